"""Each collective described once: two tables every layer reads.

:data:`SPECS` - the ten autograd-aware collectives.  A :class:`CollectiveSpec`
says what a collective *is*, independent of any backend:

* ``reference``: the world-level function in plain torch ops.  It maps every
  group member's input (indexed by group rank) to every member's output.
  It is differentiable with torch.autograd, so differentiating it gives the
  exact world-level vector-Jacobian product the autograd layer must match.
* ``output_shape``: the shape rule for one rank, on shapes (the all-gather
  rule, :func:`gathered_shape`, exists once and the public API, the autograd
  layer and the conformance suite all call it).
* ``takes_op`` / ``allowed_ops`` / ``is_linear``: which reduce ops the
  collective accepts, which of them carry a gradient, and under which the
  world function is linear (double backward is then exact).
* ``root``: ``"src"``, ``"dst"`` or ``None``; ``list_input``, ``tuple_output``,
  ``splits``: the call's shape.
* ``backward``: the adjoint, stated in words (``backward``) and as the name of
  the collective it is built from (``adjoint``).
* ``vjp``: the same backward, executable.  A rule receives a
  :class:`Collectives` (the differentiable collectives on the call's group),
  the normalised :class:`Call`, the upstream gradients and, for the
  non-linear ops, this rank's input and output.  The autograd Functions in
  :mod:`tensorplay.distributed.nn.functional` run exactly these rules, so
  double backward works wherever the collective is linear.  The local
  derivatives of the reduce ops (:func:`exclusive_product`,
  :func:`tie_mask`) live here too.
* ``lowers_to``: the backend collective it runs on.

:data:`BACKEND_COLLECTIVES` - the operations of the backend interface (what
c10d runs and the simulator emulates): root role, reduce op, what the members
must agree on (a :class:`CallKey`) and the cost class of the communication.
The :class:`~tensorplay.distributed.backends.base.Backend` interface, the
simulator's kernels and agreement check and its cost model are checked
against it at import.

The conformance suite generates its cases from :data:`SPECS` and uses
``reference`` as its expectation.  Nothing here branches on a backend.

Reference inputs, per collective (``W`` = group size, ``xs[i]`` = group rank
``i``'s argument):

=====================  ==========================================================
collective             ``xs[i]``
=====================  ==========================================================
broadcast, reduce,     a tensor
all_reduce, gather,
all_gather,
all_gather_single
all_to_all_single      a tensor (with ``in_splits[i]`` / ``out_splits[i]``)
scatter                the src rank: a list of W tensors; other ranks: ``None``
                       (the public function also takes a list there, unread)
reduce_scatter         a list of W tensors
all_to_all             a list of W tensors (``xs[j][i]`` goes to rank ``i``)
=====================  ==========================================================
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import torch

from .reduce_op import ReduceOp, dtype_rule

__all__ = [
    "CollectiveSpec",
    "SPECS",
    "DIFFERENTIABLE_OPS",
    "LINEAR_OPS",
    "reduce_reference",
    "get",
    "Call",
    "Collectives",
    "exclusive_product",
    "tie_mask",
    "CallKey",
    "BackendCollective",
    "BACKEND_COLLECTIVES",
    "COST_CLASSES",
    "gathered_shape",
]

#: reduce ops with a defined gradient (bitwise ops have none)
DIFFERENTIABLE_OPS: frozenset[ReduceOp] = frozenset(
    {ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX}
)
#: reduce ops under which a reducing collective is linear (double backward is defined through them)
LINEAR_OPS: frozenset[ReduceOp] = frozenset({ReduceOp.SUM, ReduceOp.AVG})

_BITWISE = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor}


def reduce_reference(op: ReduceOp, xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``op`` over ``xs`` with differentiable torch ops (amax/amin split ties evenly, prod handles zeros)."""
    stacked = torch.stack(list(xs))
    if op is ReduceOp.SUM:
        return stacked.sum(0) if stacked.dtype != torch.bool else stacked.any(0)
    if op is ReduceOp.AVG:
        return stacked.mean(0)
    if op is ReduceOp.PRODUCT:
        return stacked.prod(0) if stacked.dtype != torch.bool else stacked.all(0)
    if op is ReduceOp.MIN:
        return stacked.amin(0)
    if op is ReduceOp.MAX:
        return stacked.amax(0)
    return functools.reduce(_BITWISE[op], list(xs))


