"""``@interface``: declare the methods a RemoteModule may call, in plain Python.

An interface is a class whose public methods (names not starting with ``_``)
are the *whole* remote surface of a module::

    from tensorplay.distributed.nn.api import interface

    @interface
    class Encoder:
        def forward(self, x: Tensor) -> Tensor: ...
        def encode(self, x: Tensor, *, normalize: bool = False) -> Tensor: ...

    enc = RemoteModule("worker1/cpu", MyEncoder, interface=Encoder)
    enc(x); enc.encode(x, normalize=True); enc.encode_async(x).wait()

``RemoteModule(..., interface=I)`` checks, before anything is sent, that the
module class implements every method of ``I`` with a *compatible* signature,
meaning every call that is valid for the interface's signature is valid for
the implementation's:

* the interface's positional parameters are there, in order, with the same
  names (and defaults where the interface has defaults);
* its keyword-only parameters are accepted (by name, or by ``**kwargs``);
* ``*args`` / ``**kwargs`` in the interface need them in the implementation;
* extra parameters of the implementation have defaults.

This replaces torch's ``torch.jit.interface`` (TorchScript) with
``inspect.signature``; the remote side then refuses any method outside the
interface.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ...rpc.errors import InterfaceError

__all__ = ["interface", "is_interface", "interface_methods", "check_implements", "InterfaceError"]

_ATTR = "__tensorplay_remote_interface__"
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@dataclass(frozen=True)
class _Spec:
    name: str
    methods: Mapping[str, inspect.Signature]  # signatures without ``self``


def _strip_self(fn: Callable[..., Any]) -> inspect.Signature:
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    return sig.replace(parameters=params[1:])


def interface(cls: type) -> type:
    """Mark ``cls`` as a remote-method interface (its public methods, and those of interface bases)."""
    if not isinstance(cls, type):
        raise InterfaceError(f"tensorplay.distributed.nn.api.interface: expected a class, got {cls!r}: "
                             f"type={type(cls).__name__}. Fix: put @interface on a class definition")
    methods: dict[str, inspect.Signature] = {}
    for base in reversed(cls.__mro__[1:]):
        spec = base.__dict__.get(_ATTR)
        if spec is not None:
            methods.update(spec.methods)
    for name, obj in cls.__dict__.items():
        if name.startswith("_"):
            continue
        if isinstance(obj, (staticmethod, classmethod, property)):
            raise InterfaceError(
                f"tensorplay.distributed.nn.api.interface: interface methods must be plain methods: "
                f"interface={cls.__qualname__!r}, method={name!r}, kind={type(obj).__name__}. "
                f"Fix: declare `def {name}(self, ...)`")
        if not inspect.isfunction(obj):
            continue
        params = list(inspect.signature(obj).parameters.values())
        if not params or params[0].kind not in _POSITIONAL:
            raise InterfaceError(
                f"tensorplay.distributed.nn.api.interface: an interface method needs `self` first: "
                f"interface={cls.__qualname__!r}, method={name!r}. Fix: write `def {name}(self, ...)`")
        methods[name] = _strip_self(obj)
    if not methods:
        raise InterfaceError(
            f"tensorplay.distributed.nn.api.interface: the interface declares no public method: "
            f"interface={cls.__qualname__!r}. Fix: declare at least `def forward(self, ...)`")
    setattr(cls, _ATTR, _Spec(cls.__qualname__, dict(methods)))
    return cls


def is_interface(obj: Any) -> bool:
    """Whether ``obj`` is a class marked with :func:`interface`."""
    return isinstance(obj, type) and isinstance(obj.__dict__.get(_ATTR), _Spec)


def interface_methods(iface: type) -> dict[str, inspect.Signature]:
    """``{method name: signature without self}`` of an interface."""
    if not is_interface(iface):
        raise InterfaceError(
            f"tensorplay.distributed.nn.api.interface_methods: not an interface: interface={iface!r}. "
            f"Fix: decorate the class with @tensorplay.distributed.nn.api.interface")
    return dict(iface.__dict__[_ATTR].methods)


def _incompatibility(want: inspect.Signature, have: inspect.Signature) -> str | None:
    """Why a call valid for ``want`` might fail for ``have``, or ``None`` if none can."""
    wp, hp = list(want.parameters.values()), list(have.parameters.values())
    h_pos = [p for p in hp if p.kind in _POSITIONAL]
    h_varpos = any(p.kind is p.VAR_POSITIONAL for p in hp)
    h_varkw = any(p.kind is p.VAR_KEYWORD for p in hp)
    h_by_name = {p.name: p for p in hp if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    used: set[str] = set()
    w_pos = [p for p in wp if p.kind in _POSITIONAL]
    for i, p in enumerate(w_pos):
        if i < len(h_pos):
            q = h_pos[i]
            if p.kind is p.POSITIONAL_OR_KEYWORD and (q.name != p.name or q.kind is not q.POSITIONAL_OR_KEYWORD):
                return f"positional parameter {i} is {q.name!r} ({q.kind.description}), the interface has {p.name!r}"
            if p.default is not p.empty and q.default is q.empty:
                return f"parameter {q.name!r} needs a default, as in the interface"
            used.add(q.name)
        elif not h_varpos:
            return f"it takes no positional parameter {i} ({p.name!r})"
    for p in wp:
        if p.kind is p.KEYWORD_ONLY:
            q = h_by_name.get(p.name)
            if q is None and not h_varkw:
                return f"it has no keyword parameter {p.name!r}"
            if q is not None:
                if p.default is not p.empty and q.default is q.empty:
                    return f"parameter {q.name!r} needs a default, as in the interface"
                used.add(q.name)
        elif p.kind is p.VAR_POSITIONAL and not h_varpos:
            return "the interface takes *args, the implementation does not"
        elif p.kind is p.VAR_KEYWORD and not h_varkw:
            return "the interface takes **kwargs, the implementation does not"
    for q in hp:
        if q.kind in (q.VAR_POSITIONAL, q.VAR_KEYWORD) or q.name in used:
            continue
        if q.default is q.empty:
            return f"its parameter {q.name!r} is not in the interface and has no default"
    return None


def check_implements(iface: type, cls: type) -> None:
    """Raise :class:`InterfaceError` listing every method of ``iface`` that ``cls`` lacks or declares incompatibly."""
    methods = interface_methods(iface)
    problems = []
    for name, want in methods.items():
        impl = inspect.getattr_static(cls, name, None)
        if impl is None:
            problems.append(f"{name}: missing (interface: {name}{want})")
            continue
        if isinstance(impl, (staticmethod, classmethod)) or not callable(impl):
            problems.append(f"{name}: not a plain method ({type(impl).__name__})")
            continue
        try:
            have = _strip_self(impl)
        except (TypeError, ValueError):  # builtins without signatures: cannot check, accept
            continue
        why = _incompatibility(want, have)
        if why:
            problems.append(f"{name}: {why} (interface: {name}{want}; {cls.__qualname__}: {name}{have})")
    if problems:
        raise InterfaceError(
            f"tensorplay.distributed.nn.RemoteModule: module_cls does not implement the interface: "
            f"module_cls={cls.__qualname__!r}, interface={iface.__qualname__!r}, problems=[{'; '.join(problems)}]. "
            f"Fix: give {cls.__qualname__} these methods with the interface's signatures, or pass another interface")
