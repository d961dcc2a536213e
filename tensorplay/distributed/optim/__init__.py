"""``DistributedOptimizer``: step parameters that live on several workers, from one place.

Each worker that owns some of the parameters gets a local optimizer (built
over RPC); ``step(context_id)`` asks every owner, in parallel, to take its
parameters' gradients from the distributed autograd context, put them in
``.grad`` and run its optimizer's ``step()``.  It works on both RPC
transports (its gradients come from :mod:`tensorplay.distributed.autograd`,
torch's engine on TensorPipe) and uses no TorchScript.

Example::

    opt = DistributedOptimizer(tp.optim.SGD, remote_linear.remote_parameters(), lr=0.05)
    with dist_autograd.context() as cid:
        loss = remote_linear(x).pow(2).sum()
        dist_autograd.backward(cid, [loss])
        opt.step(cid)
"""
from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Any, Sequence

import torch

from ..errors import DistTypeError, DistValueError, format_message
from ..rpc import api as rpc_api
from ..rpc.futures import wait_all
from ..rpc.rref import RRef

__all__ = ["DistributedOptimizer"]


class _LocalOptimizer:
    """Lives on a parameter owner: the optimizer over its parameters."""

    #: one for all of a worker's optimizers, as torch's: several trainers' DistributedOptimizers may hold the same
    #: parameters (data-parallel trainers of one parameter server), and a step sets each parameter's ``.grad``
    #: before it reads it, which another optimizer's step must not interleave with
    lock = threading.Lock()

    def __init__(self, optimizer_class: type, param_rrefs: list[RRef[Any]], args: tuple, kwargs: dict) -> None:
        self.params = [r.local_value() for r in param_rrefs]
        self.optim = optimizer_class(self.params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        from .. import autograd

        grads = autograd.get_gradients(context_id)
        # an engine whose backward passes accumulate through .grad (the simulator's) gives this step its turn there
        held = getattr(autograd._engine("DistributedOptimizer.step")[1], "grads_held", contextlib.nullcontext)
        with held(), _LocalOptimizer.lock:
            for p in self.params:
                # a parameter without a gradient in this context must not reuse an old .grad
                p.grad = grads.get(p)
            self.optim.step()


def _new_local_optimizer(optimizer_class: type, param_rrefs: list[RRef[Any]], args: tuple,
                         kwargs: dict) -> RRef[_LocalOptimizer]:
    return RRef(_LocalOptimizer(optimizer_class, param_rrefs, args, kwargs))


def _local_step(optim_rref: RRef[_LocalOptimizer], context_id: int) -> None:
    optim_rref.local_value().step(context_id)


class DistributedOptimizer:
    """An optimizer over parameters held by RRefs, possibly on many workers.

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` subclass, e.g. ``tp.optim.SGD``.
        params_rref: RRefs to the parameters (e.g. ``RemoteModule.remote_parameters()``).
        *args, **kwargs: the optimizer's arguments (``lr=...``).
    """

    def __init__(self, optimizer_class: type, params_rref: Sequence[RRef[Any]], *args: Any, **kwargs: Any) -> None:
        name = "optim.DistributedOptimizer"
        if not isinstance(optimizer_class, type) or not issubclass(optimizer_class, torch.optim.Optimizer):
            raise DistTypeError(format_message(
                name, "optimizer_class must be a torch.optim.Optimizer subclass",
                values={"optimizer_class": optimizer_class}, fix="pass e.g. tp.optim.SGD"))
        params_rref = list(params_rref)
        if not params_rref:
            raise DistValueError(format_message(name, "params_rref is empty", fix="pass rm.remote_parameters()"))
        for i, r in enumerate(params_rref):
            if not isinstance(r, RRef):
                raise DistTypeError(format_message(
                    name, "params_rref must hold tensorplay RRefs", values={"index": i, "type": type(r).__name__},
                    fix="use RemoteModule.remote_parameters() or tensorplay.distributed.rpc.RRef(param)"))
        by_owner: dict[Any, list[RRef[Any]]] = defaultdict(list)
        for r in params_rref:
            by_owner[r.owner()].append(r)
        futs = [rpc_api.rpc_async(owner, _new_local_optimizer, args=(optimizer_class, rrefs, args, kwargs))
                for owner, rrefs in by_owner.items()]
        self.remote_optimizers: list[RRef[_LocalOptimizer]] = wait_all(futs)

    def step(self, context_id: int) -> None:
        """Every owner applies the gradients of context ``context_id`` to its parameters (in parallel)."""
        futs = [rpc_api.rpc_async(o.owner(), _local_step, args=(o, context_id)) for o in self.remote_optimizers]
        wait_all(futs)
