"""The CUDA stand-in on the paths that GPU-written programs from outside the project take (issue 22).

Each test is a small program of our own, in the GPU style, that exercises a path one of pytorch/examples'
programs failed on: composite factories (``torch.arange``/``torch.eye`` on ``cuda``), DTensor's fake-tensor
shape propagation on several ranks at once (sequence parallelism), DTensor's random operators on a
sharded parameter (FSDP2's meta-device initialisation), uninitialised device memory, and the device an
``nccl`` group reports to checkpointing.  Results are compared with the same computation on plain CPU
tensors; every rank holds distinct values; every run is bounded by ``simulator.run``'s timeout.
"""
from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed as tdist

import simulator
from simulator import standin
from simulator.standin import StandInTensor

TIMEOUT = 120  # seconds, per simulated world


@pytest.fixture
def two_gpus():
    with standin.enabled(gpus_per_node=2):
        yield


# -- composite factories ----------------------------------------------------------------------------------
FACTORIES = [
    ("arange", lambda d: torch.arange(7, device=d)), ("arange.start_step", lambda d: torch.arange(1, 10, 3, device=d)),
    ("arange.float", lambda d: torch.arange(0.5, 3.0, 0.5, dtype=torch.float64, device=d)),
    ("eye", lambda d: torch.eye(3, device=d)),
    ("eye.m", lambda d: torch.eye(2, 4, device=d)), ("linspace", lambda d: torch.linspace(0, 1, 5, device=d)),
    ("fftfreq", lambda d: torch.fft.fftfreq(6, device=d)), ("hann", lambda d: torch.hann_window(5, device=d)),
    ("full", lambda d: torch.full((2, 3), 1.5, device=d)), ("zeros", lambda d: torch.zeros(2, 2, device=d)),
]


@pytest.mark.parametrize("make", [m for _, m in FACTORIES], ids=[n for n, _ in FACTORIES])
def test_composite_factories_give_the_cpu_values_on_the_device(two_gpus, make):
    torch.cuda.set_device(1)
    got, want = make("cuda"), make("cpu")
    assert isinstance(got, StandInTensor) and got.device == torch.device("cuda", 1)
    assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got.cpu(), want)
    assert torch.equal(torch.outer(got.flatten(), got.flatten()).cpu(), torch.outer(want.flatten(), want.flatten()))


def test_every_composite_aten_factory_is_registered():
    """A new torch release may add a composite factory: it must join ops.COMPOSITE_FACTORIES."""
    from simulator.standin.ops import COMPOSITE_FACTORIES

    found = set()
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        base, _, overload = name[6:].partition(".")
        packet = getattr(torch.ops.aten, base, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is None:
            continue
        args = op._schema.arguments
        if any(a.name == "device" for a in args) and not any("Tensor" in str(a.type) for a in args) \
                and torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd") \
                and "sparse" not in name:
            found.add(name[6:])
    assert found <= set(COMPOSITE_FACTORIES), sorted(found - set(COMPOSITE_FACTORIES))


def test_an_out_overload_resizes_a_stand_in_as_on_a_gpu(two_gpus):
    out = torch.empty(0, device="cuda")
    torch.arange(0, 5, 1, out=out)
    assert isinstance(out, StandInTensor) and out.device == torch.device("cuda", torch.cuda.current_device())
    assert torch.equal(out.cpu(), torch.arange(0, 5, 1).to(out.dtype))


def test_in_place_reshaping_operators_keep_the_tensor_and_give_the_cpu_values(two_gpus):
    """t_, unsqueeze_, resize_ and set_ change the tensor itself (its identity, version and autograd state stay),
    as on a GPU; FullyShardedDataParallel (FSDP1) swaps its flat parameter's data with set_."""
    base = torch.arange(12.0).reshape(3, 4)
    for op in (lambda t: t.t_(), lambda t: t.unsqueeze_(1), lambda t: t.resize_(2, 6),
               lambda t: t.set_(t[1:].clone()), lambda t: t.as_strided_((2, 2), (1, 4))):
        on_gpu, on_cpu = base.to("cuda"), base.clone()
        same = op(on_gpu)
        op(on_cpu)
        assert same is on_gpu and isinstance(on_gpu, StandInTensor) and on_gpu.device == base.to("cuda").device
        assert on_gpu.shape == on_cpu.shape and on_gpu.stride() == on_cpu.stride()
        assert torch.equal(on_gpu.cpu(), on_cpu)
    donor = torch.arange(10.0, device="cuda")
    p = torch.nn.Parameter(torch.zeros(4, device="cuda"))
    with torch.no_grad():
        p.set_(donor[2:6])
    assert p.data_ptr() == donor[2:].data_ptr() and p.storage_offset() == 2
    (p * torch.arange(4.0, device="cuda")).sum().backward()
    assert torch.equal(p.grad.cpu(), torch.arange(4.0)) and p.grad.device == donor.device


def test_record_stream_with_torch_dispatch_disabled(two_gpus):
    """FSDP1 records a freed buffer's stream under no_dispatch(): the call reaches the device key itself."""
    from torch.utils._mode_utils import no_dispatch

    t = torch.ones(3, device="cuda")
    with no_dispatch():
        t.record_stream(torch.cuda.current_stream())
    assert torch.equal(t.cpu(), torch.ones(3))


# -- uninitialised memory ---------------------------------------------------------------------------------
def test_uninitialised_device_memory_reads_as_zeros(two_gpus):
    junk = torch.full((4096,), float("nan"))  # freed CPU memory a fresh CPU allocation may reuse
    del junk
    base = torch.ones(3, device="cuda")
    for t in (torch.empty(4096, device="cuda"), torch.empty_strided((64, 64), (1, 64), device="cuda"),
              torch.empty_like(base), base.new_empty(4096), torch.empty_like(torch.ones(5, device="meta"),
                                                                              device="cuda")):
        assert isinstance(t, StandInTensor) and torch.equal(t.cpu(), torch.zeros(t.shape))
    with torch.device("meta"):
        lin = torch.nn.Linear(50, 40)
    lin.to_empty(device="cuda")
    assert lin.weight.device.type == "cuda" and not lin.weight.cpu().any()


# -- the devices' generators -------------------------------------------------------------------------------
def test_each_device_has_a_seed_and_offset_generator(two_gpus):
    from simulator.standin import rng

    torch.cuda.set_device(0)
    torch.manual_seed(11)  # seeds the CPU and every device
    cpu_next = torch.randn(3)
    torch.manual_seed(11)
    torch.cuda.manual_seed(5)  # the current device only; the CPU stream is untouched
    assert torch.equal(torch.randn(3), cpu_next)
    state = torch.cuda.get_rng_state()
    assert state.dtype == torch.uint8 and state.tolist() == [5] + [0] * 15  # CUDA's layout: seed, offset
    a = torch.randn(10, device="cuda")
    assert torch.cuda.get_rng_state()[8:].tolist() == [12] + [0] * 7  # 10 numbers: the offset moves by 12
    g = torch.Generator().manual_seed(rng._mix(5, 0))  # the reference: the CPU kernel at (seed 5, offset 0)
    assert torch.equal(a.cpu(), torch.randn(10, generator=g))
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.empty(10, device="cuda").normal_().cpu(), a.cpu())
    assert torch.cuda.get_rng_state(1).tolist()[:8] == list((11).to_bytes(8, "little"))  # cuda:1 kept 11
    assert not torch.equal(torch.randn(10, device="cuda:1").cpu(), a.cpu())
    torch.cuda.default_generators[1].manual_seed(5)
    assert torch.equal(torch.randn(10, device="cuda:1").cpu(), a.cpu())
    assert torch.cuda.initial_seed() == 5 and len(torch.cuda.get_rng_state_all()) == 2
    with pytest.raises(RuntimeError, match="16 bytes.*new_state=.*Fix:"):
        torch.cuda.set_rng_state(torch.get_rng_state())


