"""Test helper: the backends a behaviour test runs on, listed once (this module holds no tests).

A behaviour test is written once and takes the ``ranks`` fixture (defined in
``tests/conftest.py``), parametrised through :func:`on_backends`::

    @on_backends((1, 2, 3, 4))
    def test_something(ranks: Ranks) -> None:
        results = ranks.run(body, arg)          # body(arg) on every rank, results in rank order
        ...compare with a reference computed here...

Each param is one ``(backend, world size, schedule)``: the simulator in
process (``sim``, also ``sim-threads`` where a test asks for the free-running
schedule) and real gloo processes (``gloo``: the session's ``rank_pool(n)``,
marked ``gloo`` and ``xdist_group("gloo-W<n>")`` so ``--dist loadgroup`` keeps
it on the worker that holds that pool).  Functions sent to the ranks must
survive pickling by reference or by ``dill`` (module-level functions of a test
module or of ``tests/_support``, or closures over picklable values).

**Adding a backend is one entry in** :data:`BACKENDS`.  The process-isolated
simulator (``simulator.run(fn, n, isolation="process")``) is prepared as
:data:`SIM_PROCESS`; adding it to the list is the one line.  A test that
cannot hold on some backend says so with ``skip={name: reason}`` (or
:func:`only_in_process`); a test whose outcome differs per backend states each
backend's outcome with :meth:`Ranks.expected`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

import pytest

T = TypeVar("T")

def _sim_run(isolation: str | None) -> Callable[..., list[Any]]:
    def run(fn: Callable[..., Any], world: int, args: Sequence[Any], *, mode: str, seed: int,
            timeout: float) -> list[Any]:
        import simulator  # only the simulated params import it

        # rank processes keep one PYTHONHASHSEED set whatever the schedule's seed: a test that explores seeds reuses
        # the same warm interpreters instead of starting W new ones (an import of torch each) per seed
        extra = {} if isolation is None else {"isolation": isolation, "hash_seed": 0}
        return simulator.run(fn, world, args=args, mode=mode, seed=seed, timeout=timeout, **extra)

    return run


@dataclass(frozen=True)
class Backend:
    """One way of running W ranks in the test suite.

    Attributes:
        name: the param id prefix and the key of per-backend expectations and skips.
        family: the backend whose expectations this one shares unless it states its own
            (``sim-process`` behaves as ``sim`` does).
        simulated: runs on the simulator (understands ``mode`` and ``seed``; errors may be SimErrors).
        in_process: every rank lives in the test process (tensors of different ranks share one
            address space, so aliasing between ranks can be observed).
        max_world: the largest world size the suite runs it at (gloo: 4, to fit 2 CI cores).
        modes: the simulator schedules it offers (``coop`` first: the default one).
        pool: uses the session ``rank_pool(n)`` fixture (real processes; marked ``gloo``).
        sim_run: how a simulated backend runs ``fn`` on W ranks (``None`` for a pool backend).
        timeout_s: bound on one simulated world (a pool bounds each call itself).
    """

    name: str
    family: str
    simulated: bool
    in_process: bool
    max_world: int
    modes: tuple[str, ...] = ("coop",)
    pool: bool = False
    sim_run: Callable[..., list[Any]] | None = field(default=None, compare=False, repr=False)
    timeout_s: float = 20.0
    #: its params run only in the slow tier (``-m slow``): a backend whose worlds cost seconds to start
    slow: bool = False

    def marks(self, world_size: int) -> list[Any]:
        marks: list[Any] = [pytest.mark.slow] if self.slow else []
        if self.pool:
            marks += [pytest.mark.gloo, pytest.mark.xdist_group(f"gloo-W{world_size}")]
        return marks


SIM = Backend("sim", "sim", simulated=True, in_process=True, max_world=8, modes=("coop", "threads"),
              sim_run=_sim_run(None))
GLOO = Backend("gloo", "gloo", simulated=False, in_process=False, max_world=4, pool=True)
#: the process-isolated simulator (issue 14): every behaviour test runs on it too, coop schedule, W <= 4.
#: Rank processes are forks of warm interpreters (simulator.isolation.warm), so a world starts in about
#: 0.1 s once this test process has run one (the first pays for an interpreter and ``import torch`` per rank).
SIM_PROCESS = Backend("sim-process", "sim", simulated=True, in_process=False, max_world=4,
                      modes=("coop",), sim_run=_sim_run("process"), timeout_s=60.0)

#: every backend the behaviour tests run on; one entry per backend
BACKENDS: list[Backend] = [
    SIM,
    GLOO,
    SIM_PROCESS,
]
BY_NAME: dict[str, Backend] = {b.name: b for b in (SIM, GLOO, SIM_PROCESS)}

# TENSORPLAY_TEST_BACKENDS=sim,sim-process runs the behaviour tests on exactly those (e.g. to try a
# backend before it joins the list); unset: BACKENDS
if os.environ.get("TENSORPLAY_TEST_BACKENDS"):
    _wanted = [n.strip() for n in os.environ["TENSORPLAY_TEST_BACKENDS"].split(",") if n.strip()]
    _unknown = [n for n in _wanted if n not in BY_NAME]
    if _unknown:
        raise ValueError(f"TENSORPLAY_TEST_BACKENDS names unknown backends {_unknown}; known: {sorted(BY_NAME)}")
    BACKENDS = [BY_NAME[n] for n in _wanted]


class Ranks:
    """``world_size`` ranks of one backend, ready to run a function on every rank."""

    def __init__(self, backend: Backend, world_size: int, mode: str | None,
                 pool: Any = None) -> None:
        self.backend = backend
        self.world_size = world_size
        self.mode = mode
        self._pool = pool

    @property
    def name(self) -> str:
        """The backend's name (``sim``, ``gloo``, ...)."""
        return self.backend.name

    @property
    def simulated(self) -> bool:
        return self.backend.simulated

    def run(self, fn: Callable[..., Any], *args: Any, seed: int = 0, timeout: float | None = None) -> list[Any]:
        """``fn(*args)`` on every rank; the results in rank order.

        ``seed`` picks the simulator's schedule (a real backend's schedule is the OS's, so it has no
        seed); ``timeout`` bounds the call (default: the backend's ``timeout_s`` when simulated, the
        pool's call timeout on gloo).
        """
        if self.backend.sim_run is not None:
            return self.backend.sim_run(fn, self.world_size, args, mode=self.mode or "coop", seed=seed,
                                        timeout=self.backend.timeout_s if timeout is None else timeout)
        return self._pool.run(fn, *args, timeout=timeout)

    def expected(self, table: Mapping[str, T]) -> T:
        """This backend's entry of a per-backend table (by name, else by family).

        A missing entry is a test-writing error: every backend must have its outcome stated.
        """
        for key in (self.backend.name, self.backend.family):
            if key in table:
                return table[key]
        raise KeyError(f"no expectation for backend {self.backend.name!r} (family {self.backend.family!r}) "
                       f"in {sorted(table)}: state this backend's outcome in the test's table")

    def __repr__(self) -> str:
        mode = f", mode={self.mode!r}" if self.mode and self.mode != "coop" else ""
        return f"Ranks({self.backend.name!r}, world_size={self.world_size}{mode})"


