"""Expectations computed independently of the implementation under test, and the per-case check.

For one case the parent rebuilds every member's inputs (bit-identical to what
the ranks built, see :mod:`conformance.cases`) in float64/complex128 and derives:

1. **the reference**: the spec's single-process world function
   (``SPECS[name].reference``) on all members' inputs: the expected results;
2. **the reference VJP**: that function differentiated by ``torch.autograd``
   with every rank's own upstream gradient ``g_r`` (distinct per rank);
3. **the documented rule**: the backward table of docs/semantics written out
   directly (broadcast: src gets ``sum_j g_j``, every other rank exactly 0;
   PRODUCT: ``G * prod_{k != i} x_k``; MIN/MAX: ties split evenly ...).
   It must agree with 2, or the case is reported as a suite/spec error;
4. for linear cases in float64/complex128, **the adjoint identity**
   ``sum_r <A(x)_r, g_r> == sum_r <x_r, A*(g)_r>`` on the implementation's own
   results and gradients;
5. for PRODUCT/MIN/MAX in float64 without ties, **finite differences** of the
   world function along a random direction against the implementation's gradients.

:func:`check_case` walks the stages in a fixed order: runs, shape, dtype,
values, gradient; the first failing stage is the case's cause.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tensorplay.distributed.reduce_op import ReduceOp

from .cases import Case, _generator, output_shapes, rank_inputs, upstream_grads
from .execute import RankOutcome

__all__ = ["STAGES", "Expectation", "Verdict", "check_case", "expectation", "tolerance"]

#: the order in which a case is checked; the first failing stage is the cause
STAGES = ("runs", "shape", "dtype", "values", "gradient")

_EPS = {
    "float64": torch.finfo(torch.float64).eps, "complex128": torch.finfo(torch.float64).eps,
    "float32": torch.finfo(torch.float32).eps, "bfloat16": torch.finfo(torch.bfloat16).eps,
    "float16": torch.finfo(torch.float16).eps,
}
_EXACT_OPS = ("MIN", "MAX", "BAND", "BOR", "BXOR")


@dataclass
class Verdict:
    """The outcome of one case.

    ``status``: ``"passed"``, ``"failed"``, ``"skipped"`` (the runner cannot run it here) or
    ``"error"`` (the suite itself or the spec is at fault, not the implementation).
    ``stage``/``reason`` name the cause (``reason`` is short and shared by similar failures,
    so failures group by it); ``detail`` says which rank, which tensor, by how much.
    """

    status: str
    stage: str | None = None
    reason: str = ""
    detail: str = ""
    #: the cause a later stage would report too (only for failures in the values stage)
    also: str = ""

    @property
    def cause(self) -> str:
        return f"{self.stage}: {self.reason}" if self.stage else self.reason


def tolerance(dtype: str, n: int, scale: float) -> tuple[float, float]:
    """(rtol, atol) for a reduction over ``n`` ranks of values of magnitude ``scale`` in ``dtype``."""
    eps = _EPS.get(dtype, 0.0)
    k = 4.0 * max(n, 1) * eps
    return k, k * max(scale, 1.0)


# ---------------------------------------------------------------------------
# expectations
# ---------------------------------------------------------------------------
def _up(t: torch.Tensor) -> torch.Tensor:
    """The exact high-precision copy of ``t`` (float -> float64, complex -> complex128)."""
    if t.is_complex():
        return t.detach().to(torch.complex128)
    if t.is_floating_point():
        return t.detach().to(torch.float64)
    return t.detach().clone()


def _flat(x: Any) -> list[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


@dataclass
class Expectation:
    """Everything the checker needs for one case, keyed by global rank."""

    inputs: dict[int, list[torch.Tensor]]       # each member's input leaves (high precision)
    outputs: dict[int, Any]                     # expected results (tensor or tuple), high precision
    grads: dict[int, list[torch.Tensor]]        # reference VJP per input leaf
    documented: dict[int, list[torch.Tensor]]   # documented backward rule per input leaf
    upstream: dict[int, Any]                    # g_r, high precision
    problem: str = ""                           # reference and documented rule disagree


def _world_args(case: Case, requires_grad: bool) -> tuple[list[Any], dict[int, list[torch.Tensor]]]:
    """Every member's argument in group-rank order (high precision), and each member's leaves."""
    xs: list[Any] = []
    leaves: dict[int, list[torch.Tensor]] = {}
    for g in case.members:
        x = rank_inputs(case, g, "cpu", requires_grad=False)
        if x is None:
            xs.append(None)
            leaves[g] = []
            continue
        if isinstance(x, list):
            x = [_up(t).requires_grad_(requires_grad) for t in x]
            leaves[g] = list(x)
        else:
            x = _up(x).requires_grad_(requires_grad)
            leaves[g] = [x]
        xs.append(x)
    return xs, leaves


def _reference(case: Case, xs: list[Any]) -> list[Any]:
    kwargs: dict[str, Any] = {}
    if case.root is not None:
        kwargs["root"] = case.group_root
    if case.op is not None:
        kwargs["op"] = ReduceOp[case.op]
    if case.collective == "all_to_all_single":
        kwargs["in_splits"] = [list(r) for r in case.rows]
    if case.collective == "scatter":
        # non-src ranks' own lists (offroot=tensors) are not part of the world function
        xs = [x if i == case.group_root else None for i, x in enumerate(xs)]
    return case.spec.reference(xs, **kwargs)


def expectation(case: Case) -> Expectation:
    """The reference results, the reference VJP and the documented backward rule for ``case``."""
    diff = case.differentiable
    xs, leaves = _world_args(case, diff)
    ys = _reference(case, xs)
    outputs = {g: ys[i] for i, g in enumerate(case.members)}
    upstream: dict[int, Any] = {}
    grads: dict[int, list[torch.Tensor]] = {g: [] for g in case.members}
    documented: dict[int, list[torch.Tensor]] = {g: [] for g in case.members}
    problem = ""
    if diff:
        for g in case.members:
            u = upstream_grads(case, g, "cpu")
            upstream[g] = tuple(_up(t) for t in u) if isinstance(u, tuple) else _up(u)
        outs, gos = [], []
        for g in case.members:
            for y, u in zip(_flat(outputs[g]), _flat(upstream[g])):
                if y.requires_grad:
                    outs.append(y)
                    gos.append(u)
        all_leaves = [t for g in case.members for t in leaves[g]]
        got = torch.autograd.grad(outs, all_leaves, gos, allow_unused=True) if outs and all_leaves else ()
        it = iter(got)
        for g in case.members:
            for t in leaves[g]:
                v = next(it)
                grads[g].append(torch.zeros_like(t) if v is None else v.detach())
        documented = _documented_grads(case, {g: [t.detach() for t in leaves[g]] for g in case.members}, upstream)
        problem = _compare_rules(case, grads, documented)
    detached = {g: tuple(y.detach() for y in outputs[g]) if isinstance(outputs[g], tuple) else outputs[g].detach()
                for g in case.members}
    return Expectation(inputs={g: [t.detach() for t in leaves[g]] for g in case.members}, outputs=detached,
                       grads=grads, documented=documented, upstream=upstream, problem=problem)


def _local_derivatives(op: str, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """d(op_j x_j)/dx_i for each i, written out from the spec's table (not via autograd)."""
    n = len(xs)
    if op == "SUM":
        return [torch.ones_like(x) for x in xs]
    if op == "AVG":
        return [torch.full_like(x, 1.0 / n) for x in xs]
    if op == "PRODUCT":
        out = []
        for i in range(n):
            p = torch.ones_like(xs[i])
            for k in range(n):
                if k != i:
                    p = p * xs[k]  # the exclusive product itself: y / x_i is wrong at zeros
            out.append(p.conj() if p.is_complex() else p)
        return out
    if op in ("MIN", "MAX"):
        stacked = torch.stack(list(xs))
        y = stacked.amax(0) if op == "MAX" else stacked.amin(0)
        m = [(x == y).to(x.dtype) for x in xs]
        count = sum(m)
        return [mi / count for mi in m]  # ties split the gradient evenly
    raise ValueError(f"{op} has no derivative")


