"""A CPU-backed stand-in for CUDA devices: programs written for GPUs run unmodified on a machine without one.

Inside :func:`enabled`, ``torch.cuda.is_available()`` is True and every CUDA
call of a training script works on simulated ranks: ``torch.cuda.set_device``,
``model.to(local_rank)``, ``torch.randn(..., device="cuda")``,
``DistributedDataParallel(model, device_ids=[r])``, streams, events,
``torch.cuda.memory_allocated()``, ``torch.autocast("cuda")``.  Tensors on
``cuda:i`` are :class:`StandInTensor` objects: they report ``device.type ==
"cuda"`` and index ``i``, obey CUDA's device rules, and compute every operator
on the CPU (same numbers as the CPU, bit for bit).  Device state (current
device, streams, memory counters) is per simulated rank.

Example (2 simulated ranks, a GPU program)::

    import torch, simulator
    from simulator import standin

    def body():
        torch.cuda.set_device(simulator.current_rank_state().rank)
        x = torch.ones(3, device="cuda")
        return str(x.device), torch.cuda.memory_allocated()

    with standin.enabled(gpus_per_node=2):
        simulator.run(body, 2)      # [('cuda:0', 512), ('cuda:1', 512)]

Each device has CUDA's generator state (a seed and an offset, see ``rng``), so DTensor's
sharded random initialisation (FSDP2) draws per shard as on GPUs; ``scaled_dot_product_attention``
takes CUDA's fused operators (``attention``), for which DTensor has sharding rules.

What cannot be faithful is refused with the fix named (:class:`StandInError`):
``torch.compile`` on stand-ins, CUDA graphs, operators that only have a GPU
kernel (custom CUDA extensions, Triton kernels registered as operators).
See docs/design.md ("CUDA stand-in") and docs/deviations.md.
"""
from __future__ import annotations

from typing import ContextManager

from tensorplay.distributed.errors import DistTypeError, DistValueError, format_message

from simulator.adapters.torch_private import PRIVATE_NAMES
from simulator.standin import install as _install
from simulator.standin.cuda_api import DEVICE_NAME, DeviceProperties
from simulator.standin.errors import StandInError
from simulator.standin.ranks import GIB, Config
from simulator.standin.ops import device_of
from simulator.standin.tensor import StandInTensor, is_standin

__all__ = ["enabled", "is_active", "is_standin", "device_of", "StandInTensor", "StandInError", "DeviceProperties",
           "DEVICE_NAME", "DEFAULT_TOTAL_MEMORY", "PRIVATE_TORCH_NAMES", "PATCHED_PUBLIC", "NATIVE_SYMBOLS"]

#: memory per stand-in device unless :func:`enabled` is told otherwise (80 GiB)
DEFAULT_TOTAL_MEMORY = 80 * GIB

#: Every private torch name the stand-in replaces or relies on: its records of the one list,
#: simulator.adapters.torch_private (they may change between torch releases; the adapters are pinned to
#: torch 2.13/2.14), and the module name it registers for its device.
PRIVATE_TORCH_NAMES = tuple(p.name for p in PRIVATE_NAMES if "standin" in p.users) + (
    "sys.modules['torch.privateuseone']",)

#: the public torch names replaced while a stand-in is enabled
PATCHED_PUBLIC = _install.PATCHED_PUBLIC

#: the native symbols the stand-in uses through ctypes: libc10's (simulator/standin/_native.py), then those of
#: libtorch_python's symbol table and libc10 behind pinned host memory (simulator/standin/_pinned.py)
NATIVE_SYMBOLS = _install._native.NATIVE_SYMBOLS + _install._native._pinned.SYMBOLS


def enabled(gpus_per_node: int | None = None, total_memory: int = DEFAULT_TOTAL_MEMORY) -> ContextManager[None]:
    """While active, CUDA calls run on CPU-backed stand-in devices (see the module docstring).

    Args:
        gpus_per_node: ``torch.cuda.device_count()``; None: the calling rank's world size (1 outside a world).
        total_memory: bytes per device: ``get_device_properties().total_memory``, and the limit past which an
            allocation raises ``torch.OutOfMemoryError``.

    Contexts nest (the innermost configuration applies) and may be entered by several worlds at once; the
    patches are installed by the first entry and removed by the last exit.
    """
    if gpus_per_node is not None and (isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int)):
        raise DistTypeError(format_message("simulator.standin.enabled", "gpus_per_node must be an int or None",
                                           values={"gpus_per_node": gpus_per_node}, fix="pass e.g. gpus_per_node=8"))
    if gpus_per_node is not None and not 1 <= gpus_per_node <= 64:
        raise DistValueError(format_message("simulator.standin.enabled", "gpus_per_node must be between 1 and 64",
                                            values={"gpus_per_node": gpus_per_node}, fix="pass e.g. gpus_per_node=8"))
    if isinstance(total_memory, bool) or not isinstance(total_memory, int) or total_memory <= 0:
        raise DistValueError(format_message("simulator.standin.enabled", "total_memory must be a positive int "
                                            "(bytes)", values={"total_memory": total_memory},
                                            fix="pass e.g. total_memory=80 * 2**30"))
    return _install.configured(Config(gpus_per_node=gpus_per_node, total_memory=total_memory))


def is_active() -> bool:
    """Whether a stand-in is enabled now (in any thread of the process)."""
    return _install.active()
