"""Every registered differential case, at each of its world sizes, through each of its front doors.

The ``cases_*`` modules of this package are imported automatically; a test id reads
``<module>.<case>-W<world size>-<front door>``, e.g. ``c10d.all_reduce_sum-W2-torch``.
Tests that use gloo ranks carry ``gloo`` and ``xdist_group("gloo-W<n>")`` so that
``--dist loadgroup`` keeps each world size's pool on one worker.
"""
from __future__ import annotations

from typing import Iterator

import pytest

from . import harness

harness.load_cases()


def _params() -> Iterator[object]:
    for c, w, door in harness.iter_params(harness.REGISTRY.values()):
        marks: list[pytest.MarkDecorator] = []
        if c.gloo is None:
            marks += [pytest.mark.gloo, pytest.mark.xdist_group(f"gloo-W{w}")]
        if c.slow:
            marks.append(pytest.mark.slow)
        diagnosis = harness.divergence_for(c, w, door)
        if diagnosis:
            marks.append(pytest.mark.xfail(strict=True, reason=f"divergence: {diagnosis}"))
        yield pytest.param(c, w, door, id=harness.param_id(c, w, door), marks=marks)


@pytest.mark.parametrize(("c", "world_size", "door"), list(_params()))
def test_case(c: harness.Case, world_size: int, door: str, request: pytest.FixtureRequest, diff_device: str) -> None:
    pool_for = request.getfixturevalue("rank_pool") if c.gloo is None else None
    harness.check(c, world_size, door, pool_for, request.node.nodeid, diff_device)
