"""The stand-in devices' random number generators: one ``(seed, offset)`` generator per rank and device.

A CUDA device draws from a counter-based Philox generator whose whole state is a 64-bit seed and a
64-bit offset; ``torch.cuda.get_rng_state()`` returns them as 16 bytes, and every random operator
advances the offset.  DTensor builds on exactly that: to give each shard of a random tensor its own
numbers, it moves the offset to ``shard index * shard size`` before the local draw and to
``old offset + whole numel`` after it, so replicas draw alike and every rank leaves in step.

The stand-in keeps the same state per rank and device, and computes a random operator on the CPU
with the CPU generator seeded from ``(seed, offset)`` (mixed through BLAKE2b), restoring the CPU
generator afterwards; the offset then advances by the operator's element count rounded up to 4
(DTensor's own arithmetic).  So: two draws at one ``(seed, offset)`` are equal, draws at different
offsets are independent, ``get_rng_state``/``set_rng_state`` replay, ``torch.cuda.manual_seed`` seeds
the device and not the CPU, and ``torch.manual_seed`` seeds both, as on a GPU.  The numbers differ
from a GPU's (see docs/deviations.md).

Example (2 simulated ranks)::

    torch.cuda.manual_seed(7)
    state = torch.cuda.get_rng_state()          # 16 bytes: seed 7, offset 0
    a = torch.randn(5, device="cuda")           # offset -> 8
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.randn(5, device="cuda").cpu(), a.cpu())
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch

from simulator.standin.ranks import DeviceState, device_count, resolve_index, state
from simulator.standin.device_type import replacement_class

__all__ = ["generator", "draw", "advance", "get_state", "set_state", "seed_devices", "all_devices", "StandInGenerator",
           "generator_class", "CudaGenerator"]

_MASK = (1 << 64) - 1


def generator(st: DeviceState, idx: int) -> list[int]:
    """``[seed, offset]`` of the rank's device ``idx``; a device never seeded starts from the rank's CPU seed
    (what a process that was seeded before the run, or a fresh one, gives every device)."""
    g = st.rng.get(idx)
    if g is None:
        g = st.rng.setdefault(idx, [torch.initial_seed() & _MASK, 0])
    return g


def _mix(seed: int, offset: int) -> int:
    digest = hashlib.blake2b(seed.to_bytes(8, "little") + offset.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _numel(out: Any) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel()
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o.numel()
    return 0


def draw(idx: int, call: Callable[[], Any]) -> Any:
    """Run ``call`` (a random operator on CPU tensors) as a draw from device ``idx``'s generator."""
    g = generator(state(), idx)
    cpu = torch._C.default_generator
    saved = cpu.get_state()
    cpu.manual_seed(_mix(g[0], g[1]))
    try:
        out = call()
    finally:
        cpu.set_state(saved)
    advance(g, _numel(out))
    return out


