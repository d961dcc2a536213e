"""tensorplay.distributed.nn.functional on the simulator and on real gloo ranks.

Every test takes ``run_world(fn, W, *args)``, which runs ``fn(*args)`` on
every rank of a ``W``-rank world and returns the per-rank results: either
``simulator.run`` or a persistent gloo :class:`RankPool` (one per world size
1-4, started together on first use and kept for the module; all gloo tests
share the ``functional-gloo`` xdist group so one worker holds the pools).  Each test
batches its sub-cases into one call.

What is checked (helpers in _support/functional.py): outputs and every
rank's input gradients against a single-process plain-torch reference
differentiated by torch.autograd, the cross-rank dot-product identity (or a
directional finite difference for PRODUCT/MIN/MAX), inputs left untouched,
and outputs requiring grad on every rank that must join the backward.
Run: ``pytest -n 2 --dist loadgroup tests/test_functional_*.py``.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import simulator
import tensorplay.distributed as dist
import tensorplay.distributed.nn.functional as df
from tensorplay.distributed import DistValueError
from tensorplay.testing import RankPool
from _support.functional import (COLLECTIVES, ERROR_CASES, REDUCING, ROOTED, Case, errors_body, example_body,
                                     hvp_body, hvp_inputs, hvp_loss, int_body, matrix, run_checked,
                                     RECEIVER_STYLES, ScatterCase, scatter_blocks, scatter_receivers_body, scatter_upstream,
                                     scatter_hvp_body, scatter_receivers_reference, scatter_torch_style_body)

CALL_TIMEOUT_S = float(os.environ.get("TENSORPLAY_TEST_CALL_TIMEOUT", "60"))
PG_TIMEOUT_S = float(os.environ.get("TENSORPLAY_TEST_PG_TIMEOUT", "30"))
GLOO = [pytest.mark.gloo, pytest.mark.xdist_group("functional-gloo")]


def sim_world(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    return simulator.run(fn, world, args=args)


def _each(pools: dict[int, RankPool], method: str) -> None:
    """Start or close every pool at once (starting is mostly ``import torch`` in each rank process)."""
    threads = [threading.Thread(target=getattr(p, method)) for p in pools.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600.0)  # each pool bounds its own start and close; this only keeps the wait finite
    stuck = [t for t in threads if t.is_alive()]
    assert not stuck, f"RankPool.{method} did not return within 600 s"


@pytest.fixture(scope="module")
def gloo_pools() -> Iterator[dict[int, RankPool]]:
    """A gloo RankPool per world size 1-4, started together on first use and kept for the module."""
    pools = {w: RankPool(w, call_timeout=CALL_TIMEOUT_S, pg_timeout=PG_TIMEOUT_S) for w in (1, 2, 3, 4)}
    _each(pools, "start")
    yield pools
    _each(pools, "close")


@pytest.fixture(params=["sim", pytest.param("gloo", marks=GLOO)])
def run_world(request: pytest.FixtureRequest) -> Callable[..., list[Any]]:
    """``run_world(fn, W, *args)`` on the simulator or on gloo (only the gloo variant starts processes)."""
    if request.param == "sim":
        return sim_world
    pools: dict[int, RankPool] = request.getfixturevalue("gloo_pools")

    def gloo_world(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
        return pools[world].run(fn, *args)

    return gloo_world


def worlds(request: pytest.FixtureRequest) -> tuple[int, ...]:
    return (1, 2, 3, 4, 8) if request.node.callspec.params["run_world"] == "sim" else (1, 2, 3, 4)


# ---------------------------------------------------------------------------
# 1-2. the case matrix: reference gradients, dot-product identity, per collective
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", COLLECTIVES)
def test_matrix(run_world: Callable[..., list[Any]], name: str, request: pytest.FixtureRequest) -> None:
    for world in worlds(request):
        run_checked(run_world, matrix(name, world), world)


# ---------------------------------------------------------------------------
# 5. the documented example
# ---------------------------------------------------------------------------
def test_documented_example_cuda() -> None:
    """The same example with CUDA tensors on simulated ranks (skipped without a GPU)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for world in range(1, 9):
        for x, grad in simulator.run(example_body, world, args=("cuda",)):
            assert grad.device.type == "cuda"
            assert torch.equal(grad.cpu(), torch.full((4, 8), float(world)))


def test_documented_example(run_world: Callable[..., list[Any]], request: pytest.FixtureRequest) -> None:
    for world in (*range(1, 9),) if request.node.callspec.params["run_world"] == "sim" else (1, 2, 3, 4):
        res = run_world(example_body, world)
        for x, grad in res:
            assert torch.equal(grad, torch.full((4, 8), float(world))), (world, grad)