def _chunks_dim0(t: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    return list(torch.split(t, list(sizes)))


def _documented_grads(case: Case, x: dict[int, list[torch.Tensor]], g: dict[int, Any]) -> dict[int, list[torch.Tensor]]:
    """The backward table of docs/semantics, evaluated directly for every member's input leaves."""
    c, m, n = case.collective, case.members, case.group_size
    root = case.root
    zeros = {r: [torch.zeros_like(t) for t in x[r]] for r in m}
    res = zeros
    if c == "broadcast":
        total = sum(g[r] for r in m)
        res = {r: [total.clone() if r == root else torch.zeros_like(x[r][0])] for r in m}
    elif c in ("reduce", "all_reduce"):
        big_g = g[root] if c == "reduce" else sum(g[r] for r in m)
        local = _local_derivatives(case.op, [x[r][0] for r in m])
        res = {r: [big_g * local[i]] for i, r in enumerate(m)}
    elif c == "reduce_scatter":
        res = {r: [] for r in m}
        per_slot = [_local_derivatives(case.op, [x[r][i] for r in m]) for i in range(n)]
        for j, r in enumerate(m):
            res[r] = [g[m[i]] * per_slot[i][j] for i in range(n)]
    elif c == "gather":
        res = {r: [g[root][i].clone()] for i, r in enumerate(m)}
    elif c == "scatter":
        res = {r: [torch.zeros_like(t) for t in x[r]] for r in m}
        res[root] = [g[m[i]].clone() for i in range(n)]
    elif c == "all_gather":
        res = {r: [sum(g[q][i] for q in m)] for i, r in enumerate(m)}
    elif c == "all_gather_single":
        def part(t: torch.Tensor, i: int) -> torch.Tensor:
            if not case.shape:
                return t[i]
            k = case.shape[0]
            return t[i * k:(i + 1) * k]
        res = {r: [sum(part(g[q], i) for q in m)] for i, r in enumerate(m)}
    elif c == "all_to_all":
        # rank j's block for rank i arrived as rank i's j-th result
        res = {r: [g[m[i]][j].clone() for i in range(n)] for j, r in enumerate(m)}
    elif c == "all_to_all_single":
        rows = case.rows
        received = {m[i]: _chunks_dim0(g[m[i]], [rows[j][i] for j in range(n)]) for i in range(n)}
        res = {r: [torch.cat([received[m[i]][j] for i in range(n)])] for j, r in enumerate(m)}
    return res


def _compare_rules(case: Case, ref: dict[int, list[torch.Tensor]], doc: dict[int, list[torch.Tensor]]) -> str:
    """Empty when the reference VJP equals the documented rule, else what differs (a spec/suite bug)."""
    for r in case.members:
        for k, (a, b) in enumerate(zip(ref[r], doc[r])):
            if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-9, atol=1e-12):
                err = (a - b).abs().max().item() if a.shape == b.shape and a.numel() else float("nan")
                return (f"the spec's reference VJP and the documented backward rule disagree on rank {r}, "
                        f"input {k} (max |diff| {err:.3g}); the spec or the suite is wrong, not the implementation")
    return ""


