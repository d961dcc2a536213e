"""Test helper: the autograd-collective cases, rank bodies and references (this module holds no tests).

The pieces, in the order a check uses them:

* :class:`Case`: one call of one collective at one world size (group, root,
  op, shape, dtype, layouts, splits).  Its ``id`` reproduces it.
* :func:`inputs` / :func:`upstream`: every member's input and upstream
  gradient, built from ``(case, global rank)`` alone, so the ranks and the
  test process derive the same values independently.  Inputs and gradients
  differ per rank and per element; MIN/MAX cases may hold ties, PRODUCT cases
  zeros.
* :func:`rank_batch`: what every rank runs (a simulator thread or a gloo
  process): for each case, call the collective, check the inputs were not
  written, run the backward with this rank's gradient, and report outputs and
  input gradients (plus the forward at ``x +- h*d`` for the directional check).
* :func:`reference`: the world function in plain torch loops, written here
  without the library's code; :func:`check_case` differentiates it with
  torch.autograd and compares every rank, then runs the cross-rank
  dot-product identity (linear collectives) or a central finite difference
  along a random direction (PRODUCT/MIN/MAX) on the ranks' own results.
"""
from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple, Sequence

import torch

import tensorplay as tp
import tensorplay.distributed as dist
import tensorplay.distributed.nn.functional as df
from tensorplay.distributed import DistError, DistTypeError, DistValueError, ReduceOp


class Kind(NamedTuple):
    """What a case needs to know about a collective: its root argument (``None``: not rooted) and whether
    it takes a reduce op."""

    root: str | None = None
    reduces: bool = False


#: every autograd collective, each named once (written here, not read from the product: this is the oracle)
KINDS: dict[str, Kind] = {
    "broadcast": Kind(root="src"),
    "reduce": Kind(root="dst", reduces=True),
    "all_reduce": Kind(reduces=True),
    "gather": Kind(root="dst"),
    "scatter": Kind(root="src"),
    "all_gather": Kind(),
    "all_gather_single": Kind(),
    "reduce_scatter": Kind(reduces=True),
    "all_to_all": Kind(),
    "all_to_all_single": Kind(),
}
COLLECTIVES = tuple(KINDS)
#: collectives that take a reduce op
REDUCING = tuple(name for name, kind in KINDS.items() if kind.reduces)
#: rooted collective -> the name of its root argument
ROOTED = {name: kind.root for name, kind in KINDS.items() if kind.root is not None}
DTYPES = {"f64": torch.float64, "c128": torch.complex128, "i64": torch.int64, "f32": torch.float32,
          "bool": torch.bool}
FD_STEP = 1e-6


@dataclass(frozen=True)
class Case:
    """One call.  ``group`` is new_group's argument (global ranks, any order) or None for the world;
    ``root`` a global rank; ``splits`` (all_to_all_single) row counts ``splits[i][j]`` sent from group
    rank i to group rank j, or None for equal splits; ``ragged`` (all_to_all) gives each pair its own
    row count; ``values`` is "random", "ties" (small integers: MIN/MAX ties, PRODUCT zeros) or
    "distinct" (no ties anywhere: the finite-difference check is valid)."""

    name: str
    world: int
    group: tuple[int, ...] | None = None
    root: int | None = None
    op: str | None = None
    shape: tuple[int, ...] = (3, 2)
    dtype: str = "f64"
    noncontig: bool = False
    grad_noncontig: bool = False
    splits: tuple[tuple[int, ...], ...] | None = None
    ragged: bool = False
    values: str = "random"
    out_given: bool = True
    stacked: bool = False
    seed: int = 0

    @property
    def members(self) -> list[int]:
        return list(range(self.world)) if self.group is None else sorted(self.group)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def differentiable(self) -> bool:
        return DTYPES[self.dtype].is_floating_point or DTYPES[self.dtype].is_complex

    @property
    def linear(self) -> bool:
        return self.op in (None, "SUM", "AVG")

    @property
    def id(self) -> str:
        parts = [self.name, f"W{self.world}", "world" if self.group is None else "g" + "_".join(map(str, self.group))]
        if self.root is not None:
            parts.append(f"{ROOTED[self.name]}{self.root}")
        if self.op:
            parts.append(self.op)
        parts += ["x".join(map(str, self.shape)) or "0d", self.dtype]
        if self.noncontig:
            parts.append("nc")
        if self.grad_noncontig:
            parts.append("gnc")
        if self.splits is not None:
            parts.append("splits" + "/".join(".".join(map(str, r)) for r in self.splits))
        if self.ragged:
            parts.append("ragged")
        if self.values != "random":
            parts.append(self.values)
        if not self.out_given:
            parts.append("out=None")
        if self.stacked:
            parts.append("stacked")
        if self.seed:
            parts.append(f"s{self.seed}")
        return "-".join(parts)


