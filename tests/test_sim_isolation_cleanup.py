"""Process ranks: what a run leaves behind and what crosses the process boundary (tests/test_sim_isolation.py has
the behaviour itself).

* a closure's call sites, whatever cloudpickle's version does to code objects;
* an ``async_op=True`` operation that is never waited still writes its outputs and frees its staging;
* ``/dev/shm`` full is a clear error on the rank, not SIGBUS;
* a kept exception does not keep the run's arenas mapped; at most ``_MAX_WARM`` warm interpreters stay (or the
  last world's);
* a coordinator killed by SIGTERM or SIGKILL leaves no arena and no process; stale arenas are swept;
* a script read from stdin; the one-line note of a slow first start-up.

Every multi-process test runs on loopback, with bounded waits, and ends by itself.
"""
from __future__ import annotations

import gc
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import simulator
from simulator.core.hash_seeds import rank_envs
from simulator.isolation import warm
import tensorplay.distributed as dist
from tensorplay.distributed.errors import DistRuntimeError

from _support.warm_starts import run_counting

ROOT = Path(__file__).resolve().parents[1]
HERE = os.path.basename(__file__)
BOTH = ("thread", "process")


def _mapped_arenas() -> dict[str, int]:
    """This process's mapped arena files (``/dev/shm/tp-sim-ranks-*``) and the bytes their pages hold."""
    out: dict[str, int] = {}
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and "/tp-sim-ranks-" in parts[5]:
                path = parts[5].strip().removesuffix(" (deleted)")
                try:
                    out[path] = os.stat(path).st_blocks * 512
                except OSError:
                    out[path] = -1  # deleted, still mapped
    return out


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"  # a zombie has ended (nobody reaps it here)
    except (OSError, IndexError):
        return True


# ---------------------------------------------------------------------------
# what crosses: closures keep their file names
# ---------------------------------------------------------------------------
def test_pickled_closures_keep_their_file_names_whatever_cloudpickle_does():
    """cloudpickle 3.1 pickles a closure's code with co_filename "<dynamic-code>"; the isolation's pickler keeps
    the real file of the closure and of the code nested in it."""
    from simulator.isolation import pickling

    k = 3

    def outer(x):
        def inner(y):
            return y + k
        return inner(x)

    back = pickle.loads(pickling.dumps(outer))
    assert back(1) == 4
    assert back.__code__.co_filename == __file__
    nested = [c for c in back.__code__.co_consts if hasattr(c, "co_filename")]
    assert nested and all(c.co_filename == __file__ for c in nested)


def test_call_sites_of_a_closure_name_its_file_on_process_ranks():
    def fn():
        x = torch.ones(3)
        if dist.get_rank() == 1:
            dist.broadcast(x, src=0)
        else:
            dist.all_reduce(x)

    with pytest.raises(simulator.CollectiveMismatchError) as e:
        simulator.run(fn, 2, isolation="process")
    assert "<dynamic-code>" not in str(e.value)
    assert str(e.value).count(f"{HERE}:") >= 2, str(e.value)


# ---------------------------------------------------------------------------
# async operations that are never waited
# ---------------------------------------------------------------------------
def _dropped_async() -> tuple[torch.Tensor, torch.Tensor]:
    r = dist.get_rank()
    x = torch.ones(4) * (r + 1)
    dist.all_reduce(x, async_op=True)  # never waited: completed operations' outputs are the program's anyway
    y = torch.zeros(2)
    if r == 0:
        dist.isend(torch.full((2,), 7.0), dst=1)
    else:
        dist.irecv(y, src=0)
    dist.barrier()
    return x, y


@pytest.mark.parametrize("isolation", BOTH)
def test_an_async_op_never_waited_still_writes_its_outputs(isolation):
    got = simulator.run(_dropped_async, 2, isolation=isolation)
    for x, _ in got:
        assert torch.equal(x, torch.full((4,), 3.0)), (isolation, got)
    assert torch.equal(got[1][1], torch.full((2,), 7.0)), (isolation, got)


