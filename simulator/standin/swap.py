"""Moving a module's parameters onto stand-ins: ``Module.to`` swaps a wrapper-subclass parameter with its moved
value (``torch.utils.swap_tensors``), where a GPU run assigns ``param.data``; the swap is made to keep what that
assignment keeps (see :func:`swap_unless_same` and :class:`SwapWeakrefs`)."""
from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Callable

import torch

from simulator.standin.tensor import StandInTensor

__all__ = ["same_standin", "swap_unless_same", "set_like_a_gpu", "SwapWeakrefs", "SWAP_WEAKREFS"]


def same_standin(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two stand-ins are one device tensor: the same data, device, layout and dtype."""
    if not (isinstance(a, StandInTensor) and isinstance(b, StandInTensor)) or a._idx != b._idx:
        return False
    x, y = a._inner, b._inner
    return x is y or (x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() and x.dtype == y.dtype
                      and x.storage_offset() == y.storage_offset() and x.shape == y.shape
                      and x.stride() == y.stride())


def swap_unless_same(original: Callable[..., None]) -> Callable[..., None]:
    """``Module.to``/``.cuda()`` swaps every wrapper-subclass parameter with its moved value, even one already on
    its device, and torch's swap refuses a parameter that other tensors still reference (FSDP1's flat parameter
    and its views: ``FSDP(model).cuda()``). On a GPU the move assigns ``.data``, a no-op when nothing moved:
    so is the swap of a stand-in with an alias of itself."""

    @functools.wraps(original)
    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if same_standin(t1, t2) and t1.requires_grad == t2.requires_grad:
            return
        if isinstance(t2, StandInTensor) and not isinstance(t1, StandInTensor):  # a CPU tensor moved to the device
            SWAP_WEAKREFS.moving.t = t1
            try:
                original(t1, t2)
            finally:
                SWAP_WEAKREFS.moving.t = None
            return
        original(t1, t2)

    return swap_tensors


def set_like_a_gpu(original: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``torch.nn.utils.parametrize._maybe_set``: removing a parametrization writes the result into the original
    parameter, by ``set_`` on a GPU and by a swap for a wrapper subclass, which torch refuses while anything else
    holds the parameter (DDP's reducer, an optimizer).  A stand-in takes the GPU's ``set_``: it keeps its identity
    and follows the new data (see ``simulator.standin.tensor._follow``)."""

    @functools.wraps(original)
    def _maybe_set(dest: torch.Tensor, src: torch.Tensor) -> None:
        if isinstance(dest, StandInTensor) and isinstance(src, StandInTensor) \
                and not torch.__future__.get_swap_module_params_on_conversion():
            dest.set_(src)
            return
        original(dest, src)

    return _maybe_set


class SwapWeakrefs:
    """``torch.utils``' view of the weakref module, whose only use there is ``swap_tensors``' refusal of a tensor
    that has weakrefs.  A CPU parameter moved onto a stand-in keeps its identity, as a GPU's ``param.data = ...``
    keeps it (pipelining's tracer and ``torch.export`` hold weakrefs to parameters before ``build_stage`` moves
    them): its weakrefs stay valid, now to the device tensor, and are not in the way of that swap."""

    def __init__(self) -> None:
        self.moving = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(weakref, name)

    def getweakrefs(self, obj: Any) -> list:
        return [] if getattr(self.moving, "t", None) is obj else weakref.getweakrefs(obj)


SWAP_WEAKREFS = SwapWeakrefs()
