"""``python -m simulator``: run a torchrun-style script on N simulated ranks in this process.

Each rank runs the script as ``__main__`` in its own thread and sees its own
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT`` in ``os.environ``; ``init_process_group()`` (any backend,
``env://``) binds to the simulated world.  The exit code is 0 when every rank
succeeds, else 1 with the failing rank's traceback on stderr.

Example::

    python -m simulator --nproc-per-node 4 --seed 3 train.py --epochs 1
    python -m simulator --nproc-per-node 8 --mode threads --trace run.json train.py
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback
from typing import Sequence

from .world import World

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m simulator", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc", type=int, default=1,
                   help="number of simulated ranks (default 1)")
    p.add_argument("--seed", type=int, default=0, help="schedule seed for --mode coop (default 0)")
    p.add_argument("--mode", choices=["coop", "threads"], default="coop",
                   help="coop: one rank at a time, reproducible; threads: free-running (default coop)")
    p.add_argument("--timeout", type=float, default=300.0, help="abort the run after this many seconds")
    p.add_argument("--trace", metavar="PATH", help="write a Chrome-trace/Perfetto JSON of the run to PATH")
    p.add_argument("--summary", action="store_true", help="print the per-rank communication summary")
    p.add_argument("script", help="the Python script to run on every rank")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    script = os.path.abspath(ns.script)
    if not os.path.isfile(script):
        print(f"python -m simulator: no such script: {ns.script}", file=sys.stderr)
        return 2
    if ns.nproc < 1:
        print(f"python -m simulator: --nproc-per-node must be at least 1, got {ns.nproc}", file=sys.stderr)
        return 2

    def rank_main() -> None:
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:  # sys.exit(0) in a rank is a normal return
            if e.code not in (None, 0):
                raise

    old_argv = sys.argv
    sys.argv = [script, *ns.script_args]
    sys.path.insert(0, os.path.dirname(script))
    world = World(ns.nproc, seed=ns.seed, mode=ns.mode, timeout=ns.timeout, torchrun_env=True)
    code = 0
    try:
        world.run(rank_main)
    except BaseException as e:  # noqa: BLE001  (report any failure as an exit code)
        if isinstance(e, KeyboardInterrupt):
            raise
        rank = getattr(e, "rank", None)
        who = f"rank {rank}" if rank is not None else "the run"
        print(f"python -m simulator: {who} failed ({type(e).__name__}); its traceback:", file=sys.stderr)
        traceback.print_exception(e, file=sys.stderr)
        code = 1
    finally:
        sys.argv = old_argv
        if sys.path and sys.path[0] == os.path.dirname(script):
            del sys.path[0]
    if world.trace is not None:
        if ns.trace:
            world.trace.to_chrome(ns.trace)
        if ns.summary:
            print(world.trace.format_summary())
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