def _many_dropped(n: int) -> dict[str, int]:
    for _ in range(n):
        dist.all_reduce(torch.ones(1 << 16), async_op=True)  # 256 KiB each, dropped
    dist.barrier()
    return _mapped_arenas()


def test_dropped_async_ops_free_their_shared_memory():
    """200 dropped 256 KiB all_reduces held 50 MiB of /dev/shm per rank; completed, they free their regions,
    which the next ones reuse."""
    got = simulator.run(_many_dropped, 2, args=(200,), isolation="process")
    for r, arenas in enumerate(got):
        assert 0 < sum(arenas.values()) <= 16 << 20, (r, arenas)
        assert len(arenas) == 1, (r, arenas)


# ---------------------------------------------------------------------------
# a full /dev/shm
# ---------------------------------------------------------------------------
def _gather_with_little_shm(free_mib: int) -> None:
    from simulator.isolation import staging

    staging.free_bytes = lambda path: free_mib << 20  # what os.statvfs would say of a small /dev/shm
    out = [torch.empty(1 << 18) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.ones(1 << 18))  # 1 MiB per rank


def test_full_shared_memory_is_a_clear_error_on_the_rank():
    with pytest.raises(DistRuntimeError) as e:
        simulator.run(_gather_with_little_shm, 2, args=(2,), isolation="process")
    msg = str(e.value)
    assert "shared memory is full (2 MiB free, 3.0 MiB needed)" in msg, msg
    assert "docker run --shm-size=" in msg and "isolation='thread'" in msg, msg
    simulator.run(_gather_with_little_shm, 2, args=(64,), isolation="process")  # enough: it runs


# ---------------------------------------------------------------------------
# what stays after a run
# ---------------------------------------------------------------------------
def _fails_after_a_big_call() -> None:
    dist.all_reduce(torch.ones(1 << 20))  # 4 MiB staged
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(3))
    else:
        dist.broadcast(torch.ones(3), 0)


def test_kept_failures_keep_no_arena_mapped():
    before = set(_mapped_arenas())
    kept = []
    for _ in range(3):
        world = simulator.World(2, isolation="process")
        with pytest.raises(simulator.CollectiveMismatchError) as e:
            world.run(_fails_after_a_big_call)
        kept.append((e.value, world))
    gc.collect()
    left = {p: b for p, b in _mapped_arenas().items() if p not in before}
    assert not left, left
    assert all(e.__traceback__ is not None for e, _ in kept)  # the exceptions themselves are intact


def test_at_most_max_warm_interpreters_stay(monkeypatch):
    """A world of more ranks than the cap starts what it needs and keeps them for its next run (PyTorch's harness
    starts the same world for every test of a class); after a smaller world the cap holds again."""
    monkeypatch.setattr(warm, "_MAX_WARM", 2)
    simulator.run(lambda: dist.get_rank(), 3, isolation="process")
    kept = list(warm.POOL._servers.values())
    assert len(kept) == 3 and all(s.proc.poll() is None for s in kept), len(kept)
    simulator.run(lambda: dist.get_rank(), 3, isolation="process")
    assert list(warm.POOL._servers.values()) == kept  # the same three warm interpreters forked the next world
    simulator.run(lambda: dist.get_rank(), 1, isolation="process")
    servers = list(warm.POOL._servers.values())
    assert len(servers) <= 2, len(servers)
    assert all(s.proc.poll() is None for s in servers)


