"""The CUDA stand-in (issue 22): programs written for GPUs run unmodified on simulated ranks without a GPU.

Every numeric check compares against the same computation on plain CPU tensors: the stand-in computes
on the CPU, so results must agree bit for bit.
"""
from __future__ import annotations

import copy
import io
import pickle
import re
import warnings

import pytest
import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel as DDP

import simulator
from simulator import standin
from simulator.standin import StandInError, StandInTensor
from tensorplay.distributed.errors import DistBackendError

SAME_DEVICE = "Expected all tensors to be on the same device, but found at least two devices"

#: torch's own answers, read before any stand-in is on: a CPU build has none; a CUDA build (on a machine without a
#: GPU) its toolkit's and cuDNN's, which the stand-in keeps
BUILD_CUDA = torch.version.cuda
BUILD_CUDNN = torch.backends.cudnn.version()
CUDA_BUILD = BUILD_CUDA is not None


@pytest.fixture
def two_gpus():
    with standin.enabled(gpus_per_node=2):
        yield


# -- the torch.cuda surface ---------------------------------------------------------------------------
def test_device_queries_and_selection(two_gpus):
    assert torch.cuda.is_available()
    assert torch.cuda.device_count() == 2
    assert torch.cuda.current_device() == 0
    for sel, want in ((1, 1), ("cuda:0", 0), (torch.device("cuda", 1), 1), (torch.device("cuda:0"), 0)):
        torch.cuda.set_device(sel)
        assert torch.cuda.current_device() == want
    with torch.cuda.device(1):
        assert torch.cuda.current_device() == 1
        assert torch.empty(2, device="cuda").device == torch.device("cuda", 1)
    assert torch.cuda.current_device() == 0
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.set_device(2)
    for query in (torch.cuda.get_device_properties, torch.cuda.get_device_name, torch.cuda.get_device_capability):
        with pytest.raises(AssertionError, match="Invalid device id"):  # (torch's Python checks these so)
            query(2)
    assert torch.cuda.get_device_name(1) == "tensorplay CPU stand-in (cuda:1)"
    props = torch.cuda.get_device_properties(0)
    assert (props.major, props.minor, props.total_memory) == (9, 0, standin.DEFAULT_TOTAL_MEMORY)
    assert props.multi_processor_count > 0 and torch.cuda.get_device_capability() == (9, 0)
    # what MFU and bandwidth calculators read (a memory's peak: clock kHz x 2 x bus bits / 8)
    assert props.memory_clock_rate * 2 * props.memory_bus_width // 8 * 1000 > 3e12 and props.clock_rate > 1e6
    assert props.max_threads_per_block == 1024
    assert torch.cuda.is_bf16_supported()
    # NVML's readings (pynvml on a GPU machine): an idle device's
    assert [f(1) for f in (torch.cuda.utilization, torch.cuda.memory_usage, torch.cuda.temperature,
                           torch.cuda.power_draw, torch.cuda.clock_rate)] == [0] * 5
    torch.cuda.synchronize()
    torch.cuda.synchronize(1)
    assert torch.accelerator.current_accelerator() == torch.device("cuda")
    assert torch.accelerator.device_count() == 2 and torch.accelerator.is_available()
    # a CUDA build with NCCL, as programs (and DDP's bf16 hook) ask; torch's c10d module keeps its own answer
    assert tdist.is_nccl_available() and tdist.is_backend_available("nccl")
    # (on a CUDA build without a GPU: that build's own versions)
    assert torch.version.cuda == (BUILD_CUDA or "12.8") and tdist.distributed_c10d.is_nccl_available() == CUDA_BUILD
    # and cuDNN, though no operator takes a cuDNN path: an LSTM runs the CPU's kernels, without torch's warning
    assert torch.backends.cudnn.is_available() and torch.backends.cudnn.version() == (BUILD_CUDNN or 91002)
    assert torch.backends.cuda.is_built()  # (a build that names its CUDA toolkit was built with it)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lstm = torch.nn.LSTM(3, 4).to("cuda:1")
        out, _ = lstm(torch.ones(2, 1, 3, device="cuda:1"))
    assert out.device == torch.device("cuda", 1) and not torch.backends.cudnn.is_acceptable(out)


def test_a_bare_index_names_the_gpu_as_on_a_cuda_build(two_gpus):
    """``device = torch.device(local_rank)``: a CUDA build reads a bare index as the current accelerator's GPU."""
    torch.cuda.set_device(1)
    dev = torch.device(1)
    assert (str(dev), dev.type, dev.index) == ("cuda:1", "cuda", 1) and dev == torch.device("cuda", 1)
    assert type(dev) is type(torch.device("cpu")) and isinstance(dev, torch.device)
    assert pickle.loads(pickle.dumps(dev)) == dev and copy.deepcopy(dev) == dev and torch.device(dev) == dev
    buf = io.BytesIO()
    torch.save({"w": torch.arange(3.0)}, buf)
    buf.seek(0)
    loaded = torch.load(buf, map_location=dev)  # the idiom that failed while the index read as privateuseone:1
    assert loaded["w"].device == dev and torch.equal(loaded["w"].cpu(), torch.arange(3.0))
    with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
        assert torch.nn.Linear(2, 2).to(dev)(torch.ones(1, 2, device=dev)).dtype == torch.bfloat16
    # every other spelling is torch's own
    assert [str(torch.device(s)) for s in ("cpu", "meta", "cuda", "cuda:0")] == ["cpu", "meta", "cuda", "cuda:0"]
    with pytest.raises(RuntimeError, match="Device index must not be negative"):
        torch.device(-1)


