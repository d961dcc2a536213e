"""The ``gloo`` and ``nccl`` backends, on torch's c10d.

Thin by design: arguments arrive validated and in group ranks, and map onto
torch.distributed calls with ``group_src``/``group_dst``.  What c10d lacks is
filled in here, once, for every caller:

* list ``all_to_all`` with ragged shapes runs as a single
  ``all_to_all_single`` over flattened buffers (torch's gloo path raises, and
  its emulation costs W scatters);
* reductions a library cannot do natively (PRODUCT on complex, bitwise ops on
  NCCL) gather the contributions and reduce locally in rank order;
* non-contiguous tensors are staged through a contiguous buffer;
* stacked outputs of all-gather / inputs of reduce-scatter are viewed as the
  concatenated layout c10d expects.
"""
from __future__ import annotations

import atexit
import gc
import ipaddress
import os
import socket
from datetime import timedelta
from typing import Any, Callable

from urllib.parse import urlparse

import torch
import torch.distributed as tdist
import torch._C._distributed_c10d as _c10d

from .. import _kernels
from .._rendezvous import bound_tcp_store
from ..errors import DistBackendError, DistTimeoutError, format_message
from ..group import ProcessGroup
from ..reduce_op import ReduceOp
from . import _peers, register_backend
from .base import Backend, ChainedWork, Work

__all__ = ["C10dBackend", "GlooBackend", "NcclBackend"]

_TORCH_OP = {
    ReduceOp.SUM: tdist.ReduceOp.SUM,
    ReduceOp.AVG: tdist.ReduceOp.AVG,
    ReduceOp.PRODUCT: tdist.ReduceOp.PRODUCT,
    ReduceOp.MIN: tdist.ReduceOp.MIN,
    ReduceOp.MAX: tdist.ReduceOp.MAX,
    ReduceOp.BAND: tdist.ReduceOp.BAND,
    ReduceOp.BOR: tdist.ReduceOp.BOR,
    ReduceOp.BXOR: tdist.ReduceOp.BXOR,
}
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
#: list all_to_all: from this many elements a block, uniform blocks travel by W zero-copy scatters
_SCATTER_BLOCK_NUMEL = 1 << 16

# torch 2.13 renamed the tensor variants; use the new names where they exist.
_all_gather_tensor = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor


def _finish(work: Any, async_op: bool, after: Callable[[], None] | None) -> Work | None:
    """Return torch's work (async) or nothing (blocking), running ``after`` once the data is there."""
    if not async_op:
        if after is not None:
            after()
        return None
    if after is None:
        return work
    return ChainedWork(work, after)


def _staged(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A contiguous stand-in for ``t`` and the copy-back to run after the op (if one was needed)."""
    if t.is_contiguous():
        return t, None
    buf = t.contiguous()
    return buf, lambda: t.copy_(buf)


def _bound_rendezvous(init_method: str | None, rank: int, world_size: int,
                      timeout: timedelta) -> tuple[Any, int, int] | None:
    """For ``env://`` and ``tcp://host:port``: a store rank 0 serves on ``host`` only (not every interface).

    Returns ``None`` where torch's own rendezvous should run: under torchrun's
    agent store, for other schemes, or when rank/world size are unknown (torch
    then raises its usual message).
    """
    url = urlparse(init_method or "env://")
    if url.scheme == "env":
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return None
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        rank = rank if rank >= 0 else int(os.environ.get("RANK", -1))
        world_size = world_size if world_size >= 0 else int(os.environ.get("WORLD_SIZE", -1))
    elif url.scheme == "tcp":
        host, port = url.hostname, url.port
    else:
        return None
    if not host or not port or rank < 0 or world_size < 1:
        return None
    store = bound_tcp_store(host, int(port), rank, world_size, timeout, caller="init_process_group")
    return store, rank, world_size


def _default_store() -> Any:
    """The default group's store (``None`` when torch does not expose it)."""
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001
        return None


def _rendezvous_host(init_method: str | None) -> str | None:
    url = urlparse(init_method or "env://")
    if url.scheme == "env":
        return os.environ.get("MASTER_ADDR")
    return url.hostname


def _loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), if one is found."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return next((n for n in names if n.startswith("lo")), None)


