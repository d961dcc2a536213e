"""RPC, RRef, RemoteModule, distributed autograd and DistributedOptimizer, on both transports.

Part 1 runs every behaviour the two transports share once per backend: the
``rpc_world`` fixture is a simulated world (threads of this process,
milliseconds; in ``coop`` and, where it matters, ``threads`` mode) or a warm
pool of three real TensorPipe processes on 127.0.0.1 (one pool per module:
starting a process costs seconds).  One body per behaviour: the cases live in
``tests/_support/rpc_cases.py``, run on ``worker0`` and return what they saw.
Part 2 is what only the simulator has (faults by seed, the trace, replay,
coop scheduling), part 3 what only real processes have (the rendezvous,
listening sockets, a killed process; the dead-worker test kills a worker, so
it comes last and leaves the pool to be restarted).

Under ``pytest -n 2 --dist loadgroup`` every TensorPipe test carries the
same xdist group, so they share one pool on one xdist worker.
"""
from __future__ import annotations

import os
import pickle
import time
import warnings

import pytest
import torch

from _support.net import LOOPBACK, listening

import simulator
import tensorplay as tp
import tensorplay.distributed as dist
import tensorplay.distributed.autograd as dist_autograd
import tensorplay.distributed.rpc as rpc
from tensorplay.distributed import DistRuntimeError, DistTypeError, DistValueError, NotInitializedError
from tensorplay.distributed.nn import RemoteModule
from tensorplay.distributed.nn.api import InterfaceError
from tensorplay.distributed.rpc import (
    RemoteError,
    RpcTimeoutError,
    WorkerUnavailableError,
)
from tensorplay.testing import RpcPool
from simulator.rpc import MessageFaults, SimRpcBackendOptions

from _support import rpc_cases as C
from _support.rpc_cases import drive

CALL_TIMEOUT_S = float(os.environ.get("TENSORPLAY_TEST_CALL_TIMEOUT", "60"))
#: the marks of a test (or a parameter) that uses the TensorPipe pool
TP = [pytest.mark.gloo, pytest.mark.xdist_group("rpc-tensorpipe")]


@pytest.fixture(scope="module")
def tp_pool():
    p = RpcPool(3, rpc_timeout=20.0, call_timeout=CALL_TIMEOUT_S)
    p.start()
    yield p
    p.close()


def backends(*, modes: bool = False) -> list:
    """The ``rpc_world`` parameters: the simulator (in both scheduling modes with ``modes``) and TensorPipe."""
    ms = ("coop", "threads") if modes else ("coop",)
    sims = [pytest.param((kind, m), id=f"{kind}-{m}" if modes else kind)
            for kind in ("sim", "sim-process") for m in ms]
    # rank processes talk over TensorPipe; from init_rpc on their compute runs outside the coop schedule
    # (simulator/isolation/rpc_process.py)
    return sims + [pytest.param(("tensorpipe", None), id="tensorpipe", marks=TP)]


@pytest.fixture
def rpc_world(request) -> C.RpcWorld:
    kind, mode = request.param
    if kind == "tensorpipe":
        return C.RpcWorld(kind, pool=request.getfixturevalue("tp_pool"))
    return C.RpcWorld(kind, mode=mode)


def on_backends(*, modes: bool = False):
    return pytest.mark.parametrize("rpc_world", backends(modes=modes), indirect=True)


# ---------------------------------------------------------------------------
# part 1: one body per behaviour, on every transport
# ---------------------------------------------------------------------------
@on_backends(modes=True)
def test_documented_example(rpc_world):
    C.check_documented_example(rpc_world.run(C.documented_example))


@on_backends()
def test_rrefs_inside_answers_are_the_receivers(rpc_world):
    out = rpc_world.run(C.rrefs_in_answers)
    assert out == {"inner": [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]], "kept": [7.0]}, out


@on_backends(modes=True)
def test_async_execution_and_torch_futures(rpc_world):
    C.check_async(rpc_world.run(C.async_cases, 3))


@on_backends()
def test_calls_by_value_exceptions_and_futures(rpc_world):
    C.check_calls(rpc_world.run(C.calls, 3))


@on_backends()
def test_rref_rules(rpc_world):
    C.check_rrefs(rpc_world.run(C.rrefs, 3))


