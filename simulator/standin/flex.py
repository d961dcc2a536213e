"""``flex_attention`` on stand-ins: torch's own implementation, run on the CPU, forward and backward.

``torch.nn.attention.flex_attention`` calls the ``flex_attention`` higher-order operator, whose autograd rule
traces the score function into forward and backward graphs on tensors like the query, and whose kernels are
registered per dispatch key (Triton on a GPU, a dense composite otherwise).  On stand-ins neither part works as
it is: a higher-order operator has no rule for the stand-in subclass, and tracing on stand-ins reaches the
autograd engine's stream checks for a device with no streams.  So, while a stand-in is enabled, the operator's
autograd rule moves stand-in inputs to the CPU (a copy autograd follows back), runs the original rule there
(the dense composite computes what the GPU's kernel computes, rounded as the CPU rounds), and moves the
results back to the query's device.  The backward, which torch refuses for CPU tensors in its Python front
door, runs too: it is the same dense backward a GPU without Triton would run.

Example (on a stand-in GPU; ``causal`` is a ``create_block_mask`` of ``q_idx >= kv_idx``)::

    out = flex_attention(q.cuda(), k.cuda(), v.cuda(), block_mask=causal)  # a stand-in on cuda:0
    out.sum().backward()                                                    # q.grad etc., as on a GPU
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch._C import DispatchKey

from simulator.standin.tensor import StandInTensor

__all__ = ["ON_IMPORT"]


def _cpu(x: Any) -> Any:
    return x.cpu() if isinstance(x, StandInTensor) else x


def _on_the_cpu(rule: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(rule)
    def autograd_rule(query: Any, key: Any, value: Any, score_mod: Any, block_mask: tuple, scale: Any,
                      kernel_options: Any, score_mod_other_buffers: tuple = (),
                      mask_mod_other_buffers: tuple = ()) -> Any:
        if not isinstance(query, StandInTensor):
            return rule(query, key, value, score_mod, block_mask, scale, kernel_options, score_mod_other_buffers,
                        mask_mod_other_buffers)
        out = rule(_cpu(query), _cpu(key), _cpu(value), score_mod, tuple(_cpu(b) for b in block_mask), scale,
                   kernel_options, tuple(map(_cpu, score_mod_other_buffers)), tuple(map(_cpu, mask_mod_other_buffers)))
        return tuple(o.to(query.device) if isinstance(o, torch.Tensor) else o for o in out)

    return autograd_rule


def _flex_on_the_cpu(module: Any) -> Callable[[], None]:
    """Replace the autograd rule of ``flex_attention`` (module: ``torch._higher_order_ops.flex_attention``);
    returns the undo."""
    hop = module.flex_attention
    before = hop.py_kernels[DispatchKey.Autograd]
    hop.py_kernels[DispatchKey.Autograd] = _on_the_cpu(before)
    hop._dispatch_cache.clear()  # (the operator caches the kernel it found for each key)

    def undo() -> None:
        hop.py_kernels[DispatchKey.Autograd] = before
        hop._dispatch_cache.clear()

    return undo


#: (module, patch) pairs, applied when the module is imported while the stand-in is enabled
ON_IMPORT = (("torch._higher_order_ops.flex_attention", _flex_on_the_cpu),)
