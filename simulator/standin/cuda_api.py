"""``torch.cuda`` on the CPU stand-in: devices, streams, events, memory and RNG, per simulated rank.

These functions replace their ``torch.cuda`` namesakes while
:func:`simulator.standin.enabled` is active (see ``install``).  Each answers
for the calling rank (see ``ranks``): its current device, its current stream
per device, the bytes its live stand-in tensors hold.

CPU work is synchronous, so streams never run ahead: ``synchronize()`` returns
at once, every event is complete as soon as it is recorded, and
``elapsed_time`` measures the wall time between two records.  Each device of
each rank has a ``(seed, offset)`` generator, as CUDA's Philox (see ``rng``):
its numbers differ from the ones a GPU would draw.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from tensorplay.distributed.errors import format_message

from simulator.standin import ranks, rng
from simulator.standin.errors import StandInError
from simulator.standin.ranks import resolve_index, state
from simulator.standin.streams import Event, Stream, current_stream, default_stream, set_stream

__all__ = ["DEVICE_NAME", "DeviceProperties", "Stream", "Event", "is_available", "device_count", "current_device",
           "set_device", "exchange_device", "maybe_exchange_device", "get_device_name", "get_device_capability",
           "get_device_properties", "synchronize", "current_stream", "default_stream", "set_stream",
           "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
           "reset_peak_memory_stats", "reset_accumulated_memory_stats", "memory_stats", "mem_get_info",
           "empty_cache", "set_per_process_memory_fraction", "memory_stats_as_nested_dict", "memory_snapshot",
           "get_allocator_backend", "get_per_process_memory_fraction", "caching_allocator_enable",
           "host_memory_stats", "host_memory_stats_as_nested_dict", "reset_peak_host_memory_stats", "manual_seed",
           "manual_seed_all", "seed", "seed_all",
           "initial_seed",
           "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all", "DefaultGenerators",
           "is_bf16_supported", "is_initialized", "lazy_init", "refuse_graphs", "refuse_memory_history",
           "CUDAGraph", "set_sync_debug_mode", "get_sync_debug_mode"]

#: the name every stand-in device reports (``{}``: its index)
DEVICE_NAME = "tensorplay CPU stand-in (cuda:{})"


def lazy_init() -> None:
    """``torch.cuda._lazy_init``: nothing to start; marks the calling rank's CUDA state as initialized."""
    ranks.initialize(state())


def is_initialized() -> bool:
    """Whether the calling rank has used CUDA (set a device, made a stream or a stand-in tensor)."""
    return state().initialized


def is_available() -> bool:
    """True: the stand-in devices are always there."""
    return True


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """True, as on the Hopper-class device the stand-in describes (compute capability 9.0)."""
    return True


def device_count() -> int:
    """Devices per node (:func:`simulator.standin.enabled`'s ``gpus_per_node``; default: the world size)."""
    return ranks.device_count()


def current_device() -> int:
    """The calling rank's current device index."""
    st = state()
    ranks.initialize(st)
    return st.current


def set_device(device: Any) -> None:
    """Select the calling rank's current device (an int, ``"cuda:i"`` or a device); negative: no-op."""
    if isinstance(device, int) and device < 0:
        return
    idx = resolve_index(device, "torch.cuda.set_device")
    st = state()
    st.current = idx
    ranks.initialize(st)


def exchange_device(idx: int) -> int:
    """``torch.cuda._exchange_device``: select ``idx`` (negative: no change), return the previous device."""
    if idx < 0:
        return -1
    st = state()
    prev = st.current
    set_device(idx)
    return prev


def maybe_exchange_device(idx: int) -> int:
    """``torch.cuda._maybe_exchange_device``: as :func:`exchange_device` (no context to avoid creating)."""
    return exchange_device(idx)


