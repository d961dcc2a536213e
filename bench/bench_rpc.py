"""RPC costs on the simulator's transport and on TensorPipe, in one run, with ratios.

Measured on worker0, calling worker1 (two workers):

* ``rpc_sync no-op``        - ``rpc_sync("worker1", noop)``;
* ``rpc_sync 1e6 float32``  - one 4 MB tensor there and back (``identity``);
* ``raw forward rpc_sync``  - ``rpc_sync`` of a function running a ``Linear(16, 8)`` that lives on
  worker1 (a module-level global), on ``randn(4, 16)``: the floor for a remote forward;
* ``RemoteModule forward``  - the same forward through ``RemoteModule("worker1/cpu", Linear, (16, 8))``;
* ``remote training step``  - forward, distributed backward and ``DistributedOptimizer(SGD).step``.

Each figure is the median time per call (the machine is shared: medians
resist load spikes); the raw and RemoteModule forwards are called in turn in
one loop so that load hits both alike.  1e6-element calls and training steps
run fewer times (a tenth and a quarter of ``--calls``).
TensorPipe runs in two real processes on 127.0.0.1 (a warm
:class:`~tensorplay.testing.RpcPool`), the simulator in this
process (``mode="coop"``), and the simulator with a process per rank
(``isolation="process"``: every message through the coordinator).

Targets: the simulator's no-op ``rpc_sync`` at least 10x faster than
TensorPipe's; on TensorPipe, a RemoteModule forward at most 1.2x a raw
``rpc_sync`` doing the same forward.

**Authentication's cost** (issue 16; ``--auth`` runs only this part): the
no-op ``rpc_sync`` on TensorPipe with and without authentication, in the
*same* two warm processes (both workers switch the envelope on and off
together between rounds, so pipes, threads and CPU placement are the same),
in alternating rounds so load hits both alike; and the envelope alone (seal +
open of a no-op call's pickle), which is what authentication adds to each
message of the simulator's transport.  Target: at most 10 % on the
TensorPipe no-op.

Usage::

    python bench/bench_rpc.py            # full
    python bench/bench_rpc.py --quick    # fewer calls, for a smoke run
    python bench/bench_rpc.py --auth     # authentication's cost only
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

CASES = ("rpc_sync no-op", "rpc_sync 1e6 float32", "raw forward rpc_sync", "RemoteModule forward",
         "remote training step")


# ---------------------------------------------------------------------------
# remote functions (module level: both transports send them by reference)
# ---------------------------------------------------------------------------
def noop() -> None:
    return None


def identity(x: Any) -> Any:
    return x


_LINEAR: Any = None


def make_linear() -> None:
    global _LINEAR
    import torch

    _LINEAR = torch.nn.Linear(16, 8)


def linear_forward(x: Any) -> Any:
    return _LINEAR(x)


# ---------------------------------------------------------------------------
# the measurement, run on worker0 of either transport
# ---------------------------------------------------------------------------
def _per_call(fns: list[Callable[[], Any]], calls: int) -> list[float]:
    """Median seconds per call of each function, the functions called in turn (so load hits all alike)."""
    for f in fns:  # warm-up
        for _ in range(max(3, calls // 10)):
            f()
    times: list[list[float]] = [[] for _ in fns]
    clock = time.perf_counter
    for _ in range(calls):
        for f, ts in zip(fns, times):
            t = clock()
            f()
            ts.append(clock() - t)
    return [statistics.median(ts) for ts in times]


def measure(calls: int) -> dict[str, float]:
    """Median seconds per call of every case, on worker0 (worker1 serves)."""
    import torch

    import tensorplay as tp
    import tensorplay.distributed.autograd as dist_autograd
    import tensorplay.distributed.rpc as rpc
    from tensorplay.distributed.nn import RemoteModule
    from tensorplay.distributed.optim import DistributedOptimizer

    torch.manual_seed(0)
    x = tp.randn(4, 16)
    big = tp.randn(1_000_000)
    rpc.rpc_sync("worker1", make_linear)
    rm = RemoteModule("worker1/cpu", tp.nn.Linear, args=(16, 8))
    opt = DistributedOptimizer(tp.optim.SGD, rm.remote_parameters(), lr=0.01)

    def step() -> None:
        with dist_autograd.context() as cid:
            loss = rm(x).pow(2).sum()
            dist_autograd.backward(cid, [loss])
            opt.step(cid)

    out: dict[str, float] = {}
    (out["rpc_sync no-op"],) = _per_call([lambda: rpc.rpc_sync("worker1", noop)], calls)
    (out["rpc_sync 1e6 float32"],) = _per_call([lambda: rpc.rpc_sync("worker1", identity, (big,))], max(5, calls // 10))
    out["raw forward rpc_sync"], out["RemoteModule forward"] = _per_call(
        [lambda: rpc.rpc_sync("worker1", linear_forward, (x,)), lambda: rm(x)], calls)
    (out["remote training step"],) = _per_call([step], max(5, calls // 4))
    return out


def _sim_main(calls: int) -> dict[str, float] | None:
    import tensorplay.distributed as dist
    import tensorplay.distributed.rpc as rpc

    me = dist.get_rank()
    rpc.init_rpc(f"worker{me}")
    try:
        return measure(calls) if me == 0 else None
    finally:
        rpc.shutdown()


def run_sim(calls: int, isolation: str = "thread") -> dict[str, float]:
    import simulator
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the TensorPipe workers (OMP_NUM_THREADS=1): compare like with like
    try:
        return simulator.run(_sim_main, 2, args=(calls,), timeout=600, isolation=isolation)[0]
    finally:
        torch.set_num_threads(threads)


def run_tensorpipe(calls: int) -> dict[str, float]:
    from tensorplay.testing import RpcPool

    with RpcPool(2, rpc_timeout=60.0, call_timeout=600.0) as pool:
        return pool.run_on(0, measure, calls, timeout=600.0)


def noop_median(calls: int) -> float:
    """worker0: median seconds of a no-op rpc_sync to worker1."""
    import tensorplay.distributed.rpc as rpc

    return _per_call([lambda: rpc.rpc_sync("worker1", noop)], calls)[0]


def envelope_cost(reps: int = 20000) -> tuple[float, int]:
    """Seconds per seal + open of a no-op call's pickle, and that pickle's size in bytes."""
    import pickle

    from tensorplay.distributed.rpc._auth import Authenticator
    from tensorplay.distributed.rpc._call import run_call

    payload = pickle.dumps((run_call, (noop, (), {})), protocol=pickle.HIGHEST_PROTOCOL)
    sender, receiver = Authenticator("bench secret 0123456789"), Authenticator("bench secret 0123456789")
    for _ in range(200):
        receiver.open(sender.seal(payload))
    t = time.perf_counter()
    for _ in range(reps):
        receiver.open(sender.seal(payload))
    return (time.perf_counter() - t) / reps, len(payload)


def set_auth(on: bool) -> bool:
    """Every worker at once, with no call in flight: seal/check this process's messages, or not."""
    from tensorplay.distributed.rpc import _agent, _auth

    a = _agent.current()
    if on:
        _auth.install_tensorpipe(a.auth)
    else:
        _auth.uninstall_tensorpipe()
    return _auth.tensorpipe_authenticator() is not None


