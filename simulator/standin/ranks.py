"""Per-rank device state of the CUDA stand-in: current device, current streams, memory counters.

A real rank is a process with its own CUDA context; a simulated rank is a thread.
Each simulated rank therefore gets its own :class:`DeviceState` (found through
``simulator.core.state.current_rank_state()``; a thread the rank started shares it),
and code outside any rank uses one process-wide state, as a single process would.

Memory is counted per rank and device as a caching allocator reports it:
every stand-in storage the rank allocates adds its size rounded up to 512 bytes
(the CUDA caching allocator's smallest block) until the storage is freed, which
a ``weakref.finalize`` on the storage observes.  ``memory_reserved`` is the
high-water mark of allocated bytes since the last ``empty_cache()`` (a caching
allocator keeps freed blocks until then).
"""
from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from tensorplay.distributed.errors import format_message

from simulator.core._actor import current_rank_state

__all__ = ["Config", "DeviceState", "state", "config", "push_config", "pop_config", "device_count",
           "resolve_index", "track", "GIB", "BLOCK", "open_now", "check_room", "physical", "node_devices"]

GIB = 1 << 30
#: the CUDA caching allocator's allocation granularity (bytes)
BLOCK = 512


@dataclass(frozen=True)
class Config:
    """What :func:`simulator.standin.enabled` was given."""

    #: devices per node (``torch.cuda.device_count()``); None: the rank's world size (1 outside a world)
    gpus_per_node: int | None = None
    #: bytes of memory per device (``get_device_properties().total_memory``)
    total_memory: int = 80 * GIB


_configs: list[Config] = []


#: CUDA_VISIBLE_DEVICES of the process when the stand-in started: the real machine's, not the simulated node's
_machine_visible: list[str | None] = [None]


def push_config(cfg: Config) -> None:
    if not _configs:
        _machine_visible[0] = os.environ.get("CUDA_VISIBLE_DEVICES")
    _configs.append(cfg)


def pop_config(cfg: Config) -> None:
    _configs.remove(cfg)
    if not _configs:  # the stand-in's machine is gone: a later one starts on its device 0, as a new process would
        _process._current = 0
        _process._streams.clear()
        _process.visible = _UNREAD


def open_now() -> bool:
    """Whether a stand-in context is open (in any thread of the process)."""
    return bool(_configs)


def config() -> Config:
    """The innermost active configuration (the defaults when none is active)."""
    return _configs[-1] if _configs else Config()


_UNREAD = object()


class DeviceState:
    """One rank's (or the process's) CUDA state.

    The current device and the current streams are CUDA's per host thread: the rank's own thread (a thread rank,
    or a rank process's main thread) keeps them here; any other thread (one the rank started, DataParallel's
    replicas, an RPC handler) has its own, starting on device 0 and the default streams, as a new thread does.
    """

    __slots__ = ("_current", "initialized", "mem", "_streams", "fraction", "rng", "lock", "visible", "__weakref__")

    def __init__(self) -> None:
        self._current = 0
        self.initialized = False
        #: CUDA_VISIBLE_DEVICES as read when CUDA started on this rank (the node's GPUs it sees, in order; None:
        #: all of them), or _UNREAD before
        self.visible: Any = _UNREAD
        #: device -> [allocated, peak, reserved, peak reserved, allocations, frees, bytes allocated, bytes freed,
        #: out-of-memory errors]
        self.mem: dict[int, list[int]] = {}
        self._streams: dict[int, Any] = {}  # device -> current stream (absent: the default stream)
        self.fraction: dict[int, float] = {}
        self.rng: dict[int, list[int]] = {}  # device -> [seed, offset] of its generator (see rng)
        self.lock = threading.Lock()  # rank threads run at once in threads mode; finalizers on any thread

    @property
    def current(self) -> int:
        """The calling thread's current device."""
        own = _own(self)
        return self._current if own is None else own[0]

    @current.setter
    def current(self, idx: int) -> None:
        own = _own(self)
        if own is None:
            self._current = idx
        else:
            own[0] = idx

    @property
    def streams(self) -> dict[int, Any]:
        """The calling thread's current stream per device (absent: the default stream)."""
        own = _own(self)
        return self._streams if own is None else own[1]

    def counters(self, dev: int) -> list[int]:
        """The memory counters of ``dev`` (see ``mem``)."""
        c = self.mem.get(dev)
        if c is None:
            c = self.mem.setdefault(dev, [0] * 9)
        return c

    def alloc(self, dev: int, size: int) -> None:
        c = self.mem.get(dev) or self.counters(dev)
        with self.lock:
            a = c[0] = c[0] + size
            if a > c[1]:
                c[1] = a
            if a > c[2]:
                c[2] = a
                if a > c[3]:
                    c[3] = a
            c[4] += 1
            c[6] += size

    def free(self, dev: int, size: int) -> None:
        c = self.counters(dev)
        with self.lock:
            c[0] -= size
            c[5] += 1
            c[7] += size