def test_a_default_cuda_device_is_the_current_gpu_for_every_constructor(two_gpus):
    """``torch.set_default_device("cuda")`` / ``with torch.device("cuda")``: torch.tensor, as_tensor and asarray
    land on the current GPU, as the other factories do (they landed on cuda:0)."""
    torch.cuda.set_device(1)
    want = torch.device("cuda", 1)
    with torch.device("cuda"):
        made = [torch.tensor([1.0]), torch.as_tensor([1.0]), torch.asarray([1.0]), torch.zeros(1)]
    assert [t.device for t in made] == [want] * 4
    torch.set_default_device("cuda")
    try:
        assert torch.tensor([2.0]).device == want and torch.get_default_device() == want
        assert torch.tensor([2.0], device="cpu").device == torch.device("cpu")  # an explicit device wins
    finally:
        torch.set_default_device(None)
    assert torch.tensor([1.0]).device == torch.device("cpu")
    # under any torch function mode (flex_attention's backward runs under one) the default is read again
    class PassThrough(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with PassThrough():
        assert torch.tensor([1.0]).device == torch.device("cpu")
    torch.cuda.set_device(0)


def test_total_memory_and_device_count_are_parameters():
    with standin.enabled(gpus_per_node=3, total_memory=2 ** 30):
        assert torch.cuda.device_count() == 3
        assert torch.cuda.get_device_properties(2).total_memory == 2 ** 30
        assert torch.cuda.mem_get_info(0) == (2 ** 30 - torch.cuda.memory_reserved(0), 2 ** 30)
    with pytest.raises(ValueError, match="gpus_per_node"):
        standin.enabled(gpus_per_node=0)
    with pytest.raises(ValueError, match="total_memory"):
        standin.enabled(total_memory=-1)


def test_everything_is_restored_on_exit():
    before = (torch.cuda.is_available(), torch.cuda.device_count(), torch.Tensor.to, torch.compile, torch.device,
              torch._C._get_accelerator(), torch.accelerator.current_accelerator(), tdist.is_nccl_available(),
              torch.version.cuda, torch.backends.cudnn.is_available(), torch.backends.cudnn.version(),
              torch.backends.cuda.is_built())
    with standin.enabled():
        with standin.enabled(gpus_per_node=4):  # nested: the innermost configuration applies
            assert torch.cuda.device_count() == 4
        assert torch.cuda.device_count() == 1
        kept = torch.ones(2, device="cuda")
    after = (torch.cuda.is_available(), torch.cuda.device_count(), torch.Tensor.to, torch.compile, torch.device,
             torch._C._get_accelerator(), torch.accelerator.current_accelerator(), tdist.is_nccl_available(),
             torch.version.cuda, torch.backends.cudnn.is_available(), torch.backends.cudnn.version(),
             torch.backends.cuda.is_built())
    assert after == before
    if not CUDA_BUILD:  # (a CUDA build without a GPU answers its own: an accelerator, NCCL and cuDNN compiled in)
        assert before == (False, 0, *before[2:5], torch.device("cpu"), None, False, None, False, None, False)
    assert not standin.is_active()
    # what this build raises without the stand-in (and without a GPU)
    with pytest.raises(RuntimeError if CUDA_BUILD else AssertionError,
                       match="no NVIDIA driver" if CUDA_BUILD else "Torch not compiled with CUDA enabled"):
        torch.empty(2, device="cuda")
    assert torch.equal(kept.cpu(), torch.ones(2))  # a stand-in kept past the context still holds its data
    x = torch.ones(2, requires_grad=True)
    (x * 3).sum().backward()  # CPU autograd is untouched
    assert torch.equal(x.grad, torch.full((2,), 3.0))


def test_streams_and_events(two_gpus):
    s = torch.cuda.Stream()
    assert s.device == torch.device("cuda", 0) and s.query() and isinstance(s, torch.Stream)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    with torch.cuda.stream(s):
        assert torch.cuda.current_stream() == s
        x = torch.ones(3, device="cuda") * 2
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    x.record_stream(s)
    s.wait_stream(torch.cuda.current_stream())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    y = x @ x
    end.record(s)
    s.wait_event(end)
    end.wait()
    end.synchronize()
    assert end.query() and end.elapsed_time(end) == 0.0 and start.elapsed_time(end) >= 0.0
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        torch.cuda.Event().elapsed_time(end)
    with pytest.raises(RuntimeError, match="must be recorded"):
        torch.cuda.Event(enable_timing=True).elapsed_time(end)
    assert torch.cuda.Stream(device=1).device == torch.device("cuda", 1)
    assert y.item() == 12.0
    # priorities outside the device's range map to its nearest end, as CUDA does
    assert torch.cuda.Stream.priority_range() == (0, -5)
    assert [torch.cuda.Stream(priority=p).priority for p in (3, 0, -1, -9)] == [0, 0, -1, -5]


def test_a_stream_of_another_device_makes_its_device_current_as_cuda_does(two_gpus):
    """CUDA's set_stream selects the stream's device too; leaving the stream's context puts both back."""
    torch.cuda.set_device(0)
    s1 = torch.cuda.Stream(device=1)
    for enter in (torch.cuda.stream, lambda s: s):  # torch.cuda.stream(s) and `with s:`
        with enter(s1):
            assert torch.cuda.current_device() == 1 and torch.cuda.current_stream() == s1
            assert torch.ones(1, device="cuda").device == torch.device("cuda", 1)
        assert torch.cuda.current_device() == 0 and torch.cuda.current_stream() == torch.cuda.default_stream(0)
    torch.cuda.set_stream(s1)
    assert torch.cuda.current_device() == 1
    torch.cuda.set_stream(torch.cuda.default_stream(0))
    assert torch.cuda.current_device() == 0


def test_sync_debug_mode_is_kept_and_checked(two_gpus):
    assert torch.cuda.get_sync_debug_mode() == 0
    try:
        torch.cuda.set_sync_debug_mode("warn")
        assert torch.cuda.get_sync_debug_mode() == 1
        torch.cuda.set_sync_debug_mode(2)
        assert torch.cuda.get_sync_debug_mode() == 2
        with pytest.raises(RuntimeError, match="expected one of `default`, `warn`, `error`"):
            torch.cuda.set_sync_debug_mode("loud")
        assert torch.cuda.get_sync_debug_mode() == 2
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_memory_counters_follow_live_tensors(two_gpus):
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    a = torch.empty(1000, device="cuda")  # 4000 bytes: one 4096-byte block
    assert torch.cuda.memory_allocated() == base + 4096
    b = torch.empty(10, device="cuda")  # rounded up to 512 bytes
    assert torch.cuda.memory_allocated() == base + 4096 + 512
    v = a.view(10, 100)  # a view allocates nothing
    assert torch.cuda.memory_allocated() == base + 4096 + 512
    c = torch.empty(10, device="cuda:1")
    assert torch.cuda.memory_allocated(1) >= 512 and torch.cuda.memory_allocated(0) == base + 4608
    del a
    assert torch.cuda.memory_allocated() == base + 4608  # the view keeps the storage alive
    del v, b
    assert torch.cuda.memory_allocated() == base
    assert torch.cuda.max_memory_allocated() == base + 4608
    assert torch.cuda.memory_reserved() >= base + 4608
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == base
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == base
    stats = torch.cuda.memory_stats()
    assert stats["allocated_bytes.all.current"] == base and stats["allocation.all.allocated"] >= 2
    assert "PyTorch CUDA memory summary, device ID 0" in torch.cuda.memory_summary()
    del c


def test_accelerator_memory_functions_answer_as_torch_cuda(two_gpus):
    """torch.accelerator's memory functions give the stand-in's counters, as torch.cuda's do (on a GPU they are the
    same allocator's)."""
    acc = torch.accelerator
    a, b = torch.empty(1000, device="cuda"), torch.empty(300, device="cuda:1")
    for dev in (None, 0, 1, "cuda:1", torch.device("cuda", 0)):
        for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
            assert getattr(acc, name)(dev) == getattr(torch.cuda, name)(dev), (name, dev)
        assert acc.memory_stats(dev) == torch.cuda.memory_stats(dev)
    assert acc.memory_allocated(1) > 0 and acc.memory_allocated() == torch.cuda.memory_allocated(0) > 0
    del a
    acc.empty_cache()
    assert acc.memory_reserved() == torch.cuda.memory_reserved() < acc.max_memory_reserved()
    acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() == torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
    acc.reset_accumulated_memory_stats(1)
    assert acc.memory_stats(1)["allocation.all.allocated"] == 0
    del b


def test_the_allocators_other_queries_answer_as_a_gpu_s_own(two_gpus):
    """The siblings of memory_stats and set_per_process_memory_fraction that a program may call beside them."""
    a = torch.empty(1000, device="cuda:1")
    flat, nested = torch.cuda.memory_stats(1), torch.cuda.memory_stats_as_nested_dict(1)
    assert nested["allocated_bytes"]["all"]["current"] == flat["allocated_bytes.all.current"] > 0
    assert nested["num_ooms"] == flat["num_ooms"] == 0 and torch.cuda.memory_snapshot() == []
    assert torch.cuda.get_allocator_backend() == "native"
    assert torch.cuda.get_per_process_memory_fraction(1) == 1.0
    torch.cuda.set_per_process_memory_fraction(0.25, 1)
    assert torch.cuda.get_per_process_memory_fraction("cuda:1") == 0.25
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0
    host = torch.cuda.host_memory_stats()  # pinned memory is ordinary memory: no pinned allocator's blocks
    assert host["allocated_bytes.current"] == host["num_host_alloc"] == 0 and "host_alloc_time.avg" in host
    torch.cuda.reset_peak_host_memory_stats()
    torch.cuda.caching_allocator_enable(True)
    # DCP's staging pins its buffers through CUDA's runtime: registering host memory succeeds (cudaSuccess)
    from torch.cuda import _pin_memory_utils

    buf = torch.empty(64)
    _pin_memory_utils.pin_memory(buf.data_ptr(), buf.nbytes)
    _pin_memory_utils.unpin_memory(buf.data_ptr())
    del a


def test_nvidias_profiler_hooks_run_as_on_a_gpu_without_a_profiler_attached(two_gpus):
    """emit_nvtx and torch.cuda.profiler's start/stop only tell nsys/nvprof where to look: on a GPU without one
    attached they run and change nothing."""
    x = torch.arange(4.0, device="cuda")
    ctx = torch.autograd.profiler.emit_nvtx()
    with ctx:
        y = (x * 2).sum()
        with pytest.raises(RuntimeError, match="not reentrant"):
            ctx.__enter__()
    torch.cuda.profiler.start()
    torch.cuda.profiler.stop()
    with torch.cuda.profiler.profile():
        z = x.square().sum()
    torch.cuda.check_error(0)
    assert y.item() == 12.0 and z.item() == 14.0


def test_the_device_generic_event_times_and_synchronizes_on_the_stand_in(two_gpus):
    """torch.Event, torch.accelerator-style code's event: on a GPU it records, waits and times like torch.cuda.Event."""
    start, end = torch.Event(enable_timing=True), torch.Event(device="cuda:1", enable_timing=True)
    assert start.device == torch.device("cuda", 0) and end.device == torch.device("cuda", 1)
    start.record()
    (torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")).sum().item()
    end.record()
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 0.0
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        torch.Event().elapsed_time(end)
    assert type(torch.Event(device="cpu")) is TORCH_EVENT  # another device's event is torch's own


TORCH_EVENT = torch.Event  # (torch's own: this module is imported before any stand-in is enabled)
TORCH_STREAM = torch.Stream


def test_the_generic_stream_is_made_on_the_device_it_names(two_gpus):
    """``torch.Stream`` (device-generic code, ``torch.accelerator``): on the current GPU without an index, on the one
    named with it, current inside ``with``, as torch builds a CUDA stream; a stream of another device is torch's."""
    torch.cuda.set_device(1)
    assert [torch.Stream(device=d).device for d in (None, "cuda", "cuda:0", 0, torch.device("cuda", 1))] == \
        [torch.device("cuda", i) for i in (1, 1, 0, 0, 1)]
    side = torch.Stream(priority=-1)
    assert isinstance(side, torch.Stream) and isinstance(torch.cuda.Stream(), torch.Stream) and side.priority == -1
    assert issubclass(torch.cuda.Stream, torch.Stream) and side.record_event().device == torch.device("cuda", 1)
    with torch.cuda.device(0):
        with side:  # its device becomes the current one, and it the current stream
            assert torch.accelerator.current_stream() == side and torch.cuda.current_device() == 1
        assert torch.cuda.current_device() == 0
    assert type(torch.Stream(device="cpu")) is TORCH_STREAM


def test_out_of_memory_names_the_limit():
    with standin.enabled(gpus_per_node=1, total_memory=1 << 20):
        keep = torch.empty(200_000, device="cuda")  # 800 kB of 1 MiB
        with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory.*total_memory"):
            torch.empty(100_000, device="cuda")
        del keep
    # more than the device holds is refused before the host allocates it (the CPU allocator's own error, or the
    # host's memory taken, before): a program's batch-size search catches CUDA's error
    with standin.enabled(gpus_per_node=1):
        for make in (lambda: torch.empty(100 << 30, device="cuda"),
                     lambda: torch.zeros(1 << 20, 1 << 20, device="cuda"),
                     lambda: torch.randn(30 << 30, device="cuda", dtype=torch.float64)):
            with pytest.raises(torch.cuda.OutOfMemoryError, match="CUDA out of memory. Tried to allocate"):
                make()
        assert torch.cuda.memory_allocated() == 0


# -- tensors --------------------------------------------------------------------------------------------
def test_factories_make_standins_on_the_named_device(two_gpus):
    torch.cuda.set_device(1)
    cases = {
        "cuda": torch.randn(2, 3, device="cuda"), "cuda:0": torch.zeros(2, device=torch.device("cuda", 0)),
        "int": torch.empty(2, device=0), "tensor": torch.tensor([1.0, 2.0], device="cuda"),
        "arange": torch.arange(4, device="cuda:0"), "full": torch.full((2,), 3.0, device="cuda"),
    }
    want = {"cuda": 1, "cuda:0": 0, "int": 0, "tensor": 1, "arange": 0, "full": 1}
    for name, t in cases.items():
        assert isinstance(t, StandInTensor) and t.is_cuda, name
        assert t.device.type == "cuda" and t.device.index == want[name], name
        assert t.get_device() == want[name]
    x = cases["cuda"]
    for like in (torch.zeros_like(x), torch.ones_like(x), torch.empty_like(x), x.new_zeros(4), x.new_tensor([1.0])):
        assert like.device == x.device and isinstance(like, StandInTensor)
    assert torch.equal(cases["tensor"].cpu(), torch.tensor([1.0, 2.0]))
    assert torch.zeros_like(x, device="cpu").device.type == "cpu"
    torch.cuda.set_device(0)


def test_operators_compute_the_cpu_results(two_gpus):
    torch.manual_seed(0)
    a, b, i = torch.randn(4, 5), torch.randn(5, 3), torch.tensor([2, 0])
    ga, gb = a.cuda(), b.to("cuda")
    ops = {
        "matmul": lambda x, y: x @ y, "add": lambda x, y: x[:, :3] + y[:4] * 2,
        "reduce": lambda x, y: (x.sum(1), x.max(0).values, x.mean()), "softmax": lambda x, y: x.softmax(-1),
        "index": lambda x, y: x[i.to(x.device)] if x.is_cuda else x[i], "cat": lambda x, y: torch.cat([x, x]),
        "where": lambda x, y: torch.where(x > 0, x, -x), "sort": lambda x, y: x.sort(1),
        "inplace": lambda x, y: x.clone().mul_(3).add_(1), "scalar": lambda x, y: x * torch.tensor(2.5),
    }
    for name, op in ops.items():
        got, want = op(ga, gb), op(a, b)
        got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
        for g, w in zip(got, want):
            assert g.device.type == "cuda", name
            assert torch.equal(g.cpu(), w), name
    assert ga.tolist() == a.tolist() and ga.sum().item() == a.sum().item()
    assert "device='cuda:0'" in repr(ga) and ga.type() == "torch.cuda.FloatTensor"


def test_standins_and_their_parameters_print_as_cuda_tensors(two_gpus):
    """torch prints a CUDA tensor as tensor(..., device='cuda:0'), wrapping and indenting by "tensor(", and a
    parameter as "Parameter containing:" above it (not as a subclass, Parameter(StandInTensor(...)))."""
    half = torch.nn.Parameter(torch.zeros(2, device="cuda").half())
    assert repr(half) == ("Parameter containing:\n"
                          "tensor([0., 0.], device='cuda:0', dtype=torch.float16, requires_grad=True)")
    frozen = torch.nn.Parameter(torch.ones(2, device="cuda:1"), requires_grad=False)
    assert str(frozen) == "Parameter containing:\ntensor([1., 1.], device='cuda:1')"
    doubled = torch.zeros(2, 2, device="cuda", dtype=torch.float64, requires_grad=True) * 2
    assert repr(doubled) == ("tensor([[0., 0.],\n        [0., 0.]], device='cuda:0', dtype=torch.float64,\n"
                             "       grad_fn=<MulBackward0>)")
    wide = torch.arange(12.0).reshape(1, 12) / 7
    cpu_lines = repr(wide).splitlines()  # (the CPU's text is the same up to the device suffix)
    assert repr(wide.cuda()).splitlines()[:-1] == cpu_lines[:-1]
    assert repr(wide.cuda()).splitlines()[-1] == cpu_lines[-1][:-1] + ", device='cuda:0')"
    assert type(half).__name__ == "StandInTensor"  # (named "tensor" only while torch prints it)


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
@pytest.mark.parametrize("targets_on", ["cuda", "cpu"])
def test_ctc_loss_takes_its_lengths_on_the_cpu_as_cuda_does(two_gpus, reduction, targets_on):
    """CUDA's ctc_loss takes its lengths as CPU tensors (and its targets on the CPU too, moving them for the user),
    with every reduction ("mean" divides by the target lengths)."""
    torch.manual_seed(0)
    log_probs = torch.randn(5, 2, 4).log_softmax(2)
    targets, lengths = torch.tensor([[1, 2], [1, 1]]), (torch.tensor([5, 4]), torch.tensor([2, 1], dtype=torch.int32))
    on_gpu = log_probs.cuda().requires_grad_()
    got = torch.nn.CTCLoss(reduction=reduction)(on_gpu, targets.to(targets_on), *lengths)
    got.sum().backward()
    on_cpu = log_probs.clone().requires_grad_()
    want = torch.nn.CTCLoss(reduction=reduction)(on_cpu, targets, *lengths)
    want.sum().backward()
    assert got.is_cuda and torch.equal(got.cpu(), want) and torch.equal(on_gpu.grad.cpu(), on_cpu.grad)
    with pytest.raises(RuntimeError, match="target_lengths must be integral"):
        torch.nn.functional.ctc_loss(on_gpu, targets.cuda(), lengths[0], lengths[1].float())


def test_sdpa_kernel_restricted_to_a_kernel_that_cannot_run_refuses_as_cuda_does(two_gpus):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.ones(2, 4, 8, 16, device="cuda")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # flash has no fp32 kernel: CUDA finds none
        with pytest.raises(RuntimeError, match="No available kernel. Aborting execution."):
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
        half = q.half()  # one flash takes
        assert torch.nn.functional.scaled_dot_product_attention(half, half, half).dtype == torch.float16
        # flash takes dropout too (a train step with flash forced): its rows still average v's rows
        v = torch.arange(8.0, device="cuda").repeat_interleave(16).reshape(1, 1, 8, 16).expand(2, 4, 8, 16).half()
        out = torch.nn.functional.scaled_dot_product_attention(half, half, v, dropout_p=0.5)
        assert out.shape == half.shape and torch.isfinite(out).all() and not torch.equal(out, v.mean(2, True) + 0 * v)
    assert torch.nn.functional.scaled_dot_product_attention(q, q, q).is_cuda  # the math kernel is back


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", ["efficient", "gqa", "dropout"])
def test_sdpa_with_a_boolean_mask_masks_where_it_is_false_on_every_kernel(two_gpus, dtype, how):
    """A bool mask keeps the scores where it is True and removes the rest, as torch's front end converts it before
    any kernel (before: the fused kernel refused it, and the math and dropout paths added it as 0/1)."""
    import math

    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    heads_kv = 1 if how == "gqa" else 2
    q = torch.randn(1, 2, 6, 8, generator=g, dtype=dtype)
    k = torch.randn(1, heads_kv, 6, 8, generator=g, dtype=dtype)
    v = torch.randn(1, heads_kv, 6, 8, generator=g, dtype=dtype)
    v[..., -1, :] = 1000.0  # the last key: a row that may not see it must not carry its value
    keep = torch.ones(6, 6, dtype=torch.bool).tril()
    kw = {"enable_gqa": how == "gqa", "dropout_p": 0.2 if how == "dropout" else 0.0}
    out = F.scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda(), attn_mask=keep.cuda(), **kw).cpu()
    assert out[..., :-1, :].abs().max() < 100  # no row before the last sees the last key
    if how == "dropout":
        return
    # the reference, written out: softmax over the kept scores only
    kk, vv = (t.float().repeat_interleave(2 // heads_kv, dim=1) for t in (k, v))
    scores = (q.float() @ kk.transpose(-2, -1) / math.sqrt(8)).masked_fill(~keep, float("-inf"))
    want = torch.softmax(scores, -1) @ vv
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2.0, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), want, **tol)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_grouped_query_attention_takes_cudas_kernel(two_gpus, causal):
    """Grouped-query attention (fewer key/value heads): CUDA's flash kernel takes it in bf16/fp16, so the result is
    the CPU's fused kernel's, bit for bit, forward and backward; fp32 has no grouped fused kernel on CUDA (flash is
    half precision only, memory-efficient attention does not group heads) and takes the math composite."""
    from simulator.standin.attention import choose

    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 16, 32, generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 16, 32, generator=g, dtype=torch.bfloat16) for _ in range(2))
    assert choose(q.cuda(), k.cuda(), v.cuda(), None, 0.0, True) == "flash"
    assert choose(q.float().cuda(), k.float().cuda(), v.float().cuda(), None, 0.0, True) == "math"
    assert choose(q.cuda(), k.cuda(), v.cuda(), None, 0.0, False) == "math"  # (heads differ without enable_gqa)
    on_cpu = [t.clone().requires_grad_() for t in (q, k, v)]
    on_gpu = [t.cuda().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*on_cpu, is_causal=causal, enable_gqa=True)
    got = F.scaled_dot_product_attention(*on_gpu, is_causal=causal, enable_gqa=True)
    assert got.is_cuda and torch.equal(got.cpu(), want)
    want.float().square().sum().backward()
    got.float().square().sum().backward()
    assert all(torch.equal(a.grad.cpu(), b.grad) for a, b in zip(on_gpu, on_cpu))


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_dropout_takes_the_memory_efficient_kernel_with_one_mask_for_forward_and_backward(two_gpus, causal):
    import math

    from simulator.standin.attention import choose

    F = torch.nn.functional
    g = torch.Generator().manual_seed(0)
    q, k, v, gout = (torch.randn(1, 2, 8, 8, generator=g) for _ in range(4))
    p = 0.3
    scores = q @ k.transpose(-2, -1) / math.sqrt(8)
    if causal:
        scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.softmax(scores, -1)
    state = torch.cuda.get_rng_state()
    # with the identity for the values the output is the dropped-out probabilities: it shows the mask drawn
    shown = F.scaled_dot_product_attention(q.cuda(), k.cuda(), torch.eye(8).expand(1, 2, 8, 8).cuda(),
                                           dropout_p=p, is_causal=causal).cpu()
    keep = shown != 0
    assert 0.5 < keep[probs > 0].float().mean() < 0.9
    assert torch.allclose(shown, probs * keep / (1 - p), atol=1e-6)
    torch.cuda.set_rng_state(state)  # the same draw again, on values that need a gradient
    qs, ks, vs = (t.cuda().requires_grad_() for t in (q, k, v))
    assert choose(qs, ks, vs, None, p, False) == "efficient"  # (CUDA's memory-efficient kernel takes dropout)
    out = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=p, is_causal=causal)
    out.backward(gout.cuda())
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    scores = qc @ kc.transpose(-2, -1) / math.sqrt(8)
    if causal:
        scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    ref = (torch.softmax(scores, -1) * keep / (1 - p)) @ vc
    ref.backward(gout)
    assert torch.allclose(out.cpu(), ref.detach(), atol=1e-5)
    for mine, want in ((qs, qc), (ks, kc), (vs, vc)):
        assert torch.allclose(mine.grad.cpu(), want.grad, atol=1e-5)


