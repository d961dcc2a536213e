"""Test helper: the shared RPC cases, run on both transports by tests/test_rpc_transports.py (no tests here).

Each case runs on the driving worker (``worker0``) of an RPC world - a
simulated one, or real TensorPipe processes - and returns what it observed as
plain values; the matching ``check_*`` function asserts on that in the test
process.  Remote functions live at module level so both transports send them
by reference.  :class:`RpcWorld` runs a case on either transport.
"""
from __future__ import annotations

import gc
import threading
import time
from typing import Any

import torch

import tensorplay as tp
import tensorplay.distributed as dist
import tensorplay.distributed.autograd as dist_autograd
import tensorplay.distributed.rpc as rpc
from tensorplay.distributed.nn import RemoteModule
from tensorplay.distributed.nn.api import interface
from tensorplay.distributed.nn.api import remote_module as _rm
from tensorplay.distributed.optim import DistributedOptimizer
from tensorplay.distributed.rpc import RpcTimeoutError


# ---------------------------------------------------------------------------
# remote functions and classes
# ---------------------------------------------------------------------------
class Boom(Exception):
    """An exception whose constructor takes two arguments (torch's RPC loses such types)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message, code)
        self.code = code


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("this exception refuses to be pickled")


def add(a, b):
    return a + b


def raise_boom(message, code):
    raise Boom(message, code)


def raise_key():
    return {}["missing"]


def raise_unpicklable():
    raise Unpicklable("nope")


def inplace_add_one(t):
    t.add_(1)
    return t


_GLOBAL = torch.zeros(3)


def get_global():
    return _GLOBAL


def whoami():
    info = rpc.get_worker_info()
    return info.name, dist.get_rank() if dist.is_initialized() else None, info.id


def make_tensor(n):
    return torch.ones(n)


def count_owned():
    from tensorplay.distributed.rpc import _agent

    return len(_agent.current().rrefs)


def rref_info(r):
    return r.owner().name, r.is_owner(), float(r.to_here().sum()), (float(r.local_value().sum()) if r.is_owner() else None)


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


#: set by a handler once it runs (threads mode: ranks share this module)
SERVING = threading.Event()


def slow_answer(value):
    """Say the call is being served, then take long enough for another worker to crash meanwhile."""
    SERVING.set()
    time.sleep(0.3)
    return value


def call_module_method(rm, method):
    """On the owner: ask its registry to run ``method``, bypassing the handle (the interface check is remote)."""
    return _rm._call_module(rm._key, method, (), {})


def use_remote_module(rm, x):
    return rm(x), repr(rm), rm.forward_async(x).wait(), rpc.get_worker_info().name


def is_training(rm):
    return rm.get_module_rref().local_value().training


class FailingModule(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        raise ValueError(f"FailingModule refuses n={n}")


class TwoMethods(torch.nn.Module):
    def forward(self, x):
        return x + 1

    def double(self):
        return 2


@interface
class OnlyForward:
    def forward(self, x): ...


@interface
class EncoderIface:
    def forward(self, x): ...

    def scale(self, x, *, factor=2.0): ...


@interface
class ScaleOnly:
    def scale(self, x, *, factor=2.0): ...


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)

    def scale(self, x, *, factor=2.0):
        return x * factor

    def secret(self):
        return "should not be reachable through the interface"


class NoScale(torch.nn.Module):
    def forward(self, x):
        return x


class WrongScale(torch.nn.Module):
    def forward(self, x):
        return x

    def scale(self, y):
        return y


_W: dict[str, torch.Tensor] = {}


def hop1(x):
    """worker1: h = x * W (W is worker1's parameter), then worker2 computes sin(h)."""
    w = _W.setdefault("w", torch.linspace(0.5, 1.5, x.numel()).requires_grad_())
    return rpc.rpc_sync("worker2", torch.sin, (x * w,))


def w_grad(cid):
    return dist_autograd.get_gradients(cid)[_W["w"]], _W["w"].detach()


def _err(fn) -> Any:
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)


