"""Every failure mode of the simulator, provoked: mismatches, deadlocks, rank failures, timeouts.

Each test checks the error type, that every involved rank got it, that it came within a second,
and that the message names the ranks and the call sites.
"""
from __future__ import annotations

import re
import time
import warnings

import pytest
import torch

import simulator
from _support.worlds import warm_rank_processes
import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed import DistError, DistTimeoutError, ReduceOp
from tensorplay.distributed import _state
from simulator.isolation import ISOLATIONS

HERE = "test_sim_failures.py:"
#: how the ranks run: a schedule of thread ranks, or rank processes (isolation="process", coop schedule)
MODES = ["coop", "threads", "process"]


def _how(mode: str) -> dict:
    """``simulator.World`` keywords of a ``MODES`` entry."""
    return {"mode": "coop", "isolation": "process"} if mode == "process" else {"mode": mode}


@pytest.fixture(scope="module", autouse=True)
def _warm_rank_processes():
    """The tests time detection, not the start-up of rank processes."""
    warm_rank_processes(4, _noop)


def _noop() -> None:
    return None


def _fail(fn, w, mode, cls, **kw):
    """Run ``fn``, expect ``cls`` from run(); return (exception, world, seconds)."""
    world = simulator.World(w, timeout=kw.pop("timeout", 20), **_how(mode), **kw)
    t0 = time.monotonic()
    with pytest.raises(cls) as ei:
        world.run(fn)
    return ei.value, world, time.monotonic() - t0


# -- mismatches ---------------------------------------------------------------
def _differs_collective():
    x = tp.ones(3)
    if dist.get_rank() == 1:
        dist.broadcast(x, src=0)
    else:
        dist.all_reduce(x)


def _differs_op():
    dist.all_reduce(tp.ones(3), op=ReduceOp.MAX if dist.get_rank() == 2 else ReduceOp.SUM)


def _differs_root():
    dist.broadcast(tp.ones(3), src=dist.get_rank() % 2)


def _differs_dtype():
    dist.all_reduce(tp.ones(3, dtype=torch.float64 if dist.get_rank() == 0 else torch.float32))


def _differs_shape():
    dist.all_gather([tp.empty(2 + dist.get_rank()) for _ in range(3)], tp.ones(2 + dist.get_rank()))


def _differs_a2a_shapes():
    r = dist.get_rank()
    ins = [tp.ones(2) for _ in range(3)]
    outs = [tp.empty(3 if (r == 1 and j == 0) else 2) for j in range(3)]  # rank 1 expects 3 from rank 0
    dist.all_to_all(outs, ins)


def _differs_splits():
    r = dist.get_rank()
    out_splits = [1, 1, 1] if r != 2 else [2, 0, 1]  # rank 2 expects 2 rows from rank 0, which sends 1
    dist.all_to_all_single(tp.empty(3), tp.ones(3), out_splits, [1, 1, 1])


def _differs_new_group():
    dist.new_group([0, 1] if dist.get_rank() == 0 else [1, 2])


