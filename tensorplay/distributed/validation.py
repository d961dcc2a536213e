"""Every argument check of tensorplay.distributed, written once and shared by both front doors.

The torch.distributed-style door (:mod:`tensorplay.distributed.api`) and the
autograd door (:mod:`tensorplay.distributed.nn.functional`) call the same
functions, so one bad input gets one error class and one message shape
through either.  Backends and harnesses may call them too (they are public):
a backend that adds a call of its own checks it the way the API does.

Every check runs on the calling rank before anything is sent, and its
message names the call, the group, the calling rank, the offending values as
``name=value`` and a fix (:func:`~tensorplay.distributed.errors.format_message`)::

    tensorplay.distributed.all_reduce (group [0, 1], rank 1): op must be a ReduceOp ...: op=3. Fix: ...

**One error class per kind of mistake.**  The class says what is wrong, never
which door or which check found it:

* **wrong type** -> :class:`DistTypeError` (a ``TypeError``): an argument whose
  Python type the call cannot take.  ``tensor=[1.0]``, ``src="0"``,
  ``group=3``, ``async_op=1``, ``tag=1.5``, split sizes of floats, and an
  ``op`` that is neither a reduce op nor an op's name (``op=3``: torch's
  ``all_reduce(x, op=3)`` raises ``TypeError`` too).  Data of the wrong type
  counts here as well: a dtype the reduce op cannot reduce (``AVG`` on
  ``int64``), a dtype that differs from the tensor it must match, and an op
  without a gradient on an input that requires grad.
* **right type, bad value** -> :class:`DistValueError` (a ``ValueError``): a
  name that names no reduce op (``op="median"``), a list whose length is not
  the group size, split sizes that do not add up, a shape, a device the
  backend cannot use, both ``src`` and ``group_src``, a non-positive timeout,
  a group object of another world (a destroyed process group).
* **a rank outside the group** -> :class:`RankNotInGroupError` (a
  :class:`DistValueError`: a rank is a value): ``src``/``dst``/``group_src``
  not in the group, or the calling rank not a member of ``group``.
* **the program's state, not an argument** -> :class:`NotInitializedError`
  (a :class:`DistRuntimeError`): no default process group on this rank.

A call with several mistakes reports the first one its checks meet; the two
doors run the checks of one collective in the same order.  One exception to
the rule: a backend *name* gets the class torch's ``init_process_group``
raises for it (:func:`backend_name_refusal`), so that a harness standing in
for torch raises what torch raises.
"""
from __future__ import annotations

import difflib
import warnings
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as tdist
import torch.distributed.distributed_c10d as c10d
from torch.distributed import Backend as TorchBackend

from . import state
from .errors import (
    DistError,
    DistTypeError,
    DistValueError,
    NotInitializedError,
    RankNotInGroupError,
    UnknownBackendError,
    format_message,
)
from .group import ProcessGroup, _WorldSentinel
from .reduce_op import ReduceOp, dtype_rule, normalize_op
from .spec import DIFFERENTIABLE_OPS, gathered_shape

__all__ = [
    "CallContext",
    "require_state",
    "resolve_group",
    "begin",
    "check_tensor",
    "check_tensor_list",
    "check_same_dtype",
    "check_one_dtype",
    "check_async_op",
    "check_tag",
    "resolve_root",
    "resolve_peer",
    "resolve_op",
    "require_root_list",
    "check_no_list_off_root",
    "check_receiver_list",
    "check_split_list",
    "check_split_sizes",
    "check_single_splits",
    "check_self_block",
    "check_gathered_shape",
    "check_new_group_ranks",
    "check_group_rank",
    "resolve_global_rank",
    "to_timedelta",
    "backend_name_refusal",
    "check_backend_name",
    "unknown_backend",
]


# ---------------------------------------------------------------------------
# who is calling: the state, the group, the context every message names
# ---------------------------------------------------------------------------
class CallContext:
    """The context every message of one call names: the call, its group and the calling rank.

    ``name`` is the call as users spell it after ``tensorplay.distributed.``
    (``"all_reduce"``, ``"nn.functional.all_reduce"``).
    """

    __slots__ = ("name", "pg")

    def __init__(self, name: str, pg: ProcessGroup) -> None:
        self.name = name
        self.pg = pg

    def error(self, cls: type[DistError], problem: str, fix: str, **values: Any) -> DistError:
        """An exception of ``cls`` whose message names this call, ``problem``, ``values`` and ``fix``."""
        return cls(
            format_message(self.name, problem, group=self.pg.ranks, rank=self.pg.backend.rank, values=values, fix=fix)
        )


