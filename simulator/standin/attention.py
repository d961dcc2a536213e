"""``scaled_dot_product_attention`` on stand-ins takes a GPU's path: CUDA's fused kernels, computed on the CPU.

On a GPU, ``F.scaled_dot_product_attention`` picks a fused kernel (flash attention for fp16/bf16,
memory-efficient attention otherwise) and calls ``aten::_scaled_dot_product_flash_attention`` or
``aten::_scaled_dot_product_efficient_attention``, whose backward is its own operator.  Programs and
libraries depend on that path: DTensor shards attention by heads through the sharding rules of exactly
these operators (tensor parallel Llama: ``PrepareModuleInput`` then SDPA on DTensors) and has none for the
CPU's ``_scaled_dot_product_flash_attention_for_cpu``, and the math fallback mixes a plain mask tensor with
DTensors.  A stand-in is a ``privateuseone`` tensor to torch's C++ side, for which SDPA would take the
math fallback; so the stand-in registers the choice for ``AutogradPrivateUse1``:

* flash when the inputs are fp16/bf16, there is no mask, no dropout and the head size is at most 256
  and a multiple of 8 (and ``torch.backends.cuda.flash_sdp_enabled()``), grouped-query inputs too;
* memory-efficient when the head size is a multiple of 8 (4 for float32), the heads are not grouped and the mask
  does not require grad (and ``mem_efficient_sdp_enabled()``), with dropout too (flash takes dropout on a GPU as well; here the
  memory-efficient operator takes it, whose DTensor rule is the same, also when flash is the only kernel enabled);
* the math composite otherwise (dropout draws from the device's generator there).

The fused operators then run the CPU's fused kernel (``_scaled_dot_product_flash_attention_for_cpu``
and its backward) on the data inside the stand-ins, returning what the CUDA kernels return (shapes as
torch's meta kernels give them; ``philox_seed``/``philox_offset`` as CPU scalars, as CUDA returns them
outside graph capture).  The CPU kernels round differently from the GPU's (see docs/deviations.md).  The CPU's
kernel refuses dropout: with dropout, memory-efficient attention is computed here in float32, its keep-mask drawn
at the device generator's ``(seed, offset)``, which go back as the philox tensors, so that the backward draws the
same mask (as CUDA's kernel regenerates its own); the generator's offset advances by the mask's size.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from simulator.standin.ranks import state
from simulator.standin.rng import _MASK, _mix, advance, generator
from simulator.standin.tensor import _SAME_DEVICE, _SPECIAL, StandInTensor, fresh

__all__ = ["register", "choose"]


def choose(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any, dropout_p: float,
           enable_gqa: bool) -> str:
    """The kernel CUDA's SDPA would pick for these inputs: "flash", "efficient" or "math"."""
    d = query.size(-1)
    dense = query.dim() == 4 and key.dim() == 4 and value.dim() == 4 and value.size(-1) == d
    # grouped-query attention (fewer key/value heads, enable_gqa=True): flash takes it on CUDA, memory-efficient
    # attention does not (sdp_utils' num-heads check for each)
    grouped = dense and enable_gqa and key.size(1) == value.size(1) and query.size(1) % key.size(1) == 0
    plain = dense and key.size(1) == query.size(1) and value.size(1) == query.size(1) and not enable_gqa
    flash = (plain or grouped) and attn_mask is None and query.dtype in (torch.float16, torch.bfloat16) \
        and d <= 256 and d % 8 == 0 and torch.backends.cuda.flash_sdp_enabled()
    if flash and dropout_p == 0.0:
        return "flash"
    align = 4 if query.dtype == torch.float32 else 8
    # (flash with dropout, even as the only kernel enabled: computed by the memory-efficient operator here)
    if plain and d % align == 0 and query.dtype in (torch.float16, torch.bfloat16, torch.float32) \
            and (attn_mask is None or not attn_mask.requires_grad) \
            and (flash or torch.backends.cuda.mem_efficient_sdp_enabled()):
        return "efficient"
    if not (torch.backends.cuda.math_sdp_enabled() or torch.backends.cuda.cudnn_sdp_enabled()):
        # (sdpa_kernel(SDPBackend.FLASH_ATTENTION) with inputs flash cannot take: fp32, a mask, ...)
        raise RuntimeError("No available kernel. Aborting execution.")
    return "math"


