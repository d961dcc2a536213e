"""The two schedulers' hand-off paths (simulator/core/sched.py): threads mode's wake-up relay and coop mode's
blocking-collective entries keep every result and let no rank starve the others.

The speed these paths buy is measured in ``bench/bench_sim.py`` (never here); these tests check that the
shortcuts do not change what a program computes or let a rank starve the others.
"""
from __future__ import annotations

import pytest
import torch

import simulator
import tensorplay.distributed as dist
from simulator.core import progress


def _mixed_collectives(rounds: int) -> list[torch.Tensor]:
    r, w = dist.get_rank(), dist.get_world_size()
    out = []
    for i in range(rounds):
        x = torch.tensor([float(r * 100 + i), float(r - i)])
        dist.all_reduce(x)
        parts = [torch.zeros(1) for _ in range(w)]
        dist.all_gather(parts, torch.tensor([float(r * r + i)]))
        out += [x, torch.cat(parts)]
    return out


def _expected(rounds: int, w: int) -> list[torch.Tensor]:
    out = []
    for i in range(rounds):
        out.append(torch.tensor([float(sum(r * 100 + i for r in range(w))), float(sum(r - i for r in range(w)))]))
        out.append(torch.tensor([float(r * r + i) for r in range(w)]))
    return out


def test_threads_relay_survives_wait_slices_that_end_while_queued(monkeypatch):
    """A woken thread waits in the relay until the one woken before it resumes; with waits sliced very thin,
    slices run out while threads are queued there (the path that takes a thread out of the relay).  Every
    result must still be right and the run must not stall."""
    real = progress.wait_slice
    monkeypatch.setattr(progress, "wait_slice", lambda run, rs: min(real(run, rs), 2e-4))
    w, rounds = 48, 12
    res = simulator.run(_mixed_collectives, w, args=(rounds,), mode="threads", timeout=120)
    want = _expected(rounds, w)
    for got in res:
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("mode", ["threads", "coop"])
def test_many_ranks_woken_at_once_all_resume(mode):
    """One collective completes for every member at once (each wake-up goes through the relay in threads
    mode); the results are the reference's on every rank."""
    w, rounds = 96, 3
    res = simulator.run(_mixed_collectives, w, args=(rounds,), mode=mode, timeout=120)
    want = _expected(rounds, w)
    assert all(all(torch.equal(a, b) for a, b in zip(got, want)) for got in res)


def test_threads_deadlock_is_still_reported_at_once():
    """The rank that finds every other rank blocked wakes them all (itself included) without the relay."""
    def fn():
        if dist.get_rank() == 0:
            dist.recv(torch.zeros(1), src=1)
        else:
            dist.barrier(group=dist.new_group([1, 2]))
            dist.recv(torch.zeros(1), src=0)

    with pytest.raises(simulator.DeadlockError):
        simulator.run(fn, 3, mode="threads", timeout=60)
    # the same world runs on afterwards: no relay was left half-done
    got = simulator.run(_mixed_collectives, 3, args=(2,), mode="threads")[2]
    assert all(torch.equal(a, b) for a, b in zip(got, _expected(2, 3)))


def test_coop_async_collective_entries_stay_scheduling_points():
    """Coop mode lets a rank run on through a blocking collective's entry (it waits right after), but an
    async collective's entry is still a seeded choice: a rank that only issues async collectives does not keep
    the baton.  Here rank 0 checks, between async issues, whether rank 1 (which runs only when given the
    baton) has completed a barrier of their subgroup."""
    n = 48

    def fn():
        sub, solo = dist.new_group([0, 1]), dist.new_group([0])
        if dist.get_rank() == 0:
            x = torch.ones(1)
            works, seen = [], None
            b = dist.barrier(group=sub, async_op=True)
            for i in range(n):
                works.append(dist.all_reduce(x, group=solo, async_op=True))
                if seen is None and b.is_completed():
                    seen = i
            for wk in works:
                wk.wait()
            b.wait()
            return seen
        if dist.get_rank() == 1:
            dist.barrier(group=sub)
        return None

    for seed in range(3):
        seen = simulator.run(fn, 3, mode="coop", seed=seed)[0]
        assert seen is not None, f"seed {seed}: rank 1 never ran while rank 0 issued {n} async collectives"


