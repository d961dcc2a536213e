"""What runs on the callee around the user's function, shared by both transports.

:func:`run_call` executes ``fn(*args, **kwargs)`` and never lets an exception
escape into the transport: it returns a :class:`RemoteFailure` instead, which
travels back as an ordinary value.  The caller turns it into the *original*
exception (same type, same args) with the remote traceback attached as a note,
so ``except KeyError`` around an ``rpc_sync`` works exactly as it would around a
local call.  (torch rebuilds remote exceptions from one string, which loses
every type whose constructor wants something else.)

Functions that plain ``pickle`` cannot send (lambdas, closures, functions of
``__main__`` in an interactive session) travel as :class:`PickledFunction`:
``dill`` bytes unpickled on the callee.
"""
from __future__ import annotations

import functools
import io
import pickle
import sys
import traceback
import types
from typing import Any, Callable

from .errors import RemoteError

__all__ = ["RemoteFailure", "PickledFunction", "run_call", "run_call_async", "unwrap", "callable_for_wire",
           "dill_pickler", "is_async", "ASYNC_ATTR", "async_outcome", "future_outcome"]

#: the attribute ``@async_execution`` puts on a function (torch's name, so both decorators are understood
#: by both transports)
ASYNC_ATTR = "_wrapped_async_rpc_function"


def _import_module(name: str) -> types.ModuleType:
    import importlib

    return importlib.import_module(name)


@functools.lru_cache(maxsize=None)
def _os_resource_types() -> tuple[type, ...]:
    import socket
    import threading

    return (type(threading.Lock()), type(threading.RLock()), socket.socket, io.FileIO, io.BufferedReader,
            io.BufferedWriter, io.BufferedRandom, io.TextIOWrapper)


def dill_pickler(f: io.BytesIO, pid: Callable[[Any], Any] | None = None) -> Any:
    """A dill pickler that sends importable modules by name and refuses what plain pickle refuses for a reason.

    (dill pickles every module outside the standard library *by value*, state
    included, which drags half of tensorplay along with a lambda that merely
    names ``rpc``.  It also "sends" locks, open files and sockets by making new
    ones on the other side: a lock shared through a call would silently be two
    locks, so those are refused with pickle's own error, as torch's RPC does.)
    """
    import dill

    refused = _os_resource_types()

    class _Pickler(dill.Pickler):  # type: ignore[misc]
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, refused):
                t = type(obj)
                raise TypeError(f"cannot pickle '{t.__module__}.{t.__qualname__}' object")
            if isinstance(obj, types.ModuleType):
                name = obj.__name__
                if name != "__main__" and sys.modules.get(name) is obj:
                    return (_import_module, (name,))
            return NotImplemented

        if pid is not None:
            def persistent_id(self, obj: Any) -> Any:
                return pid(obj)

    return _Pickler(f, protocol=pickle.HIGHEST_PROTOCOL, recurse=True)


class PickledFunction:
    """A callable that plain pickle refuses, carried as dill bytes."""

    __slots__ = ("blob", "name", "is_async")

    def __init__(self, fn: Callable[..., Any]) -> None:
        f = io.BytesIO()
        dill_pickler(f).dump(fn)
        self.blob = f.getvalue()
        self.name = getattr(fn, "__qualname__", repr(fn))
        self.is_async = is_async(fn)

    def load(self) -> Callable[..., Any]:
        import dill

        return dill.loads(self.blob)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.load()(*args, **kwargs)

    def __reduce__(self):
        return (_rebuild_pickled_function, (self.blob, self.name, self.is_async))


def _rebuild_pickled_function(blob: bytes, name: str, async_: bool = False) -> PickledFunction:
    pf = PickledFunction.__new__(PickledFunction)
    pf.blob, pf.name, pf.is_async = blob, name, async_
    return pf


def is_async(fn: Any) -> bool:
    """Whether ``fn`` was decorated with ``@async_execution`` (ours or torch's): it returns a future."""
    if type(fn) is PickledFunction:
        return fn.is_async
    try:
        return hasattr(fn, ASYNC_ATTR)
    except Exception:  # noqa: BLE001  objects whose __getattr__ raises something else
        return False


