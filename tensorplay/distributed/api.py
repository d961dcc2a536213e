"""Process groups and blocking/async collectives with torch.distributed's signatures.

Every function here does the same three things, in order:

1. resolve the group and check the caller is initialised and a member;
2. validate every argument on this rank (types, devices, list lengths, split
   sizes, dtype/op, src/dst membership) and raise a :class:`DistError` naming
   the collective, the group, the rank and the offending values *before*
   anything is sent;
3. convert global ``src``/``dst`` to group ranks and hand the call to the
   group's backend.

Backends therefore see only group ranks and well-formed arguments.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch

from . import _state
from . import spec as _spec
from .backends import ChainedWork, Work, get_backend_class, registered
from .errors import (
    DistError,
    DistRuntimeError,
    DistTypeError,
    DistValueError,
    NotInitializedError,
    RankNotInGroupError,
    format_message,
)
from .group import ProcessGroup, _WorldSentinel
from .reduce_op import ReduceOp, dtype_rule, normalize_op

__all__ = [
    "DEFAULT_TIMEOUT",
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "is_available",
    "get_rank",
    "get_world_size",
    "get_backend",
    "new_group",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "barrier",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
]

#: finite by default (torch waits 10-30 minutes); TENSORPLAY_TIMEOUT overrides, in seconds
DEFAULT_TIMEOUT = timedelta(seconds=float(os.environ.get("TENSORPLAY_TIMEOUT", "300")))

GroupLike = Optional["ProcessGroup | _WorldSentinel"]


# ---------------------------------------------------------------------------
# errors with context
# ---------------------------------------------------------------------------
class _CallContext:
    """The context every message names: collective, group and calling rank."""

    __slots__ = ("name", "pg")

    def __init__(self, name: str, pg: ProcessGroup) -> None:
        self.name = name
        self.pg = pg

    def error(self, cls: type, problem: str, fix: str, **values: Any) -> DistError:
        return cls(
            format_message(self.name, problem, group=self.pg.ranks, rank=self.pg.backend.rank, values=values, fix=fix)
        )


def _state_or_raise(name: str) -> _state.DistState:
    st = _state.current()
    if st is None:
        raise NotInitializedError(
            format_message(
                name,
                "the default process group is not initialised",
                fix="call tensorplay.distributed.init_process_group(...) first, or run the code under "
                "simulator.run(fn, world_size), `python -m simulator` or torchrun",
            )
        )
    return st


def _group(name: str, group: Any, *, member: bool = True) -> tuple[_state.DistState, ProcessGroup]:
    st = _state_or_raise(name)
    if group is None or isinstance(group, _WorldSentinel):
        pg = st.world
    elif isinstance(group, ProcessGroup):
        pg = group
        if pg.backend is not st.backend:
            raise DistValueError(
                format_message(
                    name,
                    "the group belongs to another world (a destroyed process group or another simulated rank)",
                    group=pg.ranks,
                    rank=st.rank,
                    values={"group": pg},
                    fix="create groups with new_group() after init_process_group() on the rank that uses them",
                )
            )
    else:
        raise DistTypeError(
            format_message(
                name,
                "group must be a ProcessGroup from tensorplay.distributed.new_group, group.WORLD or None",
                rank=st.rank,
                values={"group": group, "type": type(group).__name__},
                fix="pass group=None for the world, or a group returned by new_group(ranks)",
            )
        )
    if member and pg.rank() < 0:
        raise RankNotInGroupError(
            format_message(
                name,
                "the calling rank is not a member of the group",
                group=pg.ranks,
                rank=st.rank,
                values={"rank": st.rank, "group_ranks": list(pg.ranks)},
                fix="call the collective only on member ranks (guard it with `if rank in ranks:`)",
            )
        )
    return st, pg


def _root(c: _CallContext, role: str, global_rank: Any, group_rank: Any, default: int | None = None) -> int:
    """Turn ``src``/``dst`` (global) or ``group_src``/``group_dst`` into a group rank."""
    if global_rank is not None and group_rank is not None:
        raise c.error(
            DistValueError,
            f"both {role} and group_{role} were given",
            f"pass either the global rank {role}= or the group rank group_{role}=, not both",
            **{role: global_rank, f"group_{role}": group_rank},
        )
    if group_rank is not None:
        if isinstance(group_rank, bool) or not isinstance(group_rank, int):
            raise c.error(DistTypeError, f"group_{role} must be an int", "pass a group rank", **{f"group_{role}": group_rank})
        if not 0 <= group_rank < c.pg.size():
            raise c.error(
                RankNotInGroupError,
                f"group_{role} is not a group rank of this group",
                f"use a group rank in [0, {c.pg.size()})",
                **{f"group_{role}": group_rank, "group_size": c.pg.size()},
            )
        return group_rank
    if global_rank is None:
        if default is None:
            raise c.error(
                DistValueError,
                f"no {role} was given",
                f"pass {role}=<global rank> (or group_{role}=<group rank>)",
                **{role: None},
            )
        global_rank = default
    if isinstance(global_rank, bool) or not isinstance(global_rank, int):
        raise c.error(DistTypeError, f"{role} must be an int (a global rank)", f"pass {role} as an int", **{role: global_rank})
    gr = c.pg.group_rank(global_rank)
    if gr is None:
        raise c.error(
            RankNotInGroupError,
            f"{role} is not a member of the group ({role} is a global rank)",
            f"pick {role} from the group's global ranks {list(c.pg.ranks)}, or pass group_{role}=<group rank>",
            **{role: global_rank, "group_ranks": list(c.pg.ranks)},
        )
    return gr


def _tensor(c: _CallContext, t: Any, argname: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise c.error(
            DistTypeError, f"{argname} must be a torch.Tensor", "pass a tensor", **{argname: type(t).__name__}
        )
    if not c.pg.backend.supports_device(t.device):
        raise c.error(
            DistValueError,
            f"{argname} is on a device the {c.pg.backend.name!r} backend cannot use",
            "move the tensor (e.g. .cpu() for gloo, .cuda() for nccl) or pick a backend for that device",
            **{f"{argname}.device": str(t.device), "backend": c.pg.backend.name},
        )
    return t


def _uniform_ok(c: _CallContext, ts: Any, like: torch.Tensor | None, same_shape: bool) -> bool:
    """One cheap pass: every entry a tensor on one device the backend takes (with ``like``'s dtype/shape)."""
    dev = None
    dtype = None if like is None else like.dtype
    shape = like.shape if same_shape and like is not None else None
    for t in ts:
        if not isinstance(t, torch.Tensor):
            return False
        d = t.device
        if d != dev:
            if dev is not None or not c.pg.backend.supports_device(d):
                return False
            dev = d
        if (dtype is not None and t.dtype != dtype) or (shape is not None and t.shape != shape):
            return False
    return True


def _tensor_list(c: _CallContext, ts: Any, argname: str, like: torch.Tensor | None,
                 same_shape: bool) -> list[torch.Tensor]:
    """A list of exactly group-size tensors, each with ``like``'s dtype (and shape if asked)."""
    if not isinstance(ts, (list, tuple)):
        raise c.error(
            DistTypeError, f"{argname} must be a list of tensors", "pass a list with one tensor per group rank",
            **{argname: type(ts).__name__},
        )
    if len(ts) != c.pg.size():
        raise c.error(
            DistValueError,
            f"{argname} must hold one tensor per group rank",
            f"pass exactly {c.pg.size()} tensors",
            **{f"len({argname})": len(ts), "group_size": c.pg.size()},
        )
    if _uniform_ok(c, ts, like, same_shape):  # the common case; the loop below names what is wrong
        return list(ts)
    for i, t in enumerate(ts):
        _tensor(c, t, f"{argname}[{i}]")
        if like is not None:
            _same_dtype(c, t, f"{argname}[{i}]", like)
            if same_shape and t.shape != like.shape:
                raise c.error(
                    DistValueError,
                    f"{argname}[{i}] must have the shape of the tensor",
                    "allocate every entry like the tensor (e.g. torch.empty_like(tensor))",
                    **{f"{argname}[{i}].shape": tuple(t.shape), "tensor.shape": tuple(like.shape)},
                )
    return list(ts)


def _same_dtype(c: _CallContext, t: torch.Tensor, argname: str, like: torch.Tensor, likename: str = "tensor") -> None:
    if t.dtype != like.dtype:
        raise c.error(
            DistTypeError,
            f"{argname} and {likename} must have the same dtype",
            "allocate outputs with the input's dtype",
            **{f"{argname}.dtype": t.dtype, f"{likename}.dtype": like.dtype},
        )


def _op(c: _CallContext, op: Any, dtype: torch.dtype) -> ReduceOp:
    try:
        rop = normalize_op(op)
    except ValueError:
        # an unknown name (or torch op) is a bad value; anything else is the wrong type
        cls = DistValueError if isinstance(op, str) or hasattr(op, "name") else DistTypeError
        raise c.error(
            cls, "unknown reduce op", f"use one of {', '.join('ReduceOp.' + o.name for o in ReduceOp)}", op=op
        ) from None
    why = dtype_rule(rop, dtype)
    if why is not None:
        raise c.error(DistTypeError, f"{rop.name} cannot reduce this dtype", why, op=rop, dtype=dtype)
    return rop


def _no_list_off_root(c: _CallContext, lst: Any, argname: str, role: str, root_global: int) -> None:
    if lst:
        raise c.error(
            DistValueError,
            f"{argname} may only be given on the {role} rank",
            f"pass {argname}=None on ranks other than {role}={root_global}",
            **{role: root_global, f"len({argname})": len(lst)},
        )


def _check_async(c: _CallContext, async_op: Any) -> None:
    if not isinstance(async_op, bool):
        raise c.error(DistTypeError, "async_op must be a bool", "pass async_op=True or False", async_op=async_op)


def _flat_shape_ok(out: torch.Tensor, inp: torch.Tensor, w: int) -> bool:
    """``out`` is ``w`` copies of ``inp`` concatenated on dim 0 or stacked on a new dim 0."""
    if out.numel() != w * inp.numel():
        return False
    return tuple(out.shape) in ((w, *inp.shape), _spec.gathered_shape(tuple(inp.shape), w))


# ---------------------------------------------------------------------------
# life cycle and queries
# ---------------------------------------------------------------------------
def _to_timedelta(name: str, timeout: Any) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        td = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        td = timedelta(seconds=float(timeout))
    else:
        raise DistTypeError(
            format_message(name, "timeout must be a datetime.timedelta or seconds", values={"timeout": timeout},
                           fix="pass e.g. timeout=datetime.timedelta(seconds=60)")
        )
    if td.total_seconds() <= 0:
        raise DistValueError(
            format_message(name, "timeout must be positive", values={"timeout": td},
                           fix="pass a positive timeout; waits are always bounded")
        )
    return td


class UnknownBackendError(DistError, AssertionError):
    """A backend name torch does not know: torch raises ``AssertionError`` for it, so this is one (and a DistError)."""


def _backend_name_refusal(call: str, backend: Any, runs: Sequence[str] = ()) -> Exception | None:
    """What torch's ``init_process_group``/``new_group`` raises for this backend *name* (None: torch knows it).

    torch 2.13 checks names in ``_new_process_group_helper``: ``Backend(name)`` (a non-string is a ValueError),
    then ``BackendConfig`` (a malformed ``"device:backend,..."`` string is a ValueError), then a single name must
    be one of ``Backend.backend_type_map`` (built-in or registered with ``Backend.register_backend``) and each
    backend of a ``"device:backend"`` string a built-in one or a registered plugin, else ``AssertionError``.
    The same class is returned, torch's message first, then which names exist.  Whether a known backend is
    available here (NCCL without CUDA, MPI) is not a question of its name: the backend answers it.
    ``runs``: the names the caller runs (tensorplay's backends), accepted too and offered instead of torch's.
    """
    import difflib
    import warnings

    import torch.distributed.distributed_c10d as c10d
    from torch.distributed import Backend

    if backend is None:
        return None
    ours = {k.lower() for k in runs}
    try:
        named = str(Backend(backend))
    except ValueError as e:  # not a string
        return DistValueError(f"{e}; " + format_message(call, "the backend must be a string", values={
            "backend": backend}, fix="pass e.g. backend='gloo', or 'cpu:gloo,cuda:nccl'"))
    device_form = "," in named or ":" in named
    if device_form:
        # torch warns that an unknown name's devices are unknown, then refuses it: the error says it all
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                pairs = c10d.BackendConfig(Backend(named)).get_device_backend_map()
            except ValueError as e:  # malformed "device:backend,..." string
                return DistValueError(" ".join(str(e).split()) + "; " + format_message(
                    call, "malformed device:backend string", values={"backend": backend},
                    fix="write '<device>:<backend>' pairs separated by commas, each device once, e.g. "
                        "'cpu:gloo,cuda:nccl'"))
        builtin = {Backend.GLOO, Backend.NCCL, Backend.MPI, Backend.XCCL, Backend.UCC}  # (UCC: a plugin if absent)
        if not torch.distributed.is_ucc_available():
            builtin.discard(Backend.UCC)
        known = sorted(builtin | {k.lower() for k in Backend._plugins} | ours)
        bad = next((str(b) for b in pairs.values() if str(b) not in known), None)
        if bad is None:
            return None
        torch_says, name = f"Unknown c10d backend type {bad.upper()}", bad
    else:
        known = sorted({str(k) for k in Backend.backend_type_map if k != Backend.UNDEFINED} | ours)
        if named in Backend.backend_type_map or named in ours:
            return None
        torch_says, name = f"Unknown backend type {named}", named
    offer = sorted(ours) or known
    close = difflib.get_close_matches(name.lower(), offer, n=1)
    if device_form and ":" not in named:
        hint = "a comma separates device:backend pairs: name each device, e.g. 'cpu:gloo,cuda:nccl'"
    else:
        hint = f"did you mean {close[0]!r}?" if close else f"pass one of {offer}"
    return UnknownBackendError(f"{torch_says}; " + format_message(
        call, "not a backend name torch knows", values={"backend": backend, "known": offer},
        fix=f"{hint} (a backend of your own is registered first, with torch.distributed.Backend.register_backend)"))


def _install_backend(backend: Any, timeout: timedelta = DEFAULT_TIMEOUT, *, thread_local: bool = False) -> _state.DistState:
    """Make ``backend`` the calling rank's default world (used by init_process_group and the simulator)."""
    world = ProcessGroup(range(backend.world_size), backend, backend.world_handle(), group_id=0)
    st = _state.DistState(backend=backend, world=world, timeout_s=timeout.total_seconds())
    if thread_local:
        _state.bind_thread(st)
    else:
        _state.set_process_state(st)
    return st


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> None:
    """Initialise the default process group (torch.distributed's signature).

    ``backend=None`` picks ``"nccl"`` when CUDA is available, else ``"gloo"``.
    ``init_method=None`` means ``env://`` (``MASTER_ADDR``, ``MASTER_PORT``,
    ``RANK``, ``WORLD_SIZE``), so scripts run unchanged under ``torchrun``.
    Inside a simulated world (``simulator.run`` or ``python -m simulator``)
    the world is already initialised and this call returns at once.

    Example (2 ranks; the same lines run unchanged in each process of ``torchrun --nproc-per-node 2``)::

        >>> import tensorplay as tp
        >>> import tensorplay.distributed as dist
        >>> dist.init_process_group("gloo")
        >>> x = tp.tensor([float(dist.get_rank())])
        >>> dist.all_reduce(x)
        >>> x                                   # on both ranks
        tensor([1.])
        >>> dist.destroy_process_group()
    """
    name = "init_process_group"
    st = _state.current()
    if st is not None:
        # the backend decides: a process group refuses, a world started for the program checks the values
        st.backend.check_reinit(rank, world_size)
        _check_backend_name(name, backend)  # a world started for the program still refuses what a real run does
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.distributed.is_nccl_available() else "gloo"
    _check_backend_name(name, backend)
    td = _to_timedelta(name, timeout)
    try:
        cls = get_backend_class(backend.split(":")[-1] if ":" in backend else backend)
    except KeyError:
        raise DistValueError(
            format_message(name, "unknown backend", values={"backend": backend, "available": registered()},
                           fix="pass one of the available backends")
        ) from None
    b = cls.create(rank=rank, world_size=world_size, init_method=init_method, store=store, timeout=td)
    _install_backend(b, td)


def _check_backend_name(name: str, backend: Any) -> None:
    """Refuse what torch refuses (its class, its message first), then a name torch knows that tensorplay does
    not run (mpi, ucc, xccl, fake); ``None`` is the default backend."""
    refusal = _backend_name_refusal(name, backend, runs=registered())
    if refusal is not None:
        raise refusal
    if backend is not None and (backend.split(":")[-1] if ":" in backend else backend).lower() not in registered():
        raise DistValueError(
            format_message(name, "unknown backend", values={"backend": backend, "available": registered()},
                           fix="pass one of the available backends"))


def destroy_process_group(group: GroupLike = None) -> None:
    """Destroy ``group``; with no argument (or ``group.WORLD``) shut the whole backend down."""
    st = _state.current()
    if st is None:
        return
    if group is None or isinstance(group, _WorldSentinel) or group is st.world:
        try:
            st.backend.shutdown()
        finally:
            if getattr(_state._thread, "state", None) is st:
                _state.unbind_thread()
            else:
                _state.set_process_state(None)
            st.groups.clear()
        st.backend.released()
        return
    if isinstance(group, ProcessGroup) and group in st.groups:
        st.groups.remove(group)


def is_initialized() -> bool:
    """Whether the calling rank has a default process group."""
    return _state.current() is not None


def is_available() -> bool:
    """tensorplay.distributed is always available (the simulator needs nothing else)."""
    return True


def get_rank(group: GroupLike = None) -> int:
    """The caller's rank in ``group`` (global rank for the world), or -1 if it is not a member.

    Example (4 ranks)::

        >>> g = dist.new_group([3, 1])
        >>> dist.get_rank(g) == {1: 0, 3: 1}.get(dist.get_rank(), -1)   # group rank, or -1 off the group
        True
    """
    _, pg = _group("get_rank", group, member=False)
    return pg.rank()


def get_world_size(group: GroupLike = None) -> int:
    """Number of ranks in ``group``; -1 when the caller is not a member (as torch does)."""
    _, pg = _group("get_world_size", group, member=False)
    return pg.size() if pg.rank() >= 0 else -1


def get_backend(group: GroupLike = None) -> str:
    """Name of the backend running ``group`` (``"gloo"``, ``"nccl"`` or ``"sim"``)."""
    _, pg = _group("get_backend", group, member=False)
    return pg.backend.name


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: Any = None,
) -> ProcessGroup:
    """Create a group from global ``ranks``; every rank of the world must call it, in the same order.

    Group ranks follow torch: the ranks are sorted, so ``new_group([2, 0])``
    gives group rank 0 to global rank 0 and group rank 1 to global rank 2.
    Non-members get a group object too; using it in a collective raises
    :class:`RankNotInGroupError`.

    Example (4 ranks)::

        >>> g = dist.new_group([3, 1, 2])
        >>> dist.get_process_group_ranks(g)     # group rank i is global rank ranks[i]
        [1, 2, 3]
        >>> x = tp.tensor([float(dist.get_rank())])
        >>> if dist.get_rank() in (1, 2, 3):    # only members may use g
        ...     dist.all_reduce(x, group=g)
        >>> x.item() == (6. if dist.get_rank() > 0 else 0.)
        True
    """
    name = "new_group"
    st = _state_or_raise(name)
    w = st.world_size
    if ranks is None:
        ranks = list(range(w))
    if not isinstance(ranks, (list, tuple, range)) or not all(
        isinstance(r, int) and not isinstance(r, bool) for r in ranks
    ):
        raise DistTypeError(format_message(name, "ranks must be a list of ints (global ranks)", rank=st.rank,
                                           values={"ranks": ranks}, fix="pass e.g. ranks=[0, 2]"))
    bad = [r for r in ranks if not 0 <= r < w]
    if bad:
        raise DistValueError(format_message(name, "ranks outside the world", rank=st.rank,
                                            values={"ranks": list(ranks), "out_of_range": bad, "world_size": w},
                                            fix=f"use global ranks in [0, {w})"))
    if len(set(ranks)) != len(ranks) or not ranks:
        raise DistValueError(format_message(name, "ranks must be non-empty and unique", rank=st.rank,
                                            values={"ranks": list(ranks)}, fix="list each rank once"))
    td = _to_timedelta(name, timeout) if timeout is not None else timedelta(seconds=st.timeout_s)
    sorted_ranks = tuple(sorted(ranks))
    handle = st.backend.new_group_handle(sorted_ranks, td)
    pg = ProcessGroup(sorted_ranks, st.backend, handle, group_id=len(st.groups) + 1)
    st.groups.append(pg)
    return pg