def _sdpa(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0, is_causal: bool = False,
          *, scale: Any = None, enable_gqa: bool = False) -> torch.Tensor:
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # as torch's front end does before it picks a kernel: True keeps a score (adds 0), False masks it (-inf);
        # every kernel below adds the mask to the scores
        attn_mask = torch.where(attn_mask, 0.0, torch.full((), -math.inf, dtype=query.dtype,
                                                            device=attn_mask.device))
    kind = choose(query, key, value, attn_mask, dropout_p, enable_gqa)
    aten = torch.ops.aten
    if kind == "flash":
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    if kind == "efficient":
        grads = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, grads, dropout_p, is_causal,
                                                            scale=scale)[0]
    return aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal, None,
                                                   scale=scale, enable_gqa=enable_gqa)[0]


def _bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    params = func._schema.arguments
    vals = {a.name: a.default_value for a in params if a.has_default_value()}
    vals.update(zip((a.name for a in params), args))
    vals.update(kwargs)
    return vals


def _inners(func: Any, tensors: list[Any]) -> tuple[int, list[Any]]:
    """The stand-ins' CPU tensors and their device (CUDA's rule: one device)."""
    idx = None
    out = []
    for t in tensors:
        if isinstance(t, StandInTensor):
            if idx is None:
                idx = t._idx
            elif t._idx != idx:
                raise RuntimeError(_SAME_DEVICE.format(f"cuda:{idx}", f"cuda:{t._idx}"))
            out.append(t._inner)
        elif isinstance(t, torch.Tensor) and t.dim() > 0:
            raise RuntimeError(_SAME_DEVICE.format(f"cuda:{idx if idx is not None else 0}", t.device))
        else:
            out.append(t)
    assert idx is not None, func  # reached through a stand-in's dispatch: at least one stand-in
    return idx, out


def _scalar(dtype: torch.dtype, shape: tuple = ()) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def _flash(func: Any, args: tuple, kwargs: dict) -> Any:
    a = _bind(func, args, kwargs)
    idx, (q, k, v) = _inners(func, [a["query"], a["key"], a["value"]])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, a["dropout_p"], a["is_causal"], attn_mask=None, scale=a["scale"])
    debug = torch.empty(0, dtype=q.dtype)
    return (fresh(out, idx), fresh(lse, idx), None, None, q.size(2), k.size(2), _scalar(torch.uint64, (2,)),
            _scalar(torch.uint64), fresh(debug, idx))


def _flash_backward(func: Any, args: tuple, kwargs: dict) -> Any:
    a = _bind(func, args, kwargs)
    idx, (g, q, k, v, o, lse) = _inners(func, [a[n] for n in ("grad_out", "query", "key", "value", "out",
                                                              "logsumexp")])
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, o, lse, a["dropout_p"], a["is_causal"], attn_mask=None, scale=a["scale"])
    return tuple(fresh(t, idx) for t in grads)


def _dropout_mask(shape: tuple, p: float, seed: int, offset: int) -> torch.Tensor:
    """The keep-mask of attention dropout drawn at the device generator's ``(seed, offset)``: the forward and the
    backward draw the same one (CUDA's kernels regenerate theirs from the Philox seed and offset they return)."""
    gen = torch.Generator().manual_seed(_mix(seed, offset))
    return torch.rand(shape, generator=gen) >= p


