"""Distributed autograd: gradients that flow back across RPCs, kept per *context*.

``torch.distributed.autograd``'s API on every RPC transport: each transport's
agent provides its engine (``agent.distributed_autograd()``): torch's own on
TensorPipe (:mod:`._torch`), the simulator's (``simulator.rpc.autograd``) on
the simulator.  Inside ``with
context() as cid:``, every tensor that requires grad and crosses an RPC is
recorded; ``backward(cid, roots)`` runs the backward pass from the roots on
this worker, sends gradients back along every recorded RPC, and each worker
accumulates the gradients of its leaf tensors *in the context* (``.grad`` is
left alone).  ``get_gradients(cid)`` returns this worker's part.

Example (worker0; the model's parameters live on worker1)::

    with dist_autograd.context() as cid:
        loss = remote_linear(x).sum()
        dist_autograd.backward(cid, [loss])
        opt.step(cid)                      # DistributedOptimizer: each owner steps its parameters
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import DistTypeError, DistValueError
from ..rpc import _agent
from ..rpc.errors import rpc_message

__all__ = ["context", "backward", "get_gradients"]


def _engine(call: str) -> tuple[_agent.Agent, Any]:
    a = _agent.require(f"autograd.{call}")
    return a, a.distributed_autograd()


class context:
    """``with context() as context_id:`` - a distributed autograd context on this worker."""

    def __init__(self) -> None:
        self._impl: Any = None

    def __enter__(self) -> int:
        self._impl = _engine("context")[1].context()
        return self._impl.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self._impl.__exit__(*exc)


def _check_roots(roots: Any, worker: str) -> list[torch.Tensor]:
    if isinstance(roots, torch.Tensor):
        roots = [roots]
    if not isinstance(roots, (list, tuple)) or not roots:
        raise DistTypeError(rpc_message("autograd.backward", "roots must be a non-empty list of tensors",
                                        worker=worker, values={"roots": type(roots).__name__},
                                        fix="pass [loss]"))
    for i, r in enumerate(roots):
        if not isinstance(r, torch.Tensor):
            raise DistTypeError(rpc_message("autograd.backward", "every root must be a tensor", worker=worker,
                                            values={"index": i, "type": type(r).__name__}, fix="pass [loss]"))
        if r.numel() != 1:
            raise DistValueError(rpc_message("autograd.backward", "every root must be a scalar", worker=worker,
                                             values={"index": i, "shape": tuple(r.shape)},
                                             fix="reduce it first, e.g. [out.sum()]"))
        if not r.requires_grad:
            raise DistValueError(rpc_message(
                "autograd.backward", "a root does not require grad (nothing to differentiate)", worker=worker,
                values={"index": i}, fix="compute the root from tensors with requires_grad=True"))
    return list(roots)


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass from ``roots`` (scalars) in context ``context_id``."""
    a, engine = _engine("backward")
    engine.backward(context_id, _check_roots(roots, a.name), retain_graph)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """This worker's gradients in context ``context_id``: ``{leaf tensor: gradient}``."""
    return _engine("get_gradients")[1].get_gradients(context_id)
