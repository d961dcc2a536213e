"""Each backend collective's rules, in one place: how a rank's call is described, what the members must agree
on beyond the call key, and the kernel that computes every member's outputs.

The facts every layer shares (argument names, which are outputs, the call key's fields, the cost class) are
the product's table, :data:`tensorplay.distributed.spec.BACKEND_COLLECTIVES`; this module adds what only the
simulator needs, one :class:`Rule` per collective of that table, checked at import.

A rank's call data is its arguments as a named tuple of the table's ``args`` (``Args["all_reduce"](tensor,
op)``).  A kernel receives every member's :class:`~simulator.core.state.RankCall` in *group-rank order* and
writes the outputs in place; the root and the reduce op are read from any member's call, since the members
agreed on them before a kernel runs (the engine compares the call keys first).
"""
from __future__ import annotations

from collections import namedtuple
from typing import Any, Callable, NamedTuple, Sequence

import torch

from tensorplay.distributed.reduce_op import ReduceOp
from tensorplay.distributed.spec import BACKEND_COLLECTIVES, CallKey

from simulator.core import kernels
from simulator.core.report import is_new_group
from simulator.core.state import RankCall

__all__ = ["Rule", "RULES", "Args", "outputs", "disagreement"]

#: per collective: the named tuple of its arguments (the table's ``args``), a rank's call data
Args: dict[str, Any] = {name: namedtuple(f"{name}_args", b.args) for name, b in BACKEND_COLLECTIVES.items()}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def outputs(name: str, data: Any) -> list[torch.Tensor]:
    """The tensors a collective wrote on this rank (what ``Work.result()`` gives): its table's ``outputs``."""
    out: list[torch.Tensor] = []
    for i in _OUTPUT_POSITIONS[name]:
        v = data[i]
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif v is not None:  # a list of tensors (gather_list is None off the root)
            out.extend(v)
    return out


_OUTPUT_POSITIONS = {name: b.output_positions() for name, b in BACKEND_COLLECTIVES.items()}


# ---------------------------------------------------------------------------
# agreement: the call keys first (every collective), then a collective's own pairwise check
# ---------------------------------------------------------------------------
def disagreement(calls: list[RankCall]) -> str | None:
    """The first field of the call keys on which the members differ, with who passed what (``None``: agree)."""
    k0 = calls[0].key
    for c in calls:
        if c.key != k0:
            for i, field in enumerate(CallKey._fields):
                vals: dict[Any, list[int]] = {}
                for cc in calls:
                    vals.setdefault(cc.key[i], []).append(cc.rs.rank)
                if len(vals) > 1:
                    parts = []
                    for v, ranks in list(vals.items())[:8]:
                        shown = v.name if isinstance(v, ReduceOp) else (str(v).replace("torch.", "") if v is not None else "-")
                        if field == "shape" and v is not None:
                            shown = str(tuple(v))
                        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[:8]}"
                        parts.append(f"{who}: {shown}")
                    if field == "shape" and is_new_group(calls):
                        return f"ranks differ ({'; '.join(parts)})"
                    return f"{field} differs ({'; '.join(parts)})"
    return None


def _storages(ts: Sequence[torch.Tensor]) -> set[int] | None:
    """The memory the tensors use; ``None`` when one has none to show (a wrapper subclass such as torch's
    ``TwoTensor``: its data is in tensors inside it)."""
    out = set()
    for t in ts:
        if t.numel():
            try:
                out.add(t.untyped_storage().data_ptr())
            except RuntimeError:  # "Attempted to access the data pointer on an invalid python storage"
                return None
    return out