def test_legacy_constructors_read_zero_dim_standins_as_numbers(two_gpus):
    """torch.Tensor([a, b]) and torch.FloatTensor([...]) of 0-dim CUDA tensors read each with item(), as on a GPU
    (DDP's quantization hook builds torch.FloatTensor([scale, zero_point]) so); they hit a torch assert before."""
    a, b = torch.tensor(1.5, device="cuda"), torch.tensor([0.25, 3.0]).cuda().max()
    for make in (torch.Tensor, torch.FloatTensor, torch.DoubleTensor):
        got = make([a, b, 2.0])
        assert got.device.type == "cpu" and got.tolist() == [1.5, 3.0, 2.0], (make, got)


@pytest.mark.parametrize("causal", [False, True])
def test_flex_attention_runs_forward_and_backward_on_standins(two_gpus, causal):
    """flex_attention (torchtitan's, gpt-fast's attention) on stand-ins: the forward is torch's CPU result bit for
    bit, and the backward (which torch refuses for CPU tensors) equals the math attention's gradients."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 16, generator=gen) for _ in range(3))
    mask = (lambda dev: create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 128, 128, device=dev)) \
        if causal else (lambda dev: None)
    with torch.no_grad():
        want = flex_attention(q, k, v, block_mask=mask("cpu"))
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    got = flex_attention(*leaves, block_mask=mask("cuda"))
    assert isinstance(got, StandInTensor) and got.device == torch.device("cuda", 0)
    assert torch.equal(got.detach().cpu(), want)
    got.square().sum().backward()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        torch.nn.functional.scaled_dot_product_attention(*ref, is_causal=causal).square().sum().backward()
    for leaf, r in zip(leaves, ref):
        assert isinstance(leaf.grad, StandInTensor)
        torch.testing.assert_close(leaf.grad.cpu(), r.grad, rtol=1e-4, atol=1e-5)


def _tensor_parallel_attention_with_dropout():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    tdist.init_process_group("nccl")
    torch.cuda.set_device(tdist.get_rank())
    mesh = init_device_mesh("cuda", (2,))
    torch.manual_seed(0)
    sharded = [distribute_tensor(torch.randn(2, 4, 8, 16, device="cuda"), mesh, [Shard(1)]).requires_grad_()
               for _ in range(3)]  # by heads, as tensor parallel does
    out = torch.nn.functional.scaled_dot_product_attention(*sharded, dropout_p=0.1, is_causal=True)
    out.sum().backward()
    grads = [t.grad.to_local() for t in sharded]
    return out.placements, [bool(g.is_cuda and g.isfinite().all() and g.abs().sum() > 0) for g in grads]


def test_tensor_parallel_attention_with_dropout_runs_on_standins_as_on_gpus():
    # (the math composite, taken with dropout before, mixed a plain mask tensor with DTensors and failed)
    with standin.enabled(gpus_per_node=2):
        got = simulator.run(_tensor_parallel_attention_with_dropout, 2)
    from torch.distributed.tensor import Shard

    assert got == [((Shard(1),), [True, True, True])] * 2


def _cuda_in_a_forked_child(conn) -> None:
    try:
        torch.zeros(1, device="cuda")
        conn.send("ok")
    except RuntimeError as e:
        conn.send(str(e))


def test_a_child_forked_after_cuda_was_used_cannot_use_it_as_on_a_gpu(two_gpus):
    # (a DataLoader worker forked from a rank that had used its GPU: torch's "bad fork")
    import multiprocessing

    from simulator.standin.ranks import BAD_FORK

    torch.ones(1, device="cuda")
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_cuda_in_a_forked_child, args=(there,))
    child.start()
    try:
        assert here.poll(60) and here.recv() == BAD_FORK
    finally:
        child.join(30)
    assert torch.zeros(1, device="cuda").is_cuda  # (this process goes on using its devices)


def test_export_and_the_pipeline_tracer_see_standins_as_cuda_tensors(two_gpus):
    """torch.export (and pipelining's pipeline(), which exports) fakify parameters and inputs on cuda:i as a GPU's
    tensors are fakified: FakeTensors on cuda:i, views sharing their base's fake storage (before: the meta converter
    rebuilt the stand-in over a fake of its CPU tensor and refused the shared storage)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.distributed.pipelining import SplitPoint, pipeline

    torch.cuda.set_device(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).cuda()
    x = torch.randn(3, 8).cuda()
    want = model(x)
    ep = torch.export.export(model, (x,))
    assert {str(n.meta["val"].device) for n in ep.graph.nodes if n.op == "placeholder"} == {"cuda:1"}
    got = ep.module()(x)
    assert got.device == torch.device("cuda", 1) and torch.equal(got.cpu(), want.cpu())
    pipe = pipeline(model, mb_args=(x,), split_spec={"2": SplitPoint.BEGINNING})
    staged = pipe.get_stage_module(1)(pipe.get_stage_module(0)(x))
    assert pipe.num_stages == 2 and torch.equal(staged.cpu(), want.cpu())
    view = x[1:]
    with FakeTensorMode() as mode:
        fx, fv = mode.from_tensor(x), mode.from_tensor(view)
    assert isinstance(fx, FakeTensor) and fx.device == fv.device == torch.device("cuda", 1)
    assert fv.untyped_storage()._cdata == fx.untyped_storage()._cdata and fv.storage_offset() == 8


def test_device_mixing_raises_torchs_error(two_gpus):
    x = torch.ones(3, device="cuda")
    with pytest.raises(RuntimeError, match=f"^{SAME_DEVICE}, cuda:0 and cpu!$"):
        x + torch.ones(3)
    with pytest.raises(RuntimeError, match=f"^{SAME_DEVICE}, cpu and cuda:0!$"):
        torch.ones(2, 3) @ torch.ones(3, 2, device="cuda")
    with pytest.raises(RuntimeError, match=f"^{SAME_DEVICE}, cuda:0 and cuda:1!$"):
        x + torch.ones(3, device="cuda:1")
    assert torch.equal((x + torch.tensor(1.0)).cpu(), torch.full((3,), 2.0))  # 0-dim CPU: a scalar, as on CUDA
    x.copy_(torch.arange(3.0))  # copies cross devices
    assert torch.equal(x.cpu(), torch.arange(3.0))
    assert torch.equal(x[torch.tensor([2])].cpu(), torch.tensor([2.0]))  # CPU indices are accepted
    # indices on the GPU into a table on the CPU or on another GPU are refused (diffusers' alphas_cumprod[t] bug)
    idx = torch.tensor([0, 2], device="cuda")
    with pytest.raises(RuntimeError, match=r"^indices should be either on cpu or on the same device as the indexed "
                                           r"tensor \(cpu\)$"):
        torch.arange(3.0)[idx]
    with pytest.raises(RuntimeError, match=r"on the same device as the indexed tensor \(cuda:1\)$"):
        torch.arange(3.0, device="cuda:1")[idx]
    table = torch.zeros(3)
    table[idx] = 1.0  # index_put_ moves the indices to the tensor's device, on a GPU too
    assert torch.equal(table, torch.tensor([1.0, 0.0, 1.0]))
    with pytest.raises(TypeError, match="can't convert cuda:0 device type tensor to numpy"):
        x.numpy()