def advance(g: list[int], numel: int) -> None:
    """Move generator ``g``'s offset past a draw of ``numel`` numbers (rounded up to 4, as DTensor computes it)."""
    g[1] = (g[1] + max(4, -(-numel // 4) * 4)) & _MASK


def get_state(idx: int) -> torch.Tensor:
    """The 16-byte state of the rank's device ``idx``: seed then offset, little-endian (CUDA's layout)."""
    seed, offset = generator(state(), idx)
    return torch.frombuffer(bytearray(seed.to_bytes(8, "little") + offset.to_bytes(8, "little")),
                            dtype=torch.uint8)


def set_state(idx: int, new_state: torch.Tensor, call: str) -> None:
    """Restore a state from :func:`get_state` (CUDA's 16 bytes)."""
    if isinstance(new_state, torch.Tensor) and (new_state.device.type != "cpu" or new_state.layout != torch.strided):
        # torch's own check (a state saved with torch.cuda.get_rng_state() and loaded with map_location="cuda:i"
        # lands on the GPU: a GPU refuses it so)
        raise TypeError(f"RNG state must be a torch.ByteTensor ({call}: new_state is on {new_state.device}). Fix: "
                        "pass it on the CPU (new_state.cpu(), or torch.load(..., map_location='cpu') for the state)")
    if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8 or new_state.numel() != 16:
        got = new_state if not isinstance(new_state, torch.Tensor) else \
            f"tensor(dtype={new_state.dtype}, numel={new_state.numel()})"
        raise RuntimeError(f"{call}: a CUDA generator state is 16 bytes (torch.uint8: seed, offset); "
                           f"new_state={got}. Fix: pass a state from torch.cuda.get_rng_state() (a CPU generator's "
                           "state from torch.get_rng_state() belongs to torch.set_rng_state)")
    raw = bytes(new_state.detach().cpu().contiguous().tolist())
    state().rng[idx] = [int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")]


def seed_devices(seed: int, devices: Any) -> None:
    """Seed ``devices`` of the calling rank (offset 0)."""
    st = state()
    for idx in devices:
        st.rng[idx] = [int(seed) & _MASK, 0]


class StandInGenerator:
    """``torch.cuda.default_generators[i]`` on the stand-in: device ``i``'s generator of the calling rank."""

    def __init__(self, idx: int) -> None:
        self.idx = idx

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.idx)

    def manual_seed(self, seed: int) -> "StandInGenerator":
        seed_devices(seed, [self.idx])
        return self

    def seed(self) -> int:
        s = torch.Generator().seed()
        seed_devices(s, [self.idx])
        return s

    def initial_seed(self) -> int:
        return generator(state(), self.idx)[0]

    def get_state(self) -> torch.Tensor:
        return get_state(self.idx)

    def set_state(self, new_state: torch.Tensor) -> "StandInGenerator":
        set_state(self.idx, new_state, "torch.cuda.default_generators[i].set_state")
        return self

    def get_offset(self) -> int:
        return generator(state(), self.idx)[1]

    def set_offset(self, offset: int) -> "StandInGenerator":
        generator(state(), self.idx)[1] = int(offset) & _MASK
        return self

    def __repr__(self) -> str:
        return f"<stand-in CUDA generator of cuda:{self.idx}>"


def all_devices() -> range:
    """Every device index of a node."""
    return range(device_count())


class CudaGenerator(torch.Generator):
    """``torch.Generator(device="cuda:i")`` on the stand-in: a generator of the program's own (not the device's
    default), on ``cuda:i`` for the program, whose numbers come from the CPU generator it is underneath.

    Seeded alike, two of them draw alike; they draw other numbers than a GPU's Philox generator (see
    docs/deviations.md).  Its state is the CPU generator's (``get_state``/``set_state`` round-trip).
    """

    def __new__(cls, idx: int) -> "CudaGenerator":
        g = super().__new__(cls)  # (a CPU generator underneath: the stand-in computes on the CPU)
        g._tp_idx = idx
        return g

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self._tp_idx)

    def __repr__(self) -> str:
        return f"<torch.Generator on the stand-in of cuda:{self._tp_idx}>"

    def __reduce__(self) -> Any:
        # pickled (a DataLoader's sampler sent to spawned workers) as what it is: a generator on cuda:i, its state
        return _rebuild_cuda_generator, (self._tp_idx, self.get_state())


def _rebuild_cuda_generator(idx: int, state: torch.Tensor) -> CudaGenerator:
    g = CudaGenerator(idx)
    g.set_state(state)
    return g


def generator_class(original: type) -> type:
    """``torch.Generator`` while the stand-in is enabled: ``torch.Generator(device="cuda")`` makes a
    :class:`CudaGenerator` (torch's own needs a GPU build), any other device torch's own; ``isinstance`` and
    ``issubclass`` answer for torch's generators as before."""

    def make(device: Any = None) -> Any:
        d = torch.device(device) if isinstance(device, str) else device
        if isinstance(d, torch.device) and d.type == "cuda":
            return CudaGenerator(resolve_index(d, "torch.Generator"))
        return original() if device is None else original(device)

    return replacement_class(original, make)
