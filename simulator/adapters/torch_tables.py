"""torch's process-wide tables, per simulated rank: patched when the modules that hold them are imported.

Part of the torch.distributed adapter (:mod:`simulator.adapters.torch_native` installs :data:`_ISOLATED` while a
world runs). A real process has one of each table per rank; rank threads would share one:

* FSDP1's profiler tables (:class:`_PerThreadTable`) and DTensor's custom op handlers: per rank thread;
* DDP's logging data names the backend the program named;
* torch's experimental ``_dist2`` gloo factory gives a simulated group;
* DCP's process-based ``async_save`` (one daemon per process) is refused on thread ranks with the fix.

Every private torch name these touch is listed in :mod:`simulator.adapters.torch_private`.
"""
from __future__ import annotations

import functools
import os
import threading
from collections import defaultdict
from datetime import timedelta
from typing import Any, Iterator

import torch.distributed.distributed_c10d as c10d

from tensorplay.distributed import state as dist_state
from tensorplay.distributed.errors import DistRuntimeError, format_message

from simulator.adapters._patch import replace
from simulator.adapters.process_group import SimProcessGroup
from simulator.adapters.torch_globals import _PerRankWorld, _ProcessGroupGloo, _sim_state

__all__ = ["ONE_CHECKPOINT_DAEMON"]


class _PerThreadTable:
    """Stands in for a process-global mutable table of torch's (a set or dict in a class attribute).

    A real process has one such table per rank; rank threads would share one,
    and torch code that keeps "in progress" bookkeeping there (FSDP1's
    ``SimpleProfiler.profiling`` around collectives of ``optim_state_dict``)
    then sees another rank's entries.  Each thread gets its own table, made by
    ``factory``; threads outside a simulated world use the original.
    """

    def __init__(self, original: Any, factory: Any) -> None:
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_factory", factory)
        object.__setattr__(self, "_local", threading.local())

    def _target(self) -> Any:
        if dist_state.current() is None:
            return self._original
        t = getattr(self._local, "table", None)
        if t is None:
            t = self._factory()
            self._local.table = t
        return t

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)

    def __contains__(self, key: Any) -> bool:
        return key in self._target()

    def __getitem__(self, key: Any) -> Any:
        return self._target()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._target()[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._target()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._target())

    def __len__(self) -> int:
        return len(self._target())

    def __bool__(self) -> bool:
        return bool(self._target())

    def __repr__(self) -> str:
        return repr(self._target())


def _isolate_fsdp1_profiler(module: Any) -> Any:
    """FSDP1's ``SimpleProfiler`` keeps "being profiled" in class-level tables: per thread while a world runs."""
    owner = module.SimpleProfiler
    saved = {attr: owner.__dict__[attr] for attr in ("profiling", "results")}
    owner.profiling = _PerThreadTable(saved["profiling"], set)
    owner.results = _PerThreadTable(saved["results"], lambda: defaultdict(float))

    def undo() -> None:
        for attr, original in saved.items():
            setattr(owner, attr, original)

    return undo


def _isolate_dtensor_op_handlers(module: Any) -> Any:
    """DTensor's custom op handlers (one process-wide table) per rank thread.

    ``loss_parallel()`` adds its handlers to ``DTensor._op_dispatcher._custom_op_handlers``
    on entry and pops them on exit: rank threads sharing one table pop each other's
    entries (``KeyError`` on the second exit) and run their loss outside the context
    while another rank has left it.  A property on the dispatcher class hands each
    rank thread its own copy of the table (torch's C++ dispatch reads the attribute
    on every call); other threads read the dispatcher's own table.
    """
    cls = module.OpDispatcher
    name = "_custom_op_handlers"
    local = threading.local()

    def tables() -> dict[int, dict[Any, Any]]:
        t = getattr(local, "tables", None)
        if t is None:
            t = local.tables = {}
        return t

    def get(self: Any) -> dict[Any, Any]:
        own = self.__dict__[name]
        if dist_state.current() is None:
            return own
        t = tables()
        if id(self) not in t:
            t[id(self)] = dict(own)
        return t[id(self)]

    def set_(self: Any, value: dict[Any, Any]) -> None:
        if dist_state.current() is None or name not in self.__dict__:
            self.__dict__[name] = value
        else:
            tables()[id(self)] = value

    return replace(cls, name, property(get, set_))