# ---------------------------------------------------------------------------
# comparing
# ---------------------------------------------------------------------------
def _first_mismatch(actual: torch.Tensor, expected: torch.Tensor, bad: torch.Tensor) -> str:
    idx = tuple(int(i) for i in bad.nonzero()[0]) if bad.dim() else ()
    a = actual[idx].item() if actual.dim() else actual.item()
    e = expected[idx].item() if expected.dim() else expected.item()
    where = f"[{', '.join(map(str, idx))}]" if idx else ""
    return f"element{where}: got {a!r}, expected {e!r}"


def _compare(actual: torch.Tensor, expected: torch.Tensor, exact: bool, rtol: float, atol: float) -> str:
    """Empty when ``actual`` matches ``expected`` (exactly, or within tolerance), else the first difference."""
    a = _up(actual)
    e = expected if expected.dtype == a.dtype else expected.to(a.dtype)
    if a.shape != e.shape:
        return f"shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    if a.numel() == 0:
        return ""
    if exact or not (a.is_floating_point() or a.is_complex()):
        bad = a != e
    else:
        bad = ~((a - e).abs() <= atol + rtol * e.abs())
    if bool(bad.any()):
        msg = _first_mismatch(a, e, bad)
        if not exact and (a.is_floating_point() or a.is_complex()):
            msg += f"; max |diff| {(a - e).abs().max().item():.3g} > tolerance (rtol={rtol:.2g}, atol={atol:.2g})"
        return f"{int(bad.sum())} of {a.numel()} elements differ; first {msg}"
    return ""


