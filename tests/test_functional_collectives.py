"""tensorplay.distributed.nn.functional on the simulator and on real gloo ranks.

Every test takes ``run_world(fn, W, *args)``, which runs ``fn(*args)`` on
every rank of a ``W``-rank world and returns the per-rank results: either
``simulator.run`` or a persistent gloo :class:`RankPool` (one per world size,
started on first use and kept for the module; all gloo tests share the
``functional-gloo`` xdist group so one worker holds the pools).  Each test
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
from dataclasses import replace
from typing import Any, Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import simulator
import tensorplay as tp
import tensorplay.distributed as dist
import tensorplay.distributed.nn.functional as df
from tensorplay.distributed import DistError, DistTypeError, DistValueError, ReduceOp
from tensorplay.distributed.pool import RankPool
from test_functional_support import COLLECTIVES, REDUCING, ROOTED, Case, matrix, run_checked

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
        t.join()


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

    gloo_world.backend = "gloo"  # type: ignore[attr-defined]
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
def example_body() -> tuple[torch.Tensor, torch.Tensor]:
    x = tp.randn(4, 8, requires_grad=True)
    y = df.all_reduce(x)
    y.sum().backward()
    return x.detach(), x.grad


def test_documented_example(run_world: Callable[..., list[Any]], request: pytest.FixtureRequest) -> None:
    for world in (*range(1, 9),) if request.node.callspec.params["run_world"] == "sim" else (1, 2, 3, 4):
        res = run_world(example_body, world)
        for x, grad in res:
            assert torch.equal(grad, torch.full((4, 8), float(world))), (world, grad)


# ---------------------------------------------------------------------------
# 6. double backward: Hessian-vector products through all_reduce(SUM) and all_gather
# ---------------------------------------------------------------------------
def _hvp_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(3, generator=g, dtype=torch.float64)
    c = torch.randn(3, generator=g, dtype=torch.float64)
    v = torch.randn(3, generator=g, dtype=torch.float64)
    return x, c, v


def _hvp_loss(kind: str, y: Any, c: torch.Tensor) -> torch.Tensor:
    if kind == "all_reduce":
        return (c * y ** 3).sum()
    return sum((c * (k + 1) * t ** 3).sum() for k, t in enumerate(y))  # type: ignore[return-value]


def hvp_body(kind: str, spec: tuple[int, ...] | None) -> Any:
    group = dist.new_group(list(spec)) if spec is not None else None
    rank = dist.get_rank()
    if spec is not None and rank not in spec:
        return None
    x, c, v = _hvp_inputs(rank)
    x.requires_grad_()
    y = df.all_reduce(x, group=group) if kind == "all_reduce" else df.all_gather(x, group=group)
    (gx,) = torch.autograd.grad(_hvp_loss(kind, y, c), x, create_graph=True)
    (hv,) = torch.autograd.grad(gx, x, v)
    return gx.detach(), hv


def _hvp_reference(kind: str, members: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = [_hvp_inputs(r) for r in members]
    xs = [d[0].clone().requires_grad_() for d in data]
    if kind == "all_reduce":
        s = sum(xs)
        loss = sum(_hvp_loss(kind, s, d[1]) for d in data)
    else:
        loss = sum(_hvp_loss(kind, xs, d[1]) for d in data)
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
def int_body() -> list[Any]:
    r = dist.get_rank()
    w = dist.get_world_size()
    x = torch.arange(4) + 10 * r
    out = [df.all_reduce(x), df.all_reduce(x, op=ReduceOp.BXOR), df.broadcast(x, 0), *df.all_gather(x),
           df.reduce(x, 0, op=ReduceOp.MAX), df.all_to_all_single(None, torch.arange(2 * w) + r)]
    b = torch.tensor([r % 2 == 0, True])
    out.append(df.all_reduce(b, op=ReduceOp.BAND))
    assert not any(t.requires_grad for t in out)
    return out


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


#: (call, expected error type, words the message must contain); every rank makes the same call
ERROR_CASES: list[tuple[str, Callable[[], Any], type, tuple[str, ...]]] = [
    ("max-complex", lambda: df.all_reduce(torch.ones(2, dtype=torch.complex128, requires_grad=True), op=ReduceOp.MAX),
     DistTypeError, ("all_reduce", "MAX", "complex", "Fix:")),
    ("band-requires-grad", lambda: df.all_reduce(torch.ones(2, requires_grad=True), op=ReduceOp.BAND),
     DistTypeError, ("all_reduce", "BAND has no gradient", "requires_grad=True", "Fix:")),
    ("bor-reduce-scatter-grad", lambda: df.reduce_scatter(None, [torch.ones(1, requires_grad=True)] * dist.get_world_size(),
                                                          op=ReduceOp.BOR), DistTypeError, ("reduce_scatter", "no gradient")),
    ("avg-int", lambda: df.all_reduce(torch.ones(2, dtype=torch.int64), op=ReduceOp.AVG),
     DistTypeError, ("AVG", "int64", "Fix:")),
    ("min-complex-reduce", lambda: df.reduce(torch.ones(2, dtype=torch.complex128), 0, op="min"),
     DistTypeError, ("reduce", "MIN")),
    ("unknown-op", lambda: df.all_reduce(torch.ones(2), op="median"), DistValueError, ("unknown reduce op",)),
    ("src-not-member", lambda: df.broadcast(torch.ones(2), 5), DistValueError, ("broadcast", "src=5", "group_ranks")),
    ("no-dst", lambda: df.reduce(torch.ones(2)), DistValueError, ("reduce", "no dst")),
    ("src-and-group-src", lambda: df.broadcast(torch.ones(2), 0, group_src=0), DistValueError, ("both src",)),
    ("bad-splits", lambda: df.all_to_all_single(None, torch.ones(3), [1, 2], [2, 2]), DistValueError,
     ("input_split_sizes", "sum")),
    ("gather-list-len", lambda: df.all_to_all(None, [torch.ones(1)]), DistValueError, ("input_tensor_list", "one tensor per group rank")),
    ("ags-bad-output", lambda: df.all_gather_single(torch.empty(7), torch.ones(2)), DistValueError,
     ("all_gather_single", "output.shape=(7,)")),
    ("scatter-none-on-src", lambda: df.scatter(None, 0), DistValueError, ("scatter",)),
    ("not-a-tensor", lambda: df.all_reduce([1.0]), DistTypeError, ("tensor must be a torch.Tensor",)),
]


def errors_body() -> list[tuple[str, str, str]]:
    out = []
    for name, fn, _, _ in ERROR_CASES:
        try:
            fn()
        except DistError as e:
            out.append((name, type(e).__name__, str(e)))
        else:
            out.append((name, "no error", ""))
    return out


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
    return Case(name, world, group, root, op, shape, dtype, noncontig=draw(st.booleans()),
                grad_noncontig=draw(st.booleans()), splits=splits, ragged=ragged, values=values,
                out_given=ragged or draw(st.booleans()), seed=draw(st.integers(0, 3)))


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
