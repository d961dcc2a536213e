"""How the function, its arguments and the results cross between the coordinator and a rank process.

Plain pickle first (module-level functions travel by reference: the rank
process imports their module); what it refuses (lambdas, closures, functions of
a script read from stdin) goes through cloudpickle, by value.  Two things are
added to cloudpickle here:

* **Code objects keep their file name.**  cloudpickle 3.1 rewrites the
  ``co_filename`` of every function it pickles by value to ``"<dynamic-code>"``
  (a deterministic payload), so the call sites of a closure's collectives, its
  tracebacks and the "where is it computing" of a timeout report would name
  ``<dynamic-code>`` instead of the program's file.  Code objects are pickled
  here with :mod:`marshal` instead (the rank process runs the same interpreter),
  which keeps every field, nested code objects included, whatever cloudpickle's
  version does.
* **A main module that is no file** (``python - <<EOF``, ``python -c``, a
  notebook): a rank process cannot import it, so its functions travel by value.
"""
from __future__ import annotations

import functools
import io
import marshal
import os
import pickle
import sys
import types
from collections import ChainMap
from typing import Any

from tensorplay.distributed.errors import DistTypeError, format_message

__all__ = ["dumps", "main_is_file", "fix_preparation"]

_pickler: Any = None


def _code_reduce(code: types.CodeType) -> tuple:
    return marshal.loads, (marshal.dumps(code),)


def _cloud_pickler() -> Any:
    """cloudpickle's pickler with code objects marshalled (None without cloudpickle)."""
    global _pickler
    if _pickler is None:
        try:
            import cloudpickle
        except ImportError:
            return None
        base = getattr(cloudpickle, "Pickler", None) or getattr(cloudpickle, "CloudPickler")
        table = getattr(base, "dispatch_table", None)

        class _Pickler(base):  # type: ignore[misc,valid-type]
            # reducer_override (functions, classes) comes first; code objects then reach this table
            dispatch_table = ChainMap({types.CodeType: _code_reduce}, table if table is not None else {})

        _pickler = _Pickler
    return _pickler


def main_is_file() -> bool:
    """Whether ``__main__`` is a file a rank process can import (not stdin, ``-c``, a REPL or a notebook)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(getattr(main, "__spec__", None), "name", None):  # python -m pkg.mod: imported by name
        return True
    return bool(path) and os.path.isfile(path)  # type: ignore[arg-type]


def fix_preparation(prep: dict[str, Any]) -> dict[str, Any]:
    """multiprocessing's preparation data, without a main module path that does not exist (``<stdin>``)."""
    path = prep.get("init_main_from_path")
    if path is not None and not os.path.isfile(path):
        prep.pop("init_main_from_path")
    return prep


class _MainSpotter(pickle.Pickler):
    """Plain pickle that notes the first function or class of ``__main__`` it pickles (by a name no rank has)."""

    def __init__(self, file: io.BytesIO, protocol: int) -> None:
        super().__init__(file, protocol=protocol)
        self.file = file
        self.found: Any = None

    def reducer_override(self, obj: Any) -> Any:
        if self.found is None and isinstance(obj, (types.FunctionType, type)) and obj.__module__ == "__main__":
            self.found = obj
        return NotImplemented

    def getvalue(self) -> bytes:
        return self.file.getvalue()