def _max_abs(ts: Any) -> float:
    vals = [t.abs().max().item() for t in _flat_tensors(ts) if t.numel()
            and (t.is_floating_point() or t.is_complex())]
    return max(vals, default=0.0)


def _flat_tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _flat_tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _flat_tensors(v)]
    return []


def _normalise_reason(text: str) -> str:
    """A grouping key for an error message: first line, numbers and shapes blanked, bounded length."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    line = re.sub(r"0x[0-9a-f]+", "0x…", line)
    line = re.sub(r"\d+", "N", line)
    line = re.sub(r"\[N(?:, N)*\]|\(N(?:, N)*,?\)", "(…)", line)  # shapes and rank lists of any length
    return line[:140]


def _diagnose(actual: torch.Tensor, expected: torch.Tensor, n: int) -> str:
    """A short pattern of a mismatch, shared by similar failures (so they group): zeros, a constant factor."""
    a, e = _up(actual).reshape(-1), expected.reshape(-1).to(_up(actual).dtype)
    if a.numel() == 0 or a.shape != e.shape or not (a.is_floating_point() or a.is_complex()):
        return ""
    a_zero, e_zero = bool((a == 0).all()), bool((e == 0).all())
    if a_zero and not e_zero:
        return "got zeros"
    if e_zero and not a_zero:
        return "expected zeros"
    ee = (e.conj() * e).sum().real.item() if e.is_complex() else (e * e).sum().item()
    if ee == 0:
        return ""
    c = ((e.conj() * a).sum() if e.is_complex() else (e * a).sum()).item() / ee
    resid = (a - c * e).abs().max().item()
    if resid <= 1e-3 * max(a.abs().max().item(), 1e-30) and abs(c - 1) > 1e-3:
        for name, val in ((f"W={n}", n), (f"1/W=1/{n}", 1 / n), ("-1", -1)):
            if abs(c - val) < 1e-3 * max(1.0, abs(val)):
                return f"off by a factor {name}"
        return "off by a constant factor" if a.numel() >= 2 else ""
    return ""


# ---------------------------------------------------------------------------
# the check
# ---------------------------------------------------------------------------
def check_case(case: Case, outcomes: Sequence[RankOutcome] | dict[int, RankOutcome], *,
               timed_out: bool = False, runner_note: str = "", device: str = "cpu") -> Verdict:
    """Compare every member's outcome with the expectations, stage by stage (see :data:`STAGES`)."""
    by_rank = outcomes if isinstance(outcomes, dict) else {o.rank: o for o in outcomes}
    v = _check_runs(case, by_rank, timed_out, runner_note)
    if v is not None:
        return v
    exp = expectation(case)
    if exp.problem:
        return Verdict("error", "gradient", "reference and documented rule disagree (spec or suite bug)", exp.problem)
    for check in (_check_shape, _check_dtype, _check_values, _check_gradient):
        v = check(case, by_rank, exp, device)
        if v is not None:
            if check is _check_values:
                # the cause is the values; still say whether the gradient would pass, it is often a separate bug
                later = _check_gradient(case, by_rank, exp, device)
                if later is not None:
                    v.also = later.cause
                    v.detail += f"\n(the gradient stage fails too: {later.cause}: {later.detail.splitlines()[0]})"
            return v
    return Verdict("passed")