_threads = threading.local()  # .own: {DeviceState: [current device, streams]} of a thread not its rank's own


def _own(st: DeviceState) -> list | None:
    """The calling thread's own current device and streams for ``st``, or None on the rank's own thread (a thread
    rank; outside one, the process's main thread: a rank process's)."""
    rs = current_rank_state()
    mine = threading.current_thread() is threading.main_thread() if rs is None else rs.parent is None
    if mine:
        return None
    own = getattr(_threads, "own", None)
    if own is None:
        own = _threads.own = weakref.WeakKeyDictionary()
    rec = own.get(st)
    if rec is None:
        rec = own[st] = [0, {}]
    return rec


_process = DeviceState()
_by_run: "weakref.WeakKeyDictionary[Any, dict[int, DeviceState]]" = weakref.WeakKeyDictionary()
_create = threading.Lock()


_cache = threading.local()  # per thread: (rank state, its DeviceState), the last one looked up


#: what torch raises in a process forked from one that had used CUDA (torch's "bad fork"), at its first CUDA use
BAD_FORK = ("Cannot re-initialize CUDA in forked subprocess. To use CUDA with multiprocessing, you must use the "
            "'spawn' start method")
_in_bad_fork = [False]


def initialize(st: "DeviceState") -> None:
    """The calling rank uses its devices (torch's lazy CUDA initialisation): refused in a bad fork, as torch does,
    e.g. in a DataLoader worker forked from a rank that had used its GPU."""
    if _in_bad_fork[0]:
        raise RuntimeError(BAD_FORK)
    st.initialized = True


#: whether a stand-in is enabled (set by simulator.standin.install, which imports this module)
enabled = [False]


def _after_fork_in_child() -> None:
    # the forking thread's rank had used its stand-in devices: this process is in torch's bad fork
    if enabled[0] and state().initialized:
        _in_bad_fork[0] = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def state() -> DeviceState:
    """The calling rank's device state (the process's outside a simulated rank)."""
    rs = current_rank_state()
    if rs is None:
        return _process
    hit = getattr(_cache, "hit", None)
    if hit is not None and hit[0] is rs:
        return hit[1]
    table = _by_run.get(rs.run)
    st = table.get(rs.rank) if table is not None else None
    if st is None:
        with _create:
            st = _by_run.setdefault(rs.run, {}).setdefault(rs.rank, DeviceState())
    _cache.hit = (rs, st)
    return st


def node_devices() -> int:
    """GPUs per node: the configured number, else the calling rank's world size (1 outside a world)."""
    n = config().gpus_per_node
    if n is not None:
        return n
    rs = current_rank_state()
    return 1 if rs is None else rs.run.n


def visible_devices() -> list[int] | None:
    """The node's GPUs the calling rank sees, by ``CUDA_VISIBLE_DEVICES`` (its own environment: a rank's, on thread
    ranks), read until CUDA starts on the rank and fixed then, as CUDA reads it once; None when it is not set (or
    is the value the process had when the stand-in started: that names the real machine's GPUs). As CUDA parses
    it: indices up to the first that is not one of the node's (or repeats)."""
    st = state()
    if st.visible is not _UNREAD:
        return st.visible  # type: ignore[no-any-return]
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen: list[int] | None = None
    if spec is not None and spec != _machine_visible[0]:  # (the program's own choice among the node's GPUs)
        seen, n = [], node_devices()
        for part in spec.split(","):
            part = part.strip()
            if not part.isdigit() or int(part) >= n or int(part) in seen:
                break
            seen.append(int(part))
    if st.initialized:
        st.visible = seen
    return seen


def device_count() -> int:
    """``torch.cuda.device_count()``: the GPUs the rank sees (all of its node's unless CUDA_VISIBLE_DEVICES)."""
    visible = visible_devices()
    return node_devices() if visible is None else len(visible)


