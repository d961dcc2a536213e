"""Unit tests of the RPC layer's local pieces: Future, interface checking, remote failures, loopback rendezvous."""
from __future__ import annotations

import inspect
import pickle
import threading

import pytest

from tensorplay.distributed import DistValueError
from tensorplay.distributed.nn.api import InterfaceError, check_implements, interface, interface_methods, is_interface
from tensorplay.distributed.nn.api.interface import _incompatibility
from tensorplay.distributed.rpc import Future, RemoteError, RpcTimeoutError, wait_all
from tensorplay.distributed.rpc._call import PickledFunction, RemoteFailure, run_call, unwrap


# -- Future -------------------------------------------------------------------
def test_future_result_then_and_callbacks():
    f: Future[int] = Future()
    seen = []
    f.add_done_callback(lambda fut: seen.append(fut.value()))
    g = f.then(lambda fut: fut.value() * 10)
    assert not f.done() and not g.done()
    threading.Timer(0.01, f.set_result, (4,)).start()
    assert f.wait(5) == 4 and g.wait(5) == 40 and seen == [4]
    late = []
    f.add_done_callback(lambda fut: late.append(fut.value()))  # runs at once on a completed future
    assert late == [4]
    assert "done" in repr(f)


def test_future_errors():
    f: Future[int] = Future()
    with pytest.raises(RuntimeError, match="not completed yet"):
        f.value()
    with pytest.raises(RpcTimeoutError, match="did not complete in time"):
        f.wait(0.01)
    chained = f.then(lambda fut: 1 / 0)
    f.set_result(1)
    with pytest.raises(ZeroDivisionError):
        chained.wait()
    with pytest.raises(RuntimeError, match="already completed"):
        f.set_result(2)
    e: Future[int] = Future()
    e.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        e.wait()
    assert isinstance(e.exception(), KeyError)
    with pytest.raises(TypeError):
        Future().set_exception("not an exception")  # type: ignore[arg-type]


def test_wait_all_waits_for_everyone_then_raises_the_first_failure():
    a, b, c = Future(), Future(), Future()
    a.set_exception(ValueError("first"))
    b.set_result(2)
    threading.Timer(0.02, c.set_result, (3,)).start()
    with pytest.raises(ValueError, match="first"):
        wait_all([a, b, c], timeout=5)
    assert c.done()
    assert wait_all([b, c]) == [2, 3]


# -- remote failures -----------------------------------------------------------------
class TwoArgs(Exception):
    def __init__(self, a, b):
        super().__init__(a, b)


class NoPickle(Exception):
    def __reduce__(self):
        raise TypeError("no")


def _raise(exc):
    raise exc


def test_remote_failure_keeps_type_args_and_traceback():
    v = run_call(_raise, (TwoArgs("x", 2),), {})
    assert isinstance(v, RemoteFailure)
    v = pickle.loads(pickle.dumps(v))  # it travels as a value
    with pytest.raises(TwoArgs) as ei:
        unwrap(v)
    assert ei.value.args == ("x", 2)
    assert "in _raise" in ei.value.remote_traceback
    assert any("remote traceback" in n for n in ei.value.__notes__)


def test_unpicklable_remote_exception_becomes_remote_error():
    v = run_call(_raise, (NoPickle("n"),), {})
    with pytest.raises(RemoteError) as ei:
        unwrap(v)
    assert ei.value.remote_type.endswith("NoPickle") and "n" in str(ei.value)
    again = pickle.loads(pickle.dumps(ei.value))
    assert again.remote_type == ei.value.remote_type


def test_pickled_function_sends_lambdas_and_closures():
    k = 5
    pf = PickledFunction(lambda x: x + k)
    pf2 = pickle.loads(pickle.dumps(pf))
    assert pf2(1) == 6 and run_call(pf2, (2,), {}) == 7
    assert len(pf.blob) < 2000  # modules travel by name, not with their whole state