def _check_runs(case: Case, by_rank: dict[int, RankOutcome], timed_out: bool, note: str) -> Verdict | None:
    raised = {r: o for r, o in sorted(by_rank.items()) if o.failed}
    silent = [r for r in range(case.world_size) if r not in by_rank]
    lines = []
    for r, o in raised.items():
        lines.append(f"rank {r} raised in {o.stage}: {o.error_type}: {o.error}")
    for r, o in sorted(by_rank.items()):
        lines.extend(f"rank {r}: {n}" for n in o.notes)
    if silent:
        lines.append(f"ranks {silent} never returned (still waiting inside a collective)")
    if note:
        lines.append(note)
    if raised:
        first = next(iter(raised.values()))
        reason = f"{first.stage} raised {first.error_type}: {_normalise_reason(first.error or '')}"
        if timed_out or silent:
            # the ranks that did not raise were still waiting for the ones that did
            reason = f"timed out: {reason} on some ranks, the others hung"
        tb = first.traceback or ""
        return Verdict("failed", "runs", reason, "\n".join(lines) + ("\n--- first traceback:\n" + tb if tb else ""))
    if timed_out or silent:
        return Verdict("failed", "runs", "timed out", "\n".join(lines) or "no rank answered within the timeout")
    missing = [r for r in case.members if r not in by_rank]
    if missing:
        return Verdict("error", "runs", "runner lost ranks", f"no outcome from members {missing}")
    return None


def _check_shape(case: Case, by_rank: dict[int, RankOutcome], exp: Expectation, device: str) -> Verdict | None:
    tuple_out = case.spec.tuple_output
    for r in case.members:
        y = by_rank[r].outputs
        want = output_shapes(case, r)
        if tuple_out:
            if not isinstance(y, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in y):
                return Verdict("failed", "shape", "result is not a sequence of tensors",
                               f"rank {r} returned {type(y).__name__}; expected a tuple of {case.group_size} tensors")
            if len(y) != len(want):
                return Verdict("failed", "shape", "wrong number of results",
                               f"rank {r} returned {len(y)} tensors; expected {len(want)}")
            for i, (t, s) in enumerate(zip(y, want)):
                if tuple(t.shape) != tuple(s):
                    return Verdict("failed", "shape", "wrong result shape",
                                   f"rank {r} result[{i}] has shape {tuple(t.shape)}; expected {tuple(s)}")
        else:
            if not isinstance(y, torch.Tensor):
                return Verdict("failed", "shape", "result is not a tensor",
                               f"rank {r} returned {type(y).__name__}; expected a tensor")
            if tuple(y.shape) != tuple(want):
                return Verdict("failed", "shape", "wrong result shape",
                               f"rank {r} result has shape {tuple(y.shape)}; expected {tuple(want)}")
    return None


def _check_dtype(case: Case, by_rank: dict[int, RankOutcome], exp: Expectation, device: str) -> Verdict | None:
    want = case.torch_dtype
    for r in case.members:
        devs = by_rank[r].output_devices
        if devs and any(d != device for d in devs):
            return Verdict("failed", "dtype", "result on the wrong device",
                           f"rank {r} results are on {devs}; the inputs were on {device}")
    for r in case.members:
        for i, t in enumerate(_flat(by_rank[r].outputs)):
            if t.dtype != want:
                where = f"result[{i}]" if case.spec.tuple_output else "result"
                return Verdict("failed", "dtype", "wrong result dtype",
                               f"rank {r} {where} has dtype {t.dtype}; expected {want}")
    return None


