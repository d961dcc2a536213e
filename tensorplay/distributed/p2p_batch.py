"""Batched point-to-point operations: torch.distributed's ``P2POp`` and ``batch_isend_irecv``.

A :class:`P2POp` describes one :func:`~tensorplay.distributed.isend` or
:func:`~tensorplay.distributed.irecv` (tensorplay's or torch's function: they are told apart by name, and
tensorplay's runs either way, so the batch works on every backend).  Its arguments are checked when it is
built, as torch checks them (the op, the tensor, the tag, the peer), and its group and peer are resolved
then: ``op.group`` is the group (the world for ``None``), ``op.peer`` the global rank and ``op.group_peer``
the group rank of the peer.  :func:`batch_isend_irecv` checks the whole list before it issues anything, then
issues the operations in order and returns their works.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from . import api
from .backends import Work
from .errors import DistValueError, format_message
from .group import ProcessGroup, _WorldSentinel
from .validation import CallContext, begin, check_tag, check_tensor, require_state, resolve_root

__all__ = ["P2POp", "batch_isend_irecv"]

GroupLike = Optional["ProcessGroup | _WorldSentinel"]

#: the functions a P2POp may name, and the modules they may come from (ours, or torch's own)
_OPS = ("isend", "irecv")
_MODULES = ("tensorplay.distributed", "torch.distributed")


def _op_name(op: Any) -> str | None:
    """``"isend"`` or ``"irecv"`` when ``op`` is tensorplay's or torch's function of that name, else None."""
    name = getattr(op, "__name__", None)
    module = getattr(op, "__module__", None) or ""
    if callable(op) and name in _OPS and module.startswith(_MODULES):
        return name  # type: ignore[no-any-return]
    return None


class P2POp:
    """One point-to-point operation for :func:`batch_isend_irecv` (torch.distributed's signature).

    ``op`` is ``isend`` or ``irecv`` (``tensorplay.distributed``'s or ``torch.distributed``'s), ``tensor``
    the tensor to send or receive into, ``peer`` the other rank as a global rank (or ``group_peer`` as a
    group rank of ``group``), ``tag`` matches a send with a receive.  A bad argument raises here, before
    any operation of the batch is issued; so does a peer that is the calling rank.

    Example (2 ranks)::

        >>> r = dist.get_rank()
        >>> op = dist.P2POp(dist.isend, tp.zeros(2), peer=1 - r)
        >>> (op.peer, op.group_peer, op.tag) == (1 - r, 1 - r, 0)
        True
    """

    def __init__(self, op: Callable[..., Any], tensor: torch.Tensor, peer: int | None = None,
                 group: GroupLike = None, tag: int = 0, group_peer: int | None = None) -> None:
        c = begin("P2POp", group)
        name = _op_name(op)
        if name is None:
            raise c.error(DistValueError, "op must be isend or irecv (tensorplay.distributed's or torch.distributed's)",
                          "pass op=dist.isend or op=dist.irecv", op=op)
        check_tensor(c, tensor, "tensor")
        check_tag(c, tag)
        gp = resolve_root(c, "peer", peer, group_peer)
        if gp == c.pg.rank():
            raise c.error(DistValueError, f"a rank cannot {name.lstrip('i')} to or from itself",
                          "pass a peer other than the calling rank", peer=c.pg.ranks[gp], rank=c.pg.backend.rank)
        self.op = op
        self.tensor = tensor
        self.group: ProcessGroup = c.pg
        self.peer: int = c.pg.ranks[gp]
        self.tag = tag
        self.group_peer: int = gp

    def __repr__(self) -> str:
        name = _op_name(self.op)
        me = self.group.rank()
        s, d = (me, self.group_peer) if name == "isend" else (self.group_peer, me)
        return (f"P2POp({name} group={list(self.group.ranks)}, group_src={s}, group_dst={d}, "
                f"{tuple(self.tensor.shape)}, {self.tensor.dtype})")


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Issue every :class:`P2POp` of ``p2p_op_list`` in order; their works, in the same order.

    The list must be a non-empty list of P2POp on one group (as torch checks, with ``ValueError``s); it is
    checked whole before the first operation is issued.  Every rank's batch must match its peers' (each
    send has a receive of the same shape), as with separate ``isend``/``irecv`` calls.

    Example (4 ranks; a ring: each rank sends to the next and receives from the previous)::

        >>> r, W = dist.get_rank(), dist.get_world_size()
        >>> out, got = tp.tensor([10. * r]), tp.zeros(1)
        >>> ops = [dist.P2POp(dist.isend, out, (r + 1) % W), dist.P2POp(dist.irecv, got, (r - 1) % W)]
        >>> [w.wait() for w in dist.batch_isend_irecv(ops)]
        [True, True]
        >>> got.tolist() == [10. * ((r - 1) % W)]
        True
    """
    name = "batch_isend_irecv"
    st = require_state(name)

    def refuse(problem: str, fix: str, **values: Any) -> DistValueError:
        return DistValueError(format_message(name, problem, rank=st.rank, values=values, fix=fix))

    if not isinstance(p2p_op_list, list):
        raise refuse("p2p_op_list must be a list of P2POp", "pass a list of dist.P2POp(...)",
                     **{"type(p2p_op_list)": type(p2p_op_list).__name__})
    if not p2p_op_list:
        raise refuse("p2p_op_list must not be empty", "pass at least one dist.P2POp(...)", p2p_op_list=[])
    for i, op in enumerate(p2p_op_list):
        if not isinstance(op, P2POp):
            raise refuse("every entry of p2p_op_list must be a P2POp", "wrap each operation in dist.P2POp(...)",
                         **{f"type(p2p_op_list[{i}])": type(op).__name__})
    first = p2p_op_list[0].group
    c = CallContext(name, first)
    for i, op in enumerate(p2p_op_list):
        if op.group is not first:
            raise c.error(DistValueError, "every op of the batch must use the same group",
                          "issue the operations of each group in a batch of their own",
                          **{"p2p_op_list[0].group": first, f"p2p_op_list[{i}].group": op.group})
    works: list[Work] = []
    for op in p2p_op_list:
        if _op_name(op.op) == "isend":
            works.append(api.isend(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer))
        else:
            works.append(api.irecv(op.tensor, group=op.group, tag=op.tag, group_src=op.group_peer))
    return works
