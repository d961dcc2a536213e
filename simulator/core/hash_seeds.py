"""The ``PYTHONHASHSEED`` values a run's seed gives, and ``python -m simulator``'s own (light: no torch).

A string's hash, and with it the iteration order of a ``set`` or ``dict`` of strings, is fixed by the
interpreter's hash seed when it starts.  Each rank process gets :func:`hash_seed` of the run's seed and its rank.
Thread ranks share one interpreter: under ``python -m simulator`` that interpreter starts again with rank 0's
value (:func:`reexec_with_seeded_hash`) unless ``PYTHONHASHSEED`` is set already, so a program that iterates a
set of strings (issuing collectives in that order, say) runs the same way for the same ``--seed``.  With
``--isolation process`` it starts the rank processes' warm interpreters
(:func:`simulator.isolation.warm.prestart_for_command_line`) before it imports torch.
"""
from __future__ import annotations

import hashlib
import os
import sys
from typing import Mapping, Sequence

__all__ = ["hash_seed", "reexec_with_seeded_hash", "rank_envs", "torchrun_defaults",
           "CLI_VALUE_OPTIONS"]


def hash_seed(run_seed: int, rank: int) -> int:
    """The ``PYTHONHASHSEED`` of rank ``rank``'s process: distinct per rank, a pure function of the run's seed (1..2**32-1)."""
    digest = hashlib.blake2b(f"tensorplay-simulator-hash:{run_seed}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 4294967295 + 1  # 0 would switch hash randomisation off


#: the options of ``python -m simulator`` that take a value (tests/test_sim_launch.py checks this against its parser)
_TORCHRUN_VALUE_OPTIONS = ("nnodes", "node-rank", "max-restarts", "master-addr", "master-port", "rdzv-id", "role",
                           "rdzv-backend", "rdzv-endpoint", "rdzv-conf", "local-addr", "start-method",
                           "monitor-interval", "event-log-handler", "numa-binding", "signals-to-handle",
                           "shutdown-timeout", "logs-specs", "log-dir", "local-ranks-filter", "duplicate-stdout-filters",
                           "duplicate-stderr-filters")
CLI_VALUE_OPTIONS = frozenset({"--nproc-per-node", "--nproc_per_node", "--seed", "--mode", "--timeout",
                               "--stall-timeout", "--p2p", "--trace", "--cost", "--compute-scale", "--isolation",
                               "--devices", "--gpus-per-node", "-r", "--redirects", "-t", "--tee",
                               # torchrun's (simulator.cli_torchrun), each in both of torchrun's spellings
                               *(f"--{o}" for o in _TORCHRUN_VALUE_OPTIONS),
                               *(f"--{o.replace('-', '_')}" for o in _TORCHRUN_VALUE_OPTIONS)})


def cli_options(args: Sequence[str]) -> dict[str, str] | None:
    """The options before the script, as typed (``{"--seed": "3", ...}``; a flag maps to ""); None for the
    subcommands, which run no ranks of a script."""
    if not args or args[0] in ("calibrate", "pytest"):
        return None
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            break
        if not a.startswith("-") or a == "-":  # the script: its own arguments follow
            break
        name, eq, value = a.partition("=")
        if name in CLI_VALUE_OPTIONS and not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
            i += 1
        out[name] = value
        i += 1
    return out


def cli_seed(args: Sequence[str]) -> int | None:
    """``--seed`` among the options before the script (0 when not given); None for the subcommands and usage
    errors, which run no ranks of a script."""
    options = cli_options(args)
    try:
        return None if options is None else int(options.get("--seed", "0"))
    except ValueError:
        return None  # (the parser reports it)


def rank_envs(run_hash_seed: int, n: int, base: Mapping[str, str]) -> list[dict[str, str]]:
    """The start environments of a world's ``n`` rank processes whose other variables are ``base``, for starting
    their warm interpreters ahead (:meth:`simulator.isolation.warm.WarmPool.prestart`); the rank processes get
    these values (:class:`simulator.isolation.proxy.ProcessRanks`)."""
    return [dict(base, PYTHONHASHSEED=str(hash_seed(run_hash_seed, r))) for r in range(n)]


def torchrun_defaults(environ: Mapping[str, str], world_size: int) -> dict[str, str]:
    """What torchrun adds to its workers' environment beyond the per-rank variables: one intra-op thread each
    (``OMP_NUM_THREADS=1``) when several processes share the node and the variable is not set."""
    return {"OMP_NUM_THREADS": "1"} if world_size > 1 and "OMP_NUM_THREADS" not in environ else {}


def reexec_with_seeded_hash() -> None:
    """Start this ``python -m simulator`` again with ``PYTHONHASHSEED`` from ``--seed`` (see the module docstring);
    returns when there is nothing to do (the variable set, a subcommand, no ``exec`` on this system)."""
    if os.environ.get("PYTHONHASHSEED", "random") not in ("", "random") or os.name != "posix":
        return
    seed = cli_seed(sys.argv[1:])
    orig = list(getattr(sys, "orig_argv", None) or [])  # the interpreter's own flags (-X, -W, -u) too
    # only an interpreter started as `python -m simulator` (run_module from other code would run that code twice)
    i = orig.index("-m") + 1 if "-m" in orig else len(orig)
    if seed is None or orig[i:i + 1] != ["simulator"]:
        return
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed(seed, 0)))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, orig, env)
