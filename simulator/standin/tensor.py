"""The stand-in tensor: a ``cuda:i`` tensor whose data is a plain CPU tensor.

:class:`StandInTensor` is a wrapper subclass (``torch.Tensor._make_wrapper_subclass``):
torch's dispatcher runs autograd, views and version counting on the wrapper as
on any tensor, then hands every operator to :func:`dispatch`, which runs it on
the CPU tensors inside and wraps the results on the inputs' device.  To Python
the device is ``cuda:i``; to torch's C++ side it is ``privateuseone:i`` (see
``_native``), the one device type whose autograd works without CUDA.

* **Device rules as on a GPU.**  An operator mixing ``cuda:i`` with a CPU tensor
  of one or more dimensions, or with ``cuda:j``, raises torch's own
  ``Expected all tensors to be on the same device`` error; 0-dim CPU tensors,
  copies and indexing with CPU indices are allowed, as on CUDA.  The
  simulator's own collective code (``simulator.*``, ``tensorplay.distributed``)
  may combine several ranks' devices, as NCCL does.
* **Aliasing.**  Views of a stand-in are stand-ins over views of its CPU data;
  an in-place operator returns the very wrapper it was given.
* **Factories.**  Operators with no tensor input and a CUDA device
  (``torch.randn(..., device="cuda")``, ``torch.empty(n, device=r)``, the
  buckets DDP's C++ reducer allocates) reach a Python fallback registered for
  the ``CUDA`` and ``PrivateUse1`` dispatch keys, which computes them on the CPU.
"""
from __future__ import annotations

import copy
import sys
import threading
from typing import Any, Callable

import torch

from tensorplay.distributed.errors import format_message

from simulator.standin import ranks, rng
from simulator.standin.cuda_only import CPU_KERNELS
from simulator.standin.errors import StandInError
from simulator.standin.legacy import NAMES, convert

__all__ = ["StandInTensor", "wrap", "fresh", "is_standin", "dispatch", "rewrap", "spec", "target",
           "PU_DEVICES", "CUDA_DEVICES", "CPU", "cuda_device"]

_MAX_DEVICES = 64
PU_DEVICES = [torch.device("privateuseone", i) for i in range(_MAX_DEVICES)]
CUDA_DEVICES = [torch.device("cuda", i) for i in range(_MAX_DEVICES)]
CPU = torch.device("cpu")
_SAME_DEVICE = "Expected all tensors to be on the same device, but found at least two devices, {} and {}!"
_make = torch.Tensor._make_wrapper_subclass
_inference_on = torch.is_inference_mode_enabled
_NO_KWARGS: dict = {}

#: operators that may combine a stand-in with a CPU tensor or another device, as they may on CUDA
_CROSS_DEVICE = {"copy_", "_copy_from", "_copy_from_and_resize", "_to_copy", "index", "index_put", "index_put_",
                 "_index_put_impl_", "_unsafe_index", "_unsafe_index_put", "lift_fresh", "set_",
                 # CUDA's CTC loss takes the sequence lengths (and cuDNN's, the targets) as CPU tensors
                 "ctc_loss", "_ctc_loss", "_ctc_loss_backward",
                 # and its recurrent layers over a packed sequence take its batch sizes as a CPU tensor
                 "aten::lstm.data", "aten::gru.data", "aten::rnn_tanh.data", "aten::rnn_relu.data"}
#: in-place operators that may change the tensor's shape (the wrapper follows: see _follow)
_RESHAPING = {"resize_", "resize_as_", "set_", "as_strided_", "t_", "transpose_", "squeeze_", "unsqueeze_",
              "swapdims_", "swapaxes_", "_resize_output_", "sparse_resize_"}
#: allocators whose memory is uninitialised (see _Spec.uninitialized)
_UNINITIALIZED = {"empty", "empty_strided", "empty_permuted", "empty_like", "new_empty", "new_empty_strided"}
#: namespaces of c10d's operators (and DTensor's, which call them): they hand the process group the CPU tensors
#: inside the stand-ins
_COLLECTIVE_NAMESPACES = {"_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor"}
#: namespaces whose operators are torch's own and always have a CPU implementation or decomposition
_TORCH_NAMESPACES = {"aten", "prims", "_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor",
                     "profiler", "debugprims", "rngprims", "quantized_decomposed"}


