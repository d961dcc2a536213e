"""Run unmodified torch.distributed code (DDP, FSDP2, DTensor, functional collectives) on simulated ranks.

Inside a simulated world, ``torch.distributed.init_process_group("sim")`` (or
any backend name torch knows, with ``env://``) creates a torch ``ProcessGroup`` whose
collectives call tensorplay.distributed on the simulator; a name torch refuses
(``"glo"``) is refused as torch refuses it.  torch keeps its
process-group bookkeeping in process-global state; simulated ranks are threads
of one process, so while a simulated world runs, this adapter gives every rank
thread its own copy of that state.

This module is the adapter's installation (:func:`enabled`, :func:`rank_thread`) and registers torch's
``"sim"`` backend; its parts are

* :mod:`simulator.adapters.process_group`: :class:`SimProcessGroup`, the torch ``ProcessGroup`` whose
  operations run on the simulator, and its creation;
* :mod:`simulator.adapters.process_group_work`: :class:`SimWork`, what its operations return, and how
  their errors reach the caller (as gloo's);
* :mod:`simulator.adapters.torch_globals`: torch's process-global state per rank thread (c10d's
  ``_world``, the rendezvous handlers, ``TCPStore``, the group builder, FSDP1's and DTensor's tables);
* :mod:`simulator.adapters.torch_groups`: default groups over some of the simulated ranks;
* :mod:`simulator.adapters.torch_profiling`: the profiler events a real backend records.

They touch torch internals, all of them private and liable to change between releases (c10d's
``_world``, ``_set_thread_isolation_mode``, ``_rendezvous_handlers``, ``_new_process_group_helper``, the
``ProcessGroup`` override names...), each listed in :mod:`simulator.adapters.torch_private`.  The adapter
is therefore pinned: :data:`SUPPORTED_TORCH` lists the versions it is tested with, and
:func:`check_torch_version` refuses others with a clear message.

Example (4 simulated ranks, plain torch code)::

    import torch, torch.distributed as tdist, simulator

    def body():
        tdist.init_process_group("sim")
        x = torch.ones(2) * tdist.get_rank()
        tdist.all_reduce(x)
        return x

    simulator.run(body, 4)   # [tensor([6., 6.])] * 4
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
from datetime import timedelta
from typing import Any, ContextManager, Iterator

import torch.distributed as tdist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import _set_thread_isolation_mode

from simulator.adapters import pg_wrapper, process_group_work, torch_groups
from simulator.adapters._patch import Installation
from simulator.adapters.threads import adopt_c10d, store_poll
from simulator.adapters.after_import import when_imported as _when_imported
from simulator.adapters.process_group import SimProcessGroup, _create
from simulator.adapters.process_group_work import SimWork
from simulator.adapters.torch_tables import _ISOLATED
from simulator.adapters.torch_globals import (_SCHEMES, _NameTable, _PerRankWorld, _ProcessGroupGloo,
                                              _RankWorld, _TCPStore,
                                              _is_barrier_after_init, _new_process_group_helper, _rendezvous_handler,
                                              WorldStore, _saved, _set_debug_level_from_env, _store_wait, _stores,
                                              rendezvous_files)
from simulator.adapters.torch_private import SUPPORTED_TORCH, check_torch_version
from simulator.core.state import current_rank_state

# the package attribute of that name is the rendezvous() function; the module holds the handler table
tdist_rendezvous = importlib.import_module("torch.distributed.rendezvous")

#: where a thread rank keeps its c10d state in ``RankState.own()``
_WORLD_KEY = (0, "c10d_world")

__all__ = ["SUPPORTED_TORCH", "check_torch_version", "enabled", "as_rank", "SimProcessGroup", "SimWork"]


def _install() -> None:
    _saved["world"] = c10d._world
    _saved["rdzv"] = {s: tdist_rendezvous._rendezvous_handlers[s] for s in _SCHEMES
                      if s in tdist_rendezvous._rendezvous_handlers}
    _saved["helper"] = c10d._new_process_group_helper
    _saved["barrier_after_init"] = c10d._is_barrier_after_init
    _saved["excepthook"] = sys.excepthook
    _saved["TCPStore"] = tdist.TCPStore
    c10d._world = _PerRankWorld(_saved["world"])
    # the process-wide name table too (process isolation uses torch's own _World): see SimProcessGroup.group_name
    _saved["pg_names"] = c10d._pg_names
    c10d._pg_names = _NameTable(c10d._pg_names)
    for s in _saved["rdzv"]:
        tdist_rendezvous._rendezvous_handlers[s] = _rendezvous_handler(s)
    c10d._new_process_group_helper = _new_process_group_helper
    c10d._is_barrier_after_init = _is_barrier_after_init
    tdist.TCPStore = _TCPStore  # type: ignore[misc]
    _saved["ProcessGroupGloo"] = tdist.ProcessGroupGloo
    tdist.ProcessGroupGloo = _ProcessGroupGloo  # type: ignore[misc]
    _saved["set_debug_level_from_env"] = tdist.set_debug_level_from_env
    _saved["debug_level"] = tdist.get_debug_level()  # (process-wide: a rank's TORCH_DISTRIBUTED_DEBUG ends with it)
    tdist.set_debug_level_from_env = _set_debug_level_from_env
    pg_wrapper.ORIGINAL["pg_wrapper"] = c10d._create_process_group_wrapper
    # (torch.distributed re-exports it: a program or a test calling it itself reaches that name)
    c10d._create_process_group_wrapper = tdist._create_process_group_wrapper = pg_wrapper.create_process_group_wrapper
    _saved["store_waits"] = {name: getattr(tdist.Store, name) for name in ("get", "wait")}
    for name in _saved["store_waits"]:
        setattr(tdist.Store, name, _store_wait(name))
    _saved["store_polls"] = {name: getattr(tdist.Store, name) for name in ("add", "check", "compare_set")}
    for name, original in _saved["store_polls"].items():
        setattr(tdist.Store, name, store_poll(name, original))
    # a CPU build of torch has no NCCL default timeout (None), and init_process_group("nccl") warns for it: NCCL's own
    # default (10 minutes) while the simulator binds "nccl" to its world
    _saved["nccl_timeout"] = getattr(c10d, "default_pg_nccl_timeout", None)
    if _saved["nccl_timeout"] is None:
        c10d.default_pg_nccl_timeout = timedelta(minutes=10)
    _saved["isolated"] = [_when_imported(name, isolate) for name, isolate in _ISOLATED]
    _set_thread_isolation_mode(True)


def _uninstall() -> None:
    # tolerates a partial installation (what was saved is put back)
    for attr, key in (("_world", "world"), ("_new_process_group_helper", "helper"),
                      ("_is_barrier_after_init", "barrier_after_init")):
        if key in _saved:
            setattr(c10d, attr, _saved.pop(key))
    if "pg_names" in _saved:
        names = c10d._pg_names
        c10d._pg_names = _saved.pop("pg_names")
        c10d._pg_names.update(names)  # (groups named while installed, outside simulated ranks, stay named)
    if "rdzv" in _saved:
        tdist_rendezvous._rendezvous_handlers.update(_saved.pop("rdzv"))
    if "excepthook" in _saved:
        sys.excepthook = _saved.pop("excepthook")
    if "TCPStore" in _saved:
        tdist.TCPStore = _saved.pop("TCPStore")  # type: ignore[misc]
    if "ProcessGroupGloo" in _saved:
        tdist.ProcessGroupGloo = _saved.pop("ProcessGroupGloo")  # type: ignore[misc]
    if "set_debug_level_from_env" in _saved:
        tdist.set_debug_level_from_env = _saved.pop("set_debug_level_from_env")
    if "debug_level" in _saved:
        tdist.set_debug_level(_saved.pop("debug_level"))
    if "pg_wrapper" in pg_wrapper.ORIGINAL:
        c10d._create_process_group_wrapper = tdist._create_process_group_wrapper = pg_wrapper.ORIGINAL.pop("pg_wrapper")
    for name, original in {**_saved.pop("store_waits", {}), **_saved.pop("store_polls", {})}.items():
        setattr(tdist.Store, name, original)
    if "nccl_timeout" in _saved:
        c10d.default_pg_nccl_timeout = _saved.pop("nccl_timeout")
    for undo in reversed(_saved.pop("isolated", [])):
        undo()
    _set_thread_isolation_mode(False)
    process_group_work.forget_unwaited()
    _stores.clear()
    torch_groups.reset()
    for path in rendezvous_files:
        try:
            if os.path.getsize(path) == 0:  # (a file the program filled is not the rendezvous's to remove)
                os.remove(path)
        except OSError:
            pass
    rendezvous_files.clear()


_INSTALLATION = Installation(_install, _uninstall)


def enabled() -> ContextManager[None]:
    """While active, torch.distributed in simulated rank threads is per-rank and runs on the simulator."""
    return _INSTALLATION.enabled()


def rank_process(world_key: Any, host: str, port: int, world_size: int, timeout: timedelta) -> None:
    """In a rank process (one rank per process), inside :func:`enabled`: torch's own process-wide c10d state is
    this rank's (threads the program starts see it), and the ranks' processes serve each other over a real
    ``TCPStore`` at ``host:port``, the rendezvous store of the world ``world_key``."""
    c10d._world = _saved["world"]
    _set_thread_isolation_mode(False)
    # (the program's own TCPStores are real ones too: see _TCPStore)
    _stores[id(world_key)] = WorldStore(lambda: _saved["TCPStore"](host, port, world_size, False, timeout,
                                                                   wait_for_workers=False))


@contextlib.contextmanager
def rank_thread() -> Iterator[None]:
    """Give the calling (simulated rank) thread fresh c10d state; tear it down afterwards."""
    world = c10d._world
    if not isinstance(world, _PerRankWorld):
        yield
        return
    mine = world._local.world = _RankWorld()
    rs = current_rank_state()
    if rs is not None:  # the rank's threads started by others (its RPC handlers) find it here: see as_rank
        rs.own()[_WORLD_KEY] = mine
    try:
        yield
    finally:
        try:
            if world._local.world.default_pg is not None:
                tdist.destroy_process_group()
        except Exception:  # noqa: BLE001  best effort: the thread's state is dropped below anyway
            pass
        world._local.world = None
        if rs is not None:
            rs.own().pop(_WORLD_KEY, None)


@contextlib.contextmanager
def as_rank(rs: Any) -> Iterator[None]:
    """Run the block with ``rs``'s rank's c10d state (its default group, its groups' names) on the calling
    thread: an RPC handler of a thread rank is started by the caller, yet runs in the callee as a thread of
    the callee's process would, so DDP or a collective inside it uses the callee's groups."""
    world = c10d._world
    mine = rs.own().get(_WORLD_KEY) if isinstance(world, _PerRankWorld) and rs is not None else None
    prev = getattr(world._local, "world", None) if mine is not None else None
    if mine is None or mine is prev:
        yield
        return
    adopt_c10d(mine)
    try:
        yield
    finally:
        world._local.world = prev


tdist.Backend.register_backend("sim", _create, extended_api=True, devices=["cpu", "cuda"])