def require_state(call: str) -> state.DistState:
    """The calling rank's state; :class:`NotInitializedError` when it has no default process group."""
    st = state.current()
    if st is None or st.backend.awaiting_init:
        raise NotInitializedError(
            format_message(
                call,
                "the default process group is not initialised",
                fix="call tensorplay.distributed.init_process_group(...) first, or run the code under "
                "simulator.run(fn, world_size), `python -m simulator` or torchrun",
            )
        )
    return st


def resolve_group(call: str, group: Any, *, member: bool = True) -> tuple[state.DistState, ProcessGroup]:
    """``group`` (``None``, ``group.WORLD`` or a ProcessGroup) as the calling rank's state and group.

    ``member``: the calling rank must belong to the group (every collective);
    queries such as ``get_rank`` pass ``False``.
    """
    st = require_state(call)
    if group is None or isinstance(group, _WorldSentinel):
        pg = st.world
    elif isinstance(group, ProcessGroup):
        pg = group
        if pg.backend is not st.backend:
            raise DistValueError(
                format_message(
                    call,
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
                call,
                "group must be a ProcessGroup from tensorplay.distributed.new_group, group.WORLD or None",
                rank=st.rank,
                values={"group": group, "type": type(group).__name__},
                fix="pass group=None for the world, or a group returned by new_group(ranks)",
            )
        )
    if member and pg.rank() < 0:
        raise RankNotInGroupError(
            format_message(
                call,
                "the calling rank is not a member of the group",
                group=pg.ranks,
                rank=st.rank,
                values={"rank": st.rank, "group_ranks": list(pg.ranks)},
                fix="call the collective only on member ranks (guard it with `if rank in ranks:`)",
            )
        )
    return st, pg


def begin(call: str, group: Any) -> CallContext:
    """The context of a collective: ``group`` resolved, the calling rank checked to be a member."""
    return CallContext(call, resolve_group(call, group)[1])


# ---------------------------------------------------------------------------
# tensors and lists of tensors
# ---------------------------------------------------------------------------
def check_tensor(c: CallContext, t: Any, argname: str) -> torch.Tensor:
    """``t`` is a tensor on a device the group's backend can use."""
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


def _uniform_ok(c: CallContext, ts: Any, like: torch.Tensor | None, same_shape: bool) -> bool:
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


def check_tensor_list(c: CallContext, ts: Any, argname: str, like: torch.Tensor | None = None,
                      same_shape: bool = False) -> list[torch.Tensor]:
    """A list of exactly group-size tensors, each with ``like``'s dtype (and shape if ``same_shape``)."""
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
        check_tensor(c, t, f"{argname}[{i}]")
        if like is not None:
            check_same_dtype(c, t, f"{argname}[{i}]", like)
            if same_shape and t.shape != like.shape:
                raise c.error(
                    DistValueError,
                    f"{argname}[{i}] must have the shape of the tensor",
                    "allocate every entry like the tensor (e.g. torch.empty_like(tensor))",
                    **{f"{argname}[{i}].shape": tuple(t.shape), "tensor.shape": tuple(like.shape)},
                )
    return list(ts)


def check_same_dtype(c: CallContext, t: torch.Tensor, argname: str, like: torch.Tensor,
                     likename: str = "tensor") -> None:
    """``t`` has ``like``'s dtype (a dtype mismatch is a type mistake)."""
    if t.dtype != like.dtype:
        raise c.error(
            DistTypeError,
            f"{argname} and {likename} must have the same dtype",
            "allocate outputs with the input's dtype",
            **{f"{argname}.dtype": t.dtype, f"{likename}.dtype": like.dtype},
        )


def check_one_dtype(c: CallContext, like: torch.Tensor, likename: str,
                    *lists: tuple[str, Sequence[torch.Tensor]]) -> None:
    """Every tensor of every ``(name, list)`` has ``like``'s dtype; the first that does not is named."""
    dtype = like.dtype
    for name, lst in lists:
        if any(t.dtype != dtype for t in lst):  # one pass in the common case, no message built
            for i, t in enumerate(lst):
                check_same_dtype(c, t, f"{name}[{i}]", like, likename)


