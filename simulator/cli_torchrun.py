"""torchrun's own options on ``python -m simulator``: a torchrun command line runs as it is.

Users arrive with the command they already type, copied from a README or a job script::

    torchrun --standalone --nnodes=1 --nproc-per-node=4 train.py
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=$HOST:29400 -m trainer.main

``python -m simulator`` followed by the same options runs it.  What each option means here:

* ``--nnodes N`` (or ``MIN:MAX``, then MAX: the job with all its nodes): every node of the job runs in this
  one simulation, ``N x --nproc-per-node`` ranks, each with the ``LOCAL_RANK``, ``GROUP_RANK`` and
  ``LOCAL_WORLD_SIZE`` its node gives it (``--node-rank`` is therefore not needed, and ignored).
* ``--nproc-per-node`` also takes torchrun's words: ``cpu`` (this machine's cores), ``gpu`` (the node's GPUs:
  ``--gpus-per-node`` with ``--devices cuda``) and ``auto`` (``gpu`` under ``--devices cuda``, else ``cpu``).
* ``--max-restarts N``: a failed run is started again, as torchrun restarts its worker group, at most N times;
  each attempt's ranks read ``TORCHELASTIC_RESTART_COUNT``.
* ``--master-addr``, ``--master-port``, ``--rdzv-id`` and ``--role`` set ``MASTER_ADDR``, ``MASTER_PORT``,
  ``TORCHELASTIC_RUN_ID`` and ``ROLE_NAME`` as torchrun does; the rendezvous itself is the simulator's, so
  ``--standalone``, ``--rdzv-backend``, ``--rdzv-endpoint``, ``--rdzv-conf`` and ``--local-addr`` change nothing.
* ``--redirects``, ``--tee``, ``--local-ranks-filter`` and ``--log-dir`` send each rank's output where torchrun
  sends its worker's, and each rank's ``TORCHELASTIC_ERROR_FILE`` names its error file there, as the agent's do
  (:mod:`simulator.cli_output`); the agent's other options (``--start-method``,
  ``--monitor-interval``...) change nothing, and ``--duplicate-stdout-filters``, ``--duplicate-stderr-filters``
  and ``--logs-specs`` are not applied (the run says so).
* ``--no-python`` (an executable, not a Python program) and ``--virtual-local-rank`` are refused, with why.

Without ``--nproc-per-node``, a torchrun-only option (``--standalone``, ``--nnodes``...) makes the run
torchrun-style with one rank per node, torchrun's default; with none, the script is a launcher (see
:mod:`simulator.cli`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from simulator import cli_output
from simulator.cli_output import RankOutput

__all__ = ["add_arguments", "env_default", "nproc_type", "torchrun_style", "TorchrunPlan", "plan", "UsageError"]


class UsageError(Exception):
    """A torchrun option the simulator cannot honour, or a bad value: the CLI's exit code 2."""


#: options that change nothing in a simulated run (dest names)
_INERT = ("standalone", "rdzv_backend", "rdzv_endpoint", "rdzv_conf", "local_addr", "node_rank", "monitor_interval",
          "start_method", "event_log_handler", "numa_binding", "signals_to_handle", "shutdown_timeout", "run_path")
#: options about where ranks' output goes (dest names): the first four are applied (simulator.cli_output)
_OUTPUT = ("log_dir", "redirects", "tee", "local_ranks_filter", "duplicate_stdout_filters",
           "duplicate_stderr_filters", "logs_specs")
#: options that are torchrun's alone: given without --nproc-per-node, the run is torchrun-style
_TORCHRUN_ONLY = ("nnodes", "max_restarts", "master_addr", "master_port", "rdzv_id", "role", "no_python",
                  "virtual_local_rank", *_INERT, *_OUTPUT)