def test_start_up_knobs_of_gpu_programs_are_answered_and_runtime_only_calls_refused(two_gpus):
    """What GPU programs call at start-up and change no result here is kept and answered as on a GPU (the preferred
    libraries, cuFFT's plan cache, TunableOp's query and "off", CUDA-graph trees' step marker, the spin kernel);
    what needs CUDA's runtime is refused with the fix, never a raw AttributeError from a CPU build."""
    import torch.backends.cuda as tbc

    assert str(tbc.preferred_linalg_library("cusolver")) == "_LinalgBackend.Cusolver"
    assert str(tbc.preferred_linalg_library()) == "_LinalgBackend.Cusolver"
    assert str(tbc.preferred_blas_library("cublaslt")) == "_BlasBackend.Cublaslt"
    tbc.cufft_plan_cache.max_size = 0
    assert tbc.cufft_plan_cache.max_size == 0 and tbc.cufft_plan_cache[1].size == 0
    tbc.cufft_plan_cache.clear()
    assert torch.cuda.tunable.is_enabled() is False
    torch.cuda.tunable.enable(False)
    with pytest.raises(StandInError, match=r"^torch.cuda.tunable.enable: .*TunableOp.*Fix: leave TunableOp off"):
        torch.cuda.tunable.enable(True)
    with pytest.raises(StandInError, match=r"^torch.cuda.get_stream_from_external: .*Fix: use torch.cuda.Stream"):
        torch.cuda.get_stream_from_external(0)
    assert torch.cuda._sleep(1000) is None and torch.compiler.cudagraph_mark_step_begin() is None
    # invalid ordinals name the call the program made
    with pytest.raises(torch.AcceleratorError, match=r"^torch.Tensor.to: CUDA error: invalid device ordinal"):
        torch.ones(1).to("cuda:7")
    # out-of-memory errors are counted, as CUDA's allocator counts them
    before = torch.cuda.memory_stats(0)["num_ooms"]
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(standin.DEFAULT_TOTAL_MEMORY + 2 ** 30, dtype=torch.uint8, device="cuda:0")
    assert torch.cuda.memory_stats(0)["num_ooms"] == before + 2
    torch.cuda.reset_accumulated_memory_stats(0)
    assert torch.cuda.memory_stats(0)["num_ooms"] == 0


def test_sparse_tensors_are_refused_on_stand_ins_with_the_fix(two_gpus):
    """Sparse tensors on a GPU are not simulated: every way to one (a move, a factory, to_sparse, a sparse
    embedding, whose gradient would be one) is refused with the fix, never a crash of the process."""
    i, v = torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0])
    for make in (lambda: torch.sparse_coo_tensor(i, v, (2, 2)).cuda(),
                 lambda: torch.sparse_coo_tensor(i, v, (2, 2), device="cuda"),
                 lambda: torch.eye(2, device="cuda").to_sparse()):
        with pytest.raises(StandInError, match=r"sparse tensors on a GPU are not simulated.*layout='torch.sparse_coo'"
                                               r".*Fix: keep the sparse tensor"):
            make()
    with pytest.raises(StandInError, match=r"^torch.nn.functional.embedding: .*sparse=True\. Fix: use "
                                           r"nn.Embedding\(\.\.\., sparse=False\)"):
        torch.nn.Embedding(5, 2, sparse=True).cuda()(torch.tensor([1, 2], device="cuda"))
    for padding_idx in (None, 0):  # (torch's two operators of a bag)
        with pytest.raises(StandInError, match=r"^torch.nn.functional.embedding_bag: .*sparse=True\. Fix: use "
                                               r"nn.EmbeddingBag\(\.\.\., sparse=False\)"):
            torch.nn.EmbeddingBag(5, 2, sparse=True, padding_idx=padding_idx).cuda()(
                torch.tensor([[1, 2]], device="cuda"))
    bag = torch.nn.EmbeddingBag(5, 2, mode="sum").cuda()
    bag(torch.tensor([[1, 2], [2, 3]], device="cuda")).sum().backward()
    assert torch.equal(bag.weight.grad.cpu().sum(dim=1), torch.tensor([0.0, 2.0, 4.0, 2.0, 0.0]))
    dense = torch.nn.Embedding(5, 2).cuda()
    dense(torch.tensor([1, 2], device="cuda")).sum().backward()
    assert dense.weight.grad.device == torch.device("cuda", 0)
    assert torch.equal(dense.weight.grad.cpu().sum(dim=1), torch.tensor([0.0, 2.0, 2.0, 0.0, 0.0]))


def test_nested_tensors_are_refused_naming_the_encoders_switch(two_gpus):
    """nn.TransformerEncoder's evaluation fast path makes a nested tensor from the padding mask: refused with the
    switch that avoids it; without it the encoder gives the CPU's results."""
    def encode(dev: str, nested: bool) -> torch.Tensor:
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
        enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).to(dev).eval()
        x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1)).to(dev)
        mask = torch.tensor([[False] * 5, [False, False, False, True, True]]).to(dev)
        with torch.no_grad():
            return enc(x, src_key_padding_mask=mask).cpu()

    with pytest.raises(StandInError, match=r"^torch.nested: nested tensors on a GPU are not simulated.*Fix: build "
                                           r"the encoder with nn.TransformerEncoder\(\.\.\., enable_nested_tensor=False\)"):
        encode("cuda", True)
    assert torch.equal(encode("cuda", False), encode("cpu", False))


def test_conversions_copy_between_devices(two_gpus):
    x = torch.arange(4.0, device="cuda")
    for cpu in (x.cpu(), x.to("cpu"), x.to(torch.device("cpu"))):
        assert type(cpu) is torch.Tensor and cpu.device.type == "cpu"
        cpu.add_(1)
    assert torch.equal(x.cpu(), torch.arange(4.0))  # the copies did not alias
    assert x.to("cuda") is x and x.cuda() is x and x.to(0) is x and x.to("cuda:0") is x  # same device: no copy
    for other in (x.to("cuda:1"), x.cuda(1), x.to(1), x.to(torch.device("cuda", 1))):
        assert other.device == torch.device("cuda", 1) and other is not x
        other.add_(1)
    assert torch.equal(x.cpu(), torch.arange(4.0))
    assert x.to(torch.float64).dtype == torch.float64 and x.double().device == x.device


def test_views_and_inplace_alias(two_gpus):
    x = torch.zeros(2, 3, device="cuda")
    v = x.view(6)
    v.add_(1)
    assert torch.equal(x.cpu(), torch.ones(2, 3))
    assert x.t().data_ptr() == x.data_ptr()
    y = x.mul_(2)
    assert y is x and torch.equal(x.cpu(), torch.full((2, 3), 2.0))
    torch.add(x, 1, out=x)
    assert torch.equal(v.cpu(), torch.full((6,), 3.0))
    assert x.t_() is x and x.shape == (3, 2) and x.stride() == (1, 3)  # in place, as on a GPU
    assert torch.equal(x.cpu(), torch.full((2, 3), 3.0).t())


def test_autograd_gives_standin_gradients(two_gpus):
    torch.manual_seed(0)
    w0, x0 = torch.randn(4, 3), torch.randn(5, 4)
    w = w0.clone().cuda().requires_grad_()
    wc = w0.clone().requires_grad_()
    (torch.tanh(x0.cuda() @ w) ** 2).sum().backward()
    (torch.tanh(x0 @ wc) ** 2).sum().backward()
    assert isinstance(w.grad, StandInTensor) and w.grad.device == w.device
    assert torch.equal(w.grad.cpu(), wc.grad)
    (g,) = torch.autograd.grad((w * 2).sum(), w)
    assert torch.equal(g.cpu(), torch.full((4, 3), 2.0))


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.ReLU(), torch.nn.Linear(10, 5))


def _train(model: torch.nn.Module, device: str, steps: int = 3) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(20, 10, generator=g).to(device), torch.randn(20, 5, generator=g).to(device)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def test_training_equals_the_cpu_bit_for_bit(two_gpus):
    model = _mlp().to(1)
    for p in model.parameters():
        assert isinstance(p, torch.nn.Parameter) and isinstance(p, StandInTensor)
        assert p.device == torch.device("cuda", 1) and p.requires_grad
    assert all(b.is_cuda for b in _mlp().cuda().parameters())
    got, want = _train(model, "cuda:1"), _train(_mlp(), "cpu")
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_adam_norms_and_clipping_equal_the_cpu(two_gpus):
    def run(device: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.LayerNorm(10), torch.nn.GELU(),
                                    torch.nn.Linear(10, 5)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for _ in range(3):  # (dropout on a device draws from its generator: tests/test_sim_standin_programs.py)
            loss = model(torch.randn(8, 10).to(device)).square().mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
        return [p.detach().cpu() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run("cuda"), run("cpu")))


class _TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_module_to_keeps_parameter_identity_and_ties(two_gpus):
    model = _TiedLM()
    weight = model.emb.weight
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model.cuda(1)
    assert model.emb.weight is weight and model.head.weight is weight  # as param.data = ... keeps them on a GPU
    assert weight.device == torch.device("cuda", 1) and isinstance(weight, torch.nn.Parameter)
    before = weight.detach().cpu().clone()
    model.head(model.emb(torch.tensor([1, 2], device="cuda:1"))).sum().backward()
    opt.step()  # the optimizer built before .cuda() updates the moved parameter
    assert not torch.equal(weight.cpu(), before) and weight.grad.device == weight.device


def test_module_copies_and_casts(two_gpus):
    model = _mlp().cuda()
    twin = copy.deepcopy(model)
    assert isinstance(twin[0].weight, StandInTensor) and twin[0].weight.data_ptr() != model[0].weight.data_ptr()
    assert torch.equal(twin[0].weight.cpu(), model[0].weight.cpu()) and twin[0].weight.requires_grad
    model.half()
    assert model[0].weight.dtype == torch.float16 and model[0].weight.is_cuda
    assert model(torch.randn(2, 10, device="cuda").half()).dtype == torch.float16
    model.cpu()
    assert type(model[0].weight) is torch.nn.Parameter and model[0].weight.device.type == "cpu"


def test_state_dict_round_trip(two_gpus):
    model = _mlp().cuda()
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)  # weights_only: saved tagged "cuda:i", as on a GPU, so loaded onto cuda:i
    assert all(v.device == model[0].weight.device for v in loaded.values())
    fresh = torch.nn.Linear(10, 10).cuda()
    fresh.load_state_dict({k[2:]: v for k, v in loaded.items() if k.startswith("0.")})
    assert torch.equal(fresh.weight.cpu(), model[0].weight.cpu()) and fresh.weight.is_cuda


def _rounded_once(op, *tensors, **kw):
    """The product of fp16 values accumulated in fp32 and rounded to fp16 once (cuBLAS's fp16 default)."""
    return op(*(t.half().float() for t in tensors), **kw).half()


K, M = 96, 64  # at these sizes the CPU's own fp16 matrix kernels round differently from one rounding of an fp32 sum


@pytest.mark.parametrize("op,shapes", [
    (torch.mm, [(M, K), (K, M)]), (torch.bmm, [(2, M, K), (2, K, M)]), (torch.mv, [(M, K), (K,)]),
    (torch.dot, [(K,), (K,)]), (torch.addmm, [(M,), (M, K), (K, M)]),
    (torch.baddbmm, [(2, M, M), (2, M, K), (2, K, M)]), (torch.addmv, [(M,), (M, K), (K,)]),
    (torch.addbmm, [(M, M), (2, M, K), (2, K, M)])])