def require_root_list(c: CallContext, lst: Any, argname: str, role: str,
                      like: torch.Tensor | None) -> list[torch.Tensor]:
    """The list only the root passes (gather's outputs, scatter's blocks): required, one tensor per group
    rank, each shaped like ``like`` (``None``: like the list's first entry)."""
    if lst is None:
        shaped = "shaped like tensor" if like is not None else "of one shape and dtype"
        raise c.error(DistValueError, f"{argname} is required on the {role} rank",
                      f"pass a list of {c.pg.size()} tensors {shaped}", **{argname: None})
    if like is None:
        like = check_tensor_list(c, lst, argname)[0]
    return check_tensor_list(c, lst, argname, like, same_shape=True)


def check_no_list_off_root(c: CallContext, lst: Any, argname: str, role: str, root_global: int) -> None:
    """Ranks other than the root pass no list (torch.distributed's rooted collectives)."""
    if lst:
        raise c.error(
            DistValueError,
            f"{argname} may only be given on the {role} rank",
            f"pass {argname}=None on ranks other than {role}={root_global}",
            **{role: root_global, f"len({argname})": len(lst)},
        )


def check_receiver_list(c: CallContext, lst: Any, argname: str, role: str) -> list[torch.Tensor]:
    """A non-root rank's list where torch's autograd collectives allow one: ``None`` or tensors (values unread)."""
    if lst is None:
        return []
    if isinstance(lst, torch.Tensor) or not isinstance(lst, (list, tuple)):
        raise c.error(DistTypeError, f"{argname} must be None or a list of tensors on a non-{role} rank",
                      f"pass None (or the list torch's module takes) on ranks other than {role}",
                      **{argname: type(lst).__name__})
    for i, t in enumerate(lst):
        check_tensor(c, t, f"{argname}[{i}]")
    return list(lst)


# ---------------------------------------------------------------------------
# scalars: async_op, tag, roots and peers, the reduce op
# ---------------------------------------------------------------------------
def check_async_op(c: CallContext, async_op: Any) -> None:
    """``async_op`` is a bool."""
    if not isinstance(async_op, bool):
        raise c.error(DistTypeError, "async_op must be a bool", "pass async_op=True or False", async_op=async_op)


def check_tag(c: CallContext, tag: Any) -> None:
    """A point-to-point ``tag`` is an int."""
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise c.error(DistTypeError, "tag must be an int", "pass tag=<int>", tag=tag)


def resolve_root(c: CallContext, role: str, global_rank: Any, group_rank: Any, default: int | None = None) -> int:
    """``src``/``dst`` (a global rank) or ``group_src``/``group_dst`` (a group rank) as a group rank.

    ``role`` is ``"src"`` or ``"dst"``; ``default`` (a global rank) applies when neither is given, else
    giving neither is a mistake.
    """
    if global_rank is not None and group_rank is not None:
        raise c.error(
            DistValueError,
            f"both {role} and group_{role} were given",
            f"pass either the global rank {role}= or the group rank group_{role}=, not both",
            **{role: global_rank, f"group_{role}": group_rank},
        )
    if group_rank is not None:
        if isinstance(group_rank, bool) or not isinstance(group_rank, int):
            raise c.error(DistTypeError, f"group_{role} must be an int", "pass a group rank",
                          **{f"group_{role}": group_rank})
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
        raise c.error(DistTypeError, f"{role} must be an int (a global rank)", f"pass {role} as an int",
                      **{role: global_rank})
    gr = c.pg.group_rank(global_rank)
    if gr is None:
        raise c.error(
            RankNotInGroupError,
            f"{role} is not a member of the group ({role} is a global rank)",
            f"pick {role} from the group's global ranks {list(c.pg.ranks)}, or pass group_{role}=<group rank>",
            **{role: global_rank, "group_ranks": list(c.pg.ranks)},
        )
    return gr


def resolve_peer(c: CallContext, role: str, peer: Any, group_peer: Any, *, any_source: bool) -> int | None:
    """A point-to-point peer as a group rank other than the caller's (``None``: any source, if allowed)."""
    if any_source and peer is None and group_peer is None:
        return None
    gp = resolve_root(c, role, peer, group_peer)
    if gp == c.pg.rank():
        raise c.error(DistValueError, f"a rank cannot {c.name.lstrip('i')} to or from itself",
                      f"pass a {role} other than the calling rank", **{role: c.pg.ranks[gp], "rank": c.pg.backend.rank})
    return gp


