"""Former private name of :mod:`tensorplay.distributed.state`; kept so existing imports keep working.

Every name is the public module's own object (the same functions, the same thread-local), so state set
through either name is seen through both.  New code imports :mod:`tensorplay.distributed.state`.
"""
from __future__ import annotations

from .state import (  # noqa: F401  (re-exported)
    DistState,
    _thread,
    backward_of,
    bind_thread,
    current,
    current_backward,
    set_process_state,
    unbind_thread,
)

__all__ = ["DistState", "current", "set_process_state", "bind_thread", "unbind_thread", "backward_of",
           "current_backward"]
