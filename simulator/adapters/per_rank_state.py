"""Libraries' process-wide singletons, one per rank on thread ranks (an adapter of :class:`simulator.World`).

A real process has its own copy of every module-level singleton; thread ranks share one interpreter, so a
library that keeps one registry per process sees every rank's entries.  The common case in training scripts is
Hydra (``@hydra.main``, pytorch/examples' minGPT): its ``GlobalHydra`` and its other singletons live in
``hydra.core.singleton.Singleton._instances``, and the second rank to enter ``@hydra.main`` fails with
``GlobalHydra is already initialized``.  While a world runs, that table is one per rank (a rank's threads share
its table, as a process's threads do); outside a rank, the original table.

torch's ``DeviceMesh`` is the other case: meshes are cache keys (DTensor's sharding propagation, its
redistribution plans), and two ranks' meshes over the same devices compare equal, so one rank thread would take
another's cached plan, which holds the other rank's mesh and coordinates.  torch's own thread ranks (its
``threaded`` backend) tell them apart by ``DeviceMesh._thread_id``; a mesh made on a simulated rank gets its
rank's identity there.  The caches keyed by meshes are emptied when the world ends, as a process's die with it.

What cannot be made per rank this way (a C extension's globals, torch's module trackers) is named by the
failure's report, which points to ``isolation="process"`` (see :mod:`simulator.core.report`).  The libraries'
private names it replaces are listed in :mod:`simulator.adapters.torch_private`.

Example (two thread ranks, each with its own Hydra)::

    python -m simulator --nproc-per-node 2 main.py      # main.py decorated with @hydra.main
"""
from __future__ import annotations

import copy
import itertools
import threading
from typing import Any, ContextManager, Iterator

from simulator.adapters._patch import Installation, replace
from simulator.adapters.after_import import when_imported
from simulator.core._handoff import _NP_RNG
from simulator.core.state import current_rank_state

__all__ = ["PerRankTable", "PerRankDict", "PerRankList", "enabled", "TABLES"]


