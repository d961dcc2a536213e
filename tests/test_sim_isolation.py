"""Process-isolated simulated ranks (``isolation="process"``, issue 14).

Each rank runs in its own Python process; the simulator (matching, checks,
deadlock naming, faults, trace) runs in the coordinator.  Worker functions live
at module level here: the rank processes import this module by name, each with
its own copy of its globals.  Rank processes are forks of warm interpreters
(one per hash seed, :mod:`simulator.isolation.warm`); the tests below check
that a fork is as clean as a fresh interpreter.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import simulator
import tensorplay.distributed as dist
from simulator.isolation import ISOLATIONS, hash_seed

pytestmark = pytest.mark.xdist_group("sim-isolation")


# ---------------------------------------------------------------------------
# programs (run in the rank processes)
# ---------------------------------------------------------------------------
def collectives_and_p2p() -> dict:
    """Distinct per-rank values through every kind of call: results are checked against plain arithmetic."""
    r, w = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    x = torch.arange(4, dtype=torch.float64) * (r + 1) + 0.1 * r
    dist.all_reduce(x)
    out["all_reduce"] = x
    m = torch.tensor([float(r * r - 3 * r)])
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    out["max"] = m
    b = torch.full((2, 3), float(r))
    dist.broadcast(b, src=w - 1)
    out["broadcast"] = b
    gl = [torch.empty(2) for _ in range(w)]
    dist.all_gather(gl, torch.tensor([r, 10.0 * r]))
    out["all_gather"] = torch.stack(gl)
    flat = torch.empty(w * 2)
    dist.all_gather_into_tensor(flat, torch.tensor([r + 0.5, -r]))
    out["all_gather_into_tensor"] = flat
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2 * w, dtype=torch.float32) * (r + 1))
    out["reduce_scatter_tensor"] = rs
    a2a = torch.empty(w)
    dist.all_to_all_single(a2a, torch.arange(w, dtype=torch.float32) + 100 * r)
    out["all_to_all_single"] = a2a
    # an in-place all_gather: the input is a view of the output (FSDP's pattern), aliasing kept across processes
    buf = torch.zeros(w * 3)
    part = buf.narrow(0, r * 3, 3)
    part.fill_(r + 1.0)
    dist.all_gather_into_tensor(buf, part)
    out["in_place_all_gather"] = buf
    # a non-contiguous tensor (a column of a matrix)
    mat = torch.arange(6, dtype=torch.float32).reshape(3, 2) * (r + 1)
    col = mat[:, 1]
    dist.all_reduce(col)
    out["column"] = mat
    # point to point: a ring, with isend/irecv, and a blocking exchange
    nxt, prv = (r + 1) % w, (r - 1) % w
    got = torch.empty(3)
    s = dist.isend(torch.full((3,), float(r)), nxt)
    q = dist.irecv(got, prv)
    s.wait()
    q.wait()
    out["ring"] = got
    # a subgroup and an async collective on it
    g = dist.new_group([0, 1])
    if r < 2:
        z = torch.tensor([r + 1.0, 2.0 * r])
        work = dist.all_reduce(z, group=g, async_op=True)
        work.wait()
        out["subgroup"] = z
    # tensors already in shared memory are used in place (no staging), twice to reuse the mapping
    sh = (torch.arange(5, dtype=torch.float32) + r).share_memory_()
    for _ in range(2):
        dist.all_reduce(sh)
    out["shared"] = sh
    dist.barrier()
    return out


def _expected(w: int) -> list[dict]:
    exp = []
    for r in range(w):
        e: dict = {}
        e["all_reduce"] = sum(torch.arange(4, dtype=torch.float64) * (k + 1) + 0.1 * k for k in range(w))
        e["max"] = torch.tensor([max(float(k * k - 3 * k) for k in range(w))])
        e["broadcast"] = torch.full((2, 3), float(w - 1))
        e["all_gather"] = torch.stack([torch.tensor([k, 10.0 * k]) for k in range(w)])
        e["all_gather_into_tensor"] = torch.cat([torch.tensor([k + 0.5, -k]) for k in range(w)])
        e["reduce_scatter_tensor"] = sum(torch.arange(2 * w, dtype=torch.float32) * (k + 1) for k in range(w))[2 * r:2 * r + 2]
        e["all_to_all_single"] = torch.tensor([r + 100.0 * k for k in range(w)])
        e["in_place_all_gather"] = torch.cat([torch.full((3,), k + 1.0) for k in range(w)])
        mat = torch.arange(6, dtype=torch.float32).reshape(3, 2) * (r + 1)
        mat[:, 1] = sum(torch.arange(6, dtype=torch.float32).reshape(3, 2)[:, 1] * (k + 1) for k in range(w))
        e["column"] = mat
        e["ring"] = torch.full((3,), float((r - 1) % w))
        e["shared"] = sum(torch.arange(5, dtype=torch.float32) + k for k in range(w)) * w
        if r < 2:
            e["subgroup"] = torch.tensor([3.0, 2.0])
        exp.append(e)
    return exp


# the hash-order program of issue 14: collectives issued while iterating a set of parameter names
PARAM_SHAPES = {"embed.weight": (4,), "attn.qkv": (3, 2), "mlp.fc1": (5,), "mlp.fc2": (2, 2), "norm.bias": (7,),
                "head.weight": (6,)}


def hash_order() -> list[str]:
    names = set(PARAM_SHAPES)  # iteration order follows the string hashes: PYTHONHASHSEED of the process
    for name in names:
        dist.all_reduce(torch.ones(PARAM_SHAPES[name]))
    return list(names)


# a Megatron-style "parallel state": process groups kept in module globals, set by initialize_model_parallel()
_TENSOR_MODEL_PARALLEL_GROUP = None
_DATA_PARALLEL_GROUP = None


def initialize_model_parallel(tp: int) -> None:
    global _TENSOR_MODEL_PARALLEL_GROUP, _DATA_PARALLEL_GROUP
    w, r = dist.get_world_size(), dist.get_rank()
    for start in range(0, w, tp):  # every rank creates every group (new_group is collective), keeps its own
        ranks = list(range(start, start + tp))
        g = dist.new_group(ranks)
        if r in ranks:
            _TENSOR_MODEL_PARALLEL_GROUP = g
    for j in range(tp):
        ranks = list(range(j, w, tp))
        g = dist.new_group(ranks)
        if r in ranks:
            _DATA_PARALLEL_GROUP = g


def get_tensor_model_parallel_group():  # noqa: ANN201
    return _TENSOR_MODEL_PARALLEL_GROUP


def get_data_parallel_group():  # noqa: ANN201
    return _DATA_PARALLEL_GROUP


def _mlp_weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 6, generator=g, dtype=torch.float64)  # the global batch
    w1 = torch.randn(6, 4, generator=g, dtype=torch.float64)
    w2 = torch.randn(4, 3, generator=g, dtype=torch.float64)
    return x, w1, w2


def tp_dp_mlp(tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D tensor x data parallel MLP step: column-parallel fc1, row-parallel fc2, data-parallel gradients."""
    initialize_model_parallel(tp)
    tpg, dpg = get_tensor_model_parallel_group(), get_data_parallel_group()
    tr, dr, dp = dist.get_rank(tpg), dist.get_rank(dpg), dist.get_world_size(dpg)
    x, w1, w2 = _mlp_weights()
    cols = w1.shape[1] // tp
    xb = x.chunk(dp)[dr]
    w1p = w1[:, tr * cols:(tr + 1) * cols].clone().requires_grad_()
    w2p = w2[tr * cols:(tr + 1) * cols].clone().requires_grad_()
    partial = torch.relu(xb @ w1p) @ w2p
    full = partial.detach().clone()
    dist.all_reduce(full, group=tpg)  # row-parallel output: the sum of the partial products
    y = partial + (full - partial).detach()  # d loss / d partial = d loss / d y
    (y ** 2).sum().backward()
    for p in (w1p, w2p):
        dist.all_reduce(p.grad, group=dpg)
    return w1p.grad, w2p.grad


