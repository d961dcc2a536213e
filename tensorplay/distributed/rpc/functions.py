"""``async_execution``: a remote function that answers later, when a future it returns completes.

torch.distributed.rpc.functions' decorator, on both transports::

    @rpc.functions.async_execution
    def add_later(to, x, y):
        # returns at once; the caller's answer is sent when this future completes
        return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() * 2)

    rpc.rpc_sync("worker1", add_later, args=("worker2", x, y))      # rpc_async and remote too

The decorated function must return a future (``torch.futures.Future`` or the
one ``rpc_async`` returns); the caller of ``rpc_sync``/``rpc_async``/``remote``
receives that future's result (or its exception), not the future.  The callee
does not block while it waits, so a function can hold requests until, e.g., a
batch is complete.  With ``@staticmethod``/``@classmethod`` this decorator
must be the inner one; on a class whose instance is behind an RRef, the
proxies (``rref.rpc_sync().method(...)``) honour it too.

It marks the function the way torch's decorator does, so torch's agent and
ours each understand both decorators.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

from ._call import ASYNC_ATTR

__all__ = ["async_execution"]

F = TypeVar("F", bound=Callable[..., Any])


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a future whose result is the RPC's answer (see the module docs)."""
    if not callable(fn):
        from ..errors import DistTypeError
        from .errors import rpc_message

        raise DistTypeError(rpc_message(
            "functions.async_execution", "the decorated object must be a function", values={"fn": fn},
            fix="put @async_execution directly above the def (inside @staticmethod/@classmethod)"))

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    setattr(wrapper, ASYNC_ATTR, fn)
    return wrapper  # type: ignore[return-value]
