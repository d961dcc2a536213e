"""The wire: messages on a channel, and tensors described by their place in shared memory.

A tensor never travels in a message.  The rank process copies the bytes a call
reads into an *arena* (a file in ``/dev/shm`` that both processes map; see
:mod:`.staging`) and sends ``(arena, offset, dtype, size, stride)``; the proxy
builds a tensor on its own mapping of the same bytes and hands it to the
simulator, whose kernels write the results there; the rank process copies the
outputs back.  What the messages are is :mod:`.messages`.
"""
from __future__ import annotations

import os
import pickle
from typing import Any

import torch

from tensorplay.distributed.spec import BACKEND_COLLECTIVES

__all__ = ["arena_path", "Arena", "SharedStorage", "TensorRef", "GroupRef", "OUTPUTS", "SHARED_BASE", "send", "recv"]

#: ids of the program's own shared-memory storages start here (arena ids are below)
SHARED_BASE = 1 << 30

#: per backend call: the positions of the arguments whose tensors the call writes (copied back afterwards);
#: from the backend table, so a new collective's outputs are copied back without a second list to keep
OUTPUTS: dict[str, tuple[int, ...]] = {name: b.output_positions() for name, b in BACKEND_COLLECTIVES.items()}


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


def send(conn: Any, obj: Any) -> None:
    """Send a message with plain pickle (multiprocessing's own pickler would move tensors through its fd sharer)."""
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn: Any) -> Any:
    return pickle.loads(conn.recv_bytes())