@on_backends()
def test_remote_module_construction_errors(rpc_world):
    C.check_construction_errors(rpc_world.run(C.construction_errors))


@on_backends()
def test_remote_module_every_unsupported_method_raises(rpc_world):
    C.check_unsupported_methods(rpc_world.run(C.unsupported_methods))


@on_backends()
def test_remote_module_passed_over_rpc(rpc_world):
    C.check_passed_over_rpc(rpc_world.run(C.passed_over_rpc, 3))


@on_backends()
def test_interface_enforcement(rpc_world):
    C.check_interface(rpc_world.run(C.interface_cases))


@on_backends(modes=True)
def test_training_matches_local_reference(rpc_world):
    C.check_training(rpc_world.run(C.training, steps=4))


@on_backends()
def test_two_hop_autograd_matches_local(rpc_world):
    out = rpc_world.run(C.two_hop_autograd, 3)
    assert out["grad_close"] and out["x_grad_untouched"], out


@on_backends()
def test_timeout_is_honoured(rpc_world):
    out = rpc_world.run(C.timeout_case)
    C.check_timeout(out)
    if rpc_world.kind == "tensorpipe":
        # real time: TensorPipe returns at the timeout while the callee still sleeps (the simulator's
        # clock for a call is virtual, so only check_timeout's bound applies there)
        assert out["sync_s"] < 0.6


# ---------------------------------------------------------------------------
# part 2: simulator-only behaviour
# ---------------------------------------------------------------------------
def test_rpc_async_completes_as_the_callee():
    def body():
        fut = rpc.rpc_async("worker1", C.whoami)
        before = fut.done()  # the handler runs on a thread of worker1's rank, not inline
        return before, fut.wait(), fut.done()

    before, who, after = drive(body)
    assert not before and after
    assert who == ("worker1", 1, 1)  # rpc identity, dist rank, and the rank of get_worker_info().id


_SERVED: dict = {}


def _slow_record(key: str, x: torch.Tensor) -> int:
    y = x
    for _ in range(50):  # some compute on the callee's handler thread
        y = torch.tanh(y + 1)
    _SERVED[key] = (dist.get_rank(), rpc.get_worker_info().name, y.clone())
    return dist.get_rank()


@pytest.mark.parametrize("mode", ["coop", "threads"])
def test_a_request_still_being_served_keeps_shutdown_and_the_run_waiting(mode):
    """rpc_async then shutdown at once: the handler (a thread of the callee rank) still runs to its end."""
    _SERVED.clear()

    def body():
        rpc.rpc_async("worker1", _slow_record, args=("a", torch.arange(3.0)))
        return "left"

    assert drive(body, mode=mode) == "left"
    rank, name, y = _SERVED["a"]
    x = torch.arange(3.0)
    for _ in range(50):
        x = torch.tanh(x + 1)
    assert (rank, name) == (1, "worker1") and torch.equal(y, x)


def test_handler_threads_are_actors_of_the_callee_with_its_clock_on_the_trace():
    """The handler's compute lands between the request's arrival and the answer, on the caller's event."""
    def body():
        fut = rpc.rpc_async("worker1", _slow_record, args=("b", torch.ones(1000)))
        return rpc.rpc_sync("worker2", _slow_record, args=("c", torch.ones(1))), fut.wait()

    assert drive(body, 3) == (2, 1)
    tr = simulator.last_trace()
    rpcs = sorted((e for e in tr.events if e.op in ("rpc_sync", "rpc_async")), key=lambda e: e.seq)
    assert [(e.op, e.rank, e.peer, e.seq) for e in rpcs] == [("rpc_async", 0, 1, 1), ("rpc_sync", 0, 2, 2)]
    cost = simulator.CostModel()
    a, s = rpcs
    assert a.vend - a.vstart >= cost.cost("send", 4000, 2)  # the request's transfer at least
    assert s.vstart >= a.vstart  # issued later, on the same caller's clock