#: held while torch prints a stand-in under the name "tensor" (see StandInTensor.__repr__)
_PRINTING = threading.RLock()


def cuda_device(idx: int) -> torch.device:
    """The Python-visible device ``cuda:idx``."""
    return CUDA_DEVICES[idx]


class StandInTensor(torch.Tensor):
    """A ``cuda:i`` tensor computed on the CPU (see the module docstring).

    ``_inner`` is the CPU tensor holding the data; ``_idx`` the CUDA index.
    """

    _inner: torch.Tensor
    _idx: int
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return dispatch(func, args, kwargs or _NO_KWARGS)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        """``cuda:i``."""
        return CUDA_DEVICES[self._idx]

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        """True."""
        return True

    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        """A detached stand-in sharing this one's data (setting it rebinds this tensor to another stand-in)."""
        # a wrapper's C++ ``variable_data()`` would lose ``_inner``: build the detached alias here
        with torch.no_grad():
            return wrap(self._inner, self._idx)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        if not isinstance(new, StandInTensor):
            raise StandInError(format_message(
                "simulator.standin", "a stand-in's .data can only be set to another stand-in tensor",
                values={"new": f"{type(new).__name__} on {new.device}"},
                fix="move the new value to the device first (new.to(param.device)) or use param.copy_(new)"))
        torch._C.TensorBase.data.__set__(self, new)  # sizes, strides, dtype, device of the new value
        self._inner, self._idx = new._inner, new._idx

    def __tensor_flatten__(self) -> tuple[list[str], int]:
        # torch's wrapper-subclass protocol: with it, Module.to/cuda swap each parameter in place
        # (torch.utils.swap_tensors), so tied weights stay tied and optimizers keep their parameters
        return ["_inner"], self._idx

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], idx: int, outer_size: Any,
                             outer_stride: Any) -> "StandInTensor":
        return wrap(inner["_inner"], idx)

    @property
    def __cuda_array_interface__(self) -> Any:
        raise StandInError(format_message(
            "simulator.standin", "a stand-in tensor has no GPU memory to export (__cuda_array_interface__)",
            values={"device": str(self.device)},
            fix="hand the library a CPU tensor (t.cpu()) or run on a GPU"))

    def type(self, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:  # type: ignore[override]
        """``torch.cuda.FloatTensor``-style names, as a CUDA tensor reports them."""
        if dtype is None:
            return _TYPE_NAMES.get(self.dtype, "torch.cuda.Tensor")
        out = convert(self, dtype, non_blocking)  # a legacy name or class: its device type and dtype
        if out is not None:
            return out
        return self.to(dtype=dtype, non_blocking=non_blocking) if isinstance(dtype, torch.dtype) \
            else torch.Tensor.type(self, dtype, non_blocking, **kwargs)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        # torch's printer names the class and indents and wraps by that name; a CUDA tensor prints as
        # tensor(..., device='cuda:i'): the class is named "tensor" while torch prints it
        with _PRINTING:
            StandInTensor.__name__ = "tensor"
            try:
                text = torch._tensor_str._str(self, tensor_contents=tensor_contents)
            finally:
                StandInTensor.__name__ = "StandInTensor"
        if text.startswith("Parameter(") and text.endswith(")"):  # (torch's mark of a parameter of a subclass)
            text = text[len("Parameter("):-1]
        return "Parameter containing:\n" + text if getattr(self, "_is_param", False) else text

    def __format__(self, spec: str) -> str:
        # torch formats only exact torch.Tensor scalars by value; its printer formats elements this way
        return self.item().__format__(spec) if self.dim() == 0 else object.__format__(self, spec)

    def numpy(self, *, force: bool = False) -> Any:
        """Refused with torch's error for CUDA tensors: copy to the CPU first."""
        raise TypeError(f"can't convert {self.device} device type tensor to numpy. Use Tensor.cpu() to copy the "
                        "tensor to host memory first.")

    def __array__(self, dtype: Any = None) -> Any:
        return self.numpy()

    def tolist(self) -> Any:
        """The values as (nested) Python numbers."""
        return self._inner.tolist()

    def data_ptr(self) -> int:
        """The address of the CPU data (unique per storage, as a GPU pointer is)."""
        return self._inner.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        """The CPU storage holding the data."""
        return self._inner.untyped_storage()

    def __deepcopy__(self, memo: dict) -> "StandInTensor":
        # torch's version rebuilds from the wrapper's storage, which holds no data: copy the CPU data instead
        if not self.is_leaf:
            raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                               "protocol at the moment.  If you were attempting to deepcopy a module, this may be "
                               "because of a torch.nn.utils.weight_norm usage, see "
                               "https://github.com/pytorch/pytorch/pull/103001")
        if id(self) in memo:
            return memo[id(self)]
        new = fresh(self._inner.clone(memory_format=torch.preserve_format), self._idx)
        memo[id(self)] = new
        if self.requires_grad:
            new.requires_grad_()
        if self.grad is not None:
            new.grad = copy.deepcopy(self.grad, memo)
        for k, v in self.__dict__.items():
            if k not in ("_inner", "_idx"):
                setattr(new, k, copy.deepcopy(v, memo))
        return new

    def __reduce_ex__(self, proto: Any) -> Any:
        # pickled as the CPU tensor it holds; under torch.save its storage is tagged with this stand-in's device
        # (see simulator.standin.serialization), so torch.load reads it back as a GPU's
        marks = getattr(saving, "marks", None)
        if marks is not None:
            marks[self._inner.untyped_storage()._cdata] = self._idx
            if getattr(self, "_is_param", False) or self.requires_grad:
                # as a GPU's: a parameter (a whole pickled module's) is saved as one, requires_grad kept; the alias
                # shares the inner tensor's storage, which is what the file records
                alias = self._inner.detach()
                if getattr(self, "_is_param", False):
                    return torch.nn.Parameter(alias, requires_grad=self.requires_grad).__reduce_ex__(proto)
                return alias.requires_grad_().__reduce_ex__(proto)
        return self._inner.__reduce_ex__(proto)


