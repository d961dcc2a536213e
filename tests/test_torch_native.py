"""Unmodified torch.distributed code (DDP, FSDP2, DTensor, functional collectives) on simulated ranks.

These exercise simulator/adapters/torch_native.py, the one module that depends on
private torch hooks; they are the per-release check that the adapter still
works with the pinned torch.
"""
from __future__ import annotations

import copy
import re
import warnings
from typing import Iterator

import pytest
import torch
import torch.distributed as tdist

import simulator

from _support.torch_refusals import REFUSED_NAMES, torch_refusal
import tensorplay.distributed.errors as tdist_errors
from simulator.adapters import torch_native
from simulator.isolation import ISOLATIONS

W = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(W * 2, 5, generator=g, dtype=torch.float64),
             torch.randn(W * 2, 3, generator=g, dtype=torch.float64)) for _ in range(steps)]


def _reference(steps: int) -> list[torch.Tensor]:
    """Single process, full batch: what data parallelism must reproduce."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_ddp_three_steps_match_single_process_full_batch() -> None:
    def body() -> list[torch.Tensor]:
        tdist.init_process_group("sim")
        r = tdist.get_rank()
        model = torch.nn.parallel.DistributedDataParallel(_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _batches(3):
            xs, ys = x[2 * r:2 * r + 2], y[2 * r:2 * r + 2]  # this rank's shard of the batch
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xs), ys).backward()
            opt.step()
        tdist.destroy_process_group()
        return [p.detach().clone() for p in model.parameters()]

    ref = _reference(3)
    for rank, params in enumerate(simulator.run(body, W)):
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=f"rank {rank}")


def test_fsdp2_fully_shard_matches_single_process() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def body() -> list[torch.Tensor]:
        tdist.init_process_group("sim")
        r = tdist.get_rank()
        mesh = init_device_mesh("cpu", (W,))
        model = _model()
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _batches(2):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[2 * r:2 * r + 2]), y[2 * r:2 * r + 2]).backward()
            opt.step()
        return [p.full_tensor().detach().clone() for p in model.parameters()]

    ref = _reference(2)
    for rank, params in enumerate(simulator.run(body, W)):
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10, msg=f"rank {rank}")


def test_dtensor_and_functional_collectives() -> None:
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def body() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tdist.init_process_group("sim")
        r = tdist.get_rank()
        mesh = init_device_mesh("cpu", (W,))
        full = torch.arange(24.0).reshape(8, 3)
        dt = distribute_tensor(full, mesh, [Shard(0)])
        local = dt.to_local().clone()
        total = (dt * 2).sum().full_tensor()
        y = fc.wait_tensor(fc.all_reduce(torch.full((2,), float(r + 1)), "sum", mesh))
        return local, total, y

    full = torch.arange(24.0).reshape(8, 3)
    for r, (local, total, y) in enumerate(simulator.run(body, W)):
        torch.testing.assert_close(local, full[2 * r:2 * r + 2])
        torch.testing.assert_close(total, full.sum() * 2)
        torch.testing.assert_close(y, torch.full((2,), float(sum(range(1, W + 1)))))


def test_plain_collectives_subgroups_and_any_source_recv() -> None:
    def body() -> tuple:
        tdist.init_process_group("sim")
        r = tdist.get_rank()
        x = torch.tensor([float(r + 1)])
        tdist.all_reduce(x, op=tdist.ReduceOp.PRODUCT)
        g = tdist.new_group([3, 1])
        sub = None
        if r in (1, 3):
            sub = torch.tensor([float(r)])
            tdist.broadcast(sub, src=3, group=g)
        got = None
        if r == 0:
            t = torch.empty(1)
            got = sorted(tdist.recv(t) for _ in range(W - 1))
        else:
            tdist.send(torch.tensor([float(r)]), dst=0)
        return x, sub, got

    outs = simulator.run(body, W, seed=3)
    for r, (x, sub, got) in enumerate(outs):
        assert x.item() == 24.0
        assert sub is None if r not in (1, 3) else sub.item() == 3.0
    assert outs[0][2] == [1, 2, 3]


def test_mismatch_in_torch_native_code_is_caught_by_the_simulator() -> None:
    def body() -> None:
        tdist.init_process_group("sim")
        x = torch.ones(2)
        if tdist.get_rank() == 1:
            tdist.broadcast(x, src=0)
        else:
            tdist.all_reduce(x)

    with pytest.raises(BaseException) as info:
        simulator.run(body, 2)
    assert "CollectiveMismatchError" in repr(info.value) or isinstance(info.value, simulator.CollectiveMismatchError)


def _full_size_group_is_its_own() -> list:
    """torch's new_group() over every rank is a communicator of its own: its collectives never meet the world's."""
    tdist.init_process_group("gloo")
    r = tdist.get_rank()
    side = tdist.new_group(list(range(tdist.get_world_size())))
    ones = torch.ones(1)
    tdist.all_reduce(ones, group=side)  # every rank on the full-size group: fine
    tdist.all_reduce(torch.ones(1), group=side if r == 0 else None)  # rank 0 on it, rank 1 on the world: hangs on gloo
    return [ones.item()]


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_full_size_new_group_is_not_the_world(isolation) -> None:
    with pytest.raises(simulator.DeadlockError) as info:
        simulator.run(_full_size_group_is_its_own, 2, isolation=isolation, timeout=60)
    text = str(info.value)
    # each rank waits on a different group: rank 0 in the subgroup's second call, rank 1 in the world's first
    assert "rank 0 waits in all_reduce #2 on group [0, 1] (subgroup 1)" in text, text
    assert re.search(r"rank 1 waits in all_reduce #1 on group \[0, 1\] at .*missing: \[0\]", text), text


def _counted_by_comm_debug_mode(in_module: bool) -> object:
    """c10d calls under CommDebugMode, inside a module's forward or not (gloo counts each as its c10d op, and
    attributes it to the module it ran in)."""
    import torch.nn as nn
    from torch.distributed.tensor.debug import CommDebugMode

    c10d = torch.ops.c10d
    tdist.init_process_group("gloo")
    w = tdist.get_world_size()

    class Talks(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            tdist.all_reduce(x)
            out = torch.empty(2 * w)
            tdist.all_gather_into_tensor(out, x)
            tdist.broadcast(out, src=0)
            tdist.barrier()
            return out

    comm = CommDebugMode()
    with comm:
        talks = Talks()
        talks(torch.ones(2)) if in_module else talks.forward(torch.ones(2))
    counts = comm.get_comm_counts()
    module = "Talks" if in_module else "Global"
    return ([counts[c10d.allreduce_], counts[c10d._allgather_base_], counts[c10d.broadcast_], comm.get_total_counts()],
            dict(comm.comm_module_counts[module]["forward"]) == dict(counts))


@pytest.mark.parametrize("isolation, in_module", [("thread", False), ("process", False), ("process", True)])
def test_comm_debug_mode_counts_c10d_calls_as_on_gloo(isolation, in_module) -> None:
    # gloo processes (torch 2.13) count each call once as its c10d op, and attribute it to the module it ran in;
    # barrier is not among the ops CommDebugMode counts. (Inside a module on thread ranks, torch's process-wide
    # module tracker is refused with a message naming isolation='process': docs/torch-native.md.)
    assert simulator.run(_counted_by_comm_debug_mode, 2, args=(in_module,), isolation=isolation,
                         timeout=120) == [([1, 1, 1, 3], True)] * 2


def _two_of_three_on_a_file_store(path: str) -> object:
    """Ranks 0 and 1 make a 2-rank default group, each opening its own FileStore on one file (as a
    MultiProcessTestCase does); rank 2 stays out."""
    import tensorplay.distributed as tpd

    r = tpd.get_rank()
    if r == 2:
        return None
    tdist.init_process_group("gloo", store=tdist.FileStore(path, 2), rank=1 - r, world_size=2)
    t = torch.tensor([10.0 * (r + 1)])
    tdist.all_reduce(t)
    return (tdist.get_rank(), tdist.get_world_size(), t.item())


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_group_over_some_ranks_meets_on_a_file_store_each_rank_opens(tmp_path, isolation) -> None:
    # the file names the rendezvous (each rank's FileStore is an object of its own, in a process of its own on
    # rank processes, whose members meet through the coordinator); ranks claim 1 - r
    assert simulator.run(_two_of_three_on_a_file_store, 3, args=(str(tmp_path / "store"),), timeout=60,
                         isolation=isolation) == [(1, 2, 30.0), (0, 2, 30.0), None]


def _url_without(what: str, path: str) -> str:
    return {"rank": f"file://{path}?world_size=2", "world_size": f"file://{path}?rank=0",
            "port": "tcp://127.0.0.1?rank=0&world_size=2", "path": "file://?rank=0&world_size=2"}[what]


def _init_at_url_without(what: str, path: str) -> None:
    tdist.init_process_group("gloo", init_method=_url_without(what, path))


@pytest.mark.parametrize("what, message", [("rank", "file:// rendezvous: rank parameter missing"),
                                           ("world_size", "file:// rendezvous: world size parameter missing"),
                                           ("port", "tcp:// rendezvous: port number missing"),
                                           ("path", "file:// rendezvous: path missing")])
def test_a_rendezvous_url_without_what_torch_needs_fails_as_torch_fails(tmp_path, what, message) -> None:
    # torch's own errors (ValueError), before any exchange; a simulated rank does not fill in what the URL lacks
    with pytest.raises(ValueError, match=re.escape(message)):
        simulator.run(_init_at_url_without, 2, args=(what, str(tmp_path / "f")), timeout=60)
    with pytest.raises(ValueError, match=re.escape(message)):  # torch's own handler, outside a world
        next(tdist.rendezvous(_url_without(what, str(tmp_path / "f"))))


def test_unsupported_torch_version_is_refused_with_a_clear_message() -> None:
    with pytest.raises(RuntimeError, match="not supported.*supported="):
        torch_native.check_torch_version("2.99.0")
    torch_native.check_torch_version(torch.__version__)  # the installed one is supported


def test_torch_state_outside_the_simulated_world_is_untouched() -> None:
    before = copy.copy(torch.distributed.distributed_c10d._world)
    simulator.run(lambda: tdist.init_process_group("sim"), 2)
    assert type(torch.distributed.distributed_c10d._world) is type(before)
    assert not tdist.is_initialized()


def test_torchrun_style_script_with_torch_distributed_runs_under_python_m_simulator(tmp_path) -> None:
    import subprocess
    import sys

    script = tmp_path / "plain_torch.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')  # names a real backend; the simulator binds it to the simulated world\n"
        "x = torch.ones(1) * dist.get_rank()\n"
        "dist.all_reduce(x)\n"
        "print(f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: sum={x.item()}\")\n"
        "dist.destroy_process_group()\n"
    )
    out = subprocess.run([sys.executable, "-m", "simulator", "--nproc-per-node", "3", str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank {r} of 3: sum=3.0" for r in range(3)]


# ---------------------------------------------------------------------------
# issue 12: fidelity of the adapter (async work, devices, interception depth, excepthook)
# ---------------------------------------------------------------------------
def test_tutorial_ring_with_isend_before_recv_completes() -> None:
    """PyTorch's ring all-reduce tutorial posts isend before the blocking recv on every rank (item 1)."""
    def body() -> tuple[torch.Tensor, torch.Tensor]:
        tdist.init_process_group("gloo")
        rank, size = tdist.get_rank(), tdist.get_world_size()
        t = torch.arange(3.0) + 10 * rank
        send, recv, acc = t.clone(), torch.zeros(3), t.clone()
        left, right = (rank - 1) % size, (rank + 1) % size
        for _ in range(size - 1):
            req = tdist.isend(send, right)
            tdist.recv(recv, left)
            req.wait()
            acc += recv
            send.copy_(recv)
        got = torch.zeros(3)
        reqs = tdist.batch_isend_irecv([tdist.P2POp(tdist.isend, t, right), tdist.P2POp(tdist.irecv, got, left)])
        for r in reqs:
            r.wait()
        return acc, got

    n = 4
    expected = sum(torch.arange(3.0) + 10 * r for r in range(n))
    for rank, (acc, got) in enumerate(simulator.run(body, n)):
        assert torch.equal(acc, expected), rank
        assert torch.equal(got, torch.arange(3.0) + 10 * ((rank - 1) % n)), rank