def _op_names() -> str:
    return ", ".join("ReduceOp." + o.name for o in ReduceOp)


def resolve_op(c: CallContext, op: Any, dtype: torch.dtype, *, requires_grad: bool = False) -> ReduceOp:
    """``op`` as a :class:`ReduceOp` that can reduce ``dtype`` (and, if ``requires_grad``, has a gradient).

    ``op`` may be tensorplay's ReduceOp, torch's ``ReduceOp``/``RedOpType`` or
    a name (``"sum"``).  Any other type (``op=3``) is a type mistake; a name or
    torch op that names no reduce op is a value mistake.
    """
    try:
        rop = normalize_op(op)
    except ValueError:
        # a name, or one of torch's ops (they carry .name), has the right type: an unknown one is a bad value
        if isinstance(op, str) or hasattr(op, "name"):
            raise c.error(DistValueError, "unknown reduce op", f"use one of {_op_names()}", op=op) from None
        raise c.error(DistTypeError, "op must be a ReduceOp (tensorplay's or torch's) or its name",
                      f"pass one of {_op_names()}", op=op, type=type(op).__name__) from None
    if requires_grad and rop not in DIFFERENTIABLE_OPS:
        raise c.error(
            DistTypeError, f"{rop.name} has no gradient, but the input requires grad",
            "use SUM, AVG, PRODUCT, MIN or MAX, or pass a tensor that does not require grad "
            "(x.detach(), or run under torch.no_grad())",
            op=rop, dtype=dtype, requires_grad=True)
    why = dtype_rule(rop, dtype)
    if why is not None:
        raise c.error(DistTypeError, f"{rop.name} cannot reduce this dtype", why, op=rop, dtype=dtype)
    return rop


# ---------------------------------------------------------------------------
# split sizes and shapes
# ---------------------------------------------------------------------------
def check_split_list(c: CallContext, splits: Any, argname: str) -> list[int]:
    """Explicit split sizes: a list of group-size non-negative ints (what they must add up to is checked
    by :func:`check_split_sizes`)."""
    w = c.pg.size()
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
    return list(splits)


def check_split_sizes(c: CallContext, splits: Any, argname: str, t: torch.Tensor, tname: str) -> list[int]:
    """How ``t`` splits on dim 0 into one block per group rank (``splits=None``: equal blocks)."""
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
    sizes = check_split_list(c, splits, argname)
    if sum(sizes) != n:
        raise c.error(DistValueError, f"{argname} must sum to {tname}.shape[0]",
                      f"make the sizes add up to {n}", **{argname: sizes, f"sum({argname})": sum(sizes),
                                                          f"{tname}.shape[0]": n})
    return sizes


def check_single_splits(c: CallContext, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any,
                        input_split_sizes: Any) -> tuple[list[int], list[int]]:
    """all_to_all_single's split lists, checked against both tensors on this rank: (out_splits, in_splits)."""
    ins = check_split_sizes(c, input_split_sizes, "input_split_sizes", input, "input")
    outs = check_split_sizes(c, output_split_sizes, "output_split_sizes", output, "output")
    if output.shape[1:] != input.shape[1:]:
        raise c.error(DistValueError, "output and input must agree on every dimension but the first",
                      "allocate output with input's trailing shape",
                      **{"output.shape": tuple(output.shape), "input.shape": tuple(input.shape)})
    me = c.pg.rank()
    if ins[me] != outs[me]:
        given = input_split_sizes is not None or output_split_sizes is not None
        raise c.error(DistValueError, "the rows a rank sends to itself must equal the rows it receives from itself"
                      + ("" if given else " (with no split sizes given, each tensor's first dimension is split "
                         "evenly over the group)"),
                      "make output_split_sizes[rank] == input_split_sizes[rank]" if given else
                      "allocate output with input's shape, or pass the split sizes",
                      **{f"input_split_sizes[{me}]": ins[me], f"output_split_sizes[{me}]": outs[me],
                         "input.shape": tuple(input.shape), "output.shape": tuple(output.shape)})
    return outs, ins