#: set by torch.save while the stand-in is enabled (simulator.standin.serialization.patched_save): storage address ->
#: device index of each stand-in pickled, whose storage is then tagged "cuda:i"; a pickle elsewhere (one sent
#: between processes) carries the CPU tensor a stand-in holds
saving = threading.local()

#: what ``Tensor.type()`` names a CUDA tensor of each dtype (torch.cuda's legacy type names)
_TYPE_NAMES = {dt: f"torch.cuda.{name}" for name, dt in NAMES.items()}


def is_standin(t: Any) -> bool:
    """Whether ``t`` is a stand-in (a CPU-backed ``cuda`` tensor)."""
    return isinstance(t, StandInTensor)


def wrap(inner: torch.Tensor, idx: int) -> StandInTensor:
    """A stand-in on ``cuda:idx`` over the CPU tensor ``inner`` (which must not require grad)."""
    if _inference_on() and not inner.is_inference():
        # a view of a normal tensor is a normal tensor in inference mode too (torch then gives it its base's
        # version counter, which an inference tensor cannot have): so is its wrapper
        with torch._C._InferenceMode(False):
            return wrap(inner, idx)
    if inner.layout is not torch.strided:
        raise StandInError(format_message(
            "simulator.standin", "only dense (strided) tensors can live on a stand-in CUDA device: sparse tensors "
            "on a GPU are not simulated (docs/deviations.md)", values={"layout": str(inner.layout)},
            fix="keep the sparse tensor and its products on the CPU (device='cpu'), or use a dense tensor "
                "(.to_dense(); nn.Embedding(sparse=False))"))
    size = inner.size()
    if inner.is_contiguous() and inner.storage_offset() == 0 and 1 not in size:
        # the wrapper's default strides are exactly these (passing them costs a third of the wrapping)
        r = _make(StandInTensor, size, dtype=inner.dtype, device=PU_DEVICES[idx])
    else:
        r = _make(StandInTensor, size, strides=inner.stride(), storage_offset=inner.storage_offset(),
                  dtype=inner.dtype, device=PU_DEVICES[idx])
    r._inner = inner
    r._idx = idx
    if inner.dtype.is_complex:  # a lazy conjugate or negative view: the wrapper is one too (see _math_bits)
        _math_bits(inner, r)
    return r