@dataclass(frozen=True)
class DeviceProperties:
    """What ``torch.cuda.get_device_properties`` reports for a stand-in device: a named, CPU-backed device
    with the configured memory and the compute capability (9.0) and SM count of a Hopper-class GPU."""

    name: str
    total_memory: int
    major: int = 9
    minor: int = 0
    multi_processor_count: int = 132
    is_integrated: int = 0
    is_multi_gpu_board: int = 0
    max_threads_per_multi_processor: int = 2048
    warp_size: int = 32
    regs_per_multiprocessor: int = 65536
    shared_memory_per_block: int = 49152
    shared_memory_per_block_optin: int = 232448
    shared_memory_per_multiprocessor: int = 233472
    L2_cache_size: int = 50 << 20
    clock_rate: int = 1_980_000  # kHz, as CUDA reports them (an H100 SXM's boost clock)
    memory_clock_rate: int = 2_619_000  # kHz (its HBM3)
    memory_bus_width: int = 5120  # bits
    max_threads_per_block: int = 1024
    gcnArchName: str = "NVIDIA"  # noqa: N815  (torch's attribute name)
    uuid: str = "00000000-0000-0000-0000-000000000000"

    def __repr__(self) -> str:
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // (1 << 20)}MB, multi_processor_count="
                f"{self.multi_processor_count}, uuid={self.uuid}, L2_cache_size={self.L2_cache_size >> 20}MB)")


def get_device_properties(device: Any = None) -> DeviceProperties:
    """The stand-in device's properties (name ``tensorplay CPU stand-in (cuda:i)``)."""
    try:
        idx = resolve_index(device, "torch.cuda.get_device_properties")
    except torch.AcceleratorError as e:  # (torch's Python checks the index first, with an AssertionError)
        raise AssertionError(f"Invalid device id: {e}") from None
    return DeviceProperties(name=DEVICE_NAME.format(idx), total_memory=ranks.config().total_memory)


def get_device_name(device: Any = None) -> str:
    """``tensorplay CPU stand-in (cuda:i)``."""
    return get_device_properties(device).name


def get_device_capability(device: Any = None) -> tuple[int, int]:
    """(9, 0)."""
    p = get_device_properties(device)
    return p.major, p.minor


def _nvml_reading(name: str) -> Callable[..., int]:
    def reading(device: Any = None) -> int:
        resolve_index(device, f"torch.cuda.{name}")
        return 0  # (an idle device: no kernel ever runs on a stand-in)

    reading.__name__ = reading.__qualname__ = name
    reading.__doc__ = f"``torch.cuda.{name}`` (NVML's reading): 0 on a stand-in, which runs no kernel."
    return reading


#: NVML's readings (torch asks pynvml): an idle device's
utilization, memory_usage, temperature, power_draw, clock_rate = (
    _nvml_reading(n) for n in ("utilization", "memory_usage", "temperature", "power_draw", "clock_rate"))


def synchronize(device: Any = None) -> None:
    """Returns at once: stand-in work is done when the call that issued it returns."""
    resolve_index(device, "torch.cuda.synchronize")


# -- memory -------------------------------------------------------------------------------------------
def _mem(device: Any, call: str) -> tuple[ranks.DeviceState, int, list[int]]:
    idx = resolve_index(device, call)
    st = state()
    return st, idx, st.counters(idx)


def memory_allocated(device: Any = None) -> int:
    """Bytes held by the calling rank's live stand-in tensors on ``device`` (each rounded up to 512 bytes)."""
    return _mem(device, "torch.cuda.memory_allocated")[2][0]


def max_memory_allocated(device: Any = None) -> int:
    """The peak of :func:`memory_allocated` since the start or the last :func:`reset_peak_memory_stats`."""
    return _mem(device, "torch.cuda.max_memory_allocated")[2][1]


def memory_reserved(device: Any = None) -> int:
    """The allocator's cache: the high-water mark of allocated bytes since the last :func:`empty_cache`."""
    return _mem(device, "torch.cuda.memory_reserved")[2][2]


def max_memory_reserved(device: Any = None) -> int:
    """The peak of :func:`memory_reserved`."""
    return _mem(device, "torch.cuda.max_memory_reserved")[2][3]


def reset_peak_memory_stats(device: Any = None) -> None:
    """Restart the peaks from the current values."""
    st, _, c = _mem(device, "torch.cuda.reset_peak_memory_stats")
    with st.lock:
        c[1], c[3] = c[0], c[2]


def reset_accumulated_memory_stats(device: Any = None) -> None:
    """Zero the allocation and free counts, and the out-of-memory errors."""
    st, _, c = _mem(device, "torch.cuda.reset_accumulated_memory_stats")
    with st.lock:
        c[4:9] = [0, 0, 0, 0, 0]


def empty_cache() -> None:
    """Release the cache: reserved memory drops to what is allocated."""
    st = state()
    with st.lock:
        for c in st.mem.values():
            c[2] = c[0]


