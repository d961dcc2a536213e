"""The future returned by ``rpc_async``, ``forward_async`` and the RRef proxies.

It *is* a ``torch.futures.Future`` (a subclass), so torch's own helpers take
it: ``torch.futures.wait_all``, ``torch.futures.collect_all``, and torch's
RPC agent when an ``@async_execution`` function returns one.  Its methods
are the ones RPC code uses: ``wait()``, ``then(callback)``,
``add_done_callback``, ``done()``, ``value()``, ``set_result``/``set_exception``;
every completion is mirrored into torch's future state.  Two differences
from torch's on purpose:

* ``wait(timeout=...)`` takes an optional bound of its own, and the future of
  an RPC always completes (with the result, the remote exception, or an
  :class:`~tensorplay.distributed.rpc.RpcTimeoutError` once the call's
  timeout passes), so a wait never hangs forever;
* a callback that raises makes the chained future fail with *that* exception,
  unchanged.

Example::

    fut = rpc.rpc_async("worker1", torch.add, args=(torch.ones(2), 1))
    doubled = fut.then(lambda f: f.value() * 2)
    assert doubled.wait().tolist() == [4.0, 4.0]
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, TypeVar

import torch

from .errors import RpcTimeoutError, rpc_message

__all__ = ["Future", "wait_all"]

T = TypeVar("T")

#: how a blocked ``wait`` passes time: ``waiter(event, timeout) -> bool``.  The
#: simulator transport installs a cooperative one per future so a waiting rank
#: lets the other simulated ranks run.
Waiter = Callable[[threading.Event, "float | None"], bool]


def _thread_wait(event: threading.Event, timeout: float | None) -> bool:
    return event.wait(timeout)


#: installed by the simulator's transport: ``hook(future, timeout) -> bool`` blocks a simulated rank
#: cooperatively until ``future`` completes and returns True; False means "not a simulated rank thread".
coop_wait: Callable[["Future[Any]", "float | None"], bool] | None = None

_TorchFuture = torch.futures.Future
_C_set_result = torch._C.Future.set_result
_C_set_unwrap = torch._C.Future._set_unwrap_func


def _raise(exc: BaseException) -> Any:
    raise exc


def _devices() -> list[int]:
    # a torch future checks that the tensors of its value live on devices it was told about;
    # CUDA tensors exist only once CUDA is initialised, so only then are the devices named
    return list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []


class _AlreadyCompleted(RuntimeError):
    """A second completion of a future."""


class Future(_TorchFuture[T]):
    """The eventual result of an asynchronous RPC (a ``torch.futures.Future``)."""

    __slots__ = ("_event", "_lock", "_result", "_exc", "_callbacks", "_waiter", "_what", "_bound")

    def __init__(self, *, waiter: Waiter | None = None, what: str = "Future", devices: Any = None) -> None:
        super().__init__(devices=_devices() if devices is None else devices)
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._result: Any = None
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[["Future[T]"], None]] = []
        self._waiter = waiter or _thread_wait
        self._what = what
        #: ``(deadline, source, error)``: the call this future waits on fails with ``error()`` once
        #: ``time.monotonic()`` passes ``deadline`` (an RPC's own timeout; kept by the futures ``then`` makes)
        self._bound: tuple[float, "Future[Any]", Callable[[], BaseException]] | None = None

    # -- completing -------------------------------------------------------
    def set_result(self, result: T) -> None:
        self._complete(result, None)

    def set_exception(self, exc: BaseException) -> None:
        if not isinstance(exc, BaseException):
            raise TypeError(f"Future.set_exception: exc={exc!r} is not an exception")
        self._complete(None, exc)

    def complete_once(self, result: Any, exc: BaseException | None) -> bool:
        """Complete the future unless it already is (an answer that comes after its call timed out is dropped,
        as torch's agent drops it); returns whether this call completed it."""
        try:
            self._complete(result, exc)
        except _AlreadyCompleted:
            return False
        return True

    def expire(self) -> None:
        """Fail the call this future waits on with its timeout error, unless it completed (see ``_bound``)."""
        if self._bound is not None:
            _, source, error = self._bound
            source.complete_once(None, error())

    def _complete(self, result: Any, exc: BaseException | None) -> None:
        with self._lock:
            if self._event.is_set():
                raise _AlreadyCompleted(f"{self._what}: the future is already completed; it can be completed once")
            self._result, self._exc = result, exc
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        self._mirror(result, exc)
        for cb in callbacks:
            self._run_callback(cb)

    def _mirror(self, result: Any, exc: BaseException | None) -> None:
        """Complete torch's side too, so torch's wait_all/collect_all and its RPC agent see the outcome."""
        try:
            if exc is None:
                _C_set_result(self, result)
                return
        except Exception as e:  # noqa: BLE001  e.g. tensors on a device this future was not told about
            exc = RuntimeError(rpc_message(
                f"{self._what}", "the result could not be stored in torch's future state",
                values={"error": f"{type(e).__name__}: {e}"[:300]},
                fix="read it with this future's own wait()/value() instead of torch.futures helpers"))
        _C_set_unwrap(self, _raise)
        _C_set_result(self, exc)

    def _run_callback(self, cb: Callable[["Future[T]"], None]) -> None:
        try:
            cb(self)
        except Exception:  # noqa: BLE001  a broken callback must not break the completer
            import traceback

            traceback.print_exc()

    # -- reading ----------------------------------------------------------
    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> T:
        """Block until the result is there and return it, or raise the call's exception.

        Args:
            timeout: optional bound in seconds on this wait (the RPC's own timeout applies anyway).
        """
        if not self._event.is_set():
            hook = coop_wait
            # a simulated rank waits its turn (until completion or the bound); any other thread blocks
            if not (hook is not None and hook(self, timeout)):
                self._waiter(self._event, timeout)
            if not self._event.is_set():
                raise RpcTimeoutError(rpc_message(
                    f"{self._what}.wait", "the future did not complete in time", values={"timeout": timeout},
                    fix="raise the timeout, or check that the remote worker is alive and not blocked"))
        if self._exc is not None:
            raise self._exc
        return self._result

    def value(self) -> T:
        """The result of a completed future (raises its exception); for use inside ``then`` callbacks."""
        if not self._event.is_set():
            raise RuntimeError(rpc_message(f"{self._what}.value", "the future is not completed yet",
                                           fix="call wait() instead, or read value() inside a then() callback"))
        if self._exc is not None:
            raise self._exc
        return self._result

    def exception(self) -> BaseException | None:
        """The exception of a completed future, or ``None``."""
        return self._exc if self._event.is_set() else None

    # -- chaining ---------------------------------------------------------
    def add_done_callback(self, callback: Callable[["Future[T]"], None]) -> None:
        """Run ``callback(self)`` once the future completes (at once if it already has)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(callback)
                return
        self._run_callback(callback)

    def then(self, callback: Callable[["Future[T]"], Any]) -> "Future[Any]":
        """A new future holding ``callback(self)``'s return value, or the exception it raised."""
        nxt: Future[Any] = Future(waiter=self._waiter, what=self._what)
        nxt._bound = self._bound

        def chain(f: "Future[T]") -> None:
            try:
                r = callback(f)
            except BaseException as e:  # noqa: BLE001  the chained future carries it
                nxt.set_exception(e)
            else:
                nxt.set_result(r)

        self.add_done_callback(chain)
        return nxt

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._exc is not None else "done")
        return f"<tensorplay.distributed.rpc.Future {state}>"


def wait_all(futures: Iterable[Any], timeout: float | None = None) -> list[Any]:
    """Wait for every future; return their results in order, or raise the first failure after all finished.

    Plain ``torch.futures.Future`` objects are accepted too (their ``wait`` takes no bound).
    """
    futures = list(futures)
    deadline = None if timeout is None else time.monotonic() + timeout
    results: list[Any] = []
    first: BaseException | None = None
    for f in futures:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            results.append(f.wait(left) if isinstance(f, Future) else f.wait())
        except BaseException as e:  # noqa: BLE001  keep waiting for the others, then raise the first
            results.append(None)
            if first is None:
                first = e
    if first is not None:
        raise first
    return results