# ---------------------------------------------------------------------------
# deterministic per-rank data
# ---------------------------------------------------------------------------
def _gen(case: Case, *key: Any) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(zlib.crc32(repr((case.id, key)).encode()))
    return g


def _make(case: Case, shape: Sequence[int], key: tuple, noncontig: bool, kind: str | None = None) -> torch.Tensor:
    """A tensor of ``shape`` for ``key``; non-contiguous (every other element of a wider buffer) if asked."""
    dtype = DTYPES[case.dtype]
    full = (*shape, 2) if noncontig else tuple(shape)
    g = _gen(case, *key)
    kind = kind or case.values
    if dtype == torch.bool:
        t = torch.randint(0, 2, full, generator=g).bool()
    elif not (dtype.is_floating_point or dtype.is_complex):
        t = torch.randint(-4, 5, full, generator=g).to(dtype)
    elif kind == "ties":
        re = torch.randint(-2, 3, full, generator=g).to(torch.float64)
        t = re if not dtype.is_complex else torch.complex(re, torch.randint(-1, 2, full, generator=g).double())
    elif kind == "distinct":
        # a rank-specific offset keeps every pair of ranks at least 0.01 apart: no ties, smooth MIN/MAX
        n = int(torch.Size(full).numel())
        base = torch.randperm(max(n, 1) * 64, generator=g)[:n].double().reshape(full) * 0.05
        t = base + 0.013 * (key[0] if isinstance(key[0], int) else 0)
    else:
        t = torch.randn(full, generator=g, dtype=torch.float64)
        if dtype.is_complex:
            t = torch.complex(t, torch.randn(full, generator=g, dtype=torch.float64))
    t = t.to(dtype)
    return t[..., 0] if noncontig else t


def block_rows(case: Case, i: int, j: int) -> int:
    """all_to_all: rows of the block group rank i sends to group rank j (ragged: 0-2 rows)."""
    if not case.ragged or not case.shape:
        return case.shape[0] if case.shape else -1
    return (i + 2 * j + case.seed) % 3


def block_shape(case: Case, i: int, j: int) -> tuple[int, ...]:
    if not case.shape:
        return ()
    return (block_rows(case, i, j), *case.shape[1:])


def split_lists(case: Case, i: int) -> tuple[list[int] | None, list[int] | None]:
    """all_to_all_single: (output_split_sizes, input_split_sizes) of group rank i."""
    if case.splits is None:
        return None, None
    n = case.size
    return [case.splits[j][i] for j in range(n)], [case.splits[i][j] for j in range(n)]


def a2a_rows(case: Case, i: int) -> tuple[int, int]:
    """all_to_all_single: (input rows, output rows) of group rank i."""
    if case.splits is None:
        return case.shape[0], case.shape[0]
    return sum(case.splits[i]), sum(case.splits[j][i] for j in range(case.size))


def inputs(case: Case, rank: int) -> Any:
    """Global rank ``rank``'s argument (a tensor, a list, or None for scatter's non-src ranks)."""
    i = case.members.index(rank)
    n = case.size
    nc = case.noncontig
    if case.name == "scatter":
        if rank != case.root:
            return None
        return [_make(case, case.shape, (rank, "x", k), nc) for k in range(n)]
    if case.name == "reduce_scatter":
        return [_make(case, case.shape, (rank, "x", k), nc) for k in range(n)]
    if case.name == "all_to_all":
        return [_make(case, block_shape(case, i, j), (rank, "x", j), nc) for j in range(n)]
    if case.name == "all_to_all_single":
        rows, _ = a2a_rows(case, i)
        return _make(case, (rows, *case.shape[1:]), (rank, "x"), nc)
    return _make(case, case.shape, (rank, "x"), nc)