def _math_bits(inner: torch.Tensor, r: StandInTensor) -> None:
    """The conjugate and negative bits of ``inner``, on its wrapper: torch resolves them where it dispatches the
    wrapper (ops below the stand-in's ``__torch_dispatch__`` run with those fallbacks passed, and would read the
    inner view's stored values, unconjugated)."""
    if inner.is_conj():
        torch._C._set_conj(r, True)
    if inner.is_neg():
        torch._C._set_neg(r, True)


def fresh(inner: torch.Tensor, idx: int) -> StandInTensor:
    """:func:`wrap` for an operator's newly allocated result: counted in the rank's memory."""
    r = wrap(inner, idx)  # (first: it refuses what cannot be a stand-in, a sparse tensor)
    ranks.track(inner, idx)
    return r


# -- per-operator facts, computed once -------------------------------------------------------------------
class _Spec:
    __slots__ = ("special", "cross", "reshaping", "fresh", "name", "mutates", "call", "collective", "random",
                 "generator_at", "uninitialized", "device_at", "check")

    def __init__(self, func: Any) -> None:
        schema = func._schema
        base = schema.name.split("::")[-1]
        self.name = f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
        self.special: Callable[..., Any] | None = _SPECIAL.get(base)
        self.cross = base in _CROSS_DEVICE or self.name in _CROSS_DEVICE
        # a rule of CUDA's own for this operator's arguments, checked before it runs (see _CHECKS)
        self.check: Callable[[tuple, dict, list], None] | None = _CHECKS.get(self.name)
        if "nested" in base:  # (the operators that make nested tensors, and those that take them)
            self.check = _no_nested
        # an out= overload (``out``, ``start_out``, ``Scalar_out``...) may resize its output
        self.reshaping = base in _RESHAPING or any(a.is_out for a in schema.arguments)
        # results without alias annotation are new allocations; views and in-place results are not
        self.fresh = [r.alias_info is None for r in schema.returns] or [True]
        # only an operator that writes an argument can return one of its inputs
        self.mutates = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        self.call = func._op  # the operator itself, without OpOverload.__call__'s Python frame
        if self.name in CPU_KERNELS:  # a CUDA-only operator torch reaches for a CUDA tensor: computed on the CPU
            self.call = CPU_KERNELS[self.name]
        if self.name in _GEMMS:
            self.call = _fp32_accumulating(self.call)
        ns = schema.name.split("::")[0]
        self.collective = ns in _COLLECTIVE_NAMESPACES
        # a random operator draws from its device's generator unless the caller passed one (see rng)
        self.random = torch.Tag.nondeterministic_seeded in func.tags
        self.generator_at = next((i for i, a in enumerate(schema.arguments) if a.name == "generator"), None)
        # a device passed positionally (``aten.to.device``, reached below autograd inside a subclass's handler)
        self.device_at = next((i for i, a in enumerate(schema.arguments)
                               if not a.kwarg_only and str(a.type) in ("Device", "Device?")), None)
        # memory a GPU hands out uninitialised: zero on a stand-in, so a program that reads it reproduces
        self.uninitialized = base in _UNINITIALIZED
        # the CPU entry of the computed table includes composite kernels and fallbacks
        if ns not in _TORCH_NAMESPACES and self.special is None and \
                not torch._C._dispatch_has_computed_kernel_for_dispatch_key(func.name(), "CPU"):
            self.special = _no_cpu_kernel


#: matrix products (the functional overloads): a GPU multiplies half-precision inputs accumulating in fp32 and
#: rounds the result once (cuBLAS's default for fp16); the CPU's own fp16 kernels round differently and run
#: ~20x slower than its fp32 ones (pytorch/examples' minGPT trains under autocast(float16))
_GEMMS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::mv",
                    "aten::addmv", "aten::dot", "aten::vdot"})


