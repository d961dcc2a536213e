"""What travels between simulated workers: every request and answer, serialised.

* **By value.**  Every request and answer is serialised: plain ``pickle``
  (``dill`` when pickle cannot, e.g. a lambda), with tensors copied out of
  band (``clone``; between rank processes, large ones straight into a file in shared memory, see
  :class:`Staged`), so no object is ever shared between two workers.  A tensor
  that requires grad inside a distributed-autograd context is recorded for the
  backward pass (:mod:`simulator.rpc.autograd`) and arrives as a fresh leaf.
* **Authenticated.**  Every message is sealed by its sender and checked by
  its receiver before anything is unpickled, with the same code as on
  TensorPipe (:mod:`tensorplay.distributed.rpc.transport`): under the world's
  ``TENSORPLAY_RPC_SECRET``/``_FILE`` when set, else under a secret the run
  generates (the simulator starts every member itself).  The envelope's bytes
  are not counted in the trace's message sizes.
* **RRefs only inside messages.**  An RRef pickles only while a message is
  being encoded (:func:`in_message`); the message holds one reference to its
  value while in flight (:func:`retain_for_message`), given back if the
  message fails to serialise.
"""
from __future__ import annotations

import io
import itertools
import math
import mmap
import os
import pickle
import threading
from typing import Any

import torch
from torch import nn

from tensorplay.distributed.rpc import transport as rpc_transport
from tensorplay.distributed.rpc.transport import dill_pickler

from simulator.rpc import autograd as rpc_autograd

__all__ = ["Message", "encode", "decode", "in_message", "retain_for_message"]

_codec = threading.local()  # .depth > 0 while a message is being encoded (RRefs may only pickle then)


#: set in a rank process (:mod:`simulator.isolation.rpc_process`): a folder in shared memory where the large
#: tensors of its messages are staged (None: they are copied and pickled with the message)
stage_dir: str | None = None
STAGE_MIN_BYTES = 1 << 18  # smaller tensors cost less pickled than staged
_stage_ids = itertools.count(1)


