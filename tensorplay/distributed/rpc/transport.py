"""The public surface for RPC transport authors: everything a transport needs from tensorplay, in one module.

A *transport* carries ``rpc_sync``/``rpc_async``/``remote`` between workers.
tensorplay ships TensorPipe (:mod:`tensorplay.distributed.rpc.tensorpipe`);
another package (the simulator) adds its own without touching tensorplay:

1. **Register** a module under the backend name it serves:
   ``register_transport("mine", "mypkg.transport")``.  The module implements
   :class:`Transport` (``claims_caller``, ``default_rank_and_size``, ``start``,
   ``WHERE``, ``USAGE``) and is imported the first time a world uses it.
2. **Implement an agent**: subclass :class:`Agent` (one worker's end:
   ``worker_infos``, ``call_sync``, ``call_async``, ``remote``, ``local_rref``,
   ``shutdown``, ``distributed_autograd`` returning a :class:`DistributedAutograd`).
   ``start`` returns it; the API then calls :func:`install`.  A transport whose
   workers are threads sets ``Agent.per_thread`` and hands the agent to the
   threads serving it with :func:`bind_thread` (which returns the previous one,
   to restore); :func:`current`/:func:`require` find the calling worker's agent.
3. **Run calls the way every transport does**: the callee runs
   :func:`run_call` (an exception becomes a :class:`RemoteFailure`, rebuilt on
   the caller by :func:`unwrap`); ``@async_execution`` functions are recognised
   by :func:`is_async` and their futures checked by :func:`async_outcome` /
   :func:`future_outcome`; a function that pickle cannot send goes through
   :func:`dill_pickler` / :func:`callable_for_wire`.
4. **Hand out references**: :func:`wrap_rref` turns the transport's own
   reference object into the user's :class:`~tensorplay.distributed.rpc.RRef`.
5. **Authenticate**: read the members' shared secret with :func:`load_secret`
   (``ENV_SECRET`` / ``ENV_SECRET_FILE``; launchers make one with
   :func:`generate_secret`) and seal/open every message with an
   :class:`Authenticator` (``HEADER_LEN`` bytes per message); a refused message
   raises :class:`AuthenticationError`.

Every name here is the very object of the module that defines it (the
private ``_agent``, ``_call`` and ``_auth`` modules, which keep working), so
state bound through one name is seen through the other.
"""
from __future__ import annotations

from typing import Any

from ._agent import (
    DEFAULT_TRANSPORT,
    Agent,
    DistributedAutograd,
    Transport,
    bind_thread,
    check_call,
    check_timeout,
    current,
    install,
    invoke,
    register_transport,
    require,
    set_process_agent,
    transport_for,
    transport_names,
    unbind_thread,
    uninstall,
)
from ._auth import (
    ENV_MAX_AGE,
    ENV_SECRET,
    ENV_SECRET_FILE,
    HEADER_LEN,
    AuthenticationError,
    Authenticator,
    generate_secret,
    load_secret,
)
from ._call import (
    ASYNC_ATTR,
    PickledFunction,
    RemoteFailure,
    async_outcome,
    callable_for_wire,
    dill_pickler,
    future_outcome,
    is_async,
    run_call,
    run_call_async,
    unwrap,
)
from .rref import RRef

__all__ = [
    # registry and agents
    "Agent", "Transport", "DistributedAutograd", "DEFAULT_TRANSPORT", "register_transport", "transport_names",
    "transport_for", "current", "require", "bind_thread", "unbind_thread", "set_process_agent", "install",
    "uninstall", "invoke", "check_call", "check_timeout",
    # running calls
    "RemoteFailure", "PickledFunction", "run_call", "run_call_async", "unwrap", "is_async", "async_outcome",
    "future_outcome", "dill_pickler", "callable_for_wire", "ASYNC_ATTR",
    # references
    "wrap_rref",
    # authentication
    "ENV_SECRET", "ENV_SECRET_FILE", "ENV_MAX_AGE", "HEADER_LEN", "Authenticator", "AuthenticationError",
    "generate_secret", "load_secret",
]


def wrap_rref(impl: Any) -> RRef[Any]:
    """The user's :class:`RRef` around a transport's reference object ``impl``.

    ``impl`` answers what an RRef is asked and the RRef forwards to it:
    ``owner()``, ``is_owner()``, ``confirmed_by_owner()``, ``to_here(timeout)``,
    ``local_value()``, ``here()`` (this worker's name), ``ident()`` and
    ``reduce()`` (how the RRef pickles when sent to another worker).  The calling worker's agent may name
    an :class:`RRef` subclass to use (``agent.rref_type``: the simulator's torch API gives torch's errors).
    """
    return getattr(current(), "rref_type", RRef)._wrap(impl)