# ---------------------------------------------------------------------------
# cases (run on worker0) and checks (run in the test)
# ---------------------------------------------------------------------------
def documented_example() -> dict:
    rm = RemoteModule("worker1/cpu", tp.nn.Linear, args=(16, 8))
    x = tp.randn(4, 16)
    y = rm(x)
    ref = tp.nn.Linear(16, 8)
    ref.load_state_dict(rm.get_module_rref().rpc_sync().state_dict())
    params = rm.remote_parameters()
    return {"shape": tuple(y.shape), "close": torch.allclose(y, ref(x)),
            "async_close": torch.allclose(rm.forward_async(x).wait(), y), "repr": repr(rm),
            "nparams": len(params), "owners": {p.owner().name for p in params}}


def check_documented_example(out: dict) -> None:
    assert out["shape"] == (4, 8) and out["close"] and out["async_close"], out
    assert out["repr"] == "RemoteModule(on='worker1', device='cpu', module=Linear)"
    assert out["nparams"] == 2 and out["owners"] == {"worker1"}


def calls() -> dict:
    out: dict[str, Any] = {}
    out["add"] = rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1)).tolist()
    x = torch.zeros(3)
    y = rpc.rpc_sync("worker1", inplace_add_one, (x,))
    out["arg_by_value"] = (x.tolist(), y.tolist())
    g = rpc.rpc_sync("worker1", get_global)
    g.add_(5)
    out["result_by_value"] = rpc.rpc_sync("worker1", get_global).tolist()
    k = 7
    out["lambda"] = rpc.rpc_sync(1, lambda v: v * 3, args=(2,))
    out["closure"] = rpc.rpc_sync("worker2", lambda v: v + k, args=(1,))
    try:
        rpc.rpc_sync("worker1", raise_boom, ("bad", 42))
    except Boom as e:
        out["boom"] = (e.args, e.code, "".join(getattr(e, "__notes__", [])))
    try:
        rpc.rpc_sync("worker2", raise_key)
    except KeyError as e:
        out["key"] = e.args
    f = rpc.rpc_async("worker2", torch.mul, (torch.ones(2), 4))
    out["then"] = f.then(lambda fut: fut.value() + 1).wait().tolist()
    try:
        rpc.rpc_async("worker1", raise_boom, ("async", 1)).wait()
    except Boom as e:
        out["async_boom"] = e.code
    out["wait_all"] = rpc.wait_all([rpc.rpc_async(w, add, (w, "!")) for w in ("worker1", "worker2")])
    out["who"] = rpc.rpc_sync("worker2", whoami)
    out["self_call"] = rpc.rpc_sync("worker0", whoami)
    out["unpicklable_arg"] = _err(lambda: rpc.rpc_sync("worker1", add, ((i for i in range(3)), 1)))
    return out


def check_calls(out: dict) -> None:
    assert out["add"] == [2.0, 2.0]
    assert out["arg_by_value"] == ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    assert out["result_by_value"] == [0.0, 0.0, 0.0]
    assert out["lambda"] == 6 and out["closure"] == 8
    args, code, notes = out["boom"]
    assert args == ("bad", 42) and code == 42
    assert "raised on RPC worker 'worker1'" in notes and "raise_boom" in notes
    assert out["key"] == ("missing",)
    assert out["then"] == [5.0, 5.0] and out["async_boom"] == 1
    assert out["wait_all"] == ["worker1!", "worker2!"]
    assert out["who"] == ("worker2", 2, 2) and out["self_call"] == ("worker0", 0, 0)
    kind, msg = out["unpicklable_arg"]
    assert kind == "DistTypeError" and "cannot be serialised" in msg and "generator" in msg, out["unpicklable_arg"]


