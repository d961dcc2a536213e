"""One conformance case: what it is, how it is named, and how its tensors are built.

A :class:`Case` fixes everything a run needs: the collective, the world size,
the group (global ranks, in the order given to ``new_group``), the root (a
global rank), the reduce op, the dtype, the shapes (and the row matrix of the
all-to-alls), the memory layout, the kind of values and a data seed.  Every
rank builds its own tensors from the case alone (:func:`rank_inputs`,
:func:`upstream_grads`), so the parent that checks the results rebuilds exactly
the same tensors without receiving them.

A case has a one-line id (:meth:`Case.id`) that :func:`parse_case_id` turns back
into the identical case, independent of the hypothesis version that drew it::

    reduce,W=4,group=3.1.2,root=1,op=MAX,dtype=float64,shape=2x3,layout=strided,values=ties,seed=77

    python -m conformance --backend gloo --case 'reduce,W=4,group=3.1.2,...'

Shapes are written ``2x3``; ``scalar`` is the 0-d shape.  In the all-to-alls,
``rows=a.b.c_d.e.f_...`` is the matrix ``rows[j][i]`` = number of dim-0 rows
group rank ``j`` sends to group rank ``i`` and ``trailing`` the common
trailing shape of every block.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch

from tensorplay.distributed import spec as _spec

__all__ = [
    "COLLECTIVES",
    "DTYPES",
    "FLOAT_DTYPES",
    "GROUP_KINDS",
    "OPS",
    "Case",
    "CaseIdError",
    "cell_rows",
    "group_ranks_sorted",
    "is_differentiable",
    "output_buffers",
    "parse_case_id",
    "rank_inputs",
    "upstream_grads",
]

#: every collective the suite knows, in report order
COLLECTIVES: tuple[str, ...] = tuple(_spec.SPECS)
#: reduce op names, in report order
OPS: tuple[str, ...] = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
#: dtypes the suite draws (by torch name)
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "complex128": torch.complex128, "int64": torch.int64, "bool": torch.bool,
}
FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16", "complex128")
GROUP_KINDS = ("world", "subgroup")
LAYOUTS = ("contiguous", "strided")
VALUE_KINDS = ("random", "ties", "zeros")
A2A = ("all_to_all", "all_to_all_single")


class CaseIdError(ValueError):
    """A case id (or a Case built by hand) does not describe a valid case."""


def is_differentiable(dtype: str) -> bool:
    """Whether cases of ``dtype`` check gradients (floating and complex) or only the forward."""
    return dtype in FLOAT_DTYPES


def group_ranks_sorted(case: "Case") -> tuple[int, ...]:
    """Global ranks in group-rank order (torch's ``new_group`` sorts them)."""
    return tuple(range(case.world_size)) if case.group is None else tuple(sorted(case.group))


def cell_rows(collectives: tuple[str, ...] = COLLECTIVES, ops: tuple[str, ...] = OPS) -> list[tuple[str, str | None]]:
    """The (collective, op) rows of the report matrix; op is ``None`` for collectives without one."""
    rows: list[tuple[str, str | None]] = []
    for c in collectives:
        if _spec.SPECS[c].takes_op:
            rows.extend((c, op) for op in ops)
        else:
            rows.append((c, None))
    return rows


def _shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape) if shape else "scalar"


def _parse_shape(text: str, key: str) -> tuple[int, ...]:
    if text == "scalar":
        return ()
    try:
        dims = tuple(int(d) for d in text.split("x"))
    except ValueError:
        raise CaseIdError(f"{key}={text!r} is not a shape; write e.g. {key}=2x3, or {key}=scalar for 0-d") from None
    if any(d < 0 for d in dims):
        raise CaseIdError(f"{key}={text!r} has a negative dimension")
    return dims


