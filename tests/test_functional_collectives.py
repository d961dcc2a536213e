"""tensorplay.distributed.nn.functional on the simulator and on real gloo ranks.

Every test takes ``run_world(fn, W, *args)``, which runs ``fn(*args)`` on
every rank of a ``W``-rank world and returns the per-rank results: either
``simulator.run`` or a persistent gloo :class:`RankPool` (one per world size
1-4, started together on first use and kept for the module; all gloo tests
share the ``functional-gloo`` xdist group so one worker holds the pools).  Each test
batches its sub-cases into one call.

What is checked (helpers in test_functional_support.py): outputs and every
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
from tensorplay.distributed import DistValueError
from tensorplay.distributed.pool import RankPool
from test_functional_support import (COLLECTIVES, ERROR_CASES, REDUCING, ROOTED, Case, errors_body, example_body,
                                     hvp_body, hvp_inputs, hvp_loss, int_body, matrix, run_checked,
                                     scatter_torch_style_body)

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
    """Non-src ranks may pass a list, as torch's module wants; it is ignored and gets no gradient."""
    res = run_world(scatter_torch_style_body, 3)
    (y0, g0, rg0), (y2, g2, rg2) = res[0], res[2]
    assert torch.equal(y0, torch.full((2,), 20.0)) and torch.equal(y2, torch.full((2,), 21.0))
    assert rg0 and rg2
    assert g0 == [None, None]  # rank 0's list was never read
    assert torch.equal(g2[0], torch.full((2,), 1.0)) and torch.equal(g2[1], torch.full((2,), 3.0))


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
