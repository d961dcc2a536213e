"""``RemoteModule``: a local handle to an ``nn.Module`` that lives on another worker.

::

    import tensorplay as tp
    from tensorplay.distributed.nn import RemoteModule

    lin = RemoteModule("worker1/cpu", tp.nn.Linear, args=(16, 8))   # built on worker1
    y = lin(tp.randn(4, 16))                                         # forward runs on worker1
    fut = lin.forward_async(tp.randn(4, 16))                         # a Future
    params = lin.remote_parameters()                                 # RRefs, for DistributedOptimizer

How it works: construction is one ``rpc_sync`` to the owner, which builds the
module, registers it under a key and returns ``(key, RRef(module))``.  Every
later call (``forward`` and the interface's methods) is one ``rpc_sync``
naming the key, so a forward costs one plain RPC; the RRef keeps the module
alive while any handle to it exists.  Any error of the construction - a bad
``remote_device``, an unknown worker, a ``module_cls`` that is not an
``nn.Module`` subclass, a constructor that raises - surfaces in the
constructor, with its original type.

The handle is deliberately *not* a local module: the methods that would read
or change local module state (``parameters``, ``to``, ``state_dict``, hooks,
...) raise :class:`~tensorplay.distributed.DistValueError` saying what to use
instead.  ``train()``/``eval()`` are forwarded to the owner.

A handle can be sent to another worker inside an RPC and used there.  No
TorchScript is involved anywhere.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable

import torch
from torch import nn

from ...errors import DistRuntimeError, DistTypeError, DistValueError, format_message
from ...rpc import _agent
from ...rpc import api as rpc_api
from ...rpc.errors import InterfaceError
from ...rpc.futures import Future
from ...rpc.rref import RRef
from ...rpc.worker import WorkerInfo
from .interface import check_implements, interface_methods, is_interface

__all__ = ["RemoteModule"]

_NAME = "nn.RemoteModule"

# method -> what to do instead (the module lives on its owner)
_ON_OWNER = "run it on the owner: rm.get_module_rref().rpc_sync().{m}(...)"
_UNSUPPORTED: dict[str, str] = {
    **{m: "the device and dtype are fixed at construction: pass remote_device='worker/<device>' and build the "
          "module with the dtype you need (module_cls's constructor), or " + _ON_OWNER
       for m in ("cuda", "cpu", "to", "type", "float", "double", "half", "bfloat16", "ipu", "xpu", "mtia",
                 "to_empty")},
    "state_dict": "fetch a copy from the owner: rm.get_module_rref().rpc_sync().state_dict()",
    "load_state_dict": "load on the owner: rm.get_module_rref().rpc_sync().load_state_dict(state_dict)",
    **{m: _ON_OWNER for m in ("register_buffer", "register_parameter", "add_module", "register_module", "apply",
                              "share_memory", "requires_grad_", "get_submodule", "get_parameter", "get_buffer")},
    **{m: "hooks run where the module runs: register it on the owner with an RPC, e.g. "
          "rpc_sync(rm.get_module_rref().owner(), fn, args=(rm.get_module_rref(),)) where fn calls "
          "rref.local_value()." + m + "(...)"
       for m in ("register_forward_hook", "register_forward_pre_hook", "register_backward_hook",
                 "register_full_backward_hook", "register_full_backward_pre_hook", "register_state_dict_pre_hook",
                 "register_state_dict_post_hook", "register_load_state_dict_pre_hook",
                 "register_load_state_dict_post_hook")},
    "parameters": "use rm.remote_parameters() (RRefs, e.g. for DistributedOptimizer)",
    "named_parameters": "use rm.remote_parameters(), or a function on the owner returning the names",
    **{m: "the submodules and buffers live on the owner: inspect them with an RPC on rm.get_module_rref()"
       for m in ("buffers", "named_buffers", "children", "named_children", "modules", "named_modules")},
    "zero_grad": "with distributed autograd the gradients live in the autograd context, not in .grad (nothing to "
                 "zero); to clear .grad on the owner anyway: rm.get_module_rref().rpc_sync().zero_grad()",
    "extra_repr": "use repr(rm), or rm.get_module_rref().rpc_sync().extra_repr()",
}


def _unsupported(name: str) -> Callable[..., Any]:
    def method(self: "RemoteModule", *args: Any, **kwargs: Any) -> Any:
        raise DistValueError(format_message(
            f"{_NAME}.{name}", "not supported on a RemoteModule: the module lives on another worker",
            values={"on": self.on.name, "module_cls": self._module_cls_name},
            fix=_UNSUPPORTED[name].format(m=name)))

    method.__name__ = name
    method.__qualname__ = f"RemoteModule.{name}"
    method.__doc__ = f"Not supported on a RemoteModule (raises DistValueError). Instead: {_UNSUPPORTED[name].format(m=name)}."
    return method


# ---------------------------------------------------------------------------
# the owner's side
# ---------------------------------------------------------------------------
_keys = itertools.count()
_keys_lock = threading.Lock()


class _Entry:
    __slots__ = ("module", "allowed", "device", "cls_name")

    def __init__(self, module: nn.Module, allowed: frozenset[str] | None, device: torch.device,
                 on_release: Callable[[Any], None]) -> None:
        self.module = weakref.ref(module, on_release)  # the module's RRef keeps it alive, not the registry
        self.allowed = allowed
        self.device = device
        self.cls_name = type(module).__qualname__


def _owner_objects() -> dict[Any, Any]:
    a = _agent.current()
    if a is None:  # pragma: no cover  a call always runs under an agent
        raise DistRuntimeError(format_message(
            "nn.RemoteModule", "no RPC agent on this worker", values={"agent": None},
            fix="call rpc.init_rpc(...) on every worker before creating or calling a RemoteModule"))
    return a.objects


def _create(module_cls: type, args: tuple, kwargs: dict, device: str, allowed: frozenset[str] | None) -> tuple:
    """Runs on the owner: build the module, register it, return ``(key, RRef(module))``."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise DistValueError(format_message(
            _NAME, "remote_device names a CUDA device but this worker has no CUDA", values={"device": device},
            fix="use '<worker>/cpu', or a worker with GPUs"))
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise DistTypeError(format_message(
            _NAME, "module_cls(*args, **kwargs) did not return an nn.Module",
            values={"module_cls": module_cls.__qualname__, "returned": type(module).__name__},
            fix="pass an nn.Module subclass"))
    if dev.type != "cpu":
        module.to(dev)
    with _keys_lock:
        key = ("remote_module", next(_keys))
    objects = _owner_objects()
    objects[key] = _Entry(module, allowed, dev, lambda _ref: objects.pop(key, None))
    return key, RRef(module)