def _check_values(case: Case, by_rank: dict[int, RankOutcome], exp: Expectation, device: str) -> Verdict | None:
    for r in case.members:
        if by_rank[r].mutated:
            return Verdict("failed", "values", "input modified in place",
                           f"rank {r} changed {', '.join(by_rank[r].mutated)}; inputs must never be mutated")
    exact = case.op in _EXACT_OPS or case.op is None or case.dtype in ("int64", "bool")
    scale = max(_max_abs(exp.inputs), _max_abs(exp.outputs))
    rtol, atol = tolerance(case.dtype, case.group_size, scale)
    for r in case.members:
        got, want = _flat(by_rank[r].outputs), _flat(exp.outputs[r])
        zero_rule = case.collective in ("reduce", "gather") and r != case.root
        for i, (a, e) in enumerate(zip(got, want)):
            where = f"result[{i}]" if case.spec.tuple_output else "result"
            if zero_rule:
                if a.numel() and bool((a != 0).any()):
                    return Verdict("failed", "values", f"{case.collective}: non-root result is not zeros",
                                   f"rank {r} (not the root {case.root}) {where}: the documented result off the "
                                   f"root is exactly zeros; got {a.flatten()[:6].tolist()}")
                continue
            diff = _compare(a, e, exact, rtol, atol)
            if diff:
                hint = _diagnose(a, e, case.group_size)
                return Verdict("failed", "values", "result differs from the reference" + (f" ({hint})" if hint else ""),
                               f"rank {r} {where}: {diff}")
    return None


def _check_gradient(case: Case, by_rank: dict[int, RankOutcome], exp: Expectation, device: str) -> Verdict | None:
    if not case.differentiable:
        return None
    n = case.group_size
    g_scale = _max_abs(exp.upstream) * max(1.0, _max_abs(exp.inputs)) ** (n - 1 if case.op == "PRODUCT" else 1)
    rtol, atol = tolerance(case.dtype, n, max(g_scale, _max_abs(exp.grads)))
    for r in case.members:
        o = by_rank[r]
        want = exp.grads[r]
        if o.grads is None or (want and len(o.grads) != len(want)):
            return Verdict("failed", "gradient", "no gradient returned",
                           f"rank {r}: {'; '.join(o.notes) or 'the backward produced no gradients'}")
        for k, (a, e) in enumerate(zip(o.grads, want)):
            name = "input" if len(want) == 1 else f"input[{k}]"
            if a is None:
                if e.numel() and bool((e != 0).any()):
                    return Verdict("failed", "gradient", "gradient missing (None)",
                                   f"rank {r} {name}.grad is None; expected a nonzero gradient")
                continue
            if tuple(a.shape) != tuple(e.shape):
                return Verdict("failed", "gradient", "wrong gradient shape",
                               f"rank {r} {name}.grad has shape {tuple(a.shape)}; expected {tuple(e.shape)}")
            if a.dtype != case.torch_dtype:
                return Verdict("failed", "gradient", "wrong gradient dtype",
                               f"rank {r} {name}.grad has dtype {a.dtype}; expected {case.torch_dtype}")
    # the documented exact zeros
    if case.collective == "broadcast" or (case.collective == "scatter" and case.offroot == "tensors"):
        for r in case.members:
            if r == case.root:
                continue
            for k, a in enumerate(by_rank[r].grads):
                if a is not None and a.numel() and bool((a != 0).any()):
                    return Verdict("failed", "gradient", f"{case.collective}: gradient off the src is not exactly zero",
                                   f"rank {r} (src is {case.root}) input[{k}].grad = {a.flatten()[:6].tolist()}; "
                                   "the documented gradient off src is exactly 0")
    # the reference VJP
    for r in case.members:
        for k, (a, e) in enumerate(zip(by_rank[r].grads, exp.grads[r])):
            if a is None:
                continue
            diff = _compare(a, e, False, rtol, atol)
            if diff:
                name = "input" if len(exp.grads[r]) == 1 else f"input[{k}]"
                hint = _diagnose(a, e, case.group_size)
                role = ""
                if case.root is not None:
                    role = " at the root" if r == case.root else " off the root"
                return Verdict("failed", "gradient",
                               "gradient differs from the reference VJP" + (f" ({hint}{role})" if hint else ""),
                               f"rank {r} {name}.grad: {diff}")
    if case.dtype not in ("float64", "complex128"):
        return None
    if case.spec.is_linear(None if case.op is None else ReduceOp[case.op]):
        return _check_adjoint(case, by_rank, exp)
    if case.dtype == "float64":
        return _check_finite_differences(case, by_rank, exp)
    return None


