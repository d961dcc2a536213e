"""Acceptance tests of the simulator's pytest plugin (@pytest.mark.world_size), through pytester.

Each runs with thread ranks and with rank processes (``--sim-isolation process``)."""
from __future__ import annotations

import re

import pytest

# pytester's in-process runs put sys.modules back afterwards; the package is lazy (loading the plugin imports
# none of it), so load the simulator here, once, or each run would drop what the previous one imported while
# the package still holds it
from simulator import run as _load_the_simulator  # noqa: F401

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


# -- misuse is loud ------------------------------------------------------------------------------------------
MISUSE = """
import pytest

@pytest.mark.world_size(2)
def test_ok(rank):
    pass

def test_rank_without_marker(rank):
    assert False, "the body must not run"

def test_world_size_without_marker(world_size):
    assert False, "the body must not run"
"""


def test_rank_and_world_size_fixtures_without_the_marker_are_errors(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_misuse=MISUSE)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=2)
    out = result.stdout.str()
    assert "the body must not run" not in out
    for name in ("rank", "world_size"):
        assert (f"fixture '{name}': used by a test without @pytest.mark.world_size, so no simulated ranks run it: "
                f"test='test_misuse.py::test_{name}_without_marker'. Fix: add @pytest.mark.world_size(N)") in out, out


def test_a_conftest_fixture_named_rank_wins_over_the_plugins(pytester: pytest.Pytester) -> None:
    """A project's own ``rank`` fixture is its own: the plugin's error is only for the plugin's fixture."""
    pytester.makeconftest("import pytest\n\n@pytest.fixture\ndef rank():\n    return 7\n")
    pytester.makepyfile(test_own="def test_own(rank):\n    assert rank == 7\n")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)


#: (marker arguments, fragments of the error); each test body records that it ran, which it must not
BAD_MARKERS = {
    "misspelt": ('2, isolaton="process"', ["unknown keyword: isolaton='process', valid=['seed', 'mode', "
                                           "'isolation', 'timeout', 'stall_timeout']",
                                           "Fix: did you mean isolation=?"]),
    "unknown_kw": ("2, colour=1", ["unknown keyword: colour=1", "Fix: use one of seed=, mode=, isolation="]),
    "no_args": ("", ["takes exactly one positional argument", "args=()"]),
    "two_args": ("2, 3", ["args=(2, 3)", "world_size(4, seed=1)"]),
    "zero": ("0", ["world_size needs a positive int: world_size=0"]),
    "str_world": ('"2"', ["world_size needs a positive int: world_size='2'"]),
    "bool_world": ("True", ["world_size needs a positive int: world_size=True"]),
    "seed_str": ('2, seed="1"', ["seed must be an int: seed='1'", "Fix: write e.g. seed=0"]),
    "mode_thread": ('2, mode="thread"', ["unknown mode: mode='thread'", "Fix: write mode='threads'",
                                         "isolation='thread' is a different knob"]),
    "mode_other": ('2, mode="fast"', ["unknown mode: mode='fast'", "mode='coop'", "mode='threads'"]),
    "isolation_threads": ('2, isolation="threads"', ["unknown isolation: isolation='threads'",
                                                     "mode='threads' is a different knob"]),
    "timeout_zero": ("2, timeout=0", ["timeout must be a positive number of seconds, or None for no bound: "
                                      "timeout=0", "Fix: write e.g. timeout=600"]),
    "stall_negative": ("2, stall_timeout=-1", ["stall_timeout must be a positive number of seconds, or None for "
                                               "no bound: stall_timeout=-1"]),
    "timeout_str": ('2, timeout="5"', ["timeout='5'"]),
}


def test_bad_marker_arguments_fail_the_test_before_any_rank_starts(pytester: pytest.Pytester) -> None:
    ran = pytester.path / "ran"
    body = ["import pytest", "", f"RAN = {str(ran)!r}", ""]
    for name, (args, _) in BAD_MARKERS.items():
        body += [f"@pytest.mark.world_size({args})", f"def test_{name}(rank):",
                 f"    open(RAN, 'a').write('{name} ')", ""]
    pytester.makepyfile(test_bad_markers="\n".join(body))
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=len(BAD_MARKERS))
    assert not ran.exists(), ran.read_text()
    out = result.stdout.str()
    for name, (_, fragments) in BAD_MARKERS.items():
        section = out.split(f"ERROR at setup of test_{name} ")[1].split("ERROR at setup of")[0]
        assert f"@pytest.mark.world_size (test_bad_markers.py::test_{name}): " in section, section
        for fragment in fragments:
            assert fragment in section, (name, fragment, section)
        assert "Traceback" not in section and "pytest_plugin.py" not in section, section  # the message alone


