"""Seeds fix the schedule: same seed -> same trace and results; different seeds -> different orders;
every rank has its own RNG state like a fresh process.

Tests about the schedule and the ranks' seeds run on thread ranks and on rank processes
(``isolation``); a new run seed means new hash seeds, so new warm interpreters (seconds each), and the
process params take fewer seeds.  Tests of the thread scheduler's own machinery (RNG hand-offs, CPU
affinity) are about thread ranks only."""
from __future__ import annotations

import os
import random

import pytest
import torch

import simulator
import simulator.core.seeds  # noqa: F401  (the tests patch it: loaded here, not by whichever test ran first)
import tensorplay as tp
from simulator.isolation import ISOLATIONS
import tensorplay.distributed as dist


def _racy():
    """Rank 0 receives from any source; the order it sees depends on the schedule."""
    r = dist.get_rank()
    out = []
    if r == 0:
        for _ in range(3):
            x = tp.empty(1)
            out.append(dist.recv(x))
    else:
        dist.send(tp.tensor([float(r)]), dst=0)
    x = tp.tensor([float(r)])
    w = dist.all_reduce(x, async_op=True)
    dist.barrier()
    w.wait()
    g = dist.new_group([2, 0])
    if r in (0, 2):
        dist.broadcast(x, src=2, group=g)
    return out, x


@pytest.mark.parametrize("isolation,seed", [("thread", s) for s in range(20)] + [("process", s) for s in (0, 7)])
def test_same_seed_same_trace_and_results(isolation, seed):
    trace = simulator.check_reproducible(_racy, 4, seed=seed, isolation=isolation)
    assert len(trace.events) > 0
    if isolation == "process":  # the same schedule as thread ranks: the same trace
        assert trace.signature() == simulator.check_reproducible(_racy, 4, seed=seed).signature()


def test_different_seeds_explore_different_any_source_orders():
    orders = set()
    for seed in range(20):
        orders.add(tuple(simulator.run(_racy, 4, seed=seed)[0][0]))
    assert len(orders) >= 3, orders
    assert all(sorted(o) == [1, 2, 3] for o in orders)


def test_explore_reports_the_first_failing_seed_and_replays_it():
    def fn():
        out = _racy()[0]
        if dist.get_rank() == 0 and out[0] == 3:
            raise AssertionError(f"rank 3 came first: {out}")

    with pytest.raises(simulator.ExploreError) as ei:
        simulator.explore(fn, 4, seeds=range(50))
    seed = ei.value.seed
    assert f"seed {seed} failed" in str(ei.value) and f"seed={seed}" in str(ei.value)
    assert isinstance(ei.value.__cause__, AssertionError)
    with pytest.raises(AssertionError):  # the reported seed replays the failure
        simulator.run(fn, 4, seed=seed)
    report = simulator.explore(_racy, 4, seeds=range(seed))  # the seeds before it pass
    assert report.seeds == list(range(seed))


def test_explore_counts_distinct_schedules():
    report = simulator.explore(_racy, 4, seeds=range(10))
    assert report.distinct_schedules > 1


def test_not_reproducible_is_detected():
    """Thread ranks only: state shared between two runs lives in this process (a rank process starts afresh)."""
    import itertools

    counter = itertools.count()  # state shared across runs: the second run differs from the first

    def more_ops_second_time():
        if next(counter) >= 3:
            dist.barrier()
        dist.barrier()

    with pytest.raises(simulator.NotReproducibleError, match="traces of two runs differ"):
        simulator.check_reproducible(more_ops_second_time, 3)

    def other_result_second_time():
        return next(counter)

    with pytest.raises(simulator.NotReproducibleError, match="different results"):
        simulator.check_reproducible(other_result_second_time, 3)