def test_dropout_draws_its_mask_from_the_device_generator(two_gpus):
    from simulator.standin import rng

    torch.cuda.set_device(0)
    torch.cuda.manual_seed(9)
    x = torch.arange(1.0, 41.0)
    got = torch.nn.functional.dropout(x.to("cuda"), 0.5)
    with torch.random.fork_rng(devices=[]):  # the reference: CPU dropout with the CPU generator at (9, 0)
        torch.manual_seed(rng._mix(9, 0))
        want = torch.nn.functional.dropout(x, 0.5)
    assert torch.equal(got.cpu(), want) and 0 < int((got == 0).sum()) < 40


def _sharded_random_init():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.cuda.set_device(simulator.current_rank_state().rank)
    mesh = init_device_mesh("cuda", (2,))
    torch.manual_seed(0)
    w = distribute_tensor(torch.zeros(8, 6, device="cuda"), mesh, [Shard(0)])
    torch.nn.init.normal_(w)
    rep = distribute_tensor(torch.zeros(3, device="cuda"), mesh, [Replicate()])
    torch.nn.init.uniform_(rep)
    return w.to_local().cpu(), rep.to_local().cpu(), torch.cuda.get_rng_state().tolist()


def test_dtensor_random_ops_give_each_shard_its_own_numbers():
    """FSDP2 initialises sharded parameters through DTensor's offset arithmetic on the devices' generators."""
    from simulator.standin import rng

    got = simulator.run(_sharded_random_init, 2, devices="cuda", timeout=TIMEOUT)
    (w0, rep0, st0), (w1, rep1, st1) = got
    # the reference on the CPU: shard k is drawn at offset k * 24 (its numel), the replicated tensor at 48
    for k, w in enumerate((w0, w1)):
        assert torch.equal(w, torch.empty(4, 6).normal_(generator=torch.Generator().manual_seed(rng._mix(0, 24 * k))))
    assert torch.equal(rep0, rep1) and torch.equal(
        rep0, torch.empty(3).uniform_(generator=torch.Generator().manual_seed(rng._mix(0, 48))))
    assert st0 == st1 and st0[8:] == list((48 + 4).to_bytes(8, "little"))  # the ranks leave in step
    assert simulator.run(_sharded_random_init, 2, devices="cuda", timeout=TIMEOUT)[0][0].equal(w0)


def _meta_fsdp2_steps():
    from torch.distributed.fsdp import fully_shard

    tdist.init_process_group("nccl")
    r = tdist.get_rank()
    torch.cuda.set_device(r)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    fully_shard(model[0])
    fully_shard(model)
    model.to_empty(device="cuda")
    model[0].reset_parameters()  # model[2] is left as to_empty made it, as pytorch/examples' FSDP2 model leaves layers
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.arange(12.0, device="cuda").view(2, 6) * (r + 1)
    losses = []
    for _ in range(2):
        loss = (model(x) - 1).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.full_tensor().cpu() for p in model.parameters()]


def test_fsdp2_meta_initialisation_is_finite_and_reproducible():
    first = simulator.run(_meta_fsdp2_steps, 2, devices="cuda", timeout=TIMEOUT)
    again = simulator.run(_meta_fsdp2_steps, 2, devices="cuda", timeout=TIMEOUT)
    for (l1, p1), (l2, p2) in zip(first, again):
        assert l1 == l2 and all(torch.equal(a, b) for a, b in zip(p1, p2))
        assert all(torch.isfinite(p).all() for p in p1)
    assert first[0][0][1] != first[1][0][1]  # distinct inputs per rank
    w = first[0][1][0]
    assert not torch.equal(w[:4], w[4:])  # the two shards drew different numbers, as on GPUs


# -- DTensor's fake-tensor propagation on several ranks ------------------------------------------------------
def _sequence_parallel(x_full: torch.Tensor, w1, b1, w2, b2):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    r = simulator.current_rank_state().rank
    torch.cuda.set_device(r)
    mesh = init_device_mesh("cuda", (2,))
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    with torch.no_grad():
        for p, v in zip(model.parameters(), (w1, b1, w2, b2)):
            p.copy_(v)
    model = parallelize_module(model.to("cuda"), mesh, {"0": ColwiseParallel(input_layouts=Shard(0)),
                                                        "2": RowwiseParallel(output_layouts=Shard(0))})
    out = model(x_full.chunk(2)[r].to("cuda"))  # each rank its own rows (sequence shard)
    return str(out.device), out.detach().cpu()


def test_sequence_parallel_shards_on_each_rank_s_own_device():
    """DTensor makes its fake tensors with a bare "cuda": each rank's propagation must see its own device."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 4, generator=g)
    w1, b1, w2, b2 = (torch.randn(*s, generator=g) for s in ((6, 4), (6,), (3, 6), (3,)))
    got = simulator.run(_sequence_parallel, 2, args=(x, w1, b1, w2, b2), devices="cuda", timeout=TIMEOUT)
    want = torch.relu(x @ w1.T + b1) @ w2.T + b2  # the whole computation on plain CPU tensors
    for r, (dev, out) in enumerate(got):
        assert dev == f"cuda:{r}"
        torch.testing.assert_close(out, want.chunk(2)[r], rtol=1e-6, atol=1e-6)


def _shard_to_shard(full: torch.Tensor):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    r = simulator.current_rank_state().rank
    torch.cuda.set_device(r)
    mesh = init_device_mesh("cuda", (2,))
    d = distribute_tensor(full.to("cuda"), mesh, [Shard(0)]).redistribute(mesh, [Shard(1)])  # an all-to-all
    local = d.to_local()
    return str(local.device), local.cpu(), d.full_tensor().cpu()


def test_dtensor_shard_to_shard_redistributes_through_its_all_to_all():
    """DTensor's Shard(i) -> Shard(j) calls torch's _dtensor.shard_dim_alltoall, which calls the group's
    all-to-all: the group is handed the stand-ins' data, as for c10d's own operators."""
    full = torch.arange(24.0).reshape(4, 6)
    got = simulator.run(_shard_to_shard, 2, args=(full,), devices="cuda", timeout=TIMEOUT)
    for r, (dev, local, whole) in enumerate(got):
        assert dev == f"cuda:{r}"
        assert torch.equal(local, full.chunk(2, dim=1)[r]) and torch.equal(whole, full)


@pytest.mark.parametrize("act", [torch.nn.functional.silu, torch.nn.functional.mish])
def test_activations_whose_gradient_has_a_kernel_take_the_kernel_as_on_a_gpu(two_gpus, act):
    """silu_backward and mish_backward have a CPU kernel and a composite for other devices: a stand-in takes the
    kernel (the composite rounds differently), so gradients equal the CPU's bit for bit."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3))

    def grad(dev: str) -> torch.Tensor:
        xd = x.to(dev).requires_grad_()
        act(xd).sum().backward()
        return xd.grad.cpu()

    assert torch.equal(grad("cuda"), grad("cpu"))


