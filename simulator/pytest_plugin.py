"""pytest plugin: run a test function on N simulated ranks.

Installed with tensorplay (entry point ``pytest11``), so it is active in any
project that has tensorplay installed::

    import pytest
    import tensorplay as tp
    import tensorplay.distributed as dist

    @pytest.mark.world_size(4)
    def test_sum(rank, world_size):
        x = tp.tensor([float(rank)])
        dist.all_reduce(x)
        assert x.item() == sum(range(world_size))

The test body runs once per rank, each in its own simulated rank thread (or, with
``isolation="process"`` on the marker or ``--sim-isolation process``, its own process) with
tensorplay.distributed initialised.  The ``rank`` and ``world_size`` fixtures
give each rank its own values; they are an error in a test without the marker.
A failure names the failing rank(s), the seed and the mode, and the command that replays it.

The marker: ``world_size(n, *, seed=0, mode="coop", isolation="thread", timeout=None, stall_timeout=300)``.
Each keyword has an option that overrides it for the whole session: ``--sim-seed``, ``--sim-mode``
(``coop`` or ``threads``), ``--sim-isolation`` (``thread`` or ``process``), ``--sim-timeout SECONDS``
(a bound on the whole test; default none) and ``--sim-stall-timeout SECONDS`` (the test fails when a
rank waits in an operation and nothing progressed for that long; default 300).  A marker with a
misspelt keyword or a bad value is an error of that test, reported before any rank starts.

Loading the plugin costs a session that does not use it nothing: this module imports only pytest (its
package, :mod:`simulator`, is lazy), and the simulator is imported when a marked test runs.
"""
from __future__ import annotations

import argparse
import math
from typing import Any, NamedTuple

import pytest

import simulator  # (light: the package loads its names on first use)

_RANK = object()  # placeholders the plugin replaces with per-rank values
_WORLD = object()

_MARKER = "@pytest.mark.world_size"
_MODES = ("coop", "threads")
_ISOLATIONS = ("thread", "process")
#: torch's own distributed tests (MultiProcessTestCase) give a test 300 s (``TIMEOUT_DEFAULT`` in
#: torch.testing._internal.common_distributed): a test that waits that long without progress is hung.  Outside
#: pytest the simulator waits torch's process-group timeout (1800 s), a bound made for training jobs
DEFAULT_STALL_TIMEOUT = 300.0
_KEYWORDS = ("seed", "mode", "isolation", "timeout", "stall_timeout")


class _Settings(NamedTuple):
    """How one marked test runs: the marker's values, overridden by the ``--sim-*`` options."""

    world_size: int
    seed: int
    mode: str
    isolation: str
    timeout: float  # seconds; inf: no bound
    stall_timeout: float


_SETTINGS = pytest.StashKey[_Settings]()


def _message(call: str, problem: str, values: dict[str, Any], fix: str) -> str:
    """tensorplay.distributed.errors.format_message's layout (``call: problem: name=value. Fix: ...``), written
    here so that a usage error does not import tensorplay (and torch)."""
    return f"{call}: {problem}: " + ", ".join(f"{k}={v!r}" for k, v in values.items()) + f". Fix: {fix}"


def _seconds_option(name: str) -> Any:
    """argparse type of a ``--sim-*-timeout`` option: a positive number of seconds, ``none`` (or ``inf``) for no
    bound, which is ``inf`` (``None`` stays free to mean "not given": the marker's value, else the default)."""

    def parse(text: str) -> float:
        try:
            value = math.inf if text.strip().lower() == "none" else float(text)
        except ValueError:
            value = math.nan
        if math.isnan(value) or value <= 0:
            raise argparse.ArgumentTypeError(
                f"{name} takes a positive number of seconds or 'none' (no bound), got {text!r}; e.g. {name} 600")
        return value

    return parse


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("simulator", "tensorplay simulator (@pytest.mark.world_size)")
    group.addoption("--sim-seed", type=int, default=None,
                    help="seed of the simulated schedule (default: the marker's seed=, else 0)")
    group.addoption("--sim-mode", choices=_MODES, default=None,
                    help="coop: one rank at a time, reproducible by seed (default); threads: free-running")
    group.addoption("--sim-timeout", type=_seconds_option("--sim-timeout"), default=None, metavar="SECONDS",
                    help="bound on one whole simulated test (default: the marker's timeout=, else none)")
    group.addoption("--sim-stall-timeout", type=_seconds_option("--sim-stall-timeout"), default=None,
                    metavar="SECONDS",
                    help="fail a simulated test when a rank waits in an operation and nothing progressed for this "
                         f"long (default: the marker's stall_timeout=, else {DEFAULT_STALL_TIMEOUT:g}, the per-test "
                         "bound of torch's MultiProcessTestCase)")
    group.addoption("--sim-isolation", choices=_ISOLATIONS, default=None,
                    help="thread: ranks are threads of the test process (default); process: each rank its own "
                         "process (own globals, PYTHONHASHSEED); overrides the marker's isolation=")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "world_size(n, seed=0, mode='coop', isolation='thread', timeout=None, stall_timeout=300): run the test "
        "function on n simulated ranks (tensorplay simulator); fixtures rank and world_size give each rank its "
        "values",
    )


