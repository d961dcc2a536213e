"""torch.cuda's legacy tensor types on the stand-in: ``torch.cuda.FloatTensor(2, 3)``, ``isinstance`` checks and
``Tensor.type(...)`` with their names.

Scripts from before ``device=`` arguments build tensors with ``torch.cuda.FloatTensor(...)`` (often as
``Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor``), test ``isinstance(t, torch.cuda.LongTensor)``
and convert with ``t.type(torch.cuda.FloatTensor)`` or ``t.type("torch.FloatTensor")``.  torch's own types need a
GPU build; while the stand-in is enabled the names in ``torch.cuda`` are these, and ``Tensor.type`` reads them:

* ``torch.cuda.FloatTensor()`` / ``(2, 3)`` / ``(torch.Size(...))`` / ``(data)`` / ``(tensor)``: an empty, an
  uninitialised, a filled or a converted tensor of that dtype on the current device (``device=`` another);
* ``isinstance(t, torch.cuda.FloatTensor)``: ``t`` is on a (stand-in) CUDA device with that dtype;
* ``t.type(torch.cuda.FloatTensor)`` or ``t.type("torch.cuda.FloatTensor")`` moves ``t`` to a CUDA device (its own,
  or the current one for a CPU tensor) and that dtype; ``t.type("torch.FloatTensor")`` or
  ``t.type(torch.FloatTensor)`` moves a stand-in to the CPU, as on a GPU.

Example::

    with standin.enabled(gpus_per_node=2):
        t = torch.cuda.FloatTensor(2, 3).fill_(1.0)
        assert isinstance(t, torch.cuda.FloatTensor) and t.type() == "torch.cuda.FloatTensor"
        assert t.type(torch.cuda.LongTensor).dtype == torch.int64 and t.type("torch.FloatTensor").device.type == "cpu"
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from simulator.standin.ranks import resolve_index

__all__ = ["NAMES", "LegacyCudaType", "legacy_types", "conversion", "convert", "patched_type",
           "patched_set_default_tensor_type"]

#: the legacy type names and their dtypes (torch.cuda.<name> and torch.<name>)
NAMES = {"FloatTensor": torch.float32, "DoubleTensor": torch.float64, "HalfTensor": torch.float16,
         "BFloat16Tensor": torch.bfloat16, "LongTensor": torch.int64, "IntTensor": torch.int32,
         "ShortTensor": torch.int16, "CharTensor": torch.int8, "ByteTensor": torch.uint8, "BoolTensor": torch.bool}


class LegacyCudaType(type):
    """The class of ``torch.cuda.FloatTensor`` & co. on the stand-in (each carries its ``dtype``)."""

    dtype: torch.dtype

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, torch.Tensor) and obj.device.type == "cuda" and obj.dtype == cls.dtype

    def __call__(cls, *args: Any, device: Any = None) -> torch.Tensor:  # type: ignore[override]
        dev = torch.device("cuda", resolve_index(device, f"torch.cuda.{cls.__name__}"))
        if not args:
            return torch.empty(0, dtype=cls.dtype, device=dev)
        if len(args) == 1 and isinstance(args[0], torch.Size):
            args = tuple(args[0])
        if all(isinstance(a, int) and not isinstance(a, bool) for a in args):
            return torch.empty(args, dtype=cls.dtype, device=dev)
        if len(args) == 1 and isinstance(args[0], torch.Tensor):
            return args[0].to(device=dev, dtype=cls.dtype)
        if len(args) == 1:
            return torch.tensor(args[0], dtype=cls.dtype, device=dev)
        raise TypeError(f"torch.cuda.{cls.__name__}(): expected sizes (ints), a torch.Size, data or a tensor, got "
                        f"args={args!r}")


def legacy_types() -> dict[str, LegacyCudaType]:
    """``torch.cuda``'s legacy type names on the stand-in."""
    return {name: LegacyCudaType(name, (), {"dtype": dt, "__module__": "torch.cuda", "__qualname__": name})
            for name, dt in NAMES.items()}


def conversion(spec: Any) -> tuple[str, torch.dtype] | None:
    """What ``Tensor.type(spec)`` asks for, ``(device type, dtype)``, when ``spec`` names a legacy type; else None."""
    if isinstance(spec, LegacyCudaType):
        return "cuda", spec.dtype
    if isinstance(spec, type):  # torch.FloatTensor & co.: named by their module and name
        spec = f"{spec.__module__}.{spec.__name__}"
    if not isinstance(spec, str):
        return None
    for prefix, device in (("torch.cuda.", "cuda"), ("torch.", "cpu")):
        if spec.startswith(prefix) and spec[len(prefix):] in NAMES:
            return device, NAMES[spec[len(prefix):]]
    return None


def convert(t: torch.Tensor, spec: Any, non_blocking: bool) -> torch.Tensor | None:
    """``t.type(spec)`` for a legacy type name or class: to its device type and dtype (a CUDA tensor keeps its own
    device, a CPU one goes to the current device); None when ``spec`` is no such name."""
    target = conversion(spec)
    if target is None:
        return None
    device, dtype = target
    if device == "cpu":
        return t.to(device="cpu", dtype=dtype, non_blocking=non_blocking)
    where = t.device if t.device.type == "cuda" else torch.device("cuda", resolve_index(None, "torch.Tensor.type"))
    return t.to(device=where, dtype=dtype, non_blocking=non_blocking)


def patched_type(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.Tensor.type`` that also takes the stand-in's legacy CUDA types (see the module docstring)."""
    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is not None:
            out = convert(self, dtype, non_blocking)
            if out is not None:
                return out
        return original(self, dtype, non_blocking, **kwargs)

    type_.__doc__ = original.__doc__
    return type_


def patched_set_default_tensor_type(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.set_default_tensor_type(torch.cuda.FloatTensor)`` (older scripts): new tensors default to that dtype
    on the current GPU, as on a GPU build, where torch's own refuses the stand-in's type. A CPU type afterwards
    returns new tensors to the CPU."""
    ours = [False]  # whether the default device is the one this set

    def set_default_tensor_type(t: Any) -> None:
        target = conversion(t)
        if target is None or target[0] != "cuda":
            if ours[0]:
                torch.set_default_device(None)
                ours[0] = False
            return original(t)
        dtype = target[1]
        if not dtype.is_floating_point:
            raise TypeError("invalid type object: only floating-point types are supported as the default type")
        warnings.warn("torch.set_default_tensor_type() is deprecated as of PyTorch 2.1, please use "
                      "torch.set_default_dtype() and torch.set_default_device() as alternatives.", UserWarning,
                      stacklevel=2)
        torch.set_default_dtype(dtype)
        torch.set_default_device("cuda")
        ours[0] = True

    set_default_tensor_type.__doc__ = original.__doc__
    return set_default_tensor_type
