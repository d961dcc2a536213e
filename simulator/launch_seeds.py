"""Where the ranks of processes a launcher script starts begin their torch random streams.

A child started with the ``spawn`` (or ``forkserver``) method is a fresh interpreter: it imports the script
as ``__mp_main__``, so it runs the script's top-level code but not its ``if __name__ == "__main__":``
block.  A seed the script sets at top level reaches every child; a seed set in the main block (where most
scripts parse ``--seed``) does not, and each child starts from a random seed of its own, as an unseeded
program does.  A ``fork`` child is a copy of the launcher: it has the launcher's state at ``start()``.

:class:`SeedWatch` watches ``torch.manual_seed`` on the launcher's thread while its script runs and tells
which of these a world of started processes gets (:meth:`SeedWatch.origin`, read by
:func:`simulator.core.seeds.initial_rng_states`).  Example: a script that calls ``torch.manual_seed(0)`` in
its main block and then ``mp.spawn(train, nprocs=2)`` gives its two ranks distinct seeds, as two real
processes would have; moved to the top of the script, the seed reaches both.
"""
from __future__ import annotations

import ast
import sys
import threading
from typing import Any

import torch

from simulator.core.state import current_rank_state

__all__ = ["SeedWatch", "main_guards"]


def _is_main_test(node: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq)):
        return False
    sides = [node.left, node.comparators[0]]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and \
        any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)


def main_guards(path: str) -> list[tuple[int, int]]:
    """The line ranges of the script's top-level ``if __name__ == "__main__":`` blocks (none if it does not
    parse: the script then fails as it would anyway)."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return []
    return [(n.lineno, n.end_lineno or n.lineno) for n in tree.body if isinstance(n, ast.If) and _is_main_test(n.test)]


class SeedWatch:
    """Records the torch state after each top-level seeding of the script ``path`` (see the module)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.guards = main_guards(path)
        self.thread = threading.current_thread()
        self.top: tuple[torch.Tensor, int] | None = None  # (state, seed) after the last top-level seeding
        self._saved: list[tuple[Any, Any]] = []

    def _in_main_block(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_name == "<module>" and frame.f_code.co_filename == self.path:
                return any(a <= frame.f_lineno <= b for a, b in self.guards)
            frame = frame.f_back
        return True  # (not called from the script's top level: its own functions, run from the main block)

    def __enter__(self) -> "SeedWatch":
        original = torch.random.manual_seed

        def manual_seed(seed: Any) -> Any:
            out = original(seed)
            if threading.current_thread() is self.thread and current_rank_state() is None \
                    and not self._in_main_block():
                self.top = (torch.get_rng_state(), torch.initial_seed())
            return out

        for owner in (torch, torch.random):
            self._saved.append((owner, owner.manual_seed))
            owner.manual_seed = manual_seed
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, f in reversed(self._saved):
            owner.manual_seed = f
        self._saved.clear()

    def origin(self, start_method: str, world_index: int) -> Any:
        """How a world of processes started with ``start_method`` begins (None: as the launcher is now)."""
        if start_method == "fork":
            return None
        if self.top is not None:
            return ("state", *self.top)
        return ("fresh", world_index)
