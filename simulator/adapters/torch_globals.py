"""torch's process-global state, per simulated rank: c10d's bookkeeping, rendezvous, stores, shared tables.

Part of the torch.distributed adapter (:mod:`simulator.adapters.torch_native`, which installs these while a
world runs).  torch keeps its process-group bookkeeping in process-global state; simulated ranks are threads of
one process, so each rank thread gets its own:

* c10d's ``_world`` (:class:`_PerRankWorld` hands each rank thread its :class:`_RankWorld`) and the group
  name table (:class:`_NameTable`);
* the rendezvous (:func:`_rendezvous_handler`: an in-memory store per world, or a rendezvous of a group over
  some of the simulated ranks, :mod:`simulator.adapters.torch_groups`), ``TCPStore`` (:class:`_TCPStore`)
  and torch's one group builder (:func:`_new_process_group_helper`: every backend is the simulator);
* ``ProcessGroupGloo`` built by the program itself (:class:`_ProcessGroupGloo`);
* process-wide tables torch code changes around collectives, and the like, are in
  :mod:`simulator.adapters.torch_tables` (patched when their modules are imported).

Every private torch name these touch is listed in :mod:`simulator.adapters.torch_private`.
"""
from __future__ import annotations

import importlib
import os
import sys
import threading
from datetime import timedelta
from typing import Any, Callable, Iterator
from urllib.parse import urlparse

import torch.distributed as tdist
import torch.distributed.distributed_c10d as c10d

from tensorplay.distributed import state as dist_state
from tensorplay.distributed.validation import backend_name_refusal
from tensorplay.distributed.errors import DistRuntimeError, format_message

from simulator.adapters import pg_wrapper, started_processes, torch_groups
from simulator.adapters.process_group import SimProcessGroup, _tls, direct_group
from simulator.adapters.torch_private import check_torch_version
from simulator.core._actor import current_rank_state
from simulator.core.actors import sleep_in, sleep_out
from simulator.core.backend import SimBackend

check_torch_version()  # (refuses an unsupported torch before its classes are subclassed below)

# the package attribute of that name is the rendezvous() function; the module holds the handler table
tdist_rendezvous = importlib.import_module("torch.distributed.rendezvous")


# ---------------------------------------------------------------------------
# c10d's bookkeeping, one per rank thread
# ---------------------------------------------------------------------------
class _NameTable(dict):
    """torch's group -> name table; a simulated group also keeps its name, for torch's lookups after removal."""

    def __setitem__(self, pg: Any, name: Any) -> None:
        if isinstance(pg, SimProcessGroup):
            pg.__dict__["_tp_name"] = name
        super().__setitem__(pg, name)


class _RankTable(dict):
    """torch's group -> {global rank: group rank} table.  ``init_process_group`` sets the default group's entry to
    ``{i: i for i in range(world_size)}`` on every rank: one dict of W entries per rank, O(W^2) memory in all
    (1.2 GiB at 4096 ranks).  An entry equal to that identity map is replaced by one map shared by the ranks
    (torch only assigns and reads these maps, never changes them in place)."""

    _shared: dict[int, dict[int, int]] = {}  # world size -> {i: i}

    def __setitem__(self, pg: Any, ranks: Any) -> None:
        n = len(ranks) if type(ranks) is dict else 0
        if n >= 64:
            shared = self._shared.get(n) or self._shared.setdefault(n, {i: i for i in range(n)})
            if ranks == shared:  # (a C-level comparison; no copy)
                ranks = shared
        super().__setitem__(pg, ranks)


