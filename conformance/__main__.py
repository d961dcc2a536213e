"""``python -m conformance``: run the conformance suite and print the report.

Exit codes: 0 every case that ran passed; 1 some case failed (or the suite hit
an error); 2 bad options; 5 nothing ran (e.g. ``--device cuda`` without a GPU).
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Sequence

from .cases import COLLECTIVES, OPS, CaseIdError, parse_case_id
from .execute import DEFAULT_IMPL
from .suite import DEFAULT_EXAMPLES, DEFAULT_WORLD_SIZES, ConfigError, SuiteConfig, run_suite

EPILOG = """\
examples:
  python -m conformance                                   # sim, CPU, world sizes 1-4, everything
  python -m conformance --backend gloo --world-sizes 2,3
  python -m conformance --collectives reduce,all_reduce --ops MAX,MIN --examples 20
  python -m conformance --impl torch.distributed.nn.functional --backend gloo --report torch-run
  python -m conformance --backend gloo --case 'reduce,W=4,group=3.1.2,root=1,op=MAX,...'   # rerun one case

Every failure prints its cause, the ranks' shapes and dtypes, and the command that reruns it.
"""


def _csv(kind: str, choices: Sequence[str] | None = None, upper: bool = False):
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(t.strip() for t in text.split(",") if t.strip())
        if upper:
            items = tuple(t.upper() for t in items)
        if not items:
            raise argparse.ArgumentTypeError(f"--{kind} needs at least one name")
        if choices is not None:
            bad = [t for t in items if t not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"--{kind}: unknown {', '.join(bad)}; choose from {', '.join(choices)}")
        return items
    return parse


def _world_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--world-sizes {text!r}: write ints like 1,2,3,4") from None
    if not sizes or any(w < 1 for w in sizes):
        raise argparse.ArgumentTypeError(f"--world-sizes {text!r}: every size must be >= 1")
    return sizes


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m conformance",
        description="Check every autograd-aware collective's forward and gradient against the specification.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("sim", "gloo", "nccl"), default="sim",
                   help="where the ranks run: sim (threads, in-process; default), gloo (processes on loopback), "
                        "nccl (one GPU per rank)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="tensor device (default cpu)")
    p.add_argument("--isolation", choices=("thread", "process"), default="thread",
                   help="sim only: thread (ranks are threads of one process; default) or process (each rank its "
                        "own process, with its own globals and PYTHONHASHSEED)")
    p.add_argument("--world-sizes", type=_world_sizes, default=DEFAULT_WORLD_SIZES, metavar="1,2,3,4",
                   help="world sizes to test (default 1,2,3,4)")
    p.add_argument("--collectives", type=_csv("collectives", COLLECTIVES), default=COLLECTIVES, metavar="NAMES",
                   help="comma-separated collectives (default all): " + ", ".join(COLLECTIVES))
    p.add_argument("--ops", type=_csv("ops", OPS, upper=True), default=OPS, metavar="OPS",
                   help="reduce ops for reduce/all_reduce/reduce_scatter (default all): " + ", ".join(OPS))
    p.add_argument("--examples", type=_positive_int, default=DEFAULT_EXAMPLES, metavar="N",
                   help=f"hypothesis examples per (collective, op, world size, group kind); collectives without "
                        f"an op draw 3x as many (default {DEFAULT_EXAMPLES})")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="suite seed (default 0)")
    p.add_argument("--impl", default=DEFAULT_IMPL, metavar="MODULE",
                   help=f"module under test, with torch.distributed.nn.functional's signatures: a dotted name or a "
                        f"path to a .py file (default {DEFAULT_IMPL})")
    p.add_argument("--dist-module", default=None, metavar="MODULE",
                   help="process-group module of the implementation (new_group, get_rank, get_backend, ReduceOp); "
                        "default "
                        "torch.distributed for torch.* implementations, else tensorplay.distributed")
    p.add_argument("--report", default=None, metavar="FILE",
                   help="write the report: FILE.md (markdown), FILE.json (JSON), or FILE without either "
                        "extension for both FILE.md and FILE.json")
    p.add_argument("-n", type=_positive_int, default=1, dest="workers", metavar="N",
                   help="split the cases over N worker processes (default 1)")
    p.add_argument("--case", action="append", default=[], metavar="ID",
                   help="run exactly this case (the id a failure prints); repeatable")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="per-case bound; a case running longer fails as 'timed out' (default: sim 10, gloo 10, nccl 60)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress line and no matrix, only the summary "
                   "and the failures")
    p.add_argument("--max-failures", type=int, default=10, metavar="K",
                   help="print the full reproduction of at most K failures (default 10; the report has all causes)")
    return p


def _exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the rank processes are shut down on the way out."""
    import signal

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        pass


def main(argv: Sequence[str] | None = None) -> int:
    _exit_on_sigterm()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cases = tuple(parse_case_id(c) for c in args.case)
    except CaseIdError as e:
        parser.error(f"--case: {e}")
    raw = sys.argv[1:] if argv is None else list(argv)
    cfg = SuiteConfig(
        backend=args.backend, device=args.device, impl=args.impl, dist_module=args.dist_module,
        world_sizes=args.world_sizes, collectives=args.collectives, ops=args.ops, examples=args.examples,
        seed=args.seed, timeout=args.timeout, workers=args.workers, cases=cases, isolation=args.isolation,
        command="python -m conformance " + " ".join(shlex.quote(a) for a in raw),
    )
    try:
        cfg.validate()
    except ConfigError as e:
        parser.error(str(e))
    try:
        result = run_suite(cfg, progress=not args.quiet)
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted; rank processes shut down\n")
        return 130
    out = sys.stdout
    if not args.quiet:
        out.write(result.report_markdown(max_examples=0).split("## Failures by cause")[0].rstrip() + "\n\n")
    causes = result.causes()
    if causes:
        out.write(f"Failures by cause ({len(result.failures)} cases, {len(causes)} causes):\n")
        for i, g in enumerate(causes, 1):
            where = ", ".join(f"{k} x{v}" for k, v in g["where"].items())
            out.write(f"  {i}. [{g['count']}] {g['stage']}: {g['reason']}\n       where: {where}\n"
                      f"       rerun: {g['repro']}\n")
        out.write("\n")
        for r in result.failures[: max(0, args.max_failures)]:
            out.write(r.describe() + "\n\n")
        if len(result.failures) > args.max_failures > 0:
            out.write(f"... {len(result.failures) - args.max_failures} more failures (see --report)\n\n")
    if args.report:
        for path in result.write(args.report):
            out.write(f"report written to {path}\n")
    out.write(result.summary() + "\n")
    out.flush()
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