def env_default(option: str, default: Any, flag: bool = False) -> Any:
    """An option's default as torchrun reads it: ``PET_<NAME>`` from the environment when set (``PET_NPROC_PER_NODE``
    for ``--nproc-per-node``; a flag's is 0 or 1), else ``default``.  Job templates set these instead of options."""
    value = os.environ.get("PET_" + option.lstrip("-").replace("-", "_").upper())
    if value is None:
        return default
    if flag:
        try:
            return bool(int(value))
        except ValueError:
            return default
    return value  # (argparse applies the option's type to a default given as a string)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """torchrun's options, in a group of their own in ``--help``."""
    g = p.add_argument_group("torchrun's options (a torchrun command line runs with torchrun replaced; its other "
                             "options, --rdzv-backend, --rdzv-endpoint, --start-method..., are accepted and change "
                             "nothing here)")

    def opt(*names: str, **kw: Any) -> None:
        spellings = [*names]
        for n in names:  # torchrun spells each two ways: --max-restarts and --max_restarts
            if n.startswith("--") and "-" in n[2:]:
                spellings.append("--" + n[2:].replace("-", "_"))
        kw["default"] = env_default(names[-1], kw.get("default"), flag=kw.get("action") == "store_true")
        g.add_argument(*spellings, **kw)

    opt("--nnodes", default=None, metavar="N|MIN:MAX",
        help="nodes of the job, all simulated here: N x --nproc-per-node ranks (MIN:MAX: MAX)")
    opt("--node-rank", type=int, default=None, help="ignored: every node runs here")
    opt("--max-restarts", type=int, default=0, metavar="N",
        help="start a failed run again, at most N times, as torchrun restarts its workers (default 0)")
    opt("--master-addr", default=None, help="MASTER_ADDR the ranks read (default 127.0.0.1)")
    opt("--master-port", type=int, default=None, help="MASTER_PORT the ranks read (default 29500)")
    opt("--rdzv-id", default=None, help="TORCHELASTIC_RUN_ID the ranks read")
    opt("--role", default=None, help="ROLE_NAME the ranks read (default 'default')")
    opt("--standalone", action="store_true", help="accepted (the rendezvous is the simulator's)")
    for name in ("--rdzv-backend", "--rdzv-endpoint", "--rdzv-conf", "--local-addr", "--start-method",
                 "--monitor-interval", "--event-log-handler", "--numa-binding", "--signals-to-handle",
                 "--shutdown-timeout", "--logs-specs"):
        opt(name, default=None, help=argparse.SUPPRESS)
    opt("--run-path", action="store_true", help=argparse.SUPPRESS)
    opt("--log-dir", default=None, help="where --redirects and --tee write the ranks' logs (default: a temporary folder)")
    g.add_argument("-r", "--redirects", default=env_default("--redirects", None), metavar="MASK",
                   help="send ranks' stdout (1), stderr (2) or both (3) to log files; per local rank: 0:1,1:2")
    g.add_argument("-t", "--tee", default=env_default("--tee", None), metavar="MASK",
                   help="as --redirects, and copy each line to the console behind [<role><local rank>]:")
    opt("--local-ranks-filter", default=None, metavar="RANKS",
        help="show only these local ranks' output on the console, e.g. 0 or 0,1")
    opt("--duplicate-stdout-filters", default=None, help=argparse.SUPPRESS)
    opt("--duplicate-stderr-filters", default=None, help=argparse.SUPPRESS)
    opt("--no-python", action="store_true", help=argparse.SUPPRESS)
    opt("--virtual-local-rank", action="store_true", help=argparse.SUPPRESS)


_WORDS = ("cpu", "gpu", "auto")


def nproc_type(text: str) -> int | str:
    """argparse type of ``--nproc-per-node``: a whole number, or one of torchrun's words (resolved by :func:`plan`)."""
    word = text.strip().lower()
    if word in _WORDS:
        return word
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of ranks or one of torchrun's words cpu, gpu, auto; got "
                                         f"{text!r} (e.g. --nproc-per-node 4)") from None


def _given(ns: argparse.Namespace, dest: str) -> bool:
    value = getattr(ns, dest, None)  # (0 is a value: --node-rank 0; False is an absent flag)
    return value is not None and value is not False and not (dest == "max_restarts" and value == 0)


def torchrun_style(ns: argparse.Namespace) -> bool:
    """Whether the command is torchrun-style: ``--nproc-per-node`` given, or an option only torchrun has."""
    return ns.nproc is not None or any(_given(ns, d) for d in _TORCHRUN_ONLY)


@dataclasses.dataclass
class TorchrunPlan:
    """What torchrun's options make of a run."""

    nproc: int  # ranks per node
    nodes: int
    restarts: int
    env: dict[str, str]  # set on every rank, over the simulator's torchrun environment
    notes: list[str]
    output: RankOutput  # where the ranks' stdout, stderr and error files go

    @property
    def world_size(self) -> int:
        return self.nproc * self.nodes


def _nodes(text: str | None) -> int:
    if text is None:
        return 1
    parts = text.split(":")
    try:
        counts = [int(x) for x in parts]
    except ValueError:
        counts = []
    if len(counts) not in (1, 2) or min(counts) < 1 or counts[0] > counts[-1]:
        raise UsageError(f"--nnodes must be a number of nodes N or a range MIN:MAX (1 <= MIN <= MAX), got "
                         f"{text!r} (e.g. --nnodes 2)")
    return counts[-1]