def _complex_program(dev: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    a, w = torch.randn(4, dtype=torch.complex64, generator=g), torch.randn(4, dtype=torch.complex64, generator=g)
    ad, c = a.to(dev), w.to(dev).conj()  # a lazy conjugate view
    out = [ad * c, c * c, c + 1, torch._neg_view(ad) * 2, c.resolve_conj(), c.clone(), torch.exp(1j * ad)]
    x = torch.randn(3, 2, generator=g).to(dev).requires_grad_()
    z = torch.view_as_complex(x)
    torch.view_as_real(z.conj() * z * (1 + 2j) / (z + 3)).sum().backward()  # mul's backward: grad * other.conj()
    cc = w.to(dev).clone()
    cc.conj().mul_(2)  # through the conjugate view, into cc
    return [o.detach().cpu().resolve_conj().resolve_neg() for o in (*out, x.grad, cc)] + [c.is_conj()]


def test_complex_arithmetic_and_gradients_through_conjugate_views_equal_the_cpu(two_gpus):
    """conj() is a lazy view (a bit on the tensor): the stand-in carries it, so products with a conjugate, the
    complex backward (which multiplies by conjugates) and writes through the view give the CPU's values."""
    *cpu, cpu_bit = _complex_program("cpu")
    *cuda, cuda_bit = _complex_program("cuda")
    assert cpu_bit and cuda_bit
    for i, (want, got) in enumerate(zip(cpu, cuda)):
        assert torch.equal(want, got), (i, want, got)


def _inference(dev: str) -> list:
    model = torch.nn.Linear(4, 4).to(dev)  # (the module's own init: the same on both sides under one seed)
    a = torch.linspace(0, 1, 12).to(dev)
    with torch.inference_mode():
        views = [a[3], a[2:5], a.view(3, 4).t(), a.unsqueeze(0), a.detach()]
        made = model(a.view(3, 4))  # a new tensor: an inference tensor
        cache = torch.cat([made, made[:1]])  # a KV-cache's growth
        top = torch.topk(cache.sum(1), 2).indices
    return ([v.is_inference() for v in views], made.is_inference(), [v.cpu() for v in views], cache.cpu(),
            top.cpu())


def test_inference_mode_takes_views_of_normal_tensors_and_makes_inference_tensors_as_the_cpu(two_gpus):
    """In inference mode a view of a normal tensor is a normal tensor (it shares its base's version counter) and a
    new tensor is an inference tensor: KV-cache generation loops take views of their model's tensors there."""
    torch.manual_seed(0)
    cpu = _inference("cpu")
    torch.manual_seed(0)
    cuda = _inference("cuda")
    assert cpu[0] == cuda[0] == [False] * 5 and cpu[1] is cuda[1] is True
    for want, got in zip((*cpu[2], *cpu[3:]), (*cuda[2], *cuda[3:])):
        assert torch.equal(want, got)


# -- NCCL's rules ----------------------------------------------------------------------------------------------
def _nccl_group_devices() -> tuple:
    tdist.init_process_group("nccl")
    r = tdist.get_rank()
    torch.cuda.set_device(r)
    group = tdist.distributed_c10d._get_default_group()
    ok = torch.full((2,), float(r + 1), device="cuda")
    tdist.all_reduce(ok)  # CUDA tensors: fine
    try:
        tdist.all_reduce(torch.ones(2))  # a CPU tensor on an NCCL group: refused, as NCCL refuses it
        refused = "accepted"
    except RuntimeError as e:
        refused = str(e)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "_get_pg_default_device will be deprecated"
        default = tdist.distributed_c10d._get_pg_default_device()
    return [str(d) for d in group._device_types], str(default), ok.cpu().tolist(), refused


def _nccl_options_group() -> tuple:
    r = int(__import__("os").environ.get("LOCAL_RANK", simulator.current_rank_state().rank))
    torch.cuda.set_device(r)
    opts = tdist.ProcessGroupNCCL.Options()  # (Megatron's get_nccl_options)
    opts.is_high_priority_stream = True
    opts.config.cga_cluster_size = 2
    tdist.init_process_group("nccl", pg_options=opts)
    group = tdist.new_group([0, 1], pg_options=opts)
    t = torch.full((2,), float(r + 1), device="cuda")
    tdist.all_reduce(t, group=group)
    try:
        tdist.ProcessGroupNCCL(tdist.distributed_c10d._get_default_store(), r, 2)
        built = "built"
    except standin.StandInError as e:
        built = str(e)
    return t.cpu().tolist(), built


def test_nccl_options_are_accepted_for_nccl_groups_and_a_hand_built_nccl_group_is_refused():
    got = simulator.run(_nccl_options_group, 2, devices="cuda", timeout=TIMEOUT)
    for values, built in got:
        assert values == [3.0, 3.0]
        assert built.startswith("torch.distributed.ProcessGroupNCCL: a process group built from ProcessGroupNCCL")
        assert 'Fix: create the group with torch.distributed.init_process_group("nccl")' in built


def test_an_nccl_group_is_a_cuda_group_on_stand_ins():
    """NCCL registers CUDA only: checkpointing (set_model_state_dict(broadcast_from_rank0=True) into a meta model)
    asks the group for its device and must hear cuda."""
    got = simulator.run(_nccl_group_devices, 2, devices="cuda", timeout=TIMEOUT)
    assert got == [(["cuda"], "cuda", [3.0, 3.0], "No backend type associated with device type cpu")] * 2


def _two_backends(backend: str) -> tuple:
    tdist.init_process_group(backend)
    r = tdist.get_rank()
    torch.cuda.set_device(r)
    c, g = torch.full((2,), float(r)), torch.full((3,), float(r + 1), device="cuda")
    outs = [torch.empty(2) for _ in range(2)]
    # the ranks issue a CPU all_gather (gloo's) and a CUDA all_reduce (NCCL's) in opposite orders, as a checkpoint
    # saver's thread and the training loop do (dcp.async_save's recipe)
    if r == 0:
        works = [tdist.all_gather(outs, c, async_op=True), tdist.all_reduce(g, async_op=True)]
    else:
        works = [tdist.all_reduce(g, async_op=True), tdist.all_gather(outs, c, async_op=True)]
    for w in works:
        w.wait()
    tdist.barrier()
    return [o.tolist() for o in outs], g.cpu().tolist()


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_group_of_two_backends_keeps_one_sequence_per_backend(isolation):
    """"cpu:gloo,cuda:nccl" is two communicators: CPU tensors go through gloo's, CUDA tensors through NCCL's, and
    the order of one's operations never has to agree with the other's."""
    got = simulator.run(_two_backends, 2, args=("cpu:gloo,cuda:nccl",), devices="cuda", isolation=isolation,
                        timeout=TIMEOUT)
    assert got == [([[0.0, 0.0], [1.0, 1.0]], [3.0, 3.0, 3.0])] * 2
    # one backend for both devices (gloo takes CUDA tensors too) is one sequence: the orders must agree
    with pytest.raises(simulator.CollectiveMismatchError):
        simulator.run(_two_backends, 2, args=("gloo",), devices="cuda", timeout=TIMEOUT)


# -- attention: CUDA's fused operators ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype,kernel", [(torch.float32, "Efficient"), (torch.bfloat16, "Flash")])
def test_sdpa_takes_the_fused_cuda_operator_and_gives_the_cpu_result(two_gpus, dtype, kernel):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g).to(dtype).requires_grad_() for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    want.square().sum().backward()
    qc, kc, vc = (t.detach().to("cuda:1").requires_grad_() for t in (q, k, v))
    got = torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=True)
    assert got.device == torch.device("cuda", 1) and f"ScaledDotProduct{kernel}AttentionBackward" in str(got.grad_fn)
    got.square().sum().backward()
    assert torch.equal(got.detach().cpu(), want.detach())
    for a, b in ((qc, q), (kc, k), (vc, v)):
        assert a.grad.device == torch.device("cuda", 1) and torch.equal(a.grad.cpu(), b.grad)
    with pytest.raises(RuntimeError, match="same device"):
        torch.nn.functional.scaled_dot_product_attention(qc, kc.detach().to("cuda:0"), vc)