# ---------------------------------------------------------------------------
# a killed coordinator
# ---------------------------------------------------------------------------
_VICTIM = """
import os, subprocess, sys, time
import simulator, tensorplay.distributed as dist, torch

def rank(outdir):
    dist.all_reduce(torch.ones(1000))  # (an arena exists)
    child = subprocess.Popen(["sleep", "120"])  # a process the rank started
    with open(os.path.join(outdir, f"r{dist.get_rank()}.tmp"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    os.rename(os.path.join(outdir, f"r{dist.get_rank()}.tmp"), os.path.join(outdir, f"r{dist.get_rank()}"))
    time.sleep(120)

if __name__ == "__main__":
    simulator.run(rank, 2, args=(sys.argv[1],), isolation="process", timeout=300)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_killed_coordinator_leaves_no_arena_and_no_process(tmp_path, sig):
    """SIGTERM: the coordinator's handler cleans up (checked with rank processes spawned afresh, which have no warm
    interpreter to do it); SIGKILL: the warm interpreters do, when their coordinator dies."""
    script = tmp_path / "victim.py"
    script.write_text(_VICTIM)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               TENSORPLAY_SIM_WARM="0" if sig == signal.SIGTERM else "1")
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, cwd=tmp_path,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240  # a first world imports torch once per rank
        while not all((tmp_path / f"r{r}").exists() for r in range(2)):
            assert p.poll() is None, p.stderr.read().decode()[-3000:]  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.1)
        pids = [int(x) for r in range(2) for x in (tmp_path / f"r{r}").read_text().split()]
        arenas = [d for d in os.listdir("/dev/shm") if d.startswith(f"tp-sim-ranks-{p.pid}-")]
        assert arenas, "the run's arena directory is named after its coordinator"
        p.send_signal(sig)
        assert p.wait(timeout=30) == -sig
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            left = [d for d in os.listdir("/dev/shm") if d.startswith(f"tp-sim-ranks-{p.pid}-")]
            alive = [pid for pid in pids if not _gone(pid)]
            if not left and not alive:
                break
            time.sleep(0.1)
        assert not left and not alive, (left, alive)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
        for r in range(2):  # (only if the test failed: what it started must not outlive it)
            f = tmp_path / f"r{r}"
            for pid in (f.read_text().split() if f.exists() else ()):
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass


def test_stale_arenas_of_dead_coordinators_are_swept_at_start():
    from simulator.isolation import cleanup

    probe = subprocess.Popen(["true"])  # (a pid that has ended)
    probe.wait(timeout=30)
    stale = Path(cleanup.shm_root() or "/tmp") / f"{cleanup.PREFIX}{probe.pid}-stale"
    live = Path(cleanup.shm_root() or "/tmp") / f"{cleanup.PREFIX}{os.getpid()}-live"
    for d in (stale, live):
        d.mkdir()
        (d / "r0-a0").write_bytes(b"x" * 4096)
    try:
        simulator.run(lambda: None, 1, isolation="process")
        assert not stale.exists()
        assert live.exists()  # its coordinator (this process) lives
    finally:
        for d in (stale, live):
            if d.exists():
                (d / "r0-a0").unlink()
                d.rmdir()


# ---------------------------------------------------------------------------
# a script read from stdin; the note of a slow start
# ---------------------------------------------------------------------------
_STDIN = """
import sys
import simulator, torch
import tensorplay.distributed as dist
from tensorplay.distributed.errors import DistTypeError
from simulator.isolation import pickling

def f(k):
    x = torch.ones(2) * (dist.get_rank() + k)
    dist.all_reduce(x)
    return x.tolist()

if __name__ == "__main__":
    sys.modules["cloudpickle"] = None  # without cloudpickle: a clear error before anything starts
    try:
        simulator.run(f, 2, args=(1,), isolation="process")
    except DistTypeError as e:
        print("ERROR", e)
    del sys.modules["cloudpickle"]
    pickling._pickler = None
    print("RESULT", simulator.run(f, 2, args=(1,), isolation="process"))
