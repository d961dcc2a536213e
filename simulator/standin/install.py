"""Installing the CUDA stand-in: the patches :func:`simulator.standin.enabled` applies and restores.

Three kinds of change, all undone when the last ``enabled()`` exits:

* the C++ side (``_native``): the ``cuda`` device guard and torch's
  "privateuseone registered" flag;
* Python names of torch replaced by the stand-in's (``torch.cuda.*``, the
  ``torch._C`` names behind ``torch.cuda`` and ``torch.accelerator``,
  ``Tensor.to``/``cuda``/``pin_memory``, ``torch.compile``, the autocast
  switches, the autograd entry point); every private one is listed in
  :data:`simulator.standin.PRIVATE_TORCH_NAMES`;
* operator registrations (the factory fallback for the ``CUDA`` and
  ``PrivateUse1`` keys, ``_copy_from``, autocast kernels): registered once
  per process and kept, but inert while the stand-in is off (a CUDA factory
  then fails as on a CPU-only build).
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types
from typing import Any, Callable, Iterator

import torch
import torch.autograd
import torch.autograd.graph
import torch.autograd.profiler
import torch.backends.cudnn
import torch.cuda
import torch.cuda.graphs
import torch.cuda.memory
import torch.cuda.nvtx
import torch.cuda.profiler
import torch.cuda.random
import torch.cuda.streams
import torch.jit._builtins
import torch.overrides
import torch.profiler
import torch.serialization
import torch.utils._device
from torch._subclasses import meta_utils
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils import parametrize

from simulator.adapters._patch import Installation
from simulator.adapters.after_import import when_imported
from simulator.standin import _native, amp, attention, cuda_api as api, flex, fsdp1, legacy, multi_gpu, ranks, rng
from simulator.standin import syncbn  # noqa: F401  (its operators, registered on import)
from simulator.standin.fakecache import DeviceKeyedCache, plain_to_fakes
from simulator.standin.jit import patched_jit_load, plain_slots, script_apply
from simulator.standin.device_type import device_class
from simulator.standin.streams import generic_event, generic_stream
from simulator.standin.swap import SWAP_WEAKREFS, set_like_a_gpu, swap_unless_same
from simulator.standin.refuse import (CUDA_ONLY, CudartStub, NvtxStub, check_error, emit_nvtx_enter, emit_nvtx_exit,
                                       ProcessGroupNCCL, compile_guard, cuda_only_table, profile_cpu_only,
                                       cuda_library_table, tunable_enable)
from simulator.standin.serialization import (cpu_tagger, deserialize_cuda, patched_load, patched_save,
                                             registry_entry, storage_to)
from simulator.standin.versions import CUDA_BUILD, STANDIN_CUDA_VERSION, STANDIN_CUDNN_VERSION, STANDIN_NCCL_VERSION
from simulator.standin.ops import COMPOSITE_FACTORIES, copy_from, cuda_kernel_factories, factory
from simulator.standin.tensor import CUDA_DEVICES, PU_DEVICES, StandInTensor

__all__ = ["INSTALLATION", "active", "configured", "PATCHED_PUBLIC"]

_CPU_ONLY = "Torch not compiled with CUDA enabled"
_lock = threading.Lock()
_libraries: list[Any] = []  # the operator registrations, kept for the life of the process
_saved: list[tuple[Any, Any, bool, Any]] = []
_active = ranks.enabled  # (one flag, which ranks.py's fork hook reads too)


def active() -> bool:
    """Whether a stand-in is enabled now."""
    return _active[0]


# -- operator registrations (once per process) --------------------------------------------------------
def _fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    if not _active[0]:
        if CUDA_BUILD:
            torch.cuda._lazy_init()  # a CUDA build without a GPU: raises what its own kernel would ("no NVIDIA driver")
        raise AssertionError(_CPU_ONLY)  # what a CUDA factory raises on a CPU-only build
    return factory(op, *args, **kwargs)


def _copy_from_kernel(op: Any) -> Callable[..., Any]:
    # reached when the Python key is excluded (torch.tensor(data, device="cuda") copies that way)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return copy_from(op, args, kwargs)

    return kernel


def _factory_kernel(op: Any) -> Callable[..., Any]:
    # a composite factory computed in one CPU call (see ops.COMPOSITE_FACTORIES)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return _fallback(op, *args, **kwargs)

    return kernel


def _record_stream_kernel(tensor: torch.Tensor, stream: Any) -> None:
    return None


def _scalar_kernel(tensor: torch.Tensor) -> Any:
    return tensor._inner.item()  # (a stand-in: its CPU data)


def _ctc_loss_lengths_on_host(log_probs: Any, targets: Any, input_lengths: Any, target_lengths: Any, blank: int = 0,
                              reduction: int = 1, zero_infinity: bool = False) -> Any:
    """``ctc_loss`` with Tensor lengths, as CUDA computes it: the lengths read to the host first (torch's path for
    plain tensors), so that ``reduction="mean"`` divides by lengths on the loss's device.  A subclass would take
    torch's composite path, which divides a GPU loss by lengths left on the CPU."""
    for name, t in (("input_lengths", input_lengths), ("target_lengths", target_lengths)):
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise RuntimeError(f"{name} must be integral")
    return torch.ops.aten.ctc_loss.IntList(log_probs, targets, input_lengths.tolist(), target_lengths.tolist(), blank,
                                           reduction, zero_infinity)