def test_work_api_behaves_as_on_gloo() -> None:
    """wait/is_completed/is_success/exception/result/get_future/source_rank of the adapter's torch Work."""
    def body() -> dict:
        tdist.init_process_group("gloo")
        r = tdist.get_rank()
        x = torch.tensor([float(r + 1)])
        work = tdist.all_reduce(x, async_op=True)
        assert isinstance(work, tdist.Work)
        fut = work.get_future()  # completed: the op was waited for visibly
        out = {"done": work.is_completed(), "ok": work.is_success(), "exc": work.exception(),
               "result": [t.clone() for t in work.result()], "future": [t.clone() for t in fut.wait()],
               "then": fut.then(lambda f: f.value()[0] * 2).wait()}
        if r == 0:
            buf = torch.zeros(1)
            recv_work = tdist.irecv(buf)  # any source
            recv_work.wait()
            out["source"] = recv_work._source_rank()
            out["buf"] = buf
        elif r == 1:
            send_work = tdist.isend(torch.tensor([7.0]), 0)
            send_work.wait()
            with pytest.raises(RuntimeError, match="recv"):
                send_work.source_rank()
        return out

    outs = simulator.run(body, 2)
    for o in outs:
        assert o["done"] and o["ok"] and o["exc"] is None
        assert o["result"] == [torch.tensor([3.0])] and o["future"] == [torch.tensor([3.0])]
        assert torch.equal(o["then"], torch.tensor([6.0]))
    assert outs[0]["source"] == 1 and torch.equal(outs[0]["buf"], torch.tensor([7.0]))


