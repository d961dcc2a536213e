"""``torch.save``/``torch.load`` of CUDA tensors on the stand-in: checkpoints are written and read as on GPUs.

``torch.save`` tags each storage with its device through the taggers of torch's
storage-location registry; a stand-in's storage is a CPU storage, which CPU's
tagger would call ``"cpu"``.  While :func:`patched_save` runs, each stand-in the
pickler reaches notes its storage (``StandInTensor.__reduce_ex__``) and :func:`tag_saved`
tags it ``"cuda:i"`` ahead of CPU's tagger, so the file says what a GPU's says:
``torch.load`` with ``map_location={"cuda:0": "cuda:1"}`` moves it, and a process
without GPUs (and without the stand-in) refuses it as it refuses a GPU's file.

``torch.load`` restores each storage through the deserializer registered for
its location tag; CUDA's would copy the storage to a GPU.  While the stand-in
is enabled, :func:`deserialize_cuda` replaces it: the storage stays on the CPU
and is noted with its device (the saved ``cuda:i``, or ``map_location``'s), and
:func:`patched_load` turns the tensors over noted storages into stand-ins on
that device.  Tensors are found in the loaded object's dicts, lists and tuples
(state dicts, optimizer states, checkpoints of those) and in the parameters and
buffers of a whole pickled ``nn.Module``; a tensor inside any other object loads
on the CPU.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable

import torch
import torch.serialization

from simulator.standin import ranks
from simulator.standin.tensor import StandInTensor, saving, wrap

__all__ = ["deserialize_cuda", "patched_load", "patched_save", "registry_entry", "storage_to", "tag_saved"]

_noted = threading.local()  # per loading thread: storage address -> device index


def tag_saved(storage: Any) -> str | None:
    """The location tag of a stand-in's storage being saved (``"cuda:i"``), else None (the next tagger decides)."""
    marks = getattr(saving, "marks", None)
    if not marks:
        return None
    idx = marks.get(getattr(storage, "_cdata", None))
    return None if idx is None else f"cuda:{idx}"


def patched_save(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.save`` that tags the storages of stand-ins as CUDA's (see the module docstring)."""
    def save(*args: Any, **kwargs: Any) -> Any:
        outer = getattr(saving, "marks", None)
        saving.marks = {}
        try:
            return original(*args, **kwargs)
        finally:
            saving.marks = outer

    save.__doc__ = original.__doc__
    return save


def deserialize_cuda(obj: Any, location: str) -> Any:
    """The stand-in's deserializer for ``cuda`` locations: the storage stays on the CPU, noted with its device."""
    if not location.startswith("cuda"):
        return None
    idx = ranks.resolve_index(location, "torch.load")
    marks = getattr(_noted, "marks", None)
    if marks is not None:
        marks[obj._cdata] = idx
    return obj


def storage_to(original: Callable[..., Any]) -> Callable[..., Any]:
    """``UntypedStorage.to(device="cuda:i")`` (and ``.cuda(i)``, which calls it): torch cannot make a storage on a
    stand-in device. Inside ``torch.load`` (``map_location=lambda storage, loc: storage.cuda(i)``) the storage is
    noted with its device, as :func:`deserialize_cuda` notes it, so the tensors over it load as stand-ins on
    ``cuda:i``; elsewhere the copy is a CPU storage, as a stand-in's own storage is."""
    def to(self: Any, *, device: Any, non_blocking: bool = False) -> Any:
        dev = device if isinstance(device, torch.device) else torch.device(device)
        if dev.type not in ("cuda", "privateuseone"):
            return original(self, device=device, non_blocking=non_blocking)
        idx = ranks.resolve_index(dev, "torch.UntypedStorage.to")
        marks = getattr(_noted, "marks", None)
        if marks is None:
            return self.clone()
        marks[self._cdata] = idx
        return self

    to.__doc__ = original.__doc__
    return to


def _convert(obj: Any, marks: dict[int, int], memo: dict[int, Any] | None = None) -> Any:
    """``obj`` with its tensors over noted storages as stand-ins; ``memo``: one stand-in per loaded tensor, so a
    tensor met twice (a tied weight) stays one."""
    memo = {} if memo is None else memo
    done = memo.get(id(obj))
    if done is not None:
        return done
    out: Any = obj
    if isinstance(obj, torch.Tensor) and not isinstance(obj, StandInTensor):
        idx = marks.get(obj.untyped_storage()._cdata) if obj.layout is torch.strided else None
        if idx is None:
            return obj
        ranks.track(obj, idx)
        out = wrap(obj.detach(), idx)
        if isinstance(obj, torch.nn.Parameter):
            out = torch.nn.Parameter(out, requires_grad=obj.requires_grad)
        elif obj.requires_grad:
            out.requires_grad_()
    elif isinstance(obj, torch.nn.Module):  # a whole pickled module: its parameters and buffers, in place
        for m in obj.modules():
            for table in (m._parameters, m._buffers):
                for name, t in table.items():
                    if t is not None:
                        table[name] = _convert(t, marks, memo)
    elif type(obj) in (dict, OrderedDict):
        out = type(obj)((k, _convert(v, marks, memo)) for k, v in obj.items())
    elif type(obj) in (list, tuple):
        out = type(obj)(_convert(v, marks, memo) for v in obj)
    memo[id(obj)] = out
    return out


def patched_load(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.load`` whose CUDA tensors come back as stand-ins (see the module docstring)."""
    def load(*args: Any, **kwargs: Any) -> Any:
        outer = getattr(_noted, "marks", None)
        marks: dict[int, int] = {}
        _noted.marks = marks
        try:
            obj = original(*args, **kwargs)
        finally:
            _noted.marks = outer
        return _convert(obj, marks) if marks else obj

    load.__doc__ = original.__doc__
    return load


def registry_entry(device: str = "cuda") -> tuple[int, Any, int, Any]:
    """``(position, entry, priority, tagger)`` of ``device``'s entry in torch's storage-location registry."""
    for i, entry in enumerate(torch.serialization._package_registry):
        tagger = entry[1]
        if getattr(tagger, "args", None) == (device,) or getattr(tagger, "__name__", None) == f"_{device}_tag":
            return i, entry, entry[0], tagger
    raise LookupError(f"torch.serialization has no entry for {device} locations")


def cpu_tagger(cpu: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    """CPU's tagger, asking :func:`tag_saved` first (a stand-in's storage is a CPU storage)."""
    def tag(storage: Any) -> str | None:
        return tag_saved(storage) or cpu(storage)

    return tag