def _fp32_accumulating(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` for float16 operands: computed in fp32 from the fp16 values, then rounded to fp16 once."""
    def product(*args: Any, **kwargs: Any) -> Any:
        # (every one of these operators takes a tensor first; mixed dtypes get the CPU's own error)
        if args and getattr(args[0], "dtype", None) is torch.float16 and \
                all(a.dtype is torch.float16 for a in args if type(a) is torch.Tensor):
            return call(*[a.float() if type(a) is torch.Tensor else a for a in args], **kwargs).half()
        return call(*args, **kwargs)

    return product


_SPECS: dict[Any, _Spec] = {}
#: operators with rules of their own (copies, device moves...), by base name: filled by ``ops``
_SPECIAL: dict[str, Callable[..., Any]] = {}


def spec(func: Any) -> _Spec:
    s = _SPECS.get(func)
    if s is None:
        s = _SPECS[func] = _Spec(func)
    return s


def _no_cpu_kernel(func: Any, args: tuple, kwargs: dict) -> Any:
    raise StandInError(format_message(
        "simulator.standin", "this operator has a GPU kernel only (a custom CUDA extension or Triton kernel), "
        "which the CPU stand-in cannot run", values={"operator": func.name()},
        fix=f"register a CPU implementation (torch.library.impl('{func._schema.name}', 'CPU', fn)) so the "
            "simulator can compute it, or run this program on real GPUs"))


# -- unwrapping -----------------------------------------------------------------------------------------
# ``seen`` is a 4-slot list: [first device label, (label, label) of the first conflict, stand-in index,
# owners: [(inner, wrapper)] or None when the operator cannot return an input]
_SCALARS = (int, float, bool, type(None), str, torch.dtype, torch.memory_format, torch.layout)


def _label(x: Any) -> str:
    return f"cuda:{x}" if isinstance(x, int) else str(x)


def _note(seen: list, label: Any) -> None:
    first = seen[0]
    if first is None:
        seen[0] = label
    elif label != first and seen[1] is None:
        seen[1] = (_label(first), _label(label))


def _unwrap(a: Any, seen: list) -> Any:
    t = type(a)
    if t is StandInTensor:
        idx = a._idx
        if seen[0] is None:
            seen[0] = seen[2] = idx
        else:
            if seen[2] is None:
                seen[2] = idx
            if idx != seen[0] and seen[1] is None:
                seen[1] = (_label(seen[0]), _label(idx))
        inner = a._inner
        if seen[3] is not None:
            seen[3].append((inner, a))
        return inner
    if t in _SCALARS:
        return a
    if t is list or t is tuple:
        return t([_unwrap(x, seen) for x in a])
    if isinstance(a, torch.Tensor):
        if t is not torch.Tensor and _has_own_dispatch(t):
            raise _Foreign  # (see dispatch)
        if a.dim() != 0 or a.device.type != "cpu":
            # CUDA accepts 0-dim CPU tensors as scalars; any other tensor is a device
            d = a.device
            _note(seen, d.index if d.type == "cuda" and d.index is not None else d)
    return a


class _Foreign(Exception):
    """An argument is another tensor subclass with a ``__torch_dispatch__`` of its own (an AsyncCollectiveTensor
    over a stand-in, a DTensor): by torch's protocol the stand-in returns NotImplemented and lets that subclass
    unwrap itself first; the operator then comes back with stand-ins."""


_OWN_DISPATCH: dict[type, bool] = {}


def _has_own_dispatch(t: type) -> bool:
    own = _OWN_DISPATCH.get(t)
    if own is None:
        own = _OWN_DISPATCH[t] = t.__torch_dispatch__ is not torch._C._disabled_torch_dispatch_impl
    return own


def _from_collective_code() -> bool:
    """Whether the innermost caller outside torch is the simulator's or tensorplay's collective code.

    Only asked when an operator mixes devices, which user code may not do but a
    collective that combines several ranks' tensors must.
    """
    f = sys._getframe(2)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if not (name.startswith("torch.") or name.startswith("simulator.standin")):
            return name.startswith("simulator.") or name.startswith("tensorplay.distributed")
        f = f.f_back
    return False


def target(device: Any) -> int | None:
    """The stand-in index a ``device=`` argument names; None for the CPU (or any other non-CUDA device)."""
    if device is None:
        return None
    if isinstance(device, str):
        device = torch.device(device)
    if device.type in ("cuda", "privateuseone"):
        return ranks.resolve_index(device)
    return None


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` on the CPU tensors inside the stand-ins among its arguments; wrap the results."""
    sp = _SPECS.get(func) or spec(func)
    if sp.special is not None:
        return sp.special(func, args, kwargs)
    seen = [None, None, None, [] if sp.mutates else None]
    try:
        uargs = [_unwrap(a, seen) for a in args]
        ukw = {k: _unwrap(v, seen) for k, v in kwargs.items()} if kwargs else kwargs
    except _Foreign:
        return NotImplemented
    if kwargs:
        dev = ukw.get("device")
        if dev is not None:  # a factory-like operator (new_empty, zeros_like...): the device named wins
            seen[2] = target(dev)
            ukw["device"] = CPU if seen[2] is not None else dev
    at = sp.device_at
    if at is not None and len(uargs) > at and uargs[at] is not None:  # (the same, named by position)
        dev = uargs[at]
        seen[2] = target(dev)
        uargs[at] = CPU if seen[2] is not None else dev
    if seen[1] is not None and not sp.cross and not _from_collective_code():
        raise RuntimeError(_SAME_DEVICE.format(*seen[1]))
    if sp.check is not None:
        sp.check(args, kwargs, seen)
    idx = seen[2]
    if sp.collective:
        out = _collective(sp, idx, uargs, ukw)
    elif sp.random and idx is not None and not passes_generator(sp, uargs, ukw):
        out = rng.draw(idx, lambda: sp.call(*uargs, **ukw))
    else:
        out = sp.call(*uargs, **ukw)
        if sp.uninitialized and idx is not None:
            out.zero_()
    if idx is None:
        return out
    if type(out) is torch.Tensor and seen[3] is None:  # the common case: one new tensor or view
        return fresh(out, idx) if sp.fresh[0] else wrap(out, idx)
    return rewrap(out, idx, seen[3] or (), sp, 0)


def _indices_on_cpu_or_self(args: tuple, kwargs: dict, seen: list) -> None:
    """CUDA's rule for ``t[indices]``: each index tensor on the CPU or on ``t``'s own device (a table kept on the
    CPU indexed by GPU indices, diffusers' ``alphas_cumprod[timesteps]``, fails on a GPU; ``index_put_`` moves
    its indices to the tensor's device, and is not checked)."""
    if seen[1] is None:  # (one device among the arguments)
        return
    own = args[0].device
    for i in args[1] if len(args) > 1 else ():
        if isinstance(i, torch.Tensor) and i.device.type != "cpu" and i.device != own:
            raise RuntimeError(f"indices should be either on cpu or on the same device as the indexed tensor "
                               f"({own})")


def _dense_embedding(at: int, call: str, module: str) -> Callable[[tuple, dict, list], None]:
    """A sparse embedding's gradient is a sparse tensor, which a stand-in cannot be (refused here, before the
    backward, where torch's engine would abort the process); ``at``: where the operator takes ``sparse``."""
    def check(args: tuple, kwargs: dict, seen: list) -> None:
        if (args[at] if len(args) > at else kwargs.get("sparse", False)) and seen[2] is not None:
            raise StandInError(format_message(
                call, "a sparse embedding's gradient is a sparse tensor, and sparse tensors on a GPU are not "
                "simulated (docs/deviations.md)", values={"sparse": True},
                fix=f"use nn.{module}(..., sparse=False) (dense gradients; optimizers other than SparseAdam take "
                    "them), or keep the embedding on the CPU"))

    return check


def _no_nested(args: tuple, kwargs: dict, seen: list) -> None:
    """Nested tensors are not simulated on stand-ins (refused before the operator runs: a stand-in wraps one dense
    tensor). nn.TransformerEncoder's evaluation fast path makes one from a padding mask."""
    if seen[2] is not None:
        raise StandInError(format_message(
            "torch.nested", "nested tensors on a GPU are not simulated (docs/deviations.md); nn.TransformerEncoder "
            "makes one in evaluation with a padding mask (its fast path)", values={"enable_nested_tensor": True},
            fix="build the encoder with nn.TransformerEncoder(..., enable_nested_tensor=False), or keep nested "
                "tensors on the CPU"))


_CHECKS = {"aten::index.Tensor": _indices_on_cpu_or_self, "aten::_unsafe_index.Tensor": _indices_on_cpu_or_self,
           "aten::embedding": _dense_embedding(4, "torch.nn.functional.embedding", "Embedding"),
           # (the bag's forward-only variant makes no gradient: not checked)
           "aten::_embedding_bag": _dense_embedding(5, "torch.nn.functional.embedding_bag", "EmbeddingBag"),
           "aten::embedding_bag": _dense_embedding(5, "torch.nn.functional.embedding_bag", "EmbeddingBag"),
           "aten::embedding_bag.padding_idx": _dense_embedding(5, "torch.nn.functional.embedding_bag", "EmbeddingBag")}


def passes_generator(sp: _Spec, args: Any, kwargs: dict) -> bool:
    """Whether a random operator's caller named its own generator (then the stand-in's is not used)."""
    at = sp.generator_at
    if at is None:
        return False
    if kwargs.get("generator") is not None:
        return True
    return len(args) > at and args[at] is not None


_collective_device = threading.local()


def _collective(spec: _Spec, idx: int | None, uargs: list, ukw: dict) -> Any:
    prev = getattr(_collective_device, "idx", None)
    _collective_device.idx = idx
    try:
        return spec.call(*uargs, **ukw)
    finally:
        _collective_device.idx = prev


def rewrap(out: Any, idx: int, owners: Any, sp: _Spec, pos: int) -> Any:
    """Wrap an operator's result(s) on ``cuda:idx``; ``owners``: (inner, wrapper) of the inputs it may return."""
    if isinstance(out, torch.Tensor):
        for inner, w in owners:
            if out is inner:  # an in-place or out= result: the wrapper the caller holds
                if sp.reshaping and (out.shape != w.shape or out.stride() != w.stride()
                                     or out.storage_offset() != w.storage_offset()):
                    _follow(sp, w, out, idx)
                return w
        new = sp.fresh[pos] if pos < len(sp.fresh) else sp.fresh[-1]
        return fresh(out, idx) if new else wrap(out, idx)
    t = type(out)
    if t is tuple or t is list:
        return t([rewrap(o, idx, owners, sp, i if t is tuple else pos) for i, o in enumerate(out)])
    return out


def _follow(spec: _Spec, w: StandInTensor, out: torch.Tensor, idx: int) -> None:
    """An in-place operator changed the shape, strides or offset of ``w``'s CPU tensor (``set_``, ``resize_``,
    ``t_``...): the wrapper takes them on, keeping its identity, version counter and autograd state, as the tensor
    itself would on a GPU.  FullyShardedDataParallel (FSDP1) swaps its flat parameter between the sharded and the
    gathered data this way.  (``.data =`` is torch's own in-place change of a tensor's metadata.)"""
    try:
        with torch._C._DisableTorchDispatch():
            w.data = wrap(out, idx)
    except RuntimeError as e:  # a tensor torch will not let change (made by .data or .detach() of a view...)
        raise _reshaped(spec, w, out) from e
    w._inner = out  # (the wrapper's Python state is its own: .data= changes only its metadata)


def _reshaped(spec: _Spec, w: StandInTensor, out: torch.Tensor) -> StandInError:
    fix = ("use the out-of-place form (y = x.t() instead of x.t_(); a correctly sized out= tensor; "
           "torch.empty(new_shape, device=x.device) instead of x.resize_(...))")
    return StandInError(format_message(
        "simulator.standin", "an in-place operator changed a stand-in tensor's shape or strides, which a "
        "stand-in cannot follow", values={"operator": spec.name, "shape": list(w.shape), "new_shape": list(out.shape)},
        fix=fix))
