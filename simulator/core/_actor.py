"""Which simulated actor (a rank, or a thread a rank started) runs on the calling OS thread.

The bottom of the simulator's imports: the state, the cost model and the adapters all ask it, and it
imports nothing of the simulator.
"""
from __future__ import annotations

import threading
from typing import Any

__all__ = ["current_rank_state"]

#: per OS thread: ``rs`` (the actor running on it) and, for the torch adapter, ``world``
_local = threading.local()


def current_rank_state() -> Any:
    """The calling rank thread's state (a :class:`simulator.core.state.RankState`), or ``None`` outside a world."""
    return getattr(_local, "rs", None)
