"""Threads a simulated rank starts belong to that rank, as threads of a real rank process do (issue 12, item 4).

Every program here also runs unchanged on gloo processes: a thread of a rank
process sees the process group.  The simulator must run them to the same
result and keep naming deadlocks that go through a thread, on thread ranks and
on rank processes (issue 14: each thread of a rank process is an actor of its
own, with its own channel to the coordinator).
"""
from __future__ import annotations

import queue
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as tdist

import simulator
import tensorplay.distributed as dist
from _support.worlds import warm_rank_processes
from simulator.isolation import ISOLATIONS

MODES = ["coop", "threads"]
isolations = pytest.mark.parametrize("isolation", ISOLATIONS)


def _comm_thread_all_reduce():
    """A communication thread overlapping the rank's compute (torch front door)."""
    tdist.init_process_group("gloo")
    x = torch.arange(3.0) + 10 * tdist.get_rank()
    box = {}

    def comm():
        y = x.clone()
        tdist.all_reduce(y)
        box["y"] = y

    t = threading.Thread(target=comm, name="comm")
    t.start()
    z = x * 2  # compute while the thread communicates
    t.join()
    return box["y"], z


# (rank processes of a new seed start new warm interpreters, seconds each: one seed covers them)
@pytest.mark.parametrize("isolation,seed", [("thread", 0), ("thread", 1), ("thread", 2), ("process", 0)])
@pytest.mark.parametrize("mode", MODES)
def test_collective_from_a_thread_the_rank_started(mode, isolation, seed):
    w = 3
    res = simulator.run(_comm_thread_all_reduce, w, mode=mode, seed=seed, timeout=30, isolation=isolation)
    ref = sum(torch.arange(3.0) + 10 * r for r in range(w))
    for r, (y, z) in enumerate(res):
        assert torch.equal(y, ref) and torch.equal(z, (torch.arange(3.0) + 10 * r) * 2)


def _executor():
    x = torch.full((2,), float(dist.get_rank() + 1))
    with ThreadPoolExecutor(max_workers=1) as ex:
        fut = ex.submit(dist.all_reduce, x)
        fut.result()  # a Condition wait: the rank steps out so its worker can take its turn
    return x


@pytest.mark.parametrize("mode", MODES)
@isolations
def test_thread_pool_worker_runs_collectives(mode, isolation):
    res = simulator.run(_executor, 4, mode=mode, timeout=30, isolation=isolation)
    assert [t.tolist() for t in res] == [[10.0, 10.0]] * 4


_KEPT: list = []  # executors a program keeps for its lifetime (module state, as a real program's would be)


def _executor_left_open():
    """An executor kept open for the program's life: its workers are joined when the interpreter ends."""
    ex = ThreadPoolExecutor(max_workers=2)
    _KEPT.append(ex)
    x = torch.full((2,), float(dist.get_rank() + 1))
    ex.submit(dist.all_reduce, x).result()
    return x


@pytest.mark.parametrize("mode", MODES)
@isolations
def test_executor_left_open_ends_with_the_rank(mode, isolation, capfd):
    try:
        res = simulator.run(_executor_left_open, 3, mode=mode, timeout=30, isolation=isolation)
    finally:
        while _KEPT:  # (thread ranks kept theirs in this process)
            _KEPT.pop().shutdown()
    assert [t.tolist() for t in res] == [[6.0, 6.0]] * 3
    # a rank process joins them at its end (atexit) as a plain process does, after its rank has returned
    assert "Traceback" not in capfd.readouterr().err


def _queue_worker():
    """A long-lived comm thread fed through queues (the rank waits on Queue.get)."""
    todo, done = queue.Queue(), queue.Queue()

    def worker():
        while (t := todo.get()) is not None:
            dist.all_reduce(t)
            done.put(t)

    th = threading.Thread(target=worker, daemon=True)
    th.start()
    outs = []
    for i in range(3):
        todo.put(torch.full((2,), float(dist.get_rank() * 10 + i)))
        outs.append(done.get().tolist())
    todo.put(None)
    th.join()
    return outs


