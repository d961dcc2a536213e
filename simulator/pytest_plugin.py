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
give each rank its own values.  A failure names the failing rank(s), the seed
and the mode, and the command that replays it; ``--sim-seed`` and
``--sim-mode`` choose the schedule.
"""
from __future__ import annotations

from typing import Any

import pytest

_RANK = object()  # placeholders the plugin replaces with per-rank values
_WORLD = object()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("simulator", "tensorplay simulator (@pytest.mark.world_size)")
    group.addoption("--sim-seed", type=int, default=None,
                    help="seed of the simulated schedule (default: 0, or the marker's seed=)")
    group.addoption("--sim-mode", choices=("coop", "threads"), default=None,
                    help="coop: one rank at a time, reproducible by seed (default); threads: free-running")
    group.addoption("--sim-timeout", type=float, default=60.0, help="bound on one simulated test, in seconds")
    group.addoption("--sim-isolation", choices=("thread", "process"), default=None,
                    help="thread: ranks are threads of the test process (default); process: each rank its own "
                         "process (own globals, PYTHONHASHSEED); overrides the marker's isolation=")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "world_size(n, seed=None, mode=None, isolation=None): run the test function on n simulated ranks "
        "(tensorplay simulator); fixtures rank and world_size give each rank its values",
    )


@pytest.fixture
def rank() -> Any:
    """This rank's global rank inside a ``@pytest.mark.world_size(N)`` test."""
    return _RANK


@pytest.fixture
def world_size() -> Any:
    """The number of simulated ranks of a ``@pytest.mark.world_size(N)`` test."""
    return _WORLD


def _isolation(item: pytest.Item, marker: pytest.Mark) -> str:
    """``--sim-isolation``, else the marker's ``isolation=``, else ``"thread"``."""
    return item.config.getoption("--sim-isolation") or marker.kwargs.get("isolation") or "thread"


def _rank_test(test: Any, shared: dict[str, Any], rank_keys: tuple[str, ...], world_keys: tuple[str, ...]) -> Any:
    """The test body on one rank (module level, so that a rank process can receive it by reference)."""
    import tensorplay.distributed as dist

    kwargs = dict(shared)
    kwargs.update({k: dist.get_rank() for k in rank_keys})
    kwargs.update({k: dist.get_world_size() for k in world_keys})
    return test(**kwargs)


def _settings(item: pytest.Item, marker: pytest.Mark) -> tuple[int, int, str]:
    if not marker.args or not isinstance(marker.args[0], int) or marker.args[0] < 1:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.world_size needs a positive int, got {marker.args!r}")
    n = marker.args[0]
    seed = item.config.getoption("--sim-seed")
    if seed is None:
        seed = marker.kwargs.get("seed", 0)
    mode = item.config.getoption("--sim-mode") or marker.kwargs.get("mode", "coop")
    return n, seed, mode


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("world_size")
    if marker is None:
        return None
    import simulator
    import tensorplay.distributed as dist

    n, seed, mode = _settings(pyfuncitem, marker)
    names = pyfuncitem._fixtureinfo.argnames
    shared = {name: pyfuncitem.funcargs[name] for name in names}
    test = pyfuncitem.obj

    def body() -> Any:
        kwargs = {k: (dist.get_rank() if v is _RANK else dist.get_world_size() if v is _WORLD else v)
                  for k, v in shared.items()}
        return test(**kwargs)

    isolation = _isolation(pyfuncitem, marker)
    if isolation == "process":  # the closure above cannot travel to a rank process; the same body by reference can
        import functools

        body = functools.partial(  # type: ignore[assignment]
            _rank_test, test, {k: v for k, v in shared.items() if v is not _RANK and v is not _WORLD},
            tuple(k for k, v in shared.items() if v is _RANK), tuple(k for k, v in shared.items() if v is _WORLD))
    try:
        simulator.run(body, n, seed=seed, mode=mode, timeout=pyfuncitem.config.getoption("--sim-timeout"),
                      isolation=isolation)
    except BaseException as exc:  # annotate whatever failed with how to replay it, then let pytest report it
        failed = sorted({r for r in _failed_ranks(exc)})
        note = (f"[world_size={n}] failed on rank(s) {failed} with seed={seed}, mode={mode!r}, "
                f"isolation={isolation!r}; replay: pytest '{pyfuncitem.nodeid}' --sim-seed {seed} --sim-mode {mode}"
                + (" --sim-isolation process" if isolation == "process" else ""))
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        raise
    return True


def _failed_ranks(exc: BaseException) -> list[int]:
    """Ranks that raised first (not the ones released with RankFailedError because another rank failed)."""
    from simulator import RankFailedError

    out: list[int] = []
    stack = [exc]
    while stack:
        e = stack.pop()
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        elif not isinstance(e, RankFailedError) and getattr(e, "rank", None) is not None:
            out.extend(getattr(e, "ranks", None) or [e.rank])  # every rank that raised it, not only the reported one
    return out
