"""The ``devices=`` and ``gpus_per_node=`` of a simulated world: checked before anything runs, and the context a
rank process runs inside (the CUDA stand-in, :mod:`simulator.standin`, for ``devices="cuda"``)."""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from tensorplay.distributed.errors import DistValueError, format_message

__all__ = ["check_devices", "device_context"]


def device_context(devices: str, gpus_per_node: int) -> Callable[[], Any] | None:
    """A picklable factory of the context a rank process runs inside: the stand-in for devices="cuda"."""
    if devices != "cuda":
        return None
    from simulator import standin  # (lazy: see check_devices)

    return functools.partial(standin.enabled, gpus_per_node=gpus_per_node)


def check_devices(devices: Any, gpus_per_node: Any, world_size: int, device: torch.device) -> tuple[str, int]:
    """``devices=`` and ``gpus_per_node=`` of :class:`simulator.World`, checked before anything runs; returns them
    with ``gpus_per_node`` resolved (default: the world size)."""
    if devices not in ("cpu", "cuda"):
        raise DistValueError(format_message(
            "simulator.run", "devices must be 'cpu' or 'cuda'", values={"devices": devices},
            fix="pass devices='cuda' to give every rank CPU-backed stand-ins of CUDA devices, or leave the default"))
    if gpus_per_node is not None and (isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int)
                                      or gpus_per_node < 1):
        raise DistValueError(format_message("simulator.run", "gpus_per_node must be a positive int or None",
                                            values={"gpus_per_node": gpus_per_node}, fix="pass e.g. gpus_per_node=8"))
    if devices == "cuda":
        from simulator import standin  # (lazy: the stand-in's import is heavy, and only devices="cuda" needs it)

        # inside an enclosing stand-in (a launcher's), torch.cuda.is_available() is the stand-in's answer
        if device.type == "cuda" or (torch.cuda.is_available() and not standin.is_active()):
            raise DistValueError(format_message(
                "simulator.run", "devices='cuda' stands in for GPUs on a machine without one, and this one has "
                "CUDA", values={"devices": devices, "device": str(device)},
                fix="use the real GPUs: pass device='cuda' and leave devices at its default"))
    return devices, gpus_per_node if gpus_per_node is not None else world_size
