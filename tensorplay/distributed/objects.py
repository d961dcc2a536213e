"""Collectives of picklable Python objects, with torch.distributed's names, signatures and in-place lists.

Each function pickles its objects (plain :mod:`pickle`, as torch's ``_object_to_tensor`` does), exchanges
the byte counts first and then the bytes as ``uint8`` tensors (padded to the largest count where every rank
must send a tensor of one shape: all_gather, gather, scatter), and unpickles what arrived.  They are built
only on the public tensor collectives (:func:`~tensorplay.distributed.all_gather`, ``broadcast``,
``gather``, ``scatter``, ``send``, ``recv``), so they run on every backend: gloo, nccl and the simulator.

Every argument is checked on the calling rank before anything is sent (the lists' types and lengths, the
root, the peer, the device, whether the object pickles), with the messages of
:mod:`tensorplay.distributed.validation`.  Results are written into the caller's lists, as torch does:

* ``all_gather_object(object_list, obj)``: ``object_list[i]`` = group rank ``i``'s ``obj`` on every rank;
* ``broadcast_object_list(object_list, src)``: non-src ranks' entries replaced by src's (src's untouched);
* ``gather_object(obj, object_gather_list, dst)``: ``object_gather_list[i]`` on dst only;
* ``scatter_object_list(output_list, input_list, src)``: ``output_list[0]`` = src's ``input_list[rank]``;
* ``send_object_list`` / ``recv_object_list``: the receiver's entries replaced; ``recv_object_list``
  returns the sender's global rank.

Like torch's, these calls unpickle what other ranks send: use them only between ranks you trust.
"""
from __future__ import annotations

import pickle
from typing import Any, Optional

import torch

from .api import all_gather, broadcast, gather, isend, irecv, recv, scatter, send
from .errors import DistTypeError, DistValueError
from .group import ProcessGroup, _WorldSentinel
from .validation import CallContext, begin, resolve_peer, resolve_root

__all__ = [
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
]

GroupLike = Optional["ProcessGroup | _WorldSentinel"]
DeviceLike = Optional["torch.device | str | int"]

_LONG = torch.long
_BYTE = torch.uint8


# ---------------------------------------------------------------------------
# checks (on the calling rank, before anything is sent)
# ---------------------------------------------------------------------------
def _check_list(c: CallContext, lst: Any, argname: str, *, exact: int | None = None, writable: bool = True,
                type_error: type = DistTypeError) -> list[Any]:
    """``lst`` is a list (a tuple too where it is only read) with ``exact`` entries, or at least one."""
    kinds = (list,) if writable else (list, tuple)
    if not isinstance(lst, kinds):
        what = "a list" if writable else "a list or tuple"
        raise c.error(type_error, f"{argname} must be {what}",
                      "pass a list (the call writes its results into it)" if writable else "pass a list",
                      **{f"type({argname})": type(lst).__name__})
    if exact is not None and len(lst) != exact:
        raise c.error(DistValueError, f"{argname} must have one entry per group rank",
                      f"pass a list of exactly {exact} entries (e.g. [None] * {exact})",
                      **{f"len({argname})": len(lst), "group_size": exact})
    if exact is None and not lst:
        raise c.error(DistValueError, f"{argname} must not be empty", "pass a list of at least one entry",
                      **{f"len({argname})": 0})
    return lst  # type: ignore[no-any-return]


def _no_list_off_root(c: CallContext, lst: Any, argname: str, role: str, root: int) -> None:
    """Ranks other than the root pass no list (torch: ``must NOT be specified on non-destination ranks``)."""
    if lst:
        shown = {f"len({argname})": len(lst)} if hasattr(lst, "__len__") else {argname: lst}
        raise c.error(DistValueError, f"{argname} may only be given on the {role} rank",
                      f"pass {argname}=None on ranks other than {role}={c.pg.ranks[root]}",
                      **{role: c.pg.ranks[root], **shown})


def _device(c: CallContext, device: Any) -> torch.device:
    """The device the byte tensors live on: ``device``, else the CPU when the backend takes it (gloo, sim),
    else the current CUDA device (nccl), as torch's ``_get_object_coll_device`` picks."""
    if device is None:
        cpu = torch.device("cpu")
        if c.pg.backend.supports_device(cpu) or not torch.cuda.is_available():
            return cpu
        return torch.device("cuda", torch.cuda.current_device())
    try:
        dev = torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        raise c.error(DistTypeError, "device must be a torch.device, a device string or a CUDA index",
                      "pass e.g. device=torch.device('cpu') or device='cuda:0'", device=device) from None
    if not c.pg.backend.supports_device(dev):
        raise c.error(DistValueError, f"device is one the {c.pg.backend.name!r} backend cannot use",
                      "pass device=None (the backend's default) or a device the backend runs on",
                      device=str(dev), backend=c.pg.backend.name)
    return dev