def test_fp16_products_accumulate_in_fp32_and_round_once(two_gpus, op, shapes):
    g = torch.Generator().manual_seed(len(shapes) * 10 + len(shapes[0]))
    cpu = [torch.randn(*s, generator=g) * 3 for s in shapes]
    got = op(*(t.half().cuda() for t in cpu))
    assert got.dtype == torch.float16 and got.is_cuda
    assert torch.equal(got.cpu(), _rounded_once(op, *cpu))
    kw = {"beta": 0.5, "alpha": 2.0} if op in (torch.addmm, torch.baddbmm, torch.addmv, torch.addbmm) else {}
    if kw:
        assert torch.equal(op(*(t.half().cuda() for t in cpu), **kw).cpu(), _rounded_once(op, *cpu, **kw))
    with pytest.raises(RuntimeError):  # mixed dtypes: the CPU's own error, as a GPU refuses them
        op(*(t.cuda() if i else t.half().cuda() for i, t in enumerate(cpu)))


def test_autocast_computes_in_bf16_on_the_cpu(two_gpus):
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    ga, gb = a.cuda(), b.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        mm, soft, lin = ga @ gb, torch.softmax(ga, -1), torch.nn.functional.linear(ga, gb.t())
    assert mm.dtype == lin.dtype == torch.bfloat16 and soft.dtype == torch.float32
    assert torch.equal(mm.cpu(), a.bfloat16() @ b.bfloat16())
    assert (ga @ gb).dtype == torch.float32  # off again after the region
    model = torch.nn.Linear(8, 3).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(ga).float().sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert model.weight.grad.dtype == torch.float32 and torch.isfinite(model.weight.cpu()).all()


def test_autocast_refuses_binary_cross_entropy_as_cuda_does(two_gpus):
    """CUDA's autocast bans F.binary_cross_entropy / nn.BCELoss (a GPU program that uses it fails on a GPU), and
    allows the logits form; outside autocast, or with it disabled, BCE runs."""
    p, y = torch.rand(4, device="cuda"), torch.ones(4, device="cuda")
    want = torch.nn.functional.binary_cross_entropy(p.cpu(), y.cpu())
    for region in (lambda: torch.autocast("cuda"), lambda: torch.autocast("cuda", dtype=torch.bfloat16)):
        with region():
            with pytest.raises(RuntimeError, match="binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast"):
                torch.nn.BCELoss()(p, y)
            assert torch.nn.functional.binary_cross_entropy_with_logits(p, y).dtype == torch.float32
            with torch.autocast("cuda", enabled=False):
                assert torch.equal(torch.nn.functional.binary_cross_entropy(p, y).cpu(), want)
    assert torch.equal(torch.nn.functional.binary_cross_entropy(p, y).cpu(), want)


def test_torchscript_modules_move_save_and_load_as_on_a_gpu(two_gpus, tmp_path):
    """A scripted or traced module moves onto the device after scripting, saves from it, and loads back onto it
    (without map_location: the devices it was saved from), computing what the CPU module computes."""
    torch.manual_seed(0)
    eager = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).eval()
    x = torch.randn(5, 4)
    want = eager(x)
    source = copy.deepcopy(eager)
    scripted = torch.jit.script(source).to("cuda:1")
    traced = torch.jit.trace(copy.deepcopy(eager), x).cuda()
    # the parameters are the eager module's objects, now on the device (a GPU's .data = keeps them); buffers are
    # replaced, as Module._apply replaces them
    assert getattr(scripted, "0").weight is source[0].weight and source[0].weight.device == torch.device("cuda", 1)
    assert getattr(scripted, "1").running_mean.is_cuda and not source[1].running_mean.is_cuda
    assert torch.equal(scripted(x.to("cuda:1")).cpu(), want) and torch.equal(traced(x.cuda()).cpu(), want)
    weight = getattr(scripted, "0").weight
    path, buf = tmp_path / "m.pt", io.BytesIO()
    torch.jit.save(scripted, path, _extra_files={"note": "kept"})
    scripted.save_to_buffer()
    torch.jit.save(traced, buf)
    assert getattr(scripted, "0").weight is weight and weight.is_cuda  # (saving leaves the module as it was)
    extra = {"note": "", "absent": ""}
    for loaded, dev in ((torch.jit.load(path, _extra_files=extra), "cuda:1"),
                        (torch.jit.load(io.BytesIO(buf.getvalue())), "cuda:0"),
                        (torch.jit.load(path, map_location="cuda:0"), "cuda:0"),
                        (torch.jit.load(path, map_location="cpu"), "cpu")):
        assert {str(t.device) for t in (*loaded.parameters(), *loaded.buffers())} == {dev}
        assert torch.equal(loaded(x.to(dev)).cpu(), want)
    assert extra == {"note": b"kept", "absent": b""}  # (the caller's files only, as torch answers)
    back = torch.jit.load(path).cpu()
    assert not getattr(back, "0").weight.is_cuda and torch.equal(back(x), want)


# -- refusals -------------------------------------------------------------------------------------------
def test_compiled_code_runs_eagerly_on_standins(two_gpus, monkeypatch):
    # a GPU-written script compiles by default (nanoGPT): on stand-ins the model keeps a compiled module's shape
    # (torch's OptimizedModule, _orig_mod, prefixed state_dict keys) and computes eagerly, saying so once
    from torch._dynamo.eval_frame import OptimizedModule

    from simulator.standin import refuse

    monkeypatch.setattr(refuse, "_warned", [False])
    model = _mlp().cuda()
    x = torch.randn(3, 10, device="cuda")
    with pytest.warns(RuntimeWarning, match="torch.compile: the CUDA stand-in runs compiled code eagerly"):
        compiled = torch.compile(model, mode="max-autotune")
    assert isinstance(compiled, OptimizedModule) and compiled._orig_mod is model
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    assert torch.equal(compiled(x).cpu(), model(x).cpu())
    ddp_shape = compiled(x).sum()
    ddp_shape.backward()
    assert model[0].weight.grad is not None and model[0].weight.grad.is_cuda
    double = torch.compile(lambda t: t * 2)  # compiled before it ever sees a stand-in: runs eagerly when it does
    assert torch.equal(double(torch.ones(2, device="cuda")).cpu(), torch.full((2,), 2.0))
    # PyTorch's compiled-optimizer recipe: no argument, the stand-ins reached through the closure; and a module
    # passed as an argument (dynamo traced both, and failed on the stand-ins' storage)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    before = model[0].weight.detach().cpu().clone()

    @torch.compile(fullgraph=False)
    def opt_step():
        opt.step()

    opt_step()
    assert not torch.equal(model[0].weight.detach().cpu(), before)
    assert torch.equal(torch.compile(lambda m, b: m(b["x"]))(model, {"x": x}).cpu(), model(x).cpu())


def test_what_cannot_be_faithful_is_refused(two_gpus):
    for graph_call in (torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.graph_pool_handle):
        with pytest.raises(StandInError, match="CUDA graph"):
            graph_call()
    with torch.library._scoped_library("standin_test", "FRAGMENT") as lib:
        lib.define("gpu_only(Tensor x) -> Tensor")
        lib.impl("gpu_only", lambda x: x, "CUDA")
        with pytest.raises(StandInError, match="GPU kernel only.*standin_test::gpu_only.*Fix: register a CPU"):
            torch.ops.standin_test.gpu_only(torch.ones(2, device="cuda"))
    for history_call in (torch.cuda.memory._record_memory_history, torch.cuda.memory._snapshot):
        with pytest.raises(StandInError, match="no caching allocator.*Fix: read torch.cuda.memory_allocated"):
            history_call()
    torch.cuda.nvtx.range_push("step")  # profiling annotations are accepted
    torch.cuda.nvtx.range_pop()
    assert torch.ones(2).pin_memory().device.type == "cpu"  # pinning is a no-op


CUDA_RUNTIME_CALLS = [
    ("current_blas_handle", lambda: torch.cuda.current_blas_handle(), "cuBLAS"),
    ("current_solver_handle", lambda: torch.cuda.current_solver_handle(), "cuSOLVER handles"),
    ("cudart", lambda: torch.cuda.cudart().cudaMemGetInfo(0), "this call"),
    ("caching_allocator_alloc", lambda: torch.cuda.caching_allocator_alloc(64), "caching allocator"),
    ("jiterator", lambda: torch.cuda.jiterator._create_jit_fn("template <typename T> T f(T x) { return x; }"),
     "jiterator"),
    ("tunable", lambda: torch.cuda.tunable.tuning_enable(True), "TunableOp"),
    ("MemPool", lambda: torch.cuda.MemPool(), "memory pools"),
    ("ExternalStream", lambda: torch.cuda.ExternalStream(0), "streams created outside torch"),
    ("nccl.all_reduce", lambda: torch.cuda.nccl.all_reduce([torch.ones(2, device="cuda:0"),
                                                            torch.ones(2, device="cuda:1")]), "single-process"),
]


@pytest.mark.parametrize("call,what", [c[1:] for c in CUDA_RUNTIME_CALLS], ids=[c[0] for c in CUDA_RUNTIME_CALLS])
def test_cuda_runtime_entry_points_are_refused_with_the_fix(two_gpus, call, what):
    """torch.cuda's entry points into CUDA's own runtime raise the stand-in's refusal, not a bare AttributeError
    about a missing torch._C binding."""
    with pytest.raises(StandInError, match=f"torch\\.cuda\\..*no CUDA runtime for .*{what}.*Fix: "):
        call()


_SEEN: dict[int, list[str]] = {}


def _functional_all_reduce():
    import torch.distributed._functional_collectives as fc

    tdist.init_process_group("nccl")
    r = tdist.get_rank()
    torch.cuda.set_device(r)
    out = fc.all_reduce(torch.full((2,), float(r + 1), device="cuda"), "sum", tdist.group.WORLD)
    out = out.wait() if hasattr(out, "wait") else out
    return str(out.device), out.cpu().tolist()


def test_device_of_names_the_standin_device_inside_functional_collectives(monkeypatch):
    from simulator.adapters.process_group import SimProcessGroup

    original = SimProcessGroup.allreduce

    def spy(self, tensors, opts=None):  # what the process group is handed, as a backend check would see it
        _SEEN.setdefault(simulator.current_rank_state().rank, []).extend(str(standin.device_of(t)) for t in tensors)
        return original(self, tensors, opts)

    _SEEN.clear()
    monkeypatch.setattr(SimProcessGroup, "allreduce", spy)  # (once for every rank: thread ranks share the class)
    with standin.enabled(gpus_per_node=2):
        out = simulator.run(_functional_all_reduce, 2)
        assert standin.device_of(torch.ones(1, device="cuda:1")) == torch.device("cuda", 1)
    assert standin.device_of(torch.ones(1)) == torch.device("cpu")
    assert out == [("cuda:0", [3.0, 3.0]), ("cuda:1", [3.0, 3.0])]
    assert _SEEN == {0: ["cuda:0"], 1: ["cuda:1"]}


# -- simulated ranks ------------------------------------------------------------------------------------
def _rank_devices():
    r = simulator.current_rank_state().rank
    fresh = torch.cuda.is_initialized()  # a new process has not touched CUDA yet
    before = torch.cuda.current_device()
    torch.cuda.set_device(r)
    x = torch.ones(1000, device="cuda")
    return fresh, torch.cuda.is_initialized(), before, torch.cuda.current_device(), str(x.device), \
        torch.cuda.memory_allocated(), torch.cuda.memory_allocated(1 - r)


@pytest.mark.parametrize("mode", ["coop", "threads"])
def test_each_rank_has_its_own_current_device_and_memory(mode):
    with standin.enabled(gpus_per_node=2):
        out = simulator.run(_rank_devices, 2, mode=mode)
    assert out == [(False, True, 0, 0, "cuda:0", 4096, 0), (False, True, 0, 1, "cuda:1", 4096, 0)]


class _Symmetric(torch.nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w.triu() + w.triu(1).transpose(-1, -2)


def _remove_a_parametrization_under_ddp(device_type: str):
    from torch.nn.utils import parametrize

    tdist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    r = tdist.get_rank()
    dev = torch.device(device_type, r) if device_type == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 3).to(dev)
    parametrize.register_parametrization(m, "weight", _Symmetric())
    original = m.parametrizations.weight.original
    ddp = DDP(m, device_ids=[r] if device_type == "cuda" else None)  # (its reducer holds the parameter)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp(torch.full((2, 3), float(r + 1), device=dev)).sum().backward()
    opt.step()
    parametrize.remove_parametrizations(m, "weight")
    return m.weight.detach().cpu(), m.weight is original and original.requires_grad