def _rng_draws():
    a = torch.rand(3)
    dist.barrier()  # other ranks draw in between
    b = torch.rand(1)
    return torch.initial_seed(), a, b, random.random()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_unseeded_program_gives_each_rank_its_own_seed(monkeypatch, isolation):
    """Real processes of an unseeded program start from different random seeds; so do simulated ranks."""
    monkeypatch.setattr(simulator.core.seeds, "_program_seeded", lambda: False)
    before = torch.get_rng_state()
    res = simulator.run(_rng_draws, 4, seed=1, isolation=isolation)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG is untouched
    seeds = [s for s, _, _, _ in res]
    assert seeds == [simulator.core.seeds.rank_seed(1, r) for r in range(4)]
    assert len(set(seeds)) == 4 and all(s >= 2**32 for s in seeds)
    for seed, a, b, _ in res:  # each rank's stream is exactly its seed's: no other rank's draws leak in
        g = torch.Generator().manual_seed(seed)
        assert torch.equal(a, torch.rand(3, generator=g)) and torch.equal(b, torch.rand(1, generator=g))
    assert len({p for _, _, _, p in res}) == 4  # `random` differs per rank (seeded from seed and rank)
    again = simulator.run(_rng_draws, 4, seed=1, isolation=isolation)
    assert [x[0] for x in again] == seeds and [x[3] for x in again] == [x[3] for x in res]
    assert [x[0] for x in simulator.run(_rng_draws, 4, seed=2, isolation=isolation)] != seeds


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_program_seeded_before_the_run_seeds_every_rank(monkeypatch, isolation):
    """A torch.manual_seed the program ran before the world started would have run in every real process."""
    monkeypatch.setattr(simulator.core.seeds, "_program_seeded", lambda: True)
    before = torch.get_rng_state()
    try:
        torch.manual_seed(1234)
        expected = torch.rand(3, generator=torch.Generator().manual_seed(1234))
        res = simulator.run(_rng_draws, 3, isolation=isolation)
    finally:
        torch.set_rng_state(before)
    for seed, a, b, _ in res:
        assert seed == 1234 and torch.equal(a, expected) and torch.equal(b, res[0][2])


_SEED_SCRIPT = """
import sys, torch, simulator
if sys.argv[1] == "seeded":
    torch.manual_seed(7)
print([round(x, 6) for x in simulator.run(lambda: torch.rand(1).item(), 3)])
"""


@pytest.mark.parametrize("how", ["seeded", "unseeded"])
def test_seed_detection_in_a_fresh_process(how):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SEED_SCRIPT, how], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    draws = eval(out.stdout.strip().splitlines()[-1])  # noqa: S307  (our own script's list of floats)
    if how == "seeded":
        assert draws == [round(torch.rand(1, generator=torch.Generator().manual_seed(7)).item(), 6)] * 3
    else:
        assert len(set(draws)) == 3


def test_threads_mode_and_rank_processes_give_same_results():
    coop = simulator.run(_racy, 4, seed=0)
    thr = simulator.run(_racy, 4, mode="threads")
    assert all(torch.equal(a[1], b[1]) for a, b in zip(coop, thr))
    procs = simulator.run(_racy, 4, seed=0, isolation="process")  # same seed, same schedule: equal throughout
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(coop, procs))


def _draws(interleave: bool) -> list[float]:
    out = [random.random(), random.gauss(0.0, 1.0)]  # gauss caches its pair's second value per generator
    for _ in range(3):
        if interleave:
            dist.barrier()  # every other rank draws in between (coop hands the baton over here)
        out += [random.gauss(0.0, 1.0), random.random(), random.getrandbits(40)]
    if not interleave:
        for _ in range(3):
            dist.barrier()
    return out


@pytest.mark.parametrize("isolation,seed", [("thread", 0), ("thread", 5), ("process", 0)])
def test_python_random_streams_survive_hand_offs(isolation, seed):
    """A rank's `random` stream (gauss's cached value included) is the same whether or not other ranks draw
    between its draws, differs between ranks, and is the same on thread ranks and in rank processes."""
    alone = simulator.run(_draws, 4, args=(False,), seed=seed, isolation=isolation)
    mixed = simulator.run(_draws, 4, args=(True,), seed=seed, isolation=isolation)
    assert mixed == alone
    assert len({tuple(d) for d in mixed}) == 4
    if isolation == "process":
        assert mixed == simulator.run(_draws, 4, args=(True,), seed=seed)