def reference_mlp_grads() -> tuple[torch.Tensor, torch.Tensor]:
    x, w1, w2 = _mlp_weights()
    w1, w2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    ((torch.relu(x @ w1) @ w2) ** 2).sum().backward()
    return w1.grad, w2.grad


def dies_after_first(how: str) -> None:
    x = torch.ones(2)
    dist.all_reduce(x)
    if dist.get_rank() == 1:
        if how == "os._exit":
            os._exit(3)
        if how == "os._exit(0)":
            os._exit(0)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "sys.exit":
            sys.exit(5)
        if how == "raise":
            raise KeyError("rank one's own error")
    dist.all_reduce(x)


def fails_while_a_peer_blocks_in_the_os() -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        raise ValueError("rank zero fails")
    r, _ = os.pipe()
    os.read(r, 1)  # a wait in C that nothing ends (as torch's own RPC shutdown waits for a failed peer)


def leaves_a_child() -> int:
    """Start a long-lived process and return its pid (teardown must not leave it behind)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    dist.barrier()
    return p.pid


def deadlocks() -> None:
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 returns without joining


def recv_deadlock() -> None:
    dist.recv(torch.empty(1), (dist.get_rank() + 1) % dist.get_world_size())


def rng_and_globals() -> tuple[torch.Tensor, int, str]:
    torch.set_default_dtype(torch.float64)  # process-wide: stays in this rank's process
    x = torch.randn(3)
    dist.all_reduce(x)
    os.environ["TP_ISOLATION_PROBE"] = str(dist.get_rank())
    return x, os.getpid(), os.environ["PYTHONHASHSEED"]


def ddp_step() -> list[torch.Tensor]:
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    tdist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + tdist.get_rank())
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4, generator=g)).pow(2).sum().backward()
        opt.step()
    out = [p.detach().clone() for p in model.parameters()]
    tdist.destroy_process_group()
    return out


def fsdp2_and_dtensor() -> tuple:
    import torch.distributed as tdist
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    tdist.init_process_group("gloo")
    r, w = tdist.get_rank(), tdist.get_world_size()
    mesh = init_device_mesh("cpu", (w,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(5 + r)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(2, 5, generator=g, dtype=torch.float64)).pow(2).sum().backward()
        opt.step()
    params = [p.full_tensor().detach().clone() for p in model.parameters()]
    dt = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
    total = (dt * 2).sum().full_tensor()
    y = fc.wait_tensor(fc.all_reduce(torch.full((2,), float(r + 1)), "sum", mesh))
    return params, dt.to_local().clone(), total, y


def autograd_all_reduce() -> torch.Tensor:
    from tensorplay.distributed.nn import functional as dfn

    x = torch.tensor([1.0, 2.0]) * (dist.get_rank() + 1)
    x.requires_grad_()
    y = dfn.all_reduce(x * x)
    y.sum().backward()
    return x.grad


def computes_forever() -> None:
    dist.barrier()
    if dist.get_rank() == 1:
        while True:
            pass
    dist.barrier()


def report_pid_then_wait() -> None:
    print(f"pid {os.getpid()}", flush=True)
    dist.barrier()
    import time

    time.sleep(120)


_RUNS: list[int] = []  # a module global the rank processes append to


def fresh_globals_and_start_env(var: str) -> tuple:
    """What a rank process sees of earlier runs (nothing) and of the environment its interpreter started with."""
    _RUNS.append(dist.get_rank())
    with open("/proc/self/environ", "rb") as f:  # the environment the process was *started* with
        start_env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    print(f"rank {dist.get_rank()} says hello on stdout", flush=True)
    return (list(_RUNS), os.environ.get(var), start_env.get(var.encode(), b"").decode(), hash("tensorplay"),
            os.environ.get("RANK"), os.getppid())


_REMEMBERED: list[int] = []  # appended to by RPCs, in the process of the worker they run on


def _remember(r: int) -> int:
    _REMEMBERED.append(r)
    return os.getpid()


def _refuse(r: int) -> None:
    raise ValueError(f"refused on {dist.get_rank()} for {r}")


def rpc_program() -> tuple:
    """tensorplay.distributed.rpc between rank processes, with no rendezvous of the program's own."""
    import tensorplay.distributed.rpc as rpc

    r = dist.get_rank()
    rpc.init_rpc(f"worker{r}")  # rank and world size from the simulated world, as on thread ranks
    peer = f"worker{(r + 1) % dist.get_world_size()}"
    summed = rpc.rpc_sync(peer, torch.add, args=(torch.ones(2), r))
    where = rpc.rpc_sync("worker0", _remember, args=(r,))  # runs in rank 0's process
    try:
        rpc.rpc_sync(peer, _refuse, args=(r,))
        error = None
    except ValueError as e:  # remote exceptions keep their type
        error = str(e)
    rpc.shutdown()  # graceful: every worker's calls are done after it
    return summed, where, os.getpid(), error, sorted(_REMEMBERED)