def test_removing_a_parametrization_under_ddp_sets_the_parameter_in_place_as_on_gpus():
    """remove_parametrizations writes the parametrized value into the original parameter, which keeps its identity
    (a GPU sets it in place) while DDP's reducer holds it (before: torch's swap of a subclass refused)."""
    with standin.enabled(gpus_per_node=2):
        got = simulator.run(_remove_a_parametrization_under_ddp, 2, args=("cuda",))
    want = simulator.run(_remove_a_parametrization_under_ddp, 2, args=("cpu",))
    for (w, kept), (ref, _) in zip(got, want):
        assert kept and torch.equal(w, ref) and torch.equal(w, w.t())


def _ddp_grads(use_cuda: bool, backend: str):
    tdist.init_process_group(backend)
    r = tdist.get_rank()
    model = _mlp()
    if use_cuda:
        torch.cuda.set_device(r)
        ddp = DDP(model.to(r), device_ids=[r])
    else:
        ddp = DDP(model)
    g = torch.Generator().manual_seed(r)
    x, y = torch.randn(20, 10, generator=g), torch.randn(20, 5, generator=g)
    dev = torch.device("cuda", r) if use_cuda else torch.device("cpu")
    torch.nn.functional.mse_loss(ddp(x.to(dev)), y.to(dev)).backward()
    return [(str(p.device), p.grad.cpu()) for p in ddp.parameters()]


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_ddp_on_standins_equals_cpu_ddp(backend):
    want = simulator.run(_ddp_grads, 2, args=(False, "gloo"))
    with standin.enabled(gpus_per_node=2):
        got = simulator.run(_ddp_grads, 2, args=(True, backend))
    for r in range(2):
        assert [d for d, _ in got[r]] == [f"cuda:{r}"] * 4
        assert all(torch.equal(g, w) for (_, g), (_, w) in zip(got[r], want[r]))
    # DDP averaged the two ranks' gradients: both ranks hold the same values
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got[0], got[1]))


class _TwoBranches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.b(self.a(x)) if use_b else self.a(x)


def _ddp_changing_branches(use_cuda: bool):
    """find_unused_parameters=True with a layer used on some steps only: DDP's reducer asks its C++ logger
    whether the graph is static, so the logger it holds must be alive (a segfault on stand-ins before)."""
    tdist.init_process_group("nccl" if use_cuda else "gloo")
    r = tdist.get_rank()
    torch.manual_seed(0)
    dev = torch.device("cuda", r) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(r)
    ddp = DDP(_TwoBranches().to(dev), device_ids=[r] if use_cuda else None, find_unused_parameters=True)
    # the reducer holds the logger by a C++ weak pointer: only a logger of torch's own class can be held (a
    # Python stand-in for it was converted to a temporary, freed at once: the segfault, when the memory was reused)
    assert isinstance(ddp.logger, torch._C._distributed_c10d.Logger)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    out = []
    for step in range(4):
        x = torch.full((3, 6), float(r + step)).to(dev)
        loss = ddp(x, use_b=step == 0).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out, [p.detach().cpu() for p in ddp.parameters()]


def test_ddp_find_unused_parameters_with_changing_branches_on_standins():
    want = simulator.run(_ddp_changing_branches, 2, args=(False,))
    with standin.enabled(gpus_per_node=2):
        got = simulator.run(_ddp_changing_branches, 2, args=(True,))
    for (gl, gp), (wl, wp) in zip(got, want):
        assert gl == wl and len(set(gl)) == 4
        assert all(torch.equal(x, y) for x, y in zip(gp, wp))


def _all_reduce_on(devices: tuple[int, ...], world: bool):
    """An all_reduce on ``cuda:devices[rank]``, on the default group or a new NCCL group of every rank."""
    tdist.init_process_group("nccl")
    r = tdist.get_rank()
    torch.cuda.set_device(devices[r])
    group = None if world else tdist.new_group(list(range(tdist.get_world_size())))
    x = torch.full((2,), float(r + 1), device="cuda")
    tdist.all_reduce(x, group=group)
    return x.cpu().tolist()


@pytest.mark.parametrize("world", [True, False])
def test_nccl_refuses_two_ranks_of_a_node_on_one_gpu(world):
    """The commonest torchrun mistake (no set_device(local_rank): every rank on cuda:0) fails as NCCL fails it,
    on every rank, naming the fix; ranks of different nodes may use the same index."""
    with standin.enabled(gpus_per_node=2):
        with pytest.raises(DistBackendError, match=r"Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 0"
                                                   r"(.|\n)*Fix: give each rank its own GPU"):
            simulator.run(_all_reduce_on, 2, args=((0, 0), world))
        assert simulator.run(_all_reduce_on, 2, args=((1, 0), world)) == [[3.0, 3.0]] * 2
    with standin.enabled(gpus_per_node=1):  # two nodes of one GPU each: cuda:0 on both is right
        assert simulator.run(_all_reduce_on, 2, args=((0, 0), world)) == [[3.0, 3.0]] * 2


def _p2p_by_tag(backend: str):
    """Rank 0 posts two sends, tags 1 then 2; rank 1 posts its receives tags 2 then 1.  gloo matches by tag; NCCL
    ignores tags (a pair's messages match in posting order), and has no receive from any source."""
    tdist.init_process_group(backend)
    r = tdist.get_rank()
    torch.cuda.set_device(r)
    dev = "cuda" if backend == "nccl" else "cpu"
    if r == 0:
        for w in [tdist.isend(torch.full((2,), v, device=dev), 1, tag=t) for v, t in ((1.0, 1), (2.0, 2))]:
            w.wait()
        return None
    x, y = torch.zeros(2, device=dev), torch.zeros(2, device=dev)
    for w in [tdist.irecv(x, 0, tag=2), tdist.irecv(y, 0, tag=1)]:
        w.wait()
    anysource = None
    if backend == "nccl":
        try:
            tdist.recv(torch.zeros(2, device=dev))
        except RuntimeError as e:
            anysource = str(e)
    return x[0].item(), y[0].item(), anysource


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_point_to_point_tags_are_gloos_and_ignored_by_nccl(backend):
    with standin.enabled(gpus_per_node=2):
        x, y, anysource = simulator.run(_p2p_by_tag, 2, args=(backend,), timeout=60)[1]
    if backend == "gloo":
        assert (x, y, anysource) == (2.0, 1.0, None)  # by tag
    else:
        assert (x, y) == (1.0, 2.0)  # in posting order
        assert anysource.startswith("torch.distributed.recv (group [0, 1], rank 1): Backend nccl does not support "
                                    "recvAnysource"), anysource


def _broadcast_from_outside(backend: str) -> str:
    tdist.init_process_group(backend)
    torch.cuda.set_device(tdist.get_rank())
    try:
        tdist.broadcast(torch.ones(2, device="cuda" if backend == "nccl" else "cpu"), src=5)
    except DistBackendError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_an_argument_error_names_the_class_of_the_programs_backend(backend):
    """A root rank outside the group fails before anything is sent, and the message names the process group
    class the program made (an nccl program never reads ProcessGroupGloo)."""
    with standin.enabled(gpus_per_node=2):
        said = simulator.run(_broadcast_from_outside, 2, args=(backend,), timeout=60)
    name = {"gloo": "Gloo", "nccl": "NCCL"}[backend]
    for r, text in enumerate(said):
        assert text.startswith(f"torch.distributed.ProcessGroup{name}.broadcast (group [0, 1], rank {r}): invalid "
                               f"root rank: 5"), text


def _coalesced(backend: str, async_ops: bool):
    """Megatron's shape: collectives of one kind under ``_coalescing_manager(device=...)``, waited for together."""
    tdist.init_process_group(backend)
    r, w = tdist.get_rank(), tdist.get_world_size()
    dev = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(r)
        dev = torch.device("cuda", r)
    sums = [torch.full((2,), r + 1.0, device=dev), torch.arange(3.0, device=dev) * (r + 1)]
    gathered = [torch.empty(2 * w, device=dev), torch.empty(w, device=dev)]
    scattered = [torch.empty(1, device=dev)]
    try:
        with tdist._coalescing_manager(device=dev, async_ops=async_ops) as cm:
            for t in sums:
                tdist.all_reduce(t)
        if async_ops:
            cm.wait()
        with tdist._coalescing_manager(device=dev) as cm:
            tdist.all_gather_into_tensor(gathered[0], torch.full((2,), float(r), device=dev))
            tdist.all_gather_into_tensor(gathered[1], torch.tensor([10.0 + r], device=dev))
        with tdist._coalescing_manager(device=dev) as cm:
            tdist.reduce_scatter_tensor(scattered[0], torch.arange(float(w), device=dev) + r)
    except RuntimeError as e:
        return str(e)
    return [t.cpu().tolist() for t in sums + gathered + scattered]


@pytest.mark.parametrize("async_ops", [False, True])
def test_nccl_coalescing_with_a_device_waits_for_every_operation_in_the_block(async_ops):
    """NCCL implements startCoalescing/endCoalescing: the end's work covers the block's operations (results as
    issued one by one); gloo does not implement it and says so."""
    with standin.enabled(gpus_per_node=2):
        got = simulator.run(_coalesced, 2, args=("nccl", async_ops))
    assert got == [[[3.0, 3.0], [0.0, 3.0, 6.0], [0.0, 0.0, 1.0, 1.0], [10.0, 11.0], [float(2 * r + 1)]]
                   for r in range(2)]
    refused = simulator.run(_coalesced, 2, args=("gloo", async_ops))
    assert all("backend gloo does not implement startCoalescing" in e for e in refused), refused


def _all_gather_reshaped(backend: str, case: str):
    """A list all_gather whose outputs are not of the input's shape (ml-engineering's benchmark gathers 0-dim flags
    into (1,) outputs; uneven: rank j contributes j + 1 elements)."""
    tdist.init_process_group(backend)
    r, w = tdist.get_rank(), tdist.get_world_size()
    dev = "cpu"
    if backend == "nccl":
        torch.cuda.set_device(r)
        dev = "cuda"
    if case == "scalar":
        out = [torch.zeros(1, device=dev) for _ in range(w)]
        tdist.all_gather(out, torch.tensor(10.0 * r + 1, device=dev))
    elif case == "uneven":
        out = [torch.zeros(j + 1, device=dev) for j in range(w)]
        tdist.all_gather(out, torch.arange(r + 1, device=dev) + 10.0 * r)
    else:  # "short": outputs of one shape holding fewer elements than the input
        out = [torch.zeros(1, device=dev) for _ in range(w)]
        try:
            tdist.all_gather(out, torch.zeros(2, device=dev))
        except DistBackendError as e:  # (each rank's message names its rank)
            return str(e)
    return [t.cpu().tolist() for t in out]


def _refused_by_gloo(case: str) -> str:
    try:
        _all_gather_reshaped("gloo", case)
    except DistBackendError as e:
        return str(e)
    return "not refused"


@pytest.mark.parametrize("case", ["scalar", "uneven"])
def test_nccl_list_all_gather_compares_element_counts_and_takes_uneven_sizes(case):
    """ProcessGroupNCCL::allgather gathers into one flat buffer when the outputs share a shape (only element counts
    must agree) and broadcasts rank by rank when they do not; gloo refuses both, as torch's gloo does."""
    want = [[10.0 * j + 1] for j in range(3)] if case == "scalar" else \
        [[10.0 * j + i for i in range(j + 1)] for j in range(3)]
    with standin.enabled(gpus_per_node=3):
        assert simulator.run(_all_gather_reshaped, 3, args=("nccl", case)) == [want] * 3
        for r, msg in enumerate(simulator.run(_all_gather_reshaped, 3, args=("nccl", "short"))):
            assert re.search(rf"ProcessGroupNCCL::allgather\) \(group \[0, 1, 2\], rank {r}\): each output tensor "
                             r"must hold as many elements as the input.*output_numel=1, input_numel=2.*Fix: ", msg)
    for msg in simulator.run(_refused_by_gloo, 3, args=(case,)):
        assert re.search(r"ProcessGroupGloo\.allgather.*invalid tensor size", msg)


