"""A rank process's staging: the tensors of each forwarded call copied into shared memory, and its outputs back.

Each forwarded call copies the bytes it reads into a region of an arena (a
file in ``/dev/shm`` that the proxy maps too; see :mod:`._wire`) and sends
places instead of tensors (:meth:`Staging.stage`); the simulator writes the
results there and the rank process copies the outputs back
(:meth:`Staged.copy_out`).  Tensors of one storage are staged as one byte span,
so views that alias each other in the program alias each other in the arena
too (in-place and overlapping calls keep their meaning).  A storage that is
already in shared memory (``share_memory_()``) is not copied: the proxy maps it
once (a SHARE message) and the simulator works on the program's own bytes.

A region is freed when its call is over: a blocking call when it returns, an
``async_op=True`` call when the coordinator reports it complete (with the
answer to any request of the rank), waited or not.  A completed operation's
outputs are the program's then, as on gloo, where a dropped ``Work`` still
writes its outputs.

Regions are allocated first-fit among the live ones, so a program that keeps
one or two operations in flight reuses the same pages for ever.  The pages of
an arena (a sparse file) are reserved with ``fallocate`` before a call first
touches them: a full ``/dev/shm`` is then a clear error on the rank
(:func:`free_bytes` is the probe) instead of a ``SIGBUS`` in the copy.
"""
from __future__ import annotations

import errno
import os
import threading
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tensorplay.distributed.errors import DistRuntimeError, format_message
from tensorplay.distributed.group import ProcessGroup

from simulator.isolation import _wire
from simulator.isolation._wire import SHARED_BASE, Arena, GroupRef, TensorRef

__all__ = ["ARENA_BYTES", "ALIGN", "Staging", "Staged", "free_bytes", "span_of"]

ARENA_BYTES = 64 << 20  # sparse file: only the pages a call touches cost memory
ALIGN = 64  # byte alignment of every staged span (a multiple of every element size)
_PAGE = 4096
_MIB = 1 << 20