def directions(case: Case, rank: int) -> Any:
    """A random direction shaped like the rank's input (the finite-difference check)."""
    x = inputs(case, rank)
    if x is None:
        return None
    if isinstance(x, list):
        return [_make(case, t.shape, (rank, "d", k), False, "random") for k, t in enumerate(x)]
    return _make(case, x.shape, (rank, "d"), False, "random")


def output_shapes(case: Case, rank: int) -> list[tuple[int, ...]]:
    i = case.members.index(rank)
    n, s = case.size, case.shape
    if case.name in ("gather", "all_gather"):
        return [s] * n
    if case.name == "all_gather_single":
        return [(n, *s) if case.stacked or not s else (n * s[0], *s[1:])]
    if case.name == "all_to_all":
        return [block_shape(case, j, i) for j in range(n)]
    if case.name == "all_to_all_single":
        return [(a2a_rows(case, i)[1], *s[1:])]
    return [s]


def upstream(case: Case, rank: int) -> list[torch.Tensor]:
    """The rank's upstream gradient, one per output (distinct per rank; non-contiguous if asked)."""
    return [_make(case, sh, (rank, "g", k), case.grad_noncontig, "random")
            for k, sh in enumerate(output_shapes(case, rank))]


# ---------------------------------------------------------------------------
# what every rank runs
# ---------------------------------------------------------------------------
_GROUP_CACHE: dict[Any, Any] = {}


def get_group(spec: tuple[int, ...] | None) -> Any:
    """``new_group(spec)`` (None: the world), called on every rank; cached per gloo process, fresh per
    simulated world (a simulated world lives for one run)."""
    if spec is None:
        return None
    if dist.get_backend() == "sim":
        return dist.new_group(list(spec))
    key = (dist.get_world_size(), spec)
    if key not in _GROUP_CACHE:
        _GROUP_CACHE[key] = dist.new_group(list(spec))
    return _GROUP_CACHE[key]


def _groups_for(cases: Sequence[Case]) -> dict[tuple[int, ...], Any]:
    """Create every subgroup the batch needs, on every rank, in one order."""
    return {spec: get_group(spec) for spec in sorted({c.group for c in cases if c.group is not None})}


def _leaves(x: Any) -> list[torch.Tensor]:
    if x is None:
        return []
    return list(x) if isinstance(x, list) else [x]


def call(case: Case, x: Any, group: Any, rank: int) -> Any:
    """Call the collective the way a user would (global roots, torch's argument order)."""
    op = getattr(dist.ReduceOp, case.op) if case.op else None
    n = case.name
    if n == "broadcast":
        return df.broadcast(x, case.root, group=group)
    if n == "reduce":
        return df.reduce(x, case.root, op=op, group=group)
    if n == "all_reduce":
        return df.all_reduce(x, op=op, group=group)
    if n == "gather":
        return df.gather(x, case.root, group=group)
    if n == "scatter":
        return df.scatter(x, case.root, group=group)
    if n == "all_gather":
        return df.all_gather(x, group=group)
    shapes = output_shapes(case, rank)
    dtype = DTYPES[case.dtype]
    if n == "all_gather_single":
        return df.all_gather_single(torch.empty(shapes[0], dtype=dtype) if case.out_given else None, x, group=group)
    if n == "reduce_scatter":
        return df.reduce_scatter(torch.empty(case.shape, dtype=dtype) if case.out_given else None, x, op=op,
                                 group=group)
    if n == "all_to_all":
        outs = [torch.empty(s, dtype=dtype) for s in shapes] if case.out_given else None
        return df.all_to_all(outs, x, group=group)
    if n == "all_to_all_single":
        out_s, in_s = split_lists(case, case.members.index(rank))
        return df.all_to_all_single(torch.empty(shapes[0], dtype=dtype) if case.out_given else None, x, out_s,
                                    in_s, group=group)
    raise ValueError(n)


