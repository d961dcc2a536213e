"""The conformance checker itself, without any implementation or process: fast.

A "perfect" implementation is simulated by handing the checker the
expectation's own results and gradients; each stage is then broken on purpose
and must be reported as that stage.  The suite's independent expectations
(reference VJP, documented rule, adjoint identity, finite differences) must
agree with one another on every case the strategies draw.
"""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance import strategies as cst
from conformance.cases import Case, output_shapes
from conformance.execute import RankOutcome
from conformance.expect import (
    _check_adjoint,
    _check_finite_differences,
    check_case,
    expectation,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def perfect(case: Case) -> dict[int, RankOutcome]:
    """Outcomes a conforming implementation would report (the expectation itself, in the case dtype)."""
    exp = expectation(case)
    dt = case.torch_dtype
    out = {}
    for r in range(case.world_size):
        if r not in case.members:
            out[r] = RankOutcome(rank=r, member=False)
            continue
        y = exp.outputs[r]
        y = tuple(t.to(dt) for t in y) if isinstance(y, tuple) else y.to(dt)
        grads = [g.to(dt) for g in exp.grads[r]] if case.differentiable else None
        out[r] = RankOutcome(rank=r, outputs=y, grads=grads)
    return out


@FAST
@given(cst.cases())
def test_expectations_agree_and_a_perfect_implementation_passes(case: Case) -> None:
    exp = expectation(case)
    assert exp.problem == "", exp.problem
    v = check_case(case, perfect(case))
    assert v.status == "passed", (case.id(), v.cause, v.detail)


@FAST
@given(cst.cases(dtype="float64"))
def test_scaled_gradients_fail_in_the_gradient_stage(case: Case) -> None:
    outs = perfect(case)
    exp = expectation(case)
    if not any(g.numel() and bool((g != 0).any()) for r in case.members for g in exp.grads[r]):
        return  # nothing to scale (empty tensors)
    for o in outs.values():
        if o.grads:
            o.grads = [g * 2 for g in o.grads]
    v = check_case(case, outs)
    assert v.status == "failed" and v.stage == "gradient", (case.id(), v.cause)


def test_each_stage_is_reported_first_failing_first() -> None:
    case = Case("reduce", 3, group=(2, 0), root=2, op="SUM", dtype="float64", shape=(2, 3), seed=5)
    # runs
    outs = perfect(case)
    outs[0] = RankOutcome(rank=0, stage="forward", error_type="ValueError", error="boom 12")
    v = check_case(case, outs)
    assert (v.stage, v.reason) == ("runs", "forward raised ValueError: boom N")
    v = check_case(case, {2: perfect(case)[2]}, timed_out=True)
    assert (v.stage, v.reason) == ("runs", "timed out") and "[0, 1]" in v.detail
    # shape, then dtype, then values
    outs = perfect(case)
    outs[2].outputs = outs[2].outputs[:1]
    assert check_case(case, outs).stage == "shape"
    outs = perfect(case)
    outs[2].outputs = outs[2].outputs.float()
    assert check_case(case, outs).stage == "dtype"
    outs = perfect(case)
    outs[2].outputs = outs[2].outputs + 1
    assert check_case(case, outs).cause == "values: result differs from the reference"
    outs = perfect(case)
    outs[0].outputs = outs[0].outputs + 1  # rank 0 is not the root: its result must be zeros
    assert check_case(case, outs).cause == "values: reduce: non-root result is not zeros"
    outs = perfect(case)
    outs[0].mutated = ["input"]
    assert check_case(case, outs).cause == "values: input modified in place"
    outs = perfect(case)
    outs[0].grads = [torch.zeros(2, 3, dtype=torch.float64)]
    assert check_case(case, outs).cause == "gradient: gradient differs from the reference VJP (got zeros off the root)"


def test_avg_without_one_over_w_is_named() -> None:
    case = Case("all_reduce", 4, group=(3, 1), op="AVG", dtype="float64", shape=(4,), seed=1)
    outs = perfect(case)
    for r in case.members:
        outs[r].grads = [g * 2 for g in outs[r].grads]
    v = check_case(case, outs)
    assert v.cause == "gradient: gradient differs from the reference VJP (off by a factor W=2)"


def test_broadcast_gradient_off_src_must_be_exactly_zero() -> None:
    case = Case("broadcast", 3, group=(2, 1), root=2, dtype="float64", shape=(3,), seed=2)
    outs = perfect(case)
    outs[1].grads = [torch.full((3,), 1e-300, dtype=torch.float64)]
    v = check_case(case, outs)
    assert v.cause == "gradient: broadcast: gradient off the src is not exactly zero"


def test_none_gradient_is_accepted_only_where_the_gradient_is_zero() -> None:
    case = Case("broadcast", 2, root=0, dtype="float64", shape=(2,), seed=3)
    outs = perfect(case)
    outs[1].grads = [None]
    assert check_case(case, outs).status == "passed"
    outs[0].grads = [None]
    assert check_case(case, outs).cause == "gradient: gradient missing (None)"


def test_adjoint_identity_catches_a_wrong_gradient() -> None:
    case = Case("all_to_all_single", 3, rows=((1, 0, 2), (2, 2, 0), (0, 1, 3)), splits="given", shape=(2,), seed=4)
    outs, exp = perfect(case), expectation(case)
    assert _check_adjoint(case, outs, exp) is None
    outs[1].grads = [g + 0.5 for g in outs[1].grads]
    v = _check_adjoint(case, outs, exp)
    assert v is not None and v.reason == "adjoint identity violated"


def test_finite_differences_catch_a_wrong_product_gradient() -> None:
    case = Case("all_reduce", 3, op="PRODUCT", dtype="float64", shape=(5,), values="zeros", seed=9)
    outs, exp = perfect(case), expectation(case)
    assert _check_finite_differences(case, outs, exp) is None
    # y / x_i instead of the exclusive product: wrong exactly where x_i == 0
    xs = [exp.inputs[r][0] for r in case.members]
    y = xs[0] * xs[1] * xs[2]
    g = sum(exp.upstream[r] for r in case.members)
    for i, r in enumerate(case.members):
        with torch.no_grad():
            outs[r].grads = [torch.nan_to_num(g * y / xs[i], nan=0.0, posinf=0.0, neginf=0.0)]
    assert any(bool((x == 0).any()) for x in xs)
    v = check_case(case, outs)
    assert v.stage == "gradient"


def test_ties_split_the_gradient_evenly() -> None:
    case = Case("all_reduce", 4, op="MAX", dtype="float64", shape=(6,), values="ties", seed=11)
    exp = expectation(case)
    stacked = torch.stack([exp.inputs[r][0] for r in case.members])
    assert bool(((stacked == stacked.amax(0)).sum(0) > 1).any()), "the case should contain ties"
    g = sum(exp.upstream[r] for r in case.members)
    for i, r in enumerate(case.members):
        m = (stacked[i] == stacked.amax(0)).double()
        assert torch.allclose(exp.grads[r][0], g * m / (stacked == stacked.amax(0)).sum(0))


@settings(max_examples=40, deadline=None, database=None)
@given(st.data())
def test_output_shapes_follow_the_spec_shape_rule(data: st.DataObject) -> None:
    case = data.draw(cst.cases())
    exp = expectation(case)
    for r in case.members:
        want = output_shapes(case, r)
        got = exp.outputs[r]
        if isinstance(got, tuple):
            assert tuple(tuple(t.shape) for t in got) == tuple(tuple(s) for s in want)
        else:
            assert tuple(got.shape) == tuple(want)
