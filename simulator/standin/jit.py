"""TorchScript modules on stand-ins: moved between devices, saved and loaded as on a GPU.

A TorchScript module keeps its parameters in C++ slots.  ``Module._apply`` swaps a
parameter with its moved value when that value is a wrapper subclass (every
stand-in is one), and torch refuses the swap while the C++ slot holds the
parameter.  A GPU assigns ``param.data`` instead, and the parameter object stays the
one the program (and the eager module it was scripted from) holds; the stand-in lets
the slot go of the parameter, swaps it, and puts it back (:func:`script_apply`).

``torch.jit.save`` writes each tensor's storage from C++, which a stand-in (whose
data is in the CPU tensor inside it) does not have: the module is saved with the
CPU tensors in its slots, the stand-ins' devices recorded in an extra file of the
archive, and the stand-ins put back (:func:`plain_slots`).  ``torch.jit.load``
reads that record and, as a GPU's load does, puts each tensor back on its device,
or on ``map_location`` (:func:`patched_jit_load`).
"""
from __future__ import annotations

import functools
import json
from typing import Any, Callable

import torch

from simulator.standin.tensor import StandInTensor

__all__ = ["script_apply", "plain_slots", "patched_jit_load", "DEVICES_FILE"]

#: the extra file of a TorchScript archive that records the stand-in devices of its tensors
DEVICES_FILE = "tensorplay_standin_devices.json"


def script_apply(original: Callable[..., Any]) -> Callable[..., Any]:
    """``ScriptModule._apply``: what ``Module._apply`` does, where a moved parameter cannot take the old one's place
    by ``.data =`` (a stand-in for a CPU tensor, or the reverse): the parameter object takes the moved value's
    contents, as on a GPU it would keep its identity, with the module's C++ slot let go of it meanwhile (torch
    refuses to swap a tensor something else holds)."""

    @functools.wraps(original)
    def _apply(self: Any, fn: Callable[..., Any], recurse: bool = True) -> Any:
        if recurse:
            for child in self.children():
                child._apply(fn)
        for key, p in list(self._parameters.items()):
            if p is None:
                continue
            with torch.no_grad():
                moved = fn(p)
            if moved is p:
                continue
            grad = p.grad
            if torch._has_compatible_shallow_copy_type(p, moved):  # as Module._apply: .data keeps the identity
                p.data = moved
            else:
                _take_contents(self, key, p, _as(p, moved))
            if grad is not None:
                with torch.no_grad():
                    self._parameters[key].grad = fn(grad)
        for key, b in list(self._buffers.items()):
            if b is not None:
                self._buffers[key] = fn(b)  # (Module._apply replaces buffers too)
        return self

    return _apply


def _take_contents(owner: Any, key: str, p: torch.Tensor, new: torch.Tensor) -> None:
    """Parameter ``p`` of ``owner`` becomes ``new`` in place (``torch.utils.swap_tensors``), or, if something else
    still holds it, is replaced by ``new`` in the slot."""
    p.grad = None  # (a gradient is one more reference to the tensor: moved by the caller)
    _write_slot(owner, "_parameters", key, torch.empty(0))
    try:
        torch.utils.swap_tensors(p, new)
    except RuntimeError:  # held elsewhere (an autograd graph): the slot takes the moved value, as a new object
        _write_slot(owner, "_parameters", key, new)
    else:
        _write_slot(owner, "_parameters", key, p)


def _as(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new`` in the role of ``old``: a parameter if ``old`` was one, requiring grad as ``old`` did."""
    if isinstance(old, torch.nn.Parameter):
        return torch.nn.Parameter(new, old.requires_grad)
    return new.detach().requires_grad_(old.requires_grad)


def _write_slot(owner: Any, kind: str, name: str, value: torch.Tensor) -> None:
    getattr(owner, kind)[name] = value


def _standin_slots(module: Any) -> list[tuple[Any, str, str, StandInTensor, str]]:
    """(module, "_parameters" or "_buffers", name, stand-in, its dotted name from ``module``) of every stand-in in
    the module's slots."""
    found = []
    for prefix, m in module.named_modules():
        for kind in ("_parameters", "_buffers"):
            for name, t in list(getattr(m, kind).items()):
                if type(t) is StandInTensor:
                    found.append((m, kind, name, t, f"{prefix}.{name}" if prefix else name))
    return found


def plain_slots(original: Callable[..., Any]) -> Callable[..., Any]:
    """``RecursiveScriptModule.save``/``save_to_buffer`` (``torch.jit.save`` calls one of them) of a module holding
    stand-ins: saved with their CPU data, their devices recorded in the archive's :data:`DEVICES_FILE`."""

    @functools.wraps(original)
    def save(self: Any, *args: Any, **kwargs: Any) -> Any:
        slots = _standin_slots(self)
        if not slots:
            return original(self, *args, **kwargs)
        extra = dict(kwargs.get("_extra_files") or {})
        extra[DEVICES_FILE] = json.dumps({path: [kind, t._idx] for _, kind, _, t, path in slots}, sort_keys=True)
        kwargs["_extra_files"] = extra
        try:
            for owner, kind, name, t, _ in slots:
                _write_slot(owner, kind, name, _as(t, t._inner) if kind == "_parameters" else t._inner)
            return original(self, *args, **kwargs)
        finally:
            for owner, kind, name, t, _ in slots:  # the stand-ins themselves again: the program's references stay valid
                _write_slot(owner, kind, name, t)

    return save


def patched_jit_load(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.jit.load``: a ``map_location`` on cuda, or the devices a stand-in save recorded, as a GPU's load."""

    @functools.wraps(original)
    def load(f: Any, map_location: Any = None, _extra_files: Any = None, *args: Any, **kwargs: Any) -> Any:
        target = _cuda_target(map_location)
        extra = dict(_extra_files) if _extra_files is not None else {}
        extra.setdefault(DEVICES_FILE, "")
        module = original(f, "cpu" if target is not None else map_location, extra, *args, **kwargs)
        if _extra_files is not None:  # (the caller's dict gets the files it asked for, as torch fills it)
            for k in _extra_files:
                _extra_files[k] = extra[k]
        recorded = json.loads(extra[DEVICES_FILE]) if extra[DEVICES_FILE] else {}
        if target is not None:
            module.to(target)
        elif recorded and map_location is None:
            # the file's tensors were on these devices: back onto them, as a GPU load restores each one's device
            for name, (kind, idx) in recorded.items():
                owner_name, _, attr = name.rpartition(".")
                owner = functools.reduce(getattr, owner_name.split("."), module) if owner_name else module
                t = getattr(owner, kind)[attr]
                with torch.no_grad():
                    moved = t.to(f"cuda:{idx}")
                _write_slot(owner, kind, attr, _as(t, moved) if kind == "_parameters" else moved)
        return module

    return load


def _cuda_target(map_location: Any) -> torch.device | None:
    """The cuda device ``map_location`` names (a string or device), else None."""
    if isinstance(map_location, (str, torch.device)):
        d = torch.device(map_location)
        if d.type == "cuda":
            return d
    return None