def _pin_gloo_to_loopback(init_method: str | None) -> None:
    """A world whose rendezvous is on loopback is local: gloo listens on loopback too, not on the hostname's address.

    gloo picks its listening address from ``GLOO_SOCKET_IFNAME`` or else the
    address the hostname resolves to, which on most machines is reachable from
    the network; a world rendezvousing on 127.0.0.1 never needs that.  An
    explicit ``GLOO_SOCKET_IFNAME`` is left alone.
    """
    host = _rendezvous_host(init_method)
    if not host or "GLOO_SOCKET_IFNAME" in os.environ:
        return
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return
    lo = _loopback_interface() if loopback else None
    if lo is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = lo  # also for the groups created later in this process


def _real(t: torch.Tensor) -> torch.Tensor:
    """Complex tensors travel as (real, imag) pairs, as torch's wrappers send them."""
    return torch.view_as_real(t) if t.is_complex() else t


def _gather_flat(out: torch.Tensor, src: torch.Tensor, group: ProcessGroup, async_op: bool) -> Any:
    """All-gather of 1-d ``src`` into 1-d ``out``; like torch's wrapper (work if async, else waits, None)."""
    if out.is_cuda:
        return _all_gather_tensor(out, src, group=group.handle, async_op=async_op)
    opts = _c10d.AllgatherOptions()  # the ProcessGroup method directly, as in all_reduce
    opts.asyncOp = async_op
    pg = group.handle
    call = getattr(pg, "all_gather_single", None) or pg._allgather_base
    return _blocking(call(_real(out), _real(src), opts), async_op)


def _reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, op: ReduceOp, group: ProcessGroup,
                         async_op: bool) -> Any:
    """Reduce-scatter of 1-d ``inp`` into 1-d ``out``; like torch's wrapper (work if async, else waits, None)."""
    if out.is_cuda:
        return _reduce_scatter_tensor(out, inp, op=_TORCH_OP[op], group=group.handle, async_op=async_op)
    opts = tdist.ReduceScatterOptions()
    opts.reduceOp = _TORCH_OP[op]
    opts.asyncOp = async_op
    pg = group.handle
    call = getattr(pg, "reduce_scatter_single", None) or pg._reduce_scatter_base
    return _blocking(call(out, inp, opts), async_op)


def _equal_splits(splits: list[int], rows: int) -> bool:
    """Whether ``splits`` cut ``rows`` into equal chunks (what empty split lists mean to c10d)."""
    return bool(splits) and rows == splits[0] * len(splits) and all(s == splits[0] for s in splits)


def _blocking(work: Any, async_op: bool) -> Any:
    """What torch's wrappers return for a ProcessGroup method's work: the work if async, else wait and None."""
    if async_op:
        return work
    work.wait()
    return None


def _direct(work: Any, async_op: bool, after: Callable[[], None] | None) -> Work | None:
    """Finish a call made on the ProcessGroup method itself (blocking calls wait here)."""
    return _finish(_blocking(work, async_op), async_op, after)