@pytest.mark.parametrize("mode", MODES)
@isolations
def test_queue_fed_comm_thread(mode, isolation):
    w = 2
    expect = [[float(sum(r * 10 + i for r in range(w)))] * 2 for i in range(3)]
    assert simulator.run(_queue_worker, w, mode=mode, timeout=30, isolation=isolation) == [expect] * w


def _p2p_from_thread():
    r, w = dist.get_rank(), dist.get_world_size()
    out = torch.empty(2)
    t = threading.Thread(target=dist.send, args=(torch.full((2,), float(r)), (r + 1) % w))
    t.start()  # the blocking send runs in the thread while the rank receives
    src = dist.recv(out, (r - 1) % w)
    t.join()
    return out.tolist(), src


@pytest.mark.parametrize("mode", MODES)
@isolations
def test_blocking_send_in_a_thread_and_recv_in_the_rank(mode, isolation):
    w = 3
    assert simulator.run(_p2p_from_thread, w, mode=mode, timeout=30, isolation=isolation) == \
        [([float((r - 1) % w)] * 2, (r - 1) % w) for r in range(w)]


def _two_threads_at_once():
    """Rank 0's two threads each wait in a collective; rank 1 serves the second group first.

    On gloo both threads of rank 0 are in their collectives at once.  A rank whose threads took turns on one
    channel would block the second group behind the first and never finish.
    """
    r = dist.get_rank()
    g1, g2 = dist.new_group([0, 1]), dist.new_group([0, 1])
    x, y = torch.full((2,), 1.0 + r), torch.full((2,), 10.0 + r)
    if r == 0:
        ts = [threading.Thread(target=dist.all_reduce, args=(x,), kwargs={"group": g1}, name="first"),
              threading.Thread(target=dist.all_reduce, args=(y,), kwargs={"group": g2}, name="second")]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    else:
        dist.all_reduce(y, group=g2)
        dist.all_reduce(x, group=g1)
    return x.tolist(), y.tolist()


@pytest.mark.parametrize("mode", MODES)
@isolations
def test_two_threads_of_a_rank_communicate_at_once(mode, isolation):
    assert simulator.run(_two_threads_at_once, 2, mode=mode, timeout=30, isolation=isolation) == \
        [([3.0, 3.0], [21.0, 21.0])] * 2


def _thread_waits_for_a_rank_that_returned():
    x = torch.ones(1)
    if dist.get_rank() == 0:
        t = threading.Thread(target=dist.all_reduce, args=(x,), name="comm")
        t.start()
        t.join()
    return x


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread gets it too
@pytest.mark.parametrize("mode", MODES)
@isolations
def test_deadlock_through_a_thread_is_named_not_timed_out(mode, isolation):
    import time

    if isolation == "process":
        warm_rank_processes(2)  # the bound below is on detection, not on starting interpreters
    t0 = time.monotonic()
    with pytest.raises(simulator.DeadlockError) as ei:
        simulator.run(_thread_waits_for_a_rank_that_returned, 2, mode=mode, timeout=30, isolation=isolation)
    assert time.monotonic() - t0 < 5.0
    text = str(ei.value)
    assert "rank 0 waits in Thread.join of its thread 'comm'" in text
    assert "rank 0 (thread 'comm') waits in all_reduce #1 on group [0, 1]" in text and "missing: [1]" in text
    assert "rank 1 has returned" in text


def _non_daemon_thread_outlives_the_rank(out_dir: str):
    """torch.distributed in a non-daemon thread after the rank's function returned: a process's interpreter waits
    for the thread before its exit handlers, and the process group is still there (an atexit handler sees both)."""
    import atexit
    import os
    import time

    r = dist.get_rank()
    x = torch.full((1,), float(r + 1))
    done = []

    def worker():
        time.sleep(0.2)  # (the rank has returned by now)
        tdist.all_reduce(x)
        done.append(x.item())

    def at_exit():
        with open(os.path.join(out_dir, f"rank{r}"), "w") as f:
            f.write(f"{done} {tdist.is_initialized()}")

    tdist.init_process_group("gloo")
    atexit.register(at_exit)
    threading.Thread(target=worker, daemon=False).start()
    return r