def _entry(key: Any) -> tuple[_Entry, nn.Module]:
    entry = _owner_objects().get(key)
    module = entry.module() if entry is not None else None
    if module is None:
        raise DistRuntimeError(format_message(
            _NAME, "the module is gone from its owner (every handle to it was released, or RPC restarted)",
            values={"key": key}, fix="keep a RemoteModule handle alive while you use copies of it"))
    return entry, module


def _to_device(obj: Any, dev: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dev)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(o, dev) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, dev) for k, v in obj.items()}
    return obj


def _call_module(key: Any, method: str, args: tuple, kwargs: dict) -> Any:
    """Runs on the owner: ``module.<method>(*args, **kwargs)``, refusing methods outside the interface."""
    entry, module = _entry(key)
    if entry.allowed is not None and method not in entry.allowed:
        raise InterfaceError(format_message(
            _NAME, "refused: the method is not part of this module's interface",
            values={"method": method, "module_cls": entry.cls_name, "interface_methods": sorted(entry.allowed)},
            fix="add the method to the interface class, or create the RemoteModule without interface="))
    fn = getattr(module, method)
    if entry.device.type != "cpu":  # inputs to the module's device, outputs back to the CPU for the wire
        return _to_device(fn(*_to_device(args, entry.device), **_to_device(kwargs, entry.device)),
                          torch.device("cpu"))
    return fn(*args, **kwargs)


