"""What tensorplay's transport registry asks of the simulator's transport (registered as ``"sim"``).

The registry (:mod:`tensorplay.distributed.rpc.transport`) imports the package
:mod:`simulator.rpc` by name and reads these there: whether the calling thread
is a simulated rank (:func:`claims_caller`), its rank and world size, and
:func:`start`, which makes the worker's :class:`~simulator.rpc.agent.SimAgent`.
"""
from __future__ import annotations

from typing import Any, Callable

from tensorplay.distributed import state as dist_state
from tensorplay.distributed.errors import DistRuntimeError, DistValueError
from tensorplay.distributed.rpc import transport as rpc_transport
from tensorplay.distributed.rpc.errors import rpc_message

from simulator.core.state import current_rank_state, on_simulated_rank
from simulator.rpc.agent import SimAgent
from simulator.rpc.options import SimRpcBackendOptions, options_from
from simulator.rpc.world import RpcWorld, world_of

__all__ = ["WHERE", "USAGE", "claims_caller", "default_rank_and_size", "start"]

_FROM_ENVIRONMENT = object()  # start()'s default: the worker's secret is its environment's

#: how to get a worker onto this transport (the "Fix:" of init_rpc(backend="sim") outside the simulator)
WHERE = "inside a simulated rank"
USAGE = "run the function with simulator.run(fn, world_size) or `python -m simulator`"


def claims_caller() -> bool:
    """The calling thread is a simulated rank (or one of its threads): the simulator's transport serves it."""
    return on_simulated_rank()


def default_rank_and_size() -> tuple[int, int | None]:
    """The simulated rank's own rank and the run's world size."""
    st = dist_state.current()
    return (st.rank, st.world_size) if st is not None else (-1, None)


def start(name: str, rank: int, world_size: int, options: SimRpcBackendOptions | None, *,
          default_timeout: float | None = None, make: Callable[..., SimAgent] = SimAgent,
          secret: Any = _FROM_ENVIRONMENT) -> SimAgent:
    """Register this simulated rank as worker ``name`` and wait until the whole RPC world has.

    ``default_timeout`` is not used: ``SimRpcBackendOptions.rpc_timeout`` is the default here.  ``make`` builds
    the agent (as :class:`SimAgent` takes its arguments) and ``secret`` is the worker's (by default: read from its
    environment): a rank process's proxy passes both (see :mod:`simulator.isolation.rpc_routes`).
    """
    rs = current_rank_state()
    if rs is None:  # pragma: no cover  checked by init_rpc
        raise DistRuntimeError(rpc_message("init_rpc", "not inside a simulated rank"))
    if secret is _FROM_ENVIRONMENT:
        secret = rpc_transport.load_secret("init_rpc")  # a bad secret file fails here, as it would on TensorPipe
    rs = rs.parent or rs  # (a thread of the rank may start its worker: the worker is the rank's)
    options = options_from(options)
    if not options.rpc_timeout or options.rpc_timeout <= 0:
        raise DistValueError(rpc_message("init_rpc", "rpc_timeout must be a positive number of seconds",
                                         values={"rpc_timeout": options.rpc_timeout}, fix="pass e.g. 60"))
    world = world_of(rs, world_size)
    agent = make(world, name, rank, rs, dist_state.current(), options, secret)
    with world.lock:
        clash = world.agents.get(name)
        if clash is not None or rank in world.by_rank:
            other = clash.rank if clash is not None else world.by_rank[rank].name
            raise DistValueError(rpc_message(
                "init_rpc", "worker name or rank already taken", values={"name": name, "rank": rank, "taken_by": other},
                fix="give every worker a distinct name and rank"))
        world.agents[name] = agent
        world.by_rank[rank] = agent
    world.wait(world.init_barrier, rank)
    _check_one_secret(world, agent)
    return agent


def _check_one_secret(world: RpcWorld, agent: SimAgent) -> None:
    """As on TensorPipe, members that do not share one secret (their environments name different ones, or
    only some name one) cannot start: every one of them fails init_rpc, saying so."""
    groups: list[tuple[SimAgent, list[int]]] = []
    for a in sorted(world.by_rank.values(), key=lambda a: a.rank):
        for first, ranks in groups:
            if first.auth.same_key(a.auth):
                ranks.append(a.rank)
                break
        else:
            groups.append((a, [a.rank]))
    if len(groups) > 1:
        raise DistRuntimeError(rpc_message(
            "init_rpc", "the workers do not share one RPC secret", worker=agent.name,
            values={"ranks_by_secret": [ranks for _, ranks in groups]},
            fix=f"set the same {rpc_transport.ENV_SECRET} (or {rpc_transport.ENV_SECRET_FILE}) on every worker, or on none of them"))