"""


def test_a_function_of_a_script_read_from_stdin():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-"], input=_STDIN, capture_output=True, text=True, timeout=300, env=env,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    err = next(ln for ln in lines if ln.startswith("ERROR"))
    assert "f is defined in a main script that is no file (read from stdin" in err, err
    assert "save the script to a file" in err and "isolation='thread'" in err, err
    assert "RESULT [[3.0, 3.0], [3.0, 3.0]]" in lines, p.stdout


def test_a_slow_start_says_why_once(monkeypatch, capfd):
    monkeypatch.setattr(warm, "_said_slow", False)
    monkeypatch.setattr(warm, "_SLOW_START_S", 60.0)  # a quick start-up says nothing
    simulator.run(lambda: None, 2, isolation="process")
    assert "simulator: starting" not in capfd.readouterr().err
    monkeypatch.setattr(warm, "_SLOW_START_S", 0.0)  # every start-up is "slow" now: said once per process
    simulator.run(lambda: None, 2, isolation="process")
    time.sleep(0.2)
    simulator.run(lambda: None, 2, isolation="process")
    err = capfd.readouterr().err
    assert err.count("simulator: starting 2 rank interpreters (first run imports torch") == 1, err


_ENDS_AT_ONCE = r"""
import torch, simulator, tensorplay.distributed as dist

def step():
    torch.manual_seed(0)  # the same model on every rank: after the step, the same weights
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4) * (dist.get_rank() + 1)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    return float(model.weight.detach().sum())

if __name__ == "__main__":
    out = simulator.run(step, 2, isolation="process")
    print("same" if out[0] == out[1] else "differ")
"""


def test_a_program_that_ends_right_after_its_run_prints_no_traceback():
    """The warm interpreters outlive the run and learn the rank's imports meanwhile; a coordinator that ends at
    once closes their socket under them, which is their cue to end quietly (it once printed a BrokenPipeError)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    for _ in range(2):
        p = subprocess.run([sys.executable, "-"], input=_ENDS_AT_ONCE, capture_output=True, text=True, timeout=300,
                           env=env, cwd=ROOT)
        assert p.returncode == 0 and p.stdout.strip() == "same", p.stdout + p.stderr
        assert "Traceback" not in p.stderr and "Error" not in p.stderr, p.stderr


# ---------------------------------------------------------------------------
# large buffers used again move into shared memory (no staging copies), and still resize
# ---------------------------------------------------------------------------
N_LARGE = 1 << 19  # 2 MiB of float32: over staging.ADOPT_BYTES


def _reused_large_buffer() -> dict:
    r = dist.get_rank()
    x = torch.full((N_LARGE,), float(r))
    view = x[10:20]
    out: dict = {"moved": []}
    for _ in range(3):
        dist.all_reduce(x)
        out["moved"].append(x.untyped_storage().is_shared())
    out["x"], out["view"] = x.clone(), view.clone()
    st = x.untyped_storage()  # FSDP's free and re-allocation of a buffer between steps
    n = st.nbytes()
    st.resize_(0)
    st.resize_(n)
    x.fill_(1.0)
    for _ in range(2):
        dist.all_reduce(x, async_op=True).wait()
    out["after_resize"], out["moved_again"] = x.clone(), x.untyped_storage().is_shared()
    x.resize_(2 * N_LARGE)  # grows (Tensor.resize_)
    x.fill_(float(r + 1))
    dist.all_reduce(x)
    out["grown"] = x.clone()
    a = np.zeros(N_LARGE, dtype=np.float32)  # memory torch does not own: never moved
    t = torch.from_numpy(a)
    for _ in range(3):
        t.fill_(float(r + 2))
        dist.all_reduce(t)
    out["numpy"], out["numpy_moved"] = torch.from_numpy(a.copy()), t.untyped_storage().is_shared()
    return out