def _one_visible_gpu_each():
    """A launcher-style script that gives each process one GPU: CUDA_VISIBLE_DEVICES=LOCAL_RANK, then cuda:0."""
    import os

    r = simulator.current_rank_state().rank
    os.environ["CUDA_VISIBLE_DEVICES"] = str(r)  # (a rank's own environment)
    count = torch.cuda.device_count()
    tdist.init_process_group("nccl")
    x = torch.full((2,), float(r + 1), device="cuda")
    tdist.all_reduce(x)
    os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"  # read once, when CUDA started: no change now
    return count, str(x.device), torch.cuda.device_count(), x.cpu().tolist()


def test_cuda_visible_devices_renumbers_a_ranks_gpus_as_cuda_does():
    with standin.enabled(gpus_per_node=2):
        out = simulator.run(_one_visible_gpu_each, 2)
    # each rank sees one GPU, its cuda:0, a different GPU of the node: NCCL's duplicate check passes
    assert out == [(1, "cuda:0", 1, [3.0, 3.0])] * 2


def _bound_device():
    r = simulator.current_rank_state().rank
    torch.cuda.set_device(r)
    tdist.init_process_group("nccl", device_id=torch.device("cuda", r))
    pg = tdist.distributed_c10d._get_default_group()
    return str(pg.bound_device_id), tdist.distributed_c10d._is_safe_to_split()


def test_init_process_group_binds_the_default_group_to_its_device_id():
    with standin.enabled(gpus_per_node=2):
        assert simulator.run(_bound_device, 2) == [("cuda:0", True), ("cuda:1", True)]


def _bf16_hook_grads():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    tdist.init_process_group("nccl")
    r = tdist.get_rank()
    torch.cuda.set_device(r)
    ddp = DDP(_mlp().cuda(), device_ids=[r])
    ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)  # refused on a build without CUDA and NCCL
    g = torch.Generator().manual_seed(r)
    x, y = torch.randn(20, 10, generator=g), torch.randn(20, 5, generator=g)
    torch.nn.functional.mse_loss(ddp(x.cuda()), y.cuda()).backward()
    return [p.grad.cpu() for p in ddp.parameters()]


def _fp16_hook_steps(device: str, builtin: bool):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    tdist.init_process_group("nccl" if device == "cuda" else "gloo")
    r = tdist.get_rank()
    if device == "cuda":
        torch.cuda.set_device(r)
    ddp = DDP(_mlp().to(device), device_ids=[r] if device == "cuda" else None)
    if builtin:  # c10d's C++ hook: it reads the allreduce future's value as a TensorList
        ddp._register_builtin_comm_hook(tdist.BuiltinCommHookType.FP16_COMPRESS)
    else:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(r)
    for _ in range(3):
        x, y = torch.randn(20, 10, generator=g).to(device), torch.randn(20, 5, generator=g).to(device)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [p.detach().cpu() for p in ddp.parameters()]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_ddp_builtin_fp16_compress_hook_trains_as_the_python_hook(device):
    """DDP's built-in FP16_COMPRESS hook (C++) gives, step for step, what torch's Python fp16_compress_hook gives,
    on CPU ranks (gloo) and on stand-ins (nccl), as real gloo processes do."""
    builtin, python = (simulator.run(_fp16_hook_steps, 2, args=(device, b), devices=device) for b in (True, False))
    assert not torch.equal(builtin[0][0], _mlp()[0].weight)  # trained
    for got, want in zip(builtin, python):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(builtin[0], builtin[1]))  # the ranks agree


def _local_grads(r: int) -> list[torch.Tensor]:
    model = _mlp()
    g = torch.Generator().manual_seed(r)
    x, y = torch.randn(20, 10, generator=g), torch.randn(20, 5, generator=g)
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def test_ddp_bf16_compress_hook_on_standins():
    with standin.enabled(gpus_per_node=2):
        got = simulator.run(_bf16_hook_grads, 2)
    # the hook's maths: each rank's gradient in bf16, divided by W, summed in bf16, back to fp32
    want = [((a.bfloat16() / 2) + (b.bfloat16() / 2)).float() for a, b in zip(_local_grads(0), _local_grads(1))]
    for r in range(2):
        assert all(torch.equal(g, w) for g, w in zip(got[r], want))


def test_cuda_checkpoints_load_onto_standins(two_gpus):
    buf = io.BytesIO()
    torch.save({"w": torch.arange(3.0)}, buf)
    buf.seek(0)
    loaded = torch.load(buf, map_location="cuda:1")
    assert isinstance(loaded["w"], StandInTensor) and loaded["w"].device == torch.device("cuda", 1)
    assert torch.equal(loaded["w"].cpu(), torch.arange(3.0))
    buf.seek(0)
    assert torch.load(buf)["w"].device.type == "cpu"  # no map_location: where it was saved


def test_a_whole_pickled_cuda_module_loads_back_onto_its_device_as_on_a_gpu(two_gpus):
    """torch.save(model) of a module on cuda:1, loaded: its parameters are parameters on cuda:1 that require grad,
    tied weights stay one, its buffers are there too, and it trains on a cuda input (before: CPU tensors)."""
    torch.cuda.set_device(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False),
                                torch.nn.BatchNorm1d(5)).cuda()
    model[0].weight = model[1].weight = torch.nn.Parameter(torch.randn(5, 4).cuda())
    buf = io.BytesIO()
    torch.save({"model": model, "step": 3}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)["model"]
    for (name, p), (_, q) in zip(loaded.named_parameters(), model.named_parameters()):
        assert isinstance(p, torch.nn.Parameter) and p.requires_grad and p.device == torch.device("cuda", 1), name
        assert torch.equal(p.cpu(), q.cpu()), name
    assert loaded[0].weight is loaded[1].weight
    assert {str(b.device) for b in loaded.buffers()} == {"cuda:1"}
    x = torch.tensor([1, 3]).cuda()
    loaded(x).sum().backward()
    assert loaded[0].weight.grad.device == torch.device("cuda", 1)


def test_checkpoints_load_through_a_map_location_moving_storages(two_gpus):
    """map_location=lambda storage, loc: storage.cuda(gpu) (PyTorch's ImageNet example) loads onto cuda:gpu."""
    state = {"w": torch.arange(3.0), "steps": [torch.tensor([4, 5])]}
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, map_location=lambda storage, loc: storage.cuda(1))
    for got, want in ((loaded["w"], state["w"]), (loaded["steps"][0], state["steps"][0])):
        assert isinstance(got, StandInTensor) and got.device == torch.device("cuda", 1)
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want)
    storage = torch.arange(4.0).untyped_storage()
    copy = storage.cuda()  # outside torch.load: a copy (a stand-in's storage is a CPU storage)
    assert copy.data_ptr() != storage.data_ptr() and bytes(copy) == bytes(storage)
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        storage.cuda(2)


def test_checkpoints_saved_on_gpus_load_onto_their_devices(two_gpus, monkeypatch):
    buf = io.BytesIO()
    with monkeypatch.context() as m:  # what torch.save writes on a GPU: storages tagged "cuda:1"
        m.setattr(torch.serialization, "location_tag", lambda storage: "cuda:1")
        torch.save({"w": torch.arange(3.0), "step": 5}, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert loaded["step"] == 5 and loaded["w"].device == torch.device("cuda", 1)
    buf.seek(0)
    moved = torch.load(buf, map_location={"cuda:1": "cuda:0"})
    assert moved["w"].device == torch.device("cuda", 0) and torch.equal(moved["w"].cpu(), torch.arange(3.0))


def test_standins_are_saved_as_a_gpus_tensors_are():
    # torch.save on a GPU tags each storage with its device; torch.load puts it back there, map_location moves it,
    # and a process without GPUs refuses the file unless told where to put it
    buf = io.BytesIO()
    with standin.enabled(gpus_per_node=2):
        w = torch.arange(6.0).reshape(2, 3).to("cuda:1")
        torch.save({"w": w, "w_t": w.t(), "cpu": torch.ones(2), "step": 3}, buf)
        buf.seek(0)
        back = torch.load(buf)
        assert back["w"].device == torch.device("cuda", 1) and back["cpu"].device.type == "cpu"
        assert torch.equal(back["w_t"].cpu(), torch.arange(6.0).reshape(2, 3).t()) and back["step"] == 3
        buf.seek(0)
        moved = torch.load(buf, map_location={"cuda:1": "cuda:0"})
        assert moved["w"].device == torch.device("cuda", 0) and torch.equal(moved["w"].cpu(), w.cpu())
        pickled = io.BytesIO()
        torch.save(w, pickled)  # a bare tensor too
        pickled.seek(0)
        assert torch.load(pickled).device == torch.device("cuda", 1)
    buf.seek(0)
    with pytest.raises(RuntimeError, match="Attempting to deserialize object on a CUDA device"):
        torch.load(buf)  # as a GPU's checkpoint on a machine without one
    buf.seek(0)
    on_cpu = torch.load(buf, map_location="cpu")
    assert on_cpu["w"].device.type == "cpu" and torch.equal(on_cpu["w"], torch.arange(6.0).reshape(2, 3))


#: optimizers of the FSDP2 step (fused ones with a tensor learning rate reach the operators torch has no Meta kernel for)
_OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
               "fused_sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
               "fused_adam_tensor_lr": lambda ps: torch.optim.Adam(ps, lr=torch.tensor(0.01), fused=True)}


def _fsdp2_step(use_cuda: bool, move_first: bool = True, optimizer: str = "sgd"):
    from torch.distributed.fsdp import fully_shard

    tdist.init_process_group("nccl" if use_cuda else "gloo")
    r = tdist.get_rank()
    if use_cuda:
        torch.cuda.set_device(r)
    model = _mlp()
    if move_first:
        model = model.to(torch.device("cuda", r) if use_cuda else "cpu")
    fully_shard(model[0])  # a CPU model is moved to the mesh's device here (param.data = param.to(device))
    fully_shard(model)
    opt = _OPTIMIZERS[optimizer](model.parameters())
    g = torch.Generator().manual_seed(r)
    x = torch.randn(4, 10, generator=g).to(model[0].weight.device)
    model(x).square().mean().backward()
    try:
        opt.step()
    except NotImplementedError as e:  # (torch's own refusal, the same on every device)
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return [(str(p.device), p.full_tensor().cpu()) for p in model.parameters()]


@pytest.mark.parametrize("move_first", [True, False])
def test_fsdp2_on_standins_equals_fsdp2_on_the_cpu(move_first):
    want = simulator.run(_fsdp2_step, 2, args=(False,))
    with standin.enabled(gpus_per_node=2):
        got = simulator.run(_fsdp2_step, 2, args=(True, move_first))
    for r in range(2):
        assert [d for d, _ in got[r]] == [f"cuda:{r}"] * 4
        assert all(torch.equal(g, w) for (_, g), (_, w) in zip(got[r], want[r]))


@pytest.mark.parametrize("optimizer", ["fused_adam_tensor_lr", "fused_sgd"])
def test_fsdp2_with_fused_optimizers_on_standins_does_what_it_does_on_the_cpu(optimizer):
    # fake mode could not run these steps on a stand-in (no Meta kernel: "func != nullptr INTERNAL ASSERT FAILED");
    # now Adam's trains as on the CPU, and SGD's is refused by DTensor, as on the CPU and on GPUs, with torch's error
    want = simulator.run(_fsdp2_step, 2, args=(False, True, optimizer))
    with standin.enabled(gpus_per_node=2):
        got = simulator.run(_fsdp2_step, 2, args=(True, True, optimizer))
    for r in range(2):
        if optimizer == "fused_sgd":
            assert got[r] == want[r] and "does not have a sharding strategy registered" in want[r], (got[r], want[r])
        else:
            assert [d for d, _ in got[r]] == [f"cuda:{r}"] * 4
            assert all(torch.equal(g, w) for (_, g), (_, w) in zip(got[r], want[r]))