def test_functional_collective_waits_through_the_python_work() -> None:
    """C++ wait_tensor reaches the adapter's Python wait (pybind trampoline): async results are right."""
    import torch.distributed._functional_collectives as fc

    def body() -> torch.Tensor:
        tdist.init_process_group("gloo")
        r = tdist.get_rank()
        y = fc.all_reduce(torch.full((2,), float(r + 1)), "sum", tdist.group.WORLD)
        z = fc.all_gather_single(torch.tensor([float(r)]), 0, tdist.group.WORLD)
        return (y + 0).clone(), (z + 0).clone()

    for y, z in simulator.run(body, 3):
        assert torch.equal(y, torch.full((2,), 6.0)) and torch.equal(z, torch.tensor([0.0, 1.0, 2.0]))


def test_group_reports_the_named_backend_and_its_devices() -> None:
    """get_backend and _device_types are what a gloo run reports; the default device is found (item 2)."""
    import warnings

    def body() -> tuple:
        tdist.init_process_group("gloo")
        g = tdist.new_group([0, 1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            default_device = c10d._get_pg_default_device()
        tdist.monitored_barrier()  # gloo-only API: reached because the group reports gloo
        return (tdist.get_backend(), tdist.get_backend(g), sorted(str(d) for d in tdist.group.WORLD._device_types),
                str(default_device), c10d._get_object_coll_device(), type(g).__name__)

    import torch.distributed.distributed_c10d as c10d

    for out in simulator.run(body, 2):
        assert out == ("gloo", "gloo", ["cpu", "cuda"], "cpu", "cpu", "SimProcessGroup")


def test_dcp_save_and_load_with_fsdp2_state_dict_helpers(tmp_path) -> None:
    """get_state_dict/set_state_dict and dcp.save/load run on simulated ranks and restore the model (item 2)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def body() -> list[torch.Tensor]:
        tdist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
        model = _model()
        fully_shard(model, mesh=mesh)
        dcp.save(get_model_state_dict(model), checkpoint_id=str(tmp_path))
        torch.manual_seed(5)
        other = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
        fully_shard(other, mesh=mesh)
        sd = get_model_state_dict(other)
        dcp.load(sd, checkpoint_id=str(tmp_path))
        set_model_state_dict(other, sd)
        return [p.full_tensor().clone() for p in other.parameters()]

    ref = [p.detach() for p in _model().parameters()]
    for params in simulator.run(body, 2):
        for p, q in zip(params, ref):
            assert torch.equal(p, q)


def _dcp_save_fsdp2(path: str) -> None:
    """Save a fixed model, fully sharded over the whole world, with DCP (on whatever backend runs it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (tdist.get_world_size(),)))
    dcp.save({"model": model.state_dict()}, checkpoint_id=path)


def _dcp_load_fsdp2(path: str) -> list[torch.Tensor]:
    """Load the checkpoint into a differently initialised model sharded over this world; full parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
    fully_shard(model, mesh=init_device_mesh("cpu", (tdist.get_world_size(),)))
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd["model"])
    return [p.full_tensor().detach().clone() for p in model.parameters()]


@pytest.mark.gloo
@pytest.mark.xdist_group("gloo-W2")
def test_dcp_reshards_from_four_simulated_ranks_to_two_on_sim_and_on_gloo(tmp_path, rank_pool) -> None:
    """A checkpoint saved by 4 simulated ranks loads at world size 2 on the simulator and on real gloo ranks."""
    path = str(tmp_path / "ckpt")

    def save() -> None:
        tdist.init_process_group("gloo")
        _dcp_save_fsdp2(path)

    def load() -> list[torch.Tensor]:
        tdist.init_process_group("gloo")
        return _dcp_load_fsdp2(path)

    simulator.run(save, 4)
    ref = [p.detach() for p in _model().parameters()]
    sim = simulator.run(load, 2)
    real = rank_pool(2).run(_dcp_load_fsdp2, path)
    for side, outs in (("sim", sim), ("gloo", real)):
        for rank, params in enumerate(outs):
            for p, q in zip(params, ref):
                assert torch.equal(p, q), f"{side} rank {rank}"


def test_device_mesh_without_init_process_group_binds_to_the_simulator() -> None:
    """init_device_mesh calls torch's init_process_group by its own name: still the simulated world (item 9)."""
    from torch.distributed.device_mesh import init_device_mesh

    def body() -> tuple:
        mesh = init_device_mesh("cpu", (tdist.get_world_size() if tdist.is_initialized() else 2,))
        x = torch.tensor([float(tdist.get_rank() + 1)])
        tdist.all_reduce(x, group=mesh.get_group())
        return type(tdist.group.WORLD).__name__, x

    for name, x in simulator.run(body, 2, torchrun_env=True):
        assert name == "SimProcessGroup" and x.item() == 3.0


def test_init_process_group_imported_by_name_and_any_init_method_bind_to_the_simulator(tmp_path) -> None:
    """`from torch.distributed import init_process_group` taken before the run, tcp:// and file:// (item 9)."""
    from torch.distributed import init_process_group as ipg  # the original function object, by name

    def body(method: str) -> tuple:
        r = int(__import__("os").environ["RANK"])
        if method == "env":
            ipg(backend="gloo")
        elif method == "tcp":
            ipg(backend="gloo", init_method="tcp://127.0.0.1:1", rank=r, world_size=3)  # port 1: never dialled
        else:
            ipg(backend="gloo", init_method=f"file://{tmp_path}/rdzv", rank=r, world_size=3)
        g = tdist.new_group([0, 2], backend="gloo")
        x = torch.tensor([float(r)])
        tdist.all_reduce(x)
        return type(tdist.group.WORLD).__name__, type(g).__name__ if r != 1 else None, x.item()

    for method in ("env", "tcp", "file"):
        outs = simulator.run(body, 3, args=(method,), torchrun_env=True)
        assert [o[0] for o in outs] == ["SimProcessGroup"] * 3, method
        assert [o[1] for o in outs] == ["SimProcessGroup", None, "SimProcessGroup"], method
        assert [o[2] for o in outs] == [3.0] * 3, method


def test_rank_or_world_size_that_disagree_with_the_simulated_rank_are_a_clear_error() -> None:
    def body(kind: str) -> None:
        if kind == "world_size":
            tdist.init_process_group("gloo", init_method="tcp://127.0.0.1:1", rank=tdist_rank(), world_size=5)
        else:
            tdist.init_process_group("gloo", store=tdist.HashStore(), rank=(tdist_rank() + 1) % 2, world_size=2)

    def tdist_rank() -> int:
        return int(__import__("os").environ["RANK"])

    for kind, pattern in (("world_size", r"asks for world_size=5.*simulated_world_size=2"),
                          ("rank", r"asks for rank=1, .*simulated_rank=0")):
        w = simulator.World(2, torchrun_env=True)
        with pytest.raises(BaseException):
            w.run(body, (kind,))
        # every rank, before any exchange; a RuntimeError, as gloo's (at once, or at the store's timeout)
        assert all(isinstance(e, RuntimeError) and not isinstance(e, simulator.SimError) for e in w.errors), w.errors
        assert re.search(pattern, str(w.errors[0])), str(w.errors[0])


def test_excepthook_is_left_as_found() -> None:
    """torch wraps sys.excepthook with a [rank<r>] prefixer at each init; thread ranks would nest them (item 12)."""
    import sys

    before = sys.excepthook

    def body() -> bool:
        tdist.init_process_group("gloo")
        same = sys.excepthook is before
        tdist.destroy_process_group()
        tdist.init_process_group("gloo")
        return same and sys.excepthook is before

    assert simulator.run(body, 3) == [True] * 3
    assert sys.excepthook is before


def test_explicit_tcp_store_on_simulated_ranks_is_the_worlds_in_memory_store() -> None:
    """A script that builds its own TCPStore (rank 0 the master) and passes it to init_process_group runs.

    On real processes rank 0's store waits for the workers to connect; rank threads cannot serve sockets
    to each other, so on a simulated rank the address names the world's in-memory store instead.
    """
    import os

    def body() -> tuple:
        rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = tdist.TCPStore("127.0.0.1", 1, ws, rank == 0)  # port 1: never bound or dialled
        store.set(f"k{rank}", str(rank))
        tdist.init_process_group("gloo", store=store, rank=rank, world_size=ws)
        x = torch.tensor([float(rank)])
        tdist.all_reduce(x)
        seen = sorted(store.get(f"k{r}").decode() for r in range(ws))  # every rank set its key before the exchange
        return isinstance(store, tdist.TCPStore), x.item(), seen

    assert simulator.run(body, 3, torchrun_env=True) == [(True, 3.0, ["0", "1", "2"])] * 3
    assert tdist.TCPStore.__module__.startswith("torch")  # the real class is back after the run


def _new_groups(skip: bool) -> float:
    """new_group is called by every rank of the default group, in one order, members or not; ``skip``: rank 0
    skips one (as if it were not a member), so torch names the next group differently on rank 0 (gloo hangs)."""
    tdist.init_process_group("gloo")
    r = tdist.get_rank()
    # (members only: torch names it by a hash of its ranks and of how many groups the rank has, here the same)
    local = tdist.new_group([1, 2], use_local_synchronization=True) if r in (1, 2) else None
    if not (skip and r == 0):
        tdist.new_group([1, 2])
    b = tdist.new_group([0, 1])
    x = torch.tensor([float(r + 1)])
    if r in (0, 1):
        tdist.all_reduce(x, group=b)
    if local is not None:
        tdist.all_reduce(x, group=local)
    return x.item()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_rank_that_skips_a_new_group_call_is_a_deadlock_named_with_the_fix(isolation):
    """gloo's members meet under torch's name of a group, a count of new_group calls: a rank that skipped one names
    the next group differently, and gloo hangs; the simulator's members meet under that name too, and report it."""
    assert simulator.run(_new_groups, 3, args=(False,), timeout=60, isolation=isolation) == [3.0, 6.0, 6.0]
    with pytest.raises(simulator.DeadlockError, match=r"(?s)rank 0 waits in all_reduce.*rank 1 waits in all_reduce.*"
                       r"Hint: the members of group \[0, 1\] wait in different groups: torch named the group '1' on "
                       r"rank 0, '2' on rank 1 .*Fix: call new_group on every rank"):
        simulator.run(_new_groups, 3, args=(True,), timeout=60, isolation=isolation)
    # every rank made both groups, but the ranks pass different ones: the hint says that, not "call new_group"
    with pytest.raises(simulator.DeadlockError, match=r"(?s)Hint: the members of group \[0, 1\] wait in different "
                       r"groups of the same ranks: the one torch named '1' on rank 0, '2' on rank 1\. Every member "
                       r"made each of these groups, so the ranks passed different group objects"):
        simulator.run(_different_group_objects, 2, timeout=60, isolation=isolation)


def _different_group_objects() -> None:
    tdist.init_process_group("gloo")
    first, second = tdist.new_group([0, 1]), tdist.new_group([0, 1])
    tdist.all_reduce(torch.ones(1), group=first if tdist.get_rank() == 0 else second)


def _init_after_changing_the_environment(var: str, value: str) -> str:
    import os

    os.environ[var] = value  # (torch's env:// reads RANK and WORLD_SIZE when init_process_group is called)
    try:
        tdist.init_process_group("gloo")
    except tdist_errors.DistRuntimeError as e:  # (a RuntimeError, as gloo's)
        return str(e)
    return f"rank {tdist.get_rank()} of {tdist.get_world_size()}"


@pytest.mark.parametrize("var,value,want", [
    ("WORLD_SIZE", "4", r"asks for world_size=4 \(its environment's WORLD_SIZE, which the launcher set to 2 and the "
                        r"program changed\), but this simulated rank has world_size=2.*Fix: "),
    ("RANK", "0", None)])
def test_env_rendezvous_reads_what_the_program_set_in_its_environment(var, value, want):
    """env:// takes RANK and WORLD_SIZE from the environment when init_process_group is called; a program that
    changed them gets them checked against the simulated world (gloo would hang waiting for ranks that never come)."""
    out = simulator.run(_init_after_changing_the_environment, 2, args=(var, value), torchrun_env=True, timeout=60)
    if want is not None:
        assert all(re.search(want, o) for o in out), out
    else:  # every rank claims rank 0: rank 1 is refused, naming the rank it has
        assert re.search(r"asks for rank=0 \(its environment's RANK.*has rank=1", out[1]), out
        assert out[0] == "rank 0 of 2", out


def _send_recv_with_tag(tag) -> str:
    tdist.init_process_group("gloo")
    try:
        if tdist.get_rank() == 0:
            tdist.send(torch.ones(1), 1, tag=tag)
        else:
            tdist.recv(torch.zeros(1), 0, tag=tag)
    except (RuntimeError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


@pytest.mark.parametrize("tag,want", [(-1, r"DistBackendError: .*Tag must be nonnegative: tag=-1\. Fix: "),
                                      (2 ** 40, r"TypeError: .*incompatible function arguments.*tag=1099511627776"),
                                      (2 ** 31 - 1, r"^ok$")])
def test_point_to_point_tags_are_checked_as_gloo_checks_them(tag, want):
    """gloo refuses a negative tag ("Tag must be nonnegative") and torch's binding one beyond a C int (a TypeError),
    on both ranks, before anything is sent."""
    out = simulator.run(_send_recv_with_tag, 2, args=(tag,), timeout=60)
    assert all(re.search(want, o) for o in out), out


def _profiled_all_reduce(scheduled: bool = False) -> tuple:
    """torch's profiler around an all_reduce on a rank (with a schedule: the trace starts in ``step()``, and the
    profiler's exit starts it again after a refused step): the gloo events it recorded, and the result."""
    tdist.init_process_group("gloo")
    kw = {"schedule": torch.profiler.schedule(wait=0, warmup=1, active=1)} if scheduled else {}
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], **kw) as prof:
            t = torch.ones(4) * (tdist.get_rank() + 1)
            tdist.all_reduce(t)
            if scheduled:
                prof.step()
    except simulator.SimError as e:
        return "refused", str(e)
    return [e.key for e in prof.key_averages() if e.key.startswith("gloo:")], t.tolist()