def _as_list(y: Any) -> list[torch.Tensor]:
    return list(y) if isinstance(y, (list, tuple)) else [y]


def _shifted(x: Any, d: Any, h: float) -> Any:
    if isinstance(x, list):
        return [a + h * b for a, b in zip(x, d)]
    return x + h * d


@dataclass
class RankResult:
    outputs: list[torch.Tensor] | None = None
    grads: list[torch.Tensor | None] | None = None
    mutated: bool = False
    requires_grad: list[bool] = field(default_factory=list)
    plus: list[torch.Tensor] | None = None
    minus: list[torch.Tensor] | None = None


def rank_case(case: Case, group: Any) -> RankResult | None:
    rank = dist.get_rank()
    if rank not in case.members:
        return None
    x = inputs(case, rank)
    leaves = _leaves(x)
    if case.differentiable:
        for t in leaves:
            t.requires_grad_()
    before = [t.detach().clone() for t in leaves]
    y = call(case, x, group, rank)
    ys = _as_list(y)
    res = RankResult(outputs=[t.detach().clone() for t in ys], requires_grad=[t.requires_grad for t in ys])
    res.mutated = any(not torch.equal(a.detach(), b) for a, b in zip(leaves, before))
    if case.differentiable:
        # backward() (not autograd.grad): scatter's non-src ranks have no leaf but must still join
        torch.autograd.backward(ys, upstream(case, rank))
        res.grads = [None if t.grad is None else t.grad.clone() for t in leaves]
        if not case.linear and case.values == "distinct":
            d = directions(case, rank)
            with torch.no_grad():
                xd = [t.detach() for t in leaves] if isinstance(x, list) else (x.detach() if x is not None else None)
                res.plus = [t.clone() for t in _as_list(call(case, _shifted(xd, d, FD_STEP), group, rank))]
                res.minus = [t.clone() for t in _as_list(call(case, _shifted(xd, d, -FD_STEP), group, rank))]
    return res


def rank_batch(cases: Sequence[Case]) -> list[RankResult | None]:
    """Run every case on the calling rank (every rank of the world calls this with the same cases)."""
    groups = _groups_for(cases)
    return [rank_case(c, None if c.group is None else groups[c.group]) for c in cases]


# ---------------------------------------------------------------------------
# the independent reference: plain torch loops over every member's input
# ---------------------------------------------------------------------------
def _reduce(op: str, xs: list[torch.Tensor]) -> torch.Tensor:
    if op == "SUM":
        return functools.reduce(torch.add, xs) if xs[0].dtype != torch.bool else functools.reduce(torch.logical_or, xs)
    if op == "AVG":
        return functools.reduce(torch.add, xs) / len(xs)
    if op == "PRODUCT":
        return functools.reduce(torch.mul, xs) if xs[0].dtype != torch.bool else functools.reduce(torch.logical_and, xs)
    if op == "MIN":
        return torch.stack(xs).amin(0)  # amin/amax split the gradient evenly between ties
    if op == "MAX":
        return torch.stack(xs).amax(0)
    fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
    return functools.reduce(fn, xs)