def check_self_block(c: CallContext, out_shape: Sequence[int], in_shape: Sequence[int]) -> None:
    """all_to_all: the block a rank receives from itself has the shape of the block it sends itself."""
    if tuple(out_shape) != tuple(in_shape):
        me = c.pg.rank()
        raise c.error(
            DistValueError,
            "the block a rank sends to itself must fit the block it receives from itself",
            "make output_tensor_list[rank] the shape of input_tensor_list[rank]",
            **{f"output_tensor_list[{me}].shape": tuple(out_shape), f"input_tensor_list[{me}].shape": tuple(in_shape)},
        )


def check_gathered_shape(c: CallContext, big: Sequence[int], small: Sequence[int], bigname: str, smallname: str,
                         *, may_be_none: bool = False) -> None:
    """``big`` holds group-size blocks of shape ``small``: concatenated on dim 0 or stacked on a new dim 0
    (all_gather_into_tensor's output, reduce_scatter_tensor's input).  ``may_be_none``: the fix offers
    ``<bigname>=None`` (the autograd door allocates it)."""
    w = c.pg.size()
    concat, stacked = gathered_shape(tuple(small), w), (w, *small)
    if tuple(big) in (concat, stacked):
        return
    fix = f"allocate {bigname} with shape {concat} (concatenated) or {stacked} (stacked)"
    raise c.error(
        DistValueError,
        f"{bigname} must hold group-size blocks shaped like {smallname} (concatenated on dim 0 or stacked on a "
        "new dim 0)",
        f"pass {bigname}=None, or {fix}" if may_be_none else fix,
        **{f"{bigname}.shape": tuple(big), f"{smallname}.shape": tuple(small), "group_size": w},
    )


# ---------------------------------------------------------------------------
# groups and ranks (new_group, get_global_rank, get_group_rank)
# ---------------------------------------------------------------------------
def check_new_group_ranks(call: str, ranks: Any, st: state.DistState) -> tuple[int, ...]:
    """new_group's ``ranks`` (``None``: the world) as sorted, unique global ranks of the world."""
    w = st.world_size
    if ranks is None:
        return tuple(range(w))
    if not isinstance(ranks, (list, tuple, range)) or not all(
        isinstance(r, int) and not isinstance(r, bool) for r in ranks
    ):
        raise DistTypeError(format_message(call, "ranks must be a list of ints (global ranks)", rank=st.rank,
                                           values={"ranks": ranks}, fix="pass e.g. ranks=[0, 2]"))
    bad = [r for r in ranks if not 0 <= r < w]
    if bad:
        raise DistValueError(format_message(call, "ranks outside the world", rank=st.rank,
                                            values={"ranks": list(ranks), "out_of_range": bad, "world_size": w},
                                            fix=f"use global ranks in [0, {w})"))
    if len(set(ranks)) != len(ranks) or not ranks:
        raise DistValueError(format_message(call, "ranks must be non-empty and unique", rank=st.rank,
                                            values={"ranks": list(ranks)}, fix="list each rank once"))
    return tuple(sorted(ranks))


def check_group_rank(c: CallContext, group_rank: Any) -> int:
    """``group_rank`` is an int naming a rank of the group."""
    if isinstance(group_rank, bool) or not isinstance(group_rank, int):
        raise c.error(DistTypeError, "group_rank must be an int", "pass a group rank as an int",
                      group_rank=group_rank)
    if not 0 <= group_rank < c.pg.size():
        raise c.error(RankNotInGroupError, "group_rank is not in the group", f"use a group rank in [0, {c.pg.size()})",
                      group_rank=group_rank, group_size=c.pg.size())
    return group_rank


def resolve_global_rank(c: CallContext, global_rank: Any) -> int:
    """The group rank of ``global_rank``, an int naming a member of the group."""
    if isinstance(global_rank, bool) or not isinstance(global_rank, int):
        raise c.error(DistTypeError, "global_rank must be an int", "pass a global rank as an int",
                      global_rank=global_rank)
    gr = c.pg.group_rank(global_rank)
    if gr is None:
        raise c.error(RankNotInGroupError, "global_rank is not a member of the group",
                      "pass one of the group's global ranks", global_rank=global_rank, group_ranks=list(c.pg.ranks))
    return gr


