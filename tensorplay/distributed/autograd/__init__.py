"""Distributed autograd: gradients that flow back across RPCs, kept per *context*.

``torch.distributed.autograd``'s API on both RPC transports: torch's engine on
TensorPipe, our own (:mod:`._sim`) on the simulator.  Inside ``with
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

import contextlib
from typing import Any, Iterator, Sequence

import torch

from ..errors import DistTypeError, DistValueError
from ..rpc import _agent
from ..rpc.errors import rpc_message

__all__ = ["context", "backward", "get_gradients"]


def _agent_for(call: str) -> _agent.Agent:
    return _agent.require(f"autograd.{call}")


class context:
    """``with context() as context_id:`` - a distributed autograd context on this worker."""

    def __init__(self) -> None:
        self._impl: Any = None

    def __enter__(self) -> int:
        a = _agent_for("context")
        if a.kind == "sim":
            from . import _sim

            self._impl = _sim.context()
        else:
            import torch.distributed.autograd as tda

            self._impl = tda.context()
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


@contextlib.contextmanager
def _torch_context(call: str, worker: str, context_id: int) -> Iterator[None]:
    """torch's "Could not find autograd context" as our DistValueError naming the call, worker and context."""
    try:
        yield
    except RuntimeError as e:
        if "Could not find autograd context" in str(e):
            raise DistValueError(rpc_message(
                call, "no such autograd context on this worker", worker=worker,
                values={"context_id": context_id}, fix="call it inside `with context() as context_id:`")) from e
        raise


def backward(context_id: int, roots: Sequence[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the distributed backward pass from ``roots`` (scalars) in context ``context_id``."""
    a = _agent_for("backward")
    roots = _check_roots(roots, a.name)
    if a.kind == "sim":
        from . import _sim

        _sim.backward(context_id, roots, retain_graph)
    else:
        import torch.distributed.autograd as tda

        with _torch_context("autograd.backward", a.name, context_id):
            tda.backward(context_id, roots, retain_graph)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """This worker's gradients in context ``context_id``: ``{leaf tensor: gradient}``."""
    a = _agent_for("get_gradients")
    if a.kind == "sim":
        from . import _sim

        return _sim.get_gradients(context_id)
    import torch.distributed.autograd as tda

    with _torch_context("autograd.get_gradients", a.name, context_id):
        return tda.get_gradients(context_id)
