"""torchrun called from Python: ``elastic_launch(config, entrypoint)(*args)`` on simulated ranks.

A launcher may start its ranks through torch's elastic agent instead of ``spawn``: ``elastic_launch`` (what
notebook launchers and job runners call), or ``torch.distributed.run.run(args)`` (torchrun's ``main`` run from
Python).  Both end in ``torch.distributed.launcher.api.launch_agent``, which the launcher's patches replace with
:func:`launch_agent` here.  A real agent rendezvouses, starts ``nproc_per_node`` processes that each run the
entrypoint under torch's ``@record`` with torchrun's environment, polls them, hands their return values back
through queues and restarts the group up to ``max_restarts`` times.  Here every node's ranks
(``max_nodes x nproc_per_node``) are started as processes of the launcher (:mod:`simulator.launch`), so they form
one simulated world in either isolation; each rank reads the environment torch's agent gives its worker
(``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``...), its output
goes where the config's log specs send it (:mod:`simulator.cli_output`), and its return value comes back through a
file.  What the launcher gets is what ``launch_agent`` returns: node 0's return values by global rank, or torch's
``ChildFailedError`` naming the first rank that failed (with the error file ``@record`` wrote).

An entrypoint that is a command runs when it is this Python (``sys.executable``, as ``torch.distributed.run``
passes it) running a script or ``-m module``; any other executable is refused, naming the fix.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, record
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs

from simulator import cli_output
from simulator.adapters.per_rank_main import Program
from simulator.launch_processes import _first_failed, _sim_popen

__all__ = ["launch_agent"]


def _program(entrypoint: str, args: list[Any]) -> tuple[Program, list[str]]:
    """The Python program a command entrypoint runs, and its arguments (``python -u script.py a b``)."""
    if entrypoint != sys.executable and not os.path.basename(entrypoint).startswith("python"):
        raise ValueError(
            f"torch.distributed.launcher.api.launch_agent: entrypoint={entrypoint!r} is an executable, and simulated "
            f"ranks run Python programs; fix: pass the Python function, or sys.executable with the script's path "
            f"(as torch.distributed.run does), or run the script itself with python -m simulator --nproc-per-node N")
    words = [str(a) for a in args]
    while words and words[0].startswith("-") and words[0] != "-m":
        words.pop(0)  # the interpreter's own flags (-u, as torch.distributed.run passes)
    if not words or (words[0] == "-m" and len(words) < 2):
        raise ValueError(f"torch.distributed.launcher.api.launch_agent: args={args!r} name no script for "
                         f"{entrypoint!r}; fix: pass the script's path (or -m module) first")
    if words[0] == "-m":
        return Program(words[1], module=True), words[2:]
    return Program(words[0]), words[1:]


@dataclasses.dataclass(frozen=True)
class _Job:
    """One ``launch_agent`` call: what every rank runs and reads (picklable, for rank processes)."""

    entrypoint: Any  # the function, or None for a program
    args: tuple
    program: Program | None
    argv: list[str]
    nproc: int
    nodes: int
    env: dict[str, str]  # the variables that are the same on every rank
    output: cli_output.RankOutput
    results: str  # the folder of the ranks' return values
    thread_ranks: bool

    def rank_env(self, rank: int, attempt: int) -> dict[str, str]:
        """The variables torch's agent sets for worker ``rank`` (LocalElasticAgent._start_workers)."""
        world = self.nproc * self.nodes
        return {**self.env, "RANK": str(rank), "LOCAL_RANK": str(rank % self.nproc),
                "GROUP_RANK": str(rank // self.nproc), "ROLE_RANK": str(rank), "LOCAL_WORLD_SIZE": str(self.nproc),
                "WORLD_SIZE": str(world), "GROUP_WORLD_SIZE": str(self.nodes), "ROLE_WORLD_SIZE": str(world),
                "TORCHELASTIC_RESTART_COUNT": str(attempt)}


def _rank(rank: int, job: _Job, attempt: int) -> None:
    """A worker of the agent, as torch's ``_wrap`` runs it: its environment, its output, ``@record``."""
    os.environ.update(job.rank_env(rank, attempt))  # (a thread rank's own environment; a rank process's)
    restore = job.output.install(attempt)
    failure = None
    try:
        if job.program is None:
            value = record(job.entrypoint)(*job.args)
        else:
            from simulator.isolation.child import ScriptMain  # (in-function: child imports the launcher's modules)

            ScriptMain(job.program, job.argv, thread_rank=job.thread_ranks)()
            value = None
    except BaseException as e:
        failure = e
        raise
    finally:
        restore(failure)
    with open(os.path.join(job.results, f"{rank}.pkl"), "wb") as f:
        pickle.dump(value, f)  # (a copy, as the agent's queue gives it)


def launch_agent(launcher: Any, config: Any, entrypoint: Callable[..., Any] | str | None, args: list[Any],
                 health_check_server: Any = None) -> dict[int, Any]:
    """Stands in for ``torch.distributed.launcher.api.launch_agent`` while ``launcher`` (simulator.launch's) runs
    (see the module)."""
    if entrypoint is None or not (callable(entrypoint) or isinstance(entrypoint, str)):
        raise ValueError(f"torch.distributed.launcher.api.launch_agent: entrypoint={entrypoint!r}; fix: pass a "
                         f"function, or sys.executable and a script's path")
    program, argv = _program(entrypoint, args) if isinstance(entrypoint, str) else (None, [])
    name = entrypoint.__name__ if program is None else program.typed  # type: ignore[union-attr]
    nproc, nodes = int(config.nproc_per_node), int(config.max_nodes)
    specs = config.logs_specs if isinstance(config.logs_specs, DefaultLogsSpecs) else DefaultLogsSpecs()
    run_id = config.run_id or "simulator"
    output = cli_output.parse(
        _mask_text(specs._redirects), _mask_text(specs._tee),
        ",".join(map(str, sorted(specs._local_ranks_filter))) if specs._local_ranks_filter else None,
        None if specs.root_log_dir == os.devnull else specs.root_log_dir, config.role, run_id, nproc, nodes)
    addr, port = "127.0.0.1", "29500"
    if config.rdzv_backend == "static" and ":" in (config.rdzv_endpoint or ""):
        addr, port = config.rdzv_endpoint.rsplit(":", 1)
    env = {"ROLE_NAME": config.role, "MASTER_ADDR": addr, "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": run_id,
           "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts),
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
    results = tempfile.mkdtemp(prefix="tensorplay-elastic-")
    thread_ranks = launcher.isolation == "thread"
    job = _Job(entrypoint if program is None else None, tuple(args), program, argv, nproc, nodes, env, output,
               results, thread_ranks)
    ctx = multiprocessing.get_context(config.start_method)
    old_argv = sys.argv
    if program is not None and thread_ranks:  # (thread ranks share sys.argv and sys.path: set once for all)
        sys.argv = [program.typed, *argv]
        sys.path.insert(0, program.folder)
    try:
        for attempt in range(config.max_restarts + 1):
            if attempt:
                print(f"simulator: the worker group failed; starting it again, as torch's elastic agent restarts "
                      f"it (restart {attempt} of max_restarts={config.max_restarts})", file=sys.stderr, flush=True)
            procs = [ctx.Process(target=_rank, args=(r, job, attempt), daemon=False)
                     for r in range(nproc * nodes)]
            for p in procs:
                p._sim_rank_process = True  # type: ignore[attr-defined]  # (the agent's workers are ranks)
                p._sim_own_program = program is not None  # type: ignore[attr-defined]
                p.start()
            reported = len(launcher.failures)
            for p in procs:
                p.join()
            failed = [p for p in procs if p.exitcode != 0]
            if failed and attempt < config.max_restarts:
                del launcher.failures[reported:]  # (a failure the agent restarts from is not the run's)
                continue
            if not failed:
                values = {}
                for r in range(nproc):  # (what this node's agent returns: its own workers' values)
                    with open(os.path.join(results, f"{r}.pkl"), "rb") as f:
                        values[r] = pickle.load(f)
                return values
            first = _first_failed(failed)
            rank = procs.index(first)
            popen = _sim_popen(first)
            where = output.worker_folder(attempt, rank // nproc, rank % nproc)
            raise ChildFailedError(name=name, failures={rank: ProcessFailure(
                local_rank=rank % nproc, pid=int(first.pid or 0),
                exitcode=popen.returncode if popen is not None and popen.returncode else 1,
                error_file=os.path.join(where, "error.json"))})
    finally:
        sys.argv = old_argv
        if program is not None and thread_ranks and sys.path and sys.path[0] == program.folder:
            del sys.path[0]
        shutil.rmtree(results, ignore_errors=True)
    raise AssertionError("unreachable")  # pragma: no cover


def _mask_text(value: Any) -> str:
    """A Std or {local rank: Std} as torchrun's option text (``3``, ``0:1,1:2``)."""
    if isinstance(value, dict):
        return ",".join(f"{k}:{int(v)}" for k, v in sorted(value.items()))
    return str(int(value))
