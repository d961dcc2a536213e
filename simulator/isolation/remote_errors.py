"""Exceptions across the process boundary, both ways.

A request that fails in the coordinator is answered ERR (:func:`error_answer`): the error's class, text and a
few attributes, and an id under which the proxy keeps the error itself.  The rank process raises a rebuilt
exception of the same class (:func:`rebuild`) that carries the id, so when it ends the rank the rank process
reports FORWARDED and the coordinator re-raises its own object.  An exception of the program travels as RAISE
(:func:`exception_message`): pickled when it can be, with its traceback text; the coordinator raises it with a
note naming the rank's process (:func:`program_error`).
"""
from __future__ import annotations

import importlib
import pickle
from typing import Any

from tensorplay.distributed.errors import DistRuntimeError

from simulator.core.tracebacks import format_rank_traceback
from simulator.isolation import pickling
from simulator.isolation.messages import ERR, RAISE

__all__ = ["error_answer", "rebuild", "exception_message", "rank_traceback", "program_error"]

#: the attributes of a coordinator's error that travel with it (when they are numbers or lists of them)
_ATTRS = ("rank", "failed_rank", "ranks", "exit_code", "seed")


# -- the coordinator's errors: answered by the proxy, raised again in the rank process ---------------------------
def error_answer(eid: int, e: BaseException) -> tuple:
    """``(ERR, eid, module, qualname, text, attrs)`` for the coordinator's error ``e``, kept as ``eid``
    (the proxy appends the completed works)."""
    attrs = {k: getattr(e, k) for k in _ATTRS if isinstance(getattr(e, k, None), (int, list, tuple))}
    return (ERR, eid, type(e).__module__, type(e).__qualname__, str(e), attrs)


def rebuild(eid: int, mod: str, qualname: str, message: str, attrs: dict) -> BaseException:
    """The coordinator's error ``eid`` as an exception of its class in this process (its text if the class cannot
    be rebuilt here)."""
    try:
        cls: Any = importlib.import_module(mod)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        exc = cls(message)
    except Exception:  # noqa: BLE001  a class that cannot be rebuilt here keeps its name in the text
        exc = RuntimeError(f"{qualname}: {message}")
    for k, v in attrs.items():
        try:
            setattr(exc, k, v)
        except Exception:  # noqa: BLE001
            pass
    exc._tp_forwarded = eid  # type: ignore[attr-defined]  (the proxy re-raises its own object for it)
    return exc


# -- the program's exceptions: sent by the rank process, raised again in the coordinator -------------------------
def rank_traceback(e: BaseException) -> str:
    """``e``'s traceback as the program's: without the simulator's frames (nor runpy's, for a script)."""
    return format_rank_traceback(e)


def exception_message(e: BaseException) -> tuple:
    """``(RAISE, pickled or None, class name, text, traceback text)`` for an exception of the program."""
    tb = rank_traceback(e)
    try:
        data = pickling.dumps(e)  # (what plain pickle refuses goes by value; see .pickling)
        pickle.loads(data)
    except Exception:  # noqa: BLE001  an exception that cannot cross processes is sent as its text
        data = None
    return (RAISE, data, type(e).__qualname__, str(e), tb)


def program_error(msg: tuple, rank: int, pid: int, hash_seed: int) -> BaseException:
    """The exception of a RAISE message of rank ``rank``'s process, with a note of where it was raised."""
    _, data, clsname, text, tb = msg
    exc: BaseException | None = None
    if data is not None:
        try:
            exc = pickle.loads(data)
        except Exception:  # noqa: BLE001
            exc = None
    if exc is None:
        exc = DistRuntimeError(f"{clsname}: {text}")
    exc.add_note(f"[simulator] traceback in rank {rank}'s process (pid {pid}, "
                 f"PYTHONHASHSEED={hash_seed}):\n{tb.rstrip()}")
    exc._tp_rank_traceback = tb  # type: ignore[attr-defined]  (launch.format_rank_traceback shows it instead)
    return exc