def run_auth_cost(calls: int, rounds: int) -> dict[str, Any]:
    """No-op rpc_sync medians with and without authentication in the same warm world, alternating rounds."""
    from tensorplay.testing import RpcPool

    with RpcPool(2, rpc_timeout=60.0, call_timeout=600.0) as pool:
        auth_t, plain_t = [], []
        for i in range(rounds):
            order = ((True, auth_t), (False, plain_t))
            for on, into in (order if i % 2 == 0 else order[::-1]):  # neither always goes first
                assert pool.run(set_auth, on) == [on, on]
                into.append(pool.run_on(0, noop_median, calls, timeout=600.0))
        pool.run(set_auth, True)
    env_s, env_bytes = envelope_cost()
    return {"tensorpipe_auth": statistics.median(auth_t), "tensorpipe_plain": statistics.median(plain_t),
            "rounds_auth": auth_t, "rounds_plain": plain_t, "envelope_s": env_s, "payload_bytes": env_bytes}


def report_auth(r: dict[str, Any], sim_noop: float | None) -> None:
    """Print the authentication figures; the target is judged on the paired rounds' median ratio (each
    authenticated round against the plain round next to it: the estimate load disturbs least)."""
    ratios = sorted(a / p for a, p in zip(r["rounds_auth"], r["rounds_plain"]))
    paired = statistics.median(ratios) - 1.0
    over = r["tensorpipe_auth"] / r["tensorpipe_plain"] - 1.0
    r["paired_overhead"], r["median_overhead"] = paired, over
    print(f"authentication, no-op rpc_sync on TensorPipe ({len(ratios)} alternating rounds, same two processes):")
    print(f"  unauthenticated {_fmt(r['tensorpipe_plain'])}   authenticated {_fmt(r['tensorpipe_auth'])}   "
          f"(medians of the rounds: {over * 100:+.1f} %)")
    print(f"  paired rounds: median overhead {paired * 100:+.1f} %, quartiles "
          f"{(ratios[len(ratios) // 4] - 1) * 100:+.1f} % .. {(ratios[(3 * len(ratios)) // 4] - 1) * 100:+.1f} %")
    print(f"  envelope (seal + open, {r['payload_bytes']}-byte call pickle): {_fmt(r['envelope_s'])}; "
          f"a call is two messages, so about {_fmt(2 * r['envelope_s'])} per call"
          + (f" ({2 * r['envelope_s'] / sim_noop * 100:.1f} % of the simulator's no-op)" if sim_noop else ""))
    print(f"target: authentication adds <= 10 % to a TensorPipe no-op rpc_sync: {paired * 100:+.1f} % "
          f"[{'met' if paired <= 0.10 else 'MISSED'}]")