@isolations
def test_a_non_daemon_thread_communicates_after_its_rank_returned(tmp_path, isolation):
    assert simulator.run(_non_daemon_thread_outlives_the_rank, 2, args=(str(tmp_path),), timeout=60,
                         isolation=isolation) == [0, 1]
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["[3.0] True"] * 2


def _daemon_thread_left_behind():
    stop = threading.Event()
    threading.Thread(target=stop.wait, args=(30.0,), daemon=True).start()
    x = torch.ones(1)
    dist.all_reduce(x)
    return x.item()


@pytest.mark.parametrize("mode", MODES)
@isolations
def test_run_does_not_wait_for_daemon_threads(mode, isolation):
    import time

    t0 = time.monotonic()
    assert simulator.run(_daemon_thread_left_behind, 2, mode=mode, timeout=30, isolation=isolation) == [2.0, 2.0]
    assert time.monotonic() - t0 < 10.0  # a process exits without waiting for its daemon threads


_LISTENERS: dict[int, threading.Thread] = {}


def _listener_signalled_then_released_from_its_join():
    """torch's MultiProcessTestCase.run_test, in small: a daemon thread waits on a pipe; the rank signals it, then
    joins it; rank 1 fails meanwhile, so rank 0 is released from its join while the thread is still ending."""
    import os
    import time

    dist.init_process_group("sim")
    r_fd, w_fd = os.pipe()

    def listen():
        os.read(r_fd, 1)  # an OS wait, outside the schedule
        time.sleep(0.3)   # still ending when the rank is released
        os.close(r_fd)

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    _LISTENERS[dist.get_rank()] = t
    os.write(w_fd, b"x")
    os.close(w_fd)
    if dist.get_rank() == 1:
        time.sleep(0.1)  # (coop: steps out of the schedule, so rank 0 is in its join when rank 1 fails)
        raise ValueError("rank 1 fails while rank 0 joins its listener")
    t.join()


def test_a_daemon_thread_told_to_stop_has_ended_when_the_run_returns():
    """A real process's daemon threads end with it; a rank's get a bounded moment to end before the run returns,
    so that what the launcher does next (torch's harness closes the pipe the thread listens on) is not seen by it."""
    _LISTENERS.clear()
    with pytest.raises(ValueError, match="rank 1 fails"):
        simulator.run(_listener_signalled_then_released_from_its_join, 2, mode="coop", seed=0, timeout=30)
    assert set(_LISTENERS) == {0, 1}
    assert not any(t.is_alive() for t in _LISTENERS.values())


def test_threads_outside_a_world_are_untouched():
    seen = []
    t = threading.Thread(target=lambda: seen.append(simulator.current_rank_state()))
    t.start()
    t.join()
    assert seen == [None] and not hasattr(t, "_tp_sim_inherited")


def _signal_handlers():
    import signal

    r = dist.get_rank()

    def handler(signum, frame):  # (never called: only installed)
        pass

    handler.rank = r
    before = signal.getsignal(signal.SIGUSR1)
    previous = signal.signal(signal.SIGUSR1, handler)
    dist.barrier()  # every rank has installed its own before any reads
    own = signal.getsignal(signal.SIGUSR1)
    again = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    errors = []
    for bad in ((signal.SIGKILL, handler), (0, handler), (signal.SIGUSR2, "not a handler")):
        try:
            signal.signal(*bad)
        except (OSError, ValueError, TypeError) as e:
            errors.append(type(e).__name__)
    in_thread = []

    def from_a_thread():  # a process's other threads cannot install handlers
        try:
            signal.signal(signal.SIGUSR1, handler)
        except ValueError as e:
            in_thread.append(str(e))

    t = threading.Thread(target=from_a_thread)
    t.start()
    t.join()
    return (before == previous, getattr(own, "rank", None), getattr(again, "rank", None),
            signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN, errors, in_thread)


