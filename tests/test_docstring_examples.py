"""The public API's docstring examples are doctests, and they hold on the simulator and on gloo.

Every ``Example`` block of the docstrings listed in
``tests/_support/docexamples.py`` (``MODULES``) runs: ``(N ranks)`` blocks on N
simulated ranks (every rank checks every expected output), the others once in
this process.  The ``(N ranks)`` blocks run again on the session's N gloo
processes (``gloo`` marker), or, when they set up their own process group,
under torchrun (``slow``).  A failure names the example, shows its text, the
rank and doctest's diff.  The coverage tests make sure nothing is skipped
silently: every public function that shows an example is collected, every
example is in doctest form, no ``>>>`` line sits outside an example, every
public function has an example or a stated reason, and every collective of
the spec has an autograd example.
"""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import simulator
import tensorplay.distributed as dist
import tensorplay.distributed.nn.functional as df
from tensorplay.distributed.spec import SPECS
from tensorplay.testing.pool import RankError

from _support.net import torchrun
from _support import docexamples

EXAMPLES = docexamples.collect()
BY_ID = {ex.id: ex for ex in EXAMPLES}


#: examples that take more than a second or two: they run with the slow checks (``-m slow``)
SLOW = {
    "simulator.world.run#2": "four rank processes, each imports torch",
    "conformance.api.check": "a few hundred conformance cases",
}


#: examples not yet converted to doctests, in files outside this test's change (the proposed text is in the
#: change's report).  Strict: once converted, the entry fails until it is removed from here.
NOT_YET_DOCTESTS: dict[str, str] = {}


def _param(ex: docexamples.DocExample) -> object:
    marks = [pytest.mark.slow] if ex.id in SLOW else []
    if ex.id in NOT_YET_DOCTESTS:
        marks.append(pytest.mark.xfail(strict=True, reason=NOT_YET_DOCTESTS[ex.id]))
    return pytest.param(ex, id=ex.id, marks=marks)


@pytest.mark.parametrize("ex", [_param(ex) for ex in EXAMPLES])
def test_docstring_example(ex: docexamples.DocExample) -> None:
    if not ex.is_doctest:
        pytest.fail(f"{ex.id} ({ex.filename}:{ex.lineno}) is not written as a doctest ('>>>' lines):\n{ex.text}")
    try:
        docexamples.run_example(ex)
    except docexamples.DocExampleError as e:
        pytest.fail(str(e), pytrace=False)


# ---------------------------------------------------------------------------
# the same examples on real gloo processes: the simulator and gloo must agree on every claim
# ---------------------------------------------------------------------------
#: RPC examples start their own agents, which need a rendezvous the gloo pool's ranks do not have (RPC on real
#: processes is tests/test_rpc_transports.py's TensorPipe pool)
ON_GLOO = [ex for ex in EXAMPLES if ex.world_size and ex.is_doctest and not docexamples.manages_its_process_group(ex)
           and not ex.qualname.startswith("tensorplay.distributed.rpc")]
TORCHRUN = [ex for ex in EXAMPLES if ex.world_size and ex.is_doctest and docexamples.manages_its_process_group(ex)]


def _gloo_param(ex: docexamples.DocExample) -> object:
    return pytest.param(ex, id=ex.id, marks=[pytest.mark.gloo, pytest.mark.xdist_group(f"gloo-W{ex.world_size}")])


@pytest.mark.parametrize("ex", [_gloo_param(ex) for ex in ON_GLOO])
def test_docstring_example_on_gloo(ex: docexamples.DocExample, rank_pool) -> None:
    try:
        rank_pool(ex.world_size).run(docexamples.run_on_current_rank, ex)
    except RankError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.mark.gloo
@pytest.mark.slow  # a torchrun launch takes about ten seconds
@pytest.mark.parametrize("ex", TORCHRUN, ids=[ex.id for ex in TORCHRUN])
def test_torchrun_style_example_under_torchrun(ex: docexamples.DocExample) -> None:
    # examples that set up their own process group run as written, one torchrun process per rank
    proc = torchrun(str(Path(docexamples.__file__)), ex.id, nproc=ex.world_size, timeout=120)
    assert proc.returncode == 0, f"{ex.id} under torchrun:\n{proc.stdout}\n{proc.stderr}"


def test_every_example_is_a_doctest() -> None:
    known = [ex for ex in EXAMPLES if ex.id in NOT_YET_DOCTESTS]
    assert sorted(ex.id for ex in known) == sorted(NOT_YET_DOCTESTS)  # every entry names a collected example
    assert len(docexamples.format_problems(known)) == len(known)  # ... that still needs converting
    assert docexamples.format_problems([ex for ex in EXAMPLES if ex.id not in NOT_YET_DOCTESTS]) == []


