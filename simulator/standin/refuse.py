"""``torch.compile`` on the CUDA stand-in runs eagerly; NVTX ranges are no-ops.

``torch.compile`` would trace stand-ins as ``privateuseone`` tensors and generate kernels for a device that does
not exist.  Compiling is an optimisation whose results are the eager model's (to rounding), and GPU-written
scripts compile by default (nanoGPT's ``compile = True``), so while the stand-in is enabled a module that holds
stand-in parameters or buffers "compiles" to torch's own ``OptimizedModule`` with dynamo disabled (so
``_orig_mod``, its ``state_dict`` keys and ``DDP`` around it are as after a real compile) and runs eagerly; a
compiled module called with stand-ins, and a compiled function called while the stand-in is on (it may reach
stand-ins through its closure or globals), run their originals eagerly.  The first time, a warning says so.
Anything else compiles as usual.  (CUDA graphs are refused in ``cuda_api``; operators with GPU kernels
only, such as custom CUDA extensions and Triton kernels registered as operators, in ``tensor``.)

``torch.profiler.profile(activities=[..., ProfilerActivity.CUDA])`` profiles the CPU only: there are no GPU kernels to
trace, and torch's CPU build would print a C++ stack trace for every operator it tried to time on CUDA
(:func:`profile_cpu_only`); the first time, a warning says so.

``torch.cuda``'s entry points into CUDA's own runtime (cuBLAS handles, raw allocator blocks, memory pools,
external streams, jiterator, TunableOp) are refused with :class:`StandInError` naming the fix
(:data:`CUDA_ONLY`): torch would fail on the missing binding with a bare ``AttributeError``.
"""
from __future__ import annotations

import functools
import sys
import warnings
from typing import Any, Callable

import torch
import torch.cuda
import torch.cuda.jiterator
import torch.cuda.memory
import torch.cuda.nccl
import torch.cuda.streams
import torch.cuda.tunable
import torch.profiler

from tensorplay.distributed.errors import format_message

from simulator.standin.errors import StandInError
from simulator.standin.ranks import open_now
from simulator.standin.tensor import StandInTensor

__all__ = ["compile_guard", "NvtxStub", "CudartStub", "check_error", "emit_nvtx_enter", "emit_nvtx_exit",
           "CUDA_ONLY", "cuda_only_table", "tunable_enable", "LibraryChoice", "cuda_library_table"]


_warned: list[bool] = [False]


def _eagerly(what: str) -> None:
    """Say once per process that compiled code runs eagerly on stand-ins."""
    if not _warned[0]:
        _warned[0] = True
        warnings.warn(format_message(
            "torch.compile", f"the CUDA stand-in runs compiled code eagerly ({what}); results are the eager "
            "model's, to rounding, and no kernels are generated", fix="nothing to do to simulate; on real GPUs the "
            "same program compiles"), RuntimeWarning, stacklevel=3)


_profile_warned = [False]