def _set_training(key: Any, mode: bool) -> None:
    _entry(key)[1].train(mode)


def _param_rrefs(key: Any, recurse: bool) -> list[RRef[Any]]:
    return [RRef(p) for p in _entry(key)[1].parameters(recurse)]


# ---------------------------------------------------------------------------
# the handle
# ---------------------------------------------------------------------------
def _parse_remote_device(agent: _agent.Agent, remote_device: Any) -> tuple[WorkerInfo, str]:
    if not isinstance(remote_device, str):
        raise DistTypeError(format_message(
            _NAME, "remote_device must be a string", values={"remote_device": remote_device},
            fix="write 'worker1/cpu', 'rank:1/cuda:0' or 'worker1'"))
    worker, sep, device = remote_device.partition("/")
    if sep and not device:
        raise DistValueError(format_message(
            _NAME, "remote_device has an empty device after '/'", values={"remote_device": remote_device},
            fix="write 'worker1/cpu', or drop the '/' for the CPU"))
    device = device or "cpu"
    if not worker:
        raise DistValueError(format_message(
            _NAME, "remote_device has no worker before '/'", values={"remote_device": remote_device},
            fix="write '<worker name>/<device>' or 'rank:<N>/<device>'"))
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as e:
        raise DistValueError(format_message(
            _NAME, "remote_device names an invalid device", values={"remote_device": remote_device, "device": device,
                                                                     "error": str(e).splitlines()[0]},
            fix="use a torch device string such as 'cpu' or 'cuda:0'")) from None
    if worker.startswith("rank:"):
        try:
            rank = int(worker[5:])
        except ValueError:
            raise DistValueError(format_message(
                _NAME, "remote_device's rank is not an integer", values={"remote_device": remote_device},
                fix="write 'rank:<N>/<device>', e.g. 'rank:1/cpu'")) from None
        target: Any = rank
    else:
        target = worker
    try:
        info = agent.resolve(_NAME, target)
    except (DistValueError, DistTypeError) as e:
        raise DistValueError(format_message(
            _NAME, "remote_device names no worker of this RPC world",
            values={"remote_device": remote_device, "workers": [w.name for w in agent.worker_infos()]},
            fix="use a worker name from init_rpc(name=...) or 'rank:<N>'")) from e
    return info, str(dev)


_interface_classes: dict[type, type] = {}
_interface_lock = threading.Lock()


def _interface_class(iface: type) -> type:
    """``RemoteModule`` specialised to an interface: its methods and their ``_async`` twins, nothing else."""
    with _interface_lock:
        cls = _interface_classes.get(iface)
        if cls is not None:
            return cls
        ns: dict[str, Any] = {"_interface": iface, "_methods": frozenset(interface_methods(iface))}
        for name, sig in interface_methods(iface).items():
            ns[name] = _sync_method(iface, name, sig)
            ns[f"{name}_async"] = _async_method(iface, name, sig)
        if "forward" not in ns:
            ns["forward"] = _not_in_interface("forward")
            ns["forward_async"] = _not_in_interface("forward_async")
        cls = type(f"RemoteModule[{iface.__qualname__}]", (RemoteModule,), ns)
        cls.__module__ = RemoteModule.__module__
        _interface_classes[iface] = cls
        return cls


def _bind(sig: Any, iface: type, name: str, args: tuple, kwargs: dict) -> None:
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(format_message(
            f"{_NAME}.{name}", "the arguments do not match the interface's signature",
            values={"interface": iface.__qualname__, "signature": f"{name}{sig}", "error": str(e)},
            fix="call it as the interface declares")) from None


def _sync_method(iface: type, name: str, sig: Any) -> Callable[..., Any]:
    def method(self: "RemoteModule", *args: Any, **kwargs: Any) -> Any:
        _bind(sig, iface, name, args, kwargs)
        return self._call_sync(name, args, kwargs)

    method.__name__ = method.__qualname__ = name
    method.__signature__ = sig  # type: ignore[attr-defined]
    method.__doc__ = f"``{iface.__qualname__}.{name}`` run on the owner (blocking)."
    return method