def _overload(name: str) -> Any:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _register_once() -> None:
    if _libraries:
        return
    fallback = torch.library.Library("_", "IMPL")
    for key in ("CUDA", "PrivateUse1"):
        fallback.fallback(_fallback, key)
    lib = torch.library.Library("aten", "IMPL")
    for op in (torch.ops.aten._copy_from.default, torch.ops.aten._copy_from_and_resize.default):
        for key in ("CUDA", "PrivateUse1"):
            lib.impl(op, _copy_from_kernel(op), key)
    for name in COMPOSITE_FACTORIES:
        op = _overload(name)
        for key in ("CUDA", "PrivateUse1"):
            lib.impl(op, _factory_kernel(op), key)
    for op in cuda_kernel_factories(CUDA_BUILD):
        lib.impl(op, _factory_kernel(op), "CUDA")
    # FSDP1 records its freed flat parameter's stream with torch dispatch disabled (_no_dispatch_record_stream):
    # the call reaches the device key, not the stand-in's __torch_dispatch__; stand-in memory is never reused early
    lib.impl(torch.ops.aten.record_stream.default, _record_stream_kernel, "PrivateUse1")
    # torch.Tensor([a, b]) / torch.FloatTensor([...]) read 0-dim elements with item() with the Python key excluded
    lib.impl(torch.ops.aten._local_scalar_dense.default, _scalar_kernel, "PrivateUse1")
    for op in _KERNEL_OVER_COMPOSITE:
        lib.impl(op, _kernel_over_composite(op), "AutogradPrivateUse1")
    lib.impl(torch.ops.aten.ctc_loss.Tensor, _ctc_loss_lengths_on_host, "AutogradPrivateUse1")
    for name in _FUSED_STEPS_WITHOUT_META:
        lib.impl(_overload(name), _updates_in_place, "Meta")
    _libraries.extend([fallback, lib, *amp.register(), *attention.register()])


#: operators with a CPU (and CUDA) kernel and a composite for other devices: a privateuseone tensor would take the
#: composite, which rounds differently from the kernel (SiLU's and Mish's gradients by an ulp)
_KERNEL_OVER_COMPOSITE = (torch.ops.aten.silu_backward.default, torch.ops.aten.mish_backward.default,
                          torch.ops.aten.native_channel_shuffle.default)


#: fused optimizer steps that torch 2.13 gives no Meta kernel.  DTensor (FSDP2's parameters) derives an operator's
#: output by running it on fake tensors; without a Meta kernel fake mode runs it on real tensors of the fake's device,
#: which for a stand-in it cannot make ("func != nullptr INTERNAL ASSERT FAILED"), so ``SGD(fused=True)`` failed where
#: a GPU runs it.  Each updates its lists in place and returns nothing: all a Meta kernel has to say.
_FUSED_STEPS_WITHOUT_META = ("_fused_sgd_", "_fused_sgd_.tensor_lr", "_fused_adagrad_", "_fused_adagrad_.tensor_lr",
                             "_fused_adam_.tensor_lr", "_fused_adamw_.tensor_lr")


