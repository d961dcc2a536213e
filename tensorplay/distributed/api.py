"""Process groups and blocking/async collectives with torch.distributed's signatures.

Every function here does the same three things, in order:

1. resolve the group and check the caller is initialised and a member;
2. validate every argument on this rank (types, devices, list lengths, split
   sizes, dtype/op, src/dst membership) and raise a :class:`DistError` naming
   the collective, the group, the rank and the offending values *before*
   anything is sent (the checks, and which error class each mistake gets,
   live in :mod:`tensorplay.distributed.validation`, shared with the autograd
   collectives of :mod:`tensorplay.distributed.nn.functional`);
3. convert global ``src``/``dst`` to group ranks and hand the call to the
   group's backend.

Backends therefore see only group ranks and well-formed arguments.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch

from . import state
from .backends import ChainedWork, Work, get_backend_class, registered
from .errors import UnknownBackendError  # noqa: F401  (defined here before; importers of api.UnknownBackendError)
from .group import ProcessGroup, _WorldSentinel
from .reduce_op import ReduceOp
from .state import DistState, install_backend
from .validation import (
    CallContext,
    backend_name_refusal,
    begin,
    check_async_op,
    check_backend_name,
    check_gathered_shape,
    check_group_rank,
    check_new_group_ranks,
    check_no_list_off_root,
    check_one_dtype,
    check_same_dtype,
    check_self_block,
    check_single_splits,
    check_tag,
    check_tensor,
    check_tensor_list,
    require_root_list,
    require_state,
    resolve_global_rank,
    resolve_group,
    resolve_op,
    resolve_peer,
    resolve_root,
    to_timedelta,
    unknown_backend,
)

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
# life cycle and queries
# ---------------------------------------------------------------------------
def _install_backend(backend: Any, timeout: timedelta = DEFAULT_TIMEOUT, *, thread_local: bool = False) -> DistState:
    """Former private name of :func:`tensorplay.distributed.state.install_backend` (kept for harnesses that
    still call it)."""
    return install_backend(backend, timeout, thread_local=thread_local)


#: former private name of :func:`tensorplay.distributed.validation.backend_name_refusal`
_backend_name_refusal = backend_name_refusal


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
    it joins the world started for the program and returns at once (a
    script under ``python -m simulator``, as under torchrun, has no default
    group before this call); after ``destroy_process_group()`` it makes the
    default group again on that world.

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
    st = state.current()
    if st is not None:
        # the backend decides: a process group refuses, a world started for the program checks the values
        st.backend.check_reinit(rank, world_size)
        # a world started for the program still refuses what a real run does
        check_backend_name(name, backend, registered())
        st.backend.joined(backend, timeout)
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.distributed.is_nccl_available() else "gloo"
    check_backend_name(name, backend, registered())
    td = to_timedelta(name, timeout, DEFAULT_TIMEOUT)
    left = state.rejoin(td)  # a simulated rank whose program destroyed its group: the world is still its own
    if left is not None:
        try:
            left.backend.check_reinit(rank, world_size)
            left.backend.joined(backend, timeout)
        except Exception:
            state.uninstall(left)
            raise
        return
    try:
        cls = get_backend_class(backend.split(":")[-1] if ":" in backend else backend)
    except KeyError:  # listed, but its module did not register it
        raise unknown_backend(name, backend, registered()) from None
    b = cls.create(rank=rank, world_size=world_size, init_method=init_method, store=store, timeout=td)
    install_backend(b, td)


def destroy_process_group(group: GroupLike = None) -> None:
    """Destroy ``group``; with no argument (or ``group.WORLD``) shut the whole backend down."""
    st = state.current()
    if st is None or st.backend.awaiting_init:  # (nothing to destroy before init_process_group, as on gloo)
        return
    if group is None or isinstance(group, _WorldSentinel) or group is st.world:
        try:
            st.backend.shutdown()
        finally:
            state.uninstall(st)
            st.groups.clear()
        st.backend.released()
        return
    if isinstance(group, ProcessGroup) and group in st.groups:
        st.groups.remove(group)


def is_initialized() -> bool:
    """Whether the calling rank has a default process group."""
    st = state.current()
    return st is not None and not st.backend.awaiting_init


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
    _, pg = resolve_group("get_rank", group, member=False)
    return pg.rank()


def get_world_size(group: GroupLike = None) -> int:
    """Number of ranks in ``group``; -1 when the caller is not a member (as torch does)."""
    _, pg = resolve_group("get_world_size", group, member=False)
    return pg.size() if pg.rank() >= 0 else -1


def get_backend(group: GroupLike = None) -> str:
    """Name of the backend running ``group`` (``"gloo"``, ``"nccl"`` or ``"sim"``)."""
    _, pg = resolve_group("get_backend", group, member=False)
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
    st = require_state(name)
    sorted_ranks = check_new_group_ranks(name, ranks, st)
    td = to_timedelta(name, timeout, timedelta(seconds=st.timeout_s))
    handle = st.backend.new_group_handle(sorted_ranks, td)
    pg = ProcessGroup(sorted_ranks, st.backend, handle, group_id=len(st.groups) + 1)
    st.groups.append(pg)
    return pg


def get_process_group_ranks(group: GroupLike) -> list[int]:
    """Global ranks of ``group`` in group-rank order."""
    _, pg = resolve_group("get_process_group_ranks", group, member=False)
    return list(pg.ranks)


def get_global_rank(group: GroupLike, group_rank: int) -> int:
    """Global rank of ``group_rank`` in ``group``.

    Example (4 ranks)::

        >>> g = dist.new_group([3, 1])
        >>> dist.get_global_rank(g, 0), dist.get_global_rank(g, 1)
        (1, 3)
    """
    _, pg = resolve_group("get_global_rank", group, member=False)
    return pg.ranks[check_group_rank(CallContext("get_global_rank", pg), group_rank)]


def get_group_rank(group: GroupLike, global_rank: int) -> int:
    """Group rank of ``global_rank`` in ``group``.

    Example (4 ranks)::

        >>> g = dist.new_group([3, 1])
        >>> dist.get_group_rank(g, 1), dist.get_group_rank(g, 3)
        (0, 1)
    """
    _, pg = resolve_group("get_group_rank", group, member=False)
    return resolve_global_rank(CallContext("get_group_rank", pg), global_rank)


# ---------------------------------------------------------------------------
# collectives
# ---------------------------------------------------------------------------
def barrier(group: GroupLike = None, async_op: bool = False, device_ids: Any = None) -> Work | None:
    """Block until every rank of ``group`` reached the barrier.

    Example (2 ranks)::

        >>> dist.barrier()              # both ranks wait for the slower one
    """
    c = begin("barrier", group)
    check_async_op(c, async_op)
    return c.pg.backend.barrier(c.pg, async_op)


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
    c = begin("broadcast", group)
    check_tensor(c, tensor, "tensor")
    check_async_op(c, async_op)
    root = resolve_root(c, "src", src, group_src)
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
    c = begin("all_reduce", group)
    check_tensor(c, tensor, "tensor")
    check_async_op(c, async_op)
    rop = resolve_op(c, op, tensor.dtype)
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
    c = begin("reduce", group)
    check_tensor(c, tensor, "tensor")
    check_async_op(c, async_op)
    rop = resolve_op(c, op, tensor.dtype)
    root = resolve_root(c, "dst", dst, group_dst)
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
    c = begin("all_gather", group)
    check_tensor(c, tensor, "tensor")
    check_async_op(c, async_op)
    outs = check_tensor_list(c, tensor_list, "tensor_list", tensor, same_shape=True)
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
    c = begin("all_gather_into_tensor", group)
    check_tensor(c, output_tensor, "output_tensor")
    check_tensor(c, input_tensor, "input_tensor")
    check_async_op(c, async_op)
    check_same_dtype(c, output_tensor, "output_tensor", input_tensor, "input_tensor")
    check_gathered_shape(c, output_tensor.shape, input_tensor.shape, "output_tensor", "input_tensor")
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
    c = begin("gather", group)
    check_tensor(c, tensor, "tensor")
    check_async_op(c, async_op)
    root = resolve_root(c, "dst", dst, group_dst, default=0)
    if c.pg.rank() == root:
        gl = require_root_list(c, gather_list, "gather_list", "dst", tensor)
    else:
        check_no_list_off_root(c, gather_list, "gather_list", "dst", c.pg.ranks[root])
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
    c = begin("scatter", group)
    check_tensor(c, tensor, "tensor")
    check_async_op(c, async_op)
    root = resolve_root(c, "src", src, group_src, default=0)
    if c.pg.rank() == root:
        sl = require_root_list(c, scatter_list, "scatter_list", "src", tensor)
    else:
        check_no_list_off_root(c, scatter_list, "scatter_list", "src", c.pg.ranks[root])
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
    c = begin("reduce_scatter", group)
    check_tensor(c, output, "output")
    check_async_op(c, async_op)
    ins = check_tensor_list(c, input_list, "input_list", output, same_shape=True)
    rop = resolve_op(c, op, output.dtype)
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
    c = begin("reduce_scatter_tensor", group)
    check_tensor(c, output, "output")
    check_tensor(c, input, "input")
    check_async_op(c, async_op)
    check_same_dtype(c, output, "output", input, "input")
    check_gathered_shape(c, input.shape, output.shape, "input", "output")
    rop = resolve_op(c, op, output.dtype)
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
    c = begin("all_to_all", group)
    check_async_op(c, async_op)
    ins = check_tensor_list(c, input_tensor_list, "input_tensor_list")
    outs = check_tensor_list(c, output_tensor_list, "output_tensor_list")
    check_one_dtype(c, ins[0], "input_tensor_list[0]", ("input_tensor_list", ins), ("output_tensor_list", outs))
    me = c.pg.rank()
    check_self_block(c, outs[me].shape, ins[me].shape)
    return c.pg.backend.all_to_all(outs, ins, c.pg, async_op)


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
    c = begin("all_to_all_single", group)
    check_tensor(c, output, "output")
    check_tensor(c, input, "input")
    check_async_op(c, async_op)
    check_same_dtype(c, output, "output", input, "input")
    outs, ins = check_single_splits(c, output, input, output_split_sizes, input_split_sizes)
    return c.pg.backend.all_to_all_single(output, input, outs, ins, c.pg, async_op)


# ---------------------------------------------------------------------------
# point to point
# ---------------------------------------------------------------------------
def _p2p_args(name: str, tensor: Any, group: GroupLike, tag: Any, role: str, peer: Any, group_peer: Any,
              any_source: bool) -> tuple[CallContext, int | None]:
    c = begin(name, group)
    check_tensor(c, tensor, "tensor")
    check_tag(c, tag)
    return c, resolve_peer(c, role, peer, group_peer, any_source=any_source)


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