class _RankWorld(c10d._World):
    """One simulated rank's c10d bookkeeping.

    torch's ``_World`` keeps most of its tables in module globals, which the
    rank threads would share; here every table belongs to the instance.
    """

    def __init__(self) -> None:
        super().__init__()
        self._tables: dict[str, Any] = {
            "pg_map": {}, "pg_names": _NameTable(), "pg_group_ranks": _RankTable(), "pg_backend_config": {}, "tags_to_pg": {},
            "pg_to_tag": {},
        }
        self._count = 0
        self.sim_members: tuple[int, ...] | None = None  # the default group's simulated ranks, when not the world

    pg_map = property(lambda self: self._tables["pg_map"])
    pg_names = property(lambda self: self._tables["pg_names"])
    pg_group_ranks = property(lambda self: self._tables["pg_group_ranks"])
    pg_backend_config = property(lambda self: self._tables["pg_backend_config"])
    tags_to_pg = property(lambda self: self._tables["tags_to_pg"])
    pg_to_tag = property(lambda self: self._tables["pg_to_tag"])

    @property
    def group_count(self) -> int:
        return self._count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._count = value


class _PerRankWorld:
    """Stands in for c10d's ``_world``: each simulated rank thread sees its own; other threads the original."""

    def __init__(self, original: Any) -> None:
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_local", threading.local())

    def _target(self) -> Any:
        w = getattr(self._local, "world", None)
        return self._original if w is None else w

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target(), name, value)


# ---------------------------------------------------------------------------
# rendezvous, stores and the group builder on simulated ranks
# ---------------------------------------------------------------------------
_lock = threading.Lock()
#: what the installation replaced (torch_native's _install): the stand-ins fall back to it off simulated ranks
_saved: dict[str, Any] = {}
_stores: dict[Any, Any] = {}  # world -> rendezvous store; (world, host, port) -> TCPStore stand-in
#: the files of file:// rendezvous (torch's FileStore removes its file when its last user ends: thread ranks never
#: open it, so the file, left empty, is removed when the adapter is uninstalled; rank processes open a FileStore)
rendezvous_files: set[str] = set()
_SCHEMES = ("env", "tcp", "file")


def _sim_state() -> Any:
    """The calling simulated rank's tensorplay state, or ``None`` outside a simulated world."""
    st = dist_state.current()
    return st if st is not None and isinstance(st.backend, SimBackend) else None


def _mismatch(call: str, what: str, given: int, st: Any, env: str | None = None) -> DistRuntimeError:
    # (a RuntimeError, as gloo's refusal of a rank outside the world, or its store's timeout where sizes disagree)
    actual = st.rank if what == "rank" else st.world_size
    source = f" (its environment's {env}, which the launcher set to {actual} and the program changed)" if env else ""
    return DistRuntimeError(format_message(
        call, f"the program asks for {what}={given}{source}, but this simulated rank has {what}={actual}",
        values={what: given, f"simulated_{what}": actual, "simulated_rank": st.rank,
                "simulated_world_size": st.world_size},
        fix=f"start as many simulated ranks as the program expects (python -m simulator --nproc-per-node "
            f"{given if what == 'world_size' else 'N'} script.py; for a script that starts its own ranks, "
            f"nprocs=N or N Process objects), or let the program read its rank and world size from the "
            "environment (RANK, WORLD_SIZE) as torchrun sets them"))


def _env_int(name: str, default: int) -> int:
    """An integer the rank's environment holds (``-1``-style ``default`` when unset or not a number: torch's own
    handler then reports it)."""
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return default