class CallKey(NamedTuple):
    """What every member of a group must agree on for one collective call (``None``: not compared).

    ``shape`` is the shape the members must share: the tensor's for most collectives, the trailing dims
    for ``all_to_all_single`` (rows may differ), none for ``all_to_all`` (blocks are checked pairwise).
    """

    collective: str
    op: ReduceOp | None
    root: int | None
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None


# --------------------------------------------------------------------------
# references: world functions over every group rank's input
# --------------------------------------------------------------------------
def _ref_broadcast(xs: list[torch.Tensor], *, root: int, **_: Any) -> list[torch.Tensor]:
    return [xs[root].clone() for _ in xs]


def _ref_reduce(xs: list[torch.Tensor], *, root: int, op: ReduceOp = ReduceOp.SUM, **_: Any) -> list[torch.Tensor]:
    y = reduce_reference(op, xs)
    # non-root ranks get zeros: a defined value that does not depend on any input
    return [y if i == root else torch.zeros_like(y) for i in range(len(xs))]


def _ref_all_reduce(xs: list[torch.Tensor], *, op: ReduceOp = ReduceOp.SUM, **_: Any) -> list[torch.Tensor]:
    y = reduce_reference(op, xs)
    return [y.clone() for _ in xs]


def _ref_gather(xs: list[torch.Tensor], *, root: int, **_: Any) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(x.clone() if i == root else torch.zeros_like(x) for x in xs) for i in range(len(xs))]


def _ref_scatter(xs: list[Any], *, root: int, **_: Any) -> list[torch.Tensor]:
    return [t.clone() for t in xs[root]]


def _ref_all_gather(xs: list[torch.Tensor], **_: Any) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(x.clone() for x in xs) for _ in xs]


def _ref_all_gather_single(xs: list[torch.Tensor], **_: Any) -> list[torch.Tensor]:
    y = torch.stack(xs) if xs[0].dim() == 0 else torch.cat(xs)
    return [y.clone() for _ in xs]


def _ref_reduce_scatter(xs: list[list[torch.Tensor]], *, op: ReduceOp = ReduceOp.SUM, **_: Any) -> list[torch.Tensor]:
    w = len(xs)
    return [reduce_reference(op, [xs[j][i] for j in range(w)]) for i in range(w)]


def _ref_all_to_all(xs: list[list[torch.Tensor]], **_: Any) -> list[tuple[torch.Tensor, ...]]:
    w = len(xs)
    return [tuple(xs[j][i].clone() for j in range(w)) for i in range(w)]