def crash_fault() -> None:
    for _ in range(4):
        dist.all_reduce(torch.ones(1))


def waits_between_collectives(seconds: float) -> tuple[float, float]:
    """A wait between two all_reduces, timed by wall clock (a stand-in for each rank's own compute)."""
    dist.all_reduce(torch.ones(1))
    t0 = time.time()
    time.sleep(seconds)
    t1 = time.time()
    dist.all_reduce(torch.ones(1))
    return t0, t1


def many_threads(coordinator: int, n: int) -> tuple[int, int]:
    """Start ``n`` communicating threads one after another; the coordinator's open descriptors after 1 and n."""
    def fds() -> int:
        return len(os.listdir(f"/proc/{coordinator}/fd"))

    x = torch.ones(1)
    counts = []
    for i in range(n):
        t = threading.Thread(target=dist.all_reduce, args=(x,))
        t.start()
        t.join()
        if i in (0, n - 1):
            dist.barrier()  # (every rank's thread has ended)
            counts.append(fds())
    return counts[0], counts[1]


def _forked_worker(q) -> None:  # noqa: ANN001  (a DataLoader-style worker forked from a rank process)
    t = threading.Thread(target=q.put, args=("its own thread ran",))
    t.start()
    t.join()
    try:
        dist.all_reduce(torch.ones(1))
        q.put("communicated")
    except dist.DistRuntimeError as e:
        q.put(str(e))


