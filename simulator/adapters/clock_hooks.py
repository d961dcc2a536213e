"""Honest clocks: the CPU time of imports is not compute, and optimizer steps mark the step time.

While a world runs, importlib's ``_find_and_load`` is wrapped so that an outermost import on a rank moves the
rank's compute mark past it (every real process pays its own imports once; here one rank would pay them for
all), and a ``torch.optim`` post-step hook records the end of each training step on the rank's clock.
"""
from __future__ import annotations

import importlib
import threading
import time
import weakref
from typing import Any, Callable, ContextManager

from simulator.adapters._patch import Installation
from simulator.core._actor import current_rank_state
from simulator.core.clock import charge_compute

__all__ = ["timed_imports", "mark_step", "enabled"]

_saved: dict[str, Any] = {}


def _actor() -> Any:
    return current_rank_state()


def timed_imports(original: Callable[[str, Any], Any],
                  excluder: Callable[[], Callable[[float], None] | None]) -> Callable[[str, Any], Any]:
    """Wrap importlib's ``_find_and_load`` so an outermost import's CPU time is not compute.

    ``excluder()`` gives, for the calling thread, what to tell the CPU time of the import to (``None``:
    not a rank, import plainly).  Thread ranks move the actor's compute mark past it; a rank process tells
    its proxy.  Nested imports are part of the outermost one.
    """
    depth = threading.local()

    def find_and_load(name: str, import_: Any) -> Any:
        exclude = None if getattr(depth, "d", 0) else excluder()
        if exclude is None:
            return original(name, import_)
        depth.d = 1
        t0 = time.thread_time()
        try:
            return original(name, import_)
        finally:
            depth.d = 0
            exclude(time.thread_time() - t0)

    return find_and_load


def _rank_excluder() -> Callable[[float], None] | None:
    rs = _actor()
    if rs is None:
        return None

    def exclude(dt: float) -> None:
        # the rank's compute mark moves past the import: its CPU time is start-up, charged to no one
        rs.cpu_mark += dt

    return exclude


#: per run (weakly: the hook's state ends with its run): the optimizer whose steps mark each rank's training
#: steps, by rank
_first_optimizer: "weakref.WeakKeyDictionary[Any, dict[int, int]]" = weakref.WeakKeyDictionary()


def mark_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """A ``torch.optim`` post-step hook: the end of a training step on the rank's clock (a rank process's proxy
    calls it for the rank's steps too)."""
    rs = _actor()
    if rs is None or rs.parent is not None:
        return
    # the first optimizer a rank steps marks its training steps (a second one, e.g. a local reference
    # model's, would split each step in two)
    first = _first_optimizer.setdefault(rs.run, {}).setdefault(rs.rank, id(optimizer))
    if first != id(optimizer):
        return
    charge_compute(rs)
    rs.run.events.steps[rs.rank].append(rs.vt)


def _install() -> None:
    boot = importlib.import_module("importlib._bootstrap")
    _saved["find_and_load"] = boot._find_and_load
    boot._find_and_load = timed_imports(_saved["find_and_load"], _rank_excluder)
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _saved["step_handle"] = register_optimizer_step_post_hook(mark_step)
    except ImportError:  # pragma: no cover  (every supported torch has it)
        _saved["step_handle"] = None


def _uninstall() -> None:
    boot = importlib.import_module("importlib._bootstrap")
    if "find_and_load" in _saved:
        boot._find_and_load = _saved.pop("find_and_load")
    handle = _saved.pop("step_handle", None)
    if handle is not None:
        handle.remove()


_INSTALLATION = Installation(_install, _uninstall)


def enabled() -> ContextManager[None]:
    """While a world runs: imports on rank threads are not charged as compute, and every
    ``torch.optim`` step marks the end of a training step on the rank's clock (the summary's step time)."""
    return _INSTALLATION.enabled()
