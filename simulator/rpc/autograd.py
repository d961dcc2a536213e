"""Distributed autograd on the simulator's RPC transport (what ``SimAgent.distributed_autograd()`` returns).

It belongs to the transport (:mod:`simulator.rpc.codec` calls :func:`on_send` /
:func:`on_recv` while it serialises a message, :mod:`simulator.rpc.agent`
:func:`set_context_id` on a handler thread) and uses only the simulated agents' own fields
(``autograd``, ``context_ids``, ``rank``, ``world.by_rank``), never the run's
state.

Bookkeeping, per worker and context:

* ``sends[send_id]`` - a tensor (with its graph) this worker put in a message;
* ``recvs[id(leaf)]`` - the fresh leaf a receiver made of it, and who sent it;
* ``grads[leaf]`` - gradients accumulated for this worker's own leaves.

The backward pass from some roots on worker W finds every leaf reachable from
them, computes their gradients through their accumulators (so DDP's hooks run), accumulates those
of W's own leaves, and sends those of received leaves back to their sender
(an RPC through the same transport, so gradients also cross by value), where
the same step continues from the recorded send.  Backpropagation is linear in
the incoming gradient, so handling each arriving gradient on its own gives
the same sums as one pass would (torch's "FAST mode" does the same); graphs
are kept (``retain_graph=True``) until the context ends, since one recorded
send can receive several gradients.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import sys
import threading
from typing import Any, ContextManager, Iterator

import torch

from tensorplay.distributed.errors import DistRuntimeError, DistValueError
from tensorplay.distributed.rpc import transport as rpc_transport
from tensorplay.distributed.rpc.errors import rpc_message
from tensorplay.distributed.rpc.futures import Future

__all__ = ["context", "backward", "get_gradients", "grads_held", "on_send", "on_recv", "current_context_id",
           "set_context_id"]

_tl = threading.local()


class _Ctx:
    __slots__ = ("cid", "grads", "sends", "recvs", "next_send", "freed")

    def __init__(self, cid: int) -> None:
        self.cid = cid
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        self.sends: dict[int, torch.Tensor] = {}
        self.recvs: dict[int, tuple[torch.Tensor, str, int]] = {}
        self.next_send = itertools.count(1)
        #: the roots' graph nodes of the backward passes made without ``retain_graph``: torch frees those graphs
        #: (this module keeps them, see above), so a second pass from one of them fails as it does in torch
        self.freed: list[Any] = []


def current_context_id() -> int | None:
    """The distributed-autograd context of the calling thread, if any."""
    return getattr(_tl, "cid", None)


def set_context_id(cid: int | None) -> None:
    """Give the calling thread (a handler serving a call) the caller's context, or none."""
    _tl.cid = cid


def _sim_agent(call: str) -> Any:
    a = rpc_transport.require(f"autograd.{call}")
    if a.distributed_autograd() is not sys.modules[__name__]:  # pragma: no cover  dispatched by the caller
        raise DistRuntimeError(rpc_message(f"autograd.{call}", "not a simulated worker", worker=a.name))
    return a


def _ctx(agent: Any, cid: int, create: bool, call: str) -> _Ctx:
    ctx = agent.autograd.get(cid)
    if ctx is None:
        if not create:
            raise DistValueError(rpc_message(
                f"autograd.{call}", "no such autograd context on this worker", worker=agent.name,
                values={"context_id": cid}, fix="call it inside `with context() as context_id:`"))
        ctx = agent.autograd[cid] = _Ctx(cid)
    return ctx


class context:
    def __enter__(self) -> int:
        a = _sim_agent("context")
        if current_context_id() is not None:
            raise DistRuntimeError(rpc_message(
                "autograd.context", "this thread already has an autograd context (contexts do not nest)",
                worker=a.name, values={"context_id": current_context_id()}, fix="leave the outer context first"))
        cid = (a.rank << 48) | next(a.context_ids)  # like torch: the worker id in the high bits
        _ctx(a, cid, True, "context")
        _tl.cid = cid
        self.cid, self.world = cid, a.world
        return cid

    def __exit__(self, *exc: Any) -> None:
        _tl.cid = None
        end = getattr(self.world, "end_context", None)  # (a rank process's world tells the other processes)
        if end is not None:
            end(self.cid)
            return
        for peer in list(self.world.by_rank.values()):  # the context ends on every worker it reached
            peer.autograd.pop(self.cid, None)


# -- transport hooks ----------------------------------------------------------
def on_send(t: torch.Tensor) -> int | None:
    """A tensor that requires grad is being put in a message: record it; ``None`` outside a context."""
    cid = current_context_id()
    if cid is None:
        return None
    a = rpc_transport.current()
    ctx = _ctx(a, cid, True, "send")
    sid = next(ctx.next_send)
    ctx.sends[sid] = t
    return sid


def on_recv(leaf: torch.Tensor, sender: str, sid: int) -> None:
    """A recorded tensor arrived as ``leaf``: remember where its gradient must go."""
    cid = current_context_id()
    if cid is None:  # pragma: no cover  sends are only recorded inside a context
        return
    a = rpc_transport.current()
    _ctx(a, cid, True, "recv").recvs[id(leaf)] = (leaf, sender, sid)


