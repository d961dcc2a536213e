"""The suite must be able to fail: torch.distributed.nn.functional on gloo shows its known defects.

Slow (minutes: every hung case waits for its timeout and the ranks are
restarted); the full report of this run is docs/torch-comparison.md.
"""
from __future__ import annotations

import warnings

import pytest

import conformance

pytestmark = [pytest.mark.slow, pytest.mark.gloo]


@pytest.fixture(scope="module")
def torch_result() -> conformance.Result:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return conformance.check(backend="gloo", impl="torch.distributed.nn.functional", examples=4)


def causes(result: conformance.Result, collective: str, op: str | None = None, kind: str | None = None) -> set[str]:
    return {r.verdict.cause for r in result.failures
            if r.case.collective == collective and (op is None or r.case.op == op)
            and (kind is None or r.case.group_kind == kind)}


def test_the_run_fails(torch_result: conformance.Result) -> None:
    assert torch_result.exit_code == 1
    c = torch_result.counts()
    assert c["failed"] > 0.25 * len(torch_result.results), torch_result.summary()


def test_sum_gradients_pass_but_non_sum_gradients_fail(torch_result: conformance.Result) -> None:
    assert not causes(torch_result, "all_reduce", "SUM") and not causes(torch_result, "all_reduce", "AVG")
    for op in ("PRODUCT", "MIN", "MAX"):
        assert any(c.startswith("gradient:") for c in causes(torch_result, "all_reduce", op)), op
    assert any("off by a factor W=" in c for c in causes(torch_result, "reduce_scatter", "AVG"))


def test_subgroup_failures(torch_result: conformance.Result) -> None:
    # broadcast's backward compares a global src with a group rank: the real src gets zeros
    assert any("got zeros at the root" in c or "off the src" in c
               for c in causes(torch_result, "broadcast", kind="subgroup"))
    assert not causes(torch_result, "broadcast", kind="world")
    for coll in ("gather", "scatter", "all_gather", "all_to_all"):
        assert causes(torch_result, coll, kind="subgroup"), coll
    assert any("is not part of group" in c for c in causes(torch_result, "all_gather", kind="subgroup"))


def test_all_gather_base_backward_raises_on_gloo(torch_result: conformance.Result) -> None:
    assert any("backward raised RuntimeError: Backend not supported" in c
               for c in causes(torch_result, "all_gather_single", kind="world"))


def test_ragged_all_to_all_is_bounded_and_reported(torch_result: conformance.Result) -> None:
    ragged = [r for r in torch_result.results if r.case.collective == "all_to_all" and r.case.group is None
              and len({v for row in r.case.rows for v in row}) > 1 and r.case.world_size > 1]
    failed = [r for r in ragged if r.status == "failed"]
    assert failed and all(r.verdict.cause.startswith("runs: timed out") for r in failed
                          if any(len(set(row)) > 1 for row in r.case.rows))


def test_every_failure_has_a_one_line_reproduction(torch_result: conformance.Result) -> None:
    for r in torch_result.failures:
        assert r.repro.startswith("python -m conformance --backend gloo --impl torch.distributed.nn.functional")
        assert "\n" not in r.repro and f"--case '{r.case.id()}'" in r.repro
