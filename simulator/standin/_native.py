"""The C++-level registrations that let torch's autograd engine run on stand-in tensors.

A stand-in is, to torch's C++ side, a tensor on the ``privateuseone`` device
(``python -c "help(torch.utils.rename_privateuse1_backend)"``); Python sees
``cuda``.  Three things must hold for torch's C++ code to accept such tensors
on a build without CUDA, or on a CUDA build on a machine without a GPU:

* a device guard for ``privateuseone`` (autograd asks it for the tensor's
  stream when it records an op) and one for ``cuda`` (``torch.tensor(data,
  device="cuda")`` and ``Tensor.to("cuda")`` take a guard on the target);
  torch's own :class:`torch._C._acc.DeviceGuard` is a do-nothing guard;
* PrivateUse1 hooks (asked whether a device context exists);
* torch's "a privateuseone backend is registered" flag: the autograd engine
  asks ``at::getAccelerator()`` for the current stream of every gradient on an
  accelerator device, and answers "none is available" without it.

The guard and the hooks are registered once per process and stay (they are
only ever asked about ``privateuseone`` tensors, which only the stand-in
creates).  The ``cuda`` guard slot and the flag are set by :func:`install`
and put back by :func:`uninstall`: outside :func:`simulator.standin.enabled`
torch has no accelerator and no CUDA, as before (a CUDA build: its own
``cuda`` guard is kept aside while a stand-in is on, and put back).  torch offers no call to
clear the flag, so it is located in ``libc10`` (the byte that
``c10::is_privateuse1_backend_registered()`` loads) and the location is
verified against that function's own answer before it is ever written.
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import torch

from tensorplay.distributed.errors import format_message

from simulator.standin import _pinned
from simulator.standin.errors import StandInError

__all__ = ["install", "uninstall", "NATIVE_SYMBOLS"]

#: the exported libc10 symbols used here (mangled C++ names of torch 2.13/2.14)
NATIVE_SYMBOLS = (
    "_ZN3c104impl26device_guard_impl_registryE",  # c10::impl::device_guard_impl_registry (one slot per device type)
    "_ZN3c104impl24DeviceGuardImplRegistrarC1ENS_10DeviceTypeEPKNS0_24DeviceGuardImplInterfaceE",  # its registrar
    "_ZN3c1033is_privateuse1_backend_registeredEv",  # c10::is_privateuse1_backend_registered()
)

_CUDA = int(torch._C._autograd.DeviceType.CUDA)
_PU = int(torch._C._autograd.DeviceType.PrivateUse1)
_lock = threading.Lock()
_state: dict[str, Any] = {}


def _refuse(problem: str, **values: Any) -> StandInError:
    return StandInError(format_message(
        "simulator.standin.enabled", problem, values=values or None,
        fix="use a supported torch build (the CPU wheel of torch 2.13 or 2.14 for x86-64 Linux), or run "
            "without devices='cuda' and let the program use the CPU"))


class _Guard(torch._C._acc.DeviceGuard):
    """torch's do-nothing device guard (streams: the default one; events: complete at once) for one device type."""

    def __init__(self, kind: Any) -> None:
        super().__init__()
        self._kind = kind

    def type_(self) -> Any:
        return self._kind


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    """PrivateUse1 hooks: "built", available only while a stand-in is enabled, no device context ever created."""

    active = False

    def has_primary_context(self, device_index: int) -> bool:
        return False

    def is_built(self) -> bool:
        return True

    def is_available(self) -> bool:
        return _Hooks.active


def _libc10() -> Any:
    return ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))


def _flag(lib: Any) -> tuple[Any, Any]:
    """``(byte, query)``: the registered-flag byte and ``is_privateuse1_backend_registered``; located from its code.

    x86-64 code of the function: ``movzbl disp32(%rip),%eax`` (``0f b6 05`` + disp32), the flag at ``rip + disp``.
    """
    query = lib[NATIVE_SYMBOLS[2]]
    query.restype = ctypes.c_bool
    addr = ctypes.cast(query, ctypes.c_void_p).value
    code = ctypes.string_at(addr, 7) if addr else b""
    if code[:3] != b"\x0f\xb6\x05":
        raise _refuse("the privateuse1 flag of this torch build cannot be located", code=code.hex())
    disp = int.from_bytes(code[3:7], "little", signed=True)
    return ctypes.c_uint8.from_address(addr + 7 + disp), query