def test_sdpa_with_dropout_takes_the_memory_efficient_operator_where_cuda_takes_a_fused_one(two_gpus):
    q = torch.randn(1, 2, 4, 8, device="cuda", requires_grad=True)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    assert "ScaledDotProductEfficientAttentionBackward" in str(out.grad_fn) and out.shape == q.shape
    odd = torch.randn(1, 2, 4, 6, device="cuda", requires_grad=True)  # head size 6: no fused kernel takes it
    out = torch.nn.functional.scaled_dot_product_attention(odd, odd, odd, dropout_p=0.5)
    assert "Efficient" not in str(out.grad_fn) and "Flash" not in str(out.grad_fn) and out.shape == odd.shape


def _head_sharded_attention(q, k, v):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.cuda.set_device(simulator.current_rank_state().rank)
    mesh = init_device_mesh("cuda", (2,))
    dq, dk, dv = (distribute_tensor(t.to("cuda"), mesh, [Shard(1)]).requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
    out.square().sum().backward()
    return [t.full_tensor().cpu() for t in (out.detach(), dq.grad, dk.grad, dv.grad)]


def test_tensor_parallel_attention_shards_by_heads():
    """Tensor-parallel Llama runs SDPA on head-sharded DTensors: DTensor has rules for CUDA's fused operators only."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    got = simulator.run(_head_sharded_attention, 2, args=(q, k, v), devices="cuda", timeout=TIMEOUT)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
    out.square().sum().backward()
    for rank_result in got:
        for a, b in zip(rank_result, (out.detach(), qr.grad, kr.grad, vr.grad)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _fsdp1_steps(device: str, steps: int, how: str = "moved"):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    tdist.init_process_group("nccl" if device == "cuda" else "gloo")
    r = tdist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    if how.startswith("autowrap"):  # every Linear its own FSDP unit; the root holds no parameter of its own
        import functools

        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

        wrap = functools.partial(FSDP, auto_wrap_policy=functools.partial(size_based_auto_wrap_policy,
                                                                          min_num_params=20))
        if device == "cuda":
            torch.cuda.set_device(r)
            kw = {"device_id": torch.cuda.current_device()} if how == "autowrap_device_id" else {}
            model = wrap(model.to(r), **kw)
        else:
            model = wrap(model, device_id=torch.device("cpu"))
    elif device == "cuda" and how == "device_id":  # as PyTorch's FSDP tutorial writes it: a CPU model, a device index
        torch.cuda.set_device(r)
        model = FSDP(model, device_id=torch.cuda.current_device())
    elif device == "cuda" and how == "cpu_module":  # a CPU model, no device_id: FSDP computes on the current GPU
        torch.cuda.set_device(r)
        model = FSDP(model)
        assert model.compute_device == torch.device("cuda", r)
    elif device == "cuda" and how == "sync_states":  # each rank's own init; rank 0's broadcast by FSDP
        torch.cuda.set_device(r)
        torch.manual_seed(r)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        model = FSDP(model, device_id=torch.cuda.current_device(), sync_module_states=True)
    elif device == "cuda" and how == "cuda_after":  # an older idiom: wrap the CPU model, then move the wrapper
        torch.cuda.set_device(r)
        model = FSDP(model).cuda()
    elif device == "cuda" and how == "offload":  # CPU offload: the parameters stay on the stand-in (a warning)
        from torch.distributed.fsdp import CPUOffload

        torch.cuda.set_device(r)
        with pytest.warns(UserWarning, match=r"CPUOffload\(offload_params=True\)\) keeps the parameters"):
            model = FSDP(model.to(r), cpu_offload=CPUOffload(offload_params=True))
    elif device == "cuda":  # as GPU programs write it
        torch.cuda.set_device(r)
        model = FSDP(model.to(r))
    else:  # as CPU programs on gloo must write it
        model = FSDP(model, device_id=torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + r)  # data made on the CPU, then moved: the same on both
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(5, 6, generator=g).to(device)).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with FSDP.summon_full_params(model):
        weights = [p.detach().cpu().clone() for p in model.parameters()]
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch: state_dict_type() is being deprecated
        # FSDP1's checkpoint recipe on GPUs (on CPU ranks torch's offload frees the storage it reads: not used there)
        config = FullStateDictConfig(offload_to_cpu=device == "cuda")
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
            state = {k: (str(v.device), v.clone()) for k, v in model.state_dict().items()}
    return losses, weights, state


@pytest.mark.parametrize("how", ["moved", "device_id", "cpu_module", "cuda_after", "sync_states", "offload",
                                 "autowrap", "autowrap_device_id"])
def test_fsdp1_on_stand_ins_trains_as_on_cpu_ranks(how):
    """FullyShardedDataParallel (FSDP1) written for GPUs (nccl, set_device, .to(rank), or a CPU model with
    device_id=torch.cuda.current_device() or without a device_id, or FSDP(model).cuda(), or each rank's own
    initialisation made equal by sync_module_states=True, which CPU ranks cannot use) gives what the same model gives on CPU ranks over
    gloo, step for step (it shards and gathers its flat parameter with set_)."""
    steps = 3
    gpu = simulator.run(_fsdp1_steps, 2, args=("cuda", steps, how), devices="cuda", timeout=TIMEOUT)
    cpu = simulator.run(_fsdp1_steps, 2, args=("cpu", steps, "autowrap" if how.startswith("autowrap") else "moved"),
                        timeout=TIMEOUT)
    for (gl, gw, gs), (cl, cw, cs) in zip(gpu, cpu):
        assert gl == cl and len(gl) == steps and gl[0] != gl[-1]
        for a, b in zip(gw, cw):
            assert torch.equal(a, b)
        # a full state dict offloaded to the CPU: CPU tensors with the trained values, as on GPUs
        assert sorted(gs) == sorted(cs) and all(dev == "cpu" for dev, _ in gs.values())
        for k, (_, v) in gs.items():
            assert torch.equal(v, cs[k][1]), k


def _full_tensors():
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    r = simulator.current_rank_state().rank
    torch.cuda.set_device(r)
    mesh = init_device_mesh("cuda", (2,))
    d = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    full = d.full_tensor()  # redistribute(async_op=False): waited inside, as on a GPU
    lazy = d.redistribute(mesh, [Replicate()], async_op=True).to_local()  # waited on first use
    dropped = d.full_tensor()
    del dropped  # (FSDP2's example drops the full tensors of rank 1)
    out = torch.ops._c10d_functional.all_reduce(torch.ones(2, device="cuda"), "sum", tdist.group.WORLD.group_name)
    same = torch.ops._c10d_functional.wait_tensor(out) is out  # wait_tensor returns its argument, as on a GPU
    return (type(full).__name__, full.cpu(), isinstance(lazy, AsyncCollectiveTensor), (lazy * 1).cpu(),
            torch._C._distributed_c10d._get_work_registry_size(), same)


def test_functional_collectives_wait_as_on_a_gpu():
    """A functional collective's result is an AsyncCollectiveTensor over the stand-in (not a stand-in over one):
    DTensor waits for it where it must, and none is left in torch's registry of unwaited collectives (torch warns
    of each at exit)."""
    got = simulator.run(_full_tensors, 2, devices="cuda", timeout=TIMEOUT)
    for kind, full, lazy_is_async, lazy, unwaited, same in got:
        assert kind == "StandInTensor" and torch.equal(full, torch.arange(8.0).reshape(4, 2))
        assert lazy_is_async and torch.equal(lazy, torch.arange(8.0).reshape(4, 2))
        assert unwaited == 0 and same


def test_pinned_host_memory_is_ordinary_memory_on_stand_ins(two_gpus):
    """torch asks the accelerator for its pinned allocator (pin_memory=True factories, DDP's unused-parameter map);
    on a CPU that is ordinary memory, and every host tensor counts as pinned."""
    x = torch.arange(6.0, pin_memory=True).reshape(2, 3)
    y = torch.empty(4, pin_memory=True)
    assert x.is_pinned() and y.is_pinned() and x.device.type == "cpu"
    moved = x.to("cuda", non_blocking=True)
    assert moved.is_cuda and torch.equal(moved.cpu(), torch.arange(6.0).reshape(2, 3))


_PIN_FIRST = """
import torch
from torch.utils.data import DataLoader, TensorDataset
from simulator import standin
with standin.enabled():
    print(torch.ones(3).pin_memory().is_pinned(),
          [b.is_pinned() for (b,) in DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4, pin_memory=True)])