def _rendezvous_handler(scheme: str) -> Any:
    def handler(url: str, timeout: Any = None, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        st = _sim_state()
        if st is None:
            original = _saved["rdzv"][scheme]
            yield from original(url, **kwargs) if timeout is None else original(url, timeout=timeout, **kwargs)
            return
        # explicit rank/world_size (init_process_group(rank=..., world_size=...) or the URL) must be this rank's,
        # or claim a rank of a smaller group over some of the simulated ranks (torch_groups)
        parsed = urlparse(url)
        if parsed.scheme == "file" and parsed.path:
            rendezvous_files.add(parsed.path)
        query = tdist_rendezvous._query_to_dict(parsed.query)
        torch_groups.check_url(scheme, parsed, query)
        if scheme == "env" and started_processes.started_by_the_program():
            started_processes.require_env(url, query, _saved["rdzv"]["env"], kwargs)
        size = int(query.get("world_size", -1))
        rank = int(query.get("rank", -1))
        if scheme == "env":  # torch's env:// reads what the URL lacks from the environment, the program's changes too
            rank = rank if "rank" in query else _env_int("RANK", rank)
            size = size if "world_size" in query else _env_int("WORLD_SIZE", size)
        key = id(st.backend.world_key())
        # a rank process is a process: its file rendezvous is torch's FileStore on that file, as on gloo (a
        # FileStore's operations interleave where the run's TCPStore client serialises them: torch's dynamic
        # RPC waits on a key in one thread while its handler reads the store in another)
        on_file = parsed.scheme == "file" and bool(parsed.path) and _in_rank_process(key)
        if size != -1 and size < st.world_size and rank != -1:
            where = torch_groups.rendezvous_key(url)
            _tls.rendezvous = where  # the helper joins the group's members there
            yield tdist.FileStore(parsed.path, size) if on_file else _rendezvous_store(key, where), rank, size
        else:
            for what, given, var in (("rank", rank, "RANK"), ("world_size", size, "WORLD_SIZE")):
                if given != -1 and given != (st.rank if what == "rank" else st.world_size):
                    from_env = scheme == "env" and what not in query
                    raise _mismatch("init_process_group", what, given, st, var if from_env else None)
            if on_file:
                store = tdist.FileStore(parsed.path, st.world_size)
            else:
                # one in-memory store per simulated world, shared by its rank threads; never a socket or a file
                with _lock:
                    store = _connected(_stores.setdefault(key, tdist.HashStore()))
            yield store, st.rank, st.world_size
        raise DistRuntimeError(format_message(
            "init_process_group", "a simulated rank cannot re-rendezvous", values={"init_method": url},
            fix="destroy the process group and call init_process_group again"))

    handler.__name__ = f"_sim_{scheme}_rendezvous_handler"
    return handler


class WorldStore:
    """A rank process's client of the run's real ``TCPStore``, connected when the program first needs it.

    Most programs never do (their groups live on the simulator), and each connection costs a socket and, in
    torch, a reverse lookup of the server's address: on a machine whose DNS answers slowly that stalls the rank's
    start by seconds (glibc's ``getnameinfo`` of ``::ffff:127.0.0.1``, seen at 5 s)."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self._connect = connect
        self._store: Any = None

    def store(self) -> Any:
        if self._store is None:
            self._store = self._connect()
        return self._store


def _connected(store: Any) -> Any:
    """``store``, or the TCPStore client a :class:`WorldStore` stands for (connected now, at its first use)."""
    return store.store() if isinstance(store, WorldStore) else store


def _in_rank_process(key: int) -> bool:
    """The world ``key`` is served by the run's real TCPStore: this is a rank process (torch_native.rank_process)."""
    world = _stores.get(key)
    return world is not None and not isinstance(world, tdist.HashStore)


def _rendezvous_store(key: int, where: Any) -> Any:
    """The store of one subset rendezvous: two groups never see each other's keys; its members share it."""
    with _lock:
        store = _stores.get((key, "rendezvous", where))
        if store is None:
            # rank processes share the run's real TCPStore (torch_native.rank_process); rank threads a HashStore
            store = (tdist.PrefixStore(f"tensorplay-rendezvous/{where!r}", _connected(_stores[key]))
                     if _in_rank_process(key) else tdist.HashStore())
            _stores[(key, "rendezvous", where)] = store
        return store


class _StoreClassMeta(type):
    """``isinstance(x, torch.distributed.TCPStore)`` stays true for real TCP stores while the stand-in is installed."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _saved.get("TCPStore", tdist.TCPStore)) or obj in _sim_tcp_stores()

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _saved.get("TCPStore", tdist.TCPStore))

    def __getattr__(cls, name: str) -> Any:
        return getattr(_saved.get("TCPStore", tdist.TCPStore), name)


def _sim_tcp_stores() -> list[Any]:
    return [v for k, v in list(_stores.items()) if isinstance(k, tuple) and k[1] != "rendezvous"]


class _TCPStore(metaclass=_StoreClassMeta):
    """Stands in for ``torch.distributed.TCPStore`` while a simulated world runs.

    On a rank thread, ``TCPStore(host, port, world_size, is_master, ...)``
    returns the world's in-memory store for that address: rank threads cannot
    serve each other over sockets (the master would wait in C++ for workers the
    simulator never gets to run).  Rank processes serve each other over a real
    ``TCPStore``, as processes do; in coop mode its construction (the master's
    wait for its workers, a worker's for its master) steps out of the schedule.
    Elsewhere it is the real ``TCPStore``.
    """

    def __new__(cls, host_name: str = "", port: int = 0, *args: Any, **kwargs: Any) -> Any:
        st = _sim_state()
        if st is None or _in_rank_process(id(st.backend.world_key())):
            if wait_in_os is None:  # not a coop rank process
                return _saved["TCPStore"](host_name, port, *args, **kwargs)
            frame = sys._getframe(1)
            return wait_in_os(f"TCPStore({host_name!r}, {port}) waiting for its peers",
                              f"{frame.f_code.co_filename}:{frame.f_lineno}",
                              lambda: _saved["TCPStore"](host_name, port, *args, **kwargs))
        key = (id(st.backend.world_key()), str(host_name), int(port))
        with _lock:
            return _stores.setdefault(key, tdist.HashStore())  # type: ignore[arg-type]


class _GlooClassMeta(type):
    """The stand-in answers for torch's class: its attributes (``_Options``, ``create_device``), ``isinstance``
    (torch's gloo backends, and simulated groups that report gloo) and ``issubclass``."""

    def __getattr__(cls, name: str) -> Any:
        return getattr(c10d.ProcessGroupGloo, name)  # (distributed_c10d keeps torch's own class)

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, c10d.ProcessGroupGloo) or (isinstance(obj, SimProcessGroup) and obj._named == "gloo")

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, c10d.ProcessGroupGloo)


class _ProcessGroupGloo(metaclass=_GlooClassMeta):
    """Stands in for ``torch.distributed.ProcessGroupGloo`` while a simulated world runs.

    A program (PyTorch's ``test_c10d_gloo.py``, a library holding a bare backend) may build a gloo group
    itself: ``ProcessGroupGloo(store, rank, size, options)`` or ``(..., timeout=...)``.  On a simulated rank
    that is a simulated group reporting gloo, a communicator of its own: over the whole world when ``size`` is
    its size (or the launched world's, from inside a default group over some ranks) and each rank gives its own
    rank, else over the simulated ranks that claim ``rank`` of ``size``
    on the same store (:func:`torch_groups.join`, as ``init_process_group(store=...)`` over some ranks).  Its
    ``options`` are the ones given.  Off simulated ranks it is torch's own class.
    """

    def __new__(cls, store: Any, rank: int, size: int, options: Any = None, *, timeout: Any = None) -> Any:
        real = c10d.ProcessGroupGloo
        st = _sim_state()
        if isinstance(options, timedelta):  # the overload (store, rank, size, timeout)
            options, timeout = None, options
        if st is None:
            if options is not None:
                return real(store, rank, size, options)
            return real(store, rank, size) if timeout is None else real(store, rank, size, timeout=timeout)
        if options is None:
            options = real._Options()
            options._timeout = timeout if timeout is not None else c10d.default_pg_timeout
        rank, size = int(rank), int(size)
        inner = getattr(c10d._world, "sim_members", None)  # inside a default group over some simulated ranks
        ranks = tuple(inner) if inner is not None else tuple(range(st.world_size))
        if size == len(ranks) and 0 <= rank < size and ranks[rank] == st.rank:
            return direct_group(ranks, options)
        if size == st.world_size and rank == st.rank:  # the launched world, as the ranks outside that group see it
            return direct_group(tuple(range(size)), options)  # (torch's RPC agent's group, in ddp_rpc's trainers)
        if size > st.world_size:
            raise _mismatch("torch.distributed.ProcessGroupGloo", "world_size", size, st)
        members = torch_groups.join(st.backend.world_key(), ("ProcessGroupGloo", torch_groups.store_key(store)),
                                    rank, size, st.rank, st.world_size)
        return direct_group(members, options)


#: set in a coop rank process (isolation.rank_threads): (what, site, call) -> call's result, stepping the main
#: thread out of the schedule around a wait in the OS
wait_in_os: Any = None


def _store_wait(name: str) -> Any:
    """``Store.get``/``Store.wait`` on simulated ranks: a key no rank has set yet is a wait in C++ the scheduler
    cannot see; in coop mode the rank steps out of the schedule for it (as for ``time.sleep``), so the rank that
    will set the key gets to run.  The run is then marked as not a pure function of its seed.  A key already
    there is read at once, in the schedule."""
    original = getattr(tdist.Store, name)

    def call(self: Any, keys: Any, *args: Any, **kwargs: Any) -> Any:
        rs = current_rank_state()
        if rs is None and wait_in_os is None:
            return original(self, keys, *args, **kwargs)
        wanted = [keys] if isinstance(keys, str) else list(keys)
        try:
            ready = bool(self.check(wanted))
        except Exception:  # noqa: BLE001  a store without check(): wait as torch does
            ready = False
        if ready:
            return original(self, keys, *args, **kwargs)
        frame = sys._getframe(1)
        site = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        what = f"Store.{name}({wanted!r}) before any rank set it"
        if rs is None:  # a rank process: its main thread asks the coordinator
            return wait_in_os(what, site, lambda: original(self, keys, *args, **kwargs))
        if not sleep_out(rs, 1.0, site, what=what):
            return original(self, keys, *args, **kwargs)
        try:
            return original(self, keys, *args, **kwargs)
        finally:
            sleep_in(rs)

    call.__name__ = name
    call.__qualname__ = f"Store.{name}"
    return call


def _set_debug_level_from_env() -> None:
    """``set_debug_level_from_env`` reads the C environment, which rank threads share; a simulated rank's
    ``TORCH_DISTRIBUTED_DEBUG`` is its own ``os.environ``'s (the level itself stays torch's, process-wide)."""
    if _sim_state() is None:
        return _saved["set_debug_level_from_env"]()
    value = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "OFF")
    level = value.upper()
    if level not in ("OFF", "INFO", "DETAIL"):
        raise ValueError(format_message(
            "torch.distributed.set_debug_level_from_env", f"The value of TORCH_DISTRIBUTED_DEBUG must be OFF, INFO, "
            f"or DETAIL, but got {value}", values={"TORCH_DISTRIBUTED_DEBUG": value},
            fix="set TORCH_DISTRIBUTED_DEBUG to OFF, INFO or DETAIL"))
    tdist.set_debug_level(getattr(tdist.DebugLevel, level))