@pytest.mark.parametrize("fast", [True, False])
def test_rng_swap_moves_the_whole_state(fast):
    from simulator.core.sched import _PyRngSwap

    swap = _PyRngSwap()
    if not fast:
        swap._offset = None  # the portable getstate/setstate path
    elif swap._offset is None:
        pytest.skip("this interpreter's Random layout is not the CPython one the fast path checks for")
    saved = random.getstate()
    try:
        mine = random.Random(7)
        mine.gauss(0.0, 1.0)  # leaves a cached value
        expected = random.Random()
        expected.setstate(mine.getstate())
        swap.load(mine)
        assert [random.gauss(0.0, 1.0) for _ in range(5)] == [expected.gauss(0.0, 1.0) for _ in range(5)]
        parked = random.Random(0)
        swap.save(parked)
        assert parked.getstate() == random.getstate() == expected.getstate()
    finally:
        random.setstate(saved)


def _numpy_draws(interleave: bool, seeded: bool) -> list[float]:
    """Draws of numpy's global generator; ``standard_normal`` of one leaves its pair's second value cached."""
    import numpy as np

    if seeded:
        np.random.seed(100 + dist.get_rank())  # np.random.seed(seed + rank), as data pipelines do
    out = [float(np.random.standard_normal())]
    for _ in range(3):
        if interleave:
            dist.all_reduce(torch.ones(2))  # the other ranks draw in between (the baton moves here)
        out += [*np.random.rand(3).tolist(), *np.random.randint(0, 2**30, 2).tolist(),
                float(np.random.standard_normal())]
    if not interleave:
        for _ in range(3):
            dist.all_reduce(torch.ones(2))
    return out


@pytest.mark.parametrize("isolation,seed", [("thread", 0), ("thread", 4), ("process", 0)])
def test_numpy_random_streams_are_each_ranks_own(isolation, seed):
    """numpy's global generator is one per process: a rank's stream (its cached normal included) is the same
    whether or not other ranks draw between its draws, seeded or not; unseeded ranks differ from each other, and
    thread ranks and rank processes start from the same states."""
    import numpy as np

    for seeded in (True, False):
        alone = simulator.run(_numpy_draws, 3, args=(False, seeded), seed=seed, isolation=isolation)
        mixed = simulator.run(_numpy_draws, 3, args=(True, seeded), seed=seed, isolation=isolation)
        assert mixed == alone and len({tuple(d) for d in mixed}) == 3
        if seeded:  # what a process that ran np.random.seed(100 + rank) draws
            for r, drawn in enumerate(mixed):
                g = np.random.RandomState(100 + r)
                want = [float(g.standard_normal())]
                for _ in range(3):
                    want += [*g.rand(3).tolist(), *g.randint(0, 2**30, 2).tolist(), float(g.standard_normal())]
                assert drawn == want
        elif isolation == "process":
            assert mixed == simulator.run(_numpy_draws, 3, args=(True, False), seed=seed)


@pytest.mark.parametrize("fast", [True, False])
def test_numpy_rng_swap_moves_the_whole_state(fast):
    import numpy as np

    from simulator.core._handoff import _NumpyRngSwap
    from simulator.core.state import RankState

    swap = _NumpyRngSwap()
    if fast:
        swap._gauss = swap._probe(np.random.RandomState)
        if swap._gauss is None:
            pytest.skip("this numpy's RandomState layout is not the one the fast path recognises")
    else:
        swap._gauss = None  # the get_state/set_state path
    saved = np.random.get_state()
    try:
        rs = RankState.__new__(RankState)
        rs.np_rng = np.random.RandomState(7)
        rs.np_rng.standard_normal()  # leaves a cached value
        expected = np.random.RandomState(0)
        expected.set_state(rs.np_rng.get_state())
        swap.load(rs)
        assert np.random.standard_normal(5).tolist() == expected.standard_normal(5).tolist()
        swap.save(rs)
        assert rs.np_rng.rand(700).tolist() == expected.rand(700).tolist() == np.random.rand(700).tolist()
    finally:
        np.random.set_state(saved)


_NUMPY_IMPORTED_BY_A_RANK = """
import sys, simulator
assert "numpy.random" not in sys.modules  # (the rank's import below is the program's first)
def draw():
    import numpy as np
    return float(np.random.rand())
print(simulator.run(draw, 2, seed=3, isolation=sys.argv[1]))
"""