class PerRankTable(dict):  # type: ignore[type-arg]
    """Stands in for a library's process-wide dict of singletons: the entries of the keys in ``per_rank`` are each
    rank's own (a rank's threads share them, as a process's threads do); the others (registries filled as modules
    are imported, read by every rank) stay shared, in the original dict.

    A ``dict`` subclass, so ``isinstance`` and ``copy.deepcopy`` (Hydra's ``Singleton.get_state``) see a dict: the
    calling rank's view, copied as a plain dict.
    """

    def __init__(self, original: dict, per_rank: Any) -> None:  # type: ignore[type-arg]
        super().__init__()
        self._original = original
        self._per_rank = per_rank  # key -> whether its entry is the rank's own
        self._tables: dict[Any, dict] = {}  # type: ignore[type-arg]

    def _table(self, key: Any) -> dict:  # type: ignore[type-arg]
        rs = current_rank_state()
        if rs is None or not self._per_rank(key):
            return self._original
        root = rs.parent or rs
        table = self._tables.get(root)
        if table is None:
            table = self._tables[root] = {}
        return table

    def view(self) -> dict:  # type: ignore[type-arg]
        """The calling rank's entries: the shared ones and its own."""
        rs = current_rank_state()
        shared = {k: v for k, v in self._original.items() if rs is None or not self._per_rank(k)}
        if rs is not None:
            shared.update(self._tables.get(rs.parent or rs, {}))
        return shared

    def __contains__(self, key: Any) -> bool:
        return key in self._table(key)

    def __getitem__(self, key: Any) -> Any:
        return self._table(key)[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._table(key)[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._table(key)[key]

    def get(self, key: Any, default: Any = None) -> Any:
        return self._table(key).get(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        return self._table(key).pop(key, *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return self._table(key).setdefault(key, default)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.view())

    # (counted without building the view: torch.nn asks its hook tables for truth on every module call; plain
    # loops, no generator expression, since dynamo traces Module._call_impl and refuses to trace generators)
    def __len__(self) -> int:
        rs = current_rank_state()
        if rs is None:
            return len(self._original)
        mine = self._tables.get(rs.parent or rs)
        n = len(mine) if mine else 0
        for k in self._original:
            if not self._per_rank(k):
                n += 1
        return n

    def __bool__(self) -> bool:
        rs = current_rank_state()
        if rs is None:
            return bool(self._original)
        if self._tables.get(rs.parent or rs):
            return True
        for k in self._original:
            if not self._per_rank(k):
                return True
        return False

    def __repr__(self) -> str:
        return repr(self.view())

    def __eq__(self, other: object) -> bool:
        return self.view() == other

    __hash__ = None  # type: ignore[assignment]

    def keys(self) -> Any:
        return self.view().keys()

    def values(self) -> Any:
        return self.view().values()

    def items(self) -> Any:
        return self.view().items()

    def copy(self) -> dict:  # type: ignore[type-arg]
        return self.view()

    def __deepcopy__(self, memo: dict) -> dict:  # type: ignore[type-arg]
        return copy.deepcopy(self.view(), memo)

    def __reduce__(self) -> Any:
        return dict, (self.view(),)


class _RankCopies:
    """Mixin: each rank (with its threads) works on a copy of ``original`` made at its first touch; outside a rank,
    the original itself."""

    def __init__(self, original: Any) -> None:
        super().__init__()
        self._original = original
        self._copies: dict[Any, Any] = {}

    def _mine(self) -> Any:
        rs = current_rank_state()
        if rs is None:
            return self._original
        root = rs.parent or rs
        mine = self._copies.get(root)
        if mine is None:
            mine = self._copies[root] = type(self._original)(self._original)
        return mine


def _delegating(base: type, names: tuple[str, ...]) -> type:
    """A ``base`` subclass (``isinstance`` holds) whose ``names`` act on the calling rank's copy."""
    def forward(name: str) -> Any:
        return lambda self, *a, **k: getattr(self._mine(), name)(*a, **k)

    attrs: dict[str, Any] = {n: forward(n) for n in names}
    attrs["__hash__"] = None
    return type(f"PerRank{base.__name__.title()}", (_RankCopies, base), attrs)


_COMMON = ("__contains__", "__iter__", "__len__", "__getitem__", "__setitem__", "__delitem__", "__repr__", "__eq__",
           "__bool__", "copy", "clear", "pop")
#: a dict / a list each rank has a copy of (torch's backend registry: a test's ranks each register their own)
PerRankDict = _delegating(dict, _COMMON + ("get", "setdefault", "keys", "values", "items", "update"))
PerRankList = _delegating(list, _COMMON + ("append", "extend", "insert", "remove", "index", "count", "sort"))


#: Hydra's singletons that hold one run's state (initialised by each @hydra.main), as opposed to its registries
#: (ConfigStore, Plugins), which modules fill as they are imported
_HYDRA_RUN_STATE = frozenset({"GlobalHydra", "HydraConfig", "JobRuntime"})


def _hydra_singletons(module: Any) -> Any:
    owner = module.Singleton
    original = owner.__dict__["_instances"]
    if isinstance(original, PerRankTable):  # (installed already: nested worlds)
        return lambda: None
    return replace(owner, "_instances",
                   PerRankTable(original, lambda cls: getattr(cls, "__name__", "") in _HYDRA_RUN_STATE))


#: one serial per simulated rank that made a mesh, never reused in this process (see _mesh_per_rank)
_MESH_SERIALS = itertools.count(1)


def _mesh_per_rank(module: Any) -> Any:
    """A DeviceMesh made on a simulated rank equals only its own rank's meshes (see the module's docstring)."""
    cls = module.DeviceMesh
    init, setstate = cls.__dict__["__init__"], cls.__dict__.get("__setstate__")
    if getattr(init, "_tp_per_rank", False):  # (installed already: nested worlds)
        return lambda: None

    # a rank (its root state: a rank's threads share its meshes, as a process's do) -> its serial; never an id(),
    # which a later world's rank may reuse: torch keeps tables keyed by meshes beyond the caches emptied below
    identities: dict[int, tuple[Any, int]] = {}
    lock = threading.Lock()  # (a rank's threads may make their first meshes at once)

    def mine(mesh: Any) -> None:
        rs = current_rank_state()
        if rs is not None:
            root = rs.parent or rs
            with lock:
                known = identities.get(id(root))
                if known is None or known[0] is not root:
                    known = identities[id(root)] = (root, next(_MESH_SERIALS))
            mesh._thread_id = -known[1]  # (negative: never a thread ident, which torch's threaded backend sets)
            mesh._hash = None  # (computed lazily from the identity above)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if getattr(self, "_thread_id", None) is None:  # (torch's threaded backend set its own)
            mine(self)

    def __setstate__(self: Any, state: dict) -> None:  # type: ignore[type-arg]
        setstate(self, state)
        mine(self)  # a mesh another rank sent equals this rank's, as in a process that unpickles it

    __init__._tp_per_rank = True  # type: ignore[attr-defined]
    cls.__init__ = __init__
    if setstate is not None:
        cls.__setstate__ = __setstate__

    def undo() -> None:
        cls.__init__ = init
        if setstate is not None:
            cls.__setstate__ = setstate
        identities.clear()
        _forget_mesh_caches()

    return undo


#: torch's process-wide caches keyed by meshes: (module, attribute path to an object with cache_clear() or clear())
_MESH_CACHES = (("torch.distributed.tensor._redistribute", "_gen_transform_infos"),
                ("torch.distributed.tensor._redistribute", "_planner_cache"),
                ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh"),
                ("torch.distributed.tensor._sharding_prop", "ShardingPropagator._propagate_tensor_meta_cached"))


def _forget_mesh_caches() -> None:
    """Empty the caches of :data:`_MESH_CACHES` of the modules a program imported: they hold the world's meshes
    (and through them its groups) and would hand a later world's ranks this world's plans."""
    import sys

    for name, path in _MESH_CACHES:
        obj = sys.modules.get(name)
        for part in path.split("."):
            obj = getattr(obj, part, None)
        clear = getattr(obj, "cache_clear", None) or getattr(obj, "clear", None)
        if clear is not None:
            clear()


#: (module, make its table per rank -> undo), each applied when the module is imported
def _numpy_seeded_at_import(module: Any) -> Any:
    """numpy's global generator, imported by a rank while the world runs, starts from that rank's seed (as a rank
    process's does, and as every other rank's does at its next turn), not from the OS entropy numpy seeds it with
    at import: the importing rank's draws are then a function of the run's seed too."""
    rs = current_rank_state()
    while rs is not None and rs.parent is not None:  # (a rank's threads share its generator)
        rs = rs.parent
    if rs is not None and rs.np_rng is None:
        _NP_RNG.load(rs)  # (made from the rank's numpy seed, then copied into the global generator)
    return lambda: None


TABLES = (("hydra.core.singleton", _hydra_singletons),
          ("torch.distributed.device_mesh", _mesh_per_rank),
          ("numpy.random", _numpy_seeded_at_import))

_undos: list[Any] = []

#: the packages whose module-level settings (plain values) a world puts back when it ends
_SETTINGS_PACKAGES = ("torch.distributed",)
_SCALARS = (bool, int, float, str, type(None))
_settings_names: tuple[int, list[tuple[Any, str]]] = (-1, [])  # (len(sys.modules), (module, name) pairs)
_settings: list[tuple[Any, str, Any]] = []


def _setting_names() -> list[tuple[Any, str]]:
    """The plain module-level values of :data:`_SETTINGS_PACKAGES` (scanned again only when modules came)."""
    import sys

    global _settings_names
    if _settings_names[0] != len(sys.modules):
        pairs = []
        for name, module in list(sys.modules.items()):
            if module is None or not any(name == p or name.startswith(p + ".") for p in _SETTINGS_PACKAGES):
                continue
            pairs.extend((module, k) for k, v in list(vars(module).items())
                         if type(v) in _SCALARS and not k.startswith("__"))
        _settings_names = (len(sys.modules), pairs)
    return _settings_names[1]


def _install() -> None:
    # torch's settings that a program flips in a `with` (use_min_cost_redistribution_plan sets a module global and
    # puts the old value back on exit): thread ranks entering and leaving in turn leave another rank's value behind,
    # and the next world (the next test of a suite) would start with it; a process's settings die with it
    _settings[:] = [(m, k, vars(m)[k]) for m, k in _setting_names() if k in vars(m)]
    _undos.extend(when_imported(name, apply) for name, apply in TABLES)


def _uninstall() -> None:
    while _undos:
        _undos.pop()()
    for module, name, value in _settings:
        if vars(module).get(name, value) is not value:
            setattr(module, name, value)
    _settings.clear()


_INSTALLATION = Installation(_install, _uninstall)


def enabled() -> ContextManager[None]:
    """While a world runs: the tables of :data:`TABLES` are one per rank."""
    return _INSTALLATION.enabled()