def free_bytes(path: str) -> int:
    """Bytes free for an unprivileged writer on the file system of ``path`` (``/dev/shm``)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _full(call: str, rank: int, path: str, free: int, need: int) -> DistRuntimeError:
    return DistRuntimeError(format_message(
        call, f"shared memory is full ({free / _MIB:.0f} MiB free, {max(need, 1) / _MIB:.1f} MiB needed)", rank=rank,
        values={"path": os.path.dirname(path) or path},
        fix="enlarge /dev/shm (docker run --shm-size=...) or use isolation='thread'"))


def _host(a: Any) -> Any:
    """A CUDA stand-in (simulator.standin, devices="cuda") as the CPU tensor that holds its data (the same storage,
    shape and strides: what is staged in and copied back is the stand-in's); lists and tuples element-wise."""
    if isinstance(a, torch.Tensor):
        inner = getattr(a, "_inner", None) if a.device.type == "cuda" else None
        return inner if isinstance(inner, torch.Tensor) else a
    if isinstance(a, (list, tuple)):
        return type(a)(_host(x) for x in a) if any(isinstance(x, torch.Tensor) for x in a) else a
    return a


class Staging:
    """The arenas of one rank process, their live regions, and the program's shared storages the proxy maps.

    Thread-safe: a rank's threads stage at once.  ``share(sid, nbytes, fd)`` tells the proxy of a shared
    storage (a SHARE request) before any call names it.
    """

    def __init__(self, arena_dir: str, rank: int, share: Callable[[int, int, int], None]) -> None:
        self.arena_dir = arena_dir
        self.rank = rank
        self.lock = threading.Lock()
        self.arenas: list[Arena] = []
        self._live: list[dict[int, int]] = []  # per arena: offset -> bytes of each live region
        self._reserved: list[int] = []  # per arena: bytes from 0 whose pages are allocated
        self._share = share
        #: the program's shared-memory storages the proxy has mapped: address -> (id, weak ref, bytes)
        self._shared: dict[int, tuple[int, Any, int]] = {}
        self._slock = threading.Lock()
        self._next_sid = 0

    def stage(self, name: str, args: tuple, outputs: tuple[int, ...], staged: "Staged") -> list[Any]:
        """Copy the tensors of call ``name``'s ``args`` into an arena; return the arguments with tensors replaced by
        places (lists and tuples as lists).  The tensors of the arguments at ``outputs`` are noted in ``staged`` to
        be copied back."""
        tensors = [t for a in args for t in _flatten(a)]
        if any(type(t) is not torch.Tensor for t in tensors):  # (a CUDA stand-in stages the CPU data it holds)
            args = tuple(_host(a) for a in args)
            tensors = [t for a in args for t in _flatten(a)]
        spans: dict[int, list[int]] = {}  # storage address -> [lo, hi)
        shared: dict[int, int] = {}  # storage address -> id, for storages already in shared memory (not copied)
        for t in tensors:
            if t.device.type != "cpu":
                raise DistRuntimeError(format_message(
                    name, "process-isolated ranks take CPU tensors only", rank=self.rank,
                    values={"device": str(t.device)}, fix="move the tensor to the CPU, or use isolation='thread'"))
            if t.numel() == 0:
                continue
            key = t.untyped_storage().data_ptr()
            if key in shared or self._shared_id(t, key, shared):
                continue
            lo, hi = span_of(t)
            s = spans.get(key)
            if s is None:
                spans[key] = [align_down(lo), hi]
            else:
                s[0], s[1] = min(s[0], align_down(lo)), max(s[1], hi)
        need = sum(align_up(hi - lo) for lo, hi in spans.values())
        arena, top = None, 0
        if need:  # the call's region; the copies below run unlocked
            arena, top = self.alloc(need, name)
            staged.regions.append((arena, top))
        base: dict[int, int] = {}
        for t in tensors:
            if t.numel() == 0:
                continue
            key = t.untyped_storage().data_ptr()
            if key in base or key in shared:
                continue
            lo, hi = spans[key]
            off = top
            top += align_up(hi - lo)
            arena.bytes[off:off + hi - lo].copy_(storage_bytes(t)[lo:hi])
            base[key] = off - lo  # arena byte offset of the storage's byte 0

        def ref(t: torch.Tensor, is_out: bool) -> TensorRef:
            es = t.element_size()
            if t.numel() == 0:
                return TensorRef((-1, 0, t.dtype, tuple(t.shape), tuple(t.stride()), t.requires_grad))
            key = t.untyped_storage().data_ptr()
            sid = shared.get(key)
            if sid is not None:  # the simulator works on the program's own shared bytes: nothing to copy back
                return TensorRef((sid, t.storage_offset(), t.dtype, tuple(t.shape), tuple(t.stride()),
                                  t.requires_grad))
            off = (base[key] + t.storage_offset() * es) // es
            r = TensorRef((arena.aid, off, t.dtype, tuple(t.shape), tuple(t.stride()), t.requires_grad))
            if is_out:
                staged.outputs.append((t, arena.view(off, t.dtype, tuple(t.shape), tuple(t.stride()))))
            return r

        enc: list[Any] = []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                enc.append(ref(a, i in outputs))
            elif isinstance(a, (list, tuple)):  # (a list either way: split sizes travel as lists too)
                enc.append([ref(x, i in outputs) if isinstance(x, torch.Tensor) else x for x in a])
            elif isinstance(a, ProcessGroup):
                enc.append(GroupRef((a.handle,)))
            else:
                enc.append(a)
        return enc

    def _shared_id(self, t: torch.Tensor, key: int, shared: dict[int, int]) -> bool:
        """Whether ``t``'s storage is in shared memory (then ``shared[key]`` is its id, mapped by the proxy)."""
        st = t.untyped_storage()
        if not st.is_shared() or st.data_ptr() % 64:
            return False
        sid = self._known_sid(key, st)
        if sid is not None:
            shared[key] = sid
            return True
        try:
            fd, size = st._share_fd_cpu_()
        except Exception:  # noqa: BLE001  shared another way (a file name): staged like any tensor
            return False
        # registered before any call names it (and under a lock, so no other thread of this rank names it first)
        with self._slock:
            sid = self._known_sid(key, st)  # (another thread of the rank may have registered it meanwhile)
            if sid is None:
                sid = SHARED_BASE + self._next_sid
                self._next_sid += 1
                self._share(sid, size, fd)
                self._shared[key] = (sid, StorageWeakRef(st), st.nbytes())
        shared[key] = sid
        return True

    def _known_sid(self, key: int, st: torch.UntypedStorage) -> int | None:
        """The id the proxy knows the shared storage ``st`` (at address ``key``) by, if it still is that storage."""
        known = self._shared.get(key)
        if known is not None and not known[1].expired() and known[2] == st.nbytes():
            return known[0]
        return None

    def alloc(self, need: int, call: str) -> tuple[Arena, int]:
        """A region of ``need`` bytes (> 0) for ``call``; raises the "shared memory is full" error."""
        with self.lock:
            for i, a in enumerate(self.arenas):
                off = _first_fit(self._live[i], a.size, need)
                if off is not None:
                    self._reserve(i, off + need, call)
                    self._live[i][off] = need
                    return a, off
            aid = len(self.arenas)
            path = _wire.arena_path(self.arena_dir, self.rank, aid)
            free = free_bytes(self.arena_dir)
            if free < need:  # (checked before the file exists: nothing to clean up)
                raise _full(call, self.rank, path, free, need)
            a = Arena(aid, path, max(ARENA_BYTES, align_up(need) * 2), create=True)  # the proxy maps it on first use
            self.arenas.append(a)
            self._live.append({})
            self._reserved.append(0)
            self._reserve(aid, need, call)
            self._live[aid][0] = need
            return a, 0

    def free(self, arena: Arena, off: int) -> None:
        with self.lock:
            self._live[arena.aid].pop(off, None)

    def _reserve(self, i: int, end: int, call: str) -> None:
        """Allocate the pages of arena ``i`` up to ``end`` before a copy touches them (caller holds ``lock``)."""
        have = self._reserved[i]
        if end <= have:
            return
        end = min(self.arenas[i].size, (end + _PAGE - 1) // _PAGE * _PAGE)
        path = self.arenas[i].path
        free = free_bytes(self.arena_dir)
        if free < end - have:
            raise _full(call, self.rank, path, free, end - have)
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                os.posix_fallocate(fd, have, end - have)  # ENOSPC here, not SIGBUS in the copy
            finally:
                os.close(fd)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise _full(call, self.rank, path, free_bytes(self.arena_dir), end - have) from None
            if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):  # (no fallocate: the probe decided)
                raise
        self._reserved[i] = end


def _first_fit(live: dict[int, int], size: int, need: int) -> int | None:
    """The lowest offset of ``need`` free bytes between the ``live`` regions of an arena of ``size`` bytes."""
    pos = 0
    for off in sorted(live):
        if off - pos >= need:
            return pos
        pos = max(pos, off + live[off])
    return pos if size - pos >= need else None


class Staged:
    """The arena regions and output copies of one forwarded call."""

    __slots__ = ("staging", "regions", "outputs")

    def __init__(self, staging: Staging) -> None:
        self.staging = staging
        self.regions: list[tuple[Arena, int]] = []
        self.outputs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (program's tensor, its arena view)

    def copy_out(self) -> None:
        # c10d writes the buffers as memory: autograd never sees it (nor its view bookkeeping; see backend._no_grad)
        with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
            for t, v in self.outputs:
                t.copy_(v)

    def release(self) -> None:
        regions, self.regions, self.outputs = self.regions, [], []
        for a, off in regions:
            self.staging.free(a, off)


def span_of(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` of ``t``'s storage that ``t`` reads or writes."""
    es = t.element_size()
    lo = t.storage_offset() * es
    if t.numel() == 0:
        return lo, lo
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()) if s > 0)
    return lo, lo + (last + 1) * es


def align_down(n: int) -> int:
    return n - n % ALIGN


def align_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A byte tensor over ``t``'s whole storage."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def _flatten(obj: Any) -> list[torch.Tensor]:
    """The tensors in an argument (a tensor, a list of tensors, or anything else)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for t in obj if isinstance(t, torch.Tensor)]
    return []
