"""CI's conformance runs (issue 5): the default run (sim, CPU, world sizes 1-4, every collective and op)
and the same matrix on real gloo processes at world sizes 1-3.  Both must pass in full."""
from __future__ import annotations

import pytest

import conformance


def test_default_run_on_the_simulator_passes() -> None:
    result = conformance.check()
    assert len(result.results) > 1000  # the whole default matrix ran, not a sliver of it
    result.raise_for_failures()


@pytest.mark.gloo
@pytest.mark.xdist_group("conformance-gloo")
def test_gloo_at_world_sizes_up_to_3_passes() -> None:
    result = conformance.check(backend="gloo", world_sizes=(1, 2, 3))
    assert len(result.results) > 500
    result.raise_for_failures()