def _setup_once() -> None:
    """Register the guards and hooks (once per process) and locate the registry and the flag."""
    if "registry" in _state:
        return
    try:
        lib = _libc10()
        registry = (ctypes.c_void_p * 64).in_dll(lib, NATIVE_SYMBOLS[0])
        registrar = lib[NATIVE_SYMBOLS[1]]
    except (OSError, ValueError, AttributeError) as e:
        raise _refuse(f"torch's device-guard registry is not reachable ({e})") from e
    registrar.argtypes = [ctypes.c_void_p, ctypes.c_int8, ctypes.c_void_p]
    registrar.restype = None
    byte, query = _flag(lib)
    if byte.value != int(query()) or query():
        # a privateuseone backend of the program's own (an out-of-tree device) owns the slot: never touch it
        raise _refuse("a privateuseone backend is already registered in this process",
                      backend=torch._C._get_privateuse1_backend_name())
    # a CUDA build's own guard: aside while a stand-in is on (a machine without a GPU never reaches it), put back after
    real_cuda = registry[_CUDA]
    if real_cuda and torch.cuda.device_count():
        raise StandInError(format_message(
            "simulator.standin.enabled", "this machine has GPUs: the stand-in replaces CUDA only where there is none",
            values={"torch.version.cuda": torch.version.cuda, "gpus": torch.cuda.device_count()},
            fix="run the program on this machine's GPUs (simulator.run(..., device='cuda'), or python -m simulator "
                "without --devices cuda), or hide them from this process with CUDA_VISIBLE_DEVICES= to simulate "
                "GPUs on the CPU"))
    if registry[_PU]:
        raise _refuse("a device guard for privateuseone is already registered in this process")
    this = ctypes.create_string_buffer(16)  # the registrar's ``this``: it keeps no state

    def put(kind: int, pointer: int | None) -> None:
        registrar(this, kind, pointer)

    # torch registers a Python guard only into the privateuseone slot: register the cuda one there first, move
    # it to the cuda slot (kept aside until install), then register the privateuseone one for good
    cuda_guard, pu_guard, hooks = _Guard(torch._C._autograd.DeviceType.CUDA), \
        _Guard(torch._C._autograd.DeviceType.PrivateUse1), _Hooks()
    if not torch._C._acc.register_python_privateuseone_device_guard(cuda_guard):
        raise _refuse("torch refused the stand-in's device guard")
    cuda_pointer = registry[_PU]
    put(_PU, None)
    if not torch._C._acc.register_python_privateuseone_device_guard(pu_guard):
        raise _refuse("torch refused the stand-in's device guard")
    if not torch._C._acc.register_python_privateuseone_hook(hooks):
        raise _refuse("torch refused the stand-in's PrivateUse1 hooks (another backend registered its own)")
    pinned = _pinned.patch(hooks, lambda: _Hooks.active)  # (False: pin_memory=True keeps torch's error)
    _state.update(registry=registry, put=put, cuda_pointer=cuda_pointer, real_cuda=real_cuda, byte=byte, query=query,
                  keep=(cuda_guard, pu_guard, hooks), pinned=pinned)


def install() -> None:
    """Make torch's C++ side accept stand-ins: the cuda device guard and the privateuseone-registered flag."""
    with _lock:
        _setup_once()
        _state["put"](_CUDA, _state["cuda_pointer"])
        # registers the default name again: sets the flag (and nothing else: the name stays "privateuseone")
        torch._C._rename_privateuse1_backend("privateuseone")
        if not _state["query"]() or _state["byte"].value != 1:
            _state["put"](_CUDA, _state["real_cuda"])
            raise _refuse("the privateuse1 flag did not read back as set")
        _Hooks.active = True
        if _state["pinned"]:
            # torch counts no host pointer as pinned until the accelerator was initialised (which a pin_memory=True
            # factory does): initialise it now, so Tensor.pin_memory() results (DataLoader(pin_memory=True)'s
            # batches) report is_pinned() from the first, as on a GPU machine
            torch.empty(0, pin_memory=True)


def uninstall() -> None:
    """Put torch's C++ side back: no cuda guard, no accelerator (tolerates a partial :func:`install`)."""
    with _lock:
        if "registry" not in _state:
            return
        _Hooks.active = False
        _state["put"](_CUDA, _state["real_cuda"])
        byte = _state["byte"]
        if byte.value:
            byte.value = 0