def _flat_pair(out: torch.Tensor, inp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1-d views of a contiguous all-gather output and its input.

    Stacked, concatenated and 0-d-stacked outputs are the same bytes once flat,
    and gloo rejects a 0-d input otherwise (torch 2.13).
    """
    return out.view(-1), inp.view(-1)


def _chain(*fns: Callable[[], None] | None) -> Callable[[], None] | None:
    fns = tuple(f for f in fns if f is not None)
    if not fns:
        return None
    if len(fns) == 1:
        return fns[0]

    def run() -> None:
        for f in fns:
            f()

    return run


@atexit.register
def _destroy_if_initialised() -> None:
    """At exit, a group still alive is destroyed while the interpreter is whole (see C10dBackend.released)."""
    from .. import api

    try:
        if tdist.is_initialized():
            api.destroy_process_group()
    except Exception:  # noqa: BLE001  exiting anyway: a failing clean-up must not mask the exit status
        pass


class C10dBackend(Backend):
    """Common code of the gloo and nccl backends."""

    name = "c10d"

    #: whether the library's own reduce_scatter is worth calling (else: one all_to_all_single and a local reduce)
    native_reduce_scatter = True
    #: whether a world rendezvousing on loopback gets the transport pinned to the loopback interface
    pins_loopback = False
    #: whether each rank records its process so that a lost peer can be named (gloo reports only an address)
    names_lost_peers = False

    def __init__(self, rank: int, world_size: int, timeout: timedelta) -> None:
        super().__init__(rank, world_size)
        self.timeout = timeout

    @classmethod
    def create(cls, *, rank: int, world_size: int, init_method: str | None, store: Any,
               timeout: timedelta) -> "C10dBackend":
        if tdist.is_initialized():
            raise DistBackendError(format_message(
                "init_process_group", "torch.distributed is already initialised in this process",
                values={"backend": tdist.get_backend()},
                fix="call tensorplay.distributed.destroy_process_group() / torch.distributed.destroy_process_group() "
                    "first"))
        if store is None:
            bound = _bound_rendezvous(init_method, rank, world_size, timeout)
            if bound is not None:
                store, rank, world_size = bound
        if cls.pins_loopback:
            _pin_gloo_to_loopback(init_method)
        kwargs: dict[str, Any] = dict(backend=cls.name, timeout=timeout, world_size=world_size, rank=rank)
        if store is not None:
            kwargs["store"] = store
        elif init_method is not None:
            kwargs["init_method"] = init_method
        try:
            tdist.init_process_group(**kwargs)
        except (RuntimeError, ValueError) as e:
            raise DistBackendError(format_message(
                "init_process_group", f"the {cls.name} backend could not start: {e}",
                values={"init_method": init_method, "rank": rank, "world_size": world_size},
                fix="check MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE (or init_method) and that every rank starts")) from e
        b = cls(tdist.get_rank(), tdist.get_world_size(), timeout)
        if cls.names_lost_peers:
            _peers.publish(_default_store(), b.rank)
        return b

    def world_handle(self) -> Any:
        return tdist.group.WORLD

    def new_group_handle(self, ranks: tuple[int, ...], timeout: timedelta) -> Any:
        pg = tdist.new_group(list(ranks), timeout=timeout)
        return pg if self.rank in ranks else None

    def shutdown(self) -> None:
        if tdist.is_initialized():
            tdist.destroy_process_group()

    def released(self) -> None:
        # Free now what still refers to the destroyed groups (autograd graphs, optimiser state and works
        # in reference cycles). Left to interpreter teardown, their tensors die while gloo's C++ objects
        # are being torn down, and the process aborts ("terminate called without an active exception")
        # after a successful run: 3 of 14 torchrun runs of a DDP-style script under load, torch 2.13,
        # plain torch.distributed included; 0 of 38 with this collection.
        gc.collect()

    # -- what the library does natively ------------------------------------
    def supports_op(self, op: ReduceOp, dtype: torch.dtype) -> bool:
        return not (dtype.is_complex and op is ReduceOp.PRODUCT)

    def _emulated_reduce(self, tensor: torch.Tensor, op: ReduceOp, group: ProcessGroup, async_op: bool,
                         root: int | None) -> Work | None:
        """Gather every contribution and reduce locally, in rank order (same result on every rank)."""
        w = group.size()
        src, _ = _staged(tensor)
        stacked = torch.empty((w, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        work = _gather_flat(*_flat_pair(stacked, src), group, async_op)

        def reduce_locally() -> None:
            if root is None or group.rank() == root:
                tensor.copy_(_kernels.reduce_stacked(op, stacked))

        return _finish(work, async_op, reduce_locally)

    def _guard(self, name: str, group: ProcessGroup, fn: Callable[[], Work | None]) -> Work | None:
        """Run a c10d call, turning torch's failures into our errors with context."""
        try:
            return fn()
        except (RuntimeError, ValueError) as e:
            text = str(e)
            cls = DistTimeoutError if "timed out" in text.lower() or "timeout" in text.lower() else DistBackendError
            fix = "check that every rank of the group made the same call"
            values: dict[str, Any] = {}
            if _peers.PEER_LOST.search(text):
                cls = DistBackendError
                lost = _peers.lost_ranks(_default_store(), self.world_size, self.rank) \
                    if self.names_lost_peers else None
                if lost:
                    who = f"rank {lost[0]}" if len(lost) == 1 else f"ranks {lost}"
                    values["lost_ranks"] = lost
                    text = f"{who} ended during the call (its connection closed): {text}"
                    fix = (f"look at {who}'s own output for why it stopped (its exception, a signal, an "
                           f"out-of-memory kill); the other ranks cannot go on without it")
                else:
                    text = f"a peer ended or closed its connection during the call: {text}"
                    fix = ("find the rank that stopped first (its own output says why: its exception, a signal, "
                           "an out-of-memory kill); the other ranks cannot go on without it")
            raise cls(format_message(name, f"the {self.name} backend failed: {text}", group=group.ranks,
                                     rank=self.rank, values=values or None, fix=fix)) from e

    # -- collectives ------------------------------------------------------
    def barrier(self, group: ProcessGroup, async_op: bool) -> Work | None:
        return self._guard("barrier", group, lambda: tdist.barrier(group=group.handle, async_op=async_op))

    def broadcast(self, tensor: torch.Tensor, root: int, group: ProcessGroup, async_op: bool) -> Work | None:
        def run() -> Work | None:
            buf, back = _staged(tensor)
            if buf.is_cuda:  # torch's wrapper carries NCCL dtype workarounds (fp8 before sm90)
                work = tdist.broadcast(buf, group=group.handle, async_op=async_op, group_src=root)
                return _finish(work, async_op, back)
            opts = tdist.BroadcastOptions()  # the ProcessGroup method directly, as in all_reduce
            opts.rootRank, opts.rootTensor, opts.asyncOp = root, 0, async_op
            return _direct(group.handle.broadcast([_real(buf)], opts), async_op, back)

        return self._guard("broadcast", group, run)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, group: ProcessGroup, async_op: bool) -> Work | None:
        if not self.supports_op(op, tensor.dtype):
            return self._guard("all_reduce", group, lambda: self._emulated_reduce(tensor, op, group, async_op, None))

        def run() -> Work | None:
            buf, back = _staged(tensor)
            # the ProcessGroup method directly: torch's all_reduce wrapper only repeats checks the API
            # made (about 3 us a call, most of our overhead on small tensors); complex as real pairs
            # like torch (complex PRODUCT never gets here)
            opts = tdist.AllreduceOptions()
            opts.reduceOp = _TORCH_OP[op]
            opts.asyncOp = async_op
            return _direct(group.handle.allreduce([_real(buf)], opts), async_op, back)

        return self._guard("all_reduce", group, run)

    def reduce(self, tensor: torch.Tensor, root: int, op: ReduceOp, group: ProcessGroup,
               async_op: bool) -> Work | None:
        if not self.supports_op(op, tensor.dtype):
            return self._guard("reduce", group, lambda: self._emulated_reduce(tensor, op, group, async_op, root))

        def run() -> Work | None:
            buf, back = _staged(tensor)
            # torch may leave scratch values in non-root buffers; only the root's result is defined
            back = back if group.rank() == root else None
            if buf.is_cuda:
                work = tdist.reduce(buf, op=_TORCH_OP[op], group=group.handle, async_op=async_op, group_dst=root)
                return _finish(work, async_op, back)
            opts = tdist.ReduceOptions()  # the ProcessGroup method directly, as in all_reduce
            opts.reduceOp, opts.rootRank, opts.rootTensor, opts.asyncOp = _TORCH_OP[op], root, 0, async_op
            return _direct(group.handle.reduce([_real(buf)], opts), async_op, back)

        return self._guard("reduce", group, run)

    def all_gather(self, output_list: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup,
                   async_op: bool) -> Work | None:
        # torch's list path: gloo packs once and copies out once; the tensor path (_allgather_base) costs
        # an extra full copy on gloo (about 1.7x at 1e6 floats, see docs/performance-collectives.md)
        def run() -> Work | None:
            src, _ = _staged(tensor)
            staged = [_staged(o) for o in output_list]
            after = _chain(*(back for _, back in staged))
            if src.is_cuda:
                work = tdist.all_gather([b for b, _ in staged], src, group=group.handle, async_op=async_op)
                return _finish(work, async_op, after)
            opts = _c10d.AllgatherOptions()
            opts.asyncOp = async_op
            work = group.handle.allgather([[_real(b) for b, _ in staged]], [_real(src)], opts)
            return _direct(work, async_op, after)

        return self._guard("all_gather", group, run)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, group: ProcessGroup,
                               async_op: bool) -> Work | None:
        def run() -> Work | None:
            src, _ = _staged(input)
            out, back = _staged(output)
            work = _gather_flat(*_flat_pair(out, src), group, async_op)
            return _finish(work, async_op, back)

        return self._guard("all_gather_into_tensor", group, run)

    def gather(self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None, root: int,
               group: ProcessGroup, async_op: bool) -> Work | None:
        def run() -> Work | None:
            if tensor.is_complex():  # gloo's gather rejects complex dtypes ("Invalid scalar type"); move real pairs
                real_list = None if gather_list is None else [torch.view_as_real(t) for t in gather_list]
                return run_on(torch.view_as_real(tensor), real_list)
            return run_on(tensor, gather_list)

        def run_on(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None) -> Work | None:
            src, _ = _staged(tensor)
            staged = [] if gather_list is None else [_staged(t) for t in gather_list]
            after = _chain(*(back for _, back in staged))
            opts = tdist.GatherOptions()
            opts.rootRank, opts.asyncOp = root, async_op
            outs = [[b for b, _ in staged]] if gather_list is not None else []
            return _direct(group.handle.gather(outs, [src], opts), async_op, after)

        return self._guard("gather", group, run)

    def scatter(self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None, root: int,
                group: ProcessGroup, async_op: bool) -> Work | None:
        def run() -> Work | None:
            out, back = _staged(tensor)
            parts = [] if scatter_list is None else [[_real(t.contiguous()) for t in scatter_list]]
            opts = tdist.ScatterOptions()
            opts.rootRank, opts.asyncOp = root, async_op
            return _direct(group.handle.scatter([_real(out)], parts, opts), async_op, back)

        return self._guard("scatter", group, run)

    def reduce_scatter(self, output: torch.Tensor, input_list: list[torch.Tensor], op: ReduceOp,
                       group: ProcessGroup, async_op: bool) -> Work | None:
        if not self.supports_op(op, output.dtype) or not self.native_reduce_scatter:
            # the emulation works on one packed tensor
            return self.reduce_scatter_tensor(output, torch.stack(input_list), op, group, async_op)

        # torch's list path directly: packing with torch.stack first cost an extra copy of every input
        def run() -> Work | None:
            out, back = _staged(output)
            ins = [t.contiguous() for t in input_list]
            work = tdist.reduce_scatter(out, ins, op=_TORCH_OP[op], group=group.handle, async_op=async_op)
            # always chained: torch's gloo reduce-scatter work never reports is_completed() (torch 2.13)
            return _finish(work, async_op, back or (lambda: None))

        return self._guard("reduce_scatter", group, run)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                              group: ProcessGroup, async_op: bool) -> Work | None:
        w = group.size()
        if not self.supports_op(op, output.dtype) or not self.native_reduce_scatter:
            # rank j sends its i-th chunk to rank i, which reduces the W chunks it received
            def emulate() -> Work | None:
                chunks = input.contiguous().view(w, *output.shape)
                got = torch.empty_like(chunks)
                n = [output.numel()] * w
                work = tdist.all_to_all_single(got.view(-1), chunks.view(-1), n, n, group=group.handle,
                                               async_op=async_op)
                return _finish(work, async_op, lambda: output.copy_(_kernels.reduce_stacked(op, got)))

            return self._guard("reduce_scatter", group, emulate)

        def run() -> Work | None:
            out, back = _staged(output)
            # flat 1-d views on both sides: gloo segfaults on a 0-d output (torch 2.13)
            work = _reduce_scatter_flat(out.view(-1), input.contiguous().view(-1), op, group, async_op)
            # always chained: torch's gloo reduce-scatter work never reports is_completed() (torch 2.13)
            return _finish(work, async_op, back or (lambda: None))

        return self._guard("reduce_scatter_tensor", group, run)

    def all_to_all(self, output_list: list[torch.Tensor], input_list: list[torch.Tensor], group: ProcessGroup,
                   async_op: bool) -> Work | None:
        shape = input_list[0].shape
        if (not async_op and len(shape) and input_list[0].numel() >= _SCATTER_BLOCK_NUMEL
                and all(t.shape == shape for t in (*input_list, *output_list))):
            # big uniform blocks: W scatters move each block straight from its tensor into its destination;
            # gloo's list path and our packed exchange both copy every block twice more, which costs more
            # than the extra rounds from about 64Ki elements a block (bench/bench_functional.py)
            def scatters() -> Work | None:
                ins = [t.contiguous() for t in input_list]
                staged = [_staged(o) for o in output_list]
                for i in range(group.size()):
                    tdist.scatter(staged[i][0], ins if i == group.rank() else None, group=group.handle,
                                  group_src=i)
                return _finish(None, False, _chain(*(back for _, back in staged)))

            return self._guard("all_to_all", group, scatters)
        if len(shape) and all(t.shape == shape and t.is_contiguous() for t in (*input_list, *output_list)):
            # uniform contiguous blocks: the library's own list path skips our pack/unpack copies
            def uniform() -> Work | None:
                if input_list[0].is_cuda:
                    return tdist.all_to_all(output_list, input_list, group=group.handle, async_op=async_op)
                opts = _c10d.AllToAllOptions()  # the ProcessGroup method directly, as in all_reduce
                opts.asyncOp = async_op
                work = group.handle.alltoall([_real(t) for t in output_list], [_real(t) for t in input_list], opts)
                return _direct(work, async_op, None)

            return self._guard("all_to_all", group, uniform)

        # Ragged shapes in one exchange: flatten every block, send by element counts.
        def run() -> Work | None:
            send = torch.cat([t.reshape(-1) for t in input_list])
            out_n = [t.numel() for t in output_list]
            recv = torch.empty(sum(out_n), dtype=send.dtype, device=send.device)
            work = tdist.all_to_all_single(recv, send, out_n, [t.numel() for t in input_list],
                                           group=group.handle, async_op=async_op)

            def unpack() -> None:
                for o, chunk in zip(output_list, recv.split(out_n)):
                    o.copy_(chunk.view(o.shape))

            return _finish(work, async_op, unpack)

        return self._guard("all_to_all", group, run)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], group: ProcessGroup, async_op: bool) -> Work | None:
        def run() -> Work | None:
            out, back = _staged(output)
            if out.is_cuda:
                work = tdist.all_to_all_single(out, input.contiguous(), output_split_sizes, input_split_sizes,
                                               group=group.handle, async_op=async_op)
                return _finish(work, async_op, back)
            opts = _c10d.AllToAllOptions()
            opts.asyncOp = async_op
            outs, ins = output_split_sizes, input_split_sizes
            if _equal_splits(outs, out.shape[0]) and _equal_splits(ins, input.shape[0]):
                outs = ins = []  # equal chunks: gloo's plain alltoall, cheaper than its split-size (v) variant
            work = group.handle.alltoall_base(_real(out), _real(input.contiguous()), outs, ins, opts)
            return _direct(work, async_op, back)

        return self._guard("all_to_all_single", group, run)

    # -- point to point -----------------------------------------------------
    def send(self, tensor: torch.Tensor, peer: int, group: ProcessGroup, tag: int, async_op: bool) -> Work | None:
        src = tensor.contiguous()
        if async_op:
            return self._guard("isend", group, lambda: tdist.isend(src, group=group.handle, tag=tag, group_dst=peer))
        self._guard("send", group, lambda: tdist.send(src, group=group.handle, tag=tag, group_dst=peer))
        return None

    def recv(self, tensor: torch.Tensor, peer: int | None, group: ProcessGroup, tag: int,
             async_op: bool) -> Work | int:
        buf, back = _staged(tensor)
        if not async_op:
            sender = self._guard("recv", group, lambda: tdist.recv(buf, group=group.handle, tag=tag, group_src=peer))
            if back is not None:
                back()
            return group.group_rank(sender) if peer is None else peer

        work = self._guard("irecv", group, lambda: tdist.irecv(buf, group=group.handle, tag=tag, group_src=peer))
        return _RecvWork(work, peer, back)


