"""Operators with rules of their own on stand-ins: copies and device moves (across devices, as on CUDA),
stream bookkeeping, the fallback that computes CUDA factories on the CPU, and :func:`device_of` for
process groups that check devices."""
from __future__ import annotations

import math
from typing import Any

import torch

from simulator.standin import ranks, rng
from simulator.standin.tensor import (_SPECIAL, CPU, CUDA_DEVICES, StandInTensor, _collective_device, fresh, passes_generator, rewrap,
                     spec, target)

__all__ = ["copy_from", "factory", "device_of", "COMPOSITE_FACTORIES", "cuda_kernel_factories"]

#: aten's factories (no tensor argument, a ``device=``) whose kernel is composite: registered for every device,
#: they would build a stand-in through several operators, and some (``arange``, ``eye``, ``range``) allocate an
#: empty tensor and resize it through an ``out=`` overload (a wrapper follows, but at several dispatches' cost).
#: The stand-in registers :func:`factory` for them on the ``CUDA`` and ``PrivateUse1`` keys: one CPU call, then
#: wrapped.
#: (tests/test_sim_standin_programs.py checks that this list holds every such aten factory.)
COMPOSITE_FACTORIES = (
    "arange", "arange.start", "arange.start_step", "range", "range.step", "eye", "eye.m", "linspace", "logspace",
    "full", "ones", "zeros", "scalar_tensor", "empty_permuted", "normal.float_float",
    "rand", "rand.generator", "randn", "randn.generator", "randint", "randint.generator", "randint.low",
    "randint.low_generator", "randperm", "randperm.generator", "fft_fftfreq", "fft_rfftfreq",
    "bartlett_window", "bartlett_window.periodic", "blackman_window", "blackman_window.periodic",
    "hamming_window", "hamming_window.periodic", "hamming_window.periodic_alpha",
    "hamming_window.periodic_alpha_beta", "hann_window", "hann_window.periodic", "kaiser_window",
    "kaiser_window.beta", "kaiser_window.periodic",
)


def cuda_kernel_factories(cuda_build: bool) -> list[Any]:
    """aten's factories (no tensor argument) with a kernel of their own for the ``CUDA`` key: none on a CPU build;
    on a CUDA build (``empty.memory_format``, ``empty_strided``, ...) they would run CUDA's kernel, which on a
    machine without a GPU fails, so the stand-in registers :func:`factory` over them there."""
    if not cuda_build:
        return []
    found = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::") or not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"):
            continue
        base, _, overload = name[6:].partition(".")
        op = getattr(getattr(torch.ops.aten, base, None), overload or "default", None)
        if op is not None and not any("Tensor" in str(a.type) for a in op._schema.arguments):
            found.append(op)
    return found


def _inner_of(t: Any) -> Any:
    return t._inner if type(t) is StandInTensor else t


def _copy(func: Any, args: tuple, kwargs: dict) -> Any:
    """``dst.copy_(src)``: any two devices, as on CUDA."""
    dst, src = args[0], args[1]
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    _inner_of(dst).copy_(_inner_of(src), non_blocking=non_blocking)
    return dst


def copy_from(func: Any, args: tuple, kwargs: dict) -> Any:
    """``_copy_from(src, dst)`` / ``_copy_from_and_resize(src, dst)``: what ``copy_`` calls for non-CPU tensors."""
    src, dst = args[0], args[1]
    _inner_of(dst).copy_(_inner_of(src))
    return dst


def _to_copy(func: Any, args: tuple, kwargs: dict) -> Any:
    """``_to_copy``: to the CPU gives a plain tensor, to a CUDA device a stand-in (a copy, as on a GPU)."""
    src = args[0]
    kw = dict(kwargs)
    dev = kw.get("device")
    idx = target(dev) if dev is not None else (src._idx if type(src) is StandInTensor else None)
    kw["device"] = CPU
    kw.pop("pin_memory", None)
    out = func(_inner_of(src), *args[1:], **kw)
    return out if idx is None else fresh(out, idx)