def physical(idx: int) -> int:
    """The node's GPU that the rank's ``cuda:idx`` is (CUDA_VISIBLE_DEVICES renumbers the ones a process sees)."""
    visible = visible_devices()
    return idx if visible is None or idx >= len(visible) else visible[idx]


def invalid_ordinal(idx: int, call: str = "torch.cuda") -> RuntimeError:
    """torch's error for a device index past the last device, with the stand-in's note."""
    return torch.AcceleratorError(format_message(
        call, f"CUDA error: invalid device ordinal (cuda:{idx} does not exist)",
        values={"device": idx, "device_count": device_count()},
        fix="use an index below torch.cuda.device_count(), or start the stand-in with more devices per node "
            "(simulator.standin.enabled(gpus_per_node=N), python -m simulator --devices cuda --gpus-per-node N)"))


def resolve_index(device: Any, call: str = "torch.cuda") -> int:
    """The CUDA index ``device`` names (None, an int, "cuda", "cuda:1", a torch.device; no index: current)."""
    if device is None:
        idx = None
    elif isinstance(device, int) and not isinstance(device, bool):
        idx = device
    else:
        if isinstance(device, str):
            device = torch.device(device)
        if not isinstance(device, torch.device):
            idx = getattr(device, "idx", None)  # a torch.cuda.device object
            if not isinstance(idx, int):
                raise ValueError(f"Expected a cuda device, but got: {device!r}")
        elif device.type not in ("cuda", "privateuseone"):
            raise ValueError(f"Expected a cuda device, but got: {device}")
        else:
            idx = device.index
    if idx is None or idx < 0:
        idx = state().current
    if idx >= device_count():
        raise invalid_ordinal(idx, call)
    return idx


#: storages being counted, by their C++ address: (weak reference, state, device, size); none is counted twice
_tracked: dict[int, tuple[Any, DeviceState, int, int]] = {}


def _released(key: int) -> Any:
    def release(ref: Any) -> None:
        entry = _tracked.pop(key, None)
        if entry is not None:
            entry[1].free(entry[2], entry[3])

    return release


def track(inner: torch.Tensor, dev: int) -> None:
    """Count a freshly allocated stand-in storage against the calling rank's ``dev`` until it is freed."""
    storage = inner.untyped_storage()
    key = storage._cdata
    if key in _tracked:
        return
    n = storage.nbytes()
    if n == 0:
        return
    size = -(-n // BLOCK) * BLOCK
    st = state()
    initialize(st)
    used = st.mem[dev][0] if dev in st.mem else 0
    cfg = config()
    if used + size > cfg.total_memory or dev in st.fraction:
        _check_limit(st, dev, used, size, cfg)
    st.alloc(dev, size)
    # a weak reference's callback runs when torch frees the storage (its Python object lives as long as it does)
    _tracked[key] = (weakref.ref(storage, _released(key)), st, dev, size)


def check_room(dev: int, nbytes: int) -> None:
    """Raise CUDA's out-of-memory error now if ``nbytes`` more would not fit on the calling rank's ``dev``: a
    factory asks before its CPU storage is allocated (a GPU-sized request would otherwise take the host's memory,
    or fail with the CPU allocator's error, which a program catching ``torch.cuda.OutOfMemoryError`` misses)."""
    size = -(-nbytes // BLOCK) * BLOCK
    st = state()
    used = st.mem[dev][0] if dev in st.mem else 0
    cfg = config()
    if used + size > cfg.total_memory or dev in st.fraction:
        _check_limit(st, dev, used, size, cfg)


def _check_limit(st: DeviceState, dev: int, used: int, size: int, cfg: Config) -> None:
    limit = cfg.total_memory
    fraction = st.fraction.get(dev)
    if fraction is not None:
        limit = int(limit * fraction)
    if used + size > limit:
        st.counters(dev)[8] += 1  # (memory_stats' num_ooms)
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {_human(size)}. GPU {dev} has a total capacity of "
            f"{_human(cfg.total_memory)} of which {_human(max(limit - used, 0))} is free. Of the allocated "
            f"memory {_human(used)} is allocated by PyTorch (tensorplay CPU stand-in: the limit is "
            f"simulator.standin.enabled(total_memory=...))")


def _human(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"
