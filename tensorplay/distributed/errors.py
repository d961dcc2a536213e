"""The error hierarchy of tensorplay.distributed.

Every error is a :class:`DistError` *and* the matching builtin, so callers can
catch either ``DistError`` (anything from us) or the builtin they already
expect (``ValueError`` for a bad argument value, ``TypeError`` for a wrong type
or a dtype the op does not allow, ``RuntimeError`` for state problems,
``TimeoutError`` for a bounded wait that ran out).

Messages follow one pattern, built by :func:`format_message`::

    tensorplay.distributed.all_reduce (group [0, 2], rank 2): <problem>: name=value, ... Fix: <hint>.
"""
from __future__ import annotations

from typing import Any, Iterable

__all__ = [
    "DistError",
    "DistValueError",
    "DistTypeError",
    "DistRuntimeError",
    "DistTimeoutError",
    "NotInitializedError",
    "RankNotInGroupError",
    "DistBackendError",
    "UnknownBackendError",
    "format_message",
]


class DistError(Exception):
    """Root of every error raised by tensorplay.distributed, the simulator and the conformance suite."""


class DistValueError(DistError, ValueError):
    """An argument has the right type but a value the call cannot accept (rank, size, shape, device)."""


class DistTypeError(DistError, TypeError):
    """An argument has the wrong type, or a dtype the reduce op does not allow."""


class DistRuntimeError(DistError, RuntimeError):
    """The call cannot run in the current state (not initialised, already initialised, backend failure)."""


class DistTimeoutError(DistError, TimeoutError):
    """A bounded wait ran out before the other ranks arrived."""


class NotInitializedError(DistRuntimeError):
    """A collective or query was called before :func:`init_process_group`."""


class RankNotInGroupError(DistValueError):
    """The calling rank, or a named src/dst, is not a member of the group."""


class DistBackendError(DistRuntimeError):
    """The backend itself failed while running a call that passed validation."""


class UnknownBackendError(DistError, AssertionError):
    """A backend name torch does not know: torch raises ``AssertionError`` for it, so this is one (and a DistError)."""


def _fmt_value(v: Any) -> str:
    if isinstance(v, str):
        return repr(v)
    if isinstance(v, (list, tuple)) and len(v) > 16:
        head = ", ".join(_fmt_value(x) for x in list(v)[:16])
        return f"[{head}, ... ({len(v)} items)]"
    return repr(v) if not hasattr(v, "shape") else f"tensor(shape={tuple(v.shape)}, dtype={v.dtype})"


def format_message(
    collective: str,
    problem: str,
    *,
    group: Iterable[int] | None = None,
    rank: int | None = None,
    values: dict[str, Any] | None = None,
    fix: str | None = None,
) -> str:
    """Build the standard message: who (collective, group, rank), what, the values, and the fix."""
    where = []
    if group is not None:
        where.append(f"group {list(group)}")
    if rank is not None:
        where.append(f"rank {rank}")
    # the harness's own calls ("simulator.run", "conformance.check"), torch's ("torch.distributed.send"), os's and
    # signal's are named as they are; the rest are ours
    qualified = collective.split(".", 1)[0] in ("simulator", "conformance", "torch", "os", "signal")
    head = collective if qualified else f"tensorplay.distributed.{collective}"
    if where:
        head += f" ({', '.join(where)})"
    msg = f"{head}: {problem}"
    if values:
        msg += ": " + ", ".join(f"{k}={_fmt_value(v)}" for k, v in values.items())
    if fix:
        msg += f". Fix: {fix}"
    return msg