@pytest.mark.parametrize("scheduled", [False, True])
def test_the_profiler_on_one_of_several_thread_ranks_is_refused_with_the_fix_and_runs_on_rank_processes(scheduled):
    """torch's profiler is one per process: thread ranks sharing it crashed the process (a segmentation fault in
    _disable_profiler) and recorded each other's operations; a rank alone, and rank processes, have their own.
    With a schedule, the profiler's exit started the trace after the refused step: that crashed too."""
    for r, (what, msg) in enumerate(simulator.run(_profiled_all_reduce, 2, args=(scheduled,))):
        assert what == "refused" and re.search(rf"torch\.profiler\.profile \(rank {r}\): torch's profiler was started "
                                               r"on a simulated thread rank.*world_size=2.*Fix: .*isolation='process'", msg)
    if scheduled:
        return
    assert simulator.run(_profiled_all_reduce, 1) == [(["gloo:all_reduce"], [1.0] * 4)]
    assert simulator.run(_profiled_all_reduce, 2, isolation="process") == [(["gloo:all_reduce"], [3.0] * 4)] * 2
    assert "_prepare_trace" in vars(torch.autograd.profiler.profile)  # torch's own method is back after the runs
    assert torch.autograd.profiler.profile._prepare_trace.__module__.startswith("torch")