def reference(case: Case, xs: list[Any]) -> list[list[torch.Tensor]]:
    """Every member's outputs (group-rank order) from every member's input ``xs``."""
    n, r = case.size, (case.members.index(case.root) if case.root is not None else None)
    name = case.name
    if name == "broadcast":
        return [[xs[r] * 1] for _ in range(n)]
    if name == "reduce":
        y = _reduce(case.op, xs)
        return [[y if i == r else torch.zeros_like(xs[i]).detach()] for i in range(n)]
    if name == "all_reduce":
        y = _reduce(case.op, xs)
        return [[y] for _ in range(n)]
    if name == "gather":
        return [[xs[j] * 1 if i == r else torch.zeros_like(xs[j]).detach() for j in range(n)] for i in range(n)]
    if name == "scatter":
        return [[xs[r][i] * 1] for i in range(n)]
    if name == "all_gather":
        return [[xs[j] * 1 for j in range(n)] for _ in range(n)]
    if name == "all_gather_single":
        y = torch.stack(xs) if case.stacked or not case.shape else torch.cat(xs)
        return [[y] for _ in range(n)]
    if name == "reduce_scatter":
        return [[_reduce(case.op, [xs[j][i] for j in range(n)])] for i in range(n)]
    if name == "all_to_all":
        return [[xs[j][i] * 1 for j in range(n)] for i in range(n)]
    if name == "all_to_all_single":
        rows = [[case.splits[i][j] if case.splits else case.shape[0] // n for j in range(n)] for i in range(n)]
        chunks = [list(torch.split(xs[i], rows[i])) for i in range(n)]
        return [[torch.cat([chunks[j][i] for j in range(n)])] for i in range(n)]
    raise ValueError(name)


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """Real inner product (complex: Re <a, b>), in float64."""
    return float(torch.vdot(a.reshape(-1).to(torch.complex128), b.reshape(-1).to(torch.complex128)).real)


def _same_values(a: torch.Tensor, b: torch.Tensor, case: Case) -> bool:
    if a.is_floating_point() or a.is_complex():
        return torch.allclose(a, b, **_tol(case))
    return torch.equal(a, b)


def _tol(case: Case) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if case.dtype == "f32" else {"rtol": 1e-10, "atol": 1e-10}


def check_case(case: Case, results: list[RankResult | None]) -> list[str]:
    """Compare every rank's results with the reference; return failure lines (empty: pass)."""
    problems: list[str] = []

    def fail(msg: str) -> None:
        problems.append(f"{case.id}: {msg}")

    mem = case.members
    xs = [inputs(case, r) for r in mem]
    leaves_per = [_leaves(x) for x in xs]
    if case.differentiable:
        for ls in leaves_per:
            for t in ls:
                t.requires_grad_()
    ref = reference(case, xs)
    got = [results[r] for r in mem]
    for r in range(case.world):
        if r not in mem and results[r] is not None:
            fail(f"non-member rank {r} returned a result")
    for i, (res, want) in enumerate(zip(got, ref)):
        where = f"rank {mem[i]} (group rank {i})"
        if res is None:
            fail(f"{where} returned nothing")
            continue
        if res.mutated:
            fail(f"{where}: the collective wrote into its input")
        if len(res.outputs) != len(want):
            fail(f"{where}: {len(res.outputs)} outputs, expected {len(want)}")
            continue
        for k, (a, b) in enumerate(zip(res.outputs, want)):
            if a.shape != b.shape or a.dtype != b.dtype:
                fail(f"{where} output {k}: shape/dtype {tuple(a.shape)}/{a.dtype}, expected {tuple(b.shape)}/{b.dtype}")
            elif not _same_values(a, b.detach(), case):
                fail(f"{where} output {k}: got {a.flatten()[:6].tolist()}, expected {b.detach().flatten()[:6].tolist()}")
        if case.differentiable and any(not rg for rg in res.requires_grad):
            fail(f"{where}: an output does not require grad, so this rank could not join the backward")
        if not case.differentiable and any(res.requires_grad):
            fail(f"{where}: an integer output requires grad")
    if problems or not case.differentiable:
        return problems
    # gradients: differentiate the reference world loss sum_i <y_i, g_i> with torch.autograd
    ys, gs = [], []
    for i, r in enumerate(mem):
        for y, g in zip(ref[i], upstream(case, r)):
            if y.requires_grad:
                ys.append(y)
                gs.append(g)
    flat_leaves = [t for ls in leaves_per for t in ls]
    want = torch.autograd.grad(ys, flat_leaves, gs, allow_unused=True) if ys and flat_leaves else []
    pos = 0
    for i, ls in enumerate(leaves_per):
        res = got[i]
        if len(res.grads) != len(ls):
            fail(f"rank {mem[i]}: {len(res.grads)} input gradients, expected {len(ls)}")
            pos += len(ls)
            continue
        for k, t in enumerate(ls):
            w = want[pos] if want[pos] is not None else torch.zeros_like(t)
            pos += 1
            a = res.grads[k]
            if a is None:
                a = torch.zeros_like(t)
            if a.shape != w.shape or not torch.allclose(a, w, **_tol(case)):
                fail(f"rank {mem[i]} grad of input {k}: got {a.flatten()[:6].tolist()}, "
                     f"expected {w.flatten()[:6].tolist()}")
    if problems:
        return problems
    # cross-rank identities on the ranks' own results
    lhs = sum(_dot(y, g) for i, r in enumerate(mem) for y, g in zip(got[i].outputs, upstream(case, r)))
    if case.linear:
        rhs = sum(_dot(t.detach(), (gr if gr is not None else torch.zeros_like(t)))
                  for i in range(len(mem)) for t, gr in zip(leaves_per[i], got[i].grads))
        if abs(lhs - rhs) > (1e-4 if case.dtype == "f32" else 1e-9) * (1 + abs(lhs)):
            fail(f"dot-product test: sum <A x, g> = {lhs!r} but sum <x, A* g> = {rhs!r}")
    elif case.values == "distinct":
        fd = sum(_dot((p - m) / (2 * FD_STEP), g) for i, r in enumerate(mem)
                 for p, m, g in zip(got[i].plus, got[i].minus, upstream(case, r)))
        dirs = [_leaves(directions(case, r)) for r in mem]
        an = sum(_dot(d, (gr if gr is not None else torch.zeros_like(d)))
                 for i in range(len(mem)) for d, gr in zip(dirs[i], got[i].grads))
        if abs(fd - an) > 1e-6 * (1 + abs(an)):
            fail(f"directional derivative: finite difference {fd!r} vs sum <d, grad> = {an!r}")
    return problems


def check_batch(cases: Sequence[Case], results_per_rank: list[list[RankResult | None]]) -> None:
    """Assert every case of a batch; the message lists every failing case with its id."""
    problems: list[str] = []
    for k, case in enumerate(cases):
        problems += check_case(case, [results_per_rank[r][k] for r in range(case.world)])
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:40])