"""


def test_pinned_copies_report_pinned_from_a_processs_first_use():
    """On a GPU machine Tensor.pin_memory() (DataLoader(pin_memory=True)'s batches) gives pinned tensors from the
    first call; torch counts nothing as pinned before its accelerator was initialised, so enabling does that."""
    out = subprocess.run([sys.executable, "-c", _PIN_FIRST], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == "True [True, True]"


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.used, self.unused = torch.nn.Linear(4, 6), torch.nn.Linear(6, 2), torch.nn.Linear(6, 2)

    def forward(self, x):
        return self.used(torch.relu(self.body(x)))  # self.unused gets no gradient


def _ddp_unused_parameters(device: str, static_graph: bool):
    from torch.nn.parallel import DistributedDataParallel as DDP

    tdist.init_process_group("nccl" if device == "cuda" else "gloo")
    r = tdist.get_rank()
    torch.manual_seed(0)
    model = _TwoHeads()
    if device == "cuda":
        torch.cuda.set_device(r)
        model = DDP(model.to(r), device_ids=[r], find_unused_parameters=not static_graph, static_graph=static_graph)
    else:
        model = DDP(model, find_unused_parameters=not static_graph, static_graph=static_graph)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(7 + r)
    losses = []
    for _ in range(3):
        loss = model(torch.randn(5, 4, generator=g).to(device)).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().cpu().clone() for p in model.parameters()]


@pytest.mark.parametrize("static_graph", [False, True])
def test_ddp_with_unused_parameters_on_stand_ins_trains_as_on_cpu_ranks(static_graph):
    """DDP(find_unused_parameters=True) and DDP(static_graph=True) stage their used-parameter map in pinned memory
    on an accelerator: on stand-ins they train as on CPU ranks over gloo, step for step."""
    gpu = simulator.run(_ddp_unused_parameters, 2, args=("cuda", static_graph), devices="cuda", timeout=TIMEOUT)
    cpu = simulator.run(_ddp_unused_parameters, 2, args=("cpu", static_graph), timeout=TIMEOUT)
    for (gl, gw), (cl, cw) in zip(gpu, cpu):
        assert gl == cl and gl[0] != gl[-1]
        assert all(torch.equal(a, b) for a, b in zip(gw, cw))


def _sync_batch_norm(x_all: torch.Tensor):
    from torch.nn.parallel import DistributedDataParallel as DDP

    tdist.init_process_group("nccl")
    r, w = tdist.get_rank(), tdist.get_world_size()
    torch.cuda.set_device(r)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    model = DDP(torch.nn.SyncBatchNorm.convert_sync_batchnorm(model).cuda(), device_ids=[r])
    rows = len(x_all) // w
    x = x_all[r * rows:(r + 1) * rows].cuda().requires_grad_()
    y = model(x)
    (y * torch.linspace(-1, 2, y[0].numel(), device="cuda").reshape(y[0].shape)).sum().backward()
    bn = model.module[1]
    return [t.detach().cpu() for t in (y, x.grad, bn.weight.grad, bn.running_mean, bn.running_var)]


def test_sync_batch_norm_normalises_over_every_rank_s_batch():
    """SyncBatchNorm's CUDA-only operators run on stand-ins: two ranks with three samples each give what one
    BatchNorm gives over all six (DDP averages the parameter gradients over the two ranks)."""
    x_all = torch.randn(6, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    got = simulator.run(_sync_batch_norm, 2, args=(x_all,), devices="cuda", timeout=TIMEOUT)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    xr = x_all.clone().requires_grad_()
    yr = ref(xr)
    (yr * torch.linspace(-1, 2, yr[0].numel()).reshape(yr[0].shape)).sum().backward()
    for r, (y, xg, wg, rm, rv) in enumerate(got):
        rows = slice(3 * r, 3 * r + 3)
        torch.testing.assert_close(y, yr.detach()[rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xg, xr.grad[rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(wg, ref[1].weight.grad / 2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rm, ref[1].running_mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rv, ref[1].running_var, rtol=1e-6, atol=1e-6)


def _flat_all_gather(numel: int):
    tdist.init_process_group("nccl")
    r = tdist.get_rank()
    torch.cuda.set_device(r)
    out = torch.empty(1, numel, device="cuda")
    tdist.all_gather_into_tensor(out, torch.arange(3.0, device="cuda") + 10 * r)
    return out.cpu()


def test_nccl_all_gather_into_tensor_takes_any_buffer_of_the_right_size():
    """NCCL sees flat buffers: a (1, W * n) output is filled rank after rank (SyncBatchNorm relies on it); a buffer
    of another size is refused with NCCL's words."""
    got = simulator.run(_flat_all_gather, 2, args=(6,), devices="cuda", timeout=TIMEOUT)
    assert all(torch.equal(t, torch.tensor([[0.0, 1, 2, 10, 11, 12]])) for t in got)
    with pytest.raises(Exception, match="output tensor size must be equal to world_size times input tensor size"):
        simulator.run(_flat_all_gather, 2, args=(5,), devices="cuda", timeout=TIMEOUT)


@pytest.mark.parametrize("program,args", [(_ddp_unused_parameters, ("cuda", False)), (_fsdp1_steps, ("cuda", 2))],
                         ids=["ddp_unused_parameters", "fsdp1"])
def test_stand_ins_in_rank_processes_give_what_thread_ranks_give(program, args):
    """devices='cuda' with isolation='process': each rank process has its own stand-in devices, and what its
    collectives stage in and copy back is the stand-ins' CPU data; the results are the thread ranks', bit for bit."""
    threads = simulator.run(program, 2, args=args, devices="cuda", timeout=TIMEOUT)
    processes = simulator.run(program, 2, args=args, devices="cuda", isolation="process", timeout=TIMEOUT)
    for (tl, tw, *ts), (pl, pw, *ps) in zip(threads, processes):
        assert tl == pl
        assert all(torch.equal(a, b) for a, b in zip(tw, pw))
        for t, p in zip(ts, ps):  # (FSDP1's full state dict, offloaded to the CPU)
            assert sorted(t) == sorted(p) and all(torch.equal(t[k][1], p[k][1]) and t[k][0] == p[k][0] for k in t)


# -- long runs: DTensor's functional collectives, step after step ----------------------------------------------
def _tensor_parallel_steps(steps: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    r = simulator.current_rank_state().rank
    torch.cuda.set_device(r)
    mesh = init_device_mesh("cuda", (2,))
    torch.manual_seed(0)
    model = parallelize_module(torch.nn.Sequential(torch.nn.Linear(16, 64)).to("cuda"), mesh,
                               {"0": ColwiseParallel(output_layouts=Replicate())})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    held = []
    for _ in range(steps):
        model(torch.ones(32, 16, device="cuda") * (r + 1)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        held.append(torch.cuda.memory_allocated())
    try:  # a DTensor and a plain tensor in one foreach call: DTensor's own refusal, as on GPUs
        with torch.no_grad():
            torch._foreach_add_([torch.ones(2, device="cuda"), next(model.parameters())], 1)
        mixed = "accepted"
    except RuntimeError as e:
        mixed = str(e)
    return held, mixed


def test_waited_collectives_release_their_tensors_step_after_step():
    """A waited async collective's buffers are freed (the simulator once kept every one until the rank ended)."""
    for held, mixed in simulator.run(_tensor_parallel_steps, 2, args=(6,), devices="cuda", timeout=TIMEOUT):
        assert max(held[4:]) <= max(held[:4]), held  # no growth (it grew by every step's buffers)
        assert "mixed torch.Tensor and DTensor" in mixed, mixed


# -- recurrent layers: torch's fused CUDA cells, computed on the CPU ----------------------------------------
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "LSTMCell", "GRUCell"])
def test_recurrent_layers_take_the_fused_cuda_cells_and_give_the_cpu_results(two_gpus, kind, bias):
    import copy

    torch.manual_seed(3)
    cell = kind.endswith("Cell")
    layer = getattr(torch.nn, kind)(3, 5, bias=bias) if cell else getattr(torch.nn, kind)(3, 5, 2, bias=bias)
    x = torch.randn(2, 3) if cell else torch.randn(4, 2, 3)

    def loss_of(m, inp):
        out = m(inp)
        h = out[0] if isinstance(out, tuple) else out
        # (the LSTM's final cell state too: the fused backward's second incoming gradient)
        return h, (h * h).sum() + (out[1][1] * 0.5).sum() if kind == "LSTM" else (h * h).sum()

    cpu = copy.deepcopy(layer)
    h_cpu, loss_cpu = loss_of(cpu, x)
    loss_cpu.backward()
    gpu = copy.deepcopy(layer).to("cuda:1")
    h_gpu, loss_gpu = loss_of(gpu, x.to("cuda:1"))
    loss_gpu.backward()
    assert h_gpu.device == torch.device("cuda", 1)
    torch.testing.assert_close(h_gpu.cpu(), h_cpu)
    for (name, p_cpu), p_gpu in zip(cpu.named_parameters(), gpu.parameters()):
        assert p_gpu.grad.device == torch.device("cuda", 1), name
        torch.testing.assert_close(p_gpu.grad.cpu(), p_cpu.grad, msg=name)


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_packed_sequences_keep_their_lengths_on_the_cpu_and_give_the_cpu_results(two_gpus, kind):
    """CUDA's packing takes the lengths on the CPU and keeps the batch sizes there; the recurrent layers read
    them from there (pytorch/tutorials' packed-sequence models, on a GPU)."""
    import copy

    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(5)
    layer = getattr(torch.nn, kind)(4, 6, 2)
    x, lengths = torch.randn(5, 3, 4), torch.tensor([5, 3, 2])

    def run(m, inp):
        packed = pack_padded_sequence(inp, lengths)
        out, _ = m(packed)
        padded, lens = pad_packed_sequence(out)
        (padded * padded).sum().backward()
        return packed.batch_sizes, padded, lens

    cpu_inp, gpu_inp = x.clone().requires_grad_(), x.to("cuda:1").requires_grad_()
    cpu, gpu = copy.deepcopy(layer), copy.deepcopy(layer).to("cuda:1")
    want, got = run(cpu, cpu_inp), run(gpu, gpu_inp)
    assert got[0].device.type == "cpu" and got[2].device.type == "cpu"  # batch sizes and lengths, as on a GPU
    assert got[1].device == torch.device("cuda", 1) and gpu_inp.grad.device == torch.device("cuda", 1)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[2], want[2])
    torch.testing.assert_close(got[1].cpu(), want[1])
    torch.testing.assert_close(gpu_inp.grad.cpu(), cpu_inp.grad)
    for (name, p_cpu), p_gpu in zip(cpu.named_parameters(), gpu.parameters()):
        torch.testing.assert_close(p_gpu.grad.cpu(), p_cpu.grad, msg=name)