def _to_bytes(c: CallContext, obj: Any, argname: str, device: torch.device) -> torch.Tensor:
    """``obj`` pickled, as a 1-d uint8 tensor on ``device`` (a pickling failure names the argument)."""
    try:
        data = pickle.dumps(obj)
    except Exception as e:  # noqa: BLE001  (pickle raises PicklingError, TypeError, AttributeError, ...)
        raise c.error(DistTypeError, f"{argname} cannot be pickled ({type(e).__name__}: {e})",
                      "pass objects that pickle (module-level classes and functions, no locks, sockets or "
                      "lambdas)", **{f"type({argname})": type(obj).__name__}) from e
    return torch.frombuffer(bytearray(data), dtype=_BYTE).to(device)


def _from_bytes(t: torch.Tensor, size: Any) -> Any:
    """The object pickled in the first ``size`` bytes of ``t``."""
    return pickle.loads(t[: int(size)].cpu().numpy().tobytes())  # noqa: S301  (torch's semantics: trusted ranks)


def _padded(t: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=_BYTE, device=t.device)
    out[: t.numel()] = t
    return out


def _gather_sizes(c: CallContext, data: torch.Tensor, device: torch.device) -> list[int]:
    """Every group rank's byte count (all_gather of one long each)."""
    sizes = [torch.zeros(1, dtype=_LONG, device=device) for _ in range(c.pg.size())]
    all_gather(sizes, torch.tensor([data.numel()], dtype=_LONG, device=device), group=c.pg)
    return [int(s.item()) for s in sizes]


# ---------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------
def all_gather_object(object_list: list[Any], obj: Any, group: GroupLike = None) -> None:
    """Every rank gets every rank's ``obj``: ``object_list[i]`` = group rank ``i``'s object (in place).

    ``object_list`` must have one entry per group rank on every rank; its entries are replaced
    (the calling rank's own entry too, by an unpickled copy).

    Example (3 ranks)::

        >>> out = [None] * dist.get_world_size()
        >>> dist.all_gather_object(out, {"rank": dist.get_rank(), "sq": dist.get_rank() ** 2})
        >>> out                      # on every rank
        [{'rank': 0, 'sq': 0}, {'rank': 1, 'sq': 1}, {'rank': 2, 'sq': 4}]
    """
    c = begin("all_gather_object", group)
    w = c.pg.size()
    _check_list(c, object_list, "object_list", exact=w)
    dev = _device(c, None)
    data = _to_bytes(c, obj, "obj", dev)
    sizes = _gather_sizes(c, data, dev)
    n = max(sizes)
    outs = [torch.empty(n, dtype=_BYTE, device=dev) for _ in range(w)]
    all_gather(outs, _padded(data, n), group=c.pg)
    for i, (t, size) in enumerate(zip(outs, sizes)):
        object_list[i] = _from_bytes(t, size)


