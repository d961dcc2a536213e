"""conformance.strategies draws valid cases; case ids round-trip; every rank's tensors follow the case."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance import strategies as cst
from conformance.cases import (
    COLLECTIVES,
    Case,
    CaseIdError,
    input_shapes,
    output_buffers,
    parse_case_id,
    rank_inputs,
    upstream_grads,
)
from conformance.suite import SuiteConfig, plan_cases
from tensorplay.distributed import spec
from tensorplay.distributed.reduce_op import ReduceOp, dtype_rule

FAST = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@FAST
@given(cst.cases())
def test_drawn_cases_are_valid_and_their_ids_round_trip(case: Case) -> None:
    assert parse_case_id(case.id()) == case
    sp = spec.SPECS[case.collective]
    if sp.root is not None:
        assert case.root in case.members
    if sp.takes_op:
        assert dtype_rule(ReduceOp[case.op], case.torch_dtype) is None
        assert ReduceOp[case.op] in sp.allowed_ops(case.torch_dtype)
    if case.group is not None:
        # a subgroup whose global ranks differ from its group ranks
        assert case.members != tuple(range(len(case.members)))
        assert len(case.members) < case.world_size


@FAST
@given(cst.cases())
def test_rank_tensors_are_deterministic_and_shaped_by_the_case(case: Case) -> None:
    for r in case.members:
        a, b = rank_inputs(case, r), rank_inputs(case, r)
        shapes = input_shapes(case, r)
        if shapes is None:
            assert a is None
            continue
        for x, y, s in zip(a if isinstance(a, list) else [a], b if isinstance(b, list) else [b],
                           shapes if isinstance(shapes, list) else [shapes]):
            assert torch.equal(x, y)
            assert tuple(x.shape) == tuple(s) and x.dtype == case.torch_dtype
            assert x.requires_grad == case.differentiable and x.is_leaf
            if case.layout == "strided" and x.numel() > 1 and x.shape[-1] > 1:
                assert not x.is_contiguous()
        g = upstream_grads(case, r)
        assert all(t.dtype == case.torch_dtype for t in (g if isinstance(g, tuple) else (g,)))
        output_buffers(case, r)  # builds without error
    if case.differentiable and len(case.members) > 1:
        # every rank's upstream gradient differs from the others'
        gs = [upstream_grads(case, r) for r in case.members]
        flat = [torch.cat([t.reshape(-1) for t in (g if isinstance(g, tuple) else (g,))]) for g in gs]
        if flat[0].numel():
            assert not all(torch.equal(flat[0], f) for f in flat[1:])


@pytest.mark.parametrize("w,kind", [(2, "subgroup"), (3, "subgroup"), (4, "subgroup"), (1, "world")])
def test_groups_strategy(w: int, kind: str) -> None:
    @settings(max_examples=50, database=None, deadline=None)
    @given(cst.groups(w, kind))
    def check(g):
        if kind == "world":
            assert g is None
        else:
            assert 0 < len(g) < w and sorted(g) != list(range(len(g))) and len(set(g)) == len(g)

    check()


def test_subgroup_of_one_rank_world_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="world_size=1"):
        cst.groups(1, "subgroup")


@FAST
@given(st.sampled_from(COLLECTIVES), st.data())
def test_strategies_cover_the_hard_shapes(collective: str, data: st.DataObject) -> None:
    case = data.draw(cst.cases(collective=collective, world_size=3))
    assert case.collective == collective and case.world_size == 3


def test_planning_is_deterministic_and_covers_every_cell() -> None:
    cfg = SuiteConfig(collectives=("reduce", "all_to_all_single"), ops=("MAX", "BAND"), examples=2).validate()
    a, b = plan_cases(cfg), plan_cases(cfg)
    assert [c.id() for c in a] == [c.id() for c in b]
    cells = {(c.collective, c.op, c.world_size, c.group_kind) for c in a}
    for w in (1, 2, 3, 4):
        for kind in ("world", "subgroup"):
            if kind == "subgroup" and w == 1:
                continue
            for row in (("reduce", "MAX"), ("reduce", "BAND"), ("all_to_all_single", None)):
                assert (*row, w, kind) in cells
    other = plan_cases(SuiteConfig(collectives=("reduce",), ops=("MAX",), examples=2, seed=1).validate())
    assert {c.id() for c in other} != {c.id() for c in a if c.collective == "reduce" and c.op == "MAX"}


@pytest.mark.parametrize("text,match", [
    ("nonsense,W=2", "must start with a collective"),
    ("reduce,W=2,root=0,op=AVG,dtype=int64,shape=2,seed=1", "not allowed"),
    ("broadcast,W=2,group=1,root=0,dtype=float64", "root=0 must be a global rank of the group"),
    ("all_to_all,W=2,rows=1.2,trailing=scalar", "2x2 matrix"),
    ("all_reduce,W=2,op=SUM,shape=2xq", "is not a shape"),
    ("all_reduce,W=2,op=SUM,colour=red", "unknown keys"),
])
def test_bad_case_ids_are_refused_with_the_reason(text: str, match: str) -> None:
    with pytest.raises(CaseIdError, match=match):
        parse_case_id(text)


def test_planning_does_not_depend_on_what_else_is_imported() -> None:
    import hashlib
    import subprocess
    import sys

    cfg = SuiteConfig(collectives=("broadcast", "all_to_all"), world_sizes=(3,), examples=3).validate()
    here = hashlib.md5("\n".join(c.id() for c in plan_cases(cfg)).encode()).hexdigest()
    code = ("import hashlib, conformance.__main__, conformance.plugin\n"
            "from conformance.suite import SuiteConfig, plan_cases\n"
            "cfg = SuiteConfig(collectives=('broadcast', 'all_to_all'), world_sizes=(3,), examples=3).validate()\n"
            "print(hashlib.md5('\\n'.join(c.id() for c in plan_cases(cfg)).encode()).hexdigest())\n")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert there.stdout.strip() == here, there.stderr
