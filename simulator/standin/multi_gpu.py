"""The copies between one process's GPUs that ``nn.DataParallel`` makes, on stand-ins.

``nn.DataParallel`` (and ``torch.nn.parallel.comm``: ``broadcast``, ``broadcast_coalesced``, ``scatter``,
``gather``) call CUDA-only bindings of ``torch._C`` to copy tensors between the devices of one process.
While the stand-in is enabled these are its own, and copy between stand-in devices with ``Tensor.to``: the
outputs are what CUDA's give (each on its device; the source device's own tensors are handed back as they
are, as CUDA's broadcast does), and autograd is ``DataParallel``'s, which calls them from its own functions.
``comm.reduce_add`` adds on the destination device (NCCL is not there, so torch takes its own path).

Example::

    with standin.enabled(gpus_per_node=2):
        model = torch.nn.DataParallel(torch.nn.Linear(4, 2)).cuda()
        out = model(torch.randn(6, 4).cuda())     # 3 rows on cuda:0, 3 on cuda:1, gathered on cuda:0
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from simulator.standin.ranks import resolve_index

__all__ = ["BINDINGS"]


def _on(idx: int) -> torch.device:
    return torch.device("cuda", resolve_index(idx, "torch.nn.parallel.comm"))


def _copy_to(t: torch.Tensor, idx: int) -> torch.Tensor:
    """``t`` on device ``idx``: itself where it already is (as CUDA's broadcast hands the source's back), else a copy."""
    where = _on(idx)
    return t if t.device == where else t.to(where)


def _broadcast(tensor: torch.Tensor, devices: Sequence[int]) -> list[torch.Tensor]:
    return [_copy_to(tensor, d) for d in devices]


def _broadcast_out(tensor: torch.Tensor, out_tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    for out in out_tensors:
        out.copy_(tensor)
    return list(out_tensors)


def _broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[int], buffer_size: int
                         ) -> list[list[torch.Tensor]]:
    # (buffer_size only sizes CUDA's copies; the values are the same)
    return [[_copy_to(t, d) for t in tensors] for d in devices]


def _scatter(tensor: torch.Tensor, devices: Sequence[int], chunk_sizes: Sequence[int] | None = None, dim: int = 0,
             streams: Any = None) -> list[torch.Tensor]:
    chunks = tensor.split(list(chunk_sizes), dim) if chunk_sizes is not None else tensor.chunk(len(devices), dim)
    return [c.to(_on(d)) for c, d in zip(chunks, devices)]


def _scatter_out(tensor: torch.Tensor, out_tensors: Sequence[torch.Tensor], dim: int = 0,
                 streams: Any = None) -> list[torch.Tensor]:
    for out, chunk in zip(out_tensors, tensor.split([o.size(dim) for o in out_tensors], dim)):
        out.copy_(chunk)
    return list(out_tensors)


def _gather(tensors: Sequence[torch.Tensor], dim: int = 0, destination: int | None = None) -> torch.Tensor:
    where = torch.device("cpu") if destination == -1 else _on(-1 if destination is None else destination)
    return torch.cat([t.to(where) for t in tensors], dim)


def _gather_out(tensors: Sequence[torch.Tensor], out_tensor: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat([t.to(out_tensor.device) for t in tensors], dim, out=out_tensor)


#: the bindings of torch._C the stand-in provides while enabled
BINDINGS = {f.__name__: f for f in (_broadcast, _broadcast_out, _broadcast_coalesced, _scatter, _scatter_out,
                                     _gather, _gather_out)}