def broadcast_object_list(object_list: list[Any], src: int | None = None, group: GroupLike = None,
                          device: DeviceLike = None, group_src: int | None = None) -> None:
    """Replace the entries of ``object_list`` on every rank by ``src``'s (default: global rank 0; in place).

    Every rank passes a list of the same length; only ``src``'s entries are read.  ``device``: where the
    byte tensors travel (default: the CPU, or the current CUDA device on nccl).

    Example (3 ranks)::

        >>> objs = ["cfg", 3, {"lr": 0.1}] if dist.get_rank() == 1 else [None, None, None]
        >>> dist.broadcast_object_list(objs, src=1)
        >>> objs                     # on every rank
        ['cfg', 3, {'lr': 0.1}]
    """
    c = begin("broadcast_object_list", group)
    root = resolve_root(c, "src", src, group_src, default=0)
    _check_list(c, object_list, "object_list")
    dev = _device(c, device)
    me = c.pg.rank()
    if me == root:
        datas = [_to_bytes(c, o, f"object_list[{i}]", dev) for i, o in enumerate(object_list)]
        sizes = torch.tensor([d.numel() for d in datas], dtype=_LONG, device=dev)
    else:
        sizes = torch.empty(len(object_list), dtype=_LONG, device=dev)
    broadcast(sizes, group=c.pg, group_src=root)
    payload = torch.cat(datas) if me == root else torch.empty(int(sizes.sum()), dtype=_BYTE, device=dev)
    broadcast(payload, group=c.pg, group_src=root)
    if me != root:
        offset = 0
        for i, size in enumerate(sizes.tolist()):
            object_list[i] = _from_bytes(payload[offset:offset + size], size)
            offset += size


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: GroupLike = None, group_dst: int | None = None) -> None:
    """Collect every rank's ``obj`` into ``object_gather_list`` on ``dst`` (default: global rank 0; in place).

    ``dst`` passes a list of one entry per group rank; the other ranks pass ``None``.

    Example (3 ranks)::

        >>> r = dist.get_rank()
        >>> out = [None] * 3 if r == 0 else None
        >>> dist.gather_object(("rank", r), out, dst=0)
        >>> r != 0 or out == [("rank", 0), ("rank", 1), ("rank", 2)]    # rank 0 holds every rank's object
        True
    """
    c = begin("gather_object", group)
    root = resolve_root(c, "dst", dst, group_dst, default=0)
    w, me = c.pg.size(), c.pg.rank()
    if me == root:
        if not object_gather_list:
            raise c.error(DistValueError, "object_gather_list is required on the dst rank",
                          f"pass a list of {w} entries (e.g. [None] * {w}) on dst={c.pg.ranks[root]}",
                          object_gather_list=object_gather_list)
        _check_list(c, object_gather_list, "object_gather_list", exact=w)
    else:
        _no_list_off_root(c, object_gather_list, "object_gather_list", "dst", root)
    dev = _device(c, None)
    data = _to_bytes(c, obj, "obj", dev)
    # an all-gather of the sizes, not a gather: every rank must send a tensor of the largest size
    sizes = _gather_sizes(c, data, dev)
    n = max(sizes)
    outs = [torch.empty(n, dtype=_BYTE, device=dev) for _ in range(w)] if me == root else None
    gather(_padded(data, n), outs, group=c.pg, group_dst=root)
    if outs is not None:
        for i, (t, size) in enumerate(zip(outs, sizes)):
            object_gather_list[i] = _from_bytes(t, size)  # type: ignore[index]


def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: GroupLike = None, group_src: int | None = None) -> None:
    """Send ``src``'s ``scatter_object_input_list[i]`` to group rank ``i``'s ``scatter_object_output_list[0]``.

    ``src`` (default: global rank 0) passes one object per group rank; the input list of every other rank
    is ignored, as torch does.  The output list needs at least one entry.

    Example (3 ranks)::

        >>> out = [None]
        >>> parts = [{"shard": i} for i in range(3)] if dist.get_rank() == 0 else None
        >>> dist.scatter_object_list(out, parts, src=0)
        >>> out == [{"shard": dist.get_rank()}]                 # rank i got parts[i]
        True
    """
    c = begin("scatter_object_list", group)
    root = resolve_root(c, "src", src, group_src, default=0)
    # torch raises ValueError for a non-list here
    _check_list(c, scatter_object_output_list, "scatter_object_output_list", type_error=DistValueError)
    w, me = c.pg.size(), c.pg.rank()
    dev = _device(c, None)
    blocks: list[torch.Tensor] | None = None
    sizes: list[torch.Tensor] | None = None
    if me == root:
        if scatter_object_input_list is None:
            raise c.error(DistValueError, "scatter_object_input_list is required on the src rank",
                          f"pass a list of {w} objects (one per group rank) on src={c.pg.ranks[root]}",
                          scatter_object_input_list=None)
        _check_list(c, scatter_object_input_list, "scatter_object_input_list", exact=w, writable=False)
        datas = [_to_bytes(c, o, f"scatter_object_input_list[{i}]", dev)
                 for i, o in enumerate(scatter_object_input_list)]
        n = max(d.numel() for d in datas)
        blocks = [_padded(d, n) for d in datas]
        sizes = [torch.tensor([d.numel()], dtype=_LONG, device=dev) for d in datas]
        longest = torch.tensor([n], dtype=_LONG, device=dev)
    else:
        longest = torch.zeros(1, dtype=_LONG, device=dev)
    broadcast(longest, group=c.pg, group_src=root)
    out = torch.empty(int(longest.item()), dtype=_BYTE, device=dev)
    scatter(out, blocks, group=c.pg, group_src=root)
    size = torch.zeros(1, dtype=_LONG, device=dev)
    scatter(size, sizes, group=c.pg, group_src=root)
    scatter_object_output_list[0] = _from_bytes(out, size.item())


