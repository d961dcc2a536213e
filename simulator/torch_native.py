"""Run unmodified torch.distributed code (DDP, FSDP2, DTensor, functional collectives) on simulated ranks.

Inside a simulated world, ``torch.distributed.init_process_group("sim")`` (or
any backend name, with ``env://``) creates a torch ``ProcessGroup`` whose
collectives call tensorplay.distributed on the simulator.  torch keeps its
process-group bookkeeping in process-global state; simulated ranks are threads
of one process, so while a simulated world runs, this module gives every rank
thread its own copy of that state.

This is the one module that touches torch internals, all of them private and
liable to change between releases:

* ``torch.distributed.distributed_c10d._world`` (per-thread c10d state),
* ``torch._C._distributed_c10d._set_thread_isolation_mode`` (per-thread
  registry of group names, used by functional collectives),
* ``torch.distributed.rendezvous._rendezvous_handlers`` (an in-memory store
  instead of a TCP rendezvous),
* the Python ``ProcessGroup`` override names (``allreduce``,
  ``all_gather_single``, ``reduce_scatter_single``, ``all_to_all_single``...).

It is therefore pinned: :data:`SUPPORTED_TORCH` lists the versions it is tested
with, and :func:`check_torch_version` refuses others with a clear message.

Example (4 simulated ranks, plain torch code)::

    import torch, torch.distributed as tdist, simulator

    def body():
        tdist.init_process_group("sim")
        x = torch.ones(2) * tdist.get_rank()
        tdist.all_reduce(x)
        return x

    simulator.run(body, 4, torch_native=True)   # [tensor([6., 6.])] * 4
"""
from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Any, Iterator

import torch
import torch.distributed as tdist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import _create_work_from_future, _set_thread_isolation_mode

import tensorplay.distributed as tpd
from tensorplay.distributed import _state
from tensorplay.distributed.errors import DistRuntimeError, format_message
from tensorplay.distributed.group import ProcessGroup as TpGroup

# the package attribute of that name is the rendezvous() function; the module holds the handler table
tdist_rendezvous = importlib.import_module("torch.distributed.rendezvous")

__all__ = ["SUPPORTED_TORCH", "check_torch_version", "enabled", "SimProcessGroup"]

#: torch releases the adapter is tested with (major.minor)
SUPPORTED_TORCH = ("2.13", "2.14")


def check_torch_version(version: str | None = None) -> None:
    """Raise a clear error when the installed torch is not one the adapter supports."""
    v = version or torch.__version__
    if ".".join(v.split("+")[0].split(".")[:2]) not in SUPPORTED_TORCH:
        raise DistRuntimeError(format_message(
            "torch_native", "this torch release is not supported by the torch.distributed adapter",
            values={"torch": v, "supported": list(SUPPORTED_TORCH)},
            fix="install a supported torch (e.g. pip install torch==2.13.0), or use tensorplay.distributed "
                "directly, which needs no adapter"))


check_torch_version()


# ---------------------------------------------------------------------------
# the torch ProcessGroup that forwards to tensorplay.distributed
# ---------------------------------------------------------------------------
def _done(result: Any) -> Any:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _op(opts: Any) -> Any:
    op = opts.reduceOp
    return getattr(op, "op", op)  # torch's ReduceOp wraps a RedOpType; ours understands the latter