def _record_stream(func: Any, args: tuple, kwargs: dict) -> None:
    return None  # stand-in memory is never reused early: no stream to record


def _is_pinned(func: Any, args: tuple, kwargs: dict) -> bool:
    return False


def _wrap_async(func: Any, args: tuple, kwargs: dict) -> Any:
    # funcol's _wrap_tensor_autograd puts a collective's result in an AsyncCollectiveTensor, whose first use (or
    # DTensor's redistribute(async_op=False)) waits for it: the stand-in goes inside that wrapper, as a GPU tensor
    # does, not the other way round (a stand-in over an AsyncCollectiveTensor is never waited by DTensor, and
    # torch warns at exit of every collective left unwaited in its registry)
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return AsyncCollectiveTensor(args[0] if args else kwargs["input"])


def _wait_tensor(func: Any, args: tuple, kwargs: dict) -> Any:
    # waits for the collective that writes the CPU data, and returns the very tensor it was given (as on a GPU)
    t = args[0] if args else kwargs["tensor"]
    if type(t) is not StandInTensor:
        return NotImplemented  # (another subclass with its own dispatch unwraps first)
    func(t._inner)
    return t


def _packed_sequence(func: Any, args: tuple, kwargs: dict) -> Any:
    """Packing and unpacking a padded sequence: CUDA's kernels take the lengths (batch sizes) on the CPU and give
    the packed data (padded output, gradient) on the device and the batch sizes (lengths) on the CPU."""
    idx = next(a._idx for a in args if type(a) is StandInTensor)
    out = func(*[_inner_of(a) for a in args], **kwargs)
    return (fresh(out[0], idx), *out[1:]) if isinstance(out, tuple) else fresh(out, idx)


_SPECIAL.update({
    "_pack_padded_sequence": _packed_sequence, "_pad_packed_sequence": _packed_sequence,
    "_pack_padded_sequence_backward": _packed_sequence,
    "copy_": _copy, "_copy_from": copy_from, "_copy_from_and_resize": copy_from, "_to_copy": _to_copy,
    "record_stream": _record_stream, "is_pinned": _is_pinned, "_wrap_tensor_autograd": _wrap_async,
    "wait_tensor": _wait_tensor,
})


def factory(func: Any, *args: Any, **kwargs: Any) -> Any:
    """The fallback for the ``CUDA`` and ``PrivateUse1`` keys: an operator without stand-in inputs on a CUDA
    device (a factory); computed on the CPU and wrapped on the named device."""
    dev = kwargs.get("device")
    idx = target(dev) if dev is not None else ranks.state().current
    if idx is None:  # not a CUDA device after all (cannot happen through these keys): run as given
        return func(*args, **kwargs)
    ranks.initialize(ranks.state())
    if args and isinstance(args[0], (list, tuple)) and args[0] and all(type(n) is int for n in args[0]):
        # a size: the memory is known before it is taken (torch.empty(...) of more than the GPU holds)
        ranks.check_room(idx, math.prod(args[0]) * (kwargs.get("dtype") or torch.get_default_dtype()).itemsize)
    kwargs["device"] = CPU
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    sp = spec(func)
    if sp.random and not passes_generator(sp, args, kwargs):  # torch.randn(..., device="cuda"): the device draws
        out = rng.draw(idx, lambda: func(*args, **kwargs))
    else:
        out = func(*args, **kwargs)
        if sp.uninitialized:
            out.zero_()
    return rewrap(out, idx, (), sp, 0)


def device_of(t: torch.Tensor) -> torch.device:
    """The device a process group should consider ``t`` to be on.

    A stand-in's ``cuda:i``; a CPU tensor that a c10d operator (a functional
    collective) on stand-ins hands the process group, the stand-in's ``cuda:i``;
    any other tensor, its own device.  For backends that check devices (NCCL:
    CUDA tensors only).
    """
    if type(t) is StandInTensor:
        return CUDA_DEVICES[t._idx]
    idx = getattr(_collective_device, "idx", None)
    if idx is not None and t.device.type == "cpu":
        return CUDA_DEVICES[idx]
    return t.device