# -- interfaces ------------------------------------------------------------------------
def sig(f):
    params = list(inspect.signature(f).parameters.values())[1:]
    return inspect.signature(f).replace(parameters=params)


@pytest.mark.parametrize("want, have, ok", [
    (lambda self, x: 0, lambda self, x: 0, True),
    (lambda self, x: 0, lambda self, x, extra=1: 0, True),
    (lambda self, x: 0, lambda self, *args: 0, True),
    (lambda self, x, *, k=1: 0, lambda self, x, **kw: 0, True),
    (lambda self, x, *, k=1: 0, lambda self, x, k=1: 0, True),
    (lambda self, x: 0, lambda self, y: 0, False),           # renamed parameter
    (lambda self, x: 0, lambda self: 0, False),              # missing parameter
    (lambda self, x: 0, lambda self, x, extra: 0, False),    # extra required parameter
    (lambda self, x=1: 0, lambda self, x: 0, False),         # lost default
    (lambda self, *, k: 0, lambda self: 0, False),           # missing keyword
    (lambda self, *a: 0, lambda self, x: 0, False),          # no *args
    (lambda self, **kw: 0, lambda self: 0, False),           # no **kwargs
])
def test_signature_compatibility(want, have, ok):
    assert (_incompatibility(sig(want), sig(have)) is None) == ok


def test_interface_decorator_and_inheritance():
    @interface
    class Base:
        def forward(self, x): ...

    @interface
    class Child(Base):
        def extra(self, y, *, z=0): ...

        def _private(self): ...

    assert is_interface(Base) and is_interface(Child) and not is_interface(int)
    assert sorted(interface_methods(Child)) == ["extra", "forward"]

    class Impl:
        def forward(self, x):
            return x

        def extra(self, y, *, z=0):
            return y

    check_implements(Child, Impl)

    class Missing:
        def forward(self, x):
            return x

    with pytest.raises(InterfaceError, match="extra: missing"):
        check_implements(Child, Missing)


def test_interface_decorator_errors():
    with pytest.raises(InterfaceError, match="expected a class"):
        interface(lambda: 0)  # type: ignore[arg-type]
    with pytest.raises(InterfaceError, match="no public method"):
        @interface
        class Empty:
            pass
    with pytest.raises(InterfaceError, match="plain methods"):
        @interface
        class Static:
            @staticmethod
            def forward(x): ...
    with pytest.raises(InterfaceError, match="`self` first"):
        @interface
        class NoSelf:
            def forward(*args): ...
    with pytest.raises(InterfaceError, match="not an interface"):
        interface_methods(int)


# -- loopback rendezvous ------------------------------------------------------------------
def test_init_method_rewrites_to_a_bounded_loopback_store(monkeypatch):
    import torch.distributed.rpc as trpc

    from tensorplay.distributed.rpc import tensorpipe as tpipe

    opts = trpc.TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:29555")
    url, host = tpipe._init_method(opts, 12.0)
    assert url.startswith("tensorplay-tcp://127.0.0.1:29555") and "timeout_s=12.0" in url and host == "127.0.0.1"
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29556")
    url, host = tpipe._init_method(trpc.TensorPipeRpcBackendOptions(init_method="env://"), 5.0)
    assert url.startswith("tensorplay-tcp://127.0.0.1:29556") and host == "127.0.0.1"
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(DistValueError, match="MASTER_PORT"):
        tpipe._init_method(trpc.TensorPipeRpcBackendOptions(init_method="env://"), 5.0)
    url, host = tpipe._init_method(trpc.TensorPipeRpcBackendOptions(init_method="file:///tmp/x"), 5.0)
    assert url == "file:///tmp/x" and host == ""
    assert tpipe.is_loopback("127.0.0.1") and tpipe.is_loopback("::1") and tpipe.is_loopback("localhost")
    assert not tpipe.is_loopback("10.0.0.1") and not tpipe.is_loopback("example.com")