def memory_stats(device: Any = None) -> dict[str, int]:
    """``torch.cuda.memory_stats``'s keys (so ``memory_summary`` works).

    The stand-in has one pool: every figure is under ``all`` and ``large_pool``; ``small_pool`` is zero;
    segments and split blocks do not exist (zero), and requested bytes are the allocated ones.
    """
    c = list(_mem(device, "torch.cuda.memory_stats")[2])
    figures = {
        "allocated_bytes": (c[0], c[1], c[6], c[7]), "active_bytes": (c[0], c[1], c[6], c[7]),
        "requested_bytes": (c[0], c[1], c[6], c[7]), "reserved_bytes": (c[2], c[3], c[2], 0),
        "allocation": (c[4] - c[5], c[4] - c[5], c[4], c[5]), "active": (c[4] - c[5], c[4] - c[5], c[4], c[5]),
        "segment": (0, 0, 0, 0), "inactive_split": (0, 0, 0, 0), "inactive_split_bytes": (0, 0, 0, 0),
    }
    stats: dict[str, int] = {}
    for name, values in figures.items():
        for pool in ("all", "large_pool", "small_pool"):
            for stat, v in zip(("current", "peak", "allocated", "freed"), values):
                stats[f"{name}.{pool}.{stat}"] = 0 if pool == "small_pool" else v
    for name in ("oversize_allocations", "oversize_segments"):
        for stat in ("current", "peak", "allocated", "freed"):
            stats[f"{name}.{stat}"] = 0
    stats.update({"num_alloc_retries": 0, "num_ooms": c[8], "num_sync_all_streams": 0, "num_device_alloc": 0,
                  "num_device_free": 0, "max_split_size": -1})
    return stats


def memory_stats_as_nested_dict(device: Any = None) -> dict[str, Any]:
    """:func:`memory_stats` nested by the parts of its keys, as torch's C++ gives it."""
    nested: dict[str, Any] = {}
    for key, v in memory_stats(device).items():
        *path, last = key.split(".")
        d = nested
        for part in path:
            d = d.setdefault(part, {})
        d[last] = v
    return nested


def memory_snapshot(mempool_id: Any = None, include_traces: bool = True) -> list:
    """The caching allocator's segments: none on the stand-in (``memory_stats`` counts no segment either)."""
    return []


def get_allocator_backend() -> str:
    """torch's own caching allocator, as a GPU run without ``PYTORCH_ALLOC_CONF=backend:cudaMallocAsync`` has."""
    return "native"


def get_per_process_memory_fraction(device: Any = None) -> float:
    """The cap :func:`set_per_process_memory_fraction` set on ``device`` for the calling rank (1.0: none)."""
    return state().fraction.get(resolve_index(device, "torch.cuda.get_per_process_memory_fraction"), 1.0)


def caching_allocator_enable(value: bool = True) -> None:
    """Nothing to switch: the stand-in has no caching allocator (its memory figures follow live tensors)."""
    return None


_HOST_STATS = ("allocations", "allocated_bytes", "active_requests", "active_bytes")


def host_memory_stats_as_nested_dict() -> dict[str, Any]:
    """The pinned host allocator's figures: all zero, since pinned memory is ordinary memory on the stand-in."""
    nested: dict[str, Any] = {n: dict.fromkeys(("current", "peak", "allocated", "freed"), 0) for n in _HOST_STATS}
    nested.update({"num_host_alloc": 0, "num_host_free": 0})
    for n in ("host_alloc_time", "host_free_time"):
        nested[n] = dict.fromkeys(("total", "max", "min", "count", "avg"), 0)
    return nested


def host_memory_stats() -> dict[str, Any]:
    """:func:`host_memory_stats_as_nested_dict` flattened into ``"allocations.current"``-style keys."""
    flat: dict[str, Any] = {}
    for name, v in host_memory_stats_as_nested_dict().items():
        if isinstance(v, dict):
            flat.update({f"{name}.{k}": x for k, x in v.items()})
        else:
            flat[name] = v
    return dict(sorted(flat.items()))


def reset_peak_host_memory_stats() -> None:
    """No pinned host allocator: nothing to reset."""
    return None


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """``(free, total)`` bytes of ``device`` as the calling rank sees it (free: total less the reserved bytes)."""
    c = _mem(device, "torch.cuda.mem_get_info")[2]
    total = ranks.config().total_memory
    return total - c[2], total


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Cap the calling rank's allocations on ``device`` at ``fraction`` of its memory."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    state().fraction[resolve_index(device, "torch.cuda.set_per_process_memory_fraction")] = fraction


