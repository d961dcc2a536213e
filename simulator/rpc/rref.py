"""RRefs on the simulator's transport.

**Ownership.**  RRef values live in their owner's table (:class:`Slot`) with
a reference count; RRefs cross workers only inside messages (the message
holds a reference while in flight); ``to_here`` copies.
"""
from __future__ import annotations

from typing import Any

from tensorplay.distributed.errors import DistRuntimeError
from tensorplay.distributed.rpc import transport as rpc_transport
from tensorplay.distributed.rpc.transport import unwrap, wrap_rref
from tensorplay.distributed.rpc.errors import WorkerUnavailableError, rpc_message
from tensorplay.distributed.rpc.rref import RRef
from tensorplay.distributed.rpc.worker import WorkerInfo

from simulator.rpc.codec import decode, encode, in_message, retain_for_message
from simulator.rpc.waits import Pending
from simulator.rpc.world import RpcWorld

__all__ = ["Slot", "Dropped", "SimRRef", "owner_value", "message_reference"]


class Slot:
    """An RRef value in its owner's table, with the number of references to it."""

    __slots__ = ("value", "count")

    def __init__(self, value: Any, count: int) -> None:
        self.value = value
        self.count = count


class Dropped:
    """An RRef value whose creating message was lost."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class SimRRef:
    """What a simulated worker's :class:`~tensorplay.distributed.rpc.rref.RRef` wraps: one reference to a
    value of ``owner``'s table, held by worker ``holder``."""

    __slots__ = ("world", "owner_info", "rid", "holder", "__weakref__")

    def __init__(self, world: RpcWorld, owner: WorkerInfo, rid: int, holder: str) -> None:
        self.world, self.owner_info, self.rid, self.holder = world, owner, rid, holder

    def __del__(self) -> None:
        try:
            self.world.release(self.owner_info.name, self.rid)
        except Exception:  # noqa: BLE001  interpreter shutdown
            pass

    def owner(self) -> WorkerInfo:
        return self.owner_info

    def here(self) -> str:
        return self.holder

    def is_owner(self) -> bool:
        return self.holder == self.owner_info.name

    def confirmed_by_owner(self) -> bool:
        return True

    def ident(self) -> str:
        return f"{self.owner_info.id}:{self.rid}"

    def _value(self, call: str, timeout: float | None = None) -> Any:
        me = rpc_transport.current()
        return owner_value(self.world, self.owner_info.name, self.rid, call, getattr(me, "name", None), timeout)

    def local_value(self) -> Any:
        return unwrap(self._value("RRef.local_value"))

    def to_here(self, timeout: float | None) -> Any:
        v = self._value("RRef.to_here", timeout)
        if self.is_owner():
            return unwrap(v)
        owner = self.world.agents[self.owner_info.name]
        # the value crosses from the owner to here, by value
        msg = owner._as_sender(lambda: encode(v, owner.name).seal(owner.auth))
        holder = self.world.agents.get(self.holder)
        return unwrap(decode(msg, holder.auth if holder is not None else owner.auth))

    def reduce(self) -> Any:
        return message_reference(self.world, self.owner_info, self.rid, self.holder, _rebuild_sim_rref)


def owner_value(world: RpcWorld, owner_name: str, rid: int, call: str, asker: str | None,
                timeout: float | None = None) -> Any:
    """The value of RRef ``rid`` in its owner's table, once its ``remote`` kept it (a lost one raises the error
    that lost it; a wait past ``timeout`` seconds, ``to_here``'s, raises RpcTimeoutError); ``asker`` names the
    worker asking, for the error of an owner that is gone."""
    owner = world.agents.get(owner_name)
    if owner is None or not owner.alive():
        raise WorkerUnavailableError(rpc_message(
            call, "the RRef's owner is unavailable (it shut down, returned or raised)", worker=asker,
            values={"owner": owner_name}, fix="keep the owner running (and in RPC) while others use its RRefs"))
    slot = owner.rrefs.get(rid)
    if slot is None:  # pragma: no cover  a live RRef always keeps its slot
        raise DistRuntimeError(rpc_message(call, "the RRef's value is gone from its owner",
                                           values={"owner": owner_name, "id": rid}))
    v = slot.value
    if type(v) is Pending:  # remote() of an @async_execution function that has not answered yet
        v = v.outcome.wait(timeout)
    if type(v) is Dropped:
        raise v.error
    return v


def message_reference(world: Any, owner: WorkerInfo, rid: int, holder: str, rebuild: Any) -> tuple:
    """How a simulated RRef pickles (``__reduce__``): only inside an RPC message, which holds one reference to the
    value while in flight (``world.retain``); the receiver gets ``rebuild(owner name, owner id, rid)``."""
    if not in_message():
        raise DistRuntimeError(rpc_message(
            "RRef.__reduce__", "an RRef can only be pickled inside an RPC message", worker=holder,
            values={"rref": f"{owner.id}:{rid}"},
            fix="pass the RRef as an argument or result of rpc_sync/rpc_async/remote instead of pickling it"))
    retain_for_message(world, owner.name, rid)
    return (rebuild, (owner.name, owner.id, rid))


def _rebuild_sim_rref(owner_name: str, owner_id: int, rid: int) -> RRef[Any]:
    me = rpc_transport.current()
    world = getattr(me, "world", None)  # a simulated worker's agent (SimAgent) belongs to an RPC world
    if not isinstance(world, RpcWorld):  # pragma: no cover
        raise DistRuntimeError(rpc_message(
            "RRef", "a simulated RRef arrived outside a simulated worker",
            values={"owner": owner_name, "rref_id": rid, "agent": type(me).__name__ if me else None},
            fix="pass simulated RRefs only between workers of the same simulator.run world"))
    return wrap_rref(SimRRef(world, WorkerInfo(owner_name, owner_id), rid, me.name))