# ---------------------------------------------------------------------------
# point to point
# ---------------------------------------------------------------------------
def _p2p(send_side: bool, t: torch.Tensor, c: CallContext, peer: int | None, use_batch: bool) -> int:
    """One send or receive of ``t`` with group rank ``peer``; the peer's group rank.  ``use_batch``: through
    :func:`batch_isend_irecv`, as torch's ``use_batch=True`` does (a receive from any source cannot be
    batched: it is a plain one)."""
    if use_batch and peer is not None:
        from .p2p_batch import P2POp, batch_isend_irecv

        op = P2POp(isend if send_side else irecv, t, group=c.pg, group_peer=peer)
        batch_isend_irecv([op]).pop().wait()
        return peer
    if send_side:
        send(t, group=c.pg, group_dst=peer)
        return peer  # type: ignore[return-value]
    sender = recv(t, group=c.pg, group_src=peer)
    return c.pg.group_rank(sender)  # type: ignore[return-value]


def send_object_list(object_list: list[Any], dst: int | None = None, group: GroupLike = None,
                     device: DeviceLike = None, group_dst: int | None = None, use_batch: bool = False) -> None:
    """Send the objects of ``object_list`` to ``dst``, which receives them with :func:`recv_object_list`.

    ``device``: where the byte tensors travel (default: the CPU, or the current CUDA device on nccl);
    ``use_batch``: send through :func:`batch_isend_irecv`.

    Example (2 ranks)::

        >>> if dist.get_rank() == 0:
        ...     dist.send_object_list([{"step": 7}, "done"], dst=1)
        ... else:
        ...     box = [None, None]
        ...     sender = dist.recv_object_list(box, src=0)
        >>> dist.get_rank() == 0 or (sender, box) == (0, [{"step": 7}, "done"])
        True
    """
    c = begin("send_object_list", group)
    peer = resolve_peer(c, "dst", dst, group_dst, any_source=False)
    _check_list(c, object_list, "object_list", writable=False)
    dev = _device(c, device)
    datas = [_to_bytes(c, o, f"object_list[{i}]", dev) for i, o in enumerate(object_list)]
    _p2p(True, torch.tensor([d.numel() for d in datas], dtype=_LONG, device=dev), c, peer, use_batch)
    _p2p(True, torch.cat(datas), c, peer, use_batch)


def recv_object_list(object_list: list[Any], src: int | None = None, group: GroupLike = None,
                     device: DeviceLike = None, group_src: int | None = None, use_batch: bool = False) -> int:
    """Receive :func:`send_object_list`'s objects into ``object_list`` (in place); returns the sender's global
    rank.

    ``object_list`` has as many entries as the sender sends.  ``src=None`` (and no ``group_src``) receives
    from any sender, as torch's documentation promises (torch 2.13's code refuses it); both messages of one
    send then come from that sender.

    Example (3 ranks)::

        >>> r = dist.get_rank()
        >>> if r == 0:                       # any source: the return value says who sent
        ...     got = {}
        ...     for _ in range(2):
        ...         box = [None]
        ...         sender = dist.recv_object_list(box)
        ...         got[sender] = box[0]
        ... else:
        ...     dist.send_object_list([f"hello from {r}"], dst=0)
        >>> r != 0 or got == {1: "hello from 1", 2: "hello from 2"}
        True
    """
    c = begin("recv_object_list", group)
    peer = resolve_peer(c, "src", src, group_src, any_source=True)
    _check_list(c, object_list, "object_list")
    dev = _device(c, device)
    sizes = torch.empty(len(object_list), dtype=_LONG, device=dev)
    sender = _p2p(False, sizes, c, peer, use_batch)
    payload = torch.empty(int(sizes.sum()), dtype=_BYTE, device=dev)
    _p2p(False, payload, c, sender, use_batch)  # the bytes from the rank that sent the sizes
    offset = 0
    for i, size in enumerate(sizes.tolist()):
        object_list[i] = _from_bytes(payload[offset:offset + size], size)
        offset += size
    return c.pg.ranks[sender]
