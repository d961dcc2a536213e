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

A large ordinary storage (:data:`ADOPT_BYTES` or more) that the program passes to a second call moves into shared
memory in place (:meth:`Staging.adopt`): the same storage object, every view of it, with its bytes in a
shared-memory block from then on, so later calls read and write it with no staging copy, as for a storage the
program shared itself.  Such a storage still resizes as any (FSDP's ``untyped_storage().resize_``, and
``Tensor.resize_``): :func:`install_resize_hooks` gives it ordinary memory back first.  A storage that does not
own its memory (``torch.from_numpy``, ``frombuffer``, a file mapping), or a ``/dev/shm`` short of room, keeps
being staged.  The proxy lets go of a shared storage's mapping when the program drops the storage (an UNSHARE
request).

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

__all__ = ["ARENA_BYTES", "ADOPT_BYTES", "ALIGN", "Staging", "Staged", "free_bytes", "install_resize_hooks",
           "span_of"]

ARENA_BYTES = 64 << 20  # sparse file: only the pages a call touches cost memory
#: a storage of at least this many bytes that the program passes to a second call moves into shared memory
ADOPT_BYTES = 1 << 20
#: shared memory that must stay free after such a move (a small /dev/shm keeps staging instead)
ADOPT_HEADROOM = 256 << 20
_SEEN_MAX = 512  # large storages seen once, remembered (weakly) for their second call
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

    def __init__(self, arena_dir: str, rank: int, share: Callable[[int, int, int], None],
                 unshare: Callable[[list[int]], None]) -> None:
        self.arena_dir = arena_dir
        self.rank = rank
        self.lock = threading.Lock()
        self.arenas: list[Arena] = []
        self._live: list[dict[int, int]] = []  # per arena: offset -> bytes of each live region
        self._reserved: list[int] = []  # per arena: bytes from 0 whose pages are allocated
        self._share = share
        self._unshare = unshare
        #: the program's shared-memory storages the proxy has mapped: address -> (id, weak ref, bytes)
        self._shared: dict[int, tuple[int, Any, int]] = {}
        self._slock = threading.Lock()
        self._next_sid = 0
        #: large ordinary storages staged once: storage object id (``_cdata``) -> (weak ref, bytes)
        self._seen: dict[int, tuple[Any, int]] = {}
        self._dropped: list[int] = []  # ids of mapped storages the program no longer has there (see forget)
        self._calls = 0

    def stage(self, name: str, args: tuple, outputs: tuple[int, ...], staged: "Staged") -> list[Any]:
        """Copy the tensors of call ``name``'s ``args`` into an arena; return the arguments with tensors replaced by
        places (lists and tuples as lists).  The tensors of the arguments at ``outputs`` are noted in ``staged`` to
        be copied back."""
        tensors = [t for a in args for t in _flatten(a)]
        adopt = True
        if any(type(t) is not torch.Tensor for t in tensors):  # (a CUDA stand-in stages the CPU data it holds)
            args = tuple(_host(a) for a in args)
            adopt = all(t is h for t, h in zip(tensors, (h for a in args for h in _flatten(a))))
            tensors = [t for a in args for t in _flatten(a)]
        self._calls += 1
        if self._shared and (self._dropped or self._calls % 64 == 0):
            self._sweep()
        spans: dict[int, list[int]] = {}  # storage address -> [lo, hi)
        shared: dict[int, int] = {}  # storage address -> id, for storages already in shared memory (not copied)
        for t in tensors:
            if t.device.type != "cpu":
                raise DistRuntimeError(format_message(
                    name, "process-isolated ranks take CPU tensors only", rank=self.rank,
                    values={"device": str(t.device)}, fix="move the tensor to the CPU, or use isolation='thread'"))
            if t.numel() == 0:
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in shared:
                continue
            # (not a stand-in's storage: its resizes reach torch's kernels directly, past install_resize_hooks)
            if adopt and st.nbytes() >= ADOPT_BYTES and self.adopt(st):
                key = st.data_ptr()  # (its bytes moved)
            if self._shared_id(t, key, shared):
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
                gone = self._shared.get(key)  # (a dropped storage whose address this one now has)
                if gone is not None:
                    self._dropped.append(gone[0])
                self._shared[key] = (sid, StorageWeakRef(st), st.nbytes())
        shared[key] = sid
        return True

    def _known_sid(self, key: int, st: torch.UntypedStorage) -> int | None:
        """The id the proxy knows the shared storage ``st`` (at address ``key``) by, if it still is that storage."""
        known = self._shared.get(key)
        if known is not None and not known[1].expired() and known[2] == st.nbytes():
            return known[0]
        return None

    def adopt(self, st: torch.UntypedStorage) -> bool:
        """Move ``st``, a large storage this process passes to its second call, into shared memory in place (see
        the module's doc); whether it moved.  The copy is the one staging would make for this call."""
        if st.is_shared() or not st.resizable():
            return False  # (not resizable: the memory is not the storage's own, a numpy array's or a file's)
        n = st.nbytes()
        with self._slock:
            cdata = st._cdata
            seen = self._seen.get(cdata)
            if seen is None or seen[0].expired() or seen[1] != n:  # its first call: staged, and remembered
                if len(self._seen) >= _SEEN_MAX:
                    self._seen = {k: v for k, v in self._seen.items() if not v[0].expired()}
                    if len(self._seen) >= _SEEN_MAX:
                        self._seen.clear()
                self._seen[cdata] = (StorageWeakRef(st), n)
                return False
            del self._seen[cdata]
            if free_bytes(self.arena_dir) < 2 * n + ADOPT_HEADROOM:
                return False
            try:
                block = torch.UntypedStorage._new_using_fd_cpu(n)
            except Exception:  # noqa: BLE001  (no shared memory to be had: staged as before)
                return False
            block.copy_(st)
            st._swap_data_ptr_(block)  # every view of st sees the shared bytes; block holds the old ones, freed here
            _ADOPTED[cdata] = (StorageWeakRef(st), self)
        return True

    def forget(self, address: int) -> None:
        """The storage mapped at ``address`` left shared memory (see :func:`install_resize_hooks`): the proxy may
        let go of its mapping."""
        with self._slock:
            known = self._shared.pop(address, None)
            if known is not None:
                self._dropped.append(known[0])

    def _sweep(self) -> None:
        """Tell the proxy of the mapped storages the program has dropped or moved out of shared memory."""
        with self._slock:
            for address in [a for a, known in self._shared.items() if known[1].expired()]:
                self._dropped.append(self._shared.pop(address)[0])
            for cdata in [c for c, rec in _ADOPTED.items() if rec[0].expired()]:
                del _ADOPTED[cdata]
            dropped, self._dropped = self._dropped, []
        if dropped:
            self._unshare(dropped)

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