def test_fsdp1_profiler_tables_are_per_rank_while_a_world_runs_and_restored_after() -> None:
    from torch.distributed.fsdp._debug_utils import SimpleProfiler

    profiling, results = SimpleProfiler.__dict__["profiling"], SimpleProfiler.__dict__["results"]

    def body():
        tdist.init_process_group("gloo")
        rank = tdist.get_rank()
        # a rank holds a profile open across a collective, as FSDP1's optim_state_dict does: the other rank
        # enters and leaves the same profile type meanwhile, which on one shared set fails either rank
        with SimpleProfiler.profile("preprocessing_with_comm"):
            tdist.barrier()
            seen = sorted(SimpleProfiler.profiling)
            tdist.barrier()
        return seen, rank, sorted(SimpleProfiler.results)

    out = simulator.run(body, 2)
    assert out == [(["preprocessing_with_comm"], 0, ["preprocessing_with_comm"]),
                   (["preprocessing_with_comm"], 1, ["preprocessing_with_comm"])]
    assert SimpleProfiler.__dict__["profiling"] is profiling and SimpleProfiler.__dict__["results"] is results
    assert "preprocessing_with_comm" not in profiling


def test_dtensor_op_handlers_are_per_rank_while_a_world_runs_and_restored_after() -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dispatch import OpDispatcher

    dispatcher = DTensor._op_dispatcher
    table = dispatcher.__dict__["_custom_op_handlers"]
    before = dict(table)

    def body():
        tdist.init_process_group("gloo")
        # rank 0 adds a handler and keeps it across a barrier; rank 1 must not see it
        if tdist.get_rank() == 0:
            dispatcher._custom_op_handlers["probe"] = len
        tdist.barrier()
        seen = "probe" in dispatcher._custom_op_handlers
        tdist.barrier()
        if tdist.get_rank() == 0:
            dispatcher._custom_op_handlers.pop("probe")
        return seen

    assert simulator.run(body, 2) == [True, False]
    assert "_custom_op_handlers" not in OpDispatcher.__dict__
    assert dispatcher._custom_op_handlers is table and table == before