def _vdot_re(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = _up(a).reshape(-1), _up(b).reshape(-1)
    if a.is_complex() or b.is_complex():
        return torch.vdot(a.to(torch.complex128), b.to(torch.complex128)).real.item()
    return torch.dot(a, b).item()


def _check_adjoint(case: Case, by_rank: dict[int, RankOutcome], exp: Expectation) -> Verdict | None:
    """sum_r <A(x)_r, g_r> == sum_r <x_r, A*(g)_r> with the implementation's gradients as A*.

    ``A(x)`` is the reference's result (the implementation's own equals it whenever the values
    stage passed), so a wrong forward is never blamed on the gradient.
    """
    lhs = mag = 0.0
    for r in case.members:
        for y, g in zip(_flat(exp.outputs[r]), _flat(exp.upstream[r])):
            lhs += _vdot_re(g, y)
            mag += _up(g).abs().sum().item() * _up(y).abs().max().item() if y.numel() else 0.0
    rhs = 0.0
    for r in case.members:
        for x, a in zip(exp.inputs[r], by_rank[r].grads):
            if a is not None and a.numel():
                rhs += _vdot_re(a, x)
                mag += _up(a).abs().sum().item() * x.abs().max().item()
    if abs(lhs - rhs) > 1e-9 * max(1.0, mag):
        return Verdict("failed", "gradient", "adjoint identity violated",
                       f"sum_r <A(x)_r, g_r> = {lhs!r} but sum_r <x_r, A*(g)_r> = {rhs!r} "
                       f"(|diff| {abs(lhs - rhs):.3g})")
    return None


def _has_near_ties(case: Case, exp: Expectation) -> bool:
    if case.op not in ("MIN", "MAX"):
        return False
    m = case.members
    slots = ([[exp.inputs[r][0] for r in m]] if case.collective != "reduce_scatter"
             else [[exp.inputs[r][i] for r in m] for i in range(case.group_size)])
    for xs in slots:
        if len(xs) < 2 or xs[0].numel() == 0:
            continue
        s = torch.stack(xs).sort(dim=0, descending=case.op == "MAX").values
        if bool(((s[0] - s[1]).abs() < 1e-4).any()):
            return True
    return False


def _check_finite_differences(case: Case, by_rank: dict[int, RankOutcome], exp: Expectation) -> Verdict | None:
    """Central differences of F(x) = sum_r <ref(x)_r, g_r> along a random direction vs the gradients."""
    if _has_near_ties(case, exp):
        return None  # not differentiable at ties: the documented even split was checked instead
    gen = _generator(case, -1, "direction")
    direction = {r: [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in exp.inputs[r]]
                 for r in case.members}

    def world_loss(h: float) -> float:
        xs: list[Any] = []
        for r in case.members:
            moved = [t + h * d for t, d in zip(exp.inputs[r], direction[r])]
            if case.spec.list_input:
                xs.append(moved if moved else None)
            else:
                xs.append(moved[0])
        ys = _reference(case, xs)
        return sum(_vdot_re(g, y) for r, yr in zip(case.members, ys)
                   for y, g in zip(_flat(yr), _flat(exp.upstream[r])))

    h = 1e-6
    fd = (world_loss(h) - world_loss(-h)) / (2 * h)
    analytic = mag = 0.0
    for r in case.members:
        for a, d in zip(by_rank[r].grads, direction[r]):
            if a is not None and a.numel():
                analytic += _vdot_re(a, d)
                mag += (_up(a).abs() * d.abs()).sum().item()
    if not math.isfinite(fd) or abs(fd - analytic) > 1e-5 * max(1.0, mag, abs(fd)):
        return Verdict("failed", "gradient", "finite differences disagree",
                       f"directional derivative by central differences {fd!r}, from the gradients {analytic!r} "
                       f"(|diff| {abs(fd - analytic):.3g})")
    return None