def dumps(obj: Any, what: str = "") -> bytes:
    """Pickle ``obj`` for the other side (plain pickle, else cloudpickle by value, code objects marshalled).

    ``what`` names ``obj`` in the error when a function of a main module that is no file cannot travel.
    """
    if main_is_file():
        try:
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # noqa: BLE001  (lambdas, closures: by value below)
            if _cloud_pickler() is None:
                raise
    pickler = _cloud_pickler()
    if pickler is None:  # a main module that is no file, and no cloudpickle to send its functions by value
        spot = _MainSpotter(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
        spot.dump(obj)
        if spot.found is None:
            return spot.getvalue()
        name = getattr(spot.found, "__qualname__", what or "?")
        raise DistTypeError(format_message(
            "simulator.run", f"{name} is defined in a main script that is no file (read from stdin, `python -c`, "
            "a notebook), so a rank process cannot import it", values={"fn": what or name, "isolation": "process"},
            fix="save the script to a file and run that, install cloudpickle (it sends such functions by value), "
                "or use isolation='thread'"))
    buf = io.BytesIO()
    pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------------------------
# what a spawned child inherits: pipes, queues, shared tensors (the launcher's processes as rank processes)
# ---------------------------------------------------------------------------------------------------------------
#: in a rank process: the descriptors the coordinator passed with its payload, by index (see :class:`_PassedFd`)
received_fds: list[int] = []


class _PassedFd:
    """A descriptor of the coordinator, as a spawned child gets one: by its index among the passed descriptors."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def detach(self) -> int:
        return received_fds[self.index]


class _Spawning:
    """What multiprocessing's reducers ask while a child is being spawned (``context.get_spawning_popen()``):
    each descriptor they reduce is collected here and passed to the rank process beside the payload."""

    def __init__(self) -> None:
        self.fds: list[int] = []

    def duplicate_for_child(self, fd: int) -> int:
        self.fds.append(fd)
        return len(self.fds) - 1

    def DupFd(self, index: int) -> _PassedFd:  # noqa: N802  (multiprocessing's name)
        return _PassedFd(index)


@functools.cache
def _by_value_pickler(cloud: Any) -> Any:
    """cloudpickle's pickler (``cloud``) with multiprocessing's reducers too: pipes pass their descriptors."""
    from multiprocessing.reduction import ForkingPickler

    class _ByValue(cloud):  # type: ignore[misc,valid-type]
        # (read when a pickler is made; ForkingPickler's table is live: torch's reducers register into it)
        dispatch_table = ChainMap(ForkingPickler._extra_reducers, cloud.dispatch_table)

    return _ByValue


def adopt_forked_main(loaded: Any, path: str | None, name: str | None) -> None:
    """In a rank process of a fork launcher (which never runs the script's top-level code): ``__main__`` as a fork
    child has it, the launcher's script module.  It holds the script's functions and classes that came by value
    (``loaded``: the rank's function and its arguments; a started process's target and its globals), so that pickle
    finds them there by name (a ``Pool`` of the rank's own), and names the script's file (or module), so that a
    spawn context of the rank's own imports it for its children, as a real fork child's would."""
    from importlib.machinery import ModuleSpec
    from multiprocessing.process import BaseProcess

    main = types.ModuleType("__main__")
    main.__file__ = path  # type: ignore[assignment]
    main.__spec__ = ModuleSpec(name, None) if name and not path else None
    seen: set[int] = set()
    stack = [loaded]
    while stack and len(seen) < 1000:  # (a few levels: the function, its arguments, a process's target and args)
        obj = stack.pop()
        if isinstance(obj, (tuple, list)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, BaseProcess):
            stack.extend([obj._target, obj._args, obj._kwargs])  # type: ignore[attr-defined]
        elif isinstance(obj, functools.partial):
            stack.extend([obj.func, obj.args, obj.keywords])
        elif isinstance(obj, (types.FunctionType, type)) and obj.__module__ in ("__main__", "__mp_main__"):
            if id(obj) in seen:  # (``loaded`` keeps every object alive: ids are not reused meanwhile)
                continue
            seen.add(id(obj))
            main.__dict__.setdefault(obj.__name__, obj)
            for k, v in getattr(obj, "__globals__", {}).items():  # what it reached of the script, by value
                if not k.startswith("__"):
                    main.__dict__.setdefault(k, v)
                    if isinstance(v, (types.FunctionType, type)):
                        stack.append(v)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = main


def dumps_inherited(obj: Any, what: str = "", by_value: bool = False) -> tuple[bytes, list[int]]:
    """Pickle ``obj`` as multiprocessing's spawn pickles a child's process object: pipes and ``Connection``s, queues,
    locks and events of a spawn context, and tensors (torch's reducers: shared memory) reach the rank process as the
    same objects, not copies; returns the payload and the descriptors to pass with it (:data:`received_fds` on the
    other side).  What multiprocessing's pickler refuses (closures) travels by :func:`dumps` instead.

    ``by_value``: the main script's functions and classes travel by value (cloudpickle), for a rank process that does
    not import the script (a fork child, which never runs the script's top-level code again)."""
    from multiprocessing import context
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's reducers with ForkingPickler)

    spawning = _Spawning()
    context.set_spawning_popen(spawning)
    try:
        buf = io.BytesIO()
        cloud = _cloud_pickler() if by_value else None
        if cloud is None:
            ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(obj)
        else:
            _by_value_pickler(cloud)(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return buf.getvalue(), spawning.fds
    except Exception as e:  # noqa: BLE001
        first = e
    finally:
        context.set_spawning_popen(None)
    try:
        return dumps(obj, what), []
    except Exception:  # noqa: BLE001  (multiprocessing's reason is the one that teaches the fix)
        raise first from None