def _programs_own(backend: Any) -> bool:
    """A backend torch builds itself on a simulated rank too: ``"fake"``, and every backend a program (or a test
    harness) registered with ``Backend.register_backend`` (a Python process group of its own, like PyTorch's
    tests' ``DummyProcessGroup`` or the ``"threaded"`` one): its behaviour is the program's, not a network's."""
    names = [p.split(":", 1)[-1] for p in str(backend).lower().replace(" ", "").split(",") if p]
    plugins = {k.lower() for k in getattr(tdist.Backend, "_plugins", {})} - {"sim"}
    return bool(names) and all(n == "fake" or n in plugins for n in names)


def _new_process_group_helper(group_size: int, group_rank: int, global_ranks_in_group: list[int], backend: Any,
                              store: Any, group_name: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's one place that builds a group's backend; on a simulated rank every backend is the simulator.

    ``init_process_group``, ``new_group``, ``init_device_mesh`` and friends look
    this module global up at call time, so no import style escapes it.
    """
    original = _saved["helper"]
    st = _sim_state()
    if st is None or _programs_own(backend):
        # ("fake": torch's process-local group for tracing, every process its own world over a FakeStore, nothing
        # communicated: torch's own, on a simulated rank too; likewise a backend the program registered itself)
        return original(group_size, group_rank, global_ranks_in_group, backend, store, group_name, *args, **kwargs)
    if group_size == 0 and group_rank is None:  # new_group(ranks=[]): torch's ProcessGroup(store, None, 0) refuses it
        raise TypeError(format_message(
            "torch.distributed.new_group", "ranks is empty: a process group needs at least one member", rank=st.rank,
            values={"ranks": list(global_ranks_in_group)},
            fix="pass the global ranks of the group's members, or ranks=None for a group of every rank"))
    default = len(global_ranks_in_group) == 0
    members = None
    if default:
        where, _tls.rendezvous = getattr(_tls, "rendezvous", None), None
        if group_size != -1 and group_size < st.world_size and group_rank != -1:
            # a group over some of the simulated ranks: its members are whoever claims its ranks at this rendezvous
            if where is None:  # init_process_group(store=...): the store is the rendezvous
                where = torch_groups.store_key(store)
            members = torch_groups.join(st.backend.world_key(), where, group_rank, group_size, st.rank,
                                        st.world_size)
        else:
            if group_size not in (-1, st.world_size):
                raise _mismatch("init_process_group", "world_size", group_size, st)
            if group_rank not in (-1, st.rank):
                raise _mismatch("init_process_group", "rank", group_rank, st)
            group_size, group_rank = st.world_size, st.rank
        # torch wraps sys.excepthook with a "[rank<r>]" prefixer; rank threads would nest them
        _tls.excepthook = sys.excepthook
        if "TORCH_DISTRIBUTED_DEBUG" in os.environ:  # what a rank process's import of torch.distributed reads
            _set_debug_level_from_env()
    torch_rank = _torch_rank(st.rank)
    if default or torch_rank in global_ranks_in_group:  # (torch sends a non-member away before it reads the name)
        # every name becomes the simulator below: first refuse, as torch's helper would, a name torch does not know
        refusal = backend_name_refusal(f"torch.distributed.{'init_process_group' if default else 'new_group'}",
                                        backend)
        if refusal is not None:
            raise refusal
    named = tdist.Backend(str(backend)) if backend is not None else tdist.Backend("undefined")
    if len(args) >= 1:  # backend_options: options of the real backend mean nothing to the simulator
        args = (None,) + tuple(args[1:])
    kwargs.pop("backend_options", None)
    _tls.named = str(named)
    _tls.members = members
    try:
        pg, prefix_store = original(group_size, group_rank, global_ranks_in_group, "sim", store, group_name,
                                    *args, **kwargs)
    finally:
        _tls.named = _tls.members = None
    if default:
        c10d._world.sim_members = members  # torch's ranks -> simulated ranks, for the groups made inside it
    if isinstance(pg, SimProcessGroup):
        device_id = kwargs.get("device_id", args[3] if len(args) > 3 else None)
        if device_id is not None and pg.bound_device_id is None:  # (torch bound the group it built, not ours)
            pg.bound_device_id = device_id
        if tdist.get_debug_level() == tdist.DebugLevel.DETAIL and (
                str(named).split(":")[-1] in ("gloo", "nccl", "xccl", "ucc", "undefined")):
            pg_wrapper.wrap(pg, pg.options._timeout)  # torch wraps these groups at DETAIL (ProcessGroupWrapper)
        # what a real run records: the backend the program named, and its configuration
        world = c10d._world
        world.pg_map[pg] = (named, world.pg_map[pg][1])
        try:
            world.pg_backend_config[pg] = str(c10d.BackendConfig(named))
        except Exception:  # noqa: BLE001  a name torch cannot configure: keep torch's record
            pass
    return pg, prefix_store


def _torch_rank(sim_rank: int) -> int:
    """This simulated rank's rank in torch's default group (they differ inside a group over some ranks)."""
    inner = getattr(c10d._world, "sim_members", None)
    return sim_rank if inner is None or sim_rank not in inner else inner.index(sim_rank)


def _is_barrier_after_init() -> int:
    """Runs right after init_process_group installed its excepthook: a simulated rank puts the old one back."""
    hook = getattr(_tls, "excepthook", None)
    if hook is not None and _sim_state() is not None:
        _tls.excepthook = None
        if getattr(sys.excepthook, "__name__", "") == "_distributed_excepthook":
            sys.excepthook = hook
    return _saved["barrier_after_init"]()
