"""A post-import hook: patch a module the moment it is imported, or now if it was (used by several adapters).

The modules the adapters patch this way (FSDP1, DTensor, DDP, torch's RPC optimizer, Hydra) take a second or
more to import: a program that never imports them must not pay for it.
"""
from __future__ import annotations

import importlib.abc
import sys
from typing import Any

__all__ = ["when_imported"]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then(module)`` right after module ``name`` is first executed (a post-import hook)."""

    def __init__(self, name: str, then: Any) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        loader, then = spec.loader, self.then

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                then(module)

        spec.loader = _Loader()
        return spec


def when_imported(name: str, apply: Any) -> Any:
    """``apply(module)`` to module ``name`` now if imported, else right after its import; returns the undo.

    The modules patched this way (FSDP1, DTensor) take a second or more to
    import: a program that never imports them must not pay for it.
    """
    undos: list[Any] = []
    module = sys.modules.get(name)
    if module is not None:
        undos.append(apply(module))
        hook = None
    else:
        hook = _AfterImport(name, lambda m: undos.append(apply(m)))
        sys.meta_path.insert(0, hook)

    def undo() -> None:
        if hook is not None and hook in sys.meta_path:
            sys.meta_path.remove(hook)
        while undos:
            undos.pop()()

    return undo