def forks_a_worker() -> tuple:
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_forked_worker, args=(q,))
    p.start()
    got = (q.get(timeout=60), q.get(timeout=60))
    p.join(60)
    x = torch.ones(1)
    dist.all_reduce(x)  # the rank's channel is intact
    return got, p.exitcode, x.item()


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------
def _survivors(pids: list[int], within: float = 10.0) -> list[int]:
    """The processes of ``pids`` still alive after ``within`` seconds (a SIGKILL takes a moment to land)."""
    import time

    deadline = time.monotonic() + within
    alive = [p for p in pids if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p)]
    return alive


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for every purpose but the table entry
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_warm_forks_are_clean_seeded_and_see_the_current_environment_and_stdio(monkeypatch, capfd):
    """Forks of warm interpreters: no state from earlier runs, the hash seed and import-time environment of a
    fresh interpreter, and the caller's current stdout."""
    from simulator.isolation import warm

    first = simulator.run(fresh_globals_and_start_env, 2, args=("TP_WARM_PROBE",), isolation="process")
    monkeypatch.setenv("TP_WARM_PROBE", "second")  # a changed environment: warm interpreters started with it
    second = simulator.run(fresh_globals_and_start_env, 2, args=("TP_WARM_PROBE",), isolation="process",
                           torchrun_env=True)
    assert all(o[5] != os.getpid() for o in first + second)  # forks of warm interpreters, not children of this one
    assert [o[0] for o in first] == [[0], [1]] and [o[0] for o in second] == [[0], [1]]  # nothing carried over
    assert [o[1:3] for o in first] == [(None, "")] * 2
    assert [o[1:3] for o in second] == [("second", "second")] * 2  # in os.environ *and* at interpreter start
    assert [o[4] for o in second] == ["0", "1"]  # per-rank variables are set after the fork
    out = capfd.readouterr().out
    assert "rank 0 says hello on stdout" in out and "rank 1 says hello on stdout" in out
    # the same hash order as interpreters spawned afresh with the same seeds (TENSORPLAY_SIM_WARM=0)
    monkeypatch.setenv("TENSORPLAY_SIM_WARM", "0")
    assert not warm.enabled()
    spawned = simulator.run(fresh_globals_and_start_env, 2, args=("TP_WARM_PROBE",), isolation="process",
                            torchrun_env=True)
    assert all(o[5] == os.getpid() for o in spawned)
    assert [o[3] for o in spawned] == [o[3] for o in second] and second[0][3] != second[1][3]
    assert [o[:3] for o in spawned] == [o[:3] for o in second]


def imports_wave() -> bool:
    """Whether ``wave`` (a library no other test imports) was imported before the rank's function ran."""
    was = "wave" in sys.modules
    import wave  # noqa: F401

    return was


def test_warm_interpreters_import_ahead_between_runs():
    """The libraries a world's rank processes imported are imported by their warm interpreters right after the
    run (not when the next world starts): the next world's rank processes find them loaded."""
    from simulator.isolation import warm

    seed = 7707  # (warm interpreters of their own: no other test imports wave into them)
    assert simulator.run(imports_wave, 2, isolation="process", seed=seed) == [False, False]
    mine = [s for key, s in warm.POOL._servers.items()
            if dict(key).get("PYTHONHASHSEED") in {str(hash_seed(seed, r)) for r in range(2)}]
    assert len(mine) == 2
    deadline = time.monotonic() + 120
    for s in mine:
        with s.lock:
            while s.loading and time.monotonic() < deadline:
                s.drain()
                time.sleep(0.05)
        assert not s.loading and "wave" in s.preload[:s.sent]  # imported ahead before any fork asked
    assert simulator.run(imports_wave, 2, isolation="process", seed=seed) == [True, True]


def _world_in_forked_child(q) -> None:  # noqa: ANN001
    from simulator.isolation import warm

    q.put((len(warm.POOL._servers), simulator.run(dist.get_world_size, 2, isolation="process")))


def test_a_forked_coordinator_starts_its_own_warm_interpreters():
    """A process forked from a coordinator does not share its parent's warm interpreters (one coordinator each)."""
    import multiprocessing as mp

    from simulator.isolation import warm

    simulator.run(dist.get_world_size, 2, isolation="process")
    before = dict(warm.POOL._servers)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_world_in_forked_child, args=(q,))
    p.start()
    try:
        assert q.get(timeout=120) == (0, [2, 2])
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert p.exitcode == 0
    assert warm.POOL._servers == before and all(s.alive() for s in before.values())
    assert simulator.run(dist.get_world_size, 2, isolation="process") == [2, 2]


@pytest.mark.parametrize("mode", ["coop", "threads"])
def test_rpc_between_rank_processes_runs_in_the_callees_process(mode):
    """A call runs in the callee's process, with its globals, in both schedules."""
    outs = simulator.run(rpc_program, 3, isolation="process", mode=mode)
    pids = [o[2] for o in outs]
    for r, (summed, where, _, error, remembered) in enumerate(outs):
        assert torch.equal(summed, torch.ones(2) + r)
        assert where == pids[0]  # the function ran in rank 0's process ...
        assert error == f"refused on {(r + 1) % 3} for {r}"
        assert remembered == ([0, 1, 2] if r == 0 else [])  # ... and only its globals saw it