def test_a_reused_large_buffer_moves_into_shared_memory_and_still_resizes():
    """From its second call a large buffer's storage lives in shared memory (every view with it), so the simulator
    reads and writes it in place; FSDP's storage resizes and Tensor.resize_ still work; a numpy array's memory is
    never moved, and sees every result."""
    w = 4
    got = simulator.run(_reused_large_buffer, w, isolation="process")
    total = sum(range(w))  # sum of the ranks' values; each all_reduce multiplies a common value by w
    for r, out in enumerate(got):
        assert out["moved"] == [False, True, True], (r, out["moved"])
        assert torch.equal(out["x"], torch.full((N_LARGE,), float(total * w * w))), r
        assert torch.equal(out["view"], torch.full((10,), float(total * w * w))), r
        assert torch.equal(out["after_resize"], torch.full((N_LARGE,), float(w * w))), r
        assert out["moved_again"], r
        assert torch.equal(out["grown"], torch.full((2 * N_LARGE,), float(sum(k + 1 for k in range(w))))), r
        assert torch.equal(out["numpy"], torch.full((N_LARGE,), float(sum(k + 2 for k in range(w))))), r
        assert not out["numpy_moved"], r


def _torch_shm_maps(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if "/torch_" in line)


def _moved_then_dropped(coordinator: int, rounds: int) -> tuple[int, int]:
    before = _torch_shm_maps(coordinator)
    for _ in range(rounds):
        x = torch.ones(N_LARGE)
        for _ in range(2):
            dist.all_reduce(x)
        assert x.untyped_storage().is_shared()
        del x
    for _ in range(65):  # the rank process tells its proxy of dropped storages at its next calls
        dist.all_reduce(torch.ones(4))
    dist.barrier()
    return before, _torch_shm_maps(coordinator)


def test_moved_buffers_the_program_drops_are_let_go_by_the_coordinator():
    """Each moved buffer is mapped by the coordinator too; when the program drops it, the coordinator unmaps it
    (else every buffer a long run moved would stay in /dev/shm until the run ends)."""
    got = simulator.run(_moved_then_dropped, 2, args=(os.getpid(), 12), isolation="process")
    for r, (before, after) in enumerate(got):
        assert after <= before + 2, (r, before, after)  # (12 buffers per rank moved: 24 mappings if none let go)


# ---------------------------------------------------------------------------
# warm interpreters started ahead: while the command line (or pytest) imports torch, the ranks' interpreters do
# ---------------------------------------------------------------------------
_PROGRAM = r"""
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} sum {t.item():g}")
"""


@pytest.mark.parametrize("args,n,omp", [(["--isolation", "process", "--nproc-per-node", "2"], 2, "1"),
                                        (["--isolation=process", "--nproc_per_node=3", "--seed", "4"], 3, None)],
                         ids=["spaced", "equals-and-omp-unset"])
def test_the_command_line_starts_its_ranks_interpreters_ahead_and_uses_them(tmp_path, args, n, omp):
    (tmp_path / "prog.py").write_text(_PROGRAM)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONHASHSEED")}
    env.update({"OMP_NUM_THREADS": omp} if omp else {})
    p, starts = run_counting(tmp_path, "simulator", [*args, "prog.py"], "torch", env)
    assert p.returncode == 0, p.stderr
    # (found, not split into lines: under PYTHONUNBUFFERED two processes' prints can interleave)
    assert sorted(re.findall(r"rank \d+ sum \d+", p.stdout)) == [f"rank {r} sum {n * (n + 1) // 2}"
                                                                 for r in range(n)], p.stdout
    # n started before torch was imported, with n distinct hash seeds, and none more: the world used them
    assert starts == (n, n, n), p.stderr


def test_a_prestarted_interpreter_nobody_used_does_not_hold_up_the_exit():
    """A command line that fails before its world starts (a usage error) exits at once: the interpreters started
    ahead are still importing torch, and are killed rather than waited for."""
    pool = warm.WarmPool()
    try:
        assert pool.prestart(rank_envs(0, 2, os.environ)) == 2
        assert pool.prestart(rank_envs(0, 2, os.environ)) == 0  # (asked again: the same two)
        procs = [s.proc for s in pool._servers.values()]
    finally:
        pool.close()
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2  # killed, not waited for until they are ready
