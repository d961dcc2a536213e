"""Hypothesis strategies for conformance cases (public: use them in your own property tests).

Every strategy here draws *valid* values by construction (no filtering), so
they compose and shrink well.  The main entry point is :func:`cases`::

    from hypothesis import given
    from conformance import strategies as cst

    @given(cst.cases(collective="reduce", world_size=4, group_kind="subgroup"))
    def test_my_backend(case):
        result = conformance.check(cases=[case], backend="sim")
        assert result.passed, result.report_markdown()

What the strategies cover (see docs/conformance.md):

* groups: the world, and subgroups whose global ranks differ from their group
  ranks (``[1]`` of 2, ``[2, 0]``, ``[3, 1, 2]``, ``[1, 3]`` ...), listed in any order;
* roots as global ranks of the group;
* dtypes allowed for the op (float64/float32/bfloat16/float16, complex128 for
  SUM/AVG/PRODUCT, int64/bool forward only);
* 0-d, empty and non-contiguous (strided) tensors;
* uneven and zero split sizes, ragged all_to_all blocks, ``None`` splits;
* ties for MIN/MAX and exact zeros for PRODUCT.
"""
from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from tensorplay.distributed import spec as _spec
from tensorplay.distributed.reduce_op import ReduceOp, dtype_rule

from .cases import A2A, COLLECTIVES, DTYPES, GROUP_KINDS, OPS, Case

__all__ = [
    "cases",
    "dtypes",
    "groups",
    "ops",
    "row_matrices",
    "shapes",
    "value_kinds",
    "world_sizes",
]

#: float64 drawn most often: it is the dtype with exact numerics (finite differences, adjoint identity)
_DTYPE_WEIGHTS = {"float64": 4, "float32": 2, "bfloat16": 1, "float16": 1, "complex128": 1, "int64": 1, "bool": 1}


def world_sizes(min_size: int = 1, max_size: int = 4) -> st.SearchStrategy[int]:
    """World sizes in ``[min_size, max_size]``."""
    if not 1 <= min_size <= max_size:
        raise ValueError(f"world_sizes: need 1 <= min_size <= max_size, got min_size={min_size}, max_size={max_size}")
    return st.integers(min_size, max_size)


def groups(world_size: int, kind: str = "any") -> st.SearchStrategy[tuple[int, ...] | None]:
    """A group of a ``world_size``-rank world: ``None`` (the world) or global ranks in drawn order.

    ``kind="subgroup"`` draws a proper subset that is not ``[0, 1, .., k-1]`` (so at least one
    member's global rank differs from its group rank), e.g. ``(2, 0)`` or ``(3, 1, 2)``; there is
    none for ``world_size=1``.  ``kind="world"`` always gives ``None``; ``"any"`` mixes both.
    """
    if kind not in (*GROUP_KINDS, "any"):
        raise ValueError(f"groups: kind={kind!r} must be 'world', 'subgroup' or 'any'")
    if kind == "world":
        return st.just(None)
    if world_size < 2:
        if kind == "subgroup":
            raise ValueError(f"groups: world_size={world_size} has no subgroup whose global ranks differ from "
                             "its group ranks; use world_size >= 2")
        return st.just(None)

    return _subgroup(world_size) if kind == "subgroup" else st.one_of(st.just(None), _subgroup(world_size))


@st.composite
def _subgroup(draw: Any, world_size: int) -> tuple[int, ...]:
    # groups of two or more first: a one-rank group is the degenerate case (every collective is a copy)
    size = draw(st.sampled_from([*range(2, world_size), 1]))
    members = draw(st.lists(st.integers(0, world_size - 1), min_size=size, max_size=size, unique=True))
    if sorted(members) == list(range(size)):
        # a prefix keeps global == group ranks; shift one member up to the first rank outside it
        members[members.index(size - 1)] = size
    return tuple(members)


def ops(collective: str) -> st.SearchStrategy[str | None]:
    """Reduce op names for ``collective`` (``None`` when it takes no op)."""
    if not _spec.SPECS[collective].takes_op:
        return st.just(None)
    return st.sampled_from(OPS)


def dtypes(collective: str, op: str | None = None) -> st.SearchStrategy[str]:
    """Dtype names allowed for ``op`` (all of :data:`conformance.cases.DTYPES` for collectives without an op)."""
    names = [d for d in DTYPES if op is None or dtype_rule(ReduceOp[op], DTYPES[d]) is None]
    if not names:
        raise ValueError(f"dtypes: no dtype is allowed for collective={collective!r} op={op!r}")
    weighted = [d for d in names for _ in range(_DTYPE_WEIGHTS[d])]
    return st.sampled_from(weighted)