def rrefs() -> dict:
    out: dict[str, Any] = {}
    r = rpc.remote("worker1", make_tensor, (3,))
    out["remote"] = (r.owner().name, r.owner_name(), r.is_owner(), r.to_here().tolist(), repr(r).split("(")[0])
    out["local_value_elsewhere"] = _err(r.local_value)
    t = torch.ones(2)
    mine = rpc.RRef(t)
    out["local"] = (mine.is_owner(), mine.local_value() is t, mine.owner().name)
    out["at_third"] = rpc.rpc_sync("worker2", rref_info, (r,))
    out["back_at_owner"] = rpc.rpc_sync("worker1", rref_info, (r,))
    out["mine_elsewhere"] = rpc.rpc_sync("worker1", rref_info, (mine,))
    lin = rpc.remote("worker1", torch.nn.Linear, (4, 2))
    x = torch.ones(4)
    out["proxies"] = (tuple(lin.rpc_sync().forward(x).shape), tuple(lin.rpc_async().forward(x).wait().shape),
                      tuple(lin.remote().forward(x).to_here().shape))
    failed = rpc.remote("worker1", raise_boom, ("remote", 9))
    try:
        failed.to_here()
    except Boom as e:
        out["remote_failure"] = e.code
    return out


#: worker1's own reference to an RRef it also returns (rrefs_in_answers)
KEPT_HERE: dict[str, Any] = {}


def rref_list(n: int) -> list:
    """RRefs made here, returned inside an answer (the answer holds them while in flight)."""
    return [rpc.RRef(torch.full((2,), float(i))) for i in range(n)]


def keep_and_return_rref() -> Any:
    KEPT_HERE["r"] = rpc.RRef(torch.tensor([7.0]))
    return KEPT_HERE["r"]


def forget_kept() -> bool:
    KEPT_HERE.clear()
    gc.collect()
    return True


def rrefs_in_answers() -> dict:
    """RRefs that come back inside answers are the receiver's: its references keep the values alive after the
    owner, and the outer RRef that carried them, let go of theirs."""
    out: dict[str, Any] = {}
    outer = rpc.remote("worker1", rref_list, (3,))
    inner = outer.to_here()
    del outer
    gc.collect()
    r = rpc.rpc_sync("worker1", keep_and_return_rref)
    for _ in range(2):  # (each request carries what was given back since the last)
        rpc.rpc_sync("worker1", forget_kept)
    out["inner"] = [x.to_here().tolist() for x in inner]
    out["kept"] = r.to_here().tolist()
    return out


def check_rrefs(out: dict) -> None:
    assert out["remote"] == ("worker1", "worker1", False, [1.0, 1.0, 1.0], "UserRRef")
    kind, msg = out["local_value_elsewhere"]
    assert kind == "DistRuntimeError" and "to_here()" in msg
    assert out["local"] == (True, True, "worker0")
    assert out["at_third"] == ("worker1", False, 3.0, None)
    assert out["back_at_owner"] == ("worker1", True, 3.0, 3.0)
    assert out["mine_elsewhere"] == ("worker0", False, 2.0, None)
    assert out["proxies"] == ((2,), (2,), (2,))
    assert out["remote_failure"] == 9


def construction_errors() -> dict:
    lin = tp.nn.Linear
    out = {
        "bad_device": _err(lambda: RemoteModule("worker1/notadevice", lin, (2, 2))),
        "empty_device": _err(lambda: RemoteModule("worker1/", lin, (2, 2))),
        "unknown_worker": _err(lambda: RemoteModule("worker9/cpu", lin, (2, 2))),
        "bad_rank": _err(lambda: RemoteModule("rank:x/cpu", lin, (2, 2))),
        "not_a_string": _err(lambda: RemoteModule(1, lin, (2, 2))),
        "not_module": _err(lambda: RemoteModule("worker1", int)),
        "instance": _err(lambda: RemoteModule("worker1", lin(2, 2))),
        "bad_args": _err(lambda: RemoteModule("worker1", lin, 2)),
        "ctor_raises": _err(lambda: RemoteModule("worker1/cpu", FailingModule, (3,))),
        "not_interface": _err(lambda: RemoteModule("worker1", lin, (2, 2), interface=int)),
        "cuda": _err(lambda: RemoteModule("worker1/cuda:0", lin, (2, 2))),
    }
    try:
        RemoteModule("worker1/cpu", FailingModule, (3,))
    except ValueError as e:
        out["ctor_notes"] = "".join(getattr(e, "__notes__", []))
    a = RemoteModule("rank:1/cpu", lin, (2, 2))
    b = RemoteModule("worker1", lin, (2, 2))
    out["forms"] = (a.on.name, a.device, b.on.name, b.device)
    out["has_cuda"] = rpc.rpc_sync("worker1", torch.cuda.is_available)
    return out