def test_autograd_errors():
    def body():
        errs = {}
        with dist_autograd.context() as cid:
            try:
                with dist_autograd.context():
                    pass
            except DistRuntimeError as e:
                errs["nested"] = str(e)
            x = torch.ones(2, requires_grad=True)
            for name, roots in (("vector", [x * 2]), ("no_grad", [torch.ones(())]), ("not_tensor", [1.0])):
                try:
                    dist_autograd.backward(cid, roots)
                except (DistValueError, DistTypeError) as e:
                    errs[name] = str(e)
        try:
            dist_autograd.get_gradients(cid)
        except DistValueError as e:
            errs["closed"] = str(e)
        return errs

    errs = drive(body)
    assert "do not nest" in errs["nested"]
    assert "scalar" in errs["vector"] and "does not require grad" in errs["no_grad"]
    assert "must be a tensor" in errs["not_tensor"]
    assert "no such autograd context" in errs["closed"]


def test_remote_module_uses_the_owners_rng_stream():
    # coop mode gives every rank its own RNG: a module built on worker1 draws from worker1's stream
    def main():
        me = dist.get_rank()
        torch.manual_seed(100 + me)
        rpc.init_rpc(f"worker{me}")
        out = None
        if me == 0:
            rm = RemoteModule("worker1/cpu", tp.nn.Linear, args=(4, 2))
            out = rm.get_module_rref().rpc_sync().state_dict()
        rpc.shutdown()
        return out

    sd = simulator.run(main, 2)[0]
    torch.manual_seed(101)
    ref = tp.nn.Linear(4, 2).state_dict()
    assert all(torch.equal(sd[k], ref[k]) for k in ref)


def _quiet_shutdown() -> None:
    """rpc.shutdown() on a rank thread; the test silences its warning about the worker that is already gone.

    (No ``warnings.catch_warnings`` here: it swaps process-wide state and is not thread-safe, and several rank
    threads shut down at once.  The test wraps the whole run in one, on its own thread: :func:`_quietly`.)
    """
    rpc.shutdown()