def _without_marker(request: pytest.FixtureRequest, name: str) -> None:
    if request.node.get_closest_marker("world_size") is None:
        pytest.fail(_message(
            f"fixture {name!r}", "used by a test without @pytest.mark.world_size, so no simulated ranks run it",
            {"test": request.node.nodeid},
            f"add @pytest.mark.world_size(N) to the test to run its body on N simulated ranks (the fixture is "
            f"then each rank's {'global rank' if name == 'rank' else 'world size'}), or do not use {name!r}"),
            pytrace=False)


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> Any:
    """This rank's global rank inside a ``@pytest.mark.world_size(N)`` test (an error in any other test)."""
    _without_marker(request, "rank")
    return _RANK


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> Any:
    """The number of simulated ranks of a ``@pytest.mark.world_size(N)`` test (an error in any other test)."""
    _without_marker(request, "world_size")
    return _WORLD


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_bound(v: Any) -> bool:
    """A bound in seconds: None (no bound) or a positive number."""
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0)


def _marker_problem(marker: pytest.Mark) -> tuple[str, dict[str, Any], str] | None:
    """What is wrong with the marker's arguments, as (problem, values, fix); None when they are fine."""
    import difflib

    if len(marker.args) != 1:
        return ("takes exactly one positional argument, the number of ranks", {"args": marker.args},
                "write e.g. @pytest.mark.world_size(4, seed=1)")
    n = marker.args[0]
    if not _is_int(n) or n < 1:
        return ("world_size needs a positive int", {"world_size": n}, "write e.g. @pytest.mark.world_size(4)")
    for key in marker.kwargs:
        if key not in _KEYWORDS:
            close = difflib.get_close_matches(key, _KEYWORDS, n=1)
            return ("unknown keyword", {key: marker.kwargs[key], "valid": list(_KEYWORDS)},
                    f"did you mean {close[0]}=?" if close else f"use one of {', '.join(k + '=' for k in _KEYWORDS)}")
    kw = marker.kwargs
    if kw.get("seed") is not None and not _is_int(kw["seed"]):
        return "seed must be an int", {"seed": kw["seed"]}, "write e.g. seed=0"
    mode = kw.get("mode")
    if mode is not None and mode not in _MODES:
        fix = "write mode='coop' (one rank at a time, reproducible by seed) or mode='threads' (free-running)"
        if mode == "thread":
            fix = ("write mode='threads' for free-running ranks; isolation='thread' is a different knob (ranks are "
                   "threads of the test process, the default), as opposed to isolation='process'")
        return "unknown mode", {"mode": mode}, fix
    isolation = kw.get("isolation")
    if isolation is not None and isolation not in _ISOLATIONS:
        fix = "write isolation='thread' (ranks are threads of the test process) or isolation='process'"
        if isolation == "threads":
            fix = "write isolation='thread'; mode='threads' is a different knob (free-running ranks, not coop)"
        return "unknown isolation", {"isolation": isolation}, fix
    for key, example in (("timeout", 600), ("stall_timeout", 300)):
        if not _is_bound(kw.get(key)):
            return (f"{key} must be a positive number of seconds, or None for no bound", {key: kw[key]},
                    f"write e.g. {key}={example}")
    return None