# ---------------------------------------------------------------------------
# 6. double backward: Hessian-vector products through all_reduce(SUM) and all_gather
# ---------------------------------------------------------------------------
def _hvp_reference(kind: str, members: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = [hvp_inputs(r) for r in members]
    xs = [d[0].clone().requires_grad_() for d in data]
    if kind == "all_reduce":
        s = sum(xs)
        loss = sum(hvp_loss(kind, s, d[1]) for d in data)
    else:
        loss = sum(hvp_loss(kind, xs, d[1]) for d in data)
    grads = torch.autograd.grad(loss, xs, create_graph=True)
    hv = torch.autograd.grad(grads, xs, [d[2] for d in data])
    return [(g.detach(), h) for g, h in zip(grads, hv)]


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather"])
def test_double_backward_hvp(run_world: Callable[..., list[Any]], kind: str, request: pytest.FixtureRequest) -> None:
    for world in worlds(request):
        for spec in [None, (2, 0), (3, 1, 2)]:
            if spec is not None and max(spec) >= world:
                continue
            members = list(range(world)) if spec is None else sorted(spec)
            res = run_world(hvp_body, world, kind, spec)
            for r, (g_want, h_want) in zip(members, _hvp_reference(kind, members)):
                g_got, h_got = res[r]
                torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-10)
                torch.testing.assert_close(h_got, h_want, rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------
# 6. integer passthrough, call-time errors
# ---------------------------------------------------------------------------
def test_integer_passthrough(run_world: Callable[..., list[Any]]) -> None:
    res = run_world(int_body, 3)
    x = [torch.arange(4) + 10 * r for r in range(3)]
    for r, out in enumerate(res):
        assert torch.equal(out[0], x[0] + x[1] + x[2])
        assert torch.equal(out[1], x[0] ^ x[1] ^ x[2])
        assert torch.equal(out[2], x[0])
        assert all(torch.equal(a, b) for a, b in zip(out[3:6], x))
        assert torch.equal(out[6], x[2] if r == 0 else torch.zeros(4, dtype=torch.int64))
        assert out[8].tolist() == [False, True]


def test_scatter_torch_style_lists(run_world: Callable[..., list[Any]]) -> None:
    """Non-src ranks may pass a list, as torch's module wants; its values are unread and its gradient is zero."""
    res = run_world(scatter_torch_style_body, 3)
    (y0, g0, rg0), (y2, g2, rg2) = res[0], res[2]
    assert torch.equal(y0, torch.full((2,), 20.0)) and torch.equal(y2, torch.full((2,), 21.0))
    assert rg0 and rg2
    assert all(torch.equal(g, torch.zeros(2)) for g in g0), g0  # rank 0's blocks reach no output
    assert torch.equal(g2[0], torch.full((2,), 1.0)) and torch.equal(g2[1], torch.full((2,), 3.0))


def _scatter_cases(world: int) -> list[ScatterCase]:
    """Every src of the world and of the subgroups that fit, with src's blocks requiring grad or not, under
    the issue's scenario (every non-src rank: autograd.grad on its own list) and under mixed styles."""
    groups: list[tuple[int, ...] | None] = [None] + [g for g in [(2, 0), (3, 1, 2)] if max(g) < world]
    out = []
    for group in groups:
        members = list(range(world)) if group is None else sorted(group)
        n = len(members)
        patterns = [("grad",) * n] + [tuple(RECEIVER_STYLES[(i + s) % 4] for i in range(n)) for s in range(4)]
        for src in members:
            for styles in patterns:
                out.append(ScatterCase(group, src, True, styles))
            out.append(ScatterCase(group, src, False, patterns[1]))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_scatter_receivers_join_the_backward(run_world: Callable[..., list[Any]], world: int) -> None:
    """Issue 12, item 3: non-src ranks that take gradients of their own list (torch's convention), with
    ``autograd.grad``, ``backward(inputs=...)``, a list that does not require grad or ``None``, all join
    scatter's backward; src's blocks get every rank's gradient and the lists get zeros.  When src's
    blocks do not require grad, no rank's result does, whatever the lists, so nobody waits in a backward."""
    cases = _scatter_cases(world)
    res = run_world(scatter_receivers_body, world, cases)
    for k, case in enumerate(cases):
        want = scatter_receivers_reference(case, world)
        for r in range(world):
            got = res[r][k]
            if r not in want:
                assert got is None
                continue
            y, requires_grad, grads = got
            y_want, grads_want = want[r]
            assert torch.equal(y, y_want), (case, r, y, y_want)
            assert requires_grad is case.src_grad, (case, r)
            if not case.src_grad:
                assert grads == ["RuntimeError"], (case, r, grads)  # torch's own "does not require grad"
                continue
            assert len(grads) == len(grads_want), (case, r, grads)
            for a, b in zip(grads, grads_want):
                if b is None:
                    assert a is None, (case, r, grads)
                else:
                    assert a is not None and torch.equal(a, b), (case, r, grads, grads_want)


def test_scatter_hvp_through_lists(run_world: Callable[..., list[Any]]) -> None:
    """With a list on every rank, a Hessian-vector product goes through scatter: the non-src lists'
    (zero) first-order gradients come from the backward gather, so the second-order backward reaches
    every rank and nobody waits."""
    for world in (1, 2, 3, 4):
        src = world - 1
        res = run_world(scatter_hvp_body, world)
        xs = [t.requires_grad_() for t in scatter_blocks(src, world)]
        loss = sum((xs[i] ** 3).sum() * (i + 1) for i in range(world))  # rank i's loss uses src's block i
        first = torch.autograd.grad(loss, xs, create_graph=True)
        hv = torch.autograd.grad(first, xs, [scatter_upstream(src) + k for k in range(world)])
        for r, (g_got, h_got) in enumerate(res):
            g_want = [g.detach() for g in first] if r == src else [torch.zeros(3, dtype=torch.float64)] * world
            h_want = list(hv) if r == src else [torch.zeros(3, dtype=torch.float64)] * world
            for a, b in zip(g_got + h_got, g_want + h_want):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_scatter_non_src_bad_list_sim() -> None:
    """A non-src rank that passes something other than None or a list of tensors fails at the call,
    naming the call, the rank and the value, before it sends anything."""
    def body() -> None:
        r = dist.get_rank()
        df.scatter([torch.ones(1), torch.ones(1)] if r == 0 else [torch.ones(1), "x"], src=0)

    with pytest.raises(BaseException) as info:
        simulator.run(body, 2)
    text = "".join(str(e) for e in _leaf_errors(info.value))
    assert "nn.functional.scatter" in text and "rank 1" in text and "tensors[1]" in text, text


def _leaf_errors(e: BaseException) -> list[BaseException]:
    if isinstance(e, BaseExceptionGroup):
        return [x for sub in e.exceptions for x in _leaf_errors(sub)]
    return [e, *([e.__cause__] if e.__cause__ is not None else [])]


def test_call_time_errors(run_world: Callable[..., list[Any]]) -> None:
    res = run_world(errors_body, 2)
    for r, per_rank in enumerate(res):
        for (name, _, cls, words), (_, tname, text) in zip(ERROR_CASES, per_rank):
            assert tname == cls.__name__ or (tname == "RankNotInGroupError" and cls is DistValueError), \
                f"rank {r} {name}: {tname}: {text}"
            assert text.startswith("tensorplay.distributed.nn.functional."), text
            assert f"rank {r}" in text and "group [0, 1]" in text, text
            for w in words:
                assert w in text, f"rank {r} {name}: {w!r} not in {text!r}"


# ---------------------------------------------------------------------------
# 4. hypothesis: world sizes, groups, roots, ops, shapes, dtypes, splits
# ---------------------------------------------------------------------------
@st.composite
def cases(draw: st.DrawFn, max_world: int) -> Case:
    world = draw(st.integers(1, max_world))
    name = draw(st.sampled_from(COLLECTIVES))
    members = draw(st.one_of(st.none(), st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True)))
    group = None if members is None else tuple(members)
    ranks = sorted(group) if group else list(range(world))
    n = len(ranks)
    dtype = draw(st.sampled_from(["f64", "f64", "c128", "i64", "f32"]))
    root = draw(st.sampled_from(ranks)) if name in ROOTED else None
    op = None
    if name in REDUCING:
        choices = {"f64": ["SUM", "AVG", "PRODUCT", "MIN", "MAX"], "f32": ["SUM", "AVG", "MAX"],
                   "c128": ["SUM", "AVG", "PRODUCT"], "i64": ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]}
        op = draw(st.sampled_from(choices[dtype]))
    shape = tuple(draw(st.lists(st.integers(0, 3), min_size=0, max_size=3)))
    splits = None
    ragged = False
    if name == "all_to_all_single":
        if draw(st.booleans()):
            splits = tuple(tuple(draw(st.integers(0, 3)) for _ in range(n)) for _ in range(n))
            shape = (0, *shape[1:])
        else:
            shape = (n * draw(st.integers(0, 2)), *shape[1:])
    if name == "all_to_all" and shape:
        ragged = draw(st.booleans())
    values = draw(st.sampled_from(["random", "ties"])) if op in ("MIN", "MAX", "PRODUCT") else "random"
    out_given = ragged or draw(st.booleans())
    stacked = name == "all_gather_single" and out_given and draw(st.booleans())
    return Case(name, world, group, root, op, shape, dtype, noncontig=draw(st.booleans()),
                grad_noncontig=draw(st.booleans()), splits=splits, ragged=ragged, values=values,
                out_given=out_given, stacked=stacked, seed=draw(st.integers(0, 3)))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases(max_world=6))
def test_hypothesis_sim(case: Case) -> None:
    run_checked(sim_world, [case], case.world)


@pytest.mark.gloo
@pytest.mark.xdist_group("functional-gloo")
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases(max_world=4))
def test_hypothesis_gloo(case: Case, gloo_pools: dict[int, RankPool]) -> None:
    run_checked(lambda fn, w, *a: gloo_pools[w].run(fn, *a), [case], case.world)
