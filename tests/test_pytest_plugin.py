"""Acceptance tests of the simulator's pytest plugin (@pytest.mark.world_size), through pytester.

Each runs with thread ranks and with rank processes (``--sim-isolation process``)."""
from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

BODY = '''
import pytest, torch
import tensorplay.distributed as dist

@pytest.mark.world_size(4)
def test_sum(rank, world_size):
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    assert x.item() == sum(range(world_size))
    assert dist.get_world_size() == world_size == 4

@pytest.mark.world_size(3)
def test_fails_on_rank_2(rank, tmp_path):
    assert tmp_path.exists()
    assert rank != 2, "rank two is bad"

@pytest.mark.world_size(3)
def test_first_sender_is_rank_1(rank):
    if rank == 0:
        t = torch.empty(1)
        first = dist.recv(t)
        dist.recv(t)
        assert first == 1, f"first sender was {first}"
    else:
        dist.send(torch.ones(1), dst=0)

def test_plain_tests_are_untouched():
    assert not dist.is_initialized()
'''


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_sim_suite=BODY)
    return pytester


@pytest.fixture(params=["thread", "process"])
def iso(request: pytest.FixtureRequest) -> list[str]:
    """The plugin's isolation option for one param (the ``--sim-isolation`` arguments)."""
    return ["--sim-isolation", request.param]


def _isolations(slow_process: bool = False) -> list:
    return [pytest.param(["--sim-isolation", "thread"], id="thread"),
            pytest.param(["--sim-isolation", "process"], id="process",
                         marks=[pytest.mark.slow] if slow_process else [])]


def test_world_size_marker_runs_the_body_on_every_rank(suite: pytest.Pytester, iso: list[str]) -> None:
    result = suite.runpytest("-k", "sum or plain", "-p", "no:cacheprovider", *iso)
    result.assert_outcomes(passed=2)


def test_a_failure_names_the_rank_the_seed_and_how_to_replay(suite: pytest.Pytester, iso: list[str]) -> None:
    result = suite.runpytest("-k", "rank_2", "--sim-seed", "7", *iso)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "rank two is bad" in out
    assert "failed on rank(s) [2] with seed=7, mode='coop'" in out
    assert "replay: pytest 'test_sim_suite.py::test_fails_on_rank_2' --sim-seed 7" in out
    if iso[-1] == "process":
        assert "--sim-isolation process" in out


# rank processes of six seeds: six sets of warm interpreters (the slow tier)
@pytest.mark.parametrize("how", _isolations(slow_process=True))
def test_the_seed_chooses_the_schedule_and_a_failing_seed_replays(suite: pytest.Pytester, how: list[str]) -> None:
    outcomes = {}
    for seed in range(6):
        res = suite.runpytest("-k", "first_sender", "--sim-seed", str(seed), *how)
        outcomes[seed] = res.ret == 0
    assert any(outcomes.values()) and not all(outcomes.values()), outcomes
    bad = next(s for s, ok in outcomes.items() if not ok)
    first = suite.runpytest("-k", "first_sender", "--sim-seed", str(bad), *how)
    again = suite.runpytest("-k", "first_sender", "--sim-seed", str(bad), *how)
    first.assert_outcomes(failed=1)
    again.assert_outcomes(failed=1)
    pick = [line for line in first.stdout.lines if "first sender was" in line]
    assert pick and pick == [line for line in again.stdout.lines if "first sender was" in line]


def test_threads_mode_option(suite: pytest.Pytester, iso: list[str]) -> None:
    result = suite.runpytest("-k", "sum", "--sim-mode", "threads", *iso)
    result.assert_outcomes(passed=1)


def test_bad_marker_argument_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_bad='''
import pytest
@pytest.mark.world_size(0)
def test_x(rank):
    pass
''')
    result = pytester.runpytest()
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*world_size needs a positive int*"])