@pytest.mark.parametrize("mode", ["threads", "coop"])
def test_each_rank_thread_plans_its_own_redistributions(mode: str) -> None:
    # torch caches redistribution plans by mesh; two ranks' meshes over the same devices compared equal on thread
    # ranks, so a rank took another's plan (with the other's coordinates): the first gather below summed to 510
    import pickle

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    full = torch.arange(35.0).reshape(7, 5)  # 7 and 5: uneven over 2 x 2
    cases = [((Shard(0), Shard(0)), (Replicate(), Replicate())), ((Shard(0), Shard(1)), (Shard(1), Replicate())),
             ((Shard(1), Shard(0)), (Replicate(), Shard(0)))]

    def body():
        tdist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (2, 2))
        locals_ = [distribute_tensor(full, mesh, src).redistribute(mesh, dst).to_local() for src, dst in cases]
        return locals_, mesh, pickle.loads(pickle.dumps(mesh)) == mesh

    out = simulator.run(body, 4, mode=mode)
    for r, (locals_, mesh, unpickled_equal) in enumerate(out):
        want = [full, full.chunk(2, dim=1)[r // 2], full.chunk(2, dim=0)[r % 2]]  # coordinates (r // 2, r % 2)
        for got, w, case in zip(locals_, want, cases):
            torch.testing.assert_close(got, w, msg=f"rank {r}, {case}")
        assert unpickled_equal, f"rank {r}: a mesh unpickled on its rank equals the rank's own"
    assert out[0][1] != out[1][1], "two ranks' meshes are different processes' meshes"
    assert _gen_transform_infos.cache_info().currsize == 0, "the world's plans end with it"


def test_torch_settings_a_world_flips_end_with_it() -> None:
    # use_min_cost_redistribution_plan sets a module global and puts the old value back on exit: ranks that enter
    # and leave in turn leave one rank's value behind (it was True after this world), and a suite's next test would
    # plan its redistributions with it; init_process_group's legacy globals (_backend) likewise
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor import _redistribute

    before = (_redistribute._FORCE_MIN_COST_REDISTRIBUTION_PLAN, c10d._backend, c10d._default_pg_init_method)

    def body():
        tdist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (4,))
        with _redistribute.use_min_cost_redistribution_plan(True):
            out = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
        return out.to_local()

    for seed in range(3):
        for r, got in enumerate(simulator.run(body, 4, seed=seed)):
            torch.testing.assert_close(got, torch.arange(8.0), msg=f"seed {seed}, rank {r}")
        after = (_redistribute._FORCE_MIN_COST_REDISTRIBUTION_PLAN, c10d._backend, c10d._default_pg_init_method)
        assert after == before, f"seed {seed}: {after} != {before}"


# ---------------------------------------------------------------------------
# backend names: a name torch refuses is refused on simulated ranks too (the simulator runs every name it knows)
# ---------------------------------------------------------------------------
#: names torch 2.13's init_process_group refuses: misspelt, empty, bad device:backend strings
REFUSED_BACKENDS = REFUSED_NAMES


def _init_named(backend: object) -> str:
    tdist.init_process_group(backend)
    return tdist.get_backend()


def _assert_refused_as_torch_does(backend: object, errors: list, ranks: list[int]) -> None:
    kind, torch_says = torch_refusal(backend)
    for r in ranks:
        e = errors[r]
        assert isinstance(e, kind) and isinstance(e, tdist_errors.DistError), (backend, r, repr(e))
        message = re.sub(r"\s+", " ", str(e))
        assert message.startswith(torch_says + "; torch.distributed."), (backend, r, torch_says, message)
        named = str(tdist.Backend(backend))  # (torch's init_process_group lower-cases the name before its helper)
        assert f"backend={named!r}" in message and "Fix:" in message, message


@pytest.mark.parametrize("backend", REFUSED_BACKENDS, ids=repr)
def test_a_backend_name_torch_refuses_is_refused_on_simulated_ranks(backend: str) -> None:
    w = simulator.World(2)
    with pytest.raises(BaseException):
        w.run(_init_named, (backend,))
    _assert_refused_as_torch_does(backend, w.errors, [0, 1])


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_misspelt_backend_is_refused_with_the_closest_name(isolation: str) -> None:
    w = simulator.World(2, isolation=isolation)
    with pytest.raises(AssertionError, match=r"^Unknown backend type glooo; torch\.distributed\.init_process_group: "
                                             r".*Fix: did you mean 'gloo'\?"):
        w.run(_init_named, ("glooo",))
    _assert_refused_as_torch_does("glooo", w.errors, [0, 1])


def _new_group_named(backend: str) -> str:
    tdist.init_process_group("gloo")
    tdist.new_group([0], backend=backend)
    return "returned"


def test_new_group_refuses_a_name_torch_refuses_on_its_members_only() -> None:
    """torch's helper sends a non-member away before it reads the name: rank 1 is not refused."""
    w = simulator.World(2)
    with pytest.raises(BaseException):
        w.run(_new_group_named, ("glo",))
    assert isinstance(w.errors[0], AssertionError), repr(w.errors[0])
    assert str(w.errors[0]).startswith("Unknown backend type glo; torch.distributed.new_group: "), str(w.errors[0])
    assert not isinstance(w.errors[1], AssertionError), repr(w.errors[1])


@pytest.fixture
def custom_backend() -> Iterator[str]:
    """A backend registered with torch's Backend.register_backend (torch has no unregister: undone by hand)."""
    name, before = "tpcustom", copy.deepcopy({k: getattr(tdist.Backend, k) for k in _BACKEND_TABLES})
    tdist.Backend.register_backend(name, lambda *a: None, devices=["cpu"])
    yield name
    for k, v in before.items():
        setattr(tdist.Backend, k, v)
    delattr(tdist.Backend, name.upper())


_BACKEND_TABLES = ("_plugins", "backend_list", "backend_type_map", "backend_capability", "default_device_backend_map")


def test_every_name_torch_accepts_runs_on_simulated_ranks(custom_backend: str) -> None:
    """gloo, any case, nccl (whatever its availability here), device:backend strings, None, "sim", and a
    backend registered with torch: the name is what get_backend reports, as on a real run."""
    names = ["gloo", "GLOO", "nccl", "cpu:gloo,cuda:nccl", "cpu:gloo", None, "sim", custom_backend,
             custom_backend.upper()]
    reported = {"GLOO": "gloo", None: "undefined", custom_backend.upper(): custom_backend}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that this build has no NCCL to take a default timeout from
        for name in names:
            assert simulator.run(_init_named, 2, args=(name,)) == [reported.get(name, name)] * 2, name


def _destroy_a_subgroup_then_make_another() -> list[float]:
    tdist.init_process_group("gloo")
    sub = tdist.new_group([0, 1])
    t = torch.ones(1)
    tdist.all_reduce(t, group=sub)
    tdist.destroy_process_group(sub)  # torch drops the group's name, then unregisters it by that name
    again = tdist.new_group([0, 1])
    tdist.all_reduce(t, group=again)
    return [t.item(), float(again.size())]


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_destroying_a_subgroup_then_making_another_works(isolation) -> None:
    assert simulator.run(_destroy_a_subgroup_then_make_another, 2, isolation=isolation, timeout=120) == [[4.0, 2.0]] * 2


def _file_rendezvous(path: str) -> float:
    r = int(__import__("os").environ["RANK"])
    tdist.init_process_group("gloo", init_method=f"file://{path}", rank=r, world_size=2)
    t = torch.tensor([float(r + 1)])
    tdist.all_reduce(t)
    tdist.destroy_process_group()
    return t.item()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_file_rendezvous_leaves_no_file_behind_as_a_file_store_does(tmp_path, isolation) -> None:
    # torch's FileStore removes its file when its last user ends; MultiProcessTestCase relies on it (an
    # empty NamedTemporaryFile(delete=False) for every test). Rank processes open torch's FileStore on it;
    # thread ranks never open it, and remove it only if it is still empty
    used = tmp_path / "rdzv"
    used.touch()
    assert simulator.run(_file_rendezvous, 2, torchrun_env=True, isolation=isolation,
                         timeout=120, args=(str(used),)) == [3.0, 3.0]
    assert not used.exists()
    if isolation == "thread":
        filled = tmp_path / "kept"
        filled.write_text("mine")
        assert simulator.run(_file_rendezvous, 2, torchrun_env=True, timeout=120, args=(str(filled),)) == [3.0, 3.0]
        assert filled.read_text() == "mine"


def _subset_groups(kind: str) -> object:
    r = int(__import__("os").environ["RANK"])
    if kind == "two_groups":  # ranks 0, 1 at one address, ranks 3, 2 (claiming 0, 1) at another
        port, claim = (29500, r) if r < 2 else (29600, 3 - r)
        tdist.init_process_group("gloo", rank=claim, world_size=2, init_method=f"tcp://localhost:{port}")
        x = torch.tensor([float(r)])
        tdist.all_reduce(x)
        pair = tdist.new_group([0, 1])  # torch's ranks of the 2-rank group, not the launched ones
        y = torch.tensor([float(tdist.get_rank())])
        tdist.broadcast(y, group_src=1, group=pair)
        return (tdist.get_rank(), tdist.get_world_size(), x.item(), y.item())
    if kind == "same_rank" and r < 2:
        tdist.init_process_group("gloo", rank=0, world_size=2, init_method="tcp://localhost:29500")
    if kind == "rank_too_big" and r == 1:
        tdist.init_process_group("gloo", rank=2, world_size=2, init_method="tcp://localhost:29500")
    if kind == "one_missing" and r == 0:
        tdist.init_process_group("gloo", rank=0, world_size=2, init_method="tcp://localhost:29500")
    return None


@pytest.mark.parametrize("mode,isolation", [("coop", "thread"), ("threads", "thread"), ("coop", "process")])
def test_default_groups_over_part_of_the_simulated_ranks(mode: str, isolation: str) -> None:
    def world() -> simulator.World:
        return simulator.World(4, torchrun_env=True, mode=mode, timeout=120, isolation=isolation)

    got = world().run(_subset_groups, ("two_groups",))
    assert got == [(0, 2, 1.0, 1.0), (1, 2, 1.0, 1.0), (1, 2, 5.0, 1.0), (0, 2, 5.0, 1.0)], got
    for kind, pattern in (("same_rank", r"simulated ranks (0 and 1|1 and 0) both claim rank 0 of the rendezvous at "
                                        r"localhost:29500.*Fix: give each process"),
                          ("rank_too_big", r"rank 2 is outside the rendezvous at localhost:29500's world_size: "
                                           r"rank=2, world_size=2")):
        w = world()
        with pytest.raises(BaseException):
            w.run(_subset_groups, (kind,))
        want = ValueError if kind == "same_rank" else RuntimeError  # (gloo refuses an out-of-range rank: RuntimeError)
        assert [isinstance(e, want) and not isinstance(e, simulator.SimError) for e in w.errors] == \
            [kind == "same_rank", True, False, False], w.errors
        assert re.search(pattern, str(next(e for e in w.errors if e is not None))), w.errors
    with pytest.raises(simulator.DeadlockError, match=r"rank 0 waits in init_process_group's rendezvous at "
                                                      r"localhost:29500 .*no rank has claimed \[1\]"):
        world().run(_subset_groups, ("one_missing",))


def _sparse_sum() -> torch.Tensor:
    tdist.init_process_group("gloo")
    r = tdist.get_rank()
    # rank r holds r + 1 entries at distinct and shared places, values distinct per rank
    idx = torch.tensor([[i % 4 for i in range(r, 2 * r + 1)], [(3 * i + r) % 5 for i in range(r + 1)]])
    t = torch.sparse_coo_tensor(idx, torch.arange(r + 1, dtype=torch.float32) + 10 * r, (4, 5))
    tdist.all_reduce(t)
    return t.to_dense()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_sparse_all_reduce_sums_every_ranks_entries_as_gloo_does(isolation) -> None:
    w = 3
    want = torch.zeros(4, 5)
    for r in range(w):  # the dense sum of what each rank built: an independent reference
        idx = torch.tensor([[i % 4 for i in range(r, 2 * r + 1)], [(3 * i + r) % 5 for i in range(r + 1)]])
        want += torch.sparse_coo_tensor(idx, torch.arange(r + 1, dtype=torch.float32) + 10 * r, (4, 5)).to_dense()
    for got in simulator.run(_sparse_sum, w, isolation=isolation):
        assert torch.equal(got, want)


def _fake_group() -> tuple[int, int, float]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # torch's process-local fake group (tracing, memory estimates): every process its own rank 0 of 4, nothing sent
    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    x = torch.full((2,), 5.0)
    tdist.all_reduce(x)
    out = (tdist.get_rank(), tdist.get_world_size(), x.sum().item())
    tdist.destroy_process_group()
    return out


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_torchs_fake_group_is_torchs_own_on_simulated_ranks(isolation) -> None:
    # the values torch's fake backend gives in a plain process: rank 0 of 4, the tensor untouched
    assert simulator.run(_fake_group, 2, isolation=isolation) == [(0, 4, 10.0)] * 2


def _detail_checks() -> tuple:
    tdist.init_process_group("gloo")
    r = tdist.get_rank()
    level = tdist.get_debug_level()
    try:
        tdist.all_reduce(torch.ones(2 + r))  # shapes differ: the wrapper's check raises at the call, on every rank
        return level, None
    except RuntimeError as e:
        tdist.all_reduce(torch.ones(2))  # a matched collective after it still runs
        return level, str(e)
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_debug_detail_wraps_groups_for_the_world_only(isolation) -> None:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL in a rank's environment gives its gloo groups torch's ProcessGroupWrapper
    checks (tests/test_real_programs.py compares the messages with gloo's); the process's level is as before after."""
    before = tdist.get_debug_level()
    out = simulator.run(_detail_checks, 2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, isolation=isolation)
    for r, (level, err) in enumerate(out):
        assert level == tdist.DebugLevel.DETAIL
        assert err.startswith(f"Detected mismatch between collectives on ranks. Rank {r} is running collective")
        assert err.endswith(f"Tensor Tensor shapes: {2 + r}vs {3 - r}")
    assert tdist.get_debug_level() == before


def _dist2_groups(port: int) -> tuple:
    """torch's experimental ``_dist2`` groups, as PyTorch's test_dist2.py drives them on gloo."""
    import os
    from datetime import timedelta

    import torch.distributed._dist2 as dist2

    r = int(os.environ["RANK"])
    pg = dist2.new_group(backend="gloo", timeout=timedelta(seconds=60), device="cpu")
    t = torch.full((3,), float(r + 1))
    pg.allreduce(t, timeout=timedelta(seconds=30)).wait()  # the pybind overload's per-call bound
    pg.barrier(timeout=timedelta(seconds=30)).wait()
    alone = pg.split_group([r], timeout=timedelta(seconds=20), group_name=f"solo{r}")
    pair = pg.split_group([0, 1], timeout=timedelta(seconds=25))
    store = tdist.TCPStore("127.0.0.1", port, world_size=2, is_master=r == 0)
    merged = alone.merge_remote_group(store, 2, timedelta(seconds=40), "merged")
    m = torch.full((2,), float(10 * (r + 1)))
    merged.allreduce(m).wait()
    pg.shutdown()
    return (t.tolist(), alone.size(), alone.group_name, pair.size(), pair._get_backend("cpu").options._timeout,
            merged.size(), merged.group_name, m.tolist())


def test_dist2_groups_split_merge_and_per_call_timeouts() -> None:
    """test_dist2.py's shapes: a group built by its factory (a C++ ProcessGroup holding a gloo backend on a real
    run; the simulated group itself here), split into groups of some members and merged back through a store
    (torch's C++ split and merge segfaulted on a simulated group), with timeout= on each call."""
    from datetime import timedelta

    from tensorplay.testing import free_port

    out = simulator.run(_dist2_groups, 2, args=(free_port(),), torchrun_env=True)
    for r, (summed, alone, name, pair, pair_timeout, merged, merged_name, m) in enumerate(out):
        assert summed == [3.0] * 3 and (alone, name) == (1, f"solo{r}")
        assert (pair, pair_timeout) == (2, timedelta(seconds=25))
        assert (merged, merged_name, m) == (2, "merged", [30.0, 30.0])


def _process_based_async_save(path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    tdist.init_process_group("gloo")
    dcp.async_save({"w": torch.ones(2)}, checkpoint_id=path,
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()


def test_process_based_async_save_is_refused_on_thread_ranks_with_the_fix(tmp_path) -> None:
    """DCP's process-based async_save keeps one daemon per process in a module global: thread ranks would share
    one, and their saves hung waiting for ranks that never send. Refused at once, naming the fix."""
    with pytest.raises(tdist_errors.DistRuntimeError,
                       match=r"one background process per process(.|\n)*Fix: run the ranks as processes"):
        simulator.run(_process_based_async_save, 2, args=(str(tmp_path / "ckpt"),), timeout=120)


def _wrapper_subclass_collectives() -> tuple:
    from torch.testing._internal.two_tensor import TwoTensor

    tdist.init_process_group("gloo")
    r, w = tdist.get_rank(), tdist.get_world_size()
    out = TwoTensor(torch.zeros(2), torch.zeros(2))
    parts = [TwoTensor(torch.full((2,), float(i)), torch.full((2,), i + 10.0)) for i in range(w)] if r == 0 else None
    tdist.scatter(out, parts, src=0)  # (FSDP2's all-gather extension tests scatter TwoTensor parameters)
    gathered = [TwoTensor(torch.zeros(2), torch.zeros(2)) for _ in range(w)]
    tdist.all_gather(gathered, TwoTensor(torch.full((2,), float(r)), torch.full((2,), r + 20.0)))
    return out.a.tolist(), out.b.tolist(), [(g.a[0].item(), g.b[0].item()) for g in gathered]


def test_collectives_on_a_wrapper_subclass_write_its_inner_tensors() -> None:
    """A wrapper subclass (torch's TwoTensor) has no storage of its own: the kernels write it through its own
    operators, and the check for outputs sharing memory with inputs takes it as possibly shared."""
    got = simulator.run(_wrapper_subclass_collectives, 2, timeout=60)
    for r, (a, b, gathered) in enumerate(got):
        assert a == [float(r)] * 2 and b == [r + 10.0] * 2
        assert gathered == [(0.0, 20.0), (1.0, 21.0)]


def _send_to_a_rank_outside_the_group() -> tuple:
    tdist.init_process_group("gloo")
    try:
        tdist.send(torch.ones(2), dst=3)
    except Exception as e:  # noqa: BLE001  (what the program's own except clauses see)
        sent = isinstance(e, tdist.DistError), isinstance(e, tdist.DistBackendError), str(e)
    me = tdist.get_rank()
    try:
        tdist.batch_isend_irecv([tdist.P2POp(tdist.isend, torch.ones(2), me)])
    except Exception as e:  # noqa: BLE001
        return sent, str(e)
    return None


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_refused_group_call_is_one_of_torchs_own_backend_errors(isolation: str) -> None:
    """What the simulator refuses inside a group's call (gloo would fail there, or at its timeout) is torch's
    ``DistBackendError`` too, as gloo's failures are: ``except torch.distributed.DistError`` catches it."""
    for r, got in enumerate(simulator.run(_send_to_a_rank_outside_the_group, 2, isolation=isolation, timeout=120)):
        assert got is not None and got[0][:2] == (True, True), (r, got)
        sent, batched = got
        assert "group_dst=3" in sent[2] and "Fix:" in sent[2], (r, got)
        # named as the program called it (tensorplay's isend and irecv carry it out)
        assert sent[2].startswith(f"torch.distributed.send (group [0, 1], rank {r}): "), sent[2]
        assert batched.startswith(f"torch.distributed.batch_isend_irecv (group [0, 1], rank {r}): "), batched


def _world_rank_map() -> tuple:
    import torch.distributed.distributed_c10d as c10d

    tdist.init_process_group("gloo")
    sub = tdist.new_group(list(range(tdist.get_world_size())))  # every rank: the identity map again
    table = c10d._world.pg_group_ranks
    ranks = table[c10d.GroupMember.WORLD]
    out = (ranks, table[sub], ranks == {i: i for i in range(tdist.get_world_size())},
           tdist.get_group_rank(sub, tdist.get_rank()), tdist.get_global_rank(sub, tdist.get_world_size() - 1))
    tdist.destroy_process_group()
    return out


def test_the_ranks_of_a_whole_world_group_share_one_rank_map() -> None:
    """torch gives each rank a {i: i} map of the world's W ranks (O(W^2) memory in all, 1.2 GiB at 4096 ranks):
    the ranks share one, and torch's rank lookups still answer as before."""
    got = simulator.run(_world_rank_map, 64, mode="threads", timeout=120)  # (the maps themselves: no id reused)
    assert all(g[0] is got[0][0] and g[1] is got[0][0] for g in got), [len(g[0]) for g in got[:2]]
    assert all(g[2] and g[3] == r and g[4] == 63 for r, g in enumerate(got)), got[:2]