# -- the backward pass -----------------------------------------------------------
def _leaves(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    seen_t: set[int] = set()
    seen_fn: set[int] = set()
    stack = []
    for r in roots:
        if r.grad_fn is None:
            if r.requires_grad and id(r) not in seen_t:
                seen_t.add(id(r))
                out.append(r)
        else:
            stack.append(r.grad_fn)
    while stack:
        fn = stack.pop()
        if id(fn) in seen_fn:
            continue
        seen_fn.add(id(fn))
        var = getattr(fn, "variable", None)
        if var is not None:
            if id(var) not in seen_t:
                seen_t.add(id(var))
                out.append(var)
            continue
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                stack.append(nxt)
    return out


class _Turns:
    """One backward pass at a time on a worker (see :func:`_through_accumulators`); a wait for the turn is a wait
    on a future, which the scheduler sees (in coop mode the holder may be in a collective of DDP's)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.busy = False
        self.queue: collections.deque[Future[None]] = collections.deque()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self.lock:
            turn = None
            if self.busy:
                turn = Future(what="distributed autograd's turn on this worker")
                self.queue.append(turn)
            self.busy = True
        if turn is not None:
            turn.wait()
        try:
            yield
        finally:
            with self.lock:
                if self.queue:
                    self.queue.popleft().set_result(None)
                else:
                    self.busy = False


def _turns(agent: Any) -> _Turns:
    turns = getattr(agent, "backward_turns", None)
    if turns is None:
        turns = agent.backward_turns = _Turns()
    return turns


def grads_held() -> ContextManager[None]:
    """The calling worker's turn at its tensors' ``.grad``: a DistributedOptimizer's step, which sets each
    parameter's ``.grad`` and reads it, runs in it, so that no backward pass here (which accumulates through
    ``.grad``, see :func:`_through_accumulators`) adds to the gradient it set before its optimizer reads it."""
    return _turns(_sim_agent("DistributedOptimizer.step")).held()


def _through_accumulators(agent: Any, roots: list[torch.Tensor], leaves: list[torch.Tensor],
                          grads: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """The gradients of ``leaves`` from ``roots``, computed as torch's distributed engine does: through each leaf's
    gradient accumulator, so the hooks there run (DDP's reducer all-reduces in them and writes the averaged
    gradient, which is what the context then holds), while ``.grad`` ends as it was (the context has them).

    ``.grad`` is the one place hooks write to, so a worker runs one pass at a time (two contexts' passes over the
    parameter server's table would mix their gradients).
    """
    with _turns(agent).held():
        saved = [leaf.grad for leaf in leaves]
        try:
            for leaf in leaves:
                leaf.grad = None
            torch.autograd.backward(roots, grads, retain_graph=True, inputs=leaves)
            # a gradient that is a view (DDP's gradient_as_bucket_view) is overwritten by the next step: copy it
            return [g if g is None or g._base is None else g.clone() for g in (leaf.grad for leaf in leaves)]
        finally:
            for leaf, g in zip(leaves, saved):
                leaf.grad = g


def _propagate(agent: Any, ctx: _Ctx, roots: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    leaves = _leaves(roots)
    if not leaves:
        return
    outs = _through_accumulators(agent, roots, leaves, grads)
    forwards: list[tuple[str, int, torch.Tensor]] = []
    for leaf, g in zip(leaves, outs):
        if g is None:
            continue
        rec = ctx.recvs.get(id(leaf))
        if rec is not None and rec[0] is leaf:
            forwards.append((rec[1], rec[2], g))
            continue
        prev = ctx.grads.get(leaf)
        ctx.grads[leaf] = g if prev is None else prev + g
    from tensorplay.distributed.rpc import api

    for sender, sid, g in forwards:
        api.rpc_sync(sender, _backward_from_send, args=(ctx.cid, sid, g))


def _backward_from_send(cid: int, sid: int, grad: torch.Tensor) -> None:
    """Runs on the worker that sent tensor ``sid``: continue the backward pass from it."""
    a = _sim_agent("backward")
    ctx = _ctx(a, cid, False, "backward")
    t = ctx.sends.get(sid)
    if t is None:  # pragma: no cover
        raise DistRuntimeError(rpc_message("autograd.backward", "a recorded send is missing", worker=a.name,
                                           values={"context_id": cid, "send": sid}))
    _propagate(a, ctx, [t], [grad])


def backward(cid: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    a = _sim_agent("backward")
    ctx = _ctx(a, cid, False, "backward")
    nodes = [r.grad_fn for r in roots if r.grad_fn is not None]
    if any(n is f for n in nodes for f in ctx.freed):
        raise DistRuntimeError(rpc_message(
            "torch.distributed.autograd.backward", "Trying to backward through the graph a second time (or "
            "directly access saved tensors after they have already been freed): an earlier backward in this "
            "context freed this graph", worker=a.name, values={"context_id": cid, "retain_graph": retain_graph},
            fix="pass retain_graph=True to the earlier backward if the graph is needed again, or start a new "
                "dist_autograd.context() for the next step"))
    _propagate(a, ctx, roots, [torch.ones_like(r) for r in roots])
    if not retain_graph:
        ctx.freed.extend(nodes)


def get_gradients(cid: int) -> dict[torch.Tensor, torch.Tensor]:
    a = _sim_agent("get_gradients")
    return dict(_ctx(a, cid, False, "get_gradients").grads)
