"""How simulated ranks are isolated from each other: ``"thread"`` (one interpreter) or ``"process"`` (one each).

``isolation="process"`` runs each rank's function in its own Python process,
started with its own ``PYTHONHASHSEED`` (:func:`hash_seed` of the run's seed
and the rank), so process-wide state — module globals, singletons, hash
order, ``os.environ``, signal handlers, ``sys.exit``/``os._exit`` — is per
rank as under torchrun.  The scheduler, matching, reports, faults, virtual
time and trace stay in the coordinator (one proxy rank thread per process, see
:mod:`.proxy`); the two sides speak the protocol of :mod:`.messages`, and
tensors move through shared memory (:mod:`.staging`).

Example::

    simulator.run(train, 4, isolation="process")
    python -m simulator --isolation process --nproc-per-node 4 train.py
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from simulator.core.hash_seeds import hash_seed

if TYPE_CHECKING:
    from simulator.isolation.proxy import ProcessRanks

__all__ = ["ISOLATIONS", "check_isolation", "hash_seed", "run_processes", "ProcessRanks"]


def __getattr__(name: str) -> Any:
    # The package itself imports no torch: ``python -m simulator`` starts the ranks' warm interpreters (.warm)
    # before it imports torch, and pytest's harness plugin before it imports a test file.
    if name == "ProcessRanks":
        from simulator.isolation.proxy import ProcessRanks  # (imports torch: see above)

        return ProcessRanks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: every isolation a simulated world offers (tests parametrise over this tuple)
ISOLATIONS: tuple[str, ...] = ("thread", "process")

#: after a process-isolated run in this process: the rank processes' ids (for tests that check none survive)
last_pids: list[int] = []
#: set in a rank process: a world started there would start rank processes of its own, without end
_in_rank_process = False


def mark_rank_process() -> None:
    """This process is a rank process (called by its boot, :func:`.child.main`): it refuses to start a world."""
    global _in_rank_process
    _in_rank_process = True


def check_isolation(isolation: Any, call: str = "simulator.run") -> str:
    """Return ``isolation`` if it names one of :data:`ISOLATIONS`, else raise a clear error."""
    if isolation not in ISOLATIONS:
        from tensorplay.distributed.errors import DistValueError, format_message

        raise DistValueError(format_message(
            call, "unknown isolation", values={"isolation": isolation, "available": list(ISOLATIONS)},
            fix="pass isolation='thread' (ranks are threads of this process) or isolation='process' (each rank "
                "its own process, with its own globals and PYTHONHASHSEED)"))
    return isolation


def run_processes(world: Any, fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any] | None,
                  rank_args: Sequence[Sequence[Any]] | None = None) -> list[Any]:
    """``world.run(fn, ...)`` with each rank in its own process (``world.isolation == "process"``).

    ``rank_args``: rank ``r`` calls ``fn(*rank_args[r], **kwargs)``, its arguments inherited as by a spawned child
    (the processes a launcher starts; see :mod:`simulator.launch`).
    """
    from tensorplay.distributed.errors import DistRuntimeError, format_message

    from simulator.isolation import cleanup, proxy  # (here: the package imports no torch, see __getattr__)

    global last_pids
    if _in_rank_process:
        raise DistRuntimeError(format_message(
            "simulator.run", "a process-isolated world was started inside a rank process (a rank process imports "
            "the calling script as __mp_main__, as multiprocessing's spawn does, so unguarded top-level code runs "
            "again there)", values={"isolation": "process"},
            fix="put the script's top-level code under `if __name__ == \"__main__\":`"))
    ranks = proxy.ProcessRanks(world, fn, args, dict(kwargs or {}), rank_args)
    last_pids = ranks.pids
    world.hash_seeds = list(ranks.hash_seeds)
    world.isolation = "thread"  # the coordinator's rank threads are the proxies
    own_hint = world.replay_hint is None
    if own_hint:  # a replay must run the ranks as processes again (their hash seeds are part of the failure)
        same = world.hash_seed == world.seed
        world.replay_hint = (f"simulator.run(fn, {world.world_size}, seed={world.seed}, mode={world.mode!r}, "
                             f"isolation='process'{'' if same else f', hash_seed={world.hash_seed}'})")
    try:
        return world.run(ranks.proxy_main)
    except BaseException as e:
        seeds = ", ".join(f"{r}={h}" for r, h in enumerate(ranks.hash_seeds))
        e.add_note(f"[simulator] isolation='process': each rank ran in its own process; PYTHONHASHSEED per rank: "
                   f"{seeds}")
        cleanup.drop_locals([e, *(getattr(world, "errors", None) or ())])  # (they would keep the arenas mapped)
        raise
    finally:
        world.isolation = "process"
        if own_hint:
            world.replay_hint = None
        ranks.close()