def _updates_in_place(*args: Any, **kwargs: Any) -> None:
    return None


def _kernel_over_composite(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return op.decompose(*args, **kwargs)  # (a double backward differentiates the composite, as on a GPU)
        with torch._C._AutoDispatchBelowAutograd():  # on to the stand-in's dispatch: the CPU kernel
            return op(*args, **kwargs)

    return kernel


# -- Python-level replacements -------------------------------------------------------------------------
def _pu(device: Any) -> Any:
    """A device argument of ``Tensor.to``, resolved: CUDA (or an int) becomes the stand-in's ``privateuseone:i``."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return PU_DEVICES[ranks.resolve_index(device, "torch.Tensor.to")]
    if isinstance(device, str):
        if not (device.startswith("cuda") or device.startswith("privateuseone")):
            return device
        device = torch.device(device)
    if isinstance(device, torch.device) and device.type in ("cuda", "privateuseone"):
        return PU_DEVICES[ranks.resolve_index(device, "torch.Tensor.to")]
    return device


def _patched_to(original: Callable[..., Any]) -> Callable[..., Any]:
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # resolve "cuda"/an index to the rank's device here: torch's own resolution asks a guard that knows none
        if args and isinstance(args[0], (str, int, torch.device)):
            args = (_pu(args[0]),) + args[1:]
        if kwargs.get("device") is not None:
            kwargs["device"] = _pu(kwargs["device"])
        return original(self, *args, **kwargs)

    return to


def _patched_cuda(original_to: Callable[..., Any]) -> Callable[..., Any]:
    def cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False,
             memory_format: torch.memory_format = torch.preserve_format) -> Any:
        idx = ranks.resolve_index(device, "torch.Tensor.cuda")
        return original_to(self, PU_DEVICES[idx], non_blocking=non_blocking, memory_format=memory_format)

    return cuda


def _cpu_elements(data: Any) -> Any:
    """``data`` with each stand-in inside its (nested) lists and tuples replaced by its CPU tensor: torch reads the
    elements of ``torch.tensor([cuda_0d, 1.0])`` below the dispatcher, where a stand-in has no kernel (an internal
    assert); a GPU reads their values."""
    if not isinstance(data, (list, tuple)):
        return data._inner if isinstance(data, StandInTensor) else data
    out = [_cpu_elements(x) for x in data]
    return out if any(a is not b for a, b in zip(out, data)) else data


def _default_cuda() -> torch.device | None:
    """The innermost default device (a ``DeviceContext`` mode), when it is CUDA without an index."""
    for mode in reversed(torch.overrides._get_current_function_mode_stack()):
        if isinstance(mode, torch.utils._device.DeviceContext):
            d = mode.device
            return d if d.type == "cuda" and d.index is None else None
    return None


@functools.cache  # one wrapper per original, for the process: TorchScript knows it by id (below)
def _patched_constructor(original: Callable[..., Any]) -> Callable[..., Any]:
    def construct(*args: Any, **kwargs: Any) -> Any:
        # torch.tensor(data, device="cuda") resolves a missing index through a guard that knows no rank; so does
        # the bare "cuda" a default device (torch.set_default_device, ``with torch.device("cuda")``) puts there
        if kwargs.get("device") is not None:
            kwargs["device"] = _pu(kwargs["device"])
        elif torch._C._len_torch_function_stack():
            default = _default_cuda()
            if default is not None:
                kwargs["device"] = _pu(default)
        try:
            return original(*args, **kwargs)
        except RuntimeError:
            # (read on failure only: scanning every list made torch.tensor of a long list 3x slower)
            data = _cpu_elements(args[0]) if args and isinstance(args[0], (list, tuple)) else None
            if data is None or data is args[0]:
                raise
        return original(data, *args[1:], **kwargs)

    construct.__name__ = original.__name__
    construct.__doc__ = original.__doc__
    # a scripted function calling torch.tensor compiles the wrapper as the aten operator it stands for (a
    # *args function cannot be scripted; torch.distributed.optim scripts such functions on import)
    builtin = torch.jit._builtins._find_builtin(original)
    if builtin is not None:
        torch.jit._builtins._register_builtin(construct, builtin)
    return construct


def _patched_new_tensor(original: Callable[..., Any]) -> Callable[..., Any]:
    def new_tensor(self: torch.Tensor, data: Any, *args: Any, **kwargs: Any) -> Any:
        # torch resolves self's device without its index here (same guard as above): name it in full
        if len(args) < 2:
            kwargs["device"] = _pu(kwargs.get("device") if kwargs.get("device") is not None else self.device)
        return original(self, data, *args, **kwargs)

    return new_tensor


def _pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
    if isinstance(self, StandInTensor):
        raise RuntimeError(f"cannot pin '{self.type()}' only dense CPU tensors can be pinned")
    return self  # pinning changes nothing on the CPU: the tensor is usable as is


def _no_multithreading(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def run(*args: Any, **kwargs: Any) -> Any:
        # the engine would hand stand-in work to a device thread, where the rank's identity is lost (and whose
        # queues it sized by the one device torch's Python-registered guard reports)
        with torch.autograd.set_multithreading_enabled(False):
            return original(*args, **kwargs)

    return run


def _ddp_logger(original: type) -> type:
    """DDP's C++ logger, but for its runtime timing statistics: it times CPU and CUDA modules only, and for any
    other device (a stand-in is privateuseone underneath) prints a warning a GPU run does not print. A subclass
    of torch's own, so that the reducer's reference to it (a C++ weak pointer) holds this very logger."""

    class Logger(original):  # type: ignore[misc, valid-type]
        def set_runtime_stats_and_log(self) -> None:
            return None  # (no GPU kernels to time)

    Logger.__module__, Logger.__qualname__ = original.__module__, original.__qualname__
    return Logger


_TB_DEVICE = torch._C.TensorBase.device.__get__
_TB_IS_CUDA = torch._C.TensorBase.is_cuda.__get__
_MAKE_WRAPPER = torch.Tensor._make_wrapper_subclass


def _device(self: torch.Tensor) -> torch.device:
    # any tensor whose C++ device is privateuseone is on a stand-in: a wrapper torch builds over stand-ins
    # (DTensor, AsyncCollectiveTensor) reports the CUDA device, as on a GPU
    d = _TB_DEVICE(self)
    return CUDA_DEVICES[d.index] if d.type == "privateuseone" else d


def _is_cuda(self: torch.Tensor) -> bool:
    return _TB_IS_CUDA(self) or _TB_DEVICE(self).type == "privateuseone"


def _make_wrapper_subclass(cls: type, *args: Any, **kwargs: Any) -> Any:
    # a wrapper subclass built "on cuda" (DTensor over a stand-in) must be on the stand-in's C++ device too:
    # autograd only works for the privateuseone device type (see _native)
    dev = kwargs.get("device")
    if dev is not None:
        kwargs["device"] = _pu(dev)
    return _MAKE_WRAPPER(cls, *args, **kwargs)


_TB_DATA = torch._C.TensorBase.data


def _get_data(self: torch.Tensor) -> torch.Tensor:
    return _TB_DATA.__get__(self)


def _set_data(self: torch.Tensor, new: torch.Tensor) -> None:
    # ``cpu_param.data = standin`` (FSDP2 moving a CPU model, hand-written moves) makes the parameter live on
    # the GPU; a plain tensor cannot take a wrapper's data, so the object is swapped in place (it keeps its
    # identity, as set_data keeps it)
    if isinstance(new, StandInTensor) and not isinstance(self, StandInTensor):
        repl = torch.nn.Parameter(new, requires_grad=self.requires_grad) if isinstance(self, torch.nn.Parameter) \
            else new.detach().requires_grad_(self.requires_grad)
        torch.utils.swap_tensors(self, repl)
    else:
        _TB_DATA.__set__(self, new)


_CUDART = CudartStub()  # (torch.cuda.cudart, and torch.cuda.profiler's own binding of it)


def _current_accelerator(check: bool = False) -> torch.device:
    return torch.device("cuda")


def _exchange(idx: int) -> int:
    return api.exchange_device(idx)


_MEMORY = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
           "reset_peak_memory_stats", "reset_accumulated_memory_stats", "memory_stats", "mem_get_info",
           "empty_cache", "set_per_process_memory_fraction",
           "memory_stats_as_nested_dict", "memory_snapshot", "get_allocator_backend", "get_per_process_memory_fraction",
           "caching_allocator_enable", "host_memory_stats", "host_memory_stats_as_nested_dict",
           "reset_peak_host_memory_stats")
_RANDOM = ("manual_seed", "seed", "initial_seed", "get_rng_state", "set_rng_state", "get_rng_state_all",
           "set_rng_state_all")
_DEVICE = ("is_available", "device_count", "current_device", "set_device", "get_device_name",
           "get_device_capability", "get_device_properties", "synchronize", "current_stream", "default_stream",
           "set_stream", "is_initialized", "is_bf16_supported", "set_sync_debug_mode", "get_sync_debug_mode",
           "utilization", "memory_usage", "temperature", "power_draw", "clock_rate")


def _cudnn_acceptable(tensor: Any) -> bool:
    """``torch.backends.cudnn.is_acceptable``: never, on stand-ins. Their kernels are the CPU's, so torch must take
    its paths without cuDNN (an LSTM keeps its weights unflattened: ``_cudnn_rnn_flatten_weight`` has no CPU
    kernel); torch's own answer would warn "compiled without cuDNN" at every RNN built on a stand-in."""
    return False


def _table() -> list[tuple[Any, str, Any]]:
    """Every (owner, name, replacement) the stand-in installs."""
    cuda, mem, rnd, streams, graphs = torch.cuda, torch.cuda.memory, torch.cuda.random, torch.cuda.streams, \
        torch.cuda.graphs
    t: list[tuple[Any, str, Any]] = []
    t += [(cuda, n, getattr(api, n)) for n in _DEVICE]
    t += [(m, n, getattr(api, n)) for n in _MEMORY for m in (cuda, mem)]
    t += [(m, n, getattr(api, n)) for n in _RANDOM for m in (cuda, rnd)]
    t += [(m, n, getattr(api, n)) for m in (cuda, rnd) for n in ("manual_seed_all", "seed_all")]
    t += [(m, alias, getattr(api, n)) for m in (cuda, mem) for alias, n in
          (("memory_cached", "memory_reserved"), ("max_memory_cached", "max_memory_reserved"),
           ("reset_max_memory_allocated", "reset_peak_memory_stats"),
           ("reset_max_memory_cached", "reset_peak_memory_stats"))]
    t += [(m, n, getattr(api, n)) for n in ("Stream", "Event") for m in (cuda, streams)]
    t += [(m, n, api.CUDAGraph if n == "CUDAGraph" else api.refuse_graphs) for m in (cuda, graphs)
          for n in ("CUDAGraph", "graph", "make_graphed_callables", "graph_pool_handle")]
    t += [(m, "is_current_stream_capturing", lambda: False) for m in (cuda, graphs)]
    t += [(mem, n, api.refuse_memory_history) for n in ("_record_memory_history", "_snapshot", "_dump_snapshot")]
    t += [(cuda, "default_generators", api.DefaultGenerators()), (cuda, "init", api.lazy_init),
          (cuda, "_lazy_init", api.lazy_init), (cuda, "_initialized", True),
          (cuda, "_exchange_device", api.exchange_device), (cuda, "_maybe_exchange_device", api.maybe_exchange_device),
          (cuda, "get_arch_list", lambda: ["sm_90"]), (cuda, "ipc_collect", lambda: None),
          # (a GPU spin kernel that delays its stream, in overlap tests and benchmarks: nothing to delay here)
          (cuda, "_sleep", lambda cycles: None),
          (torch.cuda.tunable, "is_enabled", lambda: False), (torch.cuda.tunable, "enable", tunable_enable),
          # compiled code runs eagerly on stand-ins (refuse.compile_guard): no CUDA graph trees to mark a step of
          (torch.compiler, "cudagraph_mark_step_begin", lambda: None),
          (cuda, "can_device_access_peer", lambda d, p: api.resolve_index(d) >= 0 and api.resolve_index(p) >= 0),
          (torch.cuda.nvtx, "_nvtx", NvtxStub()), (torch.cuda, "cudart", _CUDART),
          (torch, "Event", generic_event(torch.Event)), (torch, "Stream", generic_stream(torch.Stream)),
          (torch.cuda.profiler, "cudart", _CUDART), (torch.cuda, "check_error", check_error),
          (torch.cuda.profiler, "check_error", check_error),
          (torch.autograd.profiler.emit_nvtx, "__enter__", emit_nvtx_enter),
          (torch.autograd.profiler.emit_nvtx, "__exit__", emit_nvtx_exit),
          # torch's c10d logger asks for NCCL's version when a collective of an "nccl" group fails
          (torch.cuda.nccl, "version", lambda: STANDIN_NCCL_VERSION),
          # (DataParallel's reduce_add asks; stand-ins have no NCCL of their own: torch's adds, without the CPU
          # build's warning that NCCL is missing)
          (torch.cuda.nccl, "is_available", lambda tensors: False),
          # the "nccl" backend is there for the program (an nccl group is the simulated world's, with NCCL's
          # rules); torch's own c10d module keeps its answer, as it would otherwise name ProcessGroupNCCL
          (torch.distributed, "is_nccl_available", lambda: True), (torch.version, "cuda", STANDIN_CUDA_VERSION),
          (torch.distributed, "ProcessGroupNCCL", ProcessGroupNCCL), (torch.backends.cuda, "is_built", lambda: True),
          # a GPU build has cuDNN: programs print its version or assert it is there
          (torch.backends.cudnn, "is_available", lambda: True),
          (torch.backends.cudnn, "version", lambda: STANDIN_CUDNN_VERSION),
          (torch.backends.cudnn, "is_acceptable", _cudnn_acceptable)]
    c = torch._C
    # (torch._C._cuda_* stay absent: torch modules import CUDA-only bindings when they see one of them)
    t += [(c, "_get_accelerator", _current_accelerator), (c, "_accelerator_getAccelerator", _current_accelerator),
          (c, "_accelerator_getDeviceIndex", api.current_device), (c, "_accelerator_setDeviceIndex", api.set_device),
          (c, "_accelerator_exchangeDevice", _exchange), (c, "_accelerator_maybeExchangeDevice", _exchange),
          (c, "_accelerator_synchronizeDevice", lambda idx=None: None),
          (c, "_accelerator_getStream", api.current_stream), (c, "_accelerator_setStream", api.set_stream),
          (c, "_accelerator_emptyCache", api.empty_cache), (c, "_accelerator_getDeviceStats", api.memory_stats),
          # (torch.accelerator's memory functions ask it first: torch's would assert on the privateuseone allocator)
          (c, "_accelerator_isAllocatorInitialized", lambda: True),
          (c, "_accelerator_resetPeakStats", api.reset_peak_memory_stats),
          (c, "_accelerator_resetAccumulatedStats", api.reset_accumulated_memory_stats),
          (c, "_accelerator_getMemoryInfo", api.mem_get_info)]
    tensor_to = torch.Tensor.to
    t += [(torch.Tensor, "device", property(_device)), (torch.Tensor, "is_cuda", property(_is_cuda)),
          (torch.Tensor, "data", property(_get_data, _set_data)),
          (torch.Tensor, "_make_wrapper_subclass", staticmethod(_make_wrapper_subclass))]
    t += [(torch, n, _patched_constructor(getattr(torch, n))) for n in ("tensor", "as_tensor", "asarray")]
    t += [(torch.Tensor, "to", _patched_to(tensor_to)), (torch.Tensor, "cuda", _patched_cuda(tensor_to)),
          (torch.Tensor, "pin_memory", _pin_memory), (torch.Tensor, "new_tensor", _patched_new_tensor(
              torch.Tensor.new_tensor)), (torch, "compile", compile_guard(torch.compile)),
          (torch.profiler.profile, "__init__", profile_cpu_only(torch.profiler.profile.__init__)),
          (torch, "set_autocast_enabled", amp.mirror_enabled(torch.set_autocast_enabled)),
          (torch, "set_autocast_dtype", amp.mirror_dtype(torch.set_autocast_dtype))]
    # TorchScript modules (scripted, loaded, traced): moved, saved and loaded as on a GPU
    t += [(torch.jit.ScriptModule, "_apply", script_apply(torch.jit.ScriptModule._apply)),
          (torch.jit, "load", patched_jit_load(torch.jit.load))]
    t += [(c, n, plain_slots(vars(c)[n])) for c in (torch.jit.ScriptModule, torch.jit.RecursiveScriptModule)
          for n in ("save", "save_to_buffer")]
    t += [(torch, "load", patched_load(torch.load)), (torch, "save", patched_save(torch.save)),
          (torch.UntypedStorage, "to", storage_to(torch.UntypedStorage.to)),
          (torch, "Generator", rng.generator_class(torch.Generator)),
          (torch, "device", device_class(torch.device)),
          (torch.utils, "swap_tensors", swap_unless_same(torch.utils.swap_tensors)),
          (torch.utils, "weakref", SWAP_WEAKREFS),
          (parametrize, "_maybe_set", set_like_a_gpu(parametrize._maybe_set)),
          (torch.Tensor, "type", legacy.patched_type(torch.Tensor.type)),
          (torch, "set_default_tensor_type", legacy.patched_set_default_tensor_type(torch.set_default_tensor_type))]
    t += [(torch.cuda, name, cls) for name, cls in legacy.legacy_types().items()]
    t += [(torch._C, name, f) for name, f in multi_gpu.BINDINGS.items()]  # nn.DataParallel's copies
    t += cuda_only_table()  # CUDA runtime entry points: refused, naming the fix
    t += cuda_library_table()  # the CUDA libraries' start-up knobs: kept and answered
    # DTensor's fake factories name a bare "cuda": their cached results belong to the current device
    t += [(FakeTensorMode, "cache", DeviceKeyedCache()),  # torch.export fakifies a stand-in as a CUDA tensor
          (meta_utils, "is_traceable_wrapper_subclass", plain_to_fakes(meta_utils.is_traceable_wrapper_subclass))]
    backward = _no_multithreading(torch.autograd.graph._engine_run_backward)
    t += [(torch.autograd, "_engine_run_backward", backward), (torch.autograd.graph, "_engine_run_backward", backward)]
    import torch.distributed.autograd as dist_autograd

    if hasattr(dist_autograd, "backward"):  # torch's distributed engine (rank processes' own RPC): the same rule
        t += [(dist_autograd, "backward", _no_multithreading(dist_autograd.backward))]
    import torch.distributed as tdist

    if hasattr(tdist, "Logger"):
        t += [(tdist, "Logger", _ddp_logger(tdist.Logger))]
    return t


#: the public torch names the stand-in replaces while enabled (the private ones: PRIVATE_TORCH_NAMES)
PATCHED_PUBLIC = tuple(sorted({f"torch.cuda.{n}" for n in (*_DEVICE, *_MEMORY, *_RANDOM, *legacy.NAMES)} | {
    "torch.cuda.Stream", "torch.cuda.Event", "torch.cuda.CUDAGraph", "torch.cuda.graph",
    "torch.cuda.make_graphed_callables", "torch.cuda.graph_pool_handle", "torch.cuda.default_generators",
    "torch.cuda.init", "torch.cuda.get_arch_list", "torch.cuda.can_device_access_peer", "torch.cuda.nccl.version",
    "torch.cuda.nccl.is_available", "torch.distributed.is_nccl_available", "torch.distributed.ProcessGroupNCCL",
    "torch.backends.cuda.is_built",
    "torch.version.cuda",
    "torch.backends.cudnn.is_available", "torch.backends.cudnn.version", "torch.backends.cudnn.is_acceptable",
    "torch.Tensor.device",
    "torch.Tensor.is_cuda", "torch.Tensor.data", "torch.Tensor.to", "torch.Tensor.cuda", "torch.Tensor.pin_memory",
    "torch.Tensor.new_tensor", "torch.tensor", "torch.as_tensor", "torch.asarray", "torch.load", "torch.save",
    "torch.UntypedStorage.to", "torch.jit.load", "torch.jit.ScriptModule.save",
    "torch.jit.ScriptModule.save_to_buffer", "torch.jit.RecursiveScriptModule.save",
    "torch.jit.RecursiveScriptModule.save_to_buffer",
    "torch.Generator", "torch.device", "torch.utils.swap_tensors", "torch.utils.weakref", "torch.cuda.cudart", "torch.Event",
    "torch.Stream",
    "torch.cuda.profiler.cudart", "torch.cuda.check_error", "torch.cuda.profiler.check_error",
    "torch.autograd.profiler.emit_nvtx.__enter__", "torch.autograd.profiler.emit_nvtx.__exit__",
    "torch.Tensor.type", "torch.set_default_tensor_type",
    "torch.compile", "torch.profiler.profile.__init__",
    "torch.set_autocast_enabled", "torch.set_autocast_dtype", "torch.distributed.autograd.backward",
    "torch.distributed.Logger"} | {
    f"torch.{m}.{n}" for modules, names, _, _ in CUDA_ONLY for m in modules for n in names if not n.startswith("_")}))


#: patched when imported, while the stand-in is enabled (they take a while to import: see adapters.after_import)
_ON_IMPORT = (*fsdp1.ON_IMPORT, *flex.ON_IMPORT)
_import_undos: list[Callable[[], None]] = []


def _set(owner: Any, name: str, value: Any) -> None:
    had = name in vars(owner)
    _saved.append((owner, name, had, vars(owner).get(name)))
    setattr(owner, name, value)


def _install() -> None:
    with _lock:
        _register_once()
        _native.install()
        # torch's dispatcher imports DTensor at the first operator on a stand-in: once now, not in a rank's call
        import torch.distributed.tensor  # noqa: F401
        # torch caches sets of its own functions on first use (the default-device constructors, the ignored
        # overrides): fill them now, with the originals, so that no replacement below is cached for good
        torch.utils._device._device_constructors()
        torch.overrides.get_ignored_functions()
        for owner, name, value in _table():
            _set(owner, name, value)
        # torch.load restores cuda storages through this entry: onto the CPU, to become stand-ins
        pos, entry, priority, tagger = registry_entry()
        _saved.append((torch.serialization._package_registry, pos, True, entry))
        torch.serialization._package_registry[pos] = (priority, tagger, deserialize_cuda)
        # torch.save tags a stand-in's (CPU) storage as its CUDA device's, ahead of CPU's tagger
        pos, entry, priority, tagger = registry_entry("cpu")
        _saved.append((torch.serialization._package_registry, pos, True, entry))
        torch.serialization._package_registry[pos] = (priority, cpu_tagger(tagger), entry[2])
        # torch.device("privateuseone", i) lazily initialises "torch.privateuseone": a module with nothing to start
        _saved.append((sys.modules, "torch.privateuseone", "torch.privateuseone" in sys.modules,
                       sys.modules.get("torch.privateuseone")))
        sys.modules["torch.privateuseone"] = types.ModuleType("torch.privateuseone")
        _import_undos.extend(when_imported(name, patch) for name, patch in _ON_IMPORT)
        _active[0] = True


def _uninstall() -> None:
    with _lock:
        _active[0] = False
        while _import_undos:
            _import_undos.pop()()
        while _saved:
            owner, name, had, old = _saved.pop()
            if isinstance(owner, list):
                owner[name] = old
            elif owner is sys.modules:
                if had:
                    sys.modules[name] = old
                else:
                    sys.modules.pop(name, None)
            elif had:
                setattr(owner, name, old)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(owner, name)
        _native.uninstall()


INSTALLATION = Installation(_install, _uninstall)


@contextlib.contextmanager
def configured(cfg: ranks.Config) -> Iterator[None]:
    """Install (first entry) and make ``cfg`` the active configuration until exit."""
    with INSTALLATION.enabled():
        ranks.push_config(cfg)
        try:
            yield
        finally:
            ranks.pop_config(cfg)