def check_construction_errors(out: dict) -> None:
    for k in ("bad_device", "empty_device", "unknown_worker", "bad_rank"):
        assert out[k][0] == "DistValueError", (k, out[k])
        assert "remote_device=" in out[k][1] and "Fix:" in out[k][1], (k, out[k])
    assert "workers=['worker0', 'worker1'" in out["unknown_worker"][1]
    for k in ("not_a_string", "not_module", "instance", "bad_args", "not_interface"):
        assert out[k][0] == "DistTypeError", (k, out[k])
    assert out["ctor_raises"] == ("ValueError", "FailingModule refuses n=3")
    assert "while constructing FailingModule" in out["ctor_notes"] and "worker 'worker1'" in out["ctor_notes"]
    assert out["forms"] == ("worker1", "cpu", "worker1", "cpu")
    if not out["has_cuda"]:
        assert out["cuda"][0] == "DistValueError" and "no CUDA" in out["cuda"][1]


#: the methods the issue lists, each of which must raise on a RemoteModule
UNSUPPORTED = [
    "cuda", "cpu", "to", "type", "float", "double", "half", "bfloat16", "load_state_dict", "state_dict",
    "register_buffer", "register_parameter", "add_module", "apply", "register_forward_hook",
    "register_forward_pre_hook", "register_backward_hook", "register_full_backward_hook",
    "register_full_backward_pre_hook", "register_state_dict_pre_hook", "register_state_dict_post_hook",
    "register_load_state_dict_pre_hook", "register_load_state_dict_post_hook", "parameters", "named_parameters",
    "buffers", "named_buffers", "children", "named_children", "modules", "named_modules", "zero_grad",
    "requires_grad_", "share_memory",
]


def unsupported_methods() -> dict:
    rm = RemoteModule("worker1", tp.nn.Linear, (2, 2))
    out: dict[str, Any] = {}
    for name in UNSUPPORTED:
        out[name] = _err(getattr(rm, name))
    out["__repr__"] = repr(rm)
    out["eval_returns_self"] = rm.eval() is rm
    out["training_after_eval"] = rpc.rpc_sync("worker1", is_training, (rm,))
    rm.train()
    out["training_after_train"] = rpc.rpc_sync("worker1", is_training, (rm,))
    out["unknown_attr"] = _err(lambda: rm.weight)
    return out


def check_unsupported_methods(out: dict) -> None:
    for name in UNSUPPORTED:
        kind, msg = out[name]
        assert kind == "DistValueError", (name, out[name])
        assert f"RemoteModule.{name}" in msg and "Fix:" in msg and "on='worker1'" in msg, (name, msg)
    assert "Fix: use rm.remote_parameters()" in out["parameters"][1]
    assert out["__repr__"] == "RemoteModule(on='worker1', device='cpu', module=Linear)"
    assert out["eval_returns_self"] and out["training_after_eval"] is False and out["training_after_train"] is True
    assert out["unknown_attr"][0] == "AttributeError" and "get_module_rref()" in out["unknown_attr"][1]