def _quietly(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with RuntimeWarnings ignored process-wide (entered on the test's thread only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn(*args, **kwargs)


def _recorded(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` and every warning raised meanwhile on any thread, recorded from the test's thread
    (rank threads must not enter ``warnings.catch_warnings`` themselves: it is not thread-safe)."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            return fn(*args, **kwargs), w
        except BaseException as e:  # noqa: BLE001  the caller checks the exception and the warnings
            return e, w


def _warnings_of(recorded, worker: str) -> list[str]:
    """The recorded warnings a worker issued (RPC warnings name their worker)."""
    return [str(x.message) for x in recorded if f"(worker {worker!r})" in str(x.message)]


def _until_unavailable(name: str, limit_s: float = 10.0) -> float:
    """Threads mode: call ``name`` until it is reported unavailable; returns when that happened."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        try:
            rpc.rpc_sync(name, C.add, (1, 2))
        except WorkerUnavailableError:
            return time.perf_counter()
        time.sleep(0.001)
    raise AssertionError(f"{name} never became unavailable")


def test_worker_failure_fails_calls_at_once_and_shutdown_returns():
    def main():
        me = dist.get_rank()
        rpc.init_rpc(f"worker{me}")
        if me == 1:
            time.sleep(0.05)
            raise C.Boom("worker1 crashed", 1)
        out = {}
        if me == 0:
            _until_unavailable("worker1")
            t = time.perf_counter()
            for fn in (lambda: rpc.rpc_sync("worker1", C.add, (1, 2)),
                       lambda: rpc.rpc_async("worker1", C.add, (1, 2)).wait(),
                       lambda: rpc.remote("worker1", C.add, (1, 2))):
                try:
                    fn()
                    out.setdefault("errors", []).append(None)
                except WorkerUnavailableError as e:
                    out.setdefault("errors", []).append(str(e))
            out["elapsed"] = time.perf_counter() - t
            out["alive"] = rpc.rpc_sync("worker2", C.add, (1, 2))
        t = time.perf_counter()
        rpc.shutdown()
        out["shutdown_s"] = time.perf_counter() - t
        return out

    world = simulator.World(3, mode="threads")
    raised, recorded = _recorded(world.run, main)
    assert isinstance(raised, C.Boom), raised
    out = world.results[0]
    assert out is not None, f"worker0 did not return: {world.errors[0]!r}"  # (says why, should it ever happen)
    out["warnings"] = _warnings_of(recorded, "worker0")
    assert all(e is not None and "worker1" in e and "Boom" in e for e in out["errors"]), out
    # "at once": far below the 60 s an RPC would wait for its timeout (margins for a loaded 2-core machine)
    assert out["elapsed"] < 5.0 and out["alive"] == 3, out
    assert out["shutdown_s"] < 5.0, out
    assert any("worker1" in w and "ended without shutdown" in w for w in out["warnings"]), out["warnings"]
    assert world.results[2]["shutdown_s"] < 5.0, world.results[2]


def test_a_call_to_a_live_worker_is_answered_when_another_worker_crashes_meanwhile():
    # worker0 waits for worker2's answer while worker1 raises: on TensorPipe the call is answered; the
    # simulator releases every waiting rank when one fails, and must not release a wait for an answer
    def main():
        me = dist.get_rank()
        rpc.init_rpc(f"worker{me}")
        if me == 1:
            C.SERVING.wait(10.0)  # worker0 waits for its answer now
            raise C.Boom("worker1 crashed", 1)
        out = rpc.rpc_sync("worker2", C.slow_answer, (40 + me,)) if me == 0 else None
        _quiet_shutdown()
        return out

    C.SERVING.clear()
    world = simulator.World(3, mode="threads")
    raised, _ = _recorded(world.run, main)
    assert isinstance(raised, C.Boom), raised
    assert world.results[0] == 40, f"worker0: {world.errors[0]!r}"


def test_calls_to_a_worker_that_returned_without_shutdown_fail():
    def main():
        me = dist.get_rank()
        rpc.init_rpc(f"worker{me}")
        if me == 1:
            return "left"  # no rpc.shutdown(): the worker is gone
        _until_unavailable("worker1")
        try:
            rpc.rpc_sync("worker1", C.add, (1, 2))
            return "reached"
        except WorkerUnavailableError as e:
            return str(e)
        finally:
            _quiet_shutdown()

    out = _quietly(simulator.run, main, 2, mode="threads")
    assert "returned without rpc.shutdown()" in out[0]


def test_graceful_shutdown_waits_for_the_slowest_worker():
    # worker1 shuts down at once; worker0 keeps calling it: graceful shutdown keeps worker1 serving
    def main():
        me = dist.get_rank()
        rpc.init_rpc(f"worker{me}")
        total = 0
        if me == 0:
            for i in range(20):
                total += rpc.rpc_sync("worker1", C.add, (i, 1))
        rpc.shutdown()
        return total

    for seed in range(3):
        assert simulator.run(main, 2, seed=seed)[0] == sum(range(1, 21))


def test_worker_that_never_inits_is_reported_as_a_deadlock():
    def main():
        if dist.get_rank() == 1:
            return None
        rpc.init_rpc("worker0")

    with pytest.raises(simulator.DeadlockError) as ei:
        simulator.run(main, 2)
    assert "rpc.init_rpc" in str(ei.value) and "missing [1]" in str(ei.value)


def test_message_faults_are_reproducible_by_seed():
    opts = SimRpcBackendOptions(rpc_timeout=5.0, faults=MessageFaults(drop=0.3, delay=0.5, max_delay_s=0.002))

    def body():
        seen = []
        for i in range(40):
            try:
                seen.append(rpc.rpc_sync("worker1", C.add, (i, 0)))
            except RpcTimeoutError as e:
                assert "simulated loss" in str(e)
                seen.append("lost")
        return seen

    a = drive(body, options=opts)
    b = drive(body, options=opts)
    c = drive(body, options=opts, seed=1)
    assert a == b
    assert a != c
    assert 0 < a.count("lost") < 40
    assert [x for x in a if x != "lost"] == [i for i, x in enumerate(a) if x != "lost"]


def test_dropped_remote_surfaces_at_to_here():
    opts = SimRpcBackendOptions(faults=MessageFaults(drop=1.0))

    def body():
        r = rpc.remote("worker1", C.add, (1, 2))
        try:
            r.to_here()
        except RpcTimeoutError as e:
            return str(e)

    assert "simulated loss of the request" in drive(body, options=opts)


def test_rref_pickled_outside_rpc_is_refused_and_values_are_released():
    def body():
        out = {}
        r = rpc.remote("worker1", C.make_tensor, (3,))
        try:
            pickle.dumps(r)
        except DistRuntimeError as e:
            out["pickle"] = str(e)
        out["before"] = rpc.rpc_sync("worker1", C.count_owned)
        del r
        out["after"] = rpc.rpc_sync("worker1", C.count_owned)
        return out

    out = drive(body)
    assert "only be pickled inside an RPC" in out["pickle"]
    assert out["before"] == out["after"] + 1


def test_validation_errors():
    def body():
        errs = {}
        cases = {
            "unknown_name": lambda: rpc.rpc_sync("nobody", C.add, (1, 2)),
            "unknown_rank": lambda: rpc.rpc_sync(7, C.add, (1, 2)),
            "bad_to": lambda: rpc.rpc_sync(1.5, C.add, (1, 2)),
            "zero_timeout": lambda: rpc.rpc_sync("worker1", C.add, (1, 2), timeout=0),
            "args_not_tuple": lambda: rpc.rpc_sync("worker1", C.add, 3),
            "not_callable": lambda: rpc.rpc_sync("worker1", 42),
            "double_init": lambda: rpc.init_rpc("again"),
            "local_value": lambda: rpc.remote("worker1", C.add, (1, 2)).local_value(),
        }
        for k, f in cases.items():
            try:
                f()
                errs[k] = None
            except Exception as e:  # noqa: BLE001
                errs[k] = (type(e).__name__, str(e))
        errs["infos"] = (rpc.get_worker_info(), rpc.get_worker_info("worker1"), rpc.get_worker_info(1))
        return errs

    e = drive(body)
    assert e["unknown_name"][0] == "DistValueError" and "['worker0', 'worker1']" in e["unknown_name"][1]
    assert e["unknown_rank"][0] == "DistValueError" and e["bad_to"][0] == "DistTypeError"
    assert e["zero_timeout"][0] == "DistValueError" and "every call is bounded" in e["zero_timeout"][1]
    assert e["args_not_tuple"][0] == "DistTypeError" and e["not_callable"][0] == "DistTypeError"
    assert e["double_init"][0] == "DistRuntimeError" and "already initialised" in e["double_init"][1]
    assert e["local_value"][0] == "DistRuntimeError" and "to_here()" in e["local_value"][1]
    me, w1, w1b = e["infos"]
    assert (me.name, me.id, w1.name, w1.id) == ("worker0", 0, "worker1", 1) and w1 == w1b


def test_not_initialised_and_backend_errors():
    with pytest.raises(NotInitializedError, match="init_rpc"):
        rpc.rpc_sync("worker1", C.add, (1, 2))
    with pytest.raises(DistRuntimeError, match="simulated rank"):
        rpc.init_rpc("w", backend="sim", rank=0, world_size=1)
    with pytest.raises(DistValueError, match="unknown RPC backend"):
        rpc.init_rpc("w", backend="carrier-pigeon", rank=0, world_size=1)
    with pytest.raises(DistValueError, match="invalid worker name"):
        rpc.init_rpc("bad name!", rank=0, world_size=1)

    def bad_options():
        rpc.init_rpc("w", rpc_backend_options={"rpc_timeout": 5})

    with pytest.raises(DistTypeError, match="TensorPipeRpcBackendOptions or SimRpcBackendOptions"):
        simulator.run(bad_options, 1)


def test_tensorpipe_backend_and_options_run_unchanged_on_the_simulator():
    """A program written for real runs (TensorPipe named, its options given) runs on the simulator's transport."""
    def main():
        me = dist.get_rank()
        opts = rpc.TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:1", rpc_timeout=7,
                                               num_worker_threads=3)
        rpc.init_rpc(f"worker{me}", backend=rpc.BackendType.TENSORPIPE, rank=me, world_size=2,
                     rpc_backend_options=opts)
        from tensorplay.distributed.rpc import _agent

        out = (_agent.current().kind, _agent.current().timeout,
               rpc.rpc_sync(f"worker{1 - me}", C.add, (me, 10)))
        rpc.shutdown()
        return out

    assert simulator.run(main, 2) == [("sim", 7.0, 10), ("sim", 7.0, 11)]

    def no_timeout():  # torch's rpc_timeout=0 ("no timeout") is unbounded per call; the run still bounds it
        rpc.init_rpc(f"worker{dist.get_rank()}", rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=0))
        from tensorplay.distributed.rpc import _agent

        t = _agent.current().timeout
        rpc.shutdown()
        return t

    assert simulator.run(no_timeout, 1) == [float("inf")]


def test_unpicklable_remote_exception_arrives_as_remote_error():
    def body():
        try:
            rpc.rpc_sync("worker1", C.raise_unpicklable)
        except RemoteError as e:
            return e.remote_type, e.worker, "raise_unpicklable" in e.remote_traceback

    t, w, tb = drive(body)
    assert t.endswith("Unpicklable") and w == "worker1" and tb


def test_interface_restricted_module_refuses_other_methods_on_owner():
    def body():
        rm = RemoteModule("worker1", C.TwoMethods, interface=C.OnlyForward)
        y = rm(torch.ones(2))
        try:
            rpc.rpc_sync("worker1", C.call_module_method, (rm, "double"))
        except InterfaceError as e:
            return y, str(e)

    y, msg = drive(body)
    assert torch.equal(y, torch.ones(2) + 1)
    assert "refused" in msg and "'double'" in msg


@pytest.mark.parametrize("mode", ["coop", "threads"])
def test_local_shutdown_does_not_hold_the_graceful_ones(mode):
    def main():
        me = dist.get_rank()
        rpc.init_rpc(f"worker{me}")
        if me == 1:
            rpc.shutdown(graceful=False)
            return "left"
        if me == 0:
            _until_unavailable("worker1") if mode == "threads" else None
        try:
            return rpc.rpc_sync("worker1", C.add, (1, 2))
        except WorkerUnavailableError as e:
            return str(e)
        finally:
            _quiet_shutdown()

    out = _quietly(simulator.run, main, 3, mode=mode)
    assert out[1] == "left"
    for r in (0, 2):
        assert out[r] == 3 or "it shut down" in out[r], out


def test_rpc_runs_replay_exactly():
    def main():
        me = dist.get_rank()
        rpc.init_rpc(f"worker{me}", rpc_backend_options=SimRpcBackendOptions(faults=MessageFaults(drop=0.2)))
        out = []
        for i in range(10):
            try:
                out.append(rpc.rpc_sync(f"worker{(me + 1) % 3}", C.add, (i, me)))
            except RpcTimeoutError:
                out.append(None)
        rpc.shutdown()
        return out

    simulator.check_reproducible(main, 3, seed=5)
    outs = simulator.run(main, 3, seed=5)
    assert any(None in o for o in outs) and any(x is not None for o in outs for x in o)


def _traced_rpcs():
    r = dist.get_rank()
    rpc.init_rpc(f"worker{r}", rank=r, world_size=3)
    if r == 0:
        rpc.rpc_sync("worker1", torch.add, args=(torch.ones(1000), 1.0))
        rpc.rpc_async("worker2", torch.mul, args=(torch.ones(10), 2.0)).wait()
    if r == 2:
        rpc.remote("worker0", torch.neg, args=(torch.ones(3),)).to_here()
    rpc.shutdown()


def test_rpcs_are_on_the_trace_and_replay():
    simulator.run(_traced_rpcs, 3, seed=4)
    tr = simulator.last_trace()
    rpcs = [e for e in tr.events if e.op in ("rpc_sync", "rpc_async", "remote")]
    by_op = {e.op: e for e in rpcs}
    assert sorted(by_op) == ["remote", "rpc_async", "rpc_sync"] and len(rpcs) == 3, rpcs
    s, a, m = by_op["rpc_sync"], by_op["rpc_async"], by_op["remote"]
    assert (s.rank, s.group, s.peer, s.seq) == (0, (0, 1), 1, 1)
    assert (a.rank, a.group, a.peer, a.seq) == (0, (0, 2), 2, 2)
    assert (m.rank, m.group, m.peer, m.seq) == (2, (2, 0), 0, 1)
    assert s.nbytes >= 2 * 4000  # 1000 float32 each way
    assert a.nbytes >= 2 * 40 and m.nbytes >= 12
    assert s.site.startswith("test_rpc_transports.py:")
    cost = simulator.CostModel()
    assert s.vend - s.vstart >= cost.cost("send", 4000, 2) * 2  # at least both transfers
    chrome = tr.to_chrome()["traceEvents"]
    assert {e["name"] for e in chrome if e.get("cat") == "rpc"} == {"rpc_sync", "rpc_async", "remote"}
    first = tr.signature()
    simulator.run(_traced_rpcs, 3, seed=4)
    assert simulator.last_trace().signature() == first


# ---------------------------------------------------------------------------
# part 3: TensorPipe-only behaviour (real processes)
# ---------------------------------------------------------------------------
@pytest.mark.gloo
@pytest.mark.xdist_group("rpc-tensorpipe")
def test_init_rpc_is_bounded_when_a_worker_never_comes():
    from tensorplay.distributed import DistRuntimeError
    from tensorplay.testing import free_port

    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{free_port()}", rpc_timeout=1.5)
    t = time.perf_counter()
    with pytest.raises(DistRuntimeError, match=r"missing_ranks=\[1, 2\]"):
        rpc.init_rpc("worker0", rank=0, world_size=3, rpc_backend_options=opts)
    assert time.perf_counter() - t < 10.0
    assert not rpc.is_initialized()


# -- loopback -----------------------------------------------------------------
def listening_sockets() -> dict:
    # every socket: RPC's, and the gloo process group's store and transport (rank 0 binds the store itself)
    return {"sockets": listening(), "rpc_up": rpc.is_initialized(),
            "pg_port": int(os.environ.get("MASTER_PORT", "0"))}


@pytest.mark.gloo
@pytest.mark.xdist_group("rpc-tensorpipe")
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp (Linux)")
def test_rpc_listens_on_loopback_only(tp_pool):
    for rank, out in enumerate(tp_pool.run(listening_sockets)):
        assert out["rpc_up"]
        assert out["sockets"], f"rank {rank}: no listening socket found"
        bad = [s for s in out["sockets"] if s[0] not in LOOPBACK]
        assert not bad, f"rank {rank} listens beyond loopback: {bad}"
    rank0 = tp_pool.run(listening_sockets)[0]
    assert any(port == rank0["pg_port"] for _, port in rank0["sockets"]), "rank 0 serves the process-group store"


# -- a dead worker (keep last: it leaves the pool to be restarted) ----------------
def die_in(seconds: float) -> None:
    import threading

    threading.Timer(seconds, lambda: os._exit(17)).start()
    time.sleep(30)


def failure_body(shutdown_timeout: float) -> dict:
    me = rpc.get_worker_info().id
    out: dict = {}
    if me == 2:
        return out  # stays up, serving, until worker0's call makes it exit
    if me == 0:
        t = time.perf_counter()
        try:
            rpc.rpc_async("worker2", die_in, (0.3,)).wait()
            out["pending"] = "no error"
        except rpc.WorkerUnavailableError as e:
            out["pending"] = str(e)
        out["pending_s"] = time.perf_counter() - t - 0.3
        out["new"] = []
        for fn in (lambda: rpc.rpc_sync("worker2", C.add, (1, 2)),
                   lambda: rpc.rpc_async("worker2", C.add, (1, 2)).wait(),
                   lambda: rpc.remote("worker2", C.add, (1, 2)),
                   lambda: C.RemoteModule("worker2/cpu", C.tp.nn.Linear, (2, 2))):
            t = time.perf_counter()
            try:
                fn()
                out["new"].append(("no error", 0.0))
            except rpc.WorkerUnavailableError as e:
                out["new"].append((str(e), time.perf_counter() - t))
        out["alive"] = rpc.rpc_sync("worker1", C.add, (1, 2))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        t = time.perf_counter()
        rpc.shutdown(timeout=shutdown_timeout)
        out["shutdown_s"] = time.perf_counter() - t
        out["warnings"] = [str(x.message) for x in w]
    return out


@pytest.mark.gloo
@pytest.mark.xdist_group("rpc-tensorpipe")
def test_dead_worker_fails_calls_within_a_second_and_shutdown_is_bounded(tp_pool):
    outs = tp_pool.run(failure_body, 8.0)
    o = outs[0]
    assert "unavailable" in o["pending"] and "worker2" in o["pending"], o
    assert o["pending_s"] < 1.0, o
    for msg, took in o["new"]:
        assert "unavailable" in msg and "worker2" in msg, o["new"]
        assert took < 1.0
    assert o["alive"] == 3
    for r in (0, 1):
        assert outs[r]["shutdown_s"] < 8.0 + 3.0, outs[r]
        assert any("worker2" in w for w in outs[r]["warnings"]), outs[r]["warnings"]