def _nproc(ns: argparse.Namespace) -> int:
    """``--nproc-per-node``: a count, or torchrun's ``cpu``, ``gpu`` and ``auto`` (1 when not given, as torchrun)."""
    value = ns.nproc
    if value is None:
        return 1
    if isinstance(value, int):
        return value
    if value == "cpu" or (value == "auto" and ns.devices != "cuda"):
        return os.cpu_count() or 1
    if ns.devices != "cuda":  # gpu
        raise UsageError(f"--nproc-per-node {value} counts the node's GPUs, and these ranks have none; fix: add "
                         f"--devices cuda --gpus-per-node N (stand-in GPUs), or give a number of ranks")
    if ns.gpus_per_node is None:
        raise UsageError(f"--nproc-per-node {value} counts the node's GPUs: say how many the simulated node has "
                         f"with --gpus-per-node N")
    return int(ns.gpus_per_node)


def plan(ns: argparse.Namespace) -> TorchrunPlan:
    """Resolve torchrun's options of a torchrun-style command (see the module); UsageError for what cannot run."""
    if ns.no_python:
        raise UsageError("--no-python runs an executable, and the simulator's ranks run Python programs; fix: drop "
                         "--no-python and name the Python script (or -m module) the executable would run")
    if ns.virtual_local_rank:
        raise UsageError("--virtual-local-rank (LOCAL_RANK 0 on every rank, each seeing one GPU) is not simulated; "
                         "fix: drop it, and index devices by LOCAL_RANK")
    nproc, nodes = _nproc(ns), _nodes(ns.nnodes)
    if nproc < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, got {nproc}")
    if ns.max_restarts < 0:
        raise UsageError(f"--max-restarts must be 0 or more, got {ns.max_restarts}")
    if nodes > 1 and ns.gpus_per_node is not None and ns.gpus_per_node != nproc:
        raise UsageError(f"--nnodes {nodes} with --gpus-per-node {ns.gpus_per_node} and --nproc-per-node {nproc}: "
                         f"a simulated job of several nodes runs one rank per GPU; fix: drop --gpus-per-node (each "
                         f"node then has --nproc-per-node GPUs)")
    env = {"TORCHELASTIC_MAX_RESTARTS": str(ns.max_restarts)}
    if ns.standalone or (ns.rdzv_backend == "c10d" and ns.rdzv_endpoint):
        # a c10d rendezvous gives the workers its host as MASTER_ADDR (--standalone's is localhost)
        env["MASTER_ADDR"] = "localhost" if ns.standalone else ns.rdzv_endpoint.rsplit(":", 1)[0] or "localhost"
    for dest, name in (("master_addr", "MASTER_ADDR"), ("master_port", "MASTER_PORT"), ("rdzv_id", "TORCHELASTIC_RUN_ID"),
                       ("role", "ROLE_NAME")):
        if getattr(ns, dest) is not None:
            env[name] = str(getattr(ns, dest))
    notes = []
    ignored = [f"--{d.replace('_', '-')}" for d in _OUTPUT[4:] if _given(ns, d)]
    if ignored:
        notes.append(f"{', '.join(ignored)}: not applied on simulated ranks")
    try:
        output = cli_output.parse(ns.redirects, ns.tee, ns.local_ranks_filter, ns.log_dir, ns.role or "default",
                                  ns.rdzv_id or "simulator", nproc, nodes)  # (TORCHELASTIC_RUN_ID's value)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None
    if any(output.redirects.values()) or any(output.tee.values()):
        notes.append(f"the ranks' redirected output goes under {output.folder} (torchrun's --log-dir layout)")
    if nodes > 1:
        notes.append(f"--nnodes {ns.nnodes}: the {nodes} nodes of the job run here, {nodes * nproc} ranks in all "
                     f"(LOCAL_RANK 0..{nproc - 1} on each node)")
    elif ns.gpus_per_node is not None and 0 < ns.gpus_per_node < nproc:
        # torchrun would start all of them on one node; a node of fewer GPUs than processes is a job of several nodes
        per, n = ns.gpus_per_node, -(-nproc // ns.gpus_per_node)
        last = f", the last node holding {nproc - (n - 1) * per} rank(s)" if nproc % per else ""
        notes.append(f"--gpus-per-node {per} with --nproc-per-node {nproc}: the ranks run as {n} nodes of {per} GPUs "
                     f"(LOCAL_RANK = rank % {per}{last}), not as one node; to simulate one node, give --gpus-per-node "
                     f"{nproc} (or leave it out)")
    return TorchrunPlan(nproc=nproc, nodes=nodes, restarts=ns.max_restarts, env=env, notes=notes, output=output)