# ---------------------------------------------------------------------------
def _fmt(s: float) -> str:
    return f"{s * 1e6:9.1f} us" if s < 1e-3 else f"{s * 1e3:9.3f} ms"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    ap.add_argument("--calls", type=int, default=None, help="calls per case (default 1000, quick 100)")
    ap.add_argument("--json", type=str, default=None, help="also write the figures to this file")
    ap.add_argument("--auth", action="store_true", help="only authentication's cost")
    ap.add_argument("--rounds", type=int, default=None, help="alternating rounds of the auth cost (default 15)")
    a = ap.parse_args(argv)
    calls = a.calls or (100 if a.quick else 1000)
    rounds = a.rounds or (3 if a.quick else 15)
    if a.auth:
        auth = run_auth_cost(calls, rounds)
        report_auth(auth, None)
        if a.json:
            Path(a.json).write_text(json.dumps({"auth": auth, "calls": calls}, indent=2))
        return {"auth": auth}

    t0 = time.perf_counter()
    tpipe = run_tensorpipe(calls)
    t1 = time.perf_counter()
    sim = run_sim(calls)
    t2 = time.perf_counter()
    proc = run_sim(calls, "process")
    t3 = time.perf_counter()

    print(f"RPC, worker0 -> worker1; median per call over up to {calls} calls (TensorPipe world "
          f"{t1 - t0:.1f} s incl. start, simulator {t2 - t1:.1f} s, simulator's process ranks {t3 - t2:.1f} s)")
    print(f"{'case':<24}{'simulator':>13}{'sim process':>13}{'TensorPipe':>13}{'TP / sim':>10}{'TP / proc':>11}")
    for c in CASES:
        print(f"{c:<24}{_fmt(sim[c]):>13}{_fmt(proc[c]):>13}{_fmt(tpipe[c]):>13}{tpipe[c] / sim[c]:>9.1f}x"
              f"{tpipe[c] / proc[c]:>10.1f}x")
    speedup = tpipe["rpc_sync no-op"] / sim["rpc_sync no-op"]
    rm_ratio = tpipe["RemoteModule forward"] / tpipe["raw forward rpc_sync"]
    ok1, ok2 = speedup >= 10, rm_ratio <= 1.2
    print(f"target: simulator no-op rpc_sync >= 10x faster than TensorPipe: {speedup:.1f}x "
          f"[{'met' if ok1 else 'MISSED'}]")
    print(f"target: TensorPipe RemoteModule forward <= 1.2x raw rpc_sync forward: {rm_ratio:.2f}x "
          f"[{'met' if ok2 else 'MISSED'}]")
    auth = run_auth_cost(calls, rounds)
    report_auth(auth, sim["rpc_sync no-op"])
    result = {"sim": sim, "sim_process": proc, "tensorpipe": tpipe, "sim_speedup_noop": speedup,
              "remote_module_ratio": rm_ratio,
              "calls": calls, "auth": auth}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    # run the worker functions from an importable module (by reference), not from __main__
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_rpc as me

    me.main()