def _async_method(iface: type, name: str, sig: Any) -> Callable[..., Any]:
    def method(self: "RemoteModule", *args: Any, **kwargs: Any) -> Future[Any]:
        _bind(sig, iface, name, args, kwargs)
        return self._call_async(name, args, kwargs)

    method.__name__ = method.__qualname__ = f"{name}_async"
    method.__signature__ = sig  # type: ignore[attr-defined]
    method.__doc__ = f"``{iface.__qualname__}.{name}`` run on the owner; returns a Future."
    return method


def _not_in_interface(name: str) -> Callable[..., Any]:
    def method(self: "RemoteModule", *args: Any, **kwargs: Any) -> Any:
        raise InterfaceError(format_message(
            f"{_NAME}.{name}", "the method is not part of this RemoteModule's interface",
            values={"interface": self._interface.__qualname__, "methods": sorted(self._methods)},
            fix="call one of the interface's methods, or add it to the interface"))

    method.__name__ = name
    return method


class RemoteModule(nn.Module):
    """A handle to an ``nn.Module`` built and run on another worker.

    Args:
        remote_device: ``"<worker name>/<device>"``, ``"rank:<N>/<device>"``, or just the worker
            (``"worker1"``, device ``cpu``).
        module_cls: an ``nn.Module`` subclass, instantiated on the remote worker as
            ``module_cls(*args, **kwargs)``.
        args, kwargs: the constructor's arguments (they cross by value).
        interface: a class marked with :func:`~tensorplay.distributed.nn.api.interface`; the handle then
            exposes exactly its methods, each also as ``<name>_async``, and the owner refuses any other.
        timeout: per-call timeout in seconds for this handle's calls (default: the RPC default).

    Example::

        rm = RemoteModule("worker1/cpu", tp.nn.Linear, args=(16, 8))
        rm(tp.randn(4, 16)).shape            # torch.Size([4, 8]), computed on worker1
    """

    _interface: type | None = None
    _methods: frozenset[str] | None = None

    def __new__(cls, *args: Any, interface: type | None = None, **kwargs: Any) -> "RemoteModule":
        if cls is RemoteModule and interface is not None:
            if not is_interface(interface):
                raise DistTypeError(format_message(
                    _NAME, "interface must be a class decorated with @interface",
                    values={"interface": interface}, fix="decorate it with tensorplay.distributed.nn.api.interface"))
            cls = _interface_class(interface)
        return super().__new__(cls)

    def __init__(self, remote_device: str, module_cls: type, args: Any = (), kwargs: Any = None, *,
                 interface: type | None = None, timeout: float | None = None) -> None:
        super().__init__()
        agent = _agent.require(_NAME)
        info, device = _parse_remote_device(agent, remote_device)
        if not isinstance(module_cls, type) or not issubclass(module_cls, nn.Module):
            raise DistTypeError(format_message(
                _NAME, "module_cls must be an nn.Module subclass (the class, not an instance)",
                values={"module_cls": module_cls, "type": type(module_cls).__name__},
                fix="pass the class, e.g. RemoteModule('worker1/cpu', tp.nn.Linear, args=(16, 8))"))
        if isinstance(args, list):
            args = tuple(args)
        if not isinstance(args, tuple):
            raise DistTypeError(format_message(_NAME, "args must be a tuple", values={"args": type(args).__name__},
                                               fix="write args=(16, 8)"))
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise DistTypeError(format_message(_NAME, "kwargs must be a dict", values={"kwargs": type(kwargs).__name__},
                                               fix="write kwargs={'bias': False}"))
        if interface is not None:
            check_implements(interface, module_cls)
        allowed = None if interface is None else frozenset(interface_methods(interface))
        if timeout is not None:
            timeout = _agent.check_timeout(_NAME, timeout, agent)
        try:
            key, rref = rpc_api.rpc_sync(info, _create, args=(module_cls, args, kwargs, device, allowed),
                                         timeout=timeout)
        except BaseException as e:
            if hasattr(e, "add_note"):
                e.add_note(f"--- while constructing {module_cls.__qualname__}(*args, **kwargs) on worker "
                           f"{info.name!r} for RemoteModule({remote_device!r}, ...)")
            raise
        self._set(info, device, key, rref, module_cls.__qualname__, timeout)

    def _set(self, on: WorkerInfo, device: str, key: Any, rref: RRef[Any], cls_name: str,
             timeout: float | None) -> None:
        d = self.__dict__  # plain attributes, bypassing nn.Module.__setattr__
        d["on"] = on
        d["device"] = device
        d["_key"] = key
        d["module_rref"] = rref
        d["_module_cls_name"] = cls_name
        d["_timeout"] = timeout

    # -- calls ----------------------------------------------------------------
    def _call_sync(self, method: str, args: tuple, kwargs: dict) -> Any:
        a = _agent.require(f"{_NAME}.{method}")
        t = a.timeout if self._timeout is None else self._timeout
        return a.call_sync(f"{_NAME}.{method}", self.on, _call_module, (self._key, method, args, kwargs), {}, t)

    def _call_async(self, method: str, args: tuple, kwargs: dict) -> Future[Any]:
        a = _agent.require(f"{_NAME}.{method}")
        t = a.timeout if self._timeout is None else self._timeout
        return a.call_async(f"{_NAME}.{method}", self.on, _call_module, (self._key, method, args, kwargs), {}, t)

    def forward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Run the module's ``forward`` on the owner and return its output."""
        return self._call_sync("forward", args, kwargs)

    def forward_async(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run the module's ``forward`` on the owner; returns a :class:`~tensorplay.distributed.rpc.Future`."""
        return self._call_async("forward", args, kwargs)

    def remote_parameters(self, recurse: bool = True) -> list[RRef[Any]]:
        """RRefs to the module's parameters (owned by the module's worker)."""
        return rpc_api.rpc_sync(self.on, _param_rrefs, args=(self._key, recurse), timeout=self._timeout)

    def get_module_rref(self) -> RRef[nn.Module]:
        """The RRef of the module itself (use its proxies to run any method on the owner)."""
        return self.module_rref

    def train(self, mode: bool = True) -> "RemoteModule":  # type: ignore[override]
        """Set training mode on the owner's module."""
        rpc_api.rpc_sync(self.on, _set_training, args=(self._key, bool(mode)), timeout=self._timeout)
        return self

    def eval(self) -> "RemoteModule":  # type: ignore[override]
        """Set evaluation mode on the owner's module."""
        return self.train(False)

    # -- the handle itself ------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        where = self.__dict__.get("on")
        if self._interface is not None:
            hint = (f"{name!r} is not in the interface {self._interface.__qualname__} "
                    f"(methods: {', '.join(sorted(self._methods or ()))}); add it to the interface")
        else:
            hint = (f"the module lives on {getattr(where, 'name', '?')!r}: call its methods with "
                    f"rm.get_module_rref().rpc_sync().{name}(...), or declare them in an interface")
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}. Fix: {hint}")

    def __repr__(self) -> str:
        if "on" not in self.__dict__:
            return f"{type(self).__name__}(<not constructed>)"
        iface = f", interface={self._interface.__qualname__}" if self._interface is not None else ""
        return f"{type(self).__name__}(on={self.on.name!r}, device={self.device!r}, module={self._module_cls_name}{iface})"

    def __reduce_ex__(self, protocol: int) -> Any:
        # crosses workers only inside an RPC: the RRef inside refuses to pickle anywhere else
        return (_rebuild, (self._interface, self.on, self.device, self._key, self.module_rref,
                           self._module_cls_name, self._timeout))


for _m in _UNSUPPORTED:
    setattr(RemoteModule, _m, _unsupported(_m))
del _m


def _rebuild(iface: type | None, on: WorkerInfo, device: str, key: Any, rref: RRef[Any], cls_name: str,
             timeout: float | None) -> RemoteModule:
    cls = RemoteModule if iface is None else _interface_class(iface)
    rm = nn.Module.__new__(cls)
    nn.Module.__init__(rm)
    rm._set(on, device, key, rref, cls_name, timeout)
    return rm