def _probs(q: torch.Tensor, k: torch.Tensor, bias: Any, causal: bool, scale: Any
           ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``P = softmax(q kᵀ · scale + bias, causal)`` in float32, the rows' logsumexp, and the scale."""
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = q.float() @ k.float().transpose(-2, -1) * scale
    if bias is not None:
        scores = scores + bias.float()
    if causal:  # (top-left aligned, as CUDA's is_causal)
        scores = scores.masked_fill(torch.ones(q.size(-2), k.size(-2), dtype=torch.bool).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores - lse.unsqueeze(-1)).exp(), lse, scale


def _attention_with_dropout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Any, causal: bool,
                            scale: Any, keep: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``O = (P ⊙ keep / (1 - p)) v`` and the rows' logsumexp, in float32 (the CPU's fused kernel refuses
    dropout)."""
    probs, lse, _ = _probs(q, k, bias, causal, scale)
    return ((probs * keep / (1.0 - p)) @ v.float()).to(q.dtype), lse


def _attention_with_dropout_backward(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Any,
                                     causal: bool, scale: Any, keep: torch.Tensor, p: float
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The adjoint of :func:`_attention_with_dropout`, with ``D = keep / (1 - p)``: ``dV = (P ⊙ D)ᵀ dO``,
    ``dP = (dO Vᵀ) ⊙ D``, ``dS = P ⊙ (dP - rowsum(dP ⊙ P))``, ``dQ = dS K · scale``, ``dK = dSᵀ Q · scale``."""
    probs, _, scale = _probs(q, k, bias, causal, scale)
    drop = keep / (1.0 - p)
    gf = g.float()
    dv = (probs * drop).transpose(-2, -1) @ gf
    dp = (gf @ v.float().transpose(-2, -1)) * drop
    ds = probs * (dp - (dp * probs).sum(-1, keepdim=True))
    dq = ds @ k.float() * scale
    dk = ds.transpose(-2, -1) @ q.float() * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _efficient(func: Any, args: tuple, kwargs: dict) -> Any:
    a = _bind(func, args, kwargs)
    idx, (q, k, v, bias) = _inners(func, [a["query"], a["key"], a["value"], a["attn_bias"]])
    p = a["dropout_p"]
    seed = offset = 0
    if p > 0.0:  # a draw of the device's generator: the mask's (seed, offset) go back as CUDA's philox tensors
        g = generator(state(), idx)
        seed, offset = g[0], g[1]
        shape = (*q.shape[:-1], k.size(-2))
        advance(g, math.prod(shape))
        out, lse = _attention_with_dropout(q, k, v, bias, a["is_causal"], a["scale"],
                                           _dropout_mask(shape, p, seed, offset), p)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, p, a["is_causal"], attn_mask=bias, scale=a["scale"])
    length = q.size(2)
    if a["compute_log_sumexp"]:  # CUDA's kernel pads the row to a multiple of 32 (see the meta kernel)
        lse = torch.nn.functional.pad(lse, (0, math.ceil(length / 32) * 32 - length), value=float("inf"))
    else:
        lse = lse.new_empty((lse.size(0), lse.size(1), 0))
    return (fresh(out, idx), fresh(lse, idx), torch.tensor(_signed(seed), dtype=torch.int64),
            torch.tensor(_signed(offset), dtype=torch.int64))


def _efficient_backward(func: Any, args: tuple, kwargs: dict) -> Any:
    a = _bind(func, args, kwargs)
    names = ("grad_out_", "query", "key", "value", "attn_bias", "out", "logsumexp")
    idx, (g, q, k, v, bias, o, lse) = _inners(func, [a[n] for n in names])
    p = a["dropout_p"]
    if p > 0.0:  # the forward's mask again, from the seed and offset it returned
        seed, offset = (int(t) & _MASK for t in (a["philox_seed"], a["philox_offset"]))
        keep = _dropout_mask((*q.shape[:-1], k.size(-2)), p, seed, offset)
        gq, gk, gv = _attention_with_dropout_backward(g, q, k, v, bias, a["is_causal"], a["scale"], keep, p)
        return fresh(gq, idx), fresh(gk, idx), fresh(gv, idx), None
    gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        g, q, k, v, o, lse[..., :q.size(2)].contiguous(), a["dropout_p"], a["is_causal"], attn_mask=bias,
        scale=a["scale"])
    return fresh(gq, idx), fresh(gk, idx), fresh(gv, idx), None


_SPECIAL.update({
    "_scaled_dot_product_flash_attention": _flash, "_scaled_dot_product_flash_attention_backward": _flash_backward,
    "_scaled_dot_product_efficient_attention": _efficient,
    "_scaled_dot_product_efficient_attention_backward": _efficient_backward,
})


def register() -> list[Any]:
    """SDPA's choice for stand-ins, registered for ``AutogradPrivateUse1`` (kept for the process's life; a stand-in
    exists only while one is enabled)."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("scaled_dot_product_attention", _sdpa, "AutogradPrivateUse1")
    return [lib]