class Staged:
    """A tensor of a message between rank processes, staged in a file in shared memory: the coordinator routes
    the message with this small record in its place, and the receiver copies the bytes out once (see
    :func:`decode`) and removes the file; pickled, the tensor would be copied at each of the four crossings."""

    __slots__ = ("path", "dtype", "shape", "size")

    def __init__(self, path: str, dtype: torch.dtype, shape: tuple[int, ...], size: int) -> None:
        self.path, self.dtype, self.shape, self.size = path, dtype, shape, size

    def numel(self) -> int:  # (Message.nbytes counts a staged tensor as the tensor it stands for)
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.size // max(1, self.numel())

    def load(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        with open(self.path, "rb") as f:
            mm = mmap.mmap(f.fileno(), self.size, access=mmap.ACCESS_COPY)
        try:
            src = torch.frombuffer(mm, dtype=torch.uint8)
            out.reshape(-1).view(torch.uint8).copy_(src)
            del src  # (the mapping closes once no tensor exports it)
        finally:
            mm.close()
            os.unlink(self.path)
        return out


def _stage(t: Any) -> Any:
    """``t`` staged in :data:`stage_dir` when it is a large plain CPU tensor (else ``t`` itself)."""
    if stage_dir is None or type(t) is not torch.Tensor or t.requires_grad or t.device.type != "cpu" \
            or t.layout != torch.strided or t.is_quantized or not t.is_contiguous():
        return t
    size = t.numel() * t.element_size()
    if size < STAGE_MIN_BYTES:
        return t
    path = os.path.join(stage_dir, f"rpc-{os.getpid()}-{next(_stage_ids)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    try:
        dst = torch.frombuffer(mm, dtype=torch.uint8)
        dst.copy_(t.reshape(-1).view(torch.uint8))
        del dst
    finally:
        mm.close()
    return Staged(path, t.dtype, tuple(t.shape), size)


def _copy_tensor(t: torch.Tensor) -> Any:
    dmap = getattr(_codec, "device_map", None)
    dev = dmap.get(t.device) if dmap else None
    if stage_dir is not None and dev is None:
        staged = _stage(t)  # (the copy the message takes, for a large plain tensor: straight into shared memory)
        if staged is not t:
            return staged
    c = t.detach().clone() if dev is None or dev == t.device else t.detach().to(dev, copy=True)
    if type(t) is nn.Parameter:
        return nn.Parameter(c, requires_grad=t.requires_grad)
    if t.requires_grad:
        c.requires_grad_(True)
    return c


class _Pickler(pickle.Pickler):
    def __init__(self, f: io.BytesIO, tensors: list, grad_sends: list) -> None:
        super().__init__(f, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors
        self.grad_sends = grad_sends

    def persistent_id(self, obj: Any) -> Any:
        t = type(obj)
        if t is torch.Tensor or t is nn.Parameter:
            return _tensor_pid(obj, self.tensors, self.grad_sends)
        return None


def _tensor_pid(obj: torch.Tensor, tensors: list, grad_sends: list) -> int:
    i = len(tensors)
    sid = None
    if obj.requires_grad:
        if rpc_autograd.current_context_id() is not None:
            sid = rpc_autograd.on_send(obj)
    if sid is not None:  # recorded for distributed autograd: the receiver gets a fresh leaf
        tensors.append(_copy_tensor(obj).detach())
        grad_sends.append((i, sid))
    else:
        tensors.append(_copy_tensor(obj))
    return i


def _dill_pickler(f: io.BytesIO, tensors: list, grad_sends: list) -> Any:
    def pid(obj: Any) -> Any:
        t = type(obj)
        if t is torch.Tensor or t is nn.Parameter:
            return _tensor_pid(obj, tensors, grad_sends)
        return None

    return dill_pickler(f, pid)


class Message:
    """A serialised message: bytes (sealed when the world is authenticated), the out-of-band tensor copies,
    and the sender (for autograd)."""

    __slots__ = ("data", "tensors", "grad_sends", "sender", "dill", "sealed")

    def __init__(self, data: bytes, tensors: list, grad_sends: list, sender: str, dill: bool) -> None:
        self.data, self.tensors, self.grad_sends, self.sender, self.dill = data, tensors, grad_sends, sender, dill
        self.sealed = False

    def seal(self, auth: "rpc_transport.Authenticator | None") -> "Message":
        """Seal the bytes under the sender's authenticator (none: the message stays bare)."""
        if auth is not None:
            self.data = auth.seal(self.data)
            self.sealed = True
        return self

    @property
    def nbytes(self) -> int:
        """What crosses the wire: the pickle plus the tensors' bytes (the authentication envelope left out, so
        virtual times do not depend on whether a world is authenticated)."""
        n = len(self.data) - (rpc_transport.HEADER_LEN if self.sealed else 0)
        for t in self.tensors:
            n += t.numel() * t.element_size()
        return n


def encode(obj: Any, sender: str, device_map: dict | None = None) -> Message:
    """Serialise ``obj`` as ``sender``'s message, its tensors moved through ``device_map`` (local -> remote)."""
    prev_map = getattr(_codec, "device_map", None)
    _codec.device_map = device_map
    try:
        return _encode_mapped(obj, sender)
    finally:
        _codec.device_map = prev_map


def _encode_mapped(obj: Any, sender: str) -> Message:
    tensors: list = []
    grad_sends: list = []
    f = io.BytesIO()
    outer = getattr(_codec, "retained", None)
    _codec.depth = getattr(_codec, "depth", 0) + 1
    _codec.retained = []
    try:
        try:
            _Pickler(f, tensors, grad_sends).dump(obj)
            used_dill = False
        except (pickle.PicklingError, AttributeError, TypeError):
            _rollback()
            tensors.clear()
            grad_sends.clear()
            f = io.BytesIO()
            _dill_pickler(f, tensors, grad_sends).dump(obj)
            used_dill = True
    except BaseException:
        _rollback()
        raise
    finally:
        _codec.depth -= 1
        _codec.retained = outer
    return Message(f.getvalue(), tensors, grad_sends, sender, used_dill)


class _Unpickler(pickle.Unpickler):
    def __init__(self, f: io.BytesIO, tensors: list) -> None:
        super().__init__(f)
        self.tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        return self.tensors[pid]


def retain_for_message(world: Any, owner: str, rid: int) -> None:
    """The message being encoded holds one reference to RRef ``rid`` of ``owner`` (in ``world``) while in
    flight; a message that fails to serialise gives it back."""
    world.retain(owner, rid)
    _codec.retained.append((world, owner, rid))


def _rollback() -> None:
    """A message that failed to serialise gives back the RRef references it took."""
    for world, owner, rid in _codec.retained:
        world.release(owner, rid)
    _codec.retained = []


def decode(msg: Message, auth: "rpc_transport.Authenticator | None" = None) -> Any:
    """The message's object as its receiver (whose authenticator is ``auth``) sees it.

    With ``auth``, the envelope is checked first: a message that is not authentic (or a replay) raises
    :class:`~tensorplay.distributed.rpc.transport.AuthenticationError` before anything is unpickled.
    """
    data: Any = msg.data
    if auth is not None:
        data = auth.open(data, f"simulated worker {msg.sender!r}")
    tensors = msg.tensors
    if any(type(t) is Staged for t in tensors):  # (a message from another rank process)
        tensors = msg.tensors = [t.load() if type(t) is Staged else t for t in tensors]
    if msg.grad_sends:
        for i, sid in msg.grad_sends:
            leaf = tensors[i].requires_grad_(True)
            rpc_autograd.on_recv(leaf, msg.sender, sid)
    f = io.BytesIO(data)
    if msg.dill:
        import dill  # an optional dependency: only a message its sender pickled with dill needs it

        class _DillUnpickler(dill.Unpickler):  # type: ignore[misc]
            def persistent_load(self, pid: Any) -> Any:
                return tensors[pid]

        return _DillUnpickler(f).load()
    return _Unpickler(f, tensors).load()


def in_message() -> bool:
    """Whether the calling thread is serialising a simulated RPC message right now."""
    return getattr(_codec, "depth", 0) > 0