MISMATCHES = {
    "collective": (_differs_collective, "collective differs"),
    "op": (_differs_op, "op differs"),
    "root": (_differs_root, "root differs"),
    "dtype": (_differs_dtype, "dtype differs"),
    "shape": (_differs_shape, "shape differs"),
    "all_to_all_shapes": (_differs_a2a_shapes, "rank 0 sends a block of shape (2,) to rank 1, which expects shape (3,)"),
    "all_to_all_single_splits": (_differs_splits, "rank 0 sends 1 rows to rank 2, which expects 2"),
    "new_group": (_differs_new_group, "ranks differ (rank 0: (0, 1)"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_mismatch_raised_on_every_rank_with_table(kind, mode):
    fn, reason = MISMATCHES[kind]
    e, world, dt = _fail(fn, 3, mode, simulator.CollectiveMismatchError)
    assert dt < 5.0  # at once: far below the run's 20 s timeout (margins for a loaded machine)
    assert isinstance(e, DistError) and isinstance(e, RuntimeError)
    assert all(isinstance(x, simulator.CollectiveMismatchError) for x in world.errors), world.errors
    msg = str(e)
    assert reason in msg
    assert re.search(r"rank \| collective +\| op +\| root +\| dtype +\| shape +\| called at", msg)
    for r in range(3):
        assert f"\n  {r} " in msg  # one table row per rank
    assert msg.count(HERE) == 3  # every row names the user's line
    assert "Fix:" in msg


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_mismatch_in_subgroup_names_only_members(isolation):
    def fn():
        g = dist.new_group([3, 1, 2])
        r = dist.get_rank()
        if r in (1, 2, 3):
            dist.all_reduce(tp.ones(2 if r != 3 else 4), group=g)

    e, world, _ = _fail(fn, 4, "process" if isolation == "process" else "coop", simulator.CollectiveMismatchError)
    assert "on group [1, 2, 3]" in str(e)
    assert world.errors[0] is None or isinstance(world.errors[0], simulator.RankFailedError)
    assert all(isinstance(world.errors[r], simulator.CollectiveMismatchError) for r in (1, 2, 3))


# -- deadlocks ------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_deadlock_missing_rank_returned(mode):
    def fn():
        x = tp.ones(3)
        dist.all_reduce(x)
        if dist.get_rank() != 1:
            dist.all_reduce(x)

    e, world, dt = _fail(fn, 3, mode, simulator.DeadlockError)
    assert dt < 5.0  # at once: far below the run's 20 s timeout (margins for a loaded machine)
    msg = str(e)
    assert "ranks 0 and 2 wait in all_reduce #2 on group [0, 1, 2]" in msg
    assert "rank 1 has returned" in msg
    assert msg.count(HERE) >= 1
    assert [type(x) for x in world.errors] == [simulator.DeadlockError, type(None), simulator.DeadlockError]


@pytest.mark.parametrize("mode", MODES)
def test_deadlock_both_wait_in_recv(mode):
    def fn():
        dist.recv(tp.empty(1), src=1 - dist.get_rank())

    e, world, dt = _fail(fn, 2, mode, simulator.DeadlockError)
    assert dt < 5.0  # at once: far below the run's 20 s timeout (margins for a loaded machine)
    assert "ranks 0 and 1 both wait in recv" in str(e)
    assert "rank 0 waits in recv from rank 1" in str(e)
    assert all(isinstance(x, simulator.DeadlockError) for x in world.errors)


def _skips_its_recv_in_a_batch():
    r = dist.get_rank()
    ops = [dist.P2POp(dist.isend, tp.ones(2), 1 - r)] + ([dist.P2POp(dist.irecv, tp.zeros(2), 1 - r)] if r == 0 else [])
    for w in dist.batch_isend_irecv(ops):
        w.wait()


@pytest.mark.parametrize("mode", MODES)
def test_deadlock_on_a_peer_that_returned_names_the_skipped_operation(mode):
    """The hint names the rank that returned without the matching operation, not a cycle of waits or a blocking
    send (the send here is already an isend, and the fix is on the other rank)."""
    e, world, _ = _fail(_skips_its_recv_in_a_batch, 2, mode, simulator.DeadlockError)
    msg = str(e)
    assert "rank 1 returned without posting the recv that matches rank 0's send (tag 0, at " + HERE in msg
    assert "left it out on rank 1" in msg
    assert "blocking send" not in msg and "nobody issues" not in msg
    assert isinstance(world.errors[0], simulator.DeadlockError) and world.errors[1] is None


def _broadcasts_object_lists_of_two_lengths():
    import torch.distributed as tdist  # (torch's own object collectives, which issue tensors of their own)
    tdist.init_process_group("sim")
    tdist.broadcast_object_list([1, 2, 3] if tdist.get_rank() == 0 else [None, None], src=0)


def _sends_an_object_list_of_another_length():
    import torch.distributed as tdist  # (as above)
    tdist.init_process_group("sim")
    if tdist.get_rank() == 0:
        tdist.send_object_list(["a", "b"], dst=1)
    else:
        tdist.recv_object_list([None], src=0)


@pytest.mark.parametrize("mode", MODES)
def test_a_mismatch_inside_torchs_object_collectives_names_them_and_the_list_length(mode):
    """broadcast_object_list and send/recv_object_list first send one int64 size per object: a mismatch there is
    reported on the call the program made, with what the shape means."""
    e, _, _ = _fail(_broadcasts_object_lists_of_two_lengths, 2, mode, simulator.CollectiveMismatchError)
    msg = str(e)
    assert "shape differs (rank 0: (3,); rank 1: (2,))" in msg
    assert "issued inside broadcast_object_list: its first broadcast carries one int64 size per object" in msg
    assert re.search(HERE + r"\d+ in broadcast_object_list", msg)
    e, _, _ = _fail(_sends_an_object_list_of_another_length, 2, mode, simulator.CollectiveMismatchError)
    msg = str(e)
    assert "issued inside recv_object_list and send_object_list" in msg and "len(object_list)" in msg
    assert re.search(HERE + r"\d+ in send_object_list", msg) and re.search(HERE + r"\d+ in recv_object_list", msg)


@pytest.mark.parametrize("mode", MODES)
def test_deadlock_crossed_groups(mode):
    def fn():
        g = dist.new_group([0, 1])
        x = tp.ones(1)
        if dist.get_rank() == 0:
            dist.all_reduce(x, group=g)
            dist.all_reduce(x)
        else:
            dist.all_reduce(x)
            dist.all_reduce(x, group=g)

    e, world, _ = _fail(fn, 2, mode, simulator.DeadlockError)
    msg = str(e)
    # new_group is the world's collective #1, so the world's first all_reduce is #2
    assert "rank 0 waits in all_reduce #1 on group [0, 1] (subgroup 1)" in msg and "missing: [1]" in msg
    assert "rank 1 waits in all_reduce #2 on group [0, 1] at" in msg and "missing: [0]" in msg
    assert all(isinstance(x, simulator.DeadlockError) for x in world.errors)


@pytest.mark.parametrize("mode", MODES)
def test_deadlock_in_async_wait(mode):
    def fn():
        if dist.get_rank() == 0:
            w = dist.all_reduce(tp.ones(2), async_op=True)
            w.wait()
            return
        dist.recv(tp.empty(1), src=0)

    e, world, _ = _fail(fn, 2, mode, simulator.DeadlockError)
    msg = str(e)
    assert "in wait() of an async op" in msg
    assert "rank 1 waits in recv from rank 0" in msg


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_deadlock_names_a_skipped_backward(isolation):
    def fn():
        x = tp.ones(2)
        if dist.get_rank() == 0:
            with _state.backward_of("reduce"):
                dist.broadcast(x, src=0)

    e, _, _ = _fail(fn, 2, "process" if isolation == "process" else "coop", simulator.DeadlockError)
    msg = str(e)
    assert "rank 1 returned without running the backward of reduce" in msg
    assert "broadcast #1 on group [0, 1]" in msg
    assert "y.sum().backward()" in msg
    # (a rank whose input did not require grad has no backward to run: the other cause, named with its fix)
    assert "did not require grad there: make requires_grad the same on every rank" in msg


# -- failures -------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_rank_failure_releases_everyone_and_reraises_original(mode):
    def fn():
        x = tp.ones(3)
        dist.all_reduce(x)
        if dist.get_rank() == 2:
            raise ValueError("boom on two")
        dist.all_reduce(x)
        dist.all_reduce(x)

    e, world, dt = _fail(fn, 4, mode, ValueError)
    assert dt < 5.0  # at once: far below the run's 20 s timeout (margins for a loaded machine)
    assert str(e) == "boom on two" and e.rank == 2
    assert any("raised on rank 2" in n for n in e.__notes__)
    # the original traceback survives: its last frame is the raise in fn (a rank process's, as a note)
    if mode == "process":
        note = next(n for n in e.__notes__ if "traceback in rank 2's process" in n)
        assert note.rstrip().endswith("ValueError: boom on two") and ', in fn\n' in note
    else:
        tb = e.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        assert tb.tb_frame.f_code.co_name == "fn"
    others = [world.errors[r] for r in (0, 1, 3)]
    assert all(isinstance(x, simulator.RankFailedError) for x in others), others
    assert all(x.failed_rank == 2 and x.__cause__ is e for x in others)
    assert "rank 2 failed with ValueError: boom on two" in str(others[0])


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_independent_failures_form_an_exception_group(isolation):
    def fn():
        raise KeyError(dist.get_rank())

    with pytest.raises(ExceptionGroup) as ei:
        simulator.run(fn, 3, isolation=isolation)
    assert sorted(x.rank for x in ei.value.exceptions) == [0, 1, 2]
    assert "3 ranks failed independently" in str(ei.value)


@pytest.mark.parametrize("mode", MODES)
def test_identical_errors_on_every_rank_arrive_as_the_ranks_own_exception(mode):
    """The same bad argument on every rank is one error, catchable by its class (as each real process raises it)."""
    def fn():
        dist.all_reduce(tp.ones(2, dtype=torch.int64), op=ReduceOp.AVG)

    e, world, _ = _fail(fn, 3, mode, dist.DistTypeError)
    assert not isinstance(e, BaseExceptionGroup) and e.rank == 0 and e.ranks == [0, 1, 2]
    assert "the same error was raised on ranks [0, 1, 2]" in "\n".join(e.__notes__)
    assert all(isinstance(x, dist.DistTypeError) for x in world.errors)


def test_an_error_naming_each_ranks_own_number_as_a_value_is_still_one_error():
    """A send to itself on every rank: each text names its own rank as dst= and rank=; one error, by its class."""
    def fn():
        dist.send(tp.ones(2), dst=dist.get_rank())

    with pytest.raises(dist.DistValueError) as ei:
        simulator.run(fn, 2)
    assert ei.value.ranks == [0, 1] and "dst=0, rank=0" in str(ei.value)


@pytest.mark.parametrize("code", [3, "fatal: bad config"])
@pytest.mark.parametrize("mode", MODES)
def test_sys_exit_in_a_rank_is_a_rank_failure(mode, code):
    import sys

    def fn():
        x = tp.ones(2)
        dist.all_reduce(x)
        if dist.get_rank() == 1:
            sys.exit(code)
        dist.all_reduce(x)  # the others wait for rank 1 here, as real processes would
        return x

    e, world, dt = _fail(fn, 3, mode, simulator.RankExitError)
    assert dt < 5.0  # at once: far below the run's 20 s timeout (margins for a loaded machine)
    assert e.rank == 1 and e.exit_code == code and isinstance(e.__cause__, SystemExit)
    assert f"rank 1 exited with code {code!r}" in str(e) and f"exit_code={code!r}" in str(e)
    for r in (0, 2):
        other = world.errors[r]
        assert isinstance(other, simulator.RankFailedError) and other.failed_rank == 1
        assert "rank 1 failed with RankExitError" in str(other) and "exited with code" in str(other)


@pytest.mark.parametrize("mode", MODES)
def test_os_exit_in_a_rank_ends_that_rank_only(mode):
    """os._exit(code) ends a rank's process, not its peers': on thread ranks too it ends the one rank (a failure
    naming os._exit when non-zero, a normal return when 0), and the test process carries on."""
    import os

    def fn(code):
        x = tp.ones(1)
        dist.all_reduce(x)
        if dist.get_rank() == 1:
            os._exit(code)
        if code:
            dist.all_reduce(x)  # the others wait for rank 1 here, as real processes would
        return x.item()

    world = simulator.World(3, timeout=20, **_how(mode))
    with pytest.raises(simulator.RankExitError) as ei:
        world.run(fn, args=(7,))
    e = ei.value
    assert e.rank == 1 and "exited with code 7" in str(e) and "os._exit" in str(e)
    assert all(isinstance(world.errors[r], simulator.RankFailedError) for r in (0, 2))
    assert simulator.run(fn, 3, args=(0,), **_how(mode)) == [3.0, None, 3.0]


@pytest.mark.parametrize("mode", MODES)
def test_sys_exit_zero_is_a_normal_return(mode):
    import sys

    def fn():
        x = tp.ones(1)
        dist.all_reduce(x)
        if dist.get_rank() == 0:
            sys.exit(0)
        return x.item()

    assert simulator.run(fn, 2, **_how(mode)) == [None, 2.0]


@pytest.mark.parametrize("mode", MODES)
def test_injected_crash(mode):
    def fn():
        x = tp.ones(1)
        for _ in range(5):
            dist.all_reduce(x)
        return x.item()

    e, world, _ = _fail(fn, 4, mode, simulator.InjectedFault, faults=[simulator.Crash(rank=2, at=3)])
    assert e.rank == 2 and "operation #3" in str(e)
    assert all(isinstance(world.errors[r], simulator.RankFailedError) for r in (0, 1, 3))
    trace = world.trace
    assert len([ev for ev in trace.events if ev.rank == 2]) == 2  # crashed before its third op


@pytest.mark.parametrize("mode", MODES)
def test_global_timeout_lists_who_arrived(mode):
    def fn():
        if dist.get_rank() == 0:
            time.sleep(3.0)  # a stuck computation: not a deadlock, only the timeout can end it
        dist.all_reduce(tp.ones(1))

    # (a timeout well inside the sleep, and long enough for a loaded machine's rank process to be in it)
    e, world, dt = _fail(fn, 3, mode, DistTimeoutError, timeout=1.0)
    assert isinstance(e, simulator.SimTimeoutError)
    assert dt < 5.0
    msg = str(e)
    assert "timeout: the run did not finish within 1 s" in msg
    # the report says which bound ran out, in the caller's terms, and how to replay with it
    assert "(timeout=1)" in msg and e.bound == "timeout" and "stall" not in msg
    assert "raise timeout= if it is just slow" in msg
    assert any("replay with" in n and "timeout=1" in n for n in getattr(e, "__notes__", ()))
    if mode == "threads":
        assert "ranks 1 and 2 wait in all_reduce #1" in msg and "arrived: [1, 2]" in msg
    # the computing rank is singled out, with where it computes, and the fix fits a stuck computation
    assert "rank 0 is computing, in no operation, at test_sim_failures.py:" in msg and "in fn" in msg
    assert "(before its first operation)" in msg
    assert "Fix: rank 0 is still computing, not waiting for another rank" in msg
    assert "same collectives in the same order" not in msg


def _stuck_rank_2():
    if dist.get_rank() == 2:
        time.sleep(3.0)  # STUCK: longer than the stall bound; the others wait for it in all_reduce
    dist.all_reduce(tp.ones(1))


_STUCK_LINE = next(i for i, line in enumerate(open(__file__), 1) if "# STUCK:" in line and "time.sleep" in line)


@pytest.mark.parametrize("mode", MODES)
def test_a_stall_names_the_rank_computing_while_others_wait(mode):
    """No whole-run bound: the stall bound (no progress while ranks wait) stops the run and says so."""
    e, world, dt = _fail(_stuck_rank_2, 3, mode, simulator.SimTimeoutError, timeout=None, stall_timeout=1.5)
    assert 1.5 <= dt < 5.5, dt
    msg = str(e)
    assert e.bound == "stall_timeout"
    assert "stall: no operation completed for 1.5 s (stall_timeout=1.5" in msg, msg
    assert "did not finish within" not in msg  # not the whole-run bound
    if mode == "threads":
        assert "while ranks 0 and 1 wait in all_reduce" in msg
    # the computing rank is named with where it computes, and since when
    assert re.search(rf"rank 2 has been computing since \d+\.\d s into the run \(for \d+\.\d s\), at "
                     rf"test_sim_failures.py:{_STUCK_LINE} in _stuck_rank_2", msg), msg
    assert "raise stall_timeout= if it is just slow" in msg
    assert all(isinstance(world.errors[r], simulator.SimTimeoutError) for r in (0, 1))


_SPEED = 200.0  # compressed time: one real second is 200 s of the bounds' clock


def _fast_clock(monkeypatch):
    """Make the clock of the run's bounds run ``_SPEED`` times faster than real time."""
    from simulator.core import progress

    real = time.monotonic
    start = real()
    monkeypatch.setattr(progress, "clock", lambda: start + (real() - start) * _SPEED)


def _long_program(minutes: float, step_s: float) -> int:
    """Compute ``step_s`` real seconds per step until ``minutes`` of compressed time passed; every rank agrees
    on when to stop (a rank process has the real clock only, so each computes the compressed time itself)."""
    t0 = time.monotonic()
    steps = 0
    while True:
        time.sleep(step_s)
        done = tp.tensor([float((time.monotonic() - t0) * _SPEED >= minutes * 60)])
        dist.all_reduce(done, op=ReduceOp.MAX)
        steps += 1
        if done.item():
            return steps


@pytest.mark.parametrize("mode", MODES)
def test_a_long_program_that_progresses_is_not_stopped_by_the_default_bounds(mode, monkeypatch):
    """A 15-minute program (compressed): no whole-run bound by default, and every step is progress."""
    _fast_clock(monkeypatch)
    world = simulator.World(3, **_how(mode))
    steps = world.run(_long_program, args=(15.5, 0.05))
    assert steps[0] == steps[1] == steps[2] >= 10
    assert world.timeout is None and world.stall_timeout == 1800.0  # torch's default process-group timeout


@pytest.mark.parametrize("mode", ["coop", "process"])
def test_coop_ranks_computing_in_turn_do_not_stall(mode, monkeypatch):
    """Coop runs one rank at a time: 6 ranks computing 60 s each between collectives take 360 s per step,
    more than a 300 s stall bound, yet each rank's call into the simulator is progress."""
    _fast_clock(monkeypatch)

    def fn():
        for _ in range(2):
            end = time.monotonic() + 60 / _SPEED
            while time.monotonic() < end:  # computing (a sleep would step out of the coop schedule)
                pass
            dist.all_reduce(tp.ones(1))
        return True

    assert simulator.run(fn, 6, stall_timeout=300, **_how(mode)) == [True] * 6


def test_bounds_are_validated_and_inf_or_none_means_no_bound():
    bad = [({"timeout": float("nan")}, dist.DistValueError, "timeout=nan"),
           ({"timeout": -1}, dist.DistValueError, "timeout=-1"),
           ({"timeout": 0}, dist.DistValueError, "timeout=0"),
           ({"timeout": True}, dist.DistTypeError, "timeout=True"),
           ({"timeout": "60"}, dist.DistTypeError, "timeout='60'"),
           ({"stall_timeout": float("nan")}, dist.DistValueError, "stall_timeout=nan"),
           ({"stall_timeout": -5.0}, dist.DistValueError, "stall_timeout=-5.0"),
           ({"stall_timeout": False}, dist.DistTypeError, "stall_timeout=False")]
    for kw, cls, shown in bad:
        with pytest.raises(cls) as ei:
            simulator.run(_noop, 2, **kw)
        assert shown in str(ei.value) and "Fix: pass e.g." in str(ei.value), (kw, str(ei.value))
    w = simulator.World(2, timeout=float("inf"), stall_timeout=None)
    assert w.timeout is None and w.stall_timeout == float("inf")
    assert w.run(dist.get_rank) == [0, 1]
    assert simulator.World(2, timeout=5).timeout == 5.0


def test_rank_threads_still_running_after_a_timeout_are_named():
    """Thread ranks only: a rank process still computing at the timeout is killed instead
    (tests/test_sim_isolation.py::test_timeout_kills_a_rank_process_stuck_computing)."""
    def fn():
        if dist.get_rank() == 1:
            time.sleep(4.0)

    with pytest.warns(RuntimeWarning, match=r"1 rank thread\(s\) still running.*rank 1 at test_sim_failures.py:\d+ in fn"):
        with pytest.raises(simulator.SimTimeoutError):
            simulator.run(fn, 2, timeout=0.3)
    time.sleep(2.0)  # let the sleeping rank thread end before the next test


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_errors_after_failure_are_rank_failed_at_next_op(isolation):
    def fn():
        if dist.get_rank() == 0:
            raise RuntimeError("first")
        try:
            dist.barrier()
        except simulator.RankFailedError:
            pass
        dist.barrier()  # the world stays failed

    world = simulator.World(3, isolation=isolation)
    with pytest.raises(RuntimeError, match="first"):
        world.run(fn)
    assert all(isinstance(world.errors[r], simulator.RankFailedError) for r in (1, 2))


def test_sim_backend_outside_a_world_explains():
    with pytest.raises(dist.DistRuntimeError, match=r"simulator.run"):
        dist.init_process_group("sim")


def test_run_argument_errors():
    with pytest.raises(dist.DistValueError):
        simulator.run(lambda: None, 0)
    with pytest.raises(dist.DistValueError):
        simulator.run(lambda: None, 2, mode="fast")
    with pytest.raises(dist.DistTypeError):
        simulator.run(42, 2)


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize("kw", [{"world_size": 3}, {"rank": 5}])
def test_init_process_group_with_another_rank_or_world_size_is_refused(kw, isolation):
    """tensorplay's init_process_group on a simulated rank checks what the program names, as torch's does (a
    RuntimeError, as gloo's: its own check of the rank, or its store's timeout where the sizes disagree)."""
    def fn():
        dist.init_process_group("gloo", **kw)

    with pytest.raises(dist.DistRuntimeError) as ei:
        simulator.run(fn, 2, isolation=isolation)
    what, given = next(iter(kw.items()))
    assert f"{what}={given}" in str(ei.value) and "simulated_" in str(ei.value) and "--nproc-per-node" in str(ei.value)


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_init_process_group_with_this_ranks_values_returns(isolation):
    def fn():
        dist.init_process_group("gloo", rank=dist.get_rank(), world_size=2)
        return dist.get_world_size()

    assert simulator.run(fn, 2, isolation=isolation) == [2, 2]


class _Singleton:
    made = False


def _make_singleton_twice() -> None:
    if _Singleton.made:  # a per-process singleton (Hydra's GlobalHydra): the second rank thread finds it set
        raise ValueError("GlobalHydra is already initialized, call GlobalHydra.instance().clear() if you want to "
                         "re-initialize")
    _Singleton.made = True


def _asks_for_cuda() -> None:
    raise AssertionError("Torch not compiled with CUDA enabled")  # what torch.cuda raises on a CPU build


@pytest.mark.parametrize("fn,needle", [(_make_singleton_twice, "isolation='process'"),
                                       (_asks_for_cuda, "devices='cuda'")], ids=["per-process-state", "cuda"])
def test_a_failure_with_a_known_cause_names_the_switch_that_fixes_it(fn, needle) -> None:
    _Singleton.made = False
    with pytest.raises((ValueError, AssertionError)) as info:
        simulator.run(fn, 2)
    notes = "\n".join(getattr(info.value, "__notes__", ()))
    assert needle in notes, notes


def test_a_thread_the_os_refuses_is_reported_with_the_fix_and_the_started_ranks_end(monkeypatch):
    """A world of more thread ranks than the OS allows threads: the run says so (not the program's error), and
    the ranks already started end; the next world runs."""
    import threading

    start, seen = threading._start_new_thread, [0]  # (what Thread.start calls: where the OS says no)

    def refusing(function, args, *rest):
        if getattr(getattr(function, "__self__", None), "name", "").startswith("sim-rank-"):
            seen[0] += 1
            if seen[0] == 3:
                raise RuntimeError("can't start new thread")
        return start(function, args, *rest)

    monkeypatch.setattr(threading, "_start_new_thread", refusing)
    with pytest.raises(simulator.SimError, match=r"refused to start the thread of rank 2 .*world_size=4, "
                                                 r"threads_started=2\. Fix: run fewer ranks"):
        simulator.run(lambda: dist.all_reduce(tp.ones(1)), 4)
    monkeypatch.setattr(threading, "_start_new_thread", start)
    assert not [t for t in threading.enumerate() if t.name.startswith("sim-rank-")]
    assert simulator.run(lambda: dist.get_rank(), 2) == [0, 1]


@pytest.mark.parametrize("stack_size", [10, 16 * 1024, -1, 1.5, True])
def test_a_stack_size_threads_cannot_take_is_refused_with_the_fix(stack_size):
    with pytest.raises(dist.DistValueError, match=r"^simulator.run: stack_size must be 0 \(the platform's\) or at "
                                                  r"least 32 KiB, in bytes: stack_size=.*Fix: pass e.g. stack_size="):
        simulator.run(lambda: None, 2, stack_size=stack_size)


def _async_all_reduces(extra_on_rank_0: bool) -> int:
    dist.all_reduce(torch.ones(2), async_op=True)  # never waited: every member issues it, so it completes
    if extra_on_rank_0 and dist.get_rank() == 0:
        dist.all_reduce(torch.ones(3), async_op=True)  # issued by rank 0 only, never waited for
    return dist.get_rank()


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_an_async_collective_some_members_never_join_is_named_when_the_run_ends(isolation) -> None:
    """gloo leaves it pending (and a member may hang at its exit); the run ends well and warns, naming it, while an
    unwaited collective every member joined is no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert simulator.run(_async_all_reduces, 2, args=(False,), isolation=isolation) == [0, 1]
    with pytest.warns(RuntimeWarning, match=r"1 asynchronous collective\(s\) were never waited for and never joined "
                                            r"by every member before the run ended: rank 0's all_reduce #2 on group "
                                            r"\[0, 1\] at test_sim_failures.py:\d+.*Fix: issue the collective"):
        assert simulator.run(_async_all_reduces, 2, args=(True,), isolation=isolation) == [0, 1]


def _interrupted_during_a_kernel() -> None:
    from simulator.core.state import current_rank_state

    if dist.get_rank() == 0:
        def ctrl_c() -> None:  # what SIGINT raises in the main thread while it runs a rank's kernel
            raise KeyboardInterrupt

        current_rank_state().run.execute(ctrl_c)
    while True:  # a rank that never returns by itself (only the run's end releases it)
        time.sleep(0.05)


def test_ctrl_c_during_a_kernel_on_the_main_thread_stops_the_run() -> None:
    """Big kernels run on the main thread, where Ctrl-C lands: the interrupt stops the run, as anywhere else, not
    just the rank whose kernel it was (the others would then run on, and a looping one forever)."""
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as got:
        simulator.run(_interrupted_during_a_kernel, 2, timeout=30)
    assert getattr(got.value, "rank", None) is None and time.monotonic() - started < 20
