"""``RRef``: a reference to a value that lives on one worker, its *owner*.

Ownership rules (the same on both transports):

* ``remote(to, fn)`` runs ``fn`` on ``to`` and returns an RRef owned by ``to``;
  ``RRef(value)`` makes the calling worker the owner of ``value``.
* ``to_here()`` fetches a *copy* of the value from the owner (on the owner it
  returns the value itself); ``local_value()`` only works on the owner.
* An RRef sent to another worker inside an RPC stays a reference to the same
  value; sent back to its owner it is the owner's RRef again.
* The value lives while any worker holds an RRef to it.
* RRefs only cross workers inside RPC arguments or results; pickling one
  anywhere else is an error.

The proxies run a method of the value on the owner::

    rref = rpc.remote("worker1", tp.nn.Linear, args=(4, 2))
    out = rref.rpc_sync().forward(tp.ones(4))     # runs on worker1, returns the output
    fut = rref.rpc_async().extra_repr()           # a Future of the string
    sd = rref.remote().state_dict()               # an RRef (owned by worker1) to the state dict

Proxies call *methods*; to read an attribute, run a function on the owner
(``rpc_sync(rref.owner(), fn, args=(rref,))`` with ``fn`` reading
``rref.local_value().weight``).
"""
from __future__ import annotations

from typing import Any, Generic, TypeVar

from .errors import rpc_message
from .worker import WorkerInfo

__all__ = ["RRef"]

T = TypeVar("T")


class RRef(Generic[T]):
    """A reference to a value owned by one worker.

    Args:
        value: the value the calling worker will own.
        type_hint: accepted for torch compatibility and ignored.
    """

    __slots__ = ("_impl", "__weakref__")

    def __init__(self, value: T, type_hint: Any = None) -> None:
        from ._agent import require

        self._impl = require("RRef").local_rref(value)._impl

    @classmethod
    def _wrap(cls, impl: Any) -> "RRef[Any]":
        r = cls.__new__(cls)
        r._impl = impl
        return r

    # -- ownership ------------------------------------------------------------
    def owner(self) -> WorkerInfo:
        """The owner's :class:`WorkerInfo`."""
        return self._impl.owner()

    def owner_name(self) -> str:
        """The owner's worker name."""
        return self._impl.owner().name

    def is_owner(self) -> bool:
        """Whether the calling worker owns the value."""
        return self._impl.is_owner()

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows about this reference (always true once a call returned it)."""
        return self._impl.confirmed_by_owner()

    # -- the value ------------------------------------------------------------
    def to_here(self, timeout: float | None = None) -> T:
        """A copy of the value, fetched from the owner (the value itself on the owner).

        Raises the exception of the call that was to produce the value, if it failed.
        """
        return self._impl.to_here(timeout)

    def local_value(self) -> T:
        """The value itself; only on the owner."""
        if not self._impl.is_owner():
            from ..errors import DistRuntimeError

            raise DistRuntimeError(rpc_message(
                "RRef.local_value", "this worker is not the RRef's owner", worker=self._impl.here(),
                values={"owner": self._impl.owner().name},
                fix="call to_here() for a copy, or run the code on the owner with rref.rpc_sync().<method>(...)"))
        return self._impl.local_value()

    # -- proxies ----------------------------------------------------------------
    def rpc_sync(self, timeout: float | None = None) -> Any:
        """A proxy: ``rref.rpc_sync().m(*a)`` runs ``value.m(*a)`` on the owner and returns the result."""
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float | None = None) -> Any:
        """A proxy: ``rref.rpc_async().m(*a)`` returns a Future of ``value.m(*a)`` run on the owner."""
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float | None = None) -> Any:
        """A proxy: ``rref.remote().m(*a)`` returns an RRef (owned by the owner) to ``value.m(*a)``."""
        return _Proxy(self, "remote", timeout)

    # -- wire ---------------------------------------------------------------------
    def __reduce__(self):
        return self._impl.reduce()

    def __repr__(self) -> str:
        kind = "OwnerRRef" if self._impl.is_owner() else "UserRRef"
        return f"{kind}(owner={self._impl.owner().name!r}, id={self._impl.ident()})"


def _invoke_on_rref(rref: RRef[Any], method: str, args: tuple, kwargs: dict) -> Any:
    """Runs on the owner: ``getattr(value, method)(*args, **kwargs)``, as a future.

    The method may be an ``@async_execution`` one (the caller cannot know), so
    this function is itself asynchronous: it returns the method's future, or
    an already completed one holding the plain result.
    """
    from ._call import is_async
    from .futures import Future

    bound = getattr(rref.local_value(), method)
    out = bound(*args, **kwargs)
    if is_async(bound):
        return out
    done: Future[Any] = Future(what=f"RRef proxy {method}")
    done.set_result(out)
    return done


def _mark_async() -> None:
    from ._call import ASYNC_ATTR

    setattr(_invoke_on_rref, ASYNC_ATTR, _invoke_on_rref)


_mark_async()


class _Proxy:
    __slots__ = ("_rref", "_mode", "_timeout")

    def __init__(self, rref: RRef[Any], mode: str, timeout: float | None) -> None:
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, method: str) -> Any:
        if method.startswith("__"):
            raise AttributeError(method)
        rref, mode, timeout = self._rref, self._mode, self._timeout

        def call(*args: Any, **kwargs: Any) -> Any:
            from ._agent import invoke

            return invoke(mode, rref.owner(), _invoke_on_rref, (rref, method, args, kwargs), None, timeout)

        call.__name__ = method
        return call

    def __repr__(self) -> str:
        return f"<RRef.{self._mode}() proxy to {self._rref!r}>"
