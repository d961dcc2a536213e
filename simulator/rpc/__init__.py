"""The simulator's RPC transport: workers are simulated ranks (threads of one process).

Used automatically when ``init_rpc`` runs inside ``simulator.run`` or
``python -m simulator`` (tensorplay's transport registry imports this package
by name, as ``"sim"``).  What it keeps from a real transport, and where:

* **by value, authenticated** - every request and answer is serialised and
  sealed by its sender, checked by its receiver (:mod:`simulator.rpc.codec`);
* **the callee's identity; failures** - a handler runs on a thread of the callee's
  rank, as the callee; calls to a dead rank fail at once (:mod:`simulator.rpc.agent`);
* **bounded, cooperative waits** - waiting for an answer (:mod:`simulator.rpc.waits`),
  for the other workers in ``init_rpc`` and ``shutdown`` (:mod:`simulator.rpc.world`);
* **ownership** - RRef values live in their owner's table (:mod:`simulator.rpc.rref`);
* **faults by seed** - :class:`MessageFaults` (:mod:`simulator.rpc.options`);
* **virtual time** - every call is an event on the run's trace (:mod:`simulator.rpc.record`);
* **distributed autograd** - :mod:`simulator.rpc.autograd`.

What the registry reads here (:data:`WHERE`, :data:`USAGE`, :func:`claims_caller`,
:func:`default_rank_and_size`, :func:`start`) is :mod:`simulator.rpc.transport`.

Limits: in ``coop`` mode a rank that waits through a ``threading`` primitive
(an ``Event`` a handler sets) while none of its threads runs keeps the baton;
run such code in ``mode="threads"``.  Collectives inside RPC handlers are not
supported.
"""
from __future__ import annotations

from simulator.rpc.agent import SimAgent
from simulator.rpc.options import MessageFaults, SimRpcBackendOptions, options_from
from simulator.rpc.transport import USAGE, WHERE, claims_caller, default_rank_and_size, start

__all__ = ["SimRpcBackendOptions", "MessageFaults", "SimAgent", "start", "options_from", "claims_caller",
           "default_rank_and_size", "USAGE", "WHERE"]
