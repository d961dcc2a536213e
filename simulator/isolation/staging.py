"""A rank process's staging: arena regions for the calls in flight, and the asynchronous operations they belong to.

Each forwarded call copies what it reads into a region of an arena (see
:mod:`._wire`); the region is freed when the call is over: a blocking call when
it returns, an ``async_op=True`` call when the coordinator reports it complete
(with the answer to any request of the rank, see :meth:`Completions.done`),
waited or not.  A completed operation's outputs are the program's then, as on
gloo, where a dropped ``Work`` still writes its outputs.

Regions are allocated first-fit among the live ones, so a program that keeps
one or two operations in flight reuses the same pages for ever.  The pages of
an arena (a sparse file in ``/dev/shm``) are reserved with ``fallocate`` before
a call first touches them: a full ``/dev/shm`` is then a clear error on the
rank (:func:`free_bytes` is the probe) instead of a ``SIGBUS`` in the copy.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from datetime import timedelta
from typing import Any, Optional

import torch

from tensorplay.distributed.backends.base import Work
from tensorplay.distributed.errors import DistRuntimeError, format_message

from simulator.isolation import _wire
from simulator.isolation._wire import Arena, align_up

__all__ = ["ARENA_BYTES", "Staging", "Staged", "ClientWork", "Completions", "free_bytes"]

ARENA_BYTES = 64 << 20  # sparse file: only the pages a call touches cost memory
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


class Staging:
    """The arenas of one rank process and their live regions (thread-safe: a rank's threads stage at once)."""

    def __init__(self, arena_dir: str, rank: int) -> None:
        self.arena_dir = arena_dir
        self.rank = rank
        self.lock = threading.Lock()
        self.arenas: list[Arena] = []
        self._live: list[dict[int, int]] = []  # per arena: offset -> bytes of each live region
        self._reserved: list[int] = []  # per arena: bytes from 0 whose pages are allocated

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


class ClientWork(Work):
    """An asynchronous operation issued in this process and running in the coordinator."""

    def __init__(self, backend: Any, wid: int, staged: Staged, result: list[torch.Tensor]) -> None:
        self._b = backend
        self._wid = wid
        self._staged: Staged | None = staged
        self._lock = threading.Lock()
        self._result = result
        self._waited = False
        self._error: BaseException | None = None

    def finish(self, ok: bool) -> None:
        """The operation completed (``ok``: successfully): its outputs are the program's, its regions are free."""
        with self._lock:  # (the thread that waits and the one whose answer reported it may both get here)
            staged, self._staged = self._staged, None
            if staged is None:
                return
            try:
                if ok:
                    staged.copy_out()
            finally:
                staged.release()

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if not self._waited:  # the wait itself goes to the coordinator (a scheduling point, as on thread ranks)
            self._waited = True
            try:
                # (timeout: its group's, counted from now: the proxy may get its turn later, in coop mode)
                self._b._request(("wait", self._wid, self._b._cpu_delta(), timeout, time.time()))
                self._b.start_clock()
            except BaseException as e:
                self._error = e
                self.finish(False)
                raise
            self.finish(True)  # (usually done already: the answer to the wait reported the completion)
        elif self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._waited or self._staged is None or bool(self._b._request(("completed", self._wid)))

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None and (
            self._waited or bool(self._b._request(("success", self._wid))))

    def source_rank(self) -> int:
        self.wait()
        return int(self._b._request(("source", self._wid)))

    def result(self) -> list[torch.Tensor]:
        return self._result


class Completions:
    """The asynchronous operations of this rank process not yet reported complete, by the coordinator's id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._works: dict[int, ClientWork] = {}  # issued, completion not yet reported
        self._early: dict[int, bool] = {}  # reported before the answer that names them reached their thread

    def track(self, work: ClientWork) -> ClientWork:
        with self._lock:
            ok = self._early.pop(work._wid, None)
            if ok is None:
                self._works[work._wid] = work
        if ok is not None:
            work.finish(ok)
        return work

    def done(self, notes: Any) -> None:
        """``notes``: ``[(id, ok), ...]`` of operations the coordinator saw complete since its last answer."""
        for wid, ok in notes or ():
            with self._lock:
                work = self._works.pop(wid, None)
                if work is None:
                    self._early[wid] = ok
            if work is not None:
                work.finish(ok)

    def __len__(self) -> int:
        return len(self._works)