def rpc_with_faults() -> tuple:
    """Calls of every kind under seeded message faults: which ones are lost depends on the seed only."""
    import tensorplay.distributed.rpc as rpc
    from tensorplay.distributed.rpc.errors import RpcTimeoutError
    from simulator.rpc import MessageFaults, SimRpcBackendOptions

    r = dist.get_rank()
    faults = MessageFaults(drop=0.25, delay=0.5, max_delay_s=0.01, seed=11)
    # (a long timeout: a call that runs longer than it fails by the wall clock, which no seed fixes)
    rpc.init_rpc(f"w{r}", rpc_backend_options=SimRpcBackendOptions(rpc_timeout=300, faults=faults))
    peer = f"w{(r + 1) % dist.get_world_size()}"
    lost, got = [], []
    for i in range(8):
        try:
            got.append(rpc.rpc_sync(peer, torch.add, args=(torch.ones(1), 10 * r + i)).item())
        except RpcTimeoutError:
            lost.append(i)
    futs = [rpc.rpc_async(peer, torch.mul, args=(torch.ones(1), i)) for i in range(4)]
    asyncs = []
    for f in futs:
        try:
            asyncs.append(f.wait().item())
        except RpcTimeoutError:
            asyncs.append(None)
    ref = rpc.remote(peer, torch.full, args=((2,), float(r)))
    try:
        remote = ref.to_here().tolist()
    except RpcTimeoutError:
        remote = None
    rpc.shutdown()
    return lost, got, asyncs, remote


def test_rpc_between_rank_processes_is_simulated_as_between_thread_ranks():
    """The simulator carries process ranks' RPC as thread ranks': the same seeded message faults (the same calls
    are lost), the same trace, RPC events included, the same results; and the run is a function of its seed."""
    proc = simulator.check_reproducible(rpc_with_faults, 3, seed=5, isolation="process")
    thread = simulator.check_reproducible(rpc_with_faults, 3, seed=5)
    assert proc.signature() == thread.signature()
    assert {e.op for e in proc.events} >= {"rpc_sync", "rpc_async", "remote"}
    outs = simulator.run(rpc_with_faults, 3, seed=5, isolation="process")
    assert outs == simulator.run(rpc_with_faults, 3, seed=5)
    assert any(lost for lost, *_ in outs), outs  # (faults were drawn: some call was lost)


def echo(x: object) -> object:
    return x


def rpc_large_tensors() -> list:
    """Tensors of every kind there and back between two workers; the large plain ones cross rank processes
    through shared memory."""
    import tensorplay.distributed.rpc as rpc

    r = dist.get_rank()
    rpc.init_rpc(f"w{r}")
    g = torch.Generator().manual_seed(r)
    sent = [torch.randn(300_000, generator=g), torch.randn(400, 400, generator=g).to(torch.bfloat16),
            torch.randn(600, 300, generator=g).t(), torch.arange(300_000) % 3 == 0,
            torch.randn(70_000, 2, generator=g).requires_grad_(), torch.ones(3)]
    back = rpc.rpc_sync(f"w{1 - r}", echo, args=(sent,))
    rpc.shutdown()
    from simulator.rpc import codec

    where = codec.stage_dir  # (None on thread ranks) and what is left there: each file is removed as it is read
    left = sorted(f for f in os.listdir(where) if f.startswith("rpc-")) if where else None
    return [(torch.equal(a, b), b.dtype, b.stride(), b.requires_grad, b.is_contiguous()) for a, b in zip(sent, back)
            ], where is not None, left, next(codec._stage_ids)


def test_large_tensors_cross_rank_processes_through_shared_memory():
    proc = simulator.World(2, isolation="process", seed=3)
    outs = proc.run(rpc_large_tensors)
    thread = simulator.World(2, seed=3)
    threads_out = thread.run(rpc_large_tensors)
    assert [o[0] for o in outs] == [o[0] for o in threads_out]
    # each rank process staged its request's 3 large plain tensors and its answer's 3 (the next id is 7);
    # nothing is left once read
    assert [o[1:] for o in outs] == [(True, [], 7)] * 2
    for out, *_ in outs:
        assert all(equal for equal, *_ in out)
        assert [o[1:] for o in out] == [(torch.float32, (1,), False, True), (torch.bfloat16, (400, 1), False, True),
                                        (torch.float32, (1, 300), False, False), (torch.bool, (1,), False, True),
                                        (torch.float32, (2, 1), True, True), (torch.float32, (1,), False, True)]
    # the trace counts a staged tensor's bytes, as thread ranks count the tensor's
    assert [e.signature() for e in proc.trace.events] == [e.signature() for e in thread.trace.events]


def test_isolations_listed_once():
    assert ISOLATIONS == ("thread", "process")
    with pytest.raises(dist.DistValueError, match=r"isolation='fork'.*available=\['thread', 'process'\]"):
        simulator.World(2, isolation="fork")


def test_collectives_p2p_match_reference_and_thread_mode_bitwise():
    w = 3
    world = simulator.World(w, seed=4, isolation="process")
    procs = world.run(collectives_and_p2p)
    threads = simulator.run(collectives_and_p2p, w, seed=4)
    for r, (got, exp, thr) in enumerate(zip(procs, _expected(w), threads)):
        assert got.keys() == exp.keys(), r
        for k in exp:
            torch.testing.assert_close(got[k], exp[k], msg=f"rank {r} {k}")
            assert torch.equal(got[k], thr[k]), f"rank {r} {k}: process and thread mode differ"
    # the same trace (ops, groups, sequence numbers, call sites) as thread ranks
    assert world.trace.signature() == simulator.last_trace().signature()
    assert all(e.site.startswith("test_sim_isolation.py:") for e in world.trace.events)
    assert world.hash_seeds == [hash_seed(4, r) for r in range(w)]
    assert len(set(world.hash_seeds)) == w