def callable_for_wire(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` itself when pickle sends it by reference, else a :class:`PickledFunction`."""
    try:
        pickle.dumps(fn)
        return fn
    except Exception:  # noqa: BLE001  pickle raises several types for "cannot pickle"
        return PickledFunction(fn)


class RemoteFailure:
    """An exception raised on the callee, in transit to the caller."""

    __slots__ = ("exc_bytes", "type_name", "message", "traceback", "worker")

    def __init__(self, exc_bytes: bytes | None, type_name: str, message: str, tb: str, worker: str) -> None:
        self.exc_bytes = exc_bytes
        self.type_name = type_name
        self.message = message
        self.traceback = tb
        self.worker = worker

    @classmethod
    def capture(cls, exc: BaseException, worker: str) -> "RemoteFailure":
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        t = type(exc)
        type_name = f"{t.__module__}.{t.__qualname__}"
        try:  # only keep bytes that really rebuild the exception
            blob: bytes | None = pickle.dumps(exc)
            pickle.loads(blob)
        except Exception:  # noqa: BLE001
            blob = None
        return cls(blob, type_name, str(exc), tb, worker)

    def to_exception(self) -> BaseException:
        exc: BaseException | None = None
        if self.exc_bytes is not None:
            try:
                exc = pickle.loads(self.exc_bytes)
            except Exception:  # noqa: BLE001  e.g. the type is not importable here
                exc = None
        if exc is None:
            exc = RemoteError(
                f"tensorplay.distributed.rpc: worker {self.worker!r} raised {self.type_name}: {self.message} "
                f"(the exception could not be rebuilt here, so it arrives as RemoteError; make the exception "
                f"type importable and picklable on both sides to get it unchanged)",
                self.type_name, self.traceback, self.worker)
        try:
            exc.remote_traceback = self.traceback  # type: ignore[attr-defined]
            exc.remote_worker = self.worker  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001  exceptions with __slots__
            pass
        if hasattr(exc, "add_note"):
            exc.add_note(f"--- raised on RPC worker {self.worker!r}; remote traceback:\n{self.traceback.rstrip()}")
        return exc

    def __reduce__(self):
        return (RemoteFailure, (self.exc_bytes, self.type_name, self.message, self.traceback, self.worker))

    def __repr__(self) -> str:
        return f"RemoteFailure({self.type_name}: {self.message!r} on {self.worker!r})"


def _worker_name() -> str:
    from ._agent import current

    a = current()
    return a.name if a is not None else "?"


def run_call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The callee side of every call: run it, and turn any exception into a :class:`RemoteFailure`."""
    try:
        if type(fn) is PickledFunction:
            fn = fn.load()
        return fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001  every failure goes back to the caller
        return RemoteFailure.capture(e, _worker_name())


def _is_future(obj: Any) -> bool:
    return isinstance(obj, torch_future_type()) or (callable(getattr(obj, "add_done_callback", None))
                                                    and callable(getattr(obj, "done", None)))


def torch_future_type() -> type:
    import torch

    return torch._C.Future


def async_outcome(value: Any, fn: Any, worker: str) -> Any:
    """What an ``@async_execution`` function returned, checked: its future, or a RemoteFailure.

    Like torch, a function so decorated must return a future; anything else is the caller's error.
    """
    if type(value) is RemoteFailure or _is_future(value):
        return value
    name = getattr(fn, "__qualname__", None) or getattr(fn, "name", None) or repr(fn)
    err = TypeError(
        f"tensorplay.distributed.rpc: function {name!r} is decorated with @async_execution, so it must return "
        f"a torch.futures.Future (or an RPC future), but it returned {type(value).__name__}. Fix: return "
        f"the future whose result is the answer (e.g. rpc.rpc_async(...).then(...)), or drop the decorator.")
    return RemoteFailure.capture(err, worker)


def future_outcome(fut: Any, worker: str) -> Any:
    """The result of a completed future, or its exception as a :class:`RemoteFailure`."""
    try:
        return fut.value()
    except BaseException as e:  # noqa: BLE001  the future's failure goes back to the caller
        return RemoteFailure.capture(e, worker)


def run_call_async(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The callee side of a call to an ``@async_execution`` function on TensorPipe.

    torch's agent sees this function's async marker and sends the answer when
    the returned (torch) future completes; its value is the function's
    future's result, or a :class:`RemoteFailure`.
    """
    import torch

    out = async_outcome(run_call(fn, args, kwargs), fn, _worker_name())
    answer: Any = torch.futures.Future()
    if type(out) is RemoteFailure:
        answer.set_result(out)
        return answer
    worker = _worker_name()
    out.add_done_callback(lambda f: answer.set_result(future_outcome(f, worker)))
    return answer


setattr(run_call_async, ASYNC_ATTR, run_call_async)


def unwrap(value: Any) -> Any:
    """The caller side: raise a :class:`RemoteFailure` as its original exception, pass anything else through."""
    if type(value) is RemoteFailure:
        raise value.to_exception()
    return value