def shapes(min_dims: int = 0, max_dims: int = 3, max_side: int = 3) -> st.SearchStrategy[tuple[int, ...]]:
    """Small shapes: mostly 1-3 dims of sides 1..``max_side``; 0-d and empty (a side of 0) now and then."""
    if not 0 <= min_dims <= max_dims:
        raise ValueError(f"shapes: need 0 <= min_dims <= max_dims, got min_dims={min_dims}, max_dims={max_dims}")
    # 1-d first (what hypothesis tries first and shrinks towards), 0-d about one draw in seven
    ndims = [d for d in (1, 2, 0, 3, 1, 2, 3) if min_dims <= d <= max_dims] or [min_dims]

    return _shape(tuple(ndims), max(1, max_side))


@st.composite
def _shape(draw: Any, ndims: tuple[int, ...], max_side: int) -> tuple[int, ...]:
    nd = draw(st.sampled_from(ndims))
    dims = [draw(st.integers(1, max_side)) for _ in range(nd)]
    if nd and draw(st.sampled_from(_EMPTY_ONE_IN_EIGHT)):
        dims[draw(st.integers(0, nd - 1))] = 0  # an empty tensor
    return tuple(dims)


_EMPTY_ONE_IN_EIGHT = (False,) * 7 + (True,)


def row_matrices(n: int, max_rows: int = 3, uniform: bool | None = None) -> st.SearchStrategy[tuple[tuple[int, ...], ...]]:
    """``n x n`` matrices of dim-0 row counts for the all-to-alls (uneven and zero entries included).

    ``uniform=True`` draws one count for every pair, ``False`` any matrix, ``None`` either.
    """
    same = st.builds(_uniform_rows, st.just(n), st.integers(0, max_rows))
    if uniform:
        return same
    ragged = st.lists(st.tuples(*[st.integers(0, max_rows)] * n), min_size=n, max_size=n).map(tuple)
    return ragged if uniform is False else st.one_of(same, ragged)


def _uniform_rows(n: int, k: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(k for _ in range(n)) for _ in range(n))


def value_kinds(op: str | None, dtype: str) -> st.SearchStrategy[str]:
    """``"ties"`` for MIN/MAX and ``"zeros"`` for PRODUCT half the time, else ``"random"``."""
    if dtype in ("int64", "bool"):
        return st.just("random")
    if op in ("MIN", "MAX"):
        return st.sampled_from(["random", "ties"])
    if op == "PRODUCT":
        return st.sampled_from(["random", "zeros"])
    return st.just("random")


@st.composite
def cases(draw: Any, collective: str | None = None, op: str | None = None, world_size: int | None = None,
          group_kind: str = "any", dtype: str | None = None, max_world_size: int = 4) -> Case:
    """A valid :class:`conformance.cases.Case`; fix any of the arguments to pin that dimension.

    ``op`` is only meaningful for reduce, all_reduce and reduce_scatter;
    ``group_kind`` is ``"world"``, ``"subgroup"`` or ``"any"``.
    """
    if collective is None:
        collective = draw(st.sampled_from(COLLECTIVES))
    elif collective not in COLLECTIVES:
        raise ValueError(f"cases: collective={collective!r} is unknown; known: {', '.join(COLLECTIVES)}")
    sp = _spec.SPECS[collective]
    if op is not None and not sp.takes_op:
        raise ValueError(f"cases: op={op!r} given, but collective={collective!r} takes no reduce op")
    if sp.takes_op and op is None:
        if dtype is None:
            op = draw(ops(collective))
        else:  # only the ops this dtype allows (the spec says which)
            op = draw(st.sampled_from([o.name for o in sp.allowed_ops(DTYPES[dtype])]))
    if world_size is None:
        lo = 2 if group_kind == "subgroup" else 1
        world_size = draw(world_sizes(lo, max(lo, max_world_size)))
    group = draw(groups(world_size, group_kind))
    members = tuple(range(world_size)) if group is None else tuple(sorted(group))
    n = len(members)
    root = draw(st.sampled_from(members)) if sp.root is not None else None
    if dtype is None:
        dtype = draw(dtypes(collective, op))
    elif op is not None and dtype_rule(ReduceOp[op], DTYPES[dtype]) is not None:
        raise ValueError(f"cases: op={op} does not allow dtype={dtype}")
    rows = splits = offroot = None
    if collective in A2A:
        uniform = None
        if collective == "all_to_all_single":
            splits = draw(st.sampled_from(["given", "given", "none"]))
            uniform = True if splits == "none" else None
        rows = draw(row_matrices(n, uniform=uniform))
        shape = draw(shapes(0, 2))
    else:
        shape = draw(shapes())
    if collective == "scatter":
        offroot = draw(st.sampled_from(["none", "tensors"]))
    strided_ok = collective in A2A or len(shape) >= 1
    layout = draw(st.sampled_from(["contiguous", "strided"])) if strided_ok else "contiguous"
    values = draw(value_kinds(op, dtype))
    seed = draw(st.integers(0, 2**31 - 1))
    return Case(collective=collective, world_size=world_size, group=group, root=root, op=op, dtype=dtype,
                shape=shape, rows=rows, splits=splits, layout=layout, values=values, offroot=offroot, seed=seed)