def test_large_world_gc_tuning_is_undone_and_leaves_a_program_freeze_alone(monkeypatch):
    """From ``_GC_TUNED_FROM`` ranks the run freezes the objects that existed before it and collects less often;
    after the run the thresholds and the freeze count are the caller's again (a freeze of the caller's own
    included: it is neither undone nor doubled)."""
    import gc

    from simulator.core import collector

    # the tuning's threshold lowered for the test: what is checked is that it applies from there and is undone,
    # not the 512-rank start-up, which bench/bench_sim.py measures
    monkeypatch.setattr(collector, "GC_TUNED_FROM", 16)
    _GC_TUNED_FROM = collector.GC_TUNED_FROM

    def seen() -> tuple:
        return gc.get_threshold()[0], gc.get_freeze_count() > 0

    before = gc.get_threshold()
    try:
        gc.set_threshold(100, 10, 10)
        during = simulator.run(seen, _GC_TUNED_FROM, mode="threads")
        assert during[0] == (10 * _GC_TUNED_FROM, True)
        assert gc.get_threshold() == (100, 10, 10) and gc.get_freeze_count() == 0
        gc.freeze()  # the caller's own freeze
        frozen = gc.get_freeze_count()
        simulator.run(seen, _GC_TUNED_FROM, mode="threads")
        assert gc.get_freeze_count() == frozen and gc.get_threshold() == (100, 10, 10)
        assert simulator.run(seen, 4)[0][0] == 100  # small worlds: untouched
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def _polls_until_complete() -> tuple:
    """Rank 0 spins on ``is_completed()`` of an async all_reduce and an irecv that rank 1 issues only after
    computing; without a hand-off at each poll, coop mode's baton would stay with rank 0 forever."""
    r = dist.get_rank()
    x = torch.full((2,), float(r + 1))
    polls = 0
    if r == 0:
        w = dist.all_reduce(x, async_op=True)
        while not w.is_completed():
            polls += 1
        got = torch.zeros(1)
        w = dist.irecv(got, src=1)
        while not w.is_completed():
            polls += 1
        w.wait()
        return x.tolist(), got.item(), polls
    sum(range(20000))
    dist.all_reduce(x)
    dist.send(torch.tensor([7.0]), dst=0)
    return x.tolist(), None, polls


@pytest.mark.parametrize("isolation", ["thread", "process"])
@pytest.mark.parametrize("mode", ["coop", "threads"])
def test_a_rank_polling_is_completed_lets_the_others_run(isolation, mode):
    for seed in range(3):
        out = simulator.run(_polls_until_complete, 2, seed=seed, mode=mode, isolation=isolation, timeout=60,
                            hash_seed=0)  # (one set of rank interpreters for every schedule seed)
        assert [o[:2] for o in out] == [([3.0, 3.0], 7.0), ([3.0, 3.0], None)], (seed, out)
        if mode == "coop" and isolation == "thread":  # a poll is a seeded choice: the same seed, the same polls
            assert simulator.run(_polls_until_complete, 2, seed=seed, mode=mode, timeout=60) == out


def test_a_rank_that_polls_forever_is_a_stall_not_a_hang():
    """Polling is no progress: a rank polling a receive nobody sends, while its peer waits for it, ends in the
    stall report, as a rank computing forever does."""
    def body() -> None:
        if dist.get_rank() == 0:
            w = dist.irecv(torch.zeros(1), src=1)
            while not w.is_completed():
                pass
        dist.barrier()

    with pytest.raises(simulator.SimTimeoutError):
        simulator.run(body, 2, stall_timeout=2.0, timeout=60)


def _sleeps_then_draws() -> list[list[float]]:
    import time

    r = dist.get_rank()
    torch.manual_seed(1234)
    draws = []
    for k in range(4):
        for _ in range((r + k) % 3):  # (a file-barrier poll: some ranks sleep, some do not)
            time.sleep(0.002)
        draws.append(torch.randn(3).tolist())
        dist.barrier()
    return draws


def test_a_rank_that_takes_a_parked_baton_after_a_sleep_keeps_every_ranks_random_stream():
    """A rank back from a sleep may take a baton the last blocked rank has just parked; that rank's random streams
    are saved before it parks, so neither rank draws from the other's (before: now and then a rank repeated an
    earlier draw, and PyTorch's distributed_test.py compared different `randn` objects on thread ranks)."""
    torch.manual_seed(1234)
    want = [torch.randn(3).tolist() for _ in range(4)]  # every rank seeded alike draws this sequence
    for _ in range(25):  # (the interleaving is the wall clock's: several runs)
        assert simulator.run(_sleeps_then_draws, 4, timeout=60) == [want] * 4
