"""RPC, RemoteModule, distributed autograd and DistributedOptimizer on real TensorPipe processes.

One pool of three worker processes (``worker0..2`` on 127.0.0.1) serves the
whole module: starting a process costs seconds, a call on the warm pool
milliseconds.  Each test runs one shared case from test_rpc_cases.py on
worker0 (the others serve) and checks it here; the same cases run on the
simulator in test_rpc_sim.py.  The worker-failure test kills a worker, so it
comes last and leaves the pool to be restarted.

Under ``pytest -n 2 --dist loadgroup`` every test here carries the same
xdist group, so they share one pool on one xdist worker.
"""
from __future__ import annotations

import os
import time
import warnings

import pytest

from _net import LOOPBACK, listening

import tensorplay.distributed.rpc as rpc
from tensorplay.testing import RpcPool

import test_rpc_cases as C

pytestmark = [pytest.mark.gloo, pytest.mark.xdist_group("rpc-tensorpipe")]

CALL_TIMEOUT_S = float(os.environ.get("TENSORPLAY_TEST_CALL_TIMEOUT", "60"))


@pytest.fixture(scope="module")
def pool():
    p = RpcPool(3, rpc_timeout=20.0, call_timeout=CALL_TIMEOUT_S)
    p.start()
    yield p
    p.close()


def test_documented_example(pool):
    C.check_documented_example(pool.run_on(0, C.documented_example))


def test_async_execution_and_torch_futures(pool):
    C.check_async(pool.run_on(0, C.async_cases))


def test_calls_by_value_exceptions_and_futures(pool):
    C.check_calls(pool.run_on(0, C.calls))


def test_rref_rules(pool):
    C.check_rrefs(pool.run_on(0, C.rrefs))


def test_remote_module_construction_errors(pool):
    C.check_construction_errors(pool.run_on(0, C.construction_errors))


def test_remote_module_every_unsupported_method_raises(pool):
    C.check_unsupported_methods(pool.run_on(0, C.unsupported_methods))


def test_remote_module_passed_over_rpc(pool):
    C.check_passed_over_rpc(pool.run_on(0, C.passed_over_rpc))


def test_interface_enforcement(pool):
    C.check_interface(pool.run_on(0, C.interface_cases))


def test_training_matches_local_reference(pool):
    C.check_training(pool.run_on(0, C.training, steps=4))


def test_two_hop_autograd_matches_local(pool):
    out = pool.run_on(0, C.two_hop_autograd)
    assert out["grad_close"] and out["x_grad_untouched"], out


def test_timeout_is_honoured(pool):
    out = pool.run_on(0, C.timeout_case)
    C.check_timeout(out)
    assert out["sync_s"] < 0.6  # TensorPipe returns at the timeout, while the callee still sleeps


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


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp (Linux)")
def test_rpc_listens_on_loopback_only(pool):
    for rank, out in enumerate(pool.run(listening_sockets)):
        assert out["rpc_up"]
        assert out["sockets"], f"rank {rank}: no listening socket found"
        bad = [s for s in out["sockets"] if s[0] not in LOOPBACK]
        assert not bad, f"rank {rank} listens beyond loopback: {bad}"
    rank0 = pool.run(listening_sockets)[0]
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


def test_dead_worker_fails_calls_within_a_second_and_shutdown_is_bounded(pool):
    outs = pool.run(failure_body, 8.0)
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