def _ref_all_to_all_single(
    xs: list[torch.Tensor], *, in_splits: list[list[int]] | None = None, **_: Any
) -> list[torch.Tensor]:
    w = len(xs)
    if in_splits is None:
        in_splits = [[x.shape[0] // w] * w for x in xs]
    chunks = [list(torch.split(x, s)) for x, s in zip(xs, in_splits)]
    return [torch.cat([chunks[j][i] for j in range(w)]) for i in range(w)]


# --------------------------------------------------------------------------
# shape rules for one rank, on shapes (``shape`` is this rank's input's shape)
# --------------------------------------------------------------------------
Shape = tuple[int, ...]


def gathered_shape(shape: Shape, group_size: int) -> Shape:
    """The one all-gather shape rule: W inputs concatenated on dim 0, or stacked when they are 0-d.

    all_gather_single's output, all_gather_into_tensor's flat output and reduce_scatter_tensor's flat input
    (whose per-rank part is ``shape``) all follow it.
    """
    return (group_size,) if not shape else (group_size * shape[0], *shape[1:])


def _same(shape: Shape, **_: Any) -> Shape:
    return tuple(shape)


def _gather_shape(shape: Shape, *, group_size: int, **_: Any) -> tuple[Shape, ...]:
    return tuple(tuple(shape) for _ in range(group_size))


def _gather_single_shape(shape: Shape, *, group_size: int, **_: Any) -> Shape:
    return gathered_shape(tuple(shape), group_size)


def _scatter_shape(shape: Shape | None, *, like: Shape, **_: Any) -> Shape:
    return tuple(like)


def _a2a_shape(shape: Any, *, in_shapes: Sequence[Shape], **_: Any) -> tuple[Shape, ...]:
    # block j of the output comes from rank j: its shape is whatever rank j sends here
    return tuple(tuple(s) for s in in_shapes)


def _a2a_single_shape(shape: Shape, *, out_split: Sequence[int] | None = None, group_size: int = 1,
                      **_: Any) -> Shape:
    rows = shape[0] if out_split is None else sum(out_split)
    return (rows, *shape[1:])


# --------------------------------------------------------------------------
# backward rules: the exact world-level VJP of each collective, written with
# the differentiable collectives themselves (so a backward is differentiable
# again wherever the collective is linear)
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """One rank's normalised call of a collective: what a backward rule needs besides tensors.

    Every rank number here is a *group* rank; the public API converted global
    ``src``/``dst`` once, on the way in.  ``group`` is opaque to this module
    (the autograd layer stores its ProcessGroup there).
    """

    name: str
    group: Any
    size: int
    me: int
    root: int | None = None
    op: ReduceOp | None = None
    #: all_to_all_single: rows this rank sends to / receives from each group rank
    in_splits: tuple[int, ...] | None = None
    out_splits: tuple[int, ...] | None = None
    #: all_to_all: this rank's block shapes (inputs by receiver, outputs by sender); scatter on a
    #: non-src rank: the shapes of the list it passed (its inputs after the stand-in)
    in_shapes: tuple[tuple[int, ...], ...] | None = None
    out_shapes: tuple[tuple[int, ...], ...] | None = None
    #: all_gather_single: the input's shape and the output's shape (concatenated or stacked)
    shape: tuple[int, ...] | None = None
    out_shape: tuple[int, ...] | None = None

    def saves_tensors(self) -> bool:
        """Whether the backward needs this rank's input and output (only the non-linear ops do)."""
        return self.op is not None and self.op not in LINEAR_OPS


class Collectives(Protocol):
    """The differentiable collectives a backward rule may use, on the call's group, in group ranks.

    Stacked tensors carry one slice per group rank on dim 0.  A backward rule
    receives one upstream gradient per output of its collective (gather,
    all_gather and all_to_all return one block per group rank) and returns one
    gradient per input (scatter's src and all_to_all take one block per rank;
    reduce_scatter takes its blocks stacked).
    """

    def broadcast(self, x: torch.Tensor, root: int) -> torch.Tensor: ...
    def reduce(self, x: torch.Tensor, root: int, op: ReduceOp) -> torch.Tensor: ...
    def all_reduce(self, x: torch.Tensor, op: ReduceOp) -> torch.Tensor: ...
    def gather(self, x: torch.Tensor, root: int) -> tuple[torch.Tensor, ...]: ...  # W blocks on root, zeros elsewhere
    def scatter(self, parts: Sequence[torch.Tensor] | None, root: int, like: torch.Tensor) -> torch.Tensor:
        """``parts`` on root, ``None`` elsewhere; ``like`` gives non-root ranks the block's shape, dtype and
        device, and is their input in the graph (so their backward runs exactly when root's does)."""
    def all_gather(self, x: torch.Tensor) -> torch.Tensor: ...  # stacked
    def reduce_scatter(self, stacked: torch.Tensor, op: ReduceOp) -> torch.Tensor: ...
    def all_to_all(self, xs: Sequence[torch.Tensor], out_shapes: Sequence[tuple[int, ...]]) -> tuple[torch.Tensor, ...]: ...
    def all_to_all_single(self, x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int]) -> torch.Tensor: ...


# -- local derivatives of the reduce ops (no communication) --------------------
def exclusive_product(stacked: torch.Tensor) -> torch.Tensor:
    """Slice ``k`` is the product of every dim-0 slice of ``stacked`` except slice ``k``.

    Built from prefix and suffix products, so a zero anywhere is handled
    exactly; dividing the full product by slice ``k`` would give 0/0 there.
    """
    ones = torch.ones_like(stacked[:1])
    before = torch.cat([ones, stacked[:-1]]).cumprod(0)  # before[k] = prod_{l<k}
    after = torch.cat([stacked[1:], ones]).flip(0).cumprod(0).flip(0)  # after[k] = prod_{l>k}
    return before * after


def tie_mask(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """1 where ``x`` attains the reduced value ``y`` (MIN/MAX), else 0, in ``x``'s dtype."""
    return (x == y).to(x.dtype)


def _scale(op: ReduceOp, size: int, grad: torch.Tensor) -> torch.Tensor:
    """The local derivative of the linear ops: SUM passes ``grad`` on, AVG divides it by the group size."""
    return grad if op is ReduceOp.SUM else grad / size


# -- one rule per collective: (collectives, call, upstream grads, (input, output)) -> input grads
def _vjp_broadcast(C: Collectives, c: Call, grads: tuple, saved: tuple) -> tuple:
    # every output is a copy of src's input: src's input collects every rank's gradient
    (g,) = grads
    return (C.reduce(g, c.root, ReduceOp.SUM),)


def _vjp_reduce(C: Collectives, c: Call, grads: tuple, saved: tuple) -> tuple:
    # only dst's output depends on the inputs, so only dst's gradient G counts; it travels by broadcast
    (g,) = grads
    if c.op in LINEAR_OPS:
        return (_scale(c.op, c.size, C.broadcast(g, c.root)),)
    x, y = saved
    if c.op is ReduceOp.PRODUCT:
        others = exclusive_product(C.all_gather(x))[c.me]
        return (C.broadcast(g, c.root) * others.conj(),)
    # MIN/MAX: y exists on dst only; it rides along with G in the one broadcast
    G, y = C.broadcast(torch.stack([g, y]), c.root).unbind(0)
    m = tie_mask(x, y)
    return (G * m / C.all_reduce(m, ReduceOp.SUM),)


def _vjp_all_reduce(C: Collectives, c: Call, grads: tuple, saved: tuple) -> tuple:
    # every rank receives y, so G is the sum of every rank's gradient
    (g,) = grads
    if c.op in LINEAR_OPS:
        return (_scale(c.op, c.size, C.all_reduce(g, ReduceOp.SUM)),)
    x, y = saved
    if c.op is ReduceOp.PRODUCT:
        others = exclusive_product(C.all_gather(x))[c.me]
        return (C.all_reduce(g, ReduceOp.SUM) * others.conj(),)
    # MIN/MAX: one all_reduce sums the gradients and counts the tied ranks together
    m = tie_mask(x, y)
    G, ties = C.all_reduce(torch.stack([g, m]), ReduceOp.SUM).unbind(0)
    return (G * m / ties,)


def _vjp_gather(C: Collectives, c: Call, grads: tuple, saved: tuple) -> tuple:
    # one gradient per output block.  dst's block i belongs to rank i's input; other ranks' blocks are
    # zeros that depend on nothing, so their gradients never count.  Non-dst ranks hand in their first
    # gradient as ``like``, so a double backward reaches them exactly when it reaches dst.
    parts = list(grads) if c.me == c.root else None
    return (C.scatter(parts, c.root, like=grads[0]),)


def _vjp_scatter(C: Collectives, c: Call, grads: tuple, saved: tuple) -> tuple:
    # rank i's output is src's i-th input: src collects the gradients with one gather.  Every rank whose
    # result requires grad joins it (src decided that for all in the forward); a non-src rank's inputs
    # (the stand-in, then any torch-style list) reach no output, so they get nothing and zeros.  The
    # gather's zero blocks are reused where they fit, so a double backward still reaches this rank.
    (g,) = grads
    G = C.gather(g, c.root)
    if c.me == c.root:
        return tuple(G)
    own = c.in_shapes or ()
    return (None, *(G[k] if k < len(G) and tuple(G[k].shape) == s else g.new_zeros(s) for k, s in enumerate(own)))


def _vjp_all_gather(C: Collectives, c: Call, grads: tuple, saved: tuple) -> tuple:
    # one gradient per output block; rank i's input appears in every rank's output at block i,
    # so one reduce_scatter sums those blocks
    return (C.reduce_scatter(torch.stack(grads), ReduceOp.SUM),)


def _vjp_all_gather_single(C: Collectives, c: Call, grads: tuple, saved: tuple) -> tuple:
    (g,) = grads
    return (C.reduce_scatter(g.reshape(c.size, *c.shape), ReduceOp.SUM),)


def _vjp_reduce_scatter(C: Collectives, c: Call, grads: tuple, saved: tuple) -> tuple:
    # the input is this rank's blocks stacked (slot i goes to rank i); rank i alone receives y_i
    (g,) = grads
    if c.op in LINEAR_OPS:
        return (_scale(c.op, c.size, C.all_gather(g)),)
    stacked, y = saved
    # Non-linear ops: the owner of y_i collects every rank's i-th block, forms each sender's share of
    # g_i there, and sends the shares back.  Two exchanges of the input's size, nothing W times larger.
    every = [1] * c.size
    column = C.all_to_all_single(stacked, every, every)  # column[k] = rank k's block for this rank
    if c.op is ReduceOp.PRODUCT:
        share = exclusive_product(column).conj()
    else:
        m = tie_mask(column, y)
        share = m / m.sum(0)
    return (C.all_to_all_single(g * share, every, every),)


def _vjp_all_to_all(C: Collectives, c: Call, grads: tuple, saved: tuple) -> tuple:
    # pure routing: the gradients go back along the reversed routes, in one exchange
    return tuple(C.all_to_all(list(grads), c.in_shapes))


def _vjp_all_to_all_single(C: Collectives, c: Call, grads: tuple, saved: tuple) -> tuple:
    (g,) = grads
    return (C.all_to_all_single(g, c.in_splits, c.out_splits),)


@dataclass(frozen=True)
class CollectiveSpec:
    """The one description of an autograd-aware collective (see the module docstring)."""

    name: str
    summary: str
    reference: Callable[..., list[Any]]
    output_shape: Callable[..., Any]
    adjoint: str
    backward: str
    root: str | None = None
    takes_op: bool = False
    list_input: bool = False
    tuple_output: bool = False
    splits: bool = False
    #: the function's first argument is an output buffer (or ``None``) that gives the result's layout; the call is
    #: ``fn([output,] input, [root,] [output_split_sizes, input_split_sizes,] [op=...,] group=...)``
    takes_output: bool = False
    #: the backend collective the autograd layer runs it with (what the members must agree on is stated there)
    lowers_to: str = ""
    #: the backward, executable: ``vjp(collectives, call, grads, (input, output)) -> input grads``
    vjp: Callable[..., tuple] | None = None

    def allowed_ops(self, dtype: torch.dtype, requires_grad: bool = False) -> list[ReduceOp]:
        """Ops this collective accepts for ``dtype`` (only differentiable ones when a gradient is wanted)."""
        if not self.takes_op:
            return []
        ops = [op for op in ReduceOp if dtype_rule(op, dtype) is None]
        if requires_grad:
            ops = [op for op in ops if op in DIFFERENTIABLE_OPS]
        return ops

    def is_linear(self, op: ReduceOp | None = None) -> bool:
        """Whether the world function is linear in its inputs (so its backward is differentiable again)."""
        return not self.takes_op or op in LINEAR_OPS


SPECS: dict[str, CollectiveSpec] = {
    s.name: s
    for s in [
        CollectiveSpec(
            name="broadcast",
            lowers_to="broadcast",
            vjp=_vjp_broadcast,
            summary="every rank gets src's tensor",
            reference=_ref_broadcast,
            output_shape=_same,
            root="src",
            adjoint="reduce",
            backward="reduce(SUM) of the gradients to src: src gets sum_j g_j, every other rank exactly 0",
        ),
        CollectiveSpec(
            name="reduce",
            lowers_to="reduce",
            vjp=_vjp_reduce,
            summary="dst gets op over every rank's tensor; other ranks get zeros",
            reference=_ref_reduce,
            output_shape=_same,
            root="dst",
            takes_op=True,
            adjoint="broadcast",
            backward="broadcast of dst's gradient, times the op's local derivative; non-dst gradients never count",
        ),
        CollectiveSpec(
            name="all_reduce",
            lowers_to="all_reduce",
            vjp=_vjp_all_reduce,
            summary="every rank gets op over every rank's tensor",
            reference=_ref_all_reduce,
            output_shape=_same,
            takes_op=True,
            adjoint="all_reduce",
            backward="all_reduce(SUM) of the gradients, times the op's local derivative",
        ),
        CollectiveSpec(
            name="gather",
            lowers_to="gather",
            vjp=_vjp_gather,
            summary="dst gets the tuple of every rank's tensor; other ranks get zeros",
            reference=_ref_gather,
            output_shape=_gather_shape,
            root="dst",
            tuple_output=True,
            adjoint="scatter",
            backward="scatter of dst's per-rank gradient slices: rank i gets g_dst[i]",
        ),
        CollectiveSpec(
            name="scatter",
            lowers_to="scatter",
            vjp=_vjp_scatter,
            summary="rank i gets src's i-th tensor",
            reference=_ref_scatter,
            output_shape=_scatter_shape,
            root="src",
            list_input=True,
            adjoint="gather",
            backward="gather of the gradients to src: src's i-th input gets g_i; non-src inputs get zeros",
        ),
        CollectiveSpec(
            name="all_gather",
            lowers_to="all_gather",
            vjp=_vjp_all_gather,
            summary="every rank gets the tuple of every rank's tensor",
            reference=_ref_all_gather,
            output_shape=_gather_shape,
            tuple_output=True,
            adjoint="reduce_scatter",
            backward="reduce_scatter(SUM) of the gradients: rank i gets sum_j g_j[i]",
        ),
        CollectiveSpec(
            name="all_gather_single",
            takes_output=True,
            lowers_to="all_gather_into_tensor",
            vjp=_vjp_all_gather_single,
            summary="every rank gets every rank's tensor concatenated on dim 0 (0-d tensors stacked)",
            reference=_ref_all_gather_single,
            output_shape=_gather_single_shape,
            adjoint="reduce_scatter",
            backward="reduce_scatter(SUM) of the concatenated gradient",
        ),
        CollectiveSpec(
            name="reduce_scatter",
            takes_output=True,
            lowers_to="reduce_scatter_tensor",
            vjp=_vjp_reduce_scatter,
            summary="rank i gets op over every rank's i-th tensor",
            reference=_ref_reduce_scatter,
            output_shape=_same,
            takes_op=True,
            list_input=True,
            adjoint="all_gather",
            backward="all_gather of the gradients, times the op's local derivative",
        ),
        CollectiveSpec(
            name="all_to_all",
            takes_output=True,
            lowers_to="all_to_all",
            vjp=_vjp_all_to_all,
            summary="rank i's j-th output is rank j's i-th input (shapes may differ per pair)",
            reference=_ref_all_to_all,
            output_shape=_a2a_shape,
            list_input=True,
            tuple_output=True,
            adjoint="all_to_all",
            backward="all_to_all of the gradients along the reversed routes",
        ),
        CollectiveSpec(
            name="all_to_all_single",
            takes_output=True,
            lowers_to="all_to_all_single",
            vjp=_vjp_all_to_all_single,
            summary="split dim 0 by in_splits, exchange, concatenate by out_splits",
            reference=_ref_all_to_all_single,
            output_shape=_a2a_single_shape,
            splits=True,
            adjoint="all_to_all_single",
            backward="all_to_all_single of the gradient with the two split lists swapped",
        ),
    ]
}


# --------------------------------------------------------------------------
# the backend interface's collectives: what every backend implements
# --------------------------------------------------------------------------
#: the classes of communication a cost model prices (and a calibration measures) separately; the simulator's
#: cost model (simulator/timing/cost.py) says which algorithm each class follows (ring, tree, ...)
COST_CLASSES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather",
                "scatter", "barrier", "p2p")


@dataclass(frozen=True)
class BackendCollective:
    """One operation of the backend interface (:class:`~tensorplay.distributed.backends.base.Backend`).

    The autograd collectives above are built from these; c10d runs them natively and the simulator emulates
    them.  The facts here are the ones every layer shares: the role of the root, whether a reduce op is
    taken, what the members of a group must agree on (the simulator's agreement check compares exactly
    these fields of a :class:`CallKey`), and the cost class of its communication.
    """

    name: str
    root: str | None = None
    takes_op: bool = False
    #: which of CallKey's ``dtype``/``shape`` every member must share (``collective``, and ``op``/``root`` when
    #: the collective has them, are always compared)
    agree_on: tuple[str, ...] = ("dtype", "shape")
    #: the class the cost model prices it as (one of COST_CLASSES; by default its own name)
    cost_class: str = ""
    #: the backend method's arguments before ``group`` (then ``tag`` for point-to-point, then ``async_op``);
    #: checked against :class:`~tensorplay.distributed.backends.base.Backend`'s signatures at import
    args: tuple[str, ...] = ()
    #: which of ``args`` the call writes on this rank: what ``Work.result()`` gives, and what a rank process
    #: copies back after the call (a tensor, or a list of tensors; ``None`` on ranks that pass none)
    outputs: tuple[str, ...] = ()

    @property
    def p2p(self) -> bool:
        """Point-to-point: the method takes a ``tag`` after ``group``."""
        return self.cost_class == "p2p"

    @property
    def parameters(self) -> tuple[str, ...]:
        """The backend method's whole parameter list (after ``self``)."""
        return (*self.args, "group", *(("tag",) if self.p2p else ()), "async_op")

    def output_positions(self) -> tuple[int, ...]:
        """The positions in :attr:`args` of the :attr:`outputs`."""
        return tuple(self.args.index(name) for name in self.outputs)

    def __post_init__(self) -> None:
        if not self.cost_class:
            object.__setattr__(self, "cost_class", self.name)

    def key(self, *, op: ReduceOp | None = None, root: int | None = None, dtype: torch.dtype | None = None,
            shape: Sequence[int] | None = None) -> CallKey:
        """The agreement key of one rank's call: the fields this collective does not compare are ``None``."""
        return CallKey(self.name, op if self.takes_op else None, root if self.root is not None else None,
                       dtype if "dtype" in self.agree_on else None,
                       tuple(shape) if "shape" in self.agree_on and shape is not None else None)


BACKEND_COLLECTIVES: dict[str, BackendCollective] = {
    b.name: b
    for b in [
        BackendCollective("barrier", agree_on=()),
        BackendCollective("broadcast", root="src", args=("tensor", "root"), outputs=("tensor",)),
        BackendCollective("all_reduce", takes_op=True, args=("tensor", "op"), outputs=("tensor",)),
        BackendCollective("reduce", root="dst", takes_op=True, args=("tensor", "root", "op"), outputs=("tensor",)),
        BackendCollective("all_gather", args=("output_list", "tensor"), outputs=("output_list",)),
        BackendCollective("all_gather_into_tensor", cost_class="all_gather", args=("output", "input"),
                          outputs=("output",)),
        BackendCollective("gather", root="dst", args=("tensor", "gather_list", "root"), outputs=("gather_list",)),
        BackendCollective("scatter", root="src", args=("tensor", "scatter_list", "root"), outputs=("tensor",)),
        # the shape compared is the output's (each rank's share)
        BackendCollective("reduce_scatter", takes_op=True, args=("output", "input_list", "op"), outputs=("output",)),
        BackendCollective("reduce_scatter_tensor", takes_op=True, cost_class="reduce_scatter",
                          args=("output", "input", "op"), outputs=("output",)),
        # blocks may differ per pair of ranks: checked pairwise (sender's block = receiver's slot), not by key
        BackendCollective("all_to_all", agree_on=("dtype",), args=("output_list", "input_list"),
                          outputs=("output_list",)),
        # the shape compared is the trailing dims: row counts differ per rank and are checked pairwise
        BackendCollective("all_to_all_single", cost_class="all_to_all",
                          args=("output", "input", "output_split_sizes", "input_split_sizes"), outputs=("output",)),
        BackendCollective("send", cost_class="p2p", args=("tensor", "peer")),
        BackendCollective("recv", cost_class="p2p", args=("tensor", "peer"), outputs=("tensor",)),
    ]
}


def _check_tables() -> None:
    """Import-time consistency of the two tables (a wrong entry fails at import, naming itself)."""
    for sp in SPECS.values():
        if sp.adjoint not in SPECS:
            raise RuntimeError(f"spec {sp.name!r}: adjoint={sp.adjoint!r} is not a collective of SPECS")
        low = BACKEND_COLLECTIVES.get(sp.lowers_to)
        if low is None:
            raise RuntimeError(f"spec {sp.name!r}: lowers_to={sp.lowers_to!r} is not in BACKEND_COLLECTIVES")
        if (low.root is not None) != (sp.root is not None) or low.takes_op != sp.takes_op:
            raise RuntimeError(f"spec {sp.name!r} and the backend collective {low.name!r} it lowers to disagree: "
                               f"root={sp.root!r}/{low.root!r}, takes_op={sp.takes_op}/{low.takes_op}")
    for b in BACKEND_COLLECTIVES.values():
        if b.cost_class not in COST_CLASSES or not set(b.agree_on) <= {"dtype", "shape"}:
            raise RuntimeError(f"backend collective {b.name!r}: cost_class={b.cost_class!r} agree_on={b.agree_on!r}")
        if not set(b.outputs) <= set(b.args) or len(set(b.args)) != len(b.args):
            raise RuntimeError(f"backend collective {b.name!r}: outputs={b.outputs!r} must name distinct "
                               f"arguments of args={b.args!r}")


def get(name: str) -> CollectiveSpec:
    """The spec of ``name`` (``KeyError`` lists the known names)."""
    try:
        return SPECS[name]
    except KeyError:
        raise KeyError(f"unknown collective {name!r}; known: {sorted(SPECS)}") from None


_check_tables()