def profile_cpu_only(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.profiler.profile.__init__`` that leaves CUDA out of the activities (see the module docstring)."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        cuda = torch.profiler.ProfilerActivity.CUDA
        if cuda in self.activities:
            self.activities = set(self.activities) - {cuda}
            self.activity_filters.pop(cuda, None)
            self.use_device = None
            if not _profile_warned[0]:
                _profile_warned[0] = True
                warnings.warn(format_message(
                    "torch.profiler.profile", "the CUDA stand-in has no GPU kernels to trace: CUDA activity is "
                    "left out, CPU activity (every operator, computed on the CPU) is recorded",
                    values={"activities": "CUDA"}, fix="nothing to do to simulate; on real GPUs the same program "
                    "traces its kernels"), RuntimeWarning, stacklevel=2)

    return __init__


def _eager_module(model: torch.nn.Module) -> torch.nn.Module:
    """torch's ``OptimizedModule`` around ``model`` with dynamo disabled: a compiled module's shape, eager calls."""
    from torch._dynamo.eval_frame import DisableContext, OptimizedModule  # (imports dynamo: only when compiling)

    return OptimizedModule(model, DisableContext())


def _holds_standin(obj: Any) -> bool:
    if isinstance(obj, torch.nn.Module):
        return any(isinstance(t, StandInTensor) for t in (*obj.parameters(), *obj.buffers()))
    return False


def _any_standin(args: tuple, kwargs: dict) -> bool:
    def check(x: Any) -> bool:
        if isinstance(x, StandInTensor):
            return True
        if type(x) in (list, tuple):
            return any(check(v) for v in x)
        if type(x) is dict:
            return any(check(v) for v in x.values())
        return False

    return check(args) or check(kwargs)


def compile_guard(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` that runs stand-in modules and calls with stand-ins eagerly (see the module docstring)."""

    @functools.wraps(original)
    def compile(model: Any = None, **kwargs: Any) -> Any:  # noqa: A001  (torch's name)
        if model is None:  # @torch.compile(mode=...) decorator form
            return lambda m: compile(m, **kwargs)
        if _holds_standin(model):
            _eagerly(f"{type(model).__name__} has parameters or buffers on a stand-in device")
            return _eager_module(model)
        compiled = original(model, **kwargs)
        if isinstance(compiled, torch.nn.Module):
            inner_forward = compiled.forward

            @functools.wraps(inner_forward)
            def forward(*args: Any, **kw: Any) -> Any:
                if _any_standin(args, kw) or _holds_standin(model):
                    _eagerly("a stand-in tensor reached the compiled module")
                    return model(*args, **kw)
                return inner_forward(*args, **kw)

            compiled.forward = forward
            return compiled

        @functools.wraps(model)
        def call(*args: Any, **kw: Any) -> Any:
            # a function reaches stand-ins through its arguments, the modules among them, its closure and its
            # globals (PyTorch's compiled-optimizer recipe: ``opt.step()`` with no argument): while the stand-in
            # is on, it runs eagerly
            if open_now():
                _eagerly("a compiled function runs while the stand-in is on")
                return model(*args, **kw)
            return compiled(*args, **kw)

        return call

    return compile


class NvtxStub:
    """``torch.cuda.nvtx``'s native module on the stand-in: ranges and marks are accepted and dropped."""

    def rangePushA(self, msg: str) -> int:  # noqa: N802  (NVTX's name)
        return 0

    def rangePop(self) -> int:  # noqa: N802
        return 0

    def rangeStartA(self, msg: str) -> int:  # noqa: N802
        return 0

    def rangeEnd(self, range_id: int) -> None:  # noqa: N802
        return None

    def markA(self, msg: str) -> None:  # noqa: N802
        return None

    def deviceRangeStart(self, msg: str, stream: Any) -> int:  # noqa: N802
        return 0

    def deviceRangeEnd(self, range_handle: Any, stream: Any) -> None:  # noqa: N802
        return None


class CudartStub:
    """``torch.cuda.cudart()`` on the stand-in: the runtime calls torch's own Python code makes succeed (0 is
    ``cudaSuccess``); any other is refused, naming the fix.  Registering host memory (DCP's pinned staging
    buffers, ``torch.cuda._pin_memory_utils``) changes nothing on the CPU, as pinning does not."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802  (CUDA's name)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        return 0

    def cudaProfilerStart(self) -> int:  # noqa: N802
        return 0

    def cudaProfilerStop(self) -> int:  # noqa: N802
        return 0

    def cudaGetErrorString(self, error: int) -> str:  # noqa: N802
        return "no error" if int(error) == 0 else f"cudaError {int(error)}"

    def __getattr__(self, name: str) -> Any:
        raise StandInError(format_message(
            f"torch.cuda.cudart().{name}", "the CPU stand-in has no CUDA runtime for this call",
            fix="compute through torch's operators and torch.cuda's APIs when simulating, or run on real GPUs"))

    def __call__(self) -> "CudartStub":  # (installed as torch.cuda.cudart itself: calling it gives the module)
        return self


def check_error(res: int) -> None:
    """``torch.cuda.check_error`` on the stand-in (torch's reads CUDA's error enum from a runtime the CPU build lacks):
    0 is ``cudaSuccess``."""
    if int(res) != 0:
        raise RuntimeError(f"CUDA error: {CudartStub().cudaGetErrorString(res)}")


def emit_nvtx_enter(self: Any) -> Any:
    """``torch.autograd.profiler.emit_nvtx().__enter__`` on the stand-in: NVTX ranges are for NVIDIA's profilers,
    which see nothing of a stand-in; the context is kept (and stays not reentrant), nothing is emitted."""
    if not self.enabled:
        return None
    if self.entered:
        raise RuntimeError("NVTX annotation context manager is not reentrant")
    self.entered = True
    return self


def emit_nvtx_exit(self: Any, *exc: Any) -> bool:
    return False


#: torch.cuda's APIs that need CUDA's runtime: (modules, names, what they are, the fix)
class ProcessGroupNCCL:
    """``torch.distributed.ProcessGroupNCCL`` while the stand-in is on: its ``Options`` (and ``NCCLConfig``), which
    programs build for ``pg_options=`` (Megatron's ``get_nccl_options``, a high-priority stream) and a simulated
    "nccl" group takes and ignores, as its schedule has no streams to prioritise; a group built by hand from this
    class is refused, naming the fix (torch's CPU build has no NCCL to build one on)."""

    class NCCLConfig:
        """NCCL's communicator settings (CTA counts, cluster size, network): kept, without effect."""

        def __init__(self) -> None:
            self.blocking = 1
            self.cga_cluster_size = self.min_ctas = self.max_ctas = -1
            self.net_name = ""
            self.split_share = 0

    class Options:
        """The options a program passes as ``pg_options=`` for an "nccl" group: kept, without effect."""

        def __init__(self, is_high_priority_stream: bool = False) -> None:
            self.is_high_priority_stream = is_high_priority_stream
            self.config = ProcessGroupNCCL.NCCLConfig()
            self.split_from: Any = None
            self.split_color = 0
            self.global_ranks_in_group: list[int] = []
            self.group_name = ""
            self._timeout: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise StandInError(format_message(
            "torch.distributed.ProcessGroupNCCL", "a process group built from ProcessGroupNCCL directly needs NCCL, "
            "which the stand-in does not have", values={"args": len(args)},
            fix='create the group with torch.distributed.init_process_group("nccl") or new_group(backend="nccl") '
                "(pg_options=ProcessGroupNCCL.Options() is accepted)"))


CUDA_ONLY = (
    (("cuda",), ("current_blas_handle", "current_solver_handle"), "cuBLAS and cuSOLVER handles",
     "compute through torch's operators (torch.matmul, ...) when simulating, or run on real GPUs"),
    (("cuda", "cuda.memory"), ("caching_allocator_alloc", "caching_allocator_delete"),
     "raw blocks of CUDA's caching allocator", "allocate a tensor instead (torch.empty(n, dtype=torch.uint8, "
     "device='cuda')), or run on real GPUs"),
    (("cuda", "cuda.memory"), ("MemPool", "use_mem_pool"), "CUDA memory pools",
     "allocate from the default pool when simulating (leave out MemPool / use_mem_pool), or run on real GPUs"),
    (("cuda", "cuda.streams"), ("ExternalStream",), "streams created outside torch (a cudaStream_t)",
     "use torch.cuda.Stream() when simulating, or run on real GPUs"),
    (("cuda",), ("get_stream_from_external",), "streams created outside torch (a cudaStream_t)",
     "use torch.cuda.Stream() when simulating, or run on real GPUs"),
    (("cuda.jiterator",), ("_create_jit_fn", "_create_multi_output_jit_fn"),
     "jiterator kernels (CUDA C++ compiled at run time)",
     "compute the same with torch operators when simulating, or run on real GPUs"),
    (("cuda.nccl",), ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "unique_id", "init_rank"),
     "NCCL's single-process collectives (one process driving several GPUs)",
     "use torch.nn.parallel.comm (broadcast, reduce_add, scatter, gather) between one process's GPUs, or "
     "torch.distributed's collectives with one rank per GPU"),
    (("cuda.tunable",), tuple(n for n in torch.cuda.tunable.__all__ if n not in ("is_enabled", "enable")),
     "TunableOp (GEMM kernels tuned on the GPU)",
     "leave TunableOp off when simulating (it tunes speed, not results), or run on real GPUs"),
)


class LibraryChoice:
    """A GPU build's start-up knob the stand-in keeps and answers but that changes no result here (the CPU's
    kernels compute): the preferred linear-algebra or BLAS library, cuFFT's plan cache size."""

    def __init__(self, initial: Any) -> None:
        self.value = initial

    def set(self, value: Any, *_: Any) -> None:
        self.value = value

    def get(self, *_: Any) -> Any:
        return self.value


def cuda_library_table() -> list[tuple[Any, str, Any]]:
    """(owner, name, replacement) for the CUDA libraries' knobs (see :class:`LibraryChoice`)."""
    c = torch._C
    linalg, blas = LibraryChoice(c._LinalgBackend.Default), LibraryChoice(c._BlasBackend.Default)
    plans = LibraryChoice(4096)  # (cuFFT's default plan cache capacity; the stand-in caches no plans)
    # (torch.backends.cuda's plan cache properties hold torch's functions from its import: their slots are set)
    cache = vars(torch.backends.cuda.cuFFTPlanCache)
    return [(c, "_set_linalg_preferred_backend", linalg.set), (c, "_get_linalg_preferred_backend", linalg.get),
            (c, "_set_blas_preferred_backend", blas.set), (c, "_get_blas_preferred_backend", blas.get),
            (cache["max_size"], "getter", plans.get), (cache["max_size"], "setter", plans.set),
            (cache["size"], "getter", lambda device: 0), (torch, "_cufft_clear_plan_cache", lambda device: None)]


def tunable_enable(val: bool = True) -> None:
    """``torch.cuda.tunable.enable``: off is what the stand-in has (``is_enabled()`` answers False); on is refused."""
    if val:
        _refusal("torch.cuda.tunable.enable", "TunableOp (GEMM kernels tuned on the GPU)",
                 "leave TunableOp off when simulating (it tunes speed, not results), or run on real GPUs", False)()


def _refusal(call: str, what: str, fix: str, cls: bool) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise StandInError(format_message(call, f"the CPU stand-in has no CUDA runtime for {what}", fix=fix))

    name = call.rsplit(".", 1)[1]
    if cls:  # (a class stays a class: isinstance checks against it keep working)
        return type(name, (), {"__new__": lambda c, *a, **k: refuse(), "__doc__": f"Refused on stand-ins: {what}."})
    refuse.__name__ = name
    return refuse


def cuda_only_table() -> list[tuple[Any, str, Any]]:
    """(owner, name, refusal) for each name of :data:`CUDA_ONLY`, in each module that holds it."""
    out = []
    for modules, names, what, fix in CUDA_ONLY:
        for name in names:
            refusal = _refusal(f"torch.{modules[0]}.{name}", what, fix, name[0].isupper())
            out += [(sys.modules[f"torch.{m}"], name, refusal) for m in modules]
    return out