def passed_over_rpc() -> dict:
    rm = RemoteModule("worker1/cpu", tp.nn.Linear, args=(16, 8))
    x = tp.randn(4, 16)
    y = rm(x)
    y2, r2, ya2, where2 = rpc.rpc_sync("worker2", use_remote_module, (rm, x))
    y1, _, _, where1 = rpc.rpc_sync("worker1", use_remote_module, (rm, x))
    return {"third": (torch.equal(y, y2), torch.equal(y, ya2), r2, where2), "owner": (torch.equal(y, y1), where1)}


def check_passed_over_rpc(out: dict) -> None:
    assert out["third"] == (True, True, "RemoteModule(on='worker1', device='cpu', module=Linear)", "worker2")
    assert out["owner"] == (True, "worker1")


def interface_cases() -> dict:
    out: dict[str, Any] = {}
    rm = RemoteModule("worker1", Encoder, interface=EncoderIface)
    x = torch.ones(2, 4)
    out["type"] = type(rm).__name__
    out["forward"] = tuple(rm(x).shape)
    out["scale"] = rm.scale(x, factor=3.0).sum().item()
    out["scale_async"] = rm.scale_async(x).wait().sum().item()
    out["forward_async"] = tuple(rm.forward_async(x).wait().shape)
    out["handle_secret"] = _err(lambda: rm.secret)
    out["owner_refuses"] = _err(lambda: rpc.rpc_sync("worker1", call_module_method, (rm, "secret")))
    out["bad_call"] = _err(lambda: rm.scale(x, 1, 2))
    out["missing"] = _err(lambda: RemoteModule("worker1", NoScale, interface=EncoderIface))
    out["wrong_signature"] = _err(lambda: RemoteModule("worker1", WrongScale, interface=EncoderIface))
    so = RemoteModule("worker1", Encoder, interface=ScaleOnly)
    out["no_forward"] = _err(lambda: so(x))
    out["scale_only"] = so.scale(x).sum().item()
    passed = rpc.rpc_sync("worker1", add_scale, (so, x))
    out["passed"] = passed
    return out


def add_scale(rm, x):
    return type(rm).__name__, rm.scale(x, factor=0.5).sum().item()


def check_interface(out: dict) -> None:
    assert out["type"] == "RemoteModule[EncoderIface]"
    assert out["forward"] == (2, 4) and out["forward_async"] == (2, 4)
    assert out["scale"] == 24.0 and out["scale_async"] == 16.0
    kind, msg = out["handle_secret"]
    assert kind == "AttributeError" and "not in the interface EncoderIface" in msg
    kind, msg = out["owner_refuses"]
    assert kind == "InterfaceError" and "refused" in msg and "method='secret'" in msg
    assert out["bad_call"][0] == "TypeError" and "interface's signature" in out["bad_call"][1]
    kind, msg = out["missing"]
    assert kind == "InterfaceError" and "scale: missing" in msg
    kind, msg = out["wrong_signature"]
    assert kind == "InterfaceError" and "scale:" in msg and "WrongScale" in msg
    assert out["no_forward"][0] == "InterfaceError"
    assert out["scale_only"] == 16.0
    assert out["passed"] == ("RemoteModule[ScaleOnly]", 4.0)


def training(steps: int = 4) -> dict:
    torch.manual_seed(0)
    rm = RemoteModule("worker1/cpu", tp.nn.Linear, args=(16, 8))
    opt = DistributedOptimizer(tp.optim.SGD, rm.remote_parameters(), lr=0.05, momentum=0.9)
    ref = tp.nn.Linear(16, 8)
    ref.load_state_dict(rm.get_module_rref().rpc_sync().state_dict())
    ref_opt = tp.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    equal, losses = [], []
    x, target = tp.randn(4, 16), tp.randn(4, 8)
    for _ in range(steps):
        with dist_autograd.context() as cid:
            loss = torch.nn.functional.mse_loss(rm(x), target)
            dist_autograd.backward(cid, [loss])
            opt.step(cid)
        ref_opt.zero_grad()
        ref_loss = torch.nn.functional.mse_loss(ref(x), target)
        ref_loss.backward()
        ref_opt.step()
        remote = rm.get_module_rref().rpc_sync().state_dict()
        equal.append(all(torch.equal(remote[k], v) for k, v in ref.state_dict().items()))
        losses.append((loss.item(), ref_loss.item()))
    return {"equal": equal, "losses": losses}