class _RecvWork(ChainedWork):
    """irecv on c10d: copy out of the staging buffer, and report the sender's group rank."""

    def __init__(self, inner: Any, peer: int | None, back: Callable[[], None] | None) -> None:
        super().__init__(inner, back or (lambda: None))
        self._peer = peer
        self._received = False

    def wait(self, timeout: Any = None) -> bool:
        # gloo's recv work waits for a *further* message on every wait(); wait once, then answer from memory
        if not self._received:
            super().wait(timeout)
            self._received = True
        return True

    def is_completed(self) -> bool:
        return self._received or self._inner.is_completed()

    def source_rank(self) -> int:
        self.wait()
        return self._peer if self._peer is not None else self._inner._source_rank()


class GlooBackend(C10dBackend):
    """torch's gloo: CPU tensors (and CUDA tensors for the ops gloo supports)."""

    name = "gloo"
    pins_loopback = True
    names_lost_peers = True
    #: gloo's reduce_scatter costs a full all_reduce of the input (measured, torch 2.13: 40 ms vs 22 ms for
    #: one all_to_all_single plus a local sum, W=4, 4e6 float32); the exchange is faster at every size tried
    native_reduce_scatter = False

    def supports_device(self, device: torch.device) -> bool:
        return device.type in ("cpu", "cuda")


class NcclBackend(C10dBackend):
    """torch's NCCL: CUDA tensors only; bitwise reductions are emulated."""

    name = "nccl"

    def supports_device(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def device_for(self, kind: str) -> torch.device:
        # one GPU per rank, as torchrun scripts set it (rank modulo the visible devices)
        if kind == "cuda":
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
        return super().device_for(kind)

    def supports_op(self, op: ReduceOp, dtype: torch.dtype) -> bool:
        return op not in _BITWISE and super().supports_op(op, dtype)


register_backend("gloo", GlooBackend)
register_backend("nccl", NcclBackend)