def test_none_on_the_marker_means_the_default(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_none='''
import pytest

@pytest.mark.world_size(2, seed=None, mode=None, isolation=None, timeout=None)
def test_defaults(rank, world_size):
    assert world_size == 2
''')
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)


# -- the bounds: --sim-timeout (whole test, default none) and --sim-stall-timeout (progress, default 300) --------
STUCK = """
import time
import pytest
import torch
import tensorplay.distributed as dist

@pytest.mark.world_size(2{kw})
def test_stuck(rank):
    if rank == 0:
        time.sleep(1.5)  # computes (outside the simulator) while rank 1 waits in all_reduce
    dist.all_reduce(torch.ones(1))
"""


@pytest.mark.parametrize("kw,args,bound", [
    (", stall_timeout=0.3", [], "stall_timeout"),
    ("", ["--sim-stall-timeout", "0.3"], "stall_timeout"),
    (", timeout=0.3", [], "timeout"),
    ("", ["--sim-timeout", "0.3"], "timeout"),
    (", stall_timeout=600", ["--sim-stall-timeout", "0.3"], "stall_timeout"),  # the option overrides the marker
], ids=["marker-stall", "option-stall", "marker-timeout", "option-timeout", "option-over-marker"])
def test_the_bounds_reach_the_run(pytester: pytest.Pytester, kw: str, args: list[str], bound: str) -> None:
    pytester.makepyfile(test_stuck=STUCK.format(kw=kw))
    result = pytester.runpytest("-p", "no:cacheprovider", "-W", "ignore::RuntimeWarning", *args)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "SimTimeoutError" in out, out
    want = "stall: no operation completed for 0.3 s" if bound == "stall_timeout" else "did not finish within 0.3 s"
    assert want in out, out
    assert "[world_size=2] failed with seed=0, mode='coop', isolation='thread'; replay:" in out, out
    shown = {"stall_timeout": "0.3" if bound == "stall_timeout" else "300", "timeout": "0.3" if bound == "timeout"
             else "inf"}
    assert (f"bounds: stall_timeout={shown['stall_timeout']} s, timeout={shown['timeout']} s; raise them with the "
            "marker's stall_timeout=/timeout= or --sim-stall-timeout/--sim-timeout") in out, out


def test_bound_options_take_positive_seconds_or_none(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_stuck=STUCK.format(kw=""))
    for option in ("--sim-timeout", "--sim-stall-timeout"):
        for bad in ("0", "-5", "soon", "nan"):
            result = pytester.runpytest("-p", "no:cacheprovider", option, bad)
            assert result.ret == pytest.ExitCode.USAGE_ERROR, (option, bad)
            assert re.search(rf"{option} takes a positive number of seconds or 'none' \(no bound\), "
                             rf"got '{bad}'; e.g. {option} 600", result.stderr.str()), result.stderr.str()
    # 'none' is no bound at all: the stuck rank comes back after 1.5 s and the test passes
    ok = pytester.runpytest("-p", "no:cacheprovider", "--sim-timeout", "none", "--sim-stall-timeout", "none")
    ok.assert_outcomes(passed=1)


def test_help_names_the_bounds_and_their_defaults(pytester: pytest.Pytester) -> None:
    text = " ".join(pytester.runpytest("--help").stdout.str().split())
    assert "--sim-timeout=SECONDS bound on one whole simulated test (default: the marker's timeout=, else none)" \
        in text, text
    assert "--sim-stall-timeout=SECONDS fail a simulated test when a rank waits in an operation and nothing " \
           "progressed for this long (default: the marker's stall_timeout=, else 300" in text, text


SKIPS = '''
import pytest
import tensorplay.distributed as dist

@pytest.mark.world_size(2)
def test_skipped_everywhere(rank):
    pytest.skip("not here")

@pytest.mark.world_size(2)
def test_skipped_by_rank_1_after_rank_0_is_done(rank):
    if rank == 1:
        pytest.skip("rank 1 has nothing to check")

@pytest.mark.world_size(2)
def test_skipped_by_rank_1_while_rank_0_waits(rank):
    if rank == 1:
        pytest.skip("only rank 0")
    dist.barrier()
'''


def test_a_skip_on_some_ranks_while_others_wait_for_them_fails(pytester: pytest.Pytester) -> None:
    """A test skipped on every rank, or on ranks nobody waits for, is skipped; one that some ranks skip while the
    others wait for them in a collective would hang on real processes: it fails, naming both and the fix."""
    pytester.makepyfile(test_skips=SKIPS)
    result = pytester.runpytest("-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(skipped=2, failed=1)
    text = result.stdout.str()
    assert "rank(s) [1] skipped the test while rank(s) [0] waited for them in a collective" in text, text
    assert "Fix: skip on every rank" in text, text