@isolations
def test_a_rank_installs_signal_handlers_of_its_own(isolation):
    """A rank process's main thread installs signal handlers; a thread rank does too (kept per rank, see
    simulator/adapters/threads.py), and the process's own handlers are as they were after the run."""
    import signal

    process_handler = signal.getsignal(signal.SIGUSR1)
    out = simulator.run(_signal_handlers, 2, isolation=isolation, timeout=60)
    for r, (kept, own, again, ignored, errors, in_thread) in enumerate(out):
        assert kept and own == r and again == r and ignored
        assert errors == ["OSError", "ValueError", "TypeError"]
        assert len(in_thread) == 1 and "main thread" in in_thread[0]
    assert signal.getsignal(signal.SIGUSR1) == process_handler


def _alarm_interrupts_a_long_wait() -> str:
    """A watchdog written with signal.alarm: a process's handler interrupts the rank's long sleep."""
    import signal
    import time

    class Timeout(Exception):
        pass

    def on_alarm(signum, frame):
        raise Timeout()

    signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.alarm(1)
        try:
            if dist.get_rank() == 0:
                time.sleep(5)
            outcome = "not interrupted"
        except Timeout:
            outcome = "interrupted"
        finally:
            signal.alarm(0)
    except simulator.SimError as e:  # (thread ranks: refused before any timer is set)
        outcome = str(e)
    dist.barrier()
    return outcome


@isolations
def test_a_timer_signal_is_a_rank_processes_own_and_refused_on_thread_ranks(isolation):
    """SIGALRM goes to a process: rank processes get their own; on thread ranks the shared process would have been
    killed by the signal's default action (no message), so setting the timer fails, naming the fix."""
    import signal

    out = simulator.run(_alarm_interrupts_a_long_wait, 2, isolation=isolation, timeout=60)
    if isolation == "process":
        assert out == ["interrupted", "not interrupted"]
    else:
        for r, msg in enumerate(out):
            assert re.search(rf"^signal\.alarm \(rank {r}\): a timer signal .*seconds=1\. Fix: .*isolation='process'",
                             msg), msg
    assert type(signal.alarm).__name__ == "builtin_function_or_method"  # the real one is back after the run


def _silence_all_but_rank_zero():
    import builtins
    import io
    import os
    import sys

    r = dist.get_rank()
    real_print = builtins.print  # the rank's own: the process's print (DETR/DeiT's setup_for_distributed)

    def quiet_print(*args, force=False, **kwargs):
        if r == 0 or force:
            real_print(*args, **kwargs)

    builtins.print = quiet_print
    dist.barrier()  # every rank has replaced it before any prints
    print(f"rank {r}: only rank 0's line is printed")
    print(f"rank {r}: forced", force=True)
    if r != 0:
        sys.stdout = open(os.devnull, "w")
    dist.barrier()
    sys.stdout.write(f"rank {r}: written to its stdout\n")
    sys.stdout.flush()
    tee = io.StringIO()
    seen = sys.stdout
    sys.stdout = tee  # a rank's own redirection: the others' stdout is untouched
    dist.barrier()
    print(f"rank {r}: into its own buffer", force=True)
    sys.stdout = seen
    if r != 0:
        sys.stdout.close()
    return tee.getvalue(), builtins.print is quiet_print


@isolations
def test_each_rank_has_its_own_stdout_and_print(isolation, capfd):
    """Silencing every rank but the first (a print that drops non-master lines, sys.stdout sent to os.devnull)
    silences those ranks only, as on processes; thread ranks used to share the last rank's choice."""
    import builtins

    process_print = builtins.print
    out = simulator.run(_silence_all_but_rank_zero, 3, isolation=isolation, timeout=60)
    assert out == [(f"rank {r}: into its own buffer\n", True) for r in range(3)]
    out = re.sub(r"(?<=[^\n])(?=rank \d: )", "\n", capfd.readouterr().out)  # (rank processes' lines interleave)
    printed = sorted(line for line in out.splitlines() if line.startswith("rank "))
    assert printed == ["rank 0: forced", "rank 0: only rank 0's line is printed", "rank 0: written to its stdout",
                       "rank 1: forced", "rank 2: forced"]
    assert builtins.print is process_print


_LIBRARY_LOG = __import__("logging").getLogger("tests.a_library_imported_before_the_ranks")