def _loss_parallel(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor):
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    torch.cuda.set_device(simulator.current_rank_state().rank)
    mesh = init_device_mesh("cuda", (2,))
    head = torch.nn.Linear(x.shape[1], w.shape[0], bias=False)
    with torch.no_grad():
        head.weight.copy_(w)
    parallelize_module(head.cuda(), mesh, ColwiseParallel(use_local_output=False))  # logits sharded by class
    with loss_parallel():
        loss = F.cross_entropy(head(x.cuda()), y.cuda())
        loss.backward()
    return loss.full_tensor().item(), head.weight.grad.full_tensor().cpu()


def test_loss_parallel_on_stand_ins_gives_the_unsharded_loss_and_gradient():
    """torchtitan's tensor-parallel loss: DTensor's handler moves a count ``.to(logits)`` below autograd, where the
    device reaches the stand-in as a positional argument."""
    g = torch.Generator().manual_seed(6)
    x, w, y = torch.randn(4, 8, generator=g), torch.randn(10, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
    got = simulator.run(_loss_parallel, 2, args=(x, y, w), devices="cuda", timeout=TIMEOUT)
    wr = w.clone().requires_grad_()
    loss = torch.nn.functional.cross_entropy(x @ wr.T, y)
    loss.backward()
    for rank_loss, grad in got:
        assert rank_loss == pytest.approx(loss.item(), rel=1e-6)
        torch.testing.assert_close(grad, wr.grad)


def test_a_device_named_by_position_below_autograd_moves_the_tensor_itself(two_gpus):
    t, x = torch.tensor([1, 2, 3, 4], device="cuda:1"), torch.randn(2, device="cuda:1")
    with torch._C._AutoDispatchBelowAutograd():
        w = t.sum().to(x)  # aten.to.device with the device positional
        c = t.to(torch.device("cpu"), torch.float64)
    assert type(w._inner) is torch.Tensor and w.device == torch.device("cuda", 1) and w.dtype == torch.float32
    assert w.item() == 10.0 and type(c) is torch.Tensor and c.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_a_parameter_others_hold_weakrefs_to_moves_to_the_device_and_keeps_them(two_gpus):
    """pipelining's tracer split and torch.export keep weakrefs to parameters that ``build_stage`` then moves to the
    GPU: on a GPU ``Module.to`` assigns ``.data``, keeping the parameter object and its weakrefs."""
    import weakref

    m = torch.nn.Linear(3, 2)
    want = m.weight.detach().clone()
    ref, weight = weakref.ref(m.weight), m.weight
    m.to("cuda:1")
    assert m.weight is weight and ref() is weight and weight.device == torch.device("cuda", 1)
    torch.testing.assert_close(weight.detach().cpu(), want)
    t = torch.ones(2)  # torch's own refusal stays for a swap that is not a move onto the device
    keep = weakref.ref(t)
    with pytest.raises(RuntimeError, match="weakref"):
        torch.utils.swap_tensors(t, torch.zeros(2))
    assert keep() is t


# -- torch.tensor: TorchScript, and stand-ins inside the data ------------------------------------------------
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_scripted_functions_calling_torch_tensor_compile_and_run(two_gpus):
    """A scripted function calling torch.tensor/as_tensor compiles while stand-ins are on (the wrappers compile as
    the aten operators they stand for) and gives the CPU result, on CPU and stand-in inputs."""
    def shift(x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor(2.0) + torch.as_tensor(1.5)

    scripted = torch.jit.script(shift)
    want = torch.arange(3.0) * 2 + 1.5
    assert torch.equal(scripted(torch.arange(3.0)), want)
    got = scripted(torch.arange(3.0, device="cuda:1"))
    assert got.device == torch.device("cuda", 1) and torch.equal(got.cpu(), want)


_OPTIM_IMPORT = """
from simulator import standin
with standin.enabled():
    from torch.distributed.optim import ZeroRedundancyOptimizer  # scripts functions calling torch.tensor on import
    print(ZeroRedundancyOptimizer.__name__)
"""


def test_torch_distributed_optim_imports_first_under_stand_ins():
    out = subprocess.run([sys.executable, "-c", _OPTIM_IMPORT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[0] == "ZeroRedundancyOptimizer"


TENSOR_DATA = [  # (name, make(a 0-d tensor on the device, the device), whether it names the device)
    ("list_on_device", lambda a, d: torch.tensor([a, 1.0], dtype=torch.float32, device=torch.device(d)), True),
    ("list", lambda a, d: torch.tensor([a, a]), False), ("as_tensor", lambda a, d: torch.as_tensor([a, 2.0]), False),
    ("nested_on_device", lambda a, d: torch.as_tensor([[a], (a * 2,)], device=d), True),
    ("int", lambda a, d: torch.tensor([a.long(), 2]), False),
    ("asarray", lambda a, d: torch.asarray([a, 5.0], device=d), True),
]


@pytest.mark.parametrize("make,on_device", [c[1:] for c in TENSOR_DATA], ids=[c[0] for c in TENSOR_DATA])
def test_torch_tensor_of_stand_ins_in_a_list_gives_the_cpu_values(two_gpus, make, on_device):
    """torch.tensor([cuda_0d, 1.0]) reads the elements' values, as on a GPU (pytorch/examples' AverageMeter does
    it); the result is on the device named (cuda:1, the current one, for a bare "cuda"), else on the CPU."""
    with torch.cuda.device(1):  # (the process's current device is back after: other tests start on cuda:0)
        want = make(torch.tensor(3.0), "cpu")
        got = make(torch.tensor(3.0, device="cuda"), "cuda")
    assert got.device == (torch.device("cuda", 1) if on_device else torch.device("cpu"))
    assert got.dtype == want.dtype and torch.equal(got.cpu(), want)


# -- NCCL's premultiplied sum ------------------------------------------------------------------------------
def _premul_sums(backend: str) -> dict:
    tdist.init_process_group(backend)
    r = tdist.get_rank()
    dev = "cuda" if "nccl" in backend else "cpu"  # ("cpu:gloo,cuda:nccl": the CUDA side is NCCL's)
    if dev == "cuda":
        torch.cuda.set_device(r)
    base = torch.arange(4.0, device=dev) + 10 * r  # distinct per rank
    out = {}
    t = base.clone()
    tdist.all_reduce(t, op=tdist.ReduceOp.PREMUL_SUM(0.5))
    out["all_reduce"] = t.cpu()
    rs = torch.empty(2, device=dev)
    tdist.reduce_scatter_tensor(rs, base.clone(), op=tdist.ReduceOp.PREMUL_SUM(0.25))
    out["reduce_scatter_tensor"] = rs.cpu()
    red = base.clone()
    tdist.reduce(red, dst=0, op=tdist.ReduceOp.PREMUL_SUM(2.0))
    out["reduce"] = red.cpu()
    return out


def test_nccl_premul_sum_scales_each_input_then_sums_and_gloo_refuses_it():
    """``ReduceOp.PREMUL_SUM(f)`` (FSDP2's gradient divide factor on NCCL): every rank's input times ``f``, summed; a
    rank that is not reduce's root keeps its input; gloo refuses the op with its own words."""
    inputs = [torch.arange(4.0) + 10 * r for r in range(2)]
    # (the CUDA tensors of a "cpu:gloo,cuda:nccl" group go to NCCL too: torchtitan's and FSDP2's mixed groups)
    for backend in ("nccl", "cpu:gloo,cuda:nccl"):
        got = simulator.run(_premul_sums, 2, args=(backend,), devices="cuda", timeout=TIMEOUT)
        for r, out in enumerate(got):
            assert torch.equal(out["all_reduce"], 0.5 * inputs[0] + 0.5 * inputs[1])
            assert torch.equal(out["reduce_scatter_tensor"], (0.25 * inputs[0] + 0.25 * inputs[1])[2 * r:2 * r + 2])
            assert torch.equal(out["reduce"], 2.0 * inputs[0] + 2.0 * inputs[1] if r == 0 else inputs[r])
    with pytest.raises(RuntimeError, match="Cannot use ReduceOp.PREMUL_SUM with Gloo"):
        simulator.run(_premul_sums, 2, args=("gloo",), timeout=TIMEOUT)


# -- NCCL's rules: its reduce ops, its dtypes; what a GPU refuses ---------------------------------------------
def _nccl_rules() -> dict:
    tdist.init_process_group("nccl")
    r = tdist.get_rank()
    torch.cuda.set_device(r)
    out: dict = {"backend": tdist.group.WORLD._get_backend(torch.device("cuda")).name()}
    for op in ("BAND", "BOR", "BXOR"):  # (ProcessGroupNCCL has no bitwise reductions; gloo has)
        with pytest.raises(ValueError) as e:
            tdist.all_reduce(torch.ones(2, dtype=torch.int32, device="cuda"), op=getattr(tdist.ReduceOp, op))
        out[op] = str(e.value)
    gloo = tdist.new_group(backend="gloo")
    t = torch.tensor([r + 1, 3])
    tdist.all_reduce(t, op=tdist.ReduceOp.BAND, group=gloo)
    out["gloo_band"] = t.tolist()
    for dt in (torch.int16, torch.uint16, torch.uint32, torch.uint64):  # (not in NCCL's dtype table)
        with pytest.raises(TypeError) as e:
            tdist.all_gather_into_tensor(torch.zeros(4, dtype=dt, device="cuda"), torch.zeros(2, dtype=dt, device="cuda"))
        out[str(dt)] = str(e.value)
    refusals = {  # (what ProcessGroupNCCL raises as each call starts)
        "bool_avg": lambda: tdist.all_reduce(torch.ones(2, dtype=torch.bool, device="cuda"), op=tdist.ReduceOp.AVG),
        "premul_int": lambda: tdist.all_reduce(torch.ones(2, dtype=torch.int64, device="cuda"),
                                               op=tdist._make_nccl_premul_sum(2.0)),
        "fnuz_sum": lambda: tdist.all_reduce(torch.ones(2).to(torch.float8_e4m3fnuz).cuda()),
        "view": lambda: tdist.all_reduce(torch.ones(3, 4, device="cuda").t()),
        "gather_into_view": lambda: tdist.all_gather_into_tensor(torch.ones(2, 4, device="cuda").t(),
                                                                 torch.ones(4, device="cuda")),
        "barrier_past_the_last_gpu": lambda: tdist.barrier(device_ids=[7]),
    }
    for key, call in refusals.items():
        with pytest.raises(Exception) as e:
            call()
        out[key] = f"{type(e.value).__name__}: {e.value}"
    mine, got = torch.full((2,), r + 5.0, device="cuda"), torch.empty(2, device="cuda")  # (NCCL sends to itself)
    for w in tdist.batch_isend_irecv([tdist.P2POp(tdist.irecv, got, r), tdist.P2POp(tdist.isend, mine, r)]):
        w.wait()
    out["to_self"] = got.tolist()
    rs_out = torch.empty(4, device="cuda")  # (NCCL's list reduce_scatter reads each input's elements, any shape)
    tdist.reduce_scatter(rs_out, [torch.full((2, 2), 1.0 + i, device="cuda") for i in range(2)])
    out["rs_shapes"] = rs_out.tolist()
    x = torch.arange(12.0, device="cuda").view(3, 4) + 100 * r  # (NCCL moves a view's storage from its first element)
    with pytest.warns(UserWarning, match="non-contiguous tensor in P2P"):
        if r == 0:
            tdist.send(x[:, :2], dst=1)
        else:
            got = torch.zeros(3, 4, device="cuda")
            tdist.recv(got[:, 1:3], src=0)
            out["p2p_view"] = got.tolist()
    cl = torch.ones(2, 3, 4, 4, device="cuda").to(memory_format=torch.channels_last)  # (dense: taken)
    tdist.all_reduce(cl)
    out["channels_last"] = cl.sum().item()
    for op in ("SUM", "AVG"):  # float8 reduces on NCCL (the CPU has no float8 arithmetic)
        x = (torch.tensor([1.0, 2.0]) * (r + 1)).to(torch.float8_e4m3fn).cuda()
        tdist.all_reduce(x, op=getattr(tdist.ReduceOp, op))
        out[f"fp8_{op}"] = x.float().tolist()
    with pytest.raises(TypeError, match="RNG state must be a torch.ByteTensor"):  # (a state loaded onto the GPU)
        torch.cuda.set_rng_state(torch.cuda.get_rng_state().cuda())
    with pytest.raises(standin.StandInError, match="no IPC handle"):
        torch.cuda.Event.from_ipc_handle(r, b"")
    return out


def test_nccl_refuses_bitwise_ops_and_dtypes_outside_its_table_before_communicating():
    for r, out in enumerate(simulator.run(_nccl_rules, 2, devices="cuda", timeout=TIMEOUT)):
        assert out["backend"] == "nccl"
        for op in ("BAND", "BOR", "BXOR"):
            assert f"Cannot use ReduceOp.{op} with NCCL" in out[op] and f"rank {r}" in out[op], out[op]
        assert out["gloo_band"] == [1 & 2, 3]
        for dt, name in ((torch.int16, "Short"), (torch.uint16, "UInt16"), (torch.uint32, "UInt32"),
                         (torch.uint64, "UInt64")):
            assert f"not supported for NCCL process group: {name}" in out[str(dt)], out[str(dt)]
        assert out["fp8_SUM"] == [3.0, 6.0] and out["fp8_AVG"] == [1.5, 3.0]
        assert out["bool_avg"].startswith("TypeError") and "Cannot use ReduceOp.AVG with boolean inputs" in out["bool_avg"]
        assert out["premul_int"].startswith("TypeError") and "PreMulSum Data type must be half" in out["premul_int"]
        assert "Float8 dtypes are not currently supported for NCCL reductions" in out["fnuz_sum"]
        for key in ("view", "gather_into_view"):
            assert out[key].startswith("ValueError") and "Tensors must be contiguous" in out[key], out[key]
        assert out["channels_last"] == 2 * 96
        assert out["to_self"] == [r + 5.0, r + 5.0]
        assert out["rs_shapes"] == [2.0 * (1 + r)] * 4
        if r == 1:  # rank 0's storage from element 0, six of them, into rank 1's storage from its view's first element
            assert out["p2p_view"] == [[0, 0, 1, 2], [3, 4, 5, 0], [0, 0, 0, 0]], out["p2p_view"]
        assert "invalid device ordinal" in out["barrier_past_the_last_gpu"], out["barrier_past_the_last_gpu"]


def _bound_to_a_device() -> str:
    import tensorplay.distributed as tpd

    r = tpd.get_rank()  # (the simulated world exists before the program joins it)
    tdist.init_process_group("nccl", device_id=torch.device("cuda", r))
    tdist.all_reduce(torch.ones(1, device=f"cuda:{r}"))  # (the bound device: taken)
    tdist.barrier()
    texts = []
    for call in (lambda: tdist.all_reduce(torch.ones(1, device=f"cuda:{1 - r}")),
                 lambda: tdist.barrier(device_ids=[1 - r])):  # (NCCL's barrier reduces a tensor on that device)
        try:
            call()
            texts.append("taken")
        except tdist.DistBackendError as e:
            texts.append(str(e))
    return texts


def test_a_group_bound_to_a_device_refuses_another_devices_tensors_as_nccl_does():
    got = simulator.run(_bound_to_a_device, 2, devices="cuda", timeout=TIMEOUT)
    for r, texts in enumerate(got):
        for text in texts:
            assert "Attempt to perform collective on tensor not on device passed to init_process_group" in text, text
            assert f"device='cuda:{1 - r}'" in text and f"device_id='cuda:{r}'" in text, text


# -- memory a rank dropped is freed when it drops it --------------------------------------------------------
def _ddp_memory() -> tuple[float, float]:
    import gc

    from torch.nn.parallel import DistributedDataParallel as DDP

    tdist.init_process_group("nccl")
    r = tdist.get_rank()
    torch.cuda.set_device(r)
    m = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).cuda()
    size = sum(p.numel() * p.element_size() for p in m.parameters())
    before = torch.cuda.memory_allocated()
    ddp = DDP(m, device_ids=[r])
    gc.collect()
    return before / size, torch.cuda.memory_allocated() / size, ddp is not None


def test_ddp_on_stand_ins_holds_its_parameters_and_buckets_only():
    """After DDP(model) a GPU holds the parameters and one model-sized gradient bucket space (about 2x the model;
    pytorch/tutorials' ZeRO recipe prints 335 MB -> 656 MB). The flat buffer DDP broadcasts its module's state
    through was kept by the simulator (the slot of the broadcast, the last offloaded kernel), so stand-ins counted
    3x."""
    for before, after, _ in simulator.run(_ddp_memory, 2, devices="cuda", timeout=TIMEOUT):
        assert before == 1.0 and 1.99 < after < 2.01, (before, after)
