"""``torch.compile`` on the CUDA stand-in runs eagerly; NVTX ranges are no-ops.

``torch.compile`` would trace stand-ins as ``privateuseone`` tensors and generate kernels for a device that does
not exist.  Compiling is an optimisation whose results are the eager model's (to rounding), and GPU-written
scripts compile by default (nanoGPT's ``compile = True``), so while the stand-in is enabled a module that holds
stand-in parameters or buffers "compiles" to torch's own ``OptimizedModule`` with dynamo disabled (so
``_orig_mod``, its ``state_dict`` keys and ``DDP`` around it are as after a real compile) and runs eagerly; a
compiled module or function called with stand-ins runs its original eagerly.  The first time, a warning says
so.  Anything else compiles as usual.  (CUDA graphs are refused in ``cuda_api``; operators with GPU kernels
only, such as custom CUDA extensions and Triton kernels registered as operators, in ``tensor``.)
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch

from tensorplay.distributed.errors import format_message

from simulator.standin.tensor import StandInTensor

__all__ = ["compile_guard", "NvtxStub"]


_warned: list[bool] = [False]


def _eagerly(what: str) -> None:
    """Say once per process that compiled code runs eagerly on stand-ins."""
    if not _warned[0]:
        _warned[0] = True
        warnings.warn(format_message(
            "torch.compile", f"the CUDA stand-in runs compiled code eagerly ({what}); results are the eager "
            "model's, to rounding, and no kernels are generated", fix="nothing to do to simulate; on real GPUs the "
            "same program compiles"), RuntimeWarning, stacklevel=3)


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
            if _any_standin(args, kw):
                _eagerly("a stand-in tensor was passed to the compiled function")
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