# ---------------------------------------------------------------------------
# the case matrix
# ---------------------------------------------------------------------------
def group_specs(world: int) -> list[tuple[int, ...] | None]:
    """The world, and subgroups whose global ranks differ from their group ranks."""
    specs: list[tuple[int, ...] | None] = [None]
    if world >= 3:
        specs.append((2, 0))
    if world >= 4:
        specs.append((3, 1, 2))
    if world >= 8:
        specs.append((7, 2, 5, 4))
    return specs


def _roots(name: str, members: list[int]) -> list[int | None]:
    if name not in ROOTED:
        return [None]
    return sorted({members[0], members[-1]})


def _ops(name: str, dtype: str) -> list[str | None]:
    if name not in REDUCING:
        return [None]
    if dtype == "c128":
        return ["SUM", "AVG", "PRODUCT"]
    if dtype in ("i64", "bool"):
        return ["SUM", "MIN", "BAND"] if dtype == "i64" else ["BOR"]
    return ["SUM", "AVG", "PRODUCT", "MIN", "MAX"]


def _split_matrix(n: int, seed: int) -> tuple[tuple[int, ...], ...]:
    g = torch.Generator().manual_seed(1000 * n + seed)
    m = torch.randint(0, 3, (n, n), generator=g)
    return tuple(tuple(int(v) for v in row) for row in m)


