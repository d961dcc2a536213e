"""What the CUDA stand-in refuses, with the fix: ``torch.compile`` on stand-in tensors; and NVTX as no-ops.

``torch.compile`` would trace stand-ins as ``privateuseone`` tensors and
generate kernels for a device that does not exist.  While the stand-in is
enabled, compiling a module that holds stand-in parameters or buffers fails at
once, and a compiled function fails on its first call with a stand-in argument;
anything else compiles as usual.  (CUDA graphs are refused in ``cuda_api``;
operators with GPU kernels only, such as custom CUDA extensions and Triton
kernels registered as operators, in ``tensor``.)
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from tensorplay.distributed.errors import format_message

from simulator.standin.errors import StandInError
from simulator.standin.tensor import StandInTensor

__all__ = ["compile_guard", "NvtxStub"]


def _refusal(what: str) -> StandInError:
    return StandInError(format_message(
        "torch.compile", f"cannot compile for the CPU stand-in of a CUDA device ({what})",
        fix="run the model eagerly when simulating (skip torch.compile, e.g. behind a flag), or run on real GPUs"))


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
    """``torch.compile`` that refuses stand-in modules and stand-in arguments (see the module docstring)."""

    @functools.wraps(original)
    def compile(model: Any = None, **kwargs: Any) -> Any:  # noqa: A001  (torch's name)
        if model is None:  # @torch.compile(mode=...) decorator form
            return lambda m: compile(m, **kwargs)
        if _holds_standin(model):
            raise _refusal(f"{type(model).__name__} has parameters or buffers on a stand-in device")
        compiled = original(model, **kwargs)
        if isinstance(compiled, torch.nn.Module):
            inner_forward = compiled.forward

            @functools.wraps(inner_forward)
            def forward(*args: Any, **kw: Any) -> Any:
                if _any_standin(args, kw) or _holds_standin(model):
                    raise _refusal("a stand-in tensor reached the compiled module")
                return inner_forward(*args, **kw)

            compiled.forward = forward
            return compiled

        @functools.wraps(model)
        def call(*args: Any, **kw: Any) -> Any:
            if _any_standin(args, kw):
                raise _refusal("a stand-in tensor was passed to the compiled function")
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