def get_process_group_ranks(group: GroupLike) -> list[int]:
    """Global ranks of ``group`` in group-rank order."""
    _, pg = _group("get_process_group_ranks", group, member=False)
    return list(pg.ranks)


def get_global_rank(group: GroupLike, group_rank: int) -> int:
    """Global rank of ``group_rank`` in ``group``.

    Example (4 ranks)::

        >>> g = dist.new_group([3, 1])
        >>> dist.get_global_rank(g, 0), dist.get_global_rank(g, 1)
        (1, 3)
    """
    _, pg = _group("get_global_rank", group, member=False)
    if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < pg.size():
        raise RankNotInGroupError(format_message("get_global_rank", "group_rank is not in the group", group=pg.ranks,
                                                 rank=pg.backend.rank,
                                                 values={"group_rank": group_rank, "group_size": pg.size()},
                                                 fix=f"use a group rank in [0, {pg.size()})"))
    return pg.ranks[group_rank]


def get_group_rank(group: GroupLike, global_rank: int) -> int:
    """Group rank of ``global_rank`` in ``group``.

    Example (4 ranks)::

        >>> g = dist.new_group([3, 1])
        >>> dist.get_group_rank(g, 1), dist.get_group_rank(g, 3)
        (0, 1)
    """
    _, pg = _group("get_group_rank", group, member=False)
    gr = pg.group_rank(global_rank) if isinstance(global_rank, int) else None
    if gr is None:
        raise RankNotInGroupError(format_message("get_group_rank", "global_rank is not a member of the group",
                                                 group=pg.ranks, rank=pg.backend.rank,
                                                 values={"global_rank": global_rank, "group_ranks": list(pg.ranks)},
                                                 fix="pass one of the group's global ranks"))
    return gr