def matrix(name: str, world: int) -> list[Case]:
    """The cases of one collective at one world size: groups x roots x ops x dtypes x shapes x layouts."""
    out: list[Case] = []
    for spec in group_specs(world):
        base = Case(name, world, spec)
        for root in _roots(name, base.members):
            for dtype, shapes in (("f64", [(3, 2), (), (0, 2)]), ("c128", [(2, 2)]), ("i64", [(3,)])):
                for op in _ops(name, dtype):
                    for shape in shapes:
                        if name == "all_to_all_single" and not shape:
                            continue
                        c = replace(base, root=root, op=op, shape=shape, dtype=dtype)
                        if name == "all_to_all_single":
                            c = replace(c, shape=(base.size * 2, *shape[1:]) if shape[0] else shape)
                        out.append(c)
                        if dtype == "f64" and shape == (3, 2):
                            out.append(replace(c, noncontig=True, grad_noncontig=True, out_given=False))
                            if op in ("MIN", "MAX", "PRODUCT"):
                                out.append(replace(c, values="ties"))
                                out.append(replace(c, values="distinct"))
        if name == "all_gather_single":
            out.append(replace(base, stacked=True, shape=(2, 3)))
            out.append(replace(base, stacked=True, shape=(0,), noncontig=True, grad_noncontig=True))
        if name == "all_to_all" and world == 4:
            # blocks big enough for the c10d backend's zero-copy path (W scatters), one non-contiguous
            out.append(replace(base, shape=(1 << 16,)))
            out.append(replace(base, shape=(1 << 15, 2), noncontig=True, grad_noncontig=True, seed=1))
        if name == "all_to_all":
            out.append(replace(base, ragged=True, shape=(2, 3)))
            out.append(replace(base, ragged=True, shape=(2, 3), seed=1, noncontig=True, grad_noncontig=True))
            out.append(replace(base, ragged=True, shape=(2,), dtype="c128"))
        if name == "all_to_all_single":
            for seed in (0, 1):
                out.append(replace(base, splits=_split_matrix(base.size, seed), shape=(0, 3), seed=seed))
            out.append(replace(base, splits=_split_matrix(base.size, 2), shape=(0, 2), noncontig=True,
                               grad_noncontig=True, out_given=False, seed=2))
    return out


def run_checked(run_world: Callable[..., list[Any]], cases: Sequence[Case], world: int) -> None:
    """Run ``cases`` (all at world size ``world``) in one call of the runner and check them."""
    check_batch(cases, run_world(rank_batch, world, list(cases)))


# ---------------------------------------------------------------------------
# rank-side bodies of the single-purpose tests (module level, so gloo ranks can import them)
# ---------------------------------------------------------------------------
def example_body(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    x = tp.randn(4, 8, requires_grad=True, device=device)
    y = df.all_reduce(x)
    y.sum().backward()
    return x.detach(), x.grad


def hvp_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(3, generator=g, dtype=torch.float64)
    c = torch.randn(3, generator=g, dtype=torch.float64)
    v = torch.randn(3, generator=g, dtype=torch.float64)
    return x, c, v


def hvp_loss(kind: str, y: Any, c: torch.Tensor) -> torch.Tensor:
    if kind == "all_reduce":
        return (c * y ** 3).sum()
    return sum((c * (k + 1) * t ** 3).sum() for k, t in enumerate(y))  # type: ignore[return-value]


def hvp_body(kind: str, spec: tuple[int, ...] | None) -> Any:
    group = get_group(spec)
    rank = dist.get_rank()
    if spec is not None and rank not in spec:
        return None
    x, c, v = hvp_inputs(rank)
    x.requires_grad_()
    y = df.all_reduce(x, group=group) if kind == "all_reduce" else df.all_gather(x, group=group)
    (gx,) = torch.autograd.grad(hvp_loss(kind, y, c), x, create_graph=True)
    (hv,) = torch.autograd.grad(gx, x, v)
    return gx.detach(), hv


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
    ("op-wrong-type", lambda: df.all_reduce(torch.ones(2), op=3), DistTypeError, ("all_reduce", "op=3", "Fix:")),
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


def scatter_torch_style_body() -> tuple[torch.Tensor, list[Any] | None, bool]:
    """torch-style scatter: non-src ranks pass a list too (its values unread); src is global rank 2 of [2, 0]."""
    group = get_group((2, 0))
    rank = dist.get_rank()
    if rank not in (0, 2):
        return torch.empty(0), None, False
    parts = [torch.full((2,), 10.0 * rank + i, requires_grad=True) for i in range(2)]
    y = df.scatter(parts, src=2, group=group)
    (y * (rank + 1)).sum().backward()
    return y.detach(), [p.grad for p in parts], y.requires_grad


# ---------------------------------------------------------------------------
# scatter: how non-src ranks take part in the backward (issue 12, item 3)
# ---------------------------------------------------------------------------
#: what a non-src rank passes and how it asks for gradients:
#: grad: a list that requires grad, ``torch.autograd.grad(y, list, g)`` (torch's convention);
#: inputs: the same list, ``torch.autograd.backward(y, g, inputs=list)``;
#: none: ``None``, ``torch.autograd.backward(y, g)``;
#: list_nograd: a list that does not require grad, ``y.backward(g)``
RECEIVER_STYLES = ("grad", "inputs", "none", "list_nograd")


@dataclass(frozen=True)
class ScatterCase:
    """One scatter: group (None: the world), src (global), whether src's blocks require grad, and the
    style of each member by group rank (src's entry is unused: src always calls autograd.grad)."""

    group: tuple[int, ...] | None
    src: int
    src_grad: bool
    styles: tuple[str, ...]


def scatter_blocks(rank: int, n: int) -> list[torch.Tensor]:
    """The list global rank ``rank`` passes: distinct per rank and per block."""
    return [torch.arange(3, dtype=torch.float64) * 0.25 + 100.0 * rank + 10.0 * k for k in range(n)]


def scatter_upstream(rank: int) -> torch.Tensor:
    """Global rank ``rank``'s upstream gradient of its scatter result."""
    return torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) * (rank + 1) + rank