def check_training(out: dict) -> None:
    assert all(out["equal"]), out
    assert all(a == b for a, b in out["losses"]), out["losses"]
    assert out["losses"][-1][0] < out["losses"][0][0]


def two_hop_autograd() -> dict:
    x = torch.linspace(-1, 1, 5, requires_grad=True)
    with dist_autograd.context() as cid:
        y = rpc.rpc_sync("worker1", hop1, (x,))
        dist_autograd.backward(cid, [y.sum()])
        gx = dist_autograd.get_gradients(cid)[x]
        gw, w = rpc.rpc_sync("worker1", w_grad, (cid,))
    xl = x.detach().clone().requires_grad_()
    wl = w.clone().requires_grad_()
    torch.sin(xl * wl).sum().backward()
    return {"grad_close": torch.allclose(gx, xl.grad) and torch.allclose(gw, wl.grad), "x_grad_untouched": x.grad is None}


def timeout_case() -> dict:
    out: dict[str, Any] = {}
    t = time.perf_counter()
    try:
        rpc.rpc_sync("worker1", sleep_then, (0.6, "late"), timeout=0.2)
        out["sync"] = "no error"
    except RpcTimeoutError as e:
        out["sync"] = str(e)
    out["sync_s"] = time.perf_counter() - t
    try:
        rpc.rpc_async("worker1", sleep_then, (0.6, "late"), timeout=0.2).wait()
        out["async"] = "no error"
    except RpcTimeoutError as e:
        out["async"] = str(e)
    # the waiter's own bound: the wait fails, the call goes on and its answer can still be waited for
    fut = rpc.rpc_async("worker1", sleep_then, (0.6, "slow"), timeout=30)
    t = time.perf_counter()
    try:
        fut.wait(timeout=0.1)
        out["own_bound"] = "no error"
    except RpcTimeoutError as e:
        out["own_bound"] = str(e)
    out["own_bound_s"] = time.perf_counter() - t
    out["late"] = fut.wait()
    out["after"] = rpc.rpc_sync("worker1", add, (1, 1))
    return out


def check_timeout(out: dict) -> None:
    assert "timeout" in out["sync"] and "timeout=0.2" in out["sync"], out
    assert "timeout" in out["async"], out
    # (bounded: far below what waiting out a stuck callee would take; margins for a loaded machine)
    assert out["sync_s"] < 5.0 and out["after"] == 2, out
    assert "timeout=0.1" in out["own_bound"] and out["own_bound_s"] < 0.5 and out["late"] == "slow", out


# ---------------------------------------------------------------------------
# @async_execution and torch.futures interop (tensorplay's API)
# ---------------------------------------------------------------------------
@rpc.functions.async_execution
def async_scaled_sum(to: str, x: torch.Tensor, k: float) -> Any:
    """Answers when the nested call does: (x + k) * 3."""
    return rpc.rpc_async(to, torch.add, args=(x, k)).then(lambda f: f.value() * 3)


class AsyncHolder:
    @staticmethod
    @rpc.functions.async_execution
    def static_fail(to: str) -> Any:
        return rpc.rpc_async(to, raise_value_error, args=("late failure",))

    @classmethod
    @rpc.functions.async_execution
    def class_plain(cls, x: torch.Tensor) -> Any:
        f: Any = torch.futures.Future()
        f.set_result(x - 1)
        return f

    @rpc.functions.async_execution
    def bound(self, x: torch.Tensor) -> Any:
        f: Any = torch.futures.Future()
        f.set_result(x * 10)
        return f


@rpc.functions.async_execution
def async_returns_no_future() -> int:
    return 3


def raise_value_error(msg: str) -> None:
    raise ValueError(msg)