def _settings(item: pytest.Item, marker: pytest.Mark) -> _Settings:
    """The marker's values (validated), overridden by the command line's ``--sim-*`` options."""
    problem = _marker_problem(marker)
    if problem is not None:
        what, values, fix = problem
        pytest.fail(_message(f"{_MARKER} ({item.nodeid})", what, values, fix), pytrace=False)
    opt = item.config.getoption
    kw = marker.kwargs

    def pick(option: str, key: str, default: Any) -> Any:  # None on the marker: the default
        given = opt(option)
        return given if given is not None else default if kw.get(key) is None else kw[key]

    def bound(option: str, key: str, default: float) -> float:  # None on the marker: no bound
        given = opt(option)
        value = given if given is not None else kw[key] if key in kw else default
        return math.inf if value is None else float(value)

    return _Settings(
        world_size=marker.args[0],
        seed=pick("--sim-seed", "seed", 0),
        mode=pick("--sim-mode", "mode", "coop"),
        isolation=pick("--sim-isolation", "isolation", "thread"),
        timeout=bound("--sim-timeout", "timeout", math.inf),
        stall_timeout=bound("--sim-stall-timeout", "stall_timeout", DEFAULT_STALL_TIMEOUT),
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Check a marked test's settings before its fixtures, and before any rank starts."""
    marker = item.get_closest_marker("world_size")
    if marker is not None:
        item.stash[_SETTINGS] = _settings(item, marker)


def _rank_test(test: Any, shared: dict[str, Any], rank_keys: tuple[str, ...], world_keys: tuple[str, ...]) -> Any:
    """The test body on one rank (module level, so that a rank process can receive it by reference)."""
    import tensorplay.distributed as dist  # (here: it imports torch, which loading the plugin must not)

    kwargs = dict(shared)
    kwargs.update({k: dist.get_rank() for k in rank_keys})
    kwargs.update({k: dist.get_world_size() for k in world_keys})
    return test(**kwargs)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("world_size")
    if marker is None:
        return None
    import tensorplay.distributed as dist  # (here: it imports torch, which loading the plugin must not)

    s = pyfuncitem.stash.get(_SETTINGS, None) or _settings(pyfuncitem, marker)
    names = pyfuncitem._fixtureinfo.argnames
    shared = {name: pyfuncitem.funcargs[name] for name in names}
    test = pyfuncitem.obj

    skipped: set[int] = set()  # thread ranks that skipped the test, and those that returned (see _skip_outcome)
    returned: set[int] = set()

    def body() -> Any:
        kwargs = {k: (dist.get_rank() if v is _RANK else dist.get_world_size() if v is _WORLD else v)
                  for k, v in shared.items()}
        try:
            out = test(**kwargs)
        except pytest.skip.Exception:
            skipped.add(dist.get_rank())
            raise
        returned.add(dist.get_rank())
        return out

    if s.isolation == "process":  # the closure above cannot travel to a rank process; the same body by reference can
        import functools

        body = functools.partial(  # type: ignore[assignment]
            _rank_test, test, {k: v for k, v in shared.items() if v is not _RANK and v is not _WORLD},
            tuple(k for k, v in shared.items() if v is _RANK), tuple(k for k, v in shared.items() if v is _WORLD))
    try:
        simulator.run(body, s.world_size, seed=s.seed, mode=s.mode, isolation=s.isolation, timeout=s.timeout,
                      stall_timeout=s.stall_timeout)
    except pytest.skip.Exception:
        _skip_outcome(skipped, returned, s.world_size)
        raise
    except BaseException as exc:  # annotate whatever failed with how to replay it, then let pytest report it
        failed = sorted({r for r in _failed_ranks(exc) if r >= 0})  # (a run's bound that ran out has rank -1)
        note = (f"[world_size={s.world_size}] failed{f' on rank(s) {failed}' if failed else ''} with seed={s.seed}, "
                f"mode={s.mode!r}, "
                f"isolation={s.isolation!r}; replay: pytest '{pyfuncitem.nodeid}' --sim-seed {s.seed} "
                f"--sim-mode {s.mode}" + (" --sim-isolation process" if s.isolation == "process" else ""))
        if isinstance(exc, simulator.SimTimeoutError):  # the run's own message names simulator.run's keywords
            note += (f"\n[world_size={s.world_size}] bounds: stall_timeout={s.stall_timeout:g} s, "
                     f"timeout={s.timeout:g} s; raise them with the marker's stall_timeout=/timeout= or "
                     "--sim-stall-timeout/--sim-timeout")
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        raise
    return True


def _skip_outcome(skipped: set[int], returned: set[int], world_size: int) -> None:
    """Some ranks skipped: the test is skipped, unless other ranks were waiting for them in a collective (released
    when the skipping ranks left), which on real processes would hang there: that is a failure of the test."""
    waited = sorted(set(range(world_size)) - skipped - returned) if skipped else []
    if waited:
        pytest.fail(_message(
            "pytest.skip", f"rank(s) {sorted(skipped)} skipped the test while rank(s) {waited} waited for them in a "
            "collective (on real processes those would wait there until the timeout)",
            {"skipped": sorted(skipped), "waiting": waited},
            "skip on every rank (the same condition on each), or before the test's first collective"), pytrace=False)


def _failed_ranks(exc: BaseException) -> list[int]:
    """Ranks that raised first (not the ones released with RankFailedError because another rank failed)."""
    out: list[int] = []
    stack = [exc]
    while stack:
        e = stack.pop()
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        elif not isinstance(e, simulator.RankFailedError) and getattr(e, "rank", None) is not None:
            out.extend(getattr(e, "ranks", None) or [e.rank])  # every rank that raised it, not only the reported one
    return out