def _scatter_one(case: ScatterCase, group: Any, rank: int) -> tuple[Any, ...] | None:
    members = list(range(dist.get_world_size())) if case.group is None else sorted(case.group)
    if rank not in members:
        return None
    n = len(members)
    style = "src" if rank == case.src else case.styles[members.index(rank)]
    want = case.src_grad if rank == case.src else style in ("grad", "inputs")
    xs = None if style == "none" else [t.requires_grad_(want) for t in scatter_blocks(rank, n)]
    y = df.scatter(xs, src=case.src, group=group)
    g = scatter_upstream(rank)
    try:
        if style in ("src", "grad"):
            got: list[Any] = list(torch.autograd.grad(y, xs, g))
        elif style == "inputs":
            torch.autograd.backward(y, g, inputs=xs)
            got = [t.grad for t in xs]
        else:
            y.backward(g)
            got = [None if t.grad is None else t.grad for t in xs or []]
    except RuntimeError as e:  # expected only when src's blocks do not require grad
        got = [type(e).__name__]
    return y.detach(), y.requires_grad, got


def scatter_receivers_body(cases: Sequence[ScatterCase]) -> list[tuple[Any, ...] | None]:
    """Every rank runs every case in order (the world's members and the others alike)."""
    groups = {spec: get_group(spec) for spec in sorted({c.group for c in cases if c.group is not None})}
    rank = dist.get_rank()
    return [_scatter_one(c, None if c.group is None else groups[c.group], rank) for c in cases]


def scatter_receivers_reference(case: ScatterCase, world: int) -> dict[int, tuple[torch.Tensor, list[Any]]]:
    """Per member: the expected result and input gradients, from a plain-torch world function
    (``y_i = src's block i``; world loss ``sum_i <y_i, g_i>``) differentiated by torch.autograd."""
    members = list(range(world)) if case.group is None else sorted(case.group)
    n = len(members)
    leaves = {r: [t.requires_grad_() for t in scatter_blocks(r, n)] for r in members}
    ys = [leaves[case.src][i] * 1.0 for i in range(n)]
    loss = sum((ys[i] * scatter_upstream(r)).sum() for i, r in enumerate(members))
    flat = [t for r in members for t in leaves[r]]
    grads = torch.autograd.grad(loss, flat, allow_unused=True, materialize_grads=True)
    per = {r: list(grads[k * n:(k + 1) * n]) for k, r in enumerate(members)}
    out = {}
    for i, r in enumerate(members):
        style = "src" if r == case.src else case.styles[i]
        if style == "none":
            want: list[Any] = []
        elif style == "list_nograd":
            want = [None] * n
        else:
            want = per[r]
        out[r] = (ys[i].detach(), want)
    return out


def scatter_hvp_body() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Second order through scatter with a list on every rank: loss_r = (r + 1) * sum(y_r ** 3)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    xs = [t.requires_grad_() for t in scatter_blocks(rank, n)]
    y = df.scatter(xs, src=n - 1)
    loss = (y ** 3).sum() * (rank + 1)
    first = torch.autograd.grad(loss, xs, create_graph=True)
    hv = torch.autograd.grad(first, xs, [scatter_upstream(rank) + k for k in range(n)])
    return [g.detach() for g in first], list(hv)