def param_id(backend: Backend, world_size: int, mode: str | None) -> str:
    """``sim-W3``, ``sim-threads-W3``, ``gloo-W3``."""
    return f"{backend.name}{'' if mode in (None, 'coop') else '-' + mode}-W{world_size}"


def backend_params(worlds: Iterable[int], *, modes: Sequence[str] = ("coop",),
                   skip: Mapping[str, str] | None = None,
                   worlds_on: Mapping[str, Iterable[int]] | None = None,
                   backends: Sequence[Backend] | None = None) -> list[Any]:
    """pytest params ``(backend name, world size, mode)`` for the ``ranks`` fixture.

    Args:
        worlds: world sizes; each backend takes those up to its ``max_world``.
        modes: simulator schedules to cover; a backend without schedules gets one param per world.
        skip: ``{backend name: reason}`` for a backend on which the test cannot hold (kept as a
            visible skip with its reason rather than dropped).
        worlds_on: ``{backend name: world sizes}`` replacing ``worlds`` for that backend (a costly
            test on real processes may cover fewer sizes; say why where it is used).
        backends: defaults to :data:`BACKENDS`.
    """
    skip = dict(skip or {})
    worlds = list(worlds)
    out = []
    for b in BACKENDS if backends is None else backends:
        # a backend with schedules covers the asked ones it has; one without gets one param per world
        b_modes: list[str | None] = ([m for m in modes if m in b.modes] or [b.modes[0]]) if b.simulated else [None]
        for w in (worlds_on or {}).get(b.name, worlds):
            if w > b.max_world:
                continue
            for mode in b_modes:
                marks = b.marks(w)
                if b.name in skip:
                    marks = [*marks, pytest.mark.skip(reason=f"{b.name}: {skip[b.name]}")]
                out.append(pytest.param((b.name, w, mode), id=param_id(b, w, mode), marks=marks))
    return out


def on_backends(worlds: Iterable[int], **kwargs: Any) -> Any:
    """Decorator: parametrise the test's ``ranks`` fixture over :func:`backend_params` (same arguments)."""
    return pytest.mark.parametrize("ranks", backend_params(worlds, **kwargs), indirect=True)


def only_in_process(reason: str) -> dict[str, str]:
    """A ``skip`` table for every backend whose ranks are not all in the test process."""
    return {b.name: reason for b in BY_NAME.values() if not b.in_process}


def make_ranks(request: pytest.FixtureRequest) -> Ranks:
    """The ``ranks`` fixture's body (conftest.py): turn one param into a :class:`Ranks`."""
    param = getattr(request, "param", None)
    if param is None:
        raise pytest.UsageError("the 'ranks' fixture is parametrised by @on_backends(worlds) "
                                "(tests/_support/backends.py); this test has no such decorator")
    name, world, mode = param
    backend = BY_NAME[name]
    pool = request.getfixturevalue("rank_pool")(world) if backend.pool else None
    return Ranks(backend, world, mode, pool)


def on_backends_with(argname: str, per_world: Callable[[int], Sequence[Any]], ids: Callable[[Any], str],
                     worlds: Iterable[int], **kwargs: Any) -> Any:
    """Like :func:`on_backends`, with a second argument whose values depend on the world size.

    ``@on_backends_with("spec", group_specs, gname, range(1, 9))`` gives one test per backend,
    world size and group that fits that world (ids such as ``sim-W4-g312``).
    """
    params = []
    for p in backend_params(worlds, **kwargs):
        (key,) = p.values
        for v in per_world(key[1]):
            params.append(pytest.param(key, v, id=f"{p.id}-{ids(v)}", marks=p.marks))
    return pytest.mark.parametrize(("ranks", argname), params, indirect=["ranks"])
