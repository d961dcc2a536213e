"""Pinned host memory while a stand-in is on: ``torch.empty(n, pin_memory=True)`` and DDP's unused-parameter map.

With the stand-in's ``privateuseone`` device registered as torch's accelerator, torch asks that device's
PrivateUse1 hooks for the pinned-memory allocator (``torch.randn(3, pin_memory=True)``, and the DDP reducer
under ``find_unused_parameters=True`` or ``static_graph=True``, which stages its used-parameter map in pinned
memory and asserts ``is_pinned()``).  torch's Python-registered hooks cannot answer: their C++ class
(``torch::acc::PythonHooks``) forwards three questions to Python and answers the rest with torch's default,
which raises ``NotImplementedError``.

On a CPU "pinned" memory is ordinary memory, so the stand-in gives the hooks object two answers of its own:
the pinned allocator is the CPU allocator, and a host pointer torch asks about counts as pinned while the
stand-in is on (``Tensor.pin_memory()`` is a no-op on stand-ins, and its result reports ``is_pinned()``).  The object's virtual table is copied and the two entries replaced; the
entries are found by the addresses of torch's own functions (read from ``libtorch_python.so``'s symbol table)
and nothing is written unless both are found where the copy will be taken from.  Any surprise leaves torch's
behaviour (the error) as it was: :func:`patch` returns False.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import struct
from typing import Any, Callable

import torch

__all__ = ["patch", "SYMBOLS"]

_ALLOCATOR = b"_ZNK5torch3acc11PythonHooks24getPinnedMemoryAllocatorEv"
_IS_PINNED = b"_ZNK5torch3acc11PythonHooks11isPinnedPtrEPKv"
_CPU_ALLOCATOR = "_ZN3c1015GetCPUAllocatorEv"  # c10::GetCPUAllocator()
#: the native symbols this module uses (mangled C++ names of torch 2.13/2.14)
SYMBOLS = (_ALLOCATOR.decode(), _IS_PINNED.decode(), _CPU_ALLOCATOR)
_SLOTS = 64  # virtual functions searched (the hooks interface has about 25)
_PTR = ctypes.sizeof(ctypes.c_void_p)
_kept: list[Any] = []  # the table copy and the callbacks: they must outlive the hooks object


def _symbol_offsets(path: str, names: tuple[bytes, ...]) -> dict[bytes, int]:
    """``st_value`` of each of ``names`` in the ELF file's static symbol table (absent names are left out)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"\x7fELF" or m[4] != 2:  # 64-bit ELF only
            return {}
        shoff, = struct.unpack_from("<Q", m, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", m, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", m, shoff + i * shentsize) for i in range(shnum)]
        found: dict[bytes, int] = {}
        for sec in sections:
            if sec[1] != 2:  # SHT_SYMTAB
                continue
            strtab = sections[sec[6]]
            s_lo, s_hi = strtab[4], strtab[4] + strtab[5]
            wanted = {}
            for name in names:
                at = m.find(b"\0" + name + b"\0", s_lo, s_hi)
                if at >= 0:
                    wanted[at + 1 - s_lo] = name
            for st_name, _info, _other, _shndx, value, _size in struct.iter_unpack("<IBBHQQ", m[sec[4]:sec[4] + sec[5]]):
                if st_name in wanted:
                    found[wanted[st_name]] = value
        return found


def _load_base(path: str) -> int | None:
    real = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and parts[2] == "00000000" and os.path.realpath(parts[5]) == real:
                return int(parts[0].split("-")[0], 16)
    return None


def patch(hooks: Any, active: Callable[[], bool]) -> bool:
    """Give the registered PrivateUse1 ``hooks`` a pinned allocator and a pinned-pointer answer (see above)."""
    try:
        path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_python.so")
        offsets = _symbol_offsets(path, (_ALLOCATOR, _IS_PINNED))
        base = _load_base(path)
        if len(offsets) != 2 or base is None:
            return False
        targets = {base + offsets[_ALLOCATOR]: "allocator", base + offsets[_IS_PINNED]: "is_pinned"}
        # pybind11 keeps a simple instance's C++ pointer right after the Python object header
        obj = ctypes.c_void_p.from_address(id(hooks) + 2 * _PTR).value
        vptr = ctypes.c_void_p.from_address(obj).value if obj else None
        if not vptr:
            return False
        slots = (ctypes.c_void_p * _SLOTS).from_address(vptr)
        where = {targets[p]: i for i, p in enumerate(slots) if p in targets}
        if len(where) != 2:
            return False
        c10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        get_cpu = c10[_CPU_ALLOCATOR]
        get_cpu.restype = ctypes.c_void_p
        cpu_allocator = get_cpu()
    except (OSError, ValueError, struct.error, AttributeError):
        return False

    @ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
    def allocator(this: int) -> int:
        return cpu_allocator

    @ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p)
    def is_pinned(this: int, pointer: int) -> bool:
        return active()

    # the copy starts two entries early: the offset-to-top and the type info that precede the functions
    table = (ctypes.c_void_p * (_SLOTS + 2))()
    ctypes.memmove(table, vptr - 2 * _PTR, (_SLOTS + 2) * _PTR)
    table[2 + where["allocator"]] = ctypes.cast(allocator, ctypes.c_void_p).value
    table[2 + where["is_pinned"]] = ctypes.cast(is_pinned, ctypes.c_void_p).value
    _kept.extend((table, allocator, is_pinned))
    ctypes.c_void_p.from_address(obj).value = ctypes.addressof(table) + 2 * _PTR
    return True