def _rank_logging():
    import io
    import logging

    r = dist.get_rank()
    buffer = io.StringIO()
    logging.basicConfig(level=logging.INFO if r == 0 else logging.WARNING, format=f"[rank{r}] %(message)s",
                        stream=buffer, force=True)
    dist.barrier()  # every rank has configured logging before any logs
    logging.getLogger("tests.a_rank_logger").info("info from %d", r)
    _LIBRARY_LOG.warning("library warning on %d", r)  # a module-level logger reaches the rank's own handler
    return buffer.getvalue().splitlines(), logging.getLogger().level


@isolations
def test_each_rank_configures_its_own_logging(isolation):
    """logging.basicConfig(level=INFO on rank 0 else WARNING, format naming the rank), as training scripts do:
    each rank's root logger is its own, as each process's is, whichever rank the schedule ran first."""
    import logging

    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    for seed in (0, 1):
        out = simulator.run(_rank_logging, 3, isolation=isolation, seed=seed, timeout=60, hash_seed=0)
        assert out[0] == (["[rank0] info from 0", "[rank0] library warning on 0"], logging.INFO)
        for r in (1, 2):
            assert out[r] == ([f"[rank{r}] library warning on {r}"], logging.WARNING)
    assert (root.level, list(root.handlers)) == before


_IMPORT_TIME_CONFIG = """
import logging

RECORDS = []


class _ListHandler(logging.Handler):
    def emit(self, record):
        RECORDS.append(record.getMessage())


# at import, as pytorch/examples' log_utils.py does (force: the test process's root has pytest's handlers)
logging.basicConfig(level=logging.INFO, handlers=[_ListHandler()], force=True)
"""


def _rank_imports_a_configuring_module(where: str, name: str):
    import importlib
    import logging
    import sys

    r = dist.get_rank()
    sys.path.insert(0, where) if where not in sys.path else None
    helper = importlib.import_module(name)
    logging.getLogger("tests.a_rank_logger").info("info from %d", r)
    return [m for m in helper.RECORDS if m == f"info from {r}"], logging.getLogger().level


@isolations
def test_a_module_that_configures_logging_as_it_is_imported_configures_every_rank(isolation, tmp_path):
    """A helper module whose top-level code calls logging.basicConfig configures each process that imports it;
    thread ranks share the module, so its one import configures the process's logging, which every rank that
    has not configured its own sees (before, only the rank that imported it first logged)."""
    import logging
    import sys

    root = logging.getLogger()
    before = (root.level, list(root.handlers))
    try:
        for seed in (0, 1):
            name = f"_tp_logs_on_import_{isolation}_{seed}"
            (tmp_path / f"{name}.py").write_text(_IMPORT_TIME_CONFIG)
            out = simulator.run(_rank_imports_a_configuring_module, 3, args=(str(tmp_path), name),
                                isolation=isolation, seed=seed, timeout=60, hash_seed=0)
            assert out == [([f"info from {r}"], logging.INFO) for r in range(3)]
    finally:
        root.handlers[:] = before[1]
        root.setLevel(before[0])
        for seed in (0, 1):
            sys.modules.pop(f"_tp_logs_on_import_{isolation}_{seed}", None)


_EXITS: list = []


def _registers_exit_handlers(fail: bool):
    import atexit
    import time

    r = dist.get_rank()

    def first():
        _EXITS.append((r, "first", tdist.is_initialized()))

    def second(tag):
        _EXITS.append((r, tag, tdist.is_initialized()))
        raise RuntimeError("an exit handler that raises is reported, and the next one runs")

    tdist.init_process_group("gloo")
    atexit.register(first)
    atexit.register(second, "second")
    atexit.register(first)
    atexit.unregister(first)  # (every registration of it)
    atexit.register(first)
    tdist.all_reduce(torch.ones(1))
    if fail and r == 1:
        raise ValueError("rank 1 fails after registering")
    return r