def test_numpy_imported_by_a_rank_draws_from_the_run_s_seed():
    """The rank that imports numpy first draws from its own seed, not from the OS entropy numpy seeds its global
    generator with at import: twice the same, and what a rank process (seeded at its start) draws."""
    import subprocess
    import sys

    def run(isolation: str) -> list[float]:
        out = subprocess.run([sys.executable, "-c", _NUMPY_IMPORTED_BY_A_RANK, isolation], capture_output=True,
                             text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-3000:]
        return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307  (our own script's list of floats)

    first = run("thread")
    assert first == run("thread") == run("process") and first[0] != first[1]


def _torch_draws(interleave: bool) -> list[torch.Tensor]:
    """Draws of every kind from the default generator; scalar-sized normals leave a cached sample behind."""
    out = [torch.randn(1)]  # a normal pair's second value stays cached in the generator
    for _ in range(3):
        if interleave:
            dist.all_reduce(torch.ones(2))  # the other ranks draw in between (a wait: the baton moves here)
        out += [torch.randn(1, dtype=torch.float64), torch.randn(3), torch.rand(5), torch.randint(0, 2**40, (2,)),
                torch.empty(1).normal_()]  # (ends with one normal cached again)
    if not interleave:
        for _ in range(3):
            dist.all_reduce(torch.ones(2))
    return out


@pytest.mark.parametrize("isolation,seed", [("thread", 0), ("thread", 9), ("process", 0)])
def test_torch_random_streams_survive_hand_offs(monkeypatch, isolation, seed):
    """A rank's torch stream (its cached normal samples included) is the same whether or not other ranks draw
    between its draws, differs between ranks, and is the same on thread ranks and in rank processes."""
    monkeypatch.setattr(simulator.core.seeds, "_program_seeded", lambda: False)  # (an earlier test may seed torch)
    alone = simulator.run(_torch_draws, 4, args=(False,), seed=seed, isolation=isolation)
    mixed = simulator.run(_torch_draws, 4, args=(True,), seed=seed, isolation=isolation)
    for a, m in zip(alone, mixed):
        assert len(a) == len(m) and all(torch.equal(x, y) for x, y in zip(a, m))
    assert len({tuple(torch.cat([t.double() for t in d]).tolist()) for d in mixed}) == 4


@pytest.mark.parametrize("fast", [True, False])
def test_torch_rng_swap_moves_the_whole_state(fast):
    from simulator.core._handoff import _TorchRngSwap

    swap = _TorchRngSwap()
    if not fast:
        swap._span = None  # the serialising get_state/set_state path
    elif swap._span is None:
        pytest.skip("this build's CPU generator layout is not the one the fast path recognises")
    saved = torch.get_rng_state()
    try:
        mine = torch.Generator().manual_seed(11)
        torch.randn(1, generator=mine)  # leaves the pair's second normal cached in the generator
        cached_at = 24 + 8 * 624 + 24  # normal_is_valid in the serialised state (CPUGeneratorImpl's legacy layout)
        assert mine.get_state()[cached_at] == 1
        expected = torch.Generator()
        expected.set_state(mine.get_state())
        swap.load(mine)
        assert torch.equal(torch.get_rng_state(), expected.get_state())
        for draw in (lambda **g: torch.randn(1, **g), lambda **g: torch.randn(1, dtype=torch.float64, **g),
                     lambda **g: torch.rand(9, **g), lambda **g: torch.randint(0, 99, (4,), **g)):
            assert torch.equal(draw(), draw(generator=expected))
        parked = torch.Generator().manual_seed(0)
        swap.save(parked)
        assert torch.equal(parked.get_state(), torch.get_rng_state())
        assert torch.equal(parked.get_state(), expected.get_state())
    finally:
        torch.set_rng_state(saved)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is a Linux API")
def test_coop_ranks_compute_on_every_cpu_of_the_caller():
    """Hand-offs wake the next rank on the waker's CPU; once it holds the baton it has the caller's CPUs back."""
    def fn():
        seen = []
        for _ in range(20):
            dist.all_reduce(torch.ones(3))
            seen.append(os.sched_getaffinity(0))
        return seen

    caller = os.sched_getaffinity(0)
    for seen in simulator.run(fn, 4, seed=3):
        assert all(s == caller for s in seen), (caller, seen)
