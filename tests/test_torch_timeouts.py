"""Operations bounded by their process group's timeout, and gloo's monitored barrier, on simulated ranks.

torch bounds each operation by its group's timeout (``init_process_group(timeout=)``, ``new_group(timeout=)``,
``Work.wait(timeout)``); gloo fails the waiting rank with ``Timed out waiting ...`` and leaves the others alone.
The same programs on real gloo processes are torch's own tests (``distributed_test.py``'s
``test_barrier_timeout_global`` and ``test_monitored_barrier_gloo*``), whose verdicts on gloo and on both
isolations ``tests/test_torch_harness.py`` compares.  Here: when the error comes, what it is, who gets it.
"""
from __future__ import annotations

import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist

import simulator
from simulator.isolation import ISOLATIONS

TIMEOUT_S = 1.0


def _poll(seconds: float) -> None:
    """Wait outside torch.distributed the way harness barriers do: short sleeps in a loop."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.05)


def _rank0_waits_alone() -> tuple[str, float, str]:
    tdist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    if tdist.get_rank() != 0:
        _poll(3 * TIMEOUT_S)  # alive, busy elsewhere: not a deadlock, the timeout decides
        return "busy", 0.0, ""
    start = time.monotonic()
    try:
        tdist.barrier()
    except tdist.DistBackendError as e:  # torch's class: what a program catches on gloo
        return type(e).__name__, time.monotonic() - start, str(e)
    return "no error", time.monotonic() - start, ""


@pytest.mark.parametrize("isolation", ISOLATIONS)
@pytest.mark.parametrize("mode", ["coop", "threads"])
def test_a_group_timeout_fails_only_the_rank_that_waits(mode: str, isolation: str) -> None:
    out = simulator.run(_rank0_waits_alone, 3, mode=mode, isolation=isolation, timeout=120)
    kind, waited, text = out[0]
    assert kind == "OperationTimeoutError", out
    assert TIMEOUT_S <= waited < TIMEOUT_S + 5, out  # wall clock, as the deadline of a real group
    assert " Timed out waiting " in text and "barrier" in text and "timeout=" in text, text
    assert "process group's timeout" in text and "init_process_group" in text, text  # the setting that fired
    assert "group=[0, 1, 2]" in text, text
    assert [o[0] for o in out[1:]] == ["busy", "busy"]


def _wait_with_its_own_timeout() -> str:
    tdist.init_process_group("gloo")  # the group's default is 30 min: Work.wait's own bound decides
    x = torch.ones(2)
    if tdist.get_rank() == 1:
        _poll(3 * TIMEOUT_S)
        return "busy"
    work = tdist.all_reduce(x, async_op=True)
    try:
        work.wait(timedelta(seconds=TIMEOUT_S))
    except RuntimeError as e:
        # the bound that fired is Work.wait's, and so is the fix: the group's timeout was never reached
        told = "Timed out" in str(e) and "Work.wait" in str(e) and "init_process_group" not in str(e)
        return "timed out" if told else f"other: {e}"
    return "completed"


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_work_wait_takes_its_own_timeout(isolation: str) -> None:
    assert simulator.run(_wait_with_its_own_timeout, 2, isolation=isolation, timeout=120) == ["timed out", "busy"]


def _monitored(missing: tuple[int, ...], wait_all: bool, bound_s: float = TIMEOUT_S) -> str:
    tdist.init_process_group("gloo")
    r = tdist.get_rank()
    if r in missing:
        _poll(3 * TIMEOUT_S)
        return "absent"
    try:
        tdist.monitored_barrier(timeout=timedelta(seconds=bound_s), wait_all_ranks=wait_all)
    except RuntimeError as e:
        return str(e)
    return "passed"


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_monitored_barrier_passes_when_every_rank_arrives(isolation: str) -> None:
    # (a bound far above the barrier's cost: on a loaded machine a rank process may take a second to arrive)
    out = simulator.run(_monitored, 3, args=((), False, 30.0), isolation=isolation, timeout=120)
    assert out == ["passed"] * 3


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_monitored_barrier_names_the_first_missing_rank_and_the_others_name_rank_0(isolation: str) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = simulator.run(_monitored, 4, args=((2, 3), False), isolation=isolation, timeout=120)
    # the failed barrier's own messages stay pending, as gloo's: not the program's to match (no advice to post a recv)
    assert not [w for w in seen if "never met their peer" in str(w.message)], [str(w.message) for w in seen]
    assert "Rank 2 failed to pass monitoredBarrier in 1000 ms" in out[0], out
    assert out[1].startswith("Rank 1 successfully reached monitoredBarrier, but received errors while waiting "
                             "for send/recv from rank 0"), out
    assert out[2:] == ["absent", "absent"]


def test_monitored_barrier_with_wait_all_ranks_names_every_missing_rank() -> None:
    out = simulator.run(_monitored, 4, args=((1, 3), True), timeout=120)
    assert "Ranks 1, 3 failed to pass monitoredBarrier in 1000 ms" in out[0], out
    assert out[2].startswith("Rank 2 successfully reached monitoredBarrier"), out