class SimProcessGroup(tdist.ProcessGroup):
    """A torch ProcessGroup whose collectives run on the simulator through tensorplay.distributed.

    Every call blocks until the simulated collective completed and returns an
    already-completed Work; the simulator's matching, deadlock detection and
    tracing apply to torch-native code as they do to tensorplay code.
    """

    def __init__(self, group: TpGroup) -> None:
        super().__init__(group.rank(), group.size())
        self._g = group

    def getBackendName(self) -> str:  # noqa: N802  (torch's name)
        return "sim"

    @property
    def group_name(self) -> str:
        # torch records the name it gave the group in the (per-rank) c10d state
        return c10d._world.pg_names[self]

    pg_name = group_name

    def __repr__(self) -> str:
        return f"SimProcessGroup(ranks={list(self._g.ranks)}, rank={self._g.rank()})"

    # -- collectives (torch passes group ranks in opts.rootRank) -------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        for t in tensors:
            tpd.all_reduce(t, op=_op(opts), group=self._g)
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        for t in tensors:
            tpd.broadcast(t, group=self._g, group_src=opts.rootRank)
        return _done(tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        for t in tensors:
            tpd.reduce(t, op=_op(opts), group=self._g, group_dst=opts.rootRank)
        return _done(tensors)

    def barrier(self, opts: Any = None) -> Any:
        tpd.barrier(group=self._g)
        return _done([])

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> Any:
        for outs, t in zip(output_tensors, input_tensors):
            tpd.all_gather(outs, t, group=self._g)
        return _done(output_tensors)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        tpd.all_gather_into_tensor(output, input, group=self._g)
        return _done([output])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        for o, i in zip(outputs, inputs):
            tpd.all_gather_into_tensor(o, i, group=self._g)
        return _done(outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> Any:
        is_root = self._g.rank() == opts.rootRank
        tpd.gather(input_tensors[0], output_tensors[0] if is_root else None, group=self._g,
                   group_dst=opts.rootRank)
        return _done(output_tensors)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> Any:
        is_root = self._g.rank() == opts.rootRank
        tpd.scatter(output_tensors[0], input_tensors[0] if is_root else None, group=self._g,
                    group_src=opts.rootRank)
        return _done(output_tensors)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> Any:
        for o, ins in zip(output_tensors, input_tensors):
            tpd.reduce_scatter(o, ins, op=_op(opts), group=self._g)
        return _done(output_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        tpd.reduce_scatter_tensor(output, input, op=_op(opts), group=self._g)
        return _done([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        for o, i in zip(outputs, inputs):
            tpd.reduce_scatter_tensor(o, i, op=_op(opts), group=self._g)
        return _done(outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> Any:
        tpd.all_to_all_single(output, input, list(output_split_sizes) or None, list(input_split_sizes) or None,
                              group=self._g)
        return _done([output])

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Any:
        tpd.all_to_all(output_tensors, input_tensors, group=self._g)
        return _done(output_tensors)

    # -- point to point ----------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        for t in tensors:
            tpd.send(t, group=self._g, group_dst=dst, tag=tag)
        return _done(tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        for t in tensors:
            tpd.recv(t, group=self._g, group_src=src, tag=tag)
        return _done(tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> Any:
        sender = tpd.recv(tensors[0], group=self._g, tag=tag)
        work = _SourceWork(self._g.group_rank(sender))
        return work


class _SourceWork:
    """An any-source receive that already happened; torch asks it for the sender's group rank."""

    def __init__(self, group_rank: int) -> None:
        self._src = group_rank
        self._work = _done([])

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def _source_rank(self) -> int:
        return self._src

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


# ---------------------------------------------------------------------------
# groups: the world, and member-only subgroups
# ---------------------------------------------------------------------------
def _tp_group_for(global_ranks: list[int]) -> TpGroup:
    st = _state.current()
    if st is None or st.backend.name != "sim":
        raise DistRuntimeError(format_message(
            "init_process_group", "the 'sim' torch backend runs only on simulated ranks",
            values={"backend": "sim"},
            fix="run the code under simulator.run(fn, world_size, torch_native=True) or `python -m simulator`"))
    ranks = tuple(sorted(global_ranks)) if global_ranks else tuple(range(st.world_size))
    if ranks == st.world.ranks:
        return st.world
    # torch calls the creator on member ranks only, so the group is made without the non-members
    handle = st.backend.member_group_handle(ranks)
    pg = TpGroup(ranks, st.backend, handle, group_id=len(st.groups) + 1)
    st.groups.append(pg)
    return pg


def _create(dist_backend_opts: Any, backend_options: Any) -> SimProcessGroup:
    return SimProcessGroup(_tp_group_for(list(dist_backend_opts.global_ranks_in_group)))


# ---------------------------------------------------------------------------
# per-thread c10d state while a simulated world runs
# ---------------------------------------------------------------------------
class _RankWorld(c10d._World):
    """One simulated rank's c10d bookkeeping.

    torch's ``_World`` keeps most of its tables in module globals, which the
    rank threads would share; here every table belongs to the instance.
    """

    def __init__(self) -> None:
        super().__init__()
        self._tables: dict[str, Any] = {
            "pg_map": {}, "pg_names": {}, "pg_group_ranks": {}, "pg_backend_config": {}, "tags_to_pg": {},
            "pg_to_tag": {},
        }
        self._count = 0

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


_lock = threading.Lock()
_active = 0
_saved: dict[str, Any] = {}
_stores: dict[int, Any] = {}


def _rendezvous_env(url: str, timeout: Any = None, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    st = _state.current()
    if st is None or st.backend.name != "sim":
        yield from _saved["env"](url, timeout=timeout, **kwargs) if timeout is not None else _saved["env"](url, **kwargs)
        return
    # one in-memory store per simulated world, shared by its rank threads
    key = id(st.backend.world_key())
    with _lock:
        store = _stores.setdefault(key, tdist.HashStore())
    yield store, st.rank, st.world_size


def _init_process_group(backend: Any = None, init_method: Any = None, *args: Any, **kwargs: Any) -> None:
    """torch's init_process_group; on a simulated rank, whatever backend a script names binds to the simulator."""
    st = _state.current()
    if st is not None and st.backend.name == "sim":
        backend = "sim"
        if kwargs.get("store") is None:
            init_method = "env://"  # the in-memory store, never a TCP rendezvous
    return _saved["init"](backend, init_method, *args, **kwargs)


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """While active, torch.distributed in simulated rank threads is per-rank and runs on the simulator."""
    global _active
    with _lock:
        if _active == 0:
            _saved["world"] = c10d._world
            _saved["env"] = tdist_rendezvous._rendezvous_handlers["env"]
            _saved["init"] = c10d.init_process_group
            c10d._world = _PerRankWorld(_saved["world"])
            tdist_rendezvous._rendezvous_handlers["env"] = _rendezvous_env
            c10d.init_process_group = tdist.init_process_group = _init_process_group
            _set_thread_isolation_mode(True)
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                c10d._world = _saved.pop("world")
                c10d.init_process_group = tdist.init_process_group = _saved.pop("init")
                tdist_rendezvous._rendezvous_handlers["env"] = _saved.pop("env")
                _set_thread_isolation_mode(False)
                _stores.clear()


@contextlib.contextmanager
def rank_thread() -> Iterator[None]:
    """Give the calling (simulated rank) thread fresh c10d state; tear it down afterwards."""
    world = c10d._world
    if not isinstance(world, _PerRankWorld):
        yield
        return
    world._local.world = _RankWorld()
    try:
        yield
    finally:
        try:
            if world._local.world.default_pg is not None:
                tdist.destroy_process_group()
        except Exception:  # noqa: BLE001  best effort: the thread's state is dropped below anyway
            pass
        world._local.world = None


tdist.Backend.register_backend("sim", _create, extended_api=True, devices=["cpu", "cuda"])