@isolations
def test_a_rank_runs_its_atexit_handlers_when_it_ends(isolation, capfd):
    """A process runs its atexit handlers when its program ends, its process group still there; a thread rank
    runs those its code registered when its function ends (last first), not the test process at its exit."""
    _EXITS.clear()
    assert simulator.run(_registers_exit_handlers, 2, args=(False,), isolation=isolation, timeout=60) == [0, 1]
    err = capfd.readouterr().err
    assert err.count("Exception ignored in atexit callback") == 2 and "the next one runs" in err
    if isolation == "thread":  # (rank processes run theirs in their own process)
        assert sorted(_EXITS) == [(0, "first", True), (0, "second", True), (1, "first", True), (1, "second", True)]
        _EXITS.clear()
        with pytest.raises(ValueError, match="rank 1 fails"):
            simulator.run(_registers_exit_handlers, 2, args=(True,), timeout=60)
        assert sorted(e[:2] for e in _EXITS) == [(0, "first"), (0, "second"), (1, "first"), (1, "second")]


def _rank_warnings():
    import warnings

    r = dist.get_rank()
    if r != 0:
        warnings.filterwarnings("ignore")  # the non-master ranks silence their warnings, as scripts do
    dist.barrier()
    warnings.warn(f"careful from rank {r}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # inside: this rank's warnings raise
        try:
            warnings.warn("raised inside catch_warnings")
            raised = False
        except UserWarning:
            raised = True
    dist.barrier()
    warnings.warn(f"after catch_warnings from rank {r}")  # the rank's own filters are back
    return raised


@isolations
def test_each_rank_has_its_own_warning_filters(isolation, recwarn):
    import warnings

    before = list(warnings.filters)
    assert simulator.run(_rank_warnings, 3, isolation=isolation, timeout=60) == [True, True, True]
    if isolation == "thread":  # (rank processes' warnings are their own process's, printed there)
        assert sorted(str(w.message) for w in recwarn) == ["after catch_warnings from rank 0", "careful from rank 0"]
    assert warnings.filters == before


def _rank_chdir(base):
    import os

    r = dist.get_rank()
    own = os.path.join(base, f"rank{r}")
    os.makedirs(own, exist_ok=True)
    os.chdir(own)  # as a program that writes its outputs under a directory of its own
    dist.barrier()  # every rank has moved before any writes
    with open("mine.txt", "w") as f:  # a relative path: the rank's own directory, as in a process
        f.write(str(r))
    dist.barrier()
    with open("mine.txt") as f:
        return os.path.basename(os.getcwd()), f.read()


@pytest.mark.parametrize("isolation, mode", [("thread", "coop"), ("process", "coop"), ("process", "threads")])
def test_each_rank_has_its_own_working_directory(isolation, mode, tmp_path, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    got = simulator.run(_rank_chdir, 3, args=(str(tmp_path),), isolation=isolation, mode=mode, seed=1, timeout=60)
    assert got == [("rank0", "0"), ("rank1", "1"), ("rank2", "2")]
    assert os.getcwd() == str(tmp_path)  # the launcher's directory is its own


def test_free_running_thread_ranks_warn_when_their_directories_part(tmp_path, monkeypatch):
    import os

    monkeypatch.chdir(tmp_path)
    with pytest.warns(RuntimeWarning, match=r"os\.chdir \(rank \d\): free-running thread ranks share one working "
                                            r"directory.*Fix: run with mode='coop'.*isolation='process'") as caught:
        got = simulator.run(_rank_chdir, 3, args=(str(tmp_path),), mode="threads", timeout=60)
    assert sum("os.chdir" in str(w.message) for w in caught) == 1  # said once per run
    assert len({d for d, _ in got}) == 1  # what they share: the last rank's directory
    assert os.getcwd() == str(tmp_path)


def _rank_records_warnings():
    import warnings

    r = dist.get_rank()
    t = torch.ones(1)
    with warnings.catch_warnings(record=True) as log:  # unittest's assertWarns records this way
        warnings.simplefilter("always")
        dist.all_reduce(t)  # every rank is inside its block here ...
        warnings.warn(f"rank {r} warns", FutureWarning)
        dist.all_reduce(t)  # ... and here
    return [str(w.message) for w in log]


@isolations
def test_each_rank_records_its_own_warnings(isolation):
    import warnings

    hooks = (warnings.showwarning, warnings._showwarnmsg_impl)
    got = simulator.run(_rank_records_warnings, 3, isolation=isolation, timeout=60)
    assert got == [[f"rank {r} warns"] for r in range(3)]
    assert (warnings.showwarning, warnings._showwarnmsg_impl) == hooks  # the process's hooks are back


_PROCESS_LOCK = threading.Lock()


def _compile_like():
    import subprocess
    import sys

    with _PROCESS_LOCK:  # as torch.compile: dynamo's compile lock held while inductor runs a compiler
        subprocess.run([sys.executable, "-c", "import time; time.sleep(0.2)"], timeout=30, check=True)
    return dist.get_rank()


def test_a_coop_rank_waiting_for_its_subprocess_keeps_the_turn():
    """subprocess's polling sleeps wait for the rank's own child: stepping out of the schedule there handed the turn
    to a rank that then blocked for real on the lock the sleeper held, and the run hung until its timeout."""
    assert simulator.run(_compile_like, 2, mode="coop", timeout=30) == [0, 1]


def _rank_sets_a_c_variable():
    import ctypes
    import os

    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    r = dist.get_rank()
    os.environ["TP_TEST_C_ENV"] = f"rank{r}"  # (a compiled extension reads what Python set with getenv)
    seen = getenv(b"TP_TEST_C_ENV")
    return os.environ["TP_TEST_C_ENV"], seen.decode() if seen else None


def test_a_ranks_environment_assignment_reaches_the_c_environment():
    """os.environ on thread ranks is each rank's own; an assignment also reaches the process's C environment, as
    os.environ's own does (torch inductor's compiled modules read a variable Python set), and the process's values
    are back after the run."""
    import ctypes
    import os

    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    got = simulator.run(_rank_sets_a_c_variable, 2, torchrun_env=True, timeout=60)
    assert got == [("rank0", "rank0"), ("rank1", "rank1")]  # (coop: each reads right after its own assignment)
    assert "TP_TEST_C_ENV" not in os.environ and getenv(b"TP_TEST_C_ENV") is None


def _ranks_poll_one_event(ev: threading.Event) -> int:
    """Every rank polls one event (a flag the ranks share, set from outside) while a thread of its own waits:
    each wait steps out of the schedule and back in, so the turn and the event's lock change hands often."""
    done = threading.Event()
    helper = threading.Thread(target=done.wait, args=(30,), name="helper")
    helper.start()
    polls = 0
    while not ev.wait(0.001):
        polls += 1
    done.set()
    helper.join()
    x = torch.ones(1)
    dist.all_reduce(x)
    return int(x.item())


def test_ranks_polling_one_event_never_wait_for_the_turn_holding_its_lock():
    """A rank that wakes from ``Event.wait`` takes its turn before the event's lock: before, it waited for the
    turn holding the lock while the turn's holder waited for that lock (the run hung to its bound)."""
    ev = threading.Event()
    timer = threading.Timer(0.4, ev.set)
    timer.start()
    try:
        assert simulator.run(_ranks_poll_one_event, 3, args=(ev,), mode="coop", timeout=20) == [3] * 3
    finally:
        timer.cancel()


def _a_thread_waits_on_the_ranks_async_ops():
    """The rank issues async operations and a thread of its own waits for them (a comm-wait thread)."""
    r, w = dist.get_rank(), dist.get_world_size()
    x = torch.full((3,), float(r + 1))
    y = torch.full((2,), float(r))
    z = torch.zeros(2)
    works = [dist.all_reduce(x, async_op=True), dist.broadcast(y, src=w - 1, async_op=True)]
    if r == 0:
        works.append(dist.isend(torch.full((2,), 7.0), 1))
    elif r == 1:
        works.append(dist.irecv(z, 0))
    t = threading.Thread(target=lambda: [wk.wait() for wk in works], name="waiter")
    t.start()
    t.join()  # (no timeout: a wait the scheduler sees, so a thread nobody wakes is a deadlock at once)
    return x.tolist(), y.tolist(), z.tolist()


@pytest.mark.parametrize("mode", MODES)
@isolations
def test_a_thread_waits_on_async_operations_its_rank_issued(mode, isolation):
    """Completion woke only the actor that issued the operation: a thread of the rank waiting on it in coop mode
    was never woken (the run ended in a deadlock report)."""
    w = 3
    got = simulator.run(_a_thread_waits_on_the_ranks_async_ops, w, mode=mode, timeout=30, isolation=isolation)
    total = float(sum(r + 1 for r in range(w)))
    assert got == [([total] * 3, [float(w - 1)] * 2, [7.0, 7.0] if r == 1 else [0.0, 0.0]) for r in range(w)]


def _ranks_talk_over_a_socket(port: int):
    """Rank 1 blocks in recv() until rank 0, which computes first, sends (a wait in the kernel, on another rank)."""
    import socket

    r = dist.get_rank()
    if r == 0:
        srv = socket.socket()
        srv.bind(("127.0.0.1", port))
        srv.listen(1)
    dist.barrier()
    if r == 0:
        conn, _ = srv.accept()
        payload = str(float(torch.arange(4.0).sum())).encode()
        conn.sendall(payload)
        conn.close()
        srv.close()
        got = "sent"
    else:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
            got = c.recv(100).decode()
    x = torch.tensor([float(r + 1)])
    dist.all_reduce(x)
    return got, x.item()


def _select_on_a_pipe_a_thread_writes():
    """The rank polls a pipe with select() while a thread of its own writes to it after a collective."""
    import os
    import select

    rd, wr = os.pipe()

    def writer():
        x = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(x)
        os.write(wr, str(x.item()).encode())
        os.close(wr)

    t = threading.Thread(target=writer)
    t.start()
    buf = b""
    while True:
        ready, _, _ = select.select([rd], [], [], 0.02)
        if ready:
            chunk = os.read(rd, 100)
            if not chunk:
                break
            buf += chunk
    t.join()
    os.close(rd)
    return buf.decode()


@isolations
def test_a_coop_rank_waiting_in_the_kernel_for_another_lets_it_run(isolation):
    """A socket recv() or a select() that would block steps out of the schedule (before: the rank kept the turn
    in the kernel, and the peer it waited for never ran: the run hung)."""
    from tensorplay.testing import free_port

    got = simulator.run(_ranks_talk_over_a_socket, 2, args=(free_port(),), mode="coop", timeout=60,
                        isolation=isolation)
    assert got == [("sent", 3.0), ("6.0", 3.0)]
    assert simulator.run(_select_on_a_pipe_a_thread_writes, 2, mode="coop", timeout=60,
                         isolation=isolation) == ["3.0", "3.0"]


def _main_waits_for_a_lock_its_thread_holds_across_a_collective():
    started, held = threading.Event(), threading.Lock()  # (the rank's own: module globals are shared by thread ranks)

    def holder():
        with held:
            started.set()
            dist.all_reduce(torch.ones(1))

    t = threading.Thread(target=holder, name="holder")
    t.start()
    started.wait(10)
    with held:  # a wait in C the simulator cannot see: in coop mode the thread never gets the turn
        pass
    t.join()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread gets it too
def test_a_rank_blocked_on_a_lock_its_waiting_thread_holds_is_named_with_the_fix(monkeypatch, capfd):
    """What coop mode cannot run (see docs/deviations.md) is said while it runs (a warning once the rank has held
    the turn, blocked, for HELD_TURN_WARN_S) and ends at the stall bound with a report that names the thread
    waiting for the turn and the fix, without the scheduler's own errors from the aborted run."""
    from simulator.core import progress

    monkeypatch.setattr(progress, "HELD_TURN_WARN_S", 0.5)
    with pytest.raises(simulator.SimTimeoutError) as info:
        simulator.run(_main_waits_for_a_lock_its_thread_holds_across_a_collective, 2, mode="coop", stall_timeout=4,
                      timeout=60)
    err = capfd.readouterr().err
    assert "has held the turn for" in err and "while rank" in err and "(thread 'holder') waits for it" in err
    assert "release unlocked lock" not in err
    text = str(info.value)
    assert "(thread 'holder') waits for the turn to enter an operation" in text
    assert "Fix: run with mode='threads'" in text
    assert simulator.run(_main_waits_for_a_lock_its_thread_holds_across_a_collective, 2, mode="threads",
                         timeout=60) == [None, None]