#: storages moved into shared memory by :meth:`Staging.adopt`: storage object id -> (weak ref, its staging)
_ADOPTED: dict[int, tuple[Any, Staging]] = {}


def _give_back(st: torch.UntypedStorage, keep: bool) -> bool:
    """Give an adopted storage ordinary memory again (its bytes copied when ``keep``, else none left), so that it
    resizes as any storage; whether ``st`` was one."""
    rec = _ADOPTED.pop(st._cdata, None)
    if rec is None or rec[0].expired() or not st.is_shared():
        return False
    address = st.data_ptr()
    own = torch.UntypedStorage(st.nbytes() if keep else 0)
    if keep:
        own.copy_(st)
    st._swap_data_ptr_(own)  # (the shared block, now own's, is unmapped here when own goes)
    rec[1].forget(address)
    return True


_HOOKED: list[tuple[Any, str, Any]] = []


def install_resize_hooks() -> None:
    """In a rank process: resizing a storage that :meth:`Staging.adopt` moved into shared memory (whose block has
    a fixed size) first gives it ordinary memory back, so FSDP's ``untyped_storage().resize_(0)`` / ``resize_(n)``
    and a growing ``Tensor.resize_`` work as on any storage.  (An ``out=`` operation that must grow such a
    tensor's storage resizes it inside torch, out of reach: torch's "not resizable" error; see docs/deviations.md.)"""
    if _HOOKED:
        return
    storage_resize = torch.UntypedStorage.resize_

    def resize_(self: torch.UntypedStorage, size: int) -> Any:
        if self._cdata in _ADOPTED:
            _give_back(self, keep=size != 0)
        return storage_resize(self, size)

    def grow(original: Any) -> Any:
        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            # (before the call: a resize that fails in the storage has already changed the tensor's shape)
            if _ADOPTED:
                try:
                    st = self.untyped_storage()
                except Exception:  # noqa: BLE001  (a tensor without a storage of its own, a DTensor: not one)
                    st = None
                if st is not None and st._cdata in _ADOPTED:
                    _give_back(st, keep=True)
            return original(self, *args, **kwargs)

        method.__name__ = original.__name__
        method.__doc__ = original.__doc__
        return method

    for owner, name, new in ((torch.UntypedStorage, "resize_", resize_),
                             (torch.Tensor, "resize_", grow(torch.Tensor.resize_)),
                             (torch.Tensor, "resize_as_", grow(torch.Tensor.resize_as_))):
        _HOOKED.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, new)


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