def _overlap(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether a tensor of ``a`` may share memory with one of ``b`` (unknown memory: it may)."""
    sa, sb = _storages(a), _storages(b)
    return sa is None or sb is None or bool(sa & sb)


def _stage(srcs: list[torch.Tensor], outs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Clone the sources when an output may share memory with one (then writes cannot clobber inputs)."""
    if _overlap(srcs, outs):
        return [s.clone() for s in srcs]
    return srcs


class Rule(NamedTuple):
    """What the simulator knows of one backend collective beyond the table."""

    #: ``describe(data, group_size) -> (key, nbytes, detail)``: the call key the members must agree on, the
    #: bytes the cost model prices, and a detail for error messages (``None``: nothing beyond the key)
    describe: Callable[[Any, int], tuple[CallKey, int, str | None]]
    #: writes every member's outputs, given the members' calls in group-rank order
    kernel: Callable[[list[RankCall]], Any]
    #: the agreement the key cannot express (per pair of ranks), or ``None``; returns the reason or ``None``
    check: Callable[[list[RankCall]], str | None] | None = None


def _key(name: str, **fields: Any) -> CallKey:
    return BACKEND_COLLECTIVES[name].key(**fields)


# -- barrier: nothing moves --------------------------------------------------
def _barrier(calls: list[RankCall]) -> None:
    return None


# -- broadcast: the root's tensor to every member ---------------------------
def _broadcast(calls: list[RankCall]) -> None:
    root = calls[0].data.root
    src = calls[root].data.tensor
    for i, c in enumerate(calls):
        if i != root:
            c.data.tensor.copy_(src)


# -- all_reduce / reduce: folded in group-rank order (kernels.reduce_into) ---
def _all_reduce(calls: list[RankCall]) -> None:
    ts = [c.data.tensor for c in calls]
    kernels.reduce_into(ts, ts, calls[0].data.op)


def _reduce(calls: list[RankCall]) -> None:
    d = calls[0].data
    kernels.reduce_into([calls[d.root].data.tensor], [c.data.tensor for c in calls], d.op)


# -- gathers: member i's tensor into slot i of every (or the root's) output --
def _all_gather(calls: list[RankCall]) -> None:
    outs = [o for c in calls for o in c.data.output_list]
    srcs = _stage([c.data.tensor for c in calls], outs)
    for c in calls:
        for o, s in zip(c.data.output_list, srcs):
            o.copy_(s)


def _all_gather_into_tensor(calls: list[RankCall]) -> None:
    srcs = _stage([c.data.input for c in calls], [c.data.output for c in calls])
    for c in calls:
        kernels.copy_rows(c.data.output, srcs)


def _gather(calls: list[RankCall]) -> None:
    gl = calls[calls[0].data.root].data.gather_list
    srcs = _stage([c.data.tensor for c in calls], gl)
    for o, s in zip(gl, srcs):
        o.copy_(s)


# -- scatter: slot i of the root's list to member i --------------------------
def _scatter(calls: list[RankCall]) -> None:
    sl = calls[calls[0].data.root].data.scatter_list
    srcs = _stage(list(sl), [c.data.tensor for c in calls])
    for c, s in zip(calls, srcs):
        c.data.tensor.copy_(s)


# -- reduce_scatter: block i of every member, reduced, to member i -----------
def _reduce_scatter(calls: list[RankCall]) -> None:
    w, op = len(calls), calls[0].data.op
    results = [kernels.reduce_tensors([c.data.input_list[i] for c in calls], op) for i in range(w)]
    for c, r in zip(calls, results):
        c.data.output.copy_(r)


def _reduce_scatter_tensor(calls: list[RankCall]) -> None:
    w, op = len(calls), calls[0].data.op
    rows = [kernels.rows_view(c.data.input, w) for c in calls]
    results = [kernels.reduce_tensors([r[i] for r in rows], op) for i in range(w)]
    for c, r in zip(calls, results):
        out = c.data.output
        out.copy_(r.view(out.shape) if r.numel() == out.numel() else r)


# -- all_to_all: member j's block i to member i's slot j ---------------------
def _all_to_all(calls: list[RankCall]) -> None:
    outs = [o for c in calls for o in c.data.output_list]
    ins = [t for c in calls for t in c.data.input_list]
    if _overlap(ins, outs):
        staged = [[t.clone() for t in c.data.input_list] for c in calls]
    else:
        staged = [c.data.input_list for c in calls]
    for i, c in enumerate(calls):
        for j, o in enumerate(c.data.output_list):
            o.copy_(staged[j][i])


def _check_all_to_all(calls: list[RankCall]) -> str | None:
    """Blocks may differ per pair of ranks: the sender's block must fit the receiver's slot."""
    w = len(calls)
    for i in range(w):
        outs_i = calls[i].data.output_list
        for j in range(w):
            sent = calls[j].data.input_list[i].shape
            want = outs_i[j].shape
            if sent != want:
                return (f"rank {calls[j].rs.rank} sends a block of shape {tuple(sent)} to rank {calls[i].rs.rank}, "
                        f"which expects shape {tuple(want)} (input_tensor_list[{i}] on the sender must match "
                        f"output_tensor_list[{j}] on the receiver)")
    return None


def _all_to_all_single(calls: list[RankCall]) -> None:
    w = len(calls)
    ins = _stage([c.data.input for c in calls], [c.data.output for c in calls])
    in_off = []
    for c in calls:
        offs, acc = [], 0
        for s in c.data.input_split_sizes:
            offs.append(acc)
            acc += s
        in_off.append(offs)
    for i, c in enumerate(calls):
        out, out_splits = c.data.output, c.data.output_split_sizes
        off = 0
        for j in range(w):
            n = out_splits[j]
            if n:
                out.narrow(0, off, n).copy_(ins[j].narrow(0, in_off[j][i], n))
            off += n


def _check_all_to_all_single(calls: list[RankCall]) -> str | None:
    """Row counts differ per pair of ranks: what j sends to i must be what i expects from j."""
    w = len(calls)
    for i in range(w):
        out_splits = calls[i].data.output_split_sizes
        for j in range(w):
            sent = calls[j].data.input_split_sizes[i]
            if sent != out_splits[j]:
                return (f"rank {calls[j].rs.rank} sends {sent} rows to rank {calls[i].rs.rank}, which expects "
                        f"{out_splits[j]} (input_split_sizes[{i}] on rank {calls[j].rs.rank} must equal "
                        f"output_split_sizes[{j}] on rank {calls[i].rs.rank})")
    return None


def _shapes(ts: Sequence[torch.Tensor]) -> str:
    return ",".join(str(tuple(t.shape)) for t in ts[:8])


RULES: dict[str, Rule] = {
    "barrier": Rule(lambda d, n: (_key("barrier"), 0, None), _barrier),
    "broadcast": Rule(lambda d, n: (_key("broadcast", root=d.root, dtype=d.tensor.dtype, shape=d.tensor.shape),
                                    nbytes(d.tensor), None), _broadcast),
    "all_reduce": Rule(lambda d, n: (_key("all_reduce", op=d.op, dtype=d.tensor.dtype, shape=d.tensor.shape),
                                     nbytes(d.tensor), None), _all_reduce),
    "reduce": Rule(lambda d, n: (_key("reduce", op=d.op, root=d.root, dtype=d.tensor.dtype, shape=d.tensor.shape),
                                 nbytes(d.tensor), None), _reduce),
    "all_gather": Rule(lambda d, n: (_key("all_gather", dtype=d.tensor.dtype, shape=d.tensor.shape),
                                     nbytes(d.tensor) * len(d.output_list), None), _all_gather),
    "all_gather_into_tensor": Rule(
        lambda d, n: (_key("all_gather_into_tensor", dtype=d.input.dtype, shape=d.input.shape), nbytes(d.output),
                      None), _all_gather_into_tensor),
    "gather": Rule(lambda d, n: (_key("gather", root=d.root, dtype=d.tensor.dtype, shape=d.tensor.shape),
                                 nbytes(d.tensor) * n, None), _gather),
    "scatter": Rule(lambda d, n: (_key("scatter", root=d.root, dtype=d.tensor.dtype, shape=d.tensor.shape),
                                  nbytes(d.tensor) * n, None), _scatter),
    "reduce_scatter": Rule(
        lambda d, n: (_key("reduce_scatter", op=d.op, dtype=d.output.dtype, shape=d.output.shape),
                      nbytes(d.output) * len(d.input_list), None), _reduce_scatter),
    "reduce_scatter_tensor": Rule(
        lambda d, n: (_key("reduce_scatter_tensor", op=d.op, dtype=d.output.dtype, shape=d.output.shape),
                      nbytes(d.input), None), _reduce_scatter_tensor),
    "all_to_all": Rule(
        lambda d, n: (_key("all_to_all", dtype=d.input_list[0].dtype), sum(nbytes(t) for t in d.input_list),
                      f"in={_shapes(d.input_list)} out={_shapes(d.output_list)}"), _all_to_all, _check_all_to_all),
    "all_to_all_single": Rule(
        lambda d, n: (_key("all_to_all_single", dtype=d.input.dtype, shape=tuple(d.input.shape[1:])), nbytes(d.input),
                      f"in_splits={list(d.input_split_sizes)} out_splits={list(d.output_split_sizes)} "
                      f"rows={tuple(d.input.shape[1:])}"), _all_to_all_single, _check_all_to_all_single),
}

# every collective of the backend interface has its rule here (send/recv are matched pairwise, not computed)
_missing = sorted(n for n, b in BACKEND_COLLECTIVES.items() if not b.p2p and n not in RULES)
if _missing:  # pragma: no cover  (a new entry in spec.BACKEND_COLLECTIVES without a simulator rule)
    raise ImportError(f"simulator/core/collectives.py has no rule for the backend collective(s) {_missing}: "
                      f"add its describe/kernel to RULES")