@dataclass(frozen=True)
class Case:
    """One fully determined conformance case (see the module docstring).

    Attributes:
        collective: a name from :data:`COLLECTIVES`.
        world_size: number of ranks in the world.
        group: global ranks as passed to ``new_group`` (any order), or ``None`` for the world.
        root: ``src``/``dst`` as a global rank (collectives with a root), else ``None``.
        op: reduce op name (``"SUM"``...) for reduce, all_reduce and reduce_scatter, else ``None``.
        dtype: a key of :data:`DTYPES`.
        shape: every tensor's shape; for the all-to-alls the trailing shape of every block.
        rows: all-to-alls only: ``rows[j][i]`` dim-0 rows group rank j sends to group rank i.
        splits: all_to_all_single only: ``"given"`` passes both split lists, ``"none"`` passes ``None``
            (equal chunks; then every entry of ``rows`` is equal).
        layout: ``"contiguous"`` or ``"strided"`` (inputs are every-other-element views).
        values: ``"random"``, ``"ties"`` (MIN/MAX: small integers, so ranks tie) or ``"zeros"``
            (PRODUCT: some entries exactly zero, on one or several ranks).
        offroot: scatter only: what non-src ranks pass, ``"none"`` (``None``) or ``"tensors"``.
        seed: the data seed every rank derives its inputs and upstream gradients from.
    """

    collective: str
    world_size: int
    group: tuple[int, ...] | None = None
    root: int | None = None
    op: str | None = None
    dtype: str = "float64"
    shape: tuple[int, ...] = ()
    rows: tuple[tuple[int, ...], ...] | None = None
    splits: str | None = None
    layout: str = "contiguous"
    values: str = "random"
    offroot: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    # -- derived ------------------------------------------------------------------
    @property
    def group_kind(self) -> str:
        return "world" if self.group is None else "subgroup"

    @property
    def members(self) -> tuple[int, ...]:
        """Global ranks in group-rank order."""
        return group_ranks_sorted(self)

    @property
    def group_size(self) -> int:
        return len(self.members)

    @property
    def group_root(self) -> int | None:
        """The root as a group rank."""
        return None if self.root is None else self.members.index(self.root)

    @property
    def differentiable(self) -> bool:
        return is_differentiable(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def spec(self) -> _spec.CollectiveSpec:
        return _spec.SPECS[self.collective]

    # -- naming -------------------------------------------------------------------
    def id(self) -> str:
        """The one-line id :func:`parse_case_id` turns back into this case."""
        parts = [self.collective, f"W={self.world_size}",
                 "group=" + ("world" if self.group is None else ".".join(map(str, self.group)))]
        if self.root is not None:
            parts.append(f"root={self.root}")
        if self.op is not None:
            parts.append(f"op={self.op}")
        parts.append(f"dtype={self.dtype}")
        if self.rows is not None:
            parts.append("rows=" + "_".join(".".join(map(str, r)) for r in self.rows))
            parts.append(f"trailing={_shape_text(self.shape)}")
        else:
            parts.append(f"shape={_shape_text(self.shape)}")
        if self.splits is not None:
            parts.append(f"splits={self.splits}")
        parts.append(f"layout={self.layout}")
        parts.append(f"values={self.values}")
        if self.offroot is not None:
            parts.append(f"offroot={self.offroot}")
        parts.append(f"seed={self.seed}")
        return ",".join(parts)

    def __str__(self) -> str:
        return self.id()

    def describe(self) -> str:
        """Multi-line description: group ranks, and each member's argument shapes and dtypes."""
        lines = [
            f"collective={self.collective} world_size={self.world_size} "
            f"group={'world' if self.group is None else list(self.group)} "
            f"(group ranks -> global: {dict(enumerate(self.members))})",
        ]
        extra = []
        if self.root is not None:
            extra.append(f"root={self.root} (global; group rank {self.group_root})")
        if self.op is not None:
            extra.append(f"op=ReduceOp.{self.op}")
        extra += [f"dtype={self.dtype}", f"layout={self.layout}", f"values={self.values}", f"seed={self.seed}"]
        if self.splits is not None:
            extra.append(f"splits={self.splits}")
        if self.offroot is not None:
            extra.append(f"offroot={self.offroot}")
        lines.append(" ".join(extra))
        for gr, g in enumerate(self.members):
            lines.append(f"  rank {g} (group rank {gr}): {argument_signature(self, g)}")
        return "\n".join(lines)

    def with_(self, **changes: Any) -> "Case":
        return replace(self, **changes)

    # -- validation ----------------------------------------------------------------
    def validate(self) -> None:
        c = self.collective
        if c not in COLLECTIVES:
            raise CaseIdError(f"collective={c!r} is unknown; known: {', '.join(COLLECTIVES)}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise CaseIdError(f"W={self.world_size!r} must be an int >= 1")
        w = self.world_size
        if self.group is not None:
            g = self.group
            if not g or len(set(g)) != len(g) or any(not 0 <= r < w for r in g):
                raise CaseIdError(f"group={list(g)} must be distinct global ranks in [0, {w}) (W={w})")
        sp = _spec.SPECS[c]
        if sp.root is not None:
            if self.root not in self.members:
                raise CaseIdError(f"root={self.root} must be a global rank of the group {list(self.members)} "
                                  f"({c} needs a {sp.root})")
        elif self.root is not None:
            raise CaseIdError(f"root={self.root} given, but {c} has no root")
        if self.dtype not in DTYPES:
            raise CaseIdError(f"dtype={self.dtype!r} is unknown; known: {', '.join(DTYPES)}")
        if sp.takes_op:
            if self.op not in OPS:
                raise CaseIdError(f"op={self.op!r}: {c} needs one of {', '.join(OPS)}")
            from tensorplay.distributed.reduce_op import ReduceOp, dtype_rule

            why = dtype_rule(ReduceOp[self.op], self.torch_dtype)
            if why is not None:
                raise CaseIdError(f"op={self.op} with dtype={self.dtype} is not allowed: {why}")
        elif self.op is not None:
            raise CaseIdError(f"op={self.op} given, but {c} takes no reduce op")
        if c in A2A:
            n = self.group_size
            if self.rows is None or len(self.rows) != n or any(len(r) != n for r in self.rows):
                raise CaseIdError(f"{c} needs rows= as a {n}x{n} matrix (one row per group rank)")
            if any(v < 0 for r in self.rows for v in r):
                raise CaseIdError(f"rows={self.rows} must not be negative")
        elif self.rows is not None:
            raise CaseIdError(f"rows= given, but {c} is not an all-to-all")
        if c == "all_to_all_single":
            if self.splits not in ("given", "none"):
                raise CaseIdError(f"splits={self.splits!r} must be 'given' or 'none' for all_to_all_single")
            if self.splits == "none" and len({v for r in self.rows for v in r}) > 1:
                raise CaseIdError("splits=none needs equal rows everywhere (the implementation splits evenly)")
        elif self.splits is not None:
            raise CaseIdError(f"splits={self.splits} given, but {c} is not all_to_all_single")
        if c == "scatter":
            if self.offroot not in ("none", "tensors"):
                raise CaseIdError(f"offroot={self.offroot!r} must be 'none' or 'tensors' for scatter")
        elif self.offroot is not None:
            raise CaseIdError(f"offroot={self.offroot} given, but only scatter has off-root inputs")
        if self.layout not in LAYOUTS:
            raise CaseIdError(f"layout={self.layout!r} must be one of {LAYOUTS}")
        if self.values not in VALUE_KINDS:
            raise CaseIdError(f"values={self.values!r} must be one of {VALUE_KINDS}")
        if any(d < 0 for d in self.shape):
            raise CaseIdError(f"shape={self.shape} has a negative dimension")


def parse_case_id(text: str) -> Case:
    """The :class:`Case` named by ``text`` (the output of :meth:`Case.id`); raises :class:`CaseIdError`."""
    text = text.strip()
    head, _, rest = text.partition(",")
    if head not in COLLECTIVES:
        raise CaseIdError(f"case id must start with a collective name, got {head!r}; known: {', '.join(COLLECTIVES)}")
    fields: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq:
            raise CaseIdError(f"case id part {part!r} is not key=value")
        if key in fields:
            raise CaseIdError(f"case id gives {key}= twice")
        fields[key] = value
    known = {"W", "group", "root", "op", "dtype", "shape", "trailing", "rows", "splits", "layout", "values",
             "offroot", "seed"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise CaseIdError(f"case id has unknown keys {unknown}; known: {sorted(known)}")

    def as_int(key: str) -> int:
        try:
            return int(fields[key])
        except KeyError:
            raise CaseIdError(f"case id lacks {key}=") from None
        except ValueError:
            raise CaseIdError(f"{key}={fields[key]!r} is not an int") from None

    group = None
    if fields.get("group", "world") != "world":
        try:
            group = tuple(int(r) for r in fields["group"].split("."))
        except ValueError:
            raise CaseIdError(f"group={fields['group']!r}: write global ranks like group=3.1.2, or group=world") from None
    rows = None
    if "rows" in fields:
        try:
            rows = tuple(tuple(int(v) for v in r.split(".")) for r in fields["rows"].split("_"))
        except ValueError:
            raise CaseIdError(f"rows={fields['rows']!r}: write rows like 1.0_2.3 (row j = what rank j sends)") from None
        shape = _parse_shape(fields.get("trailing", "scalar"), "trailing")
    else:
        shape = _parse_shape(fields.get("shape", "scalar"), "shape")
    return Case(
        collective=head,
        world_size=as_int("W"),
        group=group,
        root=as_int("root") if "root" in fields else None,
        op=fields.get("op"),
        dtype=fields.get("dtype", "float64"),
        shape=shape,
        rows=rows,
        splits=fields.get("splits"),
        layout=fields.get("layout", "contiguous"),
        values=fields.get("values", "random"),
        offroot=fields.get("offroot"),
        seed=as_int("seed") if "seed" in fields else 0,
    )


# ---------------------------------------------------------------------------
# tensors of one rank, rebuilt from the case alone
# ---------------------------------------------------------------------------
def _generator(case: Case, rank: int, purpose: str) -> torch.Generator:
    # a stable hash (Python's hash() is salted per process)
    digest = hashlib.blake2b(f"{case.seed}/{rank}/{purpose}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def _values(case: Case, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Values (float64/complex128/int64/bool on CPU) for one input tensor of ``case``."""
    dt = case.dtype
    if dt == "bool":
        return torch.rand(shape, generator=gen, dtype=torch.float64) < 0.5
    if dt == "int64":
        lo, hi = (-2, 3) if case.op == "PRODUCT" else (-8, 9)
        return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64)
    if case.values == "ties":
        # few distinct small integers: ranks tie often, and every value is exact in every dtype
        v = torch.randint(-2, 3, shape, generator=gen).to(torch.float64)
    elif case.op == "PRODUCT":
        # magnitudes in [0.5, 2): products of up to 4 factors stay well scaled
        mag = 0.5 + 1.5 * torch.rand(shape, generator=gen, dtype=torch.float64)
        sign = torch.where(torch.rand(shape, generator=gen, dtype=torch.float64) < 0.5, -1.0, 1.0)
        v = mag * sign
    else:
        v = torch.randn(shape, generator=gen, dtype=torch.float64)
    if dt == "complex128":
        if case.op == "PRODUCT":
            phase = torch.rand(shape, generator=gen, dtype=torch.float64) * 6.283185307179586
            v = torch.polar(v.abs(), phase)
        else:
            v = torch.complex(v, torch.randn(shape, generator=gen, dtype=torch.float64))
    if case.values == "zeros":
        v = torch.where(torch.rand(shape, generator=gen, dtype=torch.float64) < 0.35, torch.zeros_like(v), v)
    return v


def _place(case: Case, values: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``values`` cast to the case dtype on ``device``, as a strided view when the layout asks for one."""
    t = values.to(case.torch_dtype)
    if case.layout == "strided" and t.dim() >= 1:
        big = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype)
        big[..., ::2] = t
        t = big.to(device)[..., ::2]
    else:
        t = t.to(device)
    return t


def _leaf(case: Case, values: torch.Tensor, device: torch.device | str, requires_grad: bool) -> torch.Tensor:
    t = _place(case, values, device)
    # detach() keeps the strides, so a strided input stays a non-contiguous leaf
    t = t.detach()
    if requires_grad:
        t.requires_grad_(True)
    return t


def block_shape(case: Case, sender: int, receiver: int) -> tuple[int, ...]:
    """All-to-alls: shape of the block group rank ``sender`` sends to group rank ``receiver``."""
    if case.rows is None:
        raise CaseIdError(f"block_shape: {case.collective} has no rows (only the all-to-alls do)")
    return (case.rows[sender][receiver], *case.shape)


def input_shapes(case: Case, global_rank: int) -> Any:
    """Shapes of ``global_rank``'s input argument: a shape, a list of shapes, or ``None``."""
    c, me = case.collective, case.members.index(global_rank)
    n = case.group_size
    if c == "all_to_all":
        return [block_shape(case, me, i) for i in range(n)]
    if c == "all_to_all_single":
        return (sum(case.rows[me]), *case.shape)
    if c == "reduce_scatter":
        return [case.shape] * n
    if c == "scatter":
        if me == case.group_root or case.offroot == "tensors":
            return [case.shape] * n
        return None
    return case.shape


def rank_inputs(case: Case, global_rank: int, device: torch.device | str = "cpu",
                requires_grad: bool | None = None) -> Any:
    """``global_rank``'s input argument for ``case``: a tensor, a list of tensors, or ``None``.

    Deterministic in (case, rank): the rank that runs the collective and the
    parent that checks it build bit-identical values.  Leaves require grad for
    floating and complex dtypes unless ``requires_grad`` says otherwise.
    """
    if requires_grad is None:
        requires_grad = case.differentiable
    gen = _generator(case, global_rank, "input")
    shapes = input_shapes(case, global_rank)
    if shapes is None:
        return None
    if isinstance(shapes, list):
        return [_leaf(case, _values(case, s, gen), device, requires_grad) for s in shapes]
    return _leaf(case, _values(case, shapes, gen), device, requires_grad)


def output_shapes(case: Case, global_rank: int) -> Any:
    """Expected shape(s) of ``global_rank``'s result: a shape or a tuple of shapes (tuple outputs).

    The spec's shape rule decides; the case only supplies what the rule needs from other ranks.
    """
    me, n = case.members.index(global_rank), case.group_size
    extra: dict[str, Any] = {}
    if case.rows is not None:
        extra = {"in_shapes": [block_shape(case, j, me) for j in range(n)],
                 "out_split": [case.rows[j][me] for j in range(n)]}
    shape = (sum(case.rows[me]), *case.shape) if case.spec.splits else case.shape
    return case.spec.output_shape(shape, group_size=n, like=case.shape, **extra)


def split_sizes(case: Case, global_rank: int) -> tuple[list[int] | None, list[int] | None]:
    """all_to_all_single: (output_split_sizes, input_split_sizes) passed by ``global_rank``."""
    if case.splits == "none":
        return None, None
    me, n = case.members.index(global_rank), case.group_size
    return [case.rows[j][me] for j in range(n)], list(case.rows[me])


def output_buffers(case: Case, global_rank: int, device: torch.device | str = "cpu") -> Any:
    """The ``output`` argument(s) torch's signatures take: they give shape, dtype and device."""
    if not case.spec.takes_output:
        return None
    shapes = output_shapes(case, global_rank)
    dt = case.torch_dtype
    if case.spec.tuple_output:  # a list of buffers, one per rank (all_to_all)
        return [torch.empty(s, dtype=dt, device=device) for s in shapes]
    return torch.empty(shapes, dtype=dt, device=device)


def upstream_grads(case: Case, global_rank: int, device: torch.device | str = "cpu") -> Any:
    """``global_rank``'s upstream gradient ``g_r`` (distinct per rank): shaped like its result."""
    gen = _generator(case, global_rank, "grad")
    real = torch.float64
    shapes = output_shapes(case, global_rank)

    def one(shape: tuple[int, ...]) -> torch.Tensor:
        v = torch.randn(shape, generator=gen, dtype=real)
        if case.dtype == "complex128":
            v = torch.complex(v, torch.randn(shape, generator=gen, dtype=real))
        return v.to(case.torch_dtype).to(device)

    if case.spec.tuple_output:
        return tuple(one(s) for s in shapes)
    return one(shapes)


def argument_signature(case: Case, global_rank: int) -> str:
    """``"input (2, 3) float64 strided; output (8, 3)"``-style text for the reproduction."""
    shapes = input_shapes(case, global_rank)
    lay = "" if case.layout == "contiguous" else " strided"
    if shapes is None:
        inp = "input None"
    elif isinstance(shapes, list):
        inp = "input list [" + ", ".join(str(tuple(s)) for s in shapes) + f"] {case.dtype}{lay}"
    else:
        inp = f"input {tuple(shapes)} {case.dtype}{lay}"
    out = output_shapes(case, global_rank)
    text = f"{inp}; result {out}"
    if case.collective == "all_to_all_single":
        o, i = split_sizes(case, global_rank)
        text += f"; output_split_sizes={o} input_split_sizes={i}"
    return text


def iter_members(case: Case) -> Iterator[tuple[int, int]]:
    """(group rank, global rank) pairs."""
    return enumerate(case.members)