def _ddp_logging_names_the_backend(module: Any) -> Any:
    """DDP's logging data reports the backend the program named (``"gloo"``), as on a real run: its C++ logger
    reads the group's ``getBackendName()``, which is ``"sim"`` for torch's C++ side (see SimProcessGroup)."""
    cls = module.DistributedDataParallel
    original = cls.__dict__["_get_ddp_logging_data"]

    @functools.wraps(original)
    def _get_ddp_logging_data(self: Any) -> Any:
        data = original(self)
        pg = getattr(self, "process_group", None)
        if isinstance(pg, SimProcessGroup) and data.get("backend_name") == "sim":
            data["backend_name"] = named = pg._get_backend_name()
            if named == "gloo":  # what DDP's logger adds for a gloo group (its environment, its thread count)
                env = os.environ
                data.update(gloo_socket_ifname=env.get("GLOO_SOCKET_IFNAME", "N/A"),
                            gloo_device_transport=env.get("GLOO_DEVICE_TRANSPORT", "N/A"), gloo_num_threads=2)
        return data

    return replace(cls, "_get_ddp_logging_data", _get_ddp_logging_data)


def _dist2_gloo_groups(module: Any) -> Any:
    """torch's experimental ``_dist2.new_group("gloo", ...)`` builds a C++ ``ProcessGroup`` and registers a
    ``ProcessGroupGloo`` in it, which C++ takes only of torch's own classes: on a simulated rank its factory gives
    the simulated group ``ProcessGroupGloo(store, rank, size, timeout)`` stands for (a ``ProcessGroup`` itself,
    as the factory's callers expect). Returns the undo."""
    table = module._BACKENDS
    original = table["gloo"]

    def _gloo_factory(store: Any, rank: int, world_size: int, timeout: timedelta, device: Any,
                      **kwargs: object) -> Any:
        if _sim_state() is None or kwargs:  # (torch's factory refuses unexpected options with its own words)
            return original(store, rank, world_size, timeout, device, **kwargs)
        return _ProcessGroupGloo(store, rank, world_size, timeout=timeout)

    table["gloo"] = _gloo_factory

    def undo() -> None:
        table["gloo"] = original

    return undo


#: the words of the refusal below (the pytest switch runs a test that meets it again on rank processes)
ONE_CHECKPOINT_DAEMON = "the process-based async checkpointer keeps one background process per process"


def _one_checkpoint_daemon_per_process(module: Any) -> Any:
    """DCP's process-based ``async_save`` keeps its daemon (which saves for the rank, over a group of its own) in
    one module global: thread ranks would share one daemon, whose saves then wait for ranks that never send (a
    hang). On a thread rank it is refused with the fix; rank processes have their own. Returns the undo."""
    cls = module._ProcessBasedAsyncCheckpointExecutor
    original = cls.execute_save

    @functools.wraps(original)
    def execute_save(self: Any, *args: Any, **kwargs: Any) -> Any:
        st = _sim_state()
        if st is not None and isinstance(c10d._world, _PerRankWorld):  # (a rank process keeps torch's own world)
            raise DistRuntimeError(format_message(
                "torch.distributed.checkpoint.async_save", f"{ONE_CHECKPOINT_DAEMON} (a module global), and "
                "simulated thread ranks share this process", rank=st.rank,
                values={"async_checkpointer_type": "PROCESS"},
                fix="run the ranks as processes (python -m simulator --isolation process; simulator.run(..., "
                    "isolation='process'); --sim-harness process), or save with async_checkpointer_type="
                    "AsyncCheckpointerType.THREAD"))
        return original(self, *args, **kwargs)

    return replace(cls, "execute_save", execute_save)


#: torch's process-wide tables that code changes around collectives, and what it reports of the backend:
#: (module, isolate(module) -> undo)
_ISOLATED = (("torch.distributed.fsdp._debug_utils", _isolate_fsdp1_profiler),
             ("torch.distributed.tensor._dispatch", _isolate_dtensor_op_handlers),
             ("torch.nn.parallel.distributed", _ddp_logging_names_the_backend),
             ("torch.distributed._dist2", _dist2_gloo_groups),
             ("torch.distributed.checkpoint._async_process_executor", _one_checkpoint_daemon_per_process))