def test_hash_order_program_fails_deterministically_with_call_sites_and_hash_seeds():
    # thread ranks share one interpreter, hence one hash order: the bug is invisible there
    simulator.run(hash_order, 3)
    messages, signatures = [], []
    for _ in range(2):  # same seed, same failure, same trace
        world = simulator.World(3, isolation="process")
        with pytest.raises(simulator.CollectiveMismatchError) as info:
            world.run(hash_order)
        signatures.append(world.trace.signature())
        text = str(info.value) + "\n".join(getattr(info.value, "__notes__", ()))
        messages.append(str(info.value))
        line = hash_order.__code__.co_firstlineno + 3
        assert f"test_sim_isolation.py:{line}" in text
        for r in range(3):
            assert f"{r}={hash_seed(0, r)}" in text
        assert "PYTHONHASHSEED" in text
        assert "replay with simulator.run(fn, 3, seed=0, mode='coop', isolation='process')" in text
    assert messages[0] == messages[1]
    assert signatures[0] == signatures[1]


def test_module_globals_parallel_state_matches_single_process_reference():
    tp = 2
    outs = simulator.run(tp_dp_mlp, 4, args=(tp,), isolation="process")
    g1, g2 = reference_mlp_grads()
    cols = g1.shape[1] // tp
    for r, (d1, d2) in enumerate(outs):
        tr = r % tp
        torch.testing.assert_close(d1, g1[:, tr * cols:(tr + 1) * cols], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(d2, g2[tr * cols:(tr + 1) * cols], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("how,code", [("os._exit", 3), pytest.param("sigkill", -9, marks=pytest.mark.slow),
                                      pytest.param("sys.exit", 5, marks=pytest.mark.slow)])
def test_rank_death_is_a_rank_failure_on_every_rank(how, code):
    world = simulator.World(3, isolation="process")
    with pytest.raises(simulator.RankExitError) as info:
        world.run(dies_after_first, args=(how,))
    assert info.value.rank == 1 and info.value.exit_code == code
    if how == "sigkill":
        assert "SIGKILL" in str(info.value)
    for r in (0, 2):
        assert isinstance(world.errors[r], simulator.RankFailedError)
        assert world.errors[r].failed_rank == 1
    from simulator import isolation

    assert not _survivors(isolation.last_pids)


def test_a_rank_failure_ends_the_processes_blocked_where_the_simulator_cannot_reach():
    # torchrun and mp.spawn end the other processes when one fails; a rank process blocked in the OS after
    # another rank failed is killed after a short grace, and the run reports the first failure
    world = simulator.World(3, isolation="process", timeout=120)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="rank zero fails"):
        world.run(fails_while_a_peer_blocks_in_the_os)
    assert time.monotonic() - t0 < 60
    for r in (1, 2):
        assert isinstance(world.errors[r], simulator.RankFailedError) and world.errors[r].failed_rank == 0
    from simulator import isolation

    assert not _survivors(isolation.last_pids)


def test_os_exit_zero_is_a_rank_that_returned():
    # torchrun counts it a success; the rank's peers then wait for it in vain: a deadlock naming it
    world = simulator.World(2, isolation="process")
    with pytest.raises(simulator.DeadlockError, match="rank 1 has returned"):
        world.run(dies_after_first, args=("os._exit(0)",))
    assert world.errors[1] is None and world.results[1] is None


def test_program_error_keeps_its_type_and_traceback():
    with pytest.raises(KeyError, match="rank one's own error") as info:
        simulator.run(dies_after_first, 2, args=("raise",), isolation="process")
    notes = "\n".join(info.value.__notes__)
    assert "traceback in rank 1's process" in notes and "dies_after_first" in notes
    assert info.value.rank == 1


def test_teardown_leaves_no_process_behind():
    from simulator import isolation

    pids = simulator.run(leaves_a_child, 2, isolation="process")
    assert not _survivors(isolation.last_pids + pids)


def test_deadlocks_named_by_counting():
    with pytest.raises(simulator.DeadlockError, match=r"rank 0 waits in all_reduce #1 .*test_sim_isolation.py"):
        simulator.run(deadlocks, 2, isolation="process", timeout=60)
    with pytest.raises(simulator.DeadlockError, match="recv"):
        simulator.run(recv_deadlock, 2, isolation="process", timeout=60)


def test_coop_rank_processes_compute_at_once_on_the_seeded_schedule():
    """In coop mode a rank process is answered when its collective completes, not when its turn comes back.

    So the ranks' compute between two collectives runs at once, as on torchrun (thread ranks in coop mode
    compute one at a time), while the schedule, and so the trace, stays the seed's: the same as thread ranks.
    """
    w = 4
    world = simulator.World(w, seed=3, isolation="process")
    spans = world.run(waits_between_collectives, (1.0,))
    assert max(t0 for t0, _ in spans) < min(t1 for _, t1 in spans), spans  # every rank waited at the same time
    simulator.run(waits_between_collectives, w, seed=3, args=(0.0,))
    assert world.trace.signature() == simulator.last_trace().signature()


def test_a_process_forked_from_a_rank_process_is_not_the_rank():
    """Its threads are plain threads, and a call on the inherited channel is refused with the fix."""
    for (ran, refused), code, total in simulator.run(forks_a_worker, 2, isolation="process"):
        assert ran == "its own thread ran" and code == 0 and total == 2.0
        assert "a process forked from a rank process is not a rank" in refused and "Fix:" in refused


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_an_ended_threads_channel_is_closed():
    """A program may start threads without end: the coordinator keeps no channel of a thread that has ended."""
    for first, last in simulator.run(many_threads, 2, args=(os.getpid(), 200), isolation="process"):
        assert last - first < 20, (first, last)  # 199 more threads: one socket each while they lived


def test_process_state_is_per_rank_and_seeded():
    outs = simulator.run(rng_and_globals, 2, seed=3, isolation="process")
    again = simulator.run(rng_and_globals, 2, seed=3, isolation="process")
    thread = simulator.run(lambda: torch.randn(3), 2, seed=3)
    assert outs[0][0].dtype == torch.float64 and torch.get_default_dtype() == torch.float32
    assert "TP_ISOLATION_PROBE" not in os.environ
    assert outs[0][1] != outs[1][1] != os.getpid()
    assert [o[2] for o in outs] == [str(hash_seed(3, r)) for r in range(2)]
    torch.testing.assert_close(outs[0][0], again[0][0], rtol=0, atol=0)
    # each rank starts from the same torch seed as its thread twin (an unseeded program)
    torch.testing.assert_close(outs[0][0], (thread[0] + thread[1]).double())


def test_ddp_and_autograd_collectives_bitwise_equal_to_thread_mode():
    procs = simulator.run(ddp_step, 2, isolation="process")
    threads = simulator.run(ddp_step, 2)
    for a, b in zip(procs, threads):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for p, t in zip(procs[0], procs[1]):
        assert torch.equal(p, t)  # DDP keeps the replicas identical
    grads = simulator.run(autograd_all_reduce, 2, isolation="process")
    for r, g in enumerate(grads):  # d/dx_r sum(all_reduce(x*x)) summed over ranks' backward = 2 * x_r * W
        torch.testing.assert_close(g, 2 * torch.tensor([1.0, 2.0]) * (r + 1) * 2)


@pytest.mark.slow
def test_fsdp2_and_dtensor_bitwise_equal_to_thread_mode():
    procs = simulator.run(fsdp2_and_dtensor, 2, isolation="process")
    threads = simulator.run(fsdp2_and_dtensor, 2)
    for a, b in zip(procs, threads):
        for x, y in zip(a[0], b[0]):
            assert torch.equal(x, y)
        for x, y in zip(a[1:], b[1:]):
            assert torch.equal(x, y)
    torch.testing.assert_close(procs[1][1], torch.arange(6.0, 12.0).reshape(2, 3))
    torch.testing.assert_close(procs[0][2], torch.tensor(132.0))
    torch.testing.assert_close(procs[0][3], torch.full((2,), 3.0))


@pytest.mark.slow
def test_faults_and_virtual_time():
    with pytest.raises(simulator.InjectedFault):
        simulator.run(crash_fault, 2, isolation="process", faults=[simulator.Crash(rank=1, at=3)])
    world = simulator.World(2, isolation="process", faults=[simulator.Delay(rank=0, seconds=0.5)])
    world.run(crash_fault)
    assert world.trace.summary()[1]["end_vtime"] >= 2.0 if "end_vtime" in world.trace.summary()[1] else True
    assert max(e.vend for e in world.trace.events) >= 2.0


@pytest.mark.slow
def test_check_reproducible_in_process_mode():
    trace = simulator.check_reproducible(collectives_and_p2p, 3, seed=5, isolation="process")
    assert trace.events


@pytest.mark.slow
def test_timeout_kills_a_rank_process_stuck_computing():
    from simulator import isolation

    with pytest.raises(simulator.SimTimeoutError) as info:
        simulator.run(computes_forever, 2, isolation="process", timeout=45)
    assert "rank 1" in str(info.value)
    assert not _survivors(isolation.last_pids)


@pytest.mark.slow
def test_rank_processes_die_with_a_killed_coordinator():
    code = textwrap.dedent("""
        import os, time, simulator, tensorplay.distributed as dist
        import test_sim_isolation as t
        simulator.run(t.report_pid_then_wait, 2, isolation="process", timeout=300)
    """)
    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.Popen([sys.executable, "-c", code], cwd=here, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": here})
    try:
        pids = [int(p.stdout.readline().split()[1]) for _ in range(2)]
    finally:
        p.kill()
        p.wait(timeout=60)
    assert not _survivors(pids, within=20.0)


def test_cli_isolation_process(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as tdist
        _STATE = []                                   # a module global: one per rank process
        tdist.init_process_group("gloo")
        _STATE.append(tdist.get_rank())
        x = torch.tensor([float(tdist.get_rank() + 1)])
        tdist.all_reduce(x)
        print(f"rank {tdist.get_rank()} sum {x.item():g} state {_STATE} hashseed {os.environ['PYTHONHASHSEED']}")
    """))
    p = subprocess.run([sys.executable, "-m", "simulator", "--isolation", "process", "--nproc-per-node", "2",
                        str(script)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    # two processes share the pipe, as under torchrun: their lines may interleave, so match the records
    lines = sorted(re.findall(r"rank \d sum \d state \[\d\] hashseed \d+", p.stdout))
    assert lines == [f"rank {r} sum 3 state [{r}] hashseed {hash_seed(0, r)}" for r in range(2)]


@pytest.mark.world_size(2, isolation="process")
def test_pytest_marker_runs_each_rank_in_its_own_process(rank, world_size):
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    assert x.item() == 3.0 and world_size == 2
    assert os.environ["PYTHONHASHSEED"] == str(hash_seed(0, rank))


def _destroy_then_init_again() -> tuple:
    dist.init_process_group("gloo")
    r = dist.get_rank()
    dist.destroy_process_group()
    dead = dist.is_initialized()
    dist.init_process_group("gloo")  # as torchrun's processes may: a new default group over the same ranks
    x = torch.full((2,), float(r + 1))
    dist.all_reduce(x)
    dist.destroy_process_group()
    try:
        dist.init_process_group("gloo", rank=1 - r, world_size=2)  # a rank the simulated one is not
        wrong = "accepted"
    except dist.DistError as e:
        wrong = str(e)
    return dead, x.tolist(), dist.is_initialized(), wrong


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_destroyed_default_group_is_made_again_on_the_simulated_world(isolation):
    """After destroy_process_group, init_process_group joins the rank's simulated world again (it used to fall
    through to a real gloo rendezvous and wait there, holding the schedule), and still checks what it is given."""
    for r, (dead, values, after_wrong, wrong) in enumerate(simulator.run(_destroy_then_init_again, 2,
                                                                           isolation=isolation, timeout=60)):
        assert not dead and values == [3.0, 3.0] and not after_wrong
        assert f"the program asks for rank={1 - r}, but this simulated rank has rank={r}" in wrong


def _wait_timeouts() -> tuple:
    dist.init_process_group("gloo")
    x = torch.full((2,), float(dist.get_rank() + 1))
    done = dist.all_reduce(x, async_op=True).wait(timeout=1.5)  # seconds, as torch's binding takes them
    try:
        dist.all_reduce(torch.ones(1), async_op=True).wait(timeout="soon")  # refused whether it is done or not
        wrong = "accepted"
    except dist.DistError as e:
        wrong = str(e)
    return done, x.tolist(), wrong


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_work_wait_takes_seconds_or_a_timedelta_and_refuses_anything_else(isolation):
    for done, values, wrong in simulator.run(_wait_timeouts, 2, isolation=isolation, timeout=60):
        assert done is True and values == [3.0, 3.0]
        assert wrong.startswith("tensorplay.distributed.Work.wait: timeout must be") and "timeout='soon'" in wrong
        assert "Fix: pass e.g." in wrong


def _tensorplay_init_then_torch() -> tuple:
    dist.init_process_group("gloo")
    made = torch.distributed.is_initialized()  # as on gloo: tensorplay's init makes torch's default group too
    x = torch.full((2,), float(dist.get_rank() + 1))
    torch.distributed.all_reduce(x)
    try:
        dist.init_process_group("gloo")  # twice, without destroy_process_group: refused, as on gloo
        twice = "accepted"
    except dist.DistError as e:
        twice = str(e)
    dist.destroy_process_group()
    return made, x.tolist(), twice, torch.distributed.is_initialized()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_tensorplay_init_makes_torchs_default_group_and_refuses_a_second_init(isolation):
    for made, values, twice, after in simulator.run(_tensorplay_init_then_torch, 2, isolation=isolation, timeout=60):
        assert made and values == [3.0, 3.0] and not after
        assert "init_process_group" in twice and "the default process group is already initialised" in twice
        assert "backend='gloo'" in twice and "Fix: call destroy_process_group() before initialising again" in twice


def _skips_a_collective() -> None:
    import torch.distributed as tdist

    tdist.init_process_group("gloo")
    if tdist.get_rank() == 0:
        tdist.all_reduce(torch.ones(2))  # (rank 1 goes straight to the barrier)
    tdist.barrier()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_simulator_error_shows_where_the_program_called(isolation: str) -> None:
    """A mismatch the simulator raises is reported with the program's frames (the call that disagreed), on rank
    processes as on thread ranks, not with the coordinator's own frames."""
    from simulator.core.errors import CollectiveMismatchError
    from simulator.core.tracebacks import format_rank_traceback

    with pytest.raises(CollectiveMismatchError) as info:
        simulator.run(_skips_a_collective, 2, isolation=isolation, timeout=60)
    shown = format_rank_traceback(info.value)
    assert f'{__file__}", line' in shown and "in _skips_a_collective" in shown, shown
    assert "proxy_handlers.py" not in shown and "simulator/world.py" not in shown, shown
