"""Errors of the RPC layer, all part of the :class:`~tensorplay.distributed.DistError` hierarchy.

A *remote* exception (the called function raised on the other worker) is not
wrapped: it arrives with its original type, and the remote traceback is added
as a note (``exc.__notes__``) and kept in ``exc.remote_traceback``.  Only when
the exception cannot cross the wire (its type does not pickle) does the caller
get a :class:`RemoteError` naming the original type.

The classes here are the transport's own failures:

* :class:`WorkerUnavailableError` - the destination died, left, or was never reachable;
* :class:`RpcTimeoutError` - the call ran past its timeout;
* :class:`RpcError` - anything else the transport reports (a call that could
  not even start on the remote side, e.g. its function did not unpickle there);
* :class:`InterfaceError` - a RemoteModule interface was not implemented, or a
  method outside the interface was called.
"""
from __future__ import annotations

from ..errors import DistRuntimeError, DistTimeoutError, DistTypeError, format_message

__all__ = [
    "RpcError",
    "WorkerUnavailableError",
    "RpcTimeoutError",
    "RemoteError",
    "InterfaceError",
    "rpc_message",
]


class RpcError(DistRuntimeError):
    """The RPC transport failed to deliver a call or its answer."""


class WorkerUnavailableError(RpcError):
    """The destination worker is dead, shut down, or unreachable; pending and new calls to it fail with this."""


class RpcTimeoutError(DistTimeoutError):
    """A call (or ``to_here``, or ``Future.wait``) ran past its timeout."""


class RemoteError(DistRuntimeError):
    """A remote exception whose type could not be rebuilt on the caller.

    Attributes:
        remote_type: ``"module.QualName"`` of the original exception.
        remote_traceback: the traceback text as formatted on the remote worker.
        worker: name of the worker where it was raised.
    """

    def __init__(self, message: str, remote_type: str = "", remote_traceback: str = "", worker: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback
        self.worker = worker

    def __reduce__(self):  # keep the extra fields when it crosses another hop
        return (type(self), (str(self), self.remote_type, self.remote_traceback, self.worker))


class InterfaceError(DistTypeError):
    """A class does not implement a remote-method interface, or a call left the interface."""


def rpc_message(call: str, problem: str, *, worker: str | None = None, values: dict | None = None,
                fix: str | None = None) -> str:
    """``tensorplay.distributed.rpc.<call> (worker 'w'): problem: name=value, ... Fix: ...``."""
    msg = format_message(f"rpc.{call}", problem, values=values, fix=fix)
    if worker is not None:
        head = f"tensorplay.distributed.rpc.{call}"
        msg = f"{head} (worker {worker!r})" + msg[len(head):]
    return msg