# ---------------------------------------------------------------------------
# life cycle: timeouts and backend names
# ---------------------------------------------------------------------------
def to_timedelta(call: str, timeout: Any, default: timedelta) -> timedelta:
    """``timeout`` (a timedelta, seconds, or ``None`` for ``default``) as a positive timedelta."""
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        td = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        td = timedelta(seconds=float(timeout))
    else:
        raise DistTypeError(
            format_message(call, "timeout must be a datetime.timedelta or seconds", values={"timeout": timeout},
                           fix="pass e.g. timeout=datetime.timedelta(seconds=60)")
        )
    if td.total_seconds() <= 0:
        raise DistValueError(
            format_message(call, "timeout must be positive", values={"timeout": td},
                           fix="pass a positive timeout; waits are always bounded")
        )
    return td


def backend_name_refusal(call: str, backend: Any, runs: Sequence[str] = ()) -> Exception | None:
    """What torch's ``init_process_group``/``new_group`` raises for this backend *name* (None: torch knows it).

    torch 2.13 checks names in ``_new_process_group_helper``: ``Backend(name)`` (a non-string is a ValueError),
    then ``BackendConfig`` (a malformed ``"device:backend,..."`` string is a ValueError), then a single name must
    be one of ``Backend.backend_type_map`` (built-in or registered with ``Backend.register_backend``) and each
    backend of a ``"device:backend"`` string a built-in one or a registered plugin, else ``AssertionError``.
    The same class is returned, torch's message first, then which names exist.  Whether a known backend is
    available here (NCCL without CUDA, MPI) is not a question of its name: the backend answers it.
    ``runs``: the names the caller runs (tensorplay's backends), accepted too and offered instead of torch's.
    Here torch's classes decide, not the module's rule (a non-string name is a ValueError): a harness that
    stands in for torch's ``init_process_group`` must raise what torch raises.
    """
    if backend is None:
        return None
    ours = {k.lower() for k in runs}
    try:
        named = str(TorchBackend(backend))
    except ValueError as e:  # not a string
        return DistValueError(f"{e}; " + format_message(call, "the backend must be a string", values={
            "backend": backend}, fix="pass e.g. backend='gloo', or 'cpu:gloo,cuda:nccl'"))
    device_form = "," in named or ":" in named
    if device_form:
        # torch warns that an unknown name's devices are unknown, then refuses it: the error says it all
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                pairs = c10d.BackendConfig(TorchBackend(named)).get_device_backend_map()
            except ValueError as e:  # malformed "device:backend,..." string
                return DistValueError(" ".join(str(e).split()) + "; " + format_message(
                    call, "malformed device:backend string", values={"backend": backend},
                    fix="write '<device>:<backend>' pairs separated by commas, each device once, e.g. "
                        "'cpu:gloo,cuda:nccl'"))
        # (UCC: a plugin if absent)
        builtin = {TorchBackend.GLOO, TorchBackend.NCCL, TorchBackend.MPI, TorchBackend.XCCL, TorchBackend.UCC}
        if not tdist.is_ucc_available():
            builtin.discard(TorchBackend.UCC)
        known = sorted(builtin | {k.lower() for k in TorchBackend._plugins} | ours)
        bad = next((str(b) for b in pairs.values() if str(b) not in known), None)
        if bad is None:
            return None
        torch_says, name = f"Unknown c10d backend type {bad.upper()}", bad
    else:
        known = sorted({str(k) for k in TorchBackend.backend_type_map if k != TorchBackend.UNDEFINED} | ours)
        if named in TorchBackend.backend_type_map or named in ours:
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


def check_backend_name(call: str, backend: Any, available: Sequence[str]) -> None:
    """Refuse what torch refuses (its class, its message first), then a name torch knows that is not one of
    ``available`` (tensorplay does not run mpi, ucc, xccl, fake); ``None`` is the default backend."""
    refusal = backend_name_refusal(call, backend, runs=available)
    if refusal is not None:
        raise refusal
    if backend is not None and (backend.split(":")[-1] if ":" in backend else backend).lower() not in available:
        raise unknown_backend(call, backend, available)


def unknown_backend(call: str, backend: str, available: Sequence[str]) -> DistValueError:
    """The error for a backend name torch knows that none of ``available`` runs (``"mpi"``)."""
    return DistValueError(format_message(call, "unknown backend", values={"backend": backend,
                                                                         "available": list(available)},
                                         fix="pass one of the available backends"))