def test_no_prompt_outside_an_example_block() -> None:
    assert docexamples.stray_prompts() == []


def test_slow_examples_exist() -> None:
    # a renamed or removed example must not leave a stale entry that would hide a new one under its id
    assert sorted(set(SLOW) - set(BY_ID)) == []


def _public_functions(module: object) -> dict[str, object]:
    return {name: getattr(module, name) for name in module.__all__  # type: ignore[attr-defined]
            if inspect.isfunction(getattr(module, name))}


@pytest.mark.parametrize("module", [dist, df, simulator],
                         ids=["tensorplay.distributed", "tensorplay.distributed.nn.functional", "simulator"])
def test_every_public_example_is_collected(module: object) -> None:
    collected = {ex.qualname for ex in EXAMPLES}
    with_example = {f"{fn.__module__}.{fn.__qualname__}" for fn in _public_functions(module).values()
                    if docexamples.documented_with_example(fn)}
    assert with_example, "the check found no example at all: the collector's notion of an example broke"
    assert sorted(with_example - collected) == []


def test_collectives_of_the_spec_have_an_autograd_example() -> None:
    shown = {ex.qualname.rsplit(".", 1)[-1] for ex in EXAMPLES
             if ex.qualname.startswith("tensorplay.distributed.nn.functional.") and ex.is_doctest}
    # all_gather_single's example stands for _all_gather_base too (the same function under torch's name)
    assert sorted(set(SPECS) - shown) == []


#: public functions without an example of their own, and why that is fine
NO_EXAMPLE = {
    "destroy_process_group": "shown in init_process_group's example",
    "get_process_group_ranks": "shown in new_group's example",
    "get_backend": "a one-line query",
    "get_world_size": "a one-line query",
    "is_available": "a one-line query",
    "is_initialized": "a one-line query",
    "register_backend": "documented in docs/design.md (where a new backend goes)",
    "_all_gather_base": "torch's name for all_gather_single, whose example it shares",
}


@pytest.mark.parametrize("module", [dist, df], ids=["tensorplay.distributed", "tensorplay.distributed.nn.functional"])
def test_every_public_function_has_an_example(module: object) -> None:
    without = sorted(name for name, fn in _public_functions(module).items()
                     if not docexamples.documented_with_example(fn))
    assert [n for n in without if n not in NO_EXAMPLE] == []
    # an entry for a function that now has an example (or is gone) is stale
    assert [n for n in NO_EXAMPLE if n not in without and n in module.__all__] == []  # type: ignore[attr-defined]


def test_a_false_example_fails_with_its_text_rank_and_diff() -> None:
    # the runner itself: a claim that holds on rank 0 only must fail on rank 1, naming it
    ex = docexamples.DocExample(
        qualname="tests.fake", index=0, count=1, header="Example (2 ranks)",
        text=">>> x = tp.tensor([float(dist.get_rank())])\n>>> dist.broadcast(x, src=0)\n"
             ">>> x.tolist() == [float(dist.get_rank())]\nTrue\n",
        world_size=2, filename="fake.py", lineno=1)
    with pytest.raises(docexamples.DocExampleError) as info:
        docexamples.run_example(ex)
    msg = str(info.value)
    assert info.value.rank == 1
    assert "docstring example tests.fake failed on rank 1 of a simulated world of 2" in msg
    assert ">>> x.tolist() == [float(dist.get_rank())]" in msg  # the example's text
    assert "Expected:\n    True\nGot:\n    False" in msg  # doctest's diff


def test_a_world_failure_names_the_example_and_the_rank() -> None:
    # rank 1 calls all_reduce with another shape: the simulator's mismatch report comes back as the example's
    ex = docexamples.DocExample(
        qualname="tests.fake_mismatch", index=0, count=1, header="Example (2 ranks)",
        text=">>> x = tp.zeros(1 + dist.get_rank())\n>>> dist.all_reduce(x)\n",
        world_size=2, filename="fake.py", lineno=1)
    with pytest.raises(docexamples.DocExampleError) as info:
        docexamples.run_example(ex)
    msg = str(info.value)
    assert "docstring example tests.fake_mismatch failed on rank" in msg
    assert ">>> dist.all_reduce(x)" in msg and "The simulated world failed" in msg
    assert "shape differs (rank 0: (1,); rank 1: (2,))" in msg
