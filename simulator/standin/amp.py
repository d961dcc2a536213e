"""``torch.autocast("cuda")`` for stand-in tensors: CUDA's casting rules, computed in bf16/fp16 on the CPU.

torch casts at the ``Autocast<device>`` dispatch key of a tensor's device.
Stand-ins are ``privateuseone`` tensors to torch's C++ side, and torch registers
no autocast kernels for that key, so this module registers Python ones for
CUDA's operator lists (``aten/src/ATen/autocast_mode.cpp``): matmuls,
convolutions, ``linear`` and attention run in the autocast dtype; the
precision-sensitive operators (``exp``, ``log``, ``softmax``, norms, losses,
``sum``...) in float32; mixed-dtype ones (``addcmul``, ``dot``...) in the widest
input type.  Every other operator falls through.  While
``torch.autocast("cuda")`` is active, :func:`mirror` turns the ``privateuseone``
autocast state on with the same dtype.

Not imitated: the cast cache (a weight used twice in one region is cast twice,
with the same result).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["LOWER", "FP32", "PROMOTE", "BANNED", "register", "mirror_enabled", "mirror_dtype"]

#: CUDA's lower-precision list: computed in the autocast dtype
LOWER = ("_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
         "conv_transpose3d", "convolution", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
         "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
         "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
         "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention")
#: CUDA's float32 lists (``fp32`` and ``fp32_set_opt_dtype``)
FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm",
        "nuclear_norm", "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss",
        "nll_loss2d", "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
        "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d", "prod", "softmax", "log_softmax",
        "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm", "sum")
#: CUDA's promote list: computed in the widest floating input type
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
           "tensordot", "scatter_add")

#: CUDA's banned list: refused under autocast, since a sigmoid's fp16 output saturates before the log
BANNED = ("binary_cross_entropy",)
#: CUDA's message for them (autocast_mode.cpp), whose words programs and tests look for
_BANNED_MESSAGE = ("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
                   "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
                   "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
                   "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
                   "safe to autocast.")

_KEY = "AutocastPrivateUse1"
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)


def _eligible(t: Any) -> bool:
    # CUDA casts floating tensors of its own device, never float64 (is_eligible in autocast_mode.h)
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not torch.float64 \
        and t.device.type == "cuda"


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if _eligible(x) and x.dtype is not dtype:
        return x.to(dtype)
    if type(x) in (list, tuple):
        return type(x)(_cast(v, dtype) for v in x)
    return x


def _widest(args: tuple, kwargs: dict) -> torch.dtype | None:
    found = None
    for x in (*args, *kwargs.values()):
        for t in (x if type(x) in (list, tuple) else (x,)):
            if _eligible(t):
                found = t.dtype if found is None else torch.promote_types(found, t.dtype)
    return found


def _kernel(op: Any, rule: str) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if rule == "banned":
            raise RuntimeError(_BANNED_MESSAGE)
        dtype = torch.float32 if rule == "fp32" else \
            _widest(args, kwargs) if rule == "promote" else torch.get_autocast_dtype("cuda")
        if dtype is not None:
            args = tuple(_cast(a, dtype) for a in args)
            kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*args, **kwargs)

    return run


def register() -> list[torch.library.Library]:
    """Register the autocast kernels for the ``privateuseone`` key; returns the libraries that hold them."""
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(torch.library.fallthrough_kernel, _KEY)
    lib = torch.library.Library("aten", "IMPL")
    for rule, names in (("lower", LOWER), ("fp32", FP32), ("promote", PROMOTE), ("banned", BANNED)):
        for name in names:
            packet = getattr(torch.ops.aten, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                schema = op._schema
                if schema.is_mutable or overload.endswith("out") or not any(
                        "Tensor" in str(a.type) for a in schema.arguments):
                    continue
                lib.impl(op, _kernel(op, rule), _KEY)
    return [fallback, lib]


def mirror_enabled(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.set_autocast_enabled`` that also switches the stand-ins' (``privateuseone``) autocast with cuda's."""
    def set_autocast_enabled(*args: Any) -> None:
        original(*args)
        device, enabled = ("cuda", args[0]) if len(args) == 1 else args
        if device == "cuda":
            original("privateuseone", enabled)

    return set_autocast_enabled


def mirror_dtype(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.set_autocast_dtype`` that also sets the stand-ins' autocast dtype with cuda's."""
    def set_autocast_dtype(device: str, dtype: torch.dtype) -> None:
        original(device, dtype)
        if device == "cuda":
            original("privateuseone", dtype)

    return set_autocast_dtype
