"""Shared fixtures: persistent gloo rank pools, one per world size, reused by every test of a session.

Starting a rank costs about two seconds (``import torch``), a call on a warm
pool a few milliseconds.  So the pools live for the whole session and tests
batch many sub-cases into one call.  Under ``pytest -n 2 --dist loadgroup``
every test that uses world size ``n`` carries ``@pytest.mark.xdist_group("gloo-Wn")``,
which sends it to the xdist worker that already holds that pool; plain
``pytest`` simply keeps all pools in one process.

Functions run on the ranks travel by reference (dill pickles module-level
functions of importable modules as ``module.name``), so worker functions must
live at module level in the test files; the rank processes import the test
module themselves.

``ranks``: one body per behaviour, run on every backend of
``tests/_support/backends.py`` (``@on_backends(worlds)`` parametrises it).
"""
from __future__ import annotations

import os
from typing import Callable, Iterator

import pytest

from tensorplay.testing import RankPool

from _support.backends import Ranks, make_ranks

#: bound on one pool call; a healthy call takes milliseconds
CALL_TIMEOUT_S = float(os.environ.get("TENSORPLAY_TEST_CALL_TIMEOUT", "60"))
#: a collective a peer never joins fails after this many seconds inside the ranks
PG_TIMEOUT_S = float(os.environ.get("TENSORPLAY_TEST_PG_TIMEOUT", "30"))


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[Callable[[int], RankPool]]:
    """``rank_pool(n)``: the session's gloo :class:`RankPool` of world size ``n`` (started on first use).

    A pool whose call failed restarts its processes on the next call, so one
    failing test does not poison the others.
    """
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        pool = pools.get(world_size)
        if pool is None:
            pool = pools[world_size] = RankPool(world_size, call_timeout=CALL_TIMEOUT_S, pg_timeout=PG_TIMEOUT_S)
        if not pool.alive:
            pool.start()
        return pool

    yield get
    for pool in pools.values():
        pool.close()


@pytest.fixture
def ranks(request: pytest.FixtureRequest) -> Ranks:
    """W ranks of one backend (``ranks.run(fn, *args)``); parametrise with ``@on_backends(worlds)``.

    The gloo params take the session's ``rank_pool(n)``; the simulated ones start a world per call.
    """
    return make_ranks(request)


def pytest_configure(config: pytest.Config) -> None:
    # pyproject registers the markers too; this keeps `pytest -p no:...` runs and
    # rootdir-less invocations free of unknown-marker warnings
    config.addinivalue_line("markers", "gloo: runs real gloo rank processes on loopback")
    config.addinivalue_line("markers", "xdist_group(name): keep tests sharing a rank pool on one xdist worker")


#: the distributions whose versions decide whether this suite is green (printed at the top of every run, so a
#: CI log says what a fresh environment resolved)
_REPORTED = ("torch", "numpy", "cloudpickle", "multiprocess", "pytest", "pytest-xdist", "hypothesis", "mkdocs",
             "mkdocstrings", "mkdocstrings-python")


def pytest_report_header(config: pytest.Config) -> str:
    from importlib import metadata

    found = []
    for name in _REPORTED:
        try:
            found.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return "tensorplay dependencies: " + ", ".join(found)
