"""What a rank process and its proxy thread exchange: messages, and tensors described by place in shared memory.

A tensor never travels in a message.  The rank process copies the bytes a call
reads into an *arena* (a file in ``/dev/shm`` that both processes map) and
sends ``(arena, offset, dtype, size, stride)``; the proxy builds a tensor on its
own mapping of the same bytes and hands it to the simulator, whose kernels
write the results there; the rank process copies the outputs back.  Tensors of
one storage are staged as one byte span, so views that alias each other in the
program alias each other in the arena too (in-place and overlapping calls keep
their meaning).
"""
from __future__ import annotations

import os
import pickle
from typing import Any

import torch

__all__ = ["arena_path", "Arena", "SharedStorage", "TensorRef", "GroupRef", "OUTPUTS", "ALIGN", "SHARED_BASE"]

#: ids of the program's own shared-memory storages start here (arena ids are below)
SHARED_BASE = 1 << 30

#: byte alignment of every staged span (a multiple of every element size)
ALIGN = 64

#: per backend call: the positions of the arguments whose tensors the call writes (copied back afterwards)
OUTPUTS: dict[str, tuple[int, ...]] = {
    "barrier": (), "broadcast": (0,), "all_reduce": (0,), "reduce": (0,), "all_gather": (0,),
    "all_gather_into_tensor": (0,), "gather": (1,), "scatter": (0,), "reduce_scatter": (0,),
    "reduce_scatter_tensor": (0,), "all_to_all": (0,), "all_to_all_single": (0,), "send": (), "recv": (0,),
}


class TensorRef(tuple):
    """``(arena id, element offset, dtype, size, stride, requires_grad)`` of a staged tensor."""

    __slots__ = ()


class GroupRef(tuple):
    """``(gid,)``: a process group, by the simulator's id of it."""

    __slots__ = ()


class Arena:
    """One shared-memory file mapped as a byte tensor (the same bytes in the rank process and its proxy)."""

    __slots__ = ("aid", "path", "size", "storage", "bytes")

    def __init__(self, aid: int, path: str, size: int, create: bool) -> None:
        self.aid = aid
        self.path = path
        self.size = size
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)  # sparse: pages are only allocated when a call touches them
            finally:
                os.close(fd)
        self.storage = torch.UntypedStorage.from_file(path, True, size)
        self.bytes = torch.empty(0, dtype=torch.uint8).set_(self.storage)

    def view(self, offset_elems: int, dtype: torch.dtype, size: tuple[int, ...],
             stride: tuple[int, ...]) -> torch.Tensor:
        """The tensor at ``offset_elems`` (in elements of ``dtype``) of this arena."""
        return torch.empty(0, dtype=dtype).set_(self.storage, offset_elems, size, stride)


class SharedStorage:
    """A storage of the program that already lives in shared memory (``share_memory_()``), mapped in the proxy.

    Calls on it are not staged: the simulator reads and writes the program's own bytes.
    """

    __slots__ = ("storage",)

    def __init__(self, fd: int, size: int) -> None:
        self.storage = torch.UntypedStorage._new_shared_fd_cpu(fd, size)

    def view(self, offset_elems: int, dtype: torch.dtype, size: tuple[int, ...],
             stride: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(0, dtype=dtype).set_(self.storage, offset_elems, size, stride)


def arena_path(arena_dir: str, rank: int, aid: int) -> str:
    """The file of rank ``rank``'s arena ``aid`` (created by the rank process, mapped by its proxy on first use)."""
    return os.path.join(arena_dir, f"r{rank}-a{aid}")


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


def flatten(obj: Any) -> list[torch.Tensor]:
    """The tensors in an argument (a tensor, a list of tensors, or anything else)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for t in obj if isinstance(t, torch.Tensor)]
    return []


def send(conn: Any, obj: Any) -> None:
    """Send a message with plain pickle (multiprocessing's own pickler would move tensors through its fd sharer)."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Any) -> Any:
    return pickle.loads(conn.recv_bytes())
