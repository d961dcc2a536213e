"""The public surface for backend authors: everything a backend needs from tensorplay, in one module.

A backend runs the collectives of :mod:`tensorplay.distributed` for one rank.
tensorplay ships gloo and nccl (:mod:`tensorplay.distributed.backends.c10d`);
another package (the simulator) adds its own without touching tensorplay:

1. **Implement** :class:`Backend` (one object per rank; the API hands it only
   validated calls in *group* ranks, see :mod:`tensorplay.distributed.backends.base`)
   and return :class:`Work` objects for ``async_op=True`` (:class:`CompletedWork`
   for a result produced at once, :class:`ChainedWork` for a finishing step
   after an inner wait, :func:`completed_future` for ``Work.get_future()``).
2. **Register** it: ``register_backend("mine", MyBackend)``; then
   ``init_process_group("mine")`` creates it with ``MyBackend.create(...)``.
3. **Or start worlds yourself** (a harness that runs ranks as threads or
   processes): build the rank's backend and call :func:`install_backend` on the
   rank (``thread_local=True`` for a thread); :mod:`state` holds the rank's
   world (``state.current()``, ``state.bind_thread()`` for the rank's helper
   threads, ``state.current_backward()`` to explain a stuck autograd backward).
4. **Reduce like the others**: :class:`ReduceOp` and :func:`dtype_rule` say
   which op reduces which dtype; :func:`reduce_stacked` reduces contributions
   in group-rank order (bit-for-bit reproducible) where the backend emulates an op.
5. **Check and report like the API**: :mod:`validation` holds every argument
   check (a call of the backend's own is checked the same way, with the same
   error classes); :func:`backend_name_refusal` answers what torch's
   ``init_process_group`` raises for a backend name; :func:`format_message`
   builds every message (call, group, rank, ``name=value``, fix) and
   :class:`DistBackendError` reports a failure of the backend itself.
6. **Know the calls**: :data:`BACKEND_COLLECTIVES` lists every call a backend
   runs, with its arguments; :class:`CallKey` is what the members of a group
   must agree on for one call.

An RPC transport (``rpc_sync``/``remote`` for the backend's worlds) has its own
surface: :mod:`tensorplay.distributed.rpc.transport`.

Every name here is the very object of the module that defines it.
"""
from __future__ import annotations

from .. import state, validation
from .._kernels import reduce_stacked
from ..errors import DistBackendError, DistError, DistRuntimeError, DistTimeoutError, format_message
from ..group import ProcessGroup
from ..reduce_op import ReduceOp, dtype_rule, normalize_op, op_allows_dtype
from ..spec import BACKEND_COLLECTIVES, CallKey
from ..state import DistState, install_backend, uninstall
from ..validation import backend_name_refusal
from . import get_backend_class, register_backend, registered
from .base import Backend, ChainedWork, CompletedWork, Work, completed_future

__all__ = [
    # the interface and its works
    "Backend", "Work", "CompletedWork", "ChainedWork", "completed_future",
    # the registry
    "register_backend", "get_backend_class", "registered",
    # a rank's world
    "state", "DistState", "install_backend", "uninstall", "ProcessGroup",
    # reductions
    "ReduceOp", "normalize_op", "dtype_rule", "op_allows_dtype", "reduce_stacked",
    # checks and errors
    "validation", "backend_name_refusal", "format_message", "DistError", "DistBackendError", "DistRuntimeError",
    "DistTimeoutError",
    # the calls
    "BACKEND_COLLECTIVES", "CallKey",
]
