"""The processes a launcher starts, as process-isolated ranks (``python -m simulator --isolation process script.py``,
PyTorch's test harness under ``--sim-harness process``).

A launcher (``mp.spawn``, ``multiprocessing.Process``, ``MultiProcessTestCase``) starts real processes; with thread
ranks each becomes a thread of the launcher's process (:mod:`simulator.launch`).  Here each becomes a rank process
instead: the ``Process`` object travels to its rank process as multiprocessing's spawn sends it to a child (pickled
with the descriptors it holds, so the pipes, queues and shared tensors it was given are the launcher's own; see
:func:`.pickling.dumps_inherited`), and the rank process runs it as the child would (``Process.run``).  Its exit
status comes back as the status of a real child: 0, 1 when it raised, or its ``sys.exit`` code.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

from simulator.adapters import started_processes
from simulator.core.errors import RankExitError, os_status
from simulator.isolation import run_processes

__all__ = ["exit_status", "run_batch", "rank_process"]


def exit_status(code: Any) -> int:
    """A child's exit status for ``sys.exit(code)``, as ``multiprocessing`` computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return os_status(code)
    sys.stderr.write(str(code) + "\n")  # multiprocessing prints a non-integer exit message
    return 1


def _portable(proc: Any) -> Any:
    """``proc`` as a spawned child receives it: the same object, without the launcher's handle on the child."""
    clone = object.__new__(type(proc))
    clone.__dict__.update(proc.__dict__)
    clone._popen = None
    clone.__dict__.pop("_sentinel", None)
    clone.__dict__.pop("_tp_sim_popen", None)
    return clone


def rank_process(proc: Any, clean_codes: frozenset[int]) -> int:
    """Body of the rank process that stands for ``proc``: ``proc.run()``; returns its exit status.

    A non-zero ``sys.exit`` is a rank failure (the other ranks are released, as torchrun's peers see a child die)
    unless the code is one of ``clean_codes`` (the launcher's "skipped" codes), which ends the rank quietly.
    """
    started_processes.launched_process = True  # (its env:// rendezvous needs what the started process would have)
    try:
        proc.run()
    except SystemExit as e:
        code = exit_status(e.code)
        if code == 0 or code in clean_codes:
            return code
        raise
    return 0


def run_batch(world: Any, batch: Sequence[Any], clean_codes: frozenset[int]) -> None:
    """Run ``batch`` (started processes with simulated handles) as the ranks of ``world``, one process each; set each
    handle's ``returncode`` (and ``exc`` for a rank that raised).  Re-raises what the world raised."""
    try:
        results = run_processes(world, rank_process, (), {}, [(_portable(p), clean_codes) for p in batch])
    except BaseException:
        for r, p in enumerate(batch):
            err = world.errors[r] if r < len(world.errors) else None
            po = p._popen
            if err is None and r < len(world.results) and isinstance(world.results[r], int):
                po.returncode = world.results[r]
            elif isinstance(err, RankExitError):
                po.returncode, po.exited = exit_status(err.exit_code), True
        raise
    for p, code in zip(batch, results):
        p._popen.returncode = code