# ---------------------------------------------------------------------------------------------------------------
# the world's and the command line's switch: simulator.run(devices="cuda"), python -m simulator --devices cuda
# ---------------------------------------------------------------------------------------------------------------
def _per_rank_devices() -> tuple:
    import tensorplay.distributed as tpd

    tpd.init_process_group("sim")
    r = tpd.get_rank()
    torch.cuda.set_device(r)
    x = torch.arange(4.0, device="cuda") * (r + 1)
    return torch.cuda.is_available(), torch.cuda.device_count(), str(x.device), x.cpu().tolist()


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_the_world_switch_gives_each_rank_its_stand_in_devices(isolation):
    got = simulator.run(_per_rank_devices, 3, devices="cuda", gpus_per_node=4, isolation=isolation)
    assert got == [(True, 4, f"cuda:{r}", [0.0, r + 1.0, 2 * (r + 1.0), 3 * (r + 1.0)]) for r in range(3)]
    assert not torch.cuda.is_available()  # restored after the run


class _SeesItsDevice(torch.nn.Module):
    """A DataParallel replica's forward: a tensor on "cuda" (its thread's current device), and what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + torch.arange(3, device="cuda") * 0 + torch.cuda.current_device()


def _threads_have_their_own_device_and_stream() -> tuple:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import tensorplay.distributed as tpd

    tpd.init_process_group("sim")
    r = tpd.get_rank()
    torch.cuda.set_device(r)
    seen: dict = {}

    def worker() -> None:  # a new host thread starts on device 0; its set_device is its own
        seen["start"] = torch.cuda.current_device(), str(torch.zeros(1, device="cuda").device)
        torch.cuda.set_device(1 - r)
        seen["set"] = torch.cuda.current_device()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), ThreadPoolExecutor(1) as pool:
        other = pool.submit(lambda: torch.cuda.current_stream() == s).result()
        mine = torch.cuda.current_stream() == s
    # DataParallel on one rank over both GPUs: each replica's thread on its own device, the caller's left alone
    torch.cuda.set_device(0)
    dp = torch.nn.DataParallel(_SeesItsDevice().cuda())
    outs = [dp(torch.zeros(4, 3, device="cuda"))[:, 0].cpu() - dp.module.lin.bias[0].cpu() for _ in range(5)]
    return seen, torch.cuda.current_device(), mine, other, [o.tolist() for o in outs]


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_the_current_device_and_stream_are_each_host_threads_own(isolation):
    """CUDA keeps the current device and stream per host thread: a rank's threads start on device 0 and the
    default stream, and their choices are their own (before: shared by the rank, so DataParallel's replica threads
    moved each other's and the caller's device, and failed at random with "Expected all tensors ...")."""
    got = simulator.run(_threads_have_their_own_device_and_stream, 2, devices="cuda", isolation=isolation)
    for r, (seen, after, mine, other, outs) in enumerate(got):
        assert seen == {"start": (0, "cuda:0"), "set": 1 - r} and after == 0 and mine and not other
        assert all(torch.allclose(torch.tensor(o), torch.tensor([0.0, 0.0, 1.0, 1.0])) for o in outs), outs


@pytest.mark.parametrize("kwargs,needle", [
    (dict(devices="tpu"), "devices='tpu'"),
    (dict(devices="cuda", gpus_per_node=0), "gpus_per_node=0"),
    (dict(devices="cuda", gpus_per_node=True), "gpus_per_node=True"),
])
def test_the_world_switch_is_validated_before_anything_runs(kwargs, needle):
    from tensorplay.distributed.errors import DistValueError

    with pytest.raises(DistValueError, match="Fix:") as info:
        simulator.World(2, **kwargs)
    assert needle in str(info.value)


GPU_SCRIPT = '''
import os, torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
local_rank = int(os.environ["LOCAL_RANK"])
{setup}
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)).to({dev})
ddp = DDP(model, device_ids={ids})
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
torch.manual_seed(rank)
x, y = torch.randn(20, 10).to({dev}), torch.randn(20, 5).to({dev})
for _ in range(3):
    opt.zero_grad()
    loss = nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
print(f"rank={{rank}} device={{loss.device.type}} loss={{loss.item():.8f}} w={{model[0].weight.sum().item():.8f}}")
dist.destroy_process_group()
'''


def _cli(tmp_path, name: str, text: str, *flags: str):
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / name
    script.write_text(text)
    root = Path(__file__).resolve().parents[1]
    env = {**__import__("os").environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-m", "simulator", "--nproc-per-node", "2", *flags, str(script)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)


def test_a_script_written_for_gpus_runs_unmodified_and_matches_its_cpu_edit(tmp_path):
    """The GPU-written script (set_device, nccl, .to(local_rank), device_ids) under --devices cuda prints what the
    same script edited for the CPU (gloo, no device) prints on simulated ranks, digit for digit."""
    gpu = GPU_SCRIPT.format(setup='torch.cuda.set_device(local_rank)\ndist.init_process_group("nccl")',
                            dev="local_rank", ids="[local_rank]")
    cpu = GPU_SCRIPT.format(setup='dist.init_process_group("gloo")', dev='"cpu"', ids="None")
    on_gpu = _cli(tmp_path, "gpu.py", gpu, "--devices", "cuda")
    on_cpu = _cli(tmp_path, "cpu.py", cpu)
    assert on_gpu.returncode == 0 and on_cpu.returncode == 0, on_gpu.stderr[-3000:] + on_cpu.stderr[-3000:]
    lines = lambda out: sorted(ln for ln in out.splitlines() if ln.startswith("rank="))  # noqa: E731
    assert len(lines(on_gpu.stdout)) == 2
    assert [ln.replace("device=cuda", "device=cpu") for ln in lines(on_gpu.stdout)] == lines(on_cpu.stdout)
    assert all("device=cuda" in ln for ln in lines(on_gpu.stdout))
    assert "Time stats are currently only collected" not in on_gpu.stderr  # DDP's C++ logger, quiet as on a GPU


def test_without_the_switch_a_gpu_script_fails_with_the_fix(tmp_path):
    gpu = GPU_SCRIPT.format(setup='torch.cuda.set_device(local_rank)\ndist.init_process_group("nccl")',
                            dev="local_rank", ids="[local_rank]")
    proc = _cli(tmp_path, "gpu.py", gpu)
    assert proc.returncode == 1
    assert "pass --devices cuda" in proc.stderr, proc.stderr[-3000:]


def test_cuda_generators_of_the_programs_own(two_gpus):
    # torch.Generator(device="cuda") needs a GPU build; on the stand-in it is a generator of the program's own
    torch.cuda.set_device(1)
    g = torch.Generator(device="cuda")
    assert g.device == torch.device("cuda", 1) and isinstance(g, torch.Generator)
    assert torch.Generator("cuda:0").device == torch.device("cuda", 0)
    cpu = torch.Generator()
    assert type(cpu) is torch._C.Generator and isinstance(cpu, torch.Generator) and cpu.device.type == "cpu"
    draws = []
    for _ in range(2):
        g.manual_seed(11)
        draws.append((torch.randn(4, device="cuda", generator=g), torch.randperm(6, device="cuda", generator=g),
                      torch.empty(3, device="cuda").normal_(generator=g)))
    assert all(t.device == torch.device("cuda", 1) for t in draws[0])
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(*draws))  # seeded alike, drawn alike
    assert not torch.equal(draws[0][0].cpu(), torch.randn(4, device="cuda", generator=g).cpu())  # the stream moves on
    with pytest.raises(Exception, match="invalid device ordinal|device"):
        torch.Generator(device="cuda:5")
    g.manual_seed(5)
    copy_of_g = pickle.loads(pickle.dumps(g))  # (a sampler's generator sent to a spawned DataLoader worker)
    assert copy_of_g.device == torch.device("cuda", 1)
    assert torch.equal(torch.randn(3, device="cuda", generator=copy_of_g).cpu(),
                       torch.randn(3, device="cuda", generator=g).cpu())


def test_legacy_cuda_tensor_types(two_gpus):
    torch.cuda.set_device(1)
    Tensor = torch.cuda.FloatTensor  # the old scripts' way: Tensor = torch.cuda.FloatTensor if cuda else ...
    t = Tensor(2, 3).fill_(2.0)
    assert t.device == torch.device("cuda", 1) and t.dtype == torch.float32 and t.shape == (2, 3)
    assert isinstance(t, torch.cuda.FloatTensor) and not isinstance(t, torch.cuda.LongTensor)
    assert not isinstance(torch.ones(2), torch.cuda.FloatTensor) and t.type() == "torch.cuda.FloatTensor"
    assert torch.equal(torch.cuda.LongTensor([3, 4]).cpu(), torch.tensor([3, 4]))
    assert torch.cuda.DoubleTensor(torch.Size([4])).shape == (4,) and torch.cuda.ByteTensor().numel() == 0
    assert torch.cuda.HalfTensor(2, device="cuda:0").device == torch.device("cuda", 0)
    # Tensor.type with their names or classes moves between devices as on a GPU
    assert t.type(torch.cuda.LongTensor).dtype == torch.int64 and t.type(torch.cuda.LongTensor).is_cuda
    assert t.type("torch.FloatTensor").device.type == "cpu" and t.type(torch.DoubleTensor).dtype == torch.float64
    moved = torch.arange(3.0).type(torch.cuda.DoubleTensor)
    assert moved.device == torch.device("cuda", 1) and moved.dtype == torch.float64
    assert torch.ones(2).type("torch.cuda.HalfTensor").dtype == torch.float16
    assert torch.ones(2).type(torch.float64).device.type == "cpu"  # dtypes as before


def test_a_legacy_cuda_type_as_the_default_tensor_type(two_gpus):
    """torch.set_default_tensor_type(torch.cuda.FloatTensor) (older scripts): new tensors on the current GPU."""
    torch.cuda.set_device(1)
    try:
        with pytest.warns(UserWarning, match="set_default_tensor_type\\(\\) is deprecated"):
            torch.set_default_tensor_type(torch.cuda.DoubleTensor)
        made = [torch.zeros(2), torch.tensor([1.0]), torch.nn.Linear(2, 2).weight]
        assert [(t.device, t.dtype) for t in made] == [(torch.device("cuda", 1), torch.float64)] * 3
        with pytest.raises(TypeError, match="only floating-point types"):
            torch.set_default_tensor_type(torch.cuda.LongTensor)
    finally:
        torch.set_default_tensor_type(torch.FloatTensor)  # (back to the CPU, as on a GPU build)
    assert torch.zeros(1).device == torch.device("cpu") and torch.get_default_dtype() == torch.float32
    torch.cuda.set_device(0)


def test_data_parallel_over_one_processs_standin_gpus(two_gpus):
    # nn.DataParallel scatters the batch over the process's GPUs, replicates the module, gathers on cuda:0 and
    # sums the replicas' gradients; the reference is the same module on the CPU on the whole batch
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = copy.deepcopy(ref)
    dp = torch.nn.DataParallel(model).cuda()
    x = torch.randn(7, 4)
    out = dp(x.cuda())
    out.square().sum().backward()
    ref(x).square().sum().backward()
    assert out.device == torch.device("cuda", 0) and out.shape == (7, 3)
    assert torch.allclose(out.cpu(), ref(x), atol=1e-6)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.device == torch.device("cuda", 0) and torch.allclose(p.grad.cpu(), q.grad, atol=1e-5)
    # the copies themselves, as torch.nn.parallel.comm gives them
    from torch.nn.parallel import comm

    t = torch.arange(6.0).reshape(3, 2).cuda()
    a, b = comm.broadcast(t, [0, 1])
    assert a is t and b.device == torch.device("cuda", 1) and torch.equal(b.cpu(), t.cpu())
    parts = comm.scatter(t, [0, 1], chunk_sizes=[1, 2])
    assert [p.device.index for p in parts] == [0, 1] and [p.shape[0] for p in parts] == [1, 2]
    assert torch.equal(comm.gather(parts, destination=-1), t.cpu())
    assert torch.equal(comm.reduce_add([t, t.to("cuda:1")], destination=1).cpu(), 2 * t.cpu())


def test_profiling_cuda_activity_on_stand_ins_profiles_the_cpu(two_gpus):
    """No GPU kernels to trace: CUDA activity is left out, with a warning (torch's CPU build printed a C++ stack
    trace for every operator it failed to time on CUDA); the operators are recorded as CPU activity."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.ones(4, 4, device="cuda")
    with pytest.warns(RuntimeWarning, match="no GPU kernels to trace: CUDA activity is left out"):
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    assert prof.activities == {ProfilerActivity.CPU} and prof.use_device is None
    with prof:
        (x @ x).sum()
    names = {e.key for e in prof.key_averages()}
    assert "aten::matmul" in names or "aten::mm" in names, names
