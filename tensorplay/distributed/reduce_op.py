"""Reduce operations and the dtypes each one allows."""
from __future__ import annotations

import enum
import functools
from typing import Any

import torch

__all__ = ["ReduceOp", "normalize_op", "op_allows_dtype", "dtype_rule"]


class ReduceOp(enum.Enum):
    """The reduce operations of tensorplay.distributed (the names torch.distributed uses).

    ``AVG`` is defined for floating and complex tensors; ``BAND``/``BOR``/``BXOR``
    for integer and bool tensors; ``MIN``/``MAX`` for every real dtype.
    torch's own ``torch.distributed.ReduceOp`` values and the lower-case names
    (``"sum"``) are accepted wherever an op is expected.
    """

    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def __repr__(self) -> str:  # ReduceOp.SUM reads better in messages than <ReduceOp.SUM: 'sum'>
        return f"ReduceOp.{self.name}"

    __str__ = __repr__


def normalize_op(op: Any) -> ReduceOp:
    """Map ``op`` (ours, torch's ReduceOp/RedOpType, or a name) to :class:`ReduceOp`.

    Raises ``KeyError``-free: returns ``None`` never; unknown values raise ``ValueError``
    which callers wrap with their context.
    """
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        try:
            return ReduceOp[op.upper()]
        except KeyError:
            raise ValueError(op) from None
    # torch.distributed.ReduceOp.SUM is a RedOpType member; a ReduceOp instance
    # wraps one.  Both print as 'RedOpType.NAME' / carry a .name.
    name = getattr(op, "name", None)
    if name is None:
        text = str(op)
        name = text.rsplit(".", 1)[-1] if text.startswith(("RedOpType.", "ReduceOp.")) else None
    if isinstance(name, str) and name.upper() in ReduceOp.__members__:
        return ReduceOp[name.upper()]
    raise ValueError(op)


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating"
    return "integer"


@functools.lru_cache(maxsize=None)  # on every collective's path; (op, dtype) pairs are few
def dtype_rule(op: ReduceOp, dtype: torch.dtype) -> str | None:
    """Return ``None`` when ``op`` may reduce tensors of ``dtype``, else a reason and a fix."""
    kind = _kind(dtype)
    if op is ReduceOp.AVG and kind in ("integer", "bool"):
        return "AVG is defined only for floating and complex tensors; use SUM and divide, or cast to a float dtype"
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and kind in ("floating", "complex"):
        return f"{op.name} is defined only for integer and bool tensors; use an integer dtype or another op"
    if op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "complex":
        return f"{op.name} has no order on complex numbers; reduce the real part or the magnitude instead"
    return None


def op_allows_dtype(op: ReduceOp, dtype: torch.dtype) -> bool:
    return dtype_rule(op, dtype) is None