# ---------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------
def barrier(group: GroupLike = None, async_op: bool = False, device_ids: Any = None) -> Work | None:
    """Block until every rank of ``group`` reached the barrier.

    Example (2 ranks)::

        >>> dist.barrier()              # both ranks wait for the slower one
    """
    _, pg = _group("barrier", group)
    _check_async(_CallContext("barrier", pg), async_op)
    return pg.backend.barrier(pg, async_op)


def broadcast(
    tensor: torch.Tensor, src: int | None = None, group: GroupLike = None, async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Copy ``src``'s ``tensor`` into ``tensor`` on every rank of ``group`` (in place).

    Example (3 ranks)::

        >>> x = tp.full((2,), float(dist.get_rank()))
        >>> dist.broadcast(x, src=2)
        >>> x                        # on every rank
        tensor([2., 2.])
    """
    c = _CallContext("broadcast", _group("broadcast", group)[1])
    _tensor(c, tensor, "tensor")
    _check_async(c, async_op)
    root = _root(c, "src", src, group_src)
    return c.pg.backend.broadcast(tensor, root, c.pg, async_op)


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: GroupLike = None, async_op: bool = False
) -> Work | None:
    """Reduce ``tensor`` over ``group`` with ``op``; every rank gets the result (in place).

    Example (4 ranks)::

        >>> x = tp.tensor([dist.get_rank() + 1.0])
        >>> dist.all_reduce(x, op=dist.ReduceOp.PRODUCT)
        >>> x                        # 1 * 2 * 3 * 4 on every rank
        tensor([24.])
    """
    c = _CallContext("all_reduce", _group("all_reduce", group)[1])
    _tensor(c, tensor, "tensor")
    _check_async(c, async_op)
    rop = _op(c, op, tensor.dtype)
    return c.pg.backend.all_reduce(tensor, rop, c.pg, async_op)


def reduce(
    tensor: torch.Tensor, dst: int | None = None, op: Any = ReduceOp.SUM, group: GroupLike = None,
    async_op: bool = False, group_dst: int | None = None,
) -> Work | None:
    """Reduce ``tensor`` over ``group`` into ``dst``'s ``tensor``; other ranks' tensors are unspecified after.

    (gloo writes partial results into non-dst tensors, as torch does; see docs/deviations.md.)

    Example (2 ranks)::

        >>> r = dist.get_rank()
        >>> x = tp.tensor([1.0 + r])
        >>> dist.reduce(x, dst=1)
        >>> r != 1 or x.tolist() == [3.]     # rank 1 holds the sum; rank 0's x holds scratch values
        True
    """
    c = _CallContext("reduce", _group("reduce", group)[1])
    _tensor(c, tensor, "tensor")
    _check_async(c, async_op)
    rop = _op(c, op, tensor.dtype)
    root = _root(c, "dst", dst, group_dst)
    return c.pg.backend.reduce(tensor, root, rop, c.pg, async_op)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: GroupLike = None, async_op: bool = False
) -> Work | None:
    """Every rank gets every rank's ``tensor``: ``tensor_list[i]`` = group rank ``i``'s tensor.

    Example (2 ranks)::

        >>> out = [tp.empty(1), tp.empty(1)]
        >>> dist.all_gather(out, tp.tensor([float(dist.get_rank())]))
        >>> out                      # on both ranks
        [tensor([0.]), tensor([1.])]
    """
    c = _CallContext("all_gather", _group("all_gather", group)[1])
    _tensor(c, tensor, "tensor")
    _check_async(c, async_op)
    outs = _tensor_list(c, tensor_list, "tensor_list", tensor, same_shape=True)
    return c.pg.backend.all_gather(outs, tensor, c.pg, async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: GroupLike = None, async_op: bool = False
) -> Work | None:
    """All-gather into one tensor: group-size inputs concatenated on dim 0 (or stacked on a new dim 0).

    Example (2 ranks)::

        >>> out = tp.empty(4)
        >>> dist.all_gather_into_tensor(out, tp.full((2,), float(dist.get_rank())))
        >>> out                      # on both ranks
        tensor([0., 0., 1., 1.])
    """
    c = _CallContext("all_gather_into_tensor", _group("all_gather_into_tensor", group)[1])
    _tensor(c, output_tensor, "output_tensor")
    _tensor(c, input_tensor, "input_tensor")
    _check_async(c, async_op)
    _same_dtype(c, output_tensor, "output_tensor", input_tensor, "input_tensor")
    if not _flat_shape_ok(output_tensor, input_tensor, c.pg.size()):
        raise c.error(
            DistValueError,
            "output_tensor must hold group-size copies of input_tensor (concatenated on dim 0 or stacked)",
            f"allocate output with shape ({c.pg.size()} * input.shape[0], ...) or ({c.pg.size()}, *input.shape)",
            **{"output_tensor.shape": tuple(output_tensor.shape), "input_tensor.shape": tuple(input_tensor.shape),
               "group_size": c.pg.size()},
        )
    return c.pg.backend.all_gather_into_tensor(output_tensor, input_tensor, c.pg, async_op)


def gather(
    tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int | None = None,
    group: GroupLike = None, async_op: bool = False, group_dst: int | None = None,
) -> Work | None:
    """Collect every rank's ``tensor`` into ``gather_list`` on ``dst`` (default: global rank 0).

    Example (3 ranks, dst=0)::

        >>> r = dist.get_rank()
        >>> out = [tp.empty(1) for _ in range(3)] if r == 0 else None
        >>> dist.gather(tp.tensor([float(r)]), out, dst=0)
        >>> r != 0 or [t.item() for t in out] == [0., 1., 2.]    # rank 0 holds every rank's tensor
        True
    """
    c = _CallContext("gather", _group("gather", group)[1])
    _tensor(c, tensor, "tensor")
    _check_async(c, async_op)
    root = _root(c, "dst", dst, group_dst, default=0)
    if c.pg.rank() == root:
        if gather_list is None:
            raise c.error(DistValueError, "gather_list is required on the dst rank",
                          f"pass a list of {c.pg.size()} tensors shaped like tensor", gather_list=None)
        gl = _tensor_list(c, gather_list, "gather_list", tensor, same_shape=True)
    else:
        _no_list_off_root(c, gather_list, "gather_list", "dst", c.pg.ranks[root])
        gl = None
    return c.pg.backend.gather(tensor, gl, root, c.pg, async_op)


def scatter(
    tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int | None = None,
    group: GroupLike = None, async_op: bool = False, group_src: int | None = None,
) -> Work | None:
    """Send ``scatter_list[i]`` from ``src`` (default: global rank 0) to group rank ``i``'s ``tensor``.

    Example (2 ranks)::

        >>> r = dist.get_rank()
        >>> parts = [tp.tensor([10.]), tp.tensor([11.])] if r == 0 else None
        >>> x = tp.empty(1)
        >>> dist.scatter(x, parts, src=0)
        >>> x.tolist() == [10. + r]          # rank r got parts[r]
        True
    """
    c = _CallContext("scatter", _group("scatter", group)[1])
    _tensor(c, tensor, "tensor")
    _check_async(c, async_op)
    root = _root(c, "src", src, group_src, default=0)
    if c.pg.rank() == root:
        if scatter_list is None:
            raise c.error(DistValueError, "scatter_list is required on the src rank",
                          f"pass a list of {c.pg.size()} tensors shaped like tensor", scatter_list=None)
        sl = _tensor_list(c, scatter_list, "scatter_list", tensor, same_shape=True)
    else:
        _no_list_off_root(c, scatter_list, "scatter_list", "src", c.pg.ranks[root])
        sl = None
    return c.pg.backend.scatter(tensor, sl, root, c.pg, async_op)


def reduce_scatter(
    output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM, group: GroupLike = None,
    async_op: bool = False,
) -> Work | None:
    """Group rank ``i`` gets ``op`` over every rank's ``input_list[i]``.

    Example (2 ranks)::

        >>> out = tp.empty(1)
        >>> r = dist.get_rank()
        >>> dist.reduce_scatter(out, [tp.tensor([1. + r]), tp.tensor([10. + r])])
        >>> out.tolist() == [[3.], [21.]][r]     # rank 0: 1 + 2; rank 1: 10 + 11
        True
    """
    c = _CallContext("reduce_scatter", _group("reduce_scatter", group)[1])
    _tensor(c, output, "output")
    _check_async(c, async_op)
    ins = _tensor_list(c, input_list, "input_list", output, same_shape=True)
    rop = _op(c, op, output.dtype)
    return c.pg.backend.reduce_scatter(output, ins, rop, c.pg, async_op)


def reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM, group: GroupLike = None,
    async_op: bool = False,
) -> Work | None:
    """Reduce ``input`` over the group and give group rank ``i`` the ``i``-th dim-0 chunk.

    Example (2 ranks)::

        >>> out = tp.empty(2)
        >>> dist.reduce_scatter_tensor(out, tp.arange(4.))
        >>> out.tolist() == [[0., 2.], [4., 6.]][dist.get_rank()]
        True
    """
    c = _CallContext("reduce_scatter_tensor", _group("reduce_scatter_tensor", group)[1])
    _tensor(c, output, "output")
    _tensor(c, input, "input")
    _check_async(c, async_op)
    _same_dtype(c, output, "output", input, "input")
    if not _flat_shape_ok(input, output, c.pg.size()):
        raise c.error(
            DistValueError,
            "input must hold group-size chunks shaped like output (concatenated on dim 0 or stacked)",
            f"allocate input with shape ({c.pg.size()} * output.shape[0], ...) or ({c.pg.size()}, *output.shape)",
            **{"input.shape": tuple(input.shape), "output.shape": tuple(output.shape), "group_size": c.pg.size()},
        )
    rop = _op(c, op, output.dtype)
    return c.pg.backend.reduce_scatter_tensor(output, input, rop, c.pg, async_op)


def all_to_all(
    output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group: GroupLike = None,
    async_op: bool = False,
) -> Work | None:
    """Group rank ``j`` sends ``input_tensor_list[i]`` to group rank ``i``'s ``output_tensor_list[j]``.

    Shapes may differ per (sender, receiver) pair ("ragged"); every backend supports that.

    Example (2 ranks)::

        >>> r = dist.get_rank()
        >>> ins = [tp.full((1 + r,), 10. * r + i) for i in range(2)]
        >>> outs = [tp.empty(1 + j) for j in range(2)]
        >>> dist.all_to_all(outs, ins)
        >>> [t.tolist() for t in outs] == [[10. * j + r] * (1 + j) for j in range(2)]   # outs[j] came from rank j
        True
    """
    c = _CallContext("all_to_all", _group("all_to_all", group)[1])
    _check_async(c, async_op)
    ins = _tensor_list(c, input_tensor_list, "input_tensor_list", None, same_shape=False)
    outs = _tensor_list(c, output_tensor_list, "output_tensor_list", None, same_shape=False)
    first = ins[0]
    dtype = first.dtype
    if any(t.dtype != dtype for t in ins) or any(t.dtype != dtype for t in outs):
        for name, lst in (("input_tensor_list", ins), ("output_tensor_list", outs)):
            for i, t in enumerate(lst):
                _same_dtype(c, t, f"{name}[{i}]", first, "input_tensor_list[0]")
    me = c.pg.rank()
    if outs[me].shape != ins[me].shape:
        raise c.error(
            DistValueError,
            "the block a rank sends to itself must fit the block it receives from itself",
            "make output_tensor_list[rank] the shape of input_tensor_list[rank]",
            **{f"output_tensor_list[{me}].shape": tuple(outs[me].shape),
               f"input_tensor_list[{me}].shape": tuple(ins[me].shape)},
        )
    return c.pg.backend.all_to_all(outs, ins, c.pg, async_op)


def _splits(c: _CallContext, splits: Any, argname: str, t: torch.Tensor, tname: str) -> list[int]:
    w = c.pg.size()
    if t.dim() == 0:
        raise c.error(DistValueError, f"{tname} must have at least one dimension to be split",
                      f"reshape {tname} to 1-d (e.g. x.reshape(1))", **{f"{tname}.shape": ()})
    n = t.shape[0]
    if splits is None:
        if n % w:
            raise c.error(
                DistValueError, f"{tname}.shape[0] is not divisible by the group size and no {argname} were given",
                f"pass {argname} explicitly or make dim 0 a multiple of {w}",
                **{f"{tname}.shape[0]": n, "group_size": w},
            )
        return [n // w] * w
    if not isinstance(splits, (list, tuple)) or not all(
        isinstance(s, int) and not isinstance(s, bool) for s in splits
    ):
        raise c.error(DistTypeError, f"{argname} must be a list of ints", "pass one int per group rank",
                      **{argname: splits})
    if len(splits) != w:
        raise c.error(DistValueError, f"{argname} must have one entry per group rank",
                      f"pass exactly {w} sizes", **{f"len({argname})": len(splits), "group_size": w})
    if any(s < 0 for s in splits):
        raise c.error(DistValueError, f"{argname} must not be negative", "use sizes >= 0", **{argname: list(splits)})
    if sum(splits) != n:
        raise c.error(DistValueError, f"{argname} must sum to {tname}.shape[0]",
                      f"make the sizes add up to {n}", **{argname: list(splits), f"sum({argname})": sum(splits),
                                                            f"{tname}.shape[0]": n})
    return list(splits)


def all_to_all_single(
    output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None, group: GroupLike = None, async_op: bool = False,
) -> Work | None:
    """Split ``input`` on dim 0 by ``input_split_sizes``, exchange, concatenate by ``output_split_sizes``.

    ``None`` splits mean equal chunks.  Uneven and zero splits are allowed.

    Example (2 ranks; rank r sends r+1 rows to rank 0 and 1 row to rank 1)::

        >>> r = dist.get_rank()
        >>> x = tp.full((r + 2,), float(r))
        >>> out = tp.empty(3 if r == 0 else 2)
        >>> dist.all_to_all_single(out, x, [1, 2] if r == 0 else [1, 1], [r + 1, 1])
        >>> out.tolist() == [[0., 1., 1.], [0., 1.]][r]
        True
    """
    c = _CallContext("all_to_all_single", _group("all_to_all_single", group)[1])
    _tensor(c, output, "output")
    _tensor(c, input, "input")
    _check_async(c, async_op)
    _same_dtype(c, output, "output", input, "input")
    outs, ins = _single_splits(c, output, input, output_split_sizes, input_split_sizes)
    return c.pg.backend.all_to_all_single(output, input, outs, ins, c.pg, async_op)


def _single_splits(c: _CallContext, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any,
                   input_split_sizes: Any) -> tuple[list[int], list[int]]:
    """all_to_all_single's split lists, checked against both tensors on this rank: (out_splits, in_splits)."""
    ins = _splits(c, input_split_sizes, "input_split_sizes", input, "input")
    outs = _splits(c, output_split_sizes, "output_split_sizes", output, "output")
    if output.shape[1:] != input.shape[1:]:
        raise c.error(DistValueError, "output and input must agree on every dimension but the first",
                      "allocate output with input's trailing shape",
                      **{"output.shape": tuple(output.shape), "input.shape": tuple(input.shape)})
    me = c.pg.rank()
    if ins[me] != outs[me]:
        raise c.error(DistValueError, "the rows a rank sends to itself must equal the rows it receives from itself",
                      "make output_split_sizes[rank] == input_split_sizes[rank]",
                      **{f"input_split_sizes[{me}]": ins[me], f"output_split_sizes[{me}]": outs[me]})
    return outs, ins


# ---------------------------------------------------------------------------
# point to point
# ---------------------------------------------------------------------------
def _p2p_args(name: str, tensor: Any, group: GroupLike, tag: Any, role: str, peer: Any, group_peer: Any,
              any_source: bool) -> tuple[_CallContext, int | None]:
    c = _CallContext(name, _group(name, group)[1])
    _tensor(c, tensor, "tensor")
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise c.error(DistTypeError, "tag must be an int", "pass tag=<int>", tag=tag)
    if any_source and peer is None and group_peer is None:
        return c, None
    gp = _root(c, role, peer, group_peer)
    if gp == c.pg.rank():
        raise c.error(DistValueError, f"a rank cannot {name.lstrip('i')} to or from itself",
                      f"pass a {role} other than the calling rank", **{role: c.pg.ranks[gp], "rank": c.pg.backend.rank})
    return c, gp


def send(tensor: torch.Tensor, dst: int | None = None, group: GroupLike = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` to ``dst`` (blocking until the matching receive took it).

    Example (2 ranks)::

        >>> x = tp.tensor([42.]) if dist.get_rank() == 0 else tp.zeros(1)
        >>> if dist.get_rank() == 0:
        ...     dist.send(x, dst=1)
        ... else:
        ...     sender = dist.recv(x, src=0)
        >>> x                        # rank 1 received rank 0's tensor
        tensor([42.])
    """
    c, peer = _p2p_args("send", tensor, group, tag, "dst", dst, group_dst, any_source=False)
    c.pg.backend.send(tensor, peer, c.pg, tag, False)


def recv(tensor: torch.Tensor, src: int | None = None, group: GroupLike = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive into ``tensor`` from ``src`` (``None``: any source); returns the sender's global rank.

    Example (3 ranks)::

        >>> r = dist.get_rank()
        >>> if r == 0:                       # any source: recv says who sent
        ...     senders = sorted(dist.recv(tp.zeros(1)) for _ in range(2))
        ... else:
        ...     dist.send(tp.tensor([float(r)]), dst=0)
        >>> r != 0 or senders == [1, 2]
        True
    """
    c, peer = _p2p_args("recv", tensor, group, tag, "src", src, group_src, any_source=True)
    return c.pg.ranks[c.pg.backend.recv(tensor, peer, c.pg, tag, False)]


class _RecvWork(ChainedWork):
    """irecv's work: reports the sender as a global rank, like torch's ``_source_rank()``."""

    def __init__(self, inner: Work, pg: ProcessGroup) -> None:
        super().__init__(inner, lambda: None)
        self._pg = pg

    def source_rank(self) -> int:
        self.wait()
        return self._pg.ranks[self._inner.source_rank()]

    _source_rank = source_rank


def isend(tensor: torch.Tensor, dst: int | None = None, group: GroupLike = None, tag: int = 0,
          group_dst: int | None = None) -> Work:
    """Asynchronous :func:`send`; ``wait()`` on the returned work.

    Example (2 ranks; each sends its tensor to the other)::

        >>> r = dist.get_rank()
        >>> x, y = tp.tensor([float(r)]), tp.zeros(1)
        >>> works = [dist.isend(x, dst=1 - r), dist.irecv(y, src=1 - r)]
        >>> [w.wait() for w in works]
        [True, True]
        >>> y.tolist() == [1. - r]
        True
    """
    c, peer = _p2p_args("isend", tensor, group, tag, "dst", dst, group_dst, any_source=False)
    return c.pg.backend.send(tensor, peer, c.pg, tag, True)


def irecv(tensor: torch.Tensor, src: int | None = None, group: GroupLike = None, tag: int = 0,
          group_src: int | None = None) -> Work:
    """Asynchronous :func:`recv`; the work's ``source_rank()`` is the sender's global rank.

    Example (3 ranks)::

        >>> r = dist.get_rank()
        >>> if r == 0:                       # two receives from any source
        ...     works = [dist.irecv(tp.zeros(1)) for _ in range(2)]
        ...     senders = sorted(w.source_rank() for w in works)
        ... else:
        ...     dist.send(tp.tensor([float(r)]), dst=0)
        >>> r != 0 or senders == [1, 2]
        True
    """
    c, peer = _p2p_args("irecv", tensor, group, tag, "src", src, group_src, any_source=True)
    return _RecvWork(c.pg.backend.recv(tensor, peer, c.pg, tag, True), c.pg)