def async_cases() -> dict:
    x = torch.arange(3.0)
    out: dict[str, Any] = {}
    out["sync"] = rpc.rpc_sync("worker1", async_scaled_sum, args=("worker2", x, 1)).tolist()
    out["async"] = rpc.rpc_async("worker1", async_scaled_sum, args=("worker0", x, 2)).wait().tolist()
    out["remote"] = rpc.remote("worker1", async_scaled_sum, args=("worker2", x, 3)).to_here().tolist()
    out["class"] = rpc.rpc_sync("worker1", AsyncHolder.class_plain, args=(x,)).tolist()
    out["bound"] = rpc.remote("worker2", AsyncHolder).rpc_sync().bound(x).tolist()
    try:
        rpc.rpc_sync("worker1", AsyncHolder.static_fail, args=("worker2",))
    except ValueError as e:
        out["static_fail"] = str(e)
    try:
        rpc.rpc_sync("worker1", async_returns_no_future)
    except TypeError as e:
        out["no_future"] = "must return" in str(e)
    futs = [rpc.rpc_async(f"worker{r}", torch.mul, args=(x, r + 1)) for r in range(3)]
    out["torch_wait_all"] = [t.tolist() for t in torch.futures.wait_all(futs)]
    out["torch_collect_all"] = [f.value().tolist() for f in torch.futures.collect_all(futs).wait()]
    out["is_torch_future"] = isinstance(futs[0], torch.futures.Future)
    return out


def check_async(out: dict) -> None:
    assert out["sync"] == [3.0, 6.0, 9.0] and out["async"] == [6.0, 9.0, 12.0] and out["remote"] == [9.0, 12.0, 15.0]
    assert out["class"] == [-1.0, 0.0, 1.0] and out["bound"] == [0.0, 10.0, 20.0], out
    assert out["static_fail"] == "late failure" and out["no_future"] is True, out
    expected = [[0.0, r + 1.0, 2 * (r + 1.0)] for r in range(3)]
    assert out["torch_wait_all"] == expected and out["torch_collect_all"] == expected and out["is_torch_future"]


# ---------------------------------------------------------------------------
# running a case on either transport
# ---------------------------------------------------------------------------
class RpcWorld:
    """Runs a case on ``worker0`` of an RPC world of the given transport.

    ``kind`` is ``"sim"`` (a simulated world of ``world_size`` ranks, started per call, in ``mode``) or
    ``"tensorpipe"`` (a warm :class:`~tensorplay.testing.RpcPool` of 3 real processes, whatever
    ``world_size`` says: cases only address worker1 and worker2).
    """

    def __init__(self, kind: str, mode: str = "coop", pool: Any = None) -> None:
        self.kind, self.mode, self.pool = kind, mode, pool

    def run(self, case: Any, world_size: int = 2, **kwargs: Any) -> Any:
        if self.kind == "tensorpipe":
            return self.pool.run_on(0, case, **kwargs)
        if self.kind == "sim-process":  # rank processes: TensorPipe between them, rendezvoused by the simulator
            return drive(case, world_size, mode=self.mode, isolation="process", **kwargs)
        return drive(case, world_size, mode=self.mode, **kwargs)

    def __repr__(self) -> str:
        return f"RpcWorld({self.kind!r}, mode={self.mode!r})"


def drive(body: Any, world_size: int = 2, *, mode: str = "coop", seed: int = 0, options: Any = None,
          isolation: str = "thread", **kwargs: Any) -> Any:
    """Run ``body()`` on rank 0 of a simulated RPC world; the others serve until everyone shuts down."""
    import simulator

    def main() -> Any:
        me = dist.get_rank()
        rpc.init_rpc(f"worker{me}", rpc_backend_options=options)
        try:
            return body(**kwargs) if me == 0 else None
        finally:
            rpc.shutdown()

    return simulator.run(main, world_size, seed=seed, mode=mode, isolation=isolation)[0]