# -- random numbers: a (seed, offset) generator per rank and device, as CUDA's Philox (see rng) ----------
def manual_seed(seed: int) -> None:
    """Seed the calling rank's current device (its generator restarts at offset 0; the CPU's is untouched)."""
    rng.seed_devices(seed, [resolve_index(None, "torch.cuda.manual_seed")])


def manual_seed_all(seed: int) -> None:
    """Seed every device of the calling rank (``torch.manual_seed`` calls this too)."""
    rng.seed_devices(seed, rng.all_devices())


def seed() -> None:
    """Seed the calling rank's current device from a random number."""
    rng.StandInGenerator(resolve_index(None, "torch.cuda.seed")).seed()


def seed_all() -> None:
    """Seed every device of the calling rank from one random number."""
    rng.seed_devices(torch.Generator().seed(), rng.all_devices())


def initial_seed() -> int:
    """The current device's seed."""
    return rng.generator(state(), resolve_index(None, "torch.cuda.initial_seed"))[0]


def get_rng_state(device: Any = "cuda") -> torch.Tensor:
    """``device``'s generator state: 16 bytes (seed, offset), laid out as CUDA's Philox state."""
    return rng.get_state(resolve_index(device, "torch.cuda.get_rng_state"))


def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    """Restore a state from :func:`get_rng_state`."""
    rng.set_state(resolve_index(device, "torch.cuda.set_rng_state"), new_state, "torch.cuda.set_rng_state")


def get_rng_state_all() -> list[torch.Tensor]:
    """One state per device."""
    return [rng.get_state(i) for i in rng.all_devices()]


def set_rng_state_all(new_states: Sequence[torch.Tensor]) -> None:
    """Restore one state per device."""
    for i, s in enumerate(new_states):
        rng.set_state(resolve_index(i, "torch.cuda.set_rng_state_all"), s, "torch.cuda.set_rng_state_all")


class DefaultGenerators(Sequence):
    """``torch.cuda.default_generators``: one generator per device, each the calling rank's."""

    def __len__(self) -> int:
        return device_count()

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [rng.StandInGenerator(j) for j in range(len(self))[i]]
        if not -len(self) <= i < len(self):
            raise IndexError("tuple index out of range")
        return rng.StandInGenerator(i % len(self))

    def __iter__(self) -> Iterator[Any]:
        return (rng.StandInGenerator(j) for j in range(len(self)))


# -- CUDA graphs: refused ---------------------------------------------------------------------------------
_SYNC_DEBUG_MODES = {"default": 0, "warn": 1, "error": 2}
_sync_debug_mode = [0]  # one per process, as CUDA's


def set_sync_debug_mode(debug_mode: int | str) -> None:
    """``torch.cuda.set_sync_debug_mode``: kept and answered; no operation synchronises a stand-in, so none warns
    or raises under ``"warn"``/``"error"`` (docs/deviations.md)."""
    if isinstance(debug_mode, str):
        if debug_mode not in _SYNC_DEBUG_MODES:
            raise RuntimeError("invalid value of debug_mode, expected one of `default`, `warn`, `error`")
        debug_mode = _SYNC_DEBUG_MODES[debug_mode]
    lazy_init()
    _sync_debug_mode[0] = int(debug_mode)


def get_sync_debug_mode() -> int:
    """``torch.cuda.get_sync_debug_mode``: the mode last set (0, ``"default"``, to begin with)."""
    return _sync_debug_mode[0]


def refuse_graphs(*args: Any, **kwargs: Any) -> Any:
    """CUDA graphs replay recorded GPU kernels; the stand-in has none to record."""
    raise StandInError(format_message(
        "torch.cuda.graphs", "CUDA graph capture and replay cannot run on the CPU stand-in",
        fix="run the captured function eagerly (skip torch.cuda.graph / make_graphed_callables when "
            "simulating), or run on real GPUs"))


def refuse_memory_history(*args: Any, **kwargs: Any) -> Any:
    """``torch.cuda.memory._record_memory_history`` and its snapshots trace the caching allocator's blocks."""
    raise StandInError(format_message(
        "torch.cuda.memory._record_memory_history", "the CPU stand-in has no caching allocator whose blocks "
        "could be recorded", fix="read torch.cuda.memory_allocated() / max_memory_allocated() (they count each "
        "rank's stand-in tensors), or record the history on real GPUs"))


class CUDAGraph:
    """``torch.cuda.CUDAGraph``: refused on construction (see :func:`refuse_graphs`)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return refuse_graphs()
