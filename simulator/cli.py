"""``python -m simulator``: run a distributed script on simulated ranks in this process.

Two kinds of script, told apart by ``--nproc-per-node``:

* **torchrun-style** (``--nproc-per-node N`` given, as with ``torchrun``): the
  script runs as ``__main__`` on each of N ranks, in its own thread, and sees its
  own ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR`` and ``MASTER_PORT`` in ``os.environ``; ``init_process_group()``
  (any backend) binds to the simulated world.
* **launcher** (no ``--nproc-per-node``, as with ``python script.py``): the script
  runs once and starts its own ranks with ``torch.multiprocessing.spawn`` or
  ``multiprocessing.Process``; each process it starts becomes a simulated rank
  (see :mod:`simulator.launch`).

The exit code is 0 when the script and every rank succeed, 1 when a rank fails
(its traceback on stderr, once, naming the rank) or exits with a non-zero
status, 2 for a usage error (including a script run in the wrong style), and
the script's own ``sys.exit`` status otherwise.

Example::

    python -m simulator --nproc-per-node 4 --seed 3 train.py --epochs 1
    python -m simulator --nproc-per-node 8 --mode threads --trace run.json train.py
    python -m simulator ddp_tutorial.py          # the script calls mp.spawn(fn, nprocs=4)
    python -m simulator calibrate --backend gloo --world-sizes 2,4 --out profile.json
    python -m simulator --nproc-per-node 4 --cost profile.json --summary train.py

``calibrate`` (first argument) measures collectives on real processes and writes a cost profile (see
:mod:`simulator.timing.calibrate`); ``--cost`` makes virtual time (``--summary``, ``--trace``) use it.

A run is bounded as torch bounds it, by operation: it fails when ranks wait and nothing progressed for
``--stall-timeout`` seconds (default 1800, torch's default process-group timeout); ``--timeout`` (default
none) bounds the whole run.  A deadlock is reported at once.  Ctrl-C stops the run (exit code 130).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import shlex
import sys
import traceback
from typing import Any, Sequence

import torch
from torch.multiprocessing.spawn import ProcessException

from simulator import cli_torchrun, launch as _launch
from simulator.adapters import per_rank_main
from simulator.timing.calibrate import main as calibrate_main
from simulator.timing.cost import default_cost, resolve_cost
from simulator.isolation import ISOLATIONS
from simulator.isolation.child import ScriptMain
from simulator.core.progress import CLI, DEFAULT_STALL_TIMEOUT, check_seconds
from simulator.world import World

__all__ = ["main"]

_USAGE = ("python -m simulator [options] script [script args ...]\n"
          "       python -m simulator [options] -m module [module args ...]\n"
          "       python -m simulator calibrate [calibrate options]   (see: python -m simulator calibrate --help)\n"
          "       python -m simulator pytest [pytest args ...]")
_EPILOG = """subcommands:
  calibrate   measure collectives on real processes (gloo) and write a cost profile for --cost;
              python -m simulator calibrate --help lists its options
  pytest      run pytest with PyTorch's own distributed test harness (MultiProcessTestCase, DTensorTestBase,
              distributed_test.py) on simulated ranks with a process each: the same as
              python -m pytest -p simulator.torch_harness --sim-harness process [pytest args ...]
              (--sim-harness thread: thread ranks, faster, for suites without per-process state)

examples:
  python -m simulator --nproc-per-node 4 --seed 3 train.py --epochs 1
  python -m simulator --nproc-per-node 8 --mode threads --trace run.json train.py
  python -m simulator ddp_tutorial.py          # the script calls mp.spawn(fn, nprocs=4)
  python -m simulator --nproc-per-node 2 -m trainer.main --lr 0.1   # as python -m trainer.main
  python -m simulator calibrate --backend gloo --world-sizes 2,4 --out profile.json
  python -m simulator pytest test/distributed/test_c10d_gloo.py -k test_allreduce"""


class _Parser(argparse.ArgumentParser):
    """An abbreviation is ambiguous only between different options: ``--nproc`` names ``--nproc-per-node``
    although ``--nproc_per_node`` (its other spelling) shares the prefix (argparse before 3.12 refuses it)."""

    def _get_option_tuples(self, option_string: str) -> list[Any]:
        seen: set[int] = set()
        out = []
        for t in super()._get_option_tuples(option_string):
            if id(t[0]) not in seen:  # t[0]: the action; one per action
                seen.add(id(t[0]))
                out.append(t)
        return out


def _seconds(flag: str, example: str) -> Any:
    """An argparse type: a positive number of seconds (``inf``: no bound); anything else is a usage error."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"a number of seconds is needed, got {text!r} "
                                             f"(e.g. {flag} {example}; inf for no bound)") from None
        try:
            return check_seconds(value, flag, call="python -m simulator", example=example)
        except Exception:  # noqa: BLE001  (nan, <= 0)
            raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r} "
                                             f"(e.g. {flag} {example}; inf for no bound)") from None

    parse.__name__ = flag  # argparse names the type in some messages
    return parse


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m simulator", description=__doc__.split("\n\n")[0], usage=_USAGE,
                epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc", type=cli_torchrun.nproc_type,
                   default=cli_torchrun.env_default("--nproc-per-node", None),
                   help="run the script torchrun-style on this many simulated ranks; without it the script "
                        "runs once as a launcher that starts its own ranks (mp.spawn / multiprocessing.Process)")
    p.add_argument("--seed", type=int, default=0, help="schedule seed for --mode coop (default 0)")
    p.add_argument("--mode", choices=["coop", "threads"], default="coop",
                   help="coop: one rank at a time, reproducible; threads: free-running, and thread ranks share "
                        "torch's, random's and numpy's global generators, so random draws differ from run to run "
                        "(default coop)")
    p.add_argument("--timeout", type=_seconds("--timeout", "3600"), default=None, metavar="SECONDS",
                   help="bound each simulated world's whole run, in seconds (default: no bound)")
    p.add_argument("--stall-timeout", type=_seconds("--stall-timeout", "3600"), default=DEFAULT_STALL_TIMEOUT,
                   metavar="SECONDS", help="fail the run when ranks wait in an operation and nothing progressed for this many seconds "
                        "(default 1800, torch's default process-group timeout; inf: no bound)")
    p.add_argument("--p2p", choices=["rendezvous", "eager"], default="rendezvous",
                   help="what a blocking send waits for: its recv (rendezvous, as gloo and NCCL; default) or "
                        "nothing (eager: buffered, MPI-style)")
    p.add_argument("--trace", metavar="PATH", help="write a Chrome-trace/Perfetto JSON of the run to PATH")
    p.add_argument("--summary", action="store_true",
                   help="print the per-rank summary of virtual time: communication, exposed communication, "
                        "compute, end and step time")
    p.add_argument("--cost", metavar="PROFILE", default=None,
                   help="cost profile for virtual time, written by `python -m simulator calibrate --out PROFILE` "
                        "(default: the uncalibrated alpha-beta model)")
    p.add_argument("--compute-scale", type=float, default=None,
                   help="multiply each rank's measured CPU time between operations by this (e.g. 0.1 for a device "
                        "ten times faster; default: the profile's, else 1)")
    p.add_argument("--isolation", choices=list(ISOLATIONS), default="thread",
                   help="thread: ranks are threads of this process (default); process: each rank its own process "
                        "with its own globals and PYTHONHASHSEED")
    p.add_argument("--devices", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: every rank sees CUDA devices backed by the CPU, so a script written for GPUs runs "
                        "unmodified on a machine without one (set_device, .to(local_rank), nccl, DDP device_ids); "
                        "default cpu")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                   help="with --devices cuda: stand-in GPUs per node (torch.cuda.device_count(); LOCAL_RANK is "
                        "rank %% N); default: --nproc-per-node, or for a script that starts its ranks itself 2, "
                        "and one per rank when it starts more")
    p.add_argument("-m", "--module", action="store_true", default=cli_torchrun.env_default("--module", False, flag=True),
                   help="the program is a module, run as python -m runs it (its relative imports work; the working "
                        "directory first on sys.path), as torchrun's -m")
    cli_torchrun.add_arguments(p)
    p.add_argument("script", nargs="?", help="the Python script to run (with -m: the module's name)")
    # (required: checked in main)
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def _command(ns: argparse.Namespace, nproc: Any) -> str:
    """The command line that reruns this script with these settings (``nproc=None``: launcher style)."""
    parts = ["python", "-m", "simulator"]
    if nproc is not None:
        parts += ["--nproc-per-node", str(nproc)]
        if getattr(ns, "nodes", 1) > 1:
            parts += ["--nnodes", str(ns.nodes)]
    parts += ["--seed", str(ns.seed), "--mode", ns.mode]
    if ns.p2p != "rendezvous":
        parts += ["--p2p", ns.p2p]
    if ns.timeout is not None and ns.timeout != float("inf"):
        parts += ["--timeout", f"{ns.timeout:g}"]
    if ns.stall_timeout != DEFAULT_STALL_TIMEOUT:
        parts += ["--stall-timeout", f"{ns.stall_timeout:g}"]
    if ns.cost is not None:
        parts += ["--cost", ns.cost]
    if ns.compute_scale is not None:
        parts += ["--compute-scale", f"{ns.compute_scale:g}"]
    if ns.isolation != "thread":
        parts += ["--isolation", ns.isolation]
    if ns.devices != "cpu":
        parts += ["--devices", ns.devices]
    if ns.gpus_per_node is not None:
        parts += ["--gpus-per-node", str(ns.gpus_per_node)]
    for flag in ("--role", "--rdzv-id", "--master-addr", "--master-port"):  # (what the ranks read in os.environ)
        value = getattr(ns, flag[2:].replace("-", "_"), None)
        if value is not None:
            parts += [flag, str(value)]
    if ns.module:
        parts.append("-m")
    return shlex.join([*parts, ns.script, *ns.script_args])


def _err(text: str) -> None:
    print(f"python -m simulator: {text}", file=sys.stderr, flush=True)


def _find(exc: BaseException, cls: type) -> BaseException | None:
    """``exc`` or the first exception of class ``cls`` inside it (exception groups)."""
    if isinstance(exc, cls):
        return exc
    for sub in getattr(exc, "exceptions", ()) if isinstance(exc, BaseExceptionGroup) else ():
        found = _find(sub, cls)
        if found is not None:
            return found
    return None


def _report(exc: BaseException) -> int:
    """Print a failure once, naming the rank; return the exit code."""
    style = _find(exc, _launch.LaunchStyleError)
    if style is not None:  # every rank may raise it: say it once, it is a usage error
        _err(str(style))
        return 2
    missing = _find(exc, per_rank_main.ProgramNotFoundError)
    if missing is not None:  # -m names no module: one line, as python -m says it (each rank's is the same)
        _err(str(missing).splitlines()[0])
        return 1
    rank = getattr(exc, "rank", None)
    if isinstance(exc, ProcessException) and rank is not None:
        kind = type(getattr(exc, "rank_exception", None) or exc).__name__
        code = getattr(exc, "exit_code", None)
        what = f"exited with code {code}" if code is not None else f"failed ({kind})"
        _err(f"rank {rank} (process {exc.error_index} of torch.multiprocessing.spawn) {what}; the launcher got "
             f"{type(exc).__name__}:")
        sys.stderr.write(_launch.format_rank_traceback(exc))
        return 1
    if isinstance(exc, SystemExit) and rank is None:  # the script's own sys.exit()
        code = exc.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    exit_code = getattr(exc, "exit_code", None)
    if exit_code is None and isinstance(exc, SystemExit):
        exit_code = exc.code
    if rank is not None and rank >= 0 and exit_code is not None:
        _err(f"rank {rank} exited with code {exit_code} (a rank that exits non-zero is a failed rank, as under "
             f"torchrun); where it exited:")
        where = exc.__cause__ if isinstance(exc.__cause__, SystemExit) else exc
        sys.stderr.write(_launch.format_rank_traceback(where))
        for note in getattr(exc, "__notes__", ()) if where is not exc else ():
            sys.stderr.write(note + "\n")
        return 1
    if rank is not None and rank >= 0:
        _err(f"rank {rank} failed ({type(exc).__name__}); its traceback:")
    elif rank is not None:  # the world's own failures (a timeout) concern no single rank
        _err(f"the run failed ({type(exc).__name__}):")
    else:
        _err(f"the script raised {type(exc).__name__}; its traceback:")
    sys.stderr.write(_launch.format_rank_traceback(exc))
    return 1


_OPEN_TRACE = "open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing (Load)"


def _write_traces(ns: argparse.Namespace, worlds: list[World]) -> None:
    traces = [w.trace for w in worlds if w.trace is not None]
    if ns.trace and traces:
        if len(traces) == 1:
            traces[0].to_chrome(ns.trace)
            _err(f"trace written to {os.path.abspath(ns.trace)}; {_OPEN_TRACE}")
        else:  # one file per launched world, numbered in launch order
            stem, ext = os.path.splitext(ns.trace)
            names = [f"{stem}.{i}{ext or '.json'}" for i in range(len(traces))]
            for tr, name in zip(traces, names):
                tr.to_chrome(name)
            _err(f"{len(traces)} worlds ran; their traces: {', '.join(os.path.abspath(n) for n in names)}; "
                 f"{_OPEN_TRACE.replace('open it', 'open each')}")
    if ns.summary:
        for i, tr in enumerate(traces):
            if len(traces) > 1:
                print(f"world {i} ({tr.world_size} ranks):")
            print(tr.format_summary())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["calibrate"] and not os.path.isfile("calibrate"):  # a script named 'calibrate' still runs
        return calibrate_main(args[1:])
    if args[:1] == ["pytest"] and not os.path.isfile("pytest"):
        return _run_pytest(args[1:])
    parser = _parser()
    ns = parser.parse_args(args)
    if ns.script is None:  # (argparse would name the optional script_args as required too)
        parser.error("the following argument is required: " + ("module (the module to run, as python -m module)"
                     if ns.module else "script (the Python script to run)"))
    if not ns.module and ns.devices == "cpu" and not cli_torchrun.torchrun_style(ns) \
            and _harness_test_file(ns.script):
        return _run_harness_file(ns, args)
    program = per_rank_main.Program(ns.script, module=ns.module)
    plan = None
    if cli_torchrun.torchrun_style(ns):
        try:
            plan = cli_torchrun.plan(ns)
        except cli_torchrun.UsageError as e:
            _err(str(e))
            return 2
        ns.nodes = plan.nodes
        for note in plan.notes:
            _err(note)
    code = _check_program(program)
    if code:
        return code
    if ns.trace:  # checked before the run: a run's trace is lost if it cannot be written at its end
        folder = os.path.dirname(os.path.abspath(ns.trace))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK) or os.path.isdir(ns.trace):
            _err(f"--trace {ns.trace}: cannot write a file there (the folder {folder} must exist and be writable); "
                 f"fix: name a file in an existing, writable folder")
            return 2
    try:
        World(1, seed=ns.seed, mode=ns.mode, timeout=ns.timeout, stall_timeout=ns.stall_timeout,  # checked first
              isolation=ns.isolation, devices=ns.devices, gpus_per_node=ns.gpus_per_node)
        cost = resolve_cost(ns.cost, ns.compute_scale)
    except Exception as e:  # noqa: BLE001  a bad option is a usage error
        _err(str(e))
        return 2
    if ns.mode == "threads" and ns.isolation == "thread":
        _err("--mode threads: the ranks run free and share torch's, random's and numpy's global generators, so a "
             "program's random draws differ from run to run (--mode coop, the default, gives each rank its own)")
    hook = sys.excepthook
    try:
        with default_cost(cost):  # every world the script starts uses it (a launcher's worlds too)
            if plan is None:
                code, worlds = _run_launcher(ns, program)
            else:
                code, worlds = _run_torchrun_style(ns, program, plan)
        _write_traces(ns, worlds)
    except KeyboardInterrupt as e:
        if getattr(e, "rank", -1) >= 0:  # a rank's program raised it (not Ctrl-C): a failed rank, as a process
            _report(e)                   # that dies of it (exit status 130, its traceback)
            return 130
        _err("interrupted")  # Ctrl-C: the world was stopped (World.run releases its ranks); one line, as a shell
        return 130
    finally:
        sys.excepthook = hook  # torch's init_process_group wraps it once per rank ("[rank1]: [rank0]: ...")
    return code


def _check_program(program: per_rank_main.Program) -> int:
    """0 when the program can start; else, after saying why as python would, the exit code python gives (2 for a
    missing script, 1 for a script that does not compile or a module that cannot be found)."""
    if program.module:
        # only the top-level name is looked up here: finding a submodule imports its packages, which each rank
        # does itself (as each process of `torchrun -m` does)
        top = program.typed.split(".")[0]
        sys.path.insert(0, program.folder)
        try:
            found = bool(top) and importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            del sys.path[0]
        if not found:
            _err(f"no module named {program.typed!r} (looked for {top!r} on sys.path, from the working directory "
                 f"{os.getcwd()}); fix: run from the folder that holds it, or add that folder to PYTHONPATH")
            return 1
        return 0
    script = program.script
    if not os.path.isfile(script):
        _err(f"no such script: {program.typed}" + (f" (a directory runs as a script only with a __main__.py, as "
                                                    f"python runs it; {script} is missing)"
                                                    if os.path.isdir(program.typed) else ""))
        return 2
    try:  # a script that does not compile fails as `python script.py` does, before any rank starts
        with open(script, "rb") as f:
            compile(f.read(), script, "exec")
    except SyntaxError as e:
        sys.stderr.write("".join(traceback.format_exception_only(e)))
        return 1
    return 0


#: a script that is a test file of torch's distributed test harness (its ranks are started by the harness's classes)
_HARNESS_FILE = re.compile(r"torch\.testing\._internal\.(common_distributed|distributed\.)")


def _harness_test_file(script: str) -> bool:
    """Whether ``script`` is a test file on PyTorch's distributed test harness that runs itself (torch's
    ``run_tests()`` or unittest's ``unittest.main()``, which read the same command line)."""
    try:
        with open(script, encoding="utf-8", errors="replace") as f:
            source = f.read()
    except OSError:
        return False
    return ("run_tests(" in source or "unittest.main(" in source) and _HARNESS_FILE.search(source) is not None


def _run_harness_file(ns: argparse.Namespace, args: list[str]) -> int:
    """A test file on torch's harness that runs itself: its tests as ``python -m simulator pytest FILE`` runs them
    (rank processes unless ``--isolation thread``), with the options given here as the plugins' own."""
    def given(option: str) -> bool:
        before = args[:len(args) - len(ns.script_args)]
        return any(a == option or a.startswith(option + "=") for a in before)

    threads = given("--isolation") and ns.isolation == "thread"
    _err(f"{ns.script} is a test file of PyTorch's distributed test harness that runs itself: its tests "
         f"run as with `python -m simulator pytest {ns.script}` (pytest collects the same tests; each test's ranks "
         f"are simulated {'threads' if threads else 'processes'})")
    options = ["--sim-harness", "thread" if threads else "process"]
    for option, dest in (("--seed", "seed"), ("--mode", "mode"), ("--timeout", "timeout"),
                         ("--stall-timeout", "stall_timeout")):
        if given(option):
            options += [f"--sim-{option[2:]}", str(getattr(ns, dest))]
    return _run_pytest([*options, *_unittest_to_pytest(ns.script, ns.script_args)])


def _unittest_to_pytest(script: str, args: list[str]) -> list[str]:
    """unittest's command line (``-v``, ``-k PATTERN``, ``-f``, ``Class``, ``Class.test``) as pytest's."""
    out: list[str] = []
    chosen: list[str] = []
    it = iter(args)
    for a in it:
        if a in ("-f", "--failfast"):
            out.append("-x")
        elif a == "-k":
            out += ["-k", next(it, "")]
        elif not a.startswith("-") and re.fullmatch(r"[A-Za-z_][\w.]*", a):
            chosen.append(script + "::" + a.replace(".", "::"))
        else:
            out.append(a)  # (-v, -q and pytest's own options pass as they are)
    return [*out, *(chosen or [script])]


def _run_pytest(args: list[str]) -> int:
    """``python -m simulator pytest ARGS``: pytest with torch's test harness on simulated ranks (rank processes unless
    ARGS choose with ``--sim-harness``: a test written for processes gets a process per rank)."""
    import pytest

    chosen = any(a == "--sim-harness" or a.startswith("--sim-harness=") for a in args)
    return int(pytest.main(["-p", "simulator.torch_harness", *([] if chosen else ["--sim-harness", "process"]),
                            *args]))


#: stand-in GPUs a launcher-style script sees with --devices cuda and no --gpus-per-node
_LAUNCHER_GPUS = 2


def _run_launcher(ns: argparse.Namespace, program: per_rank_main.Program) -> tuple[int, list[World]]:
    launcher = _launch._Launcher(seed=ns.seed, mode=ns.mode, timeout=ns.timeout, stall_timeout=ns.stall_timeout,
                                 device="cpu", replay_hint=_command(ns, None), p2p=ns.p2p, bound_names=CLI,
                                 isolation=ns.isolation)
    launcher.devices, launcher.gpus_per_node = ns.devices, ns.gpus_per_node
    stand_in = contextlib.nullcontext()
    if ns.devices == "cuda":  # the launcher is a process of the machine too: it counts the GPUs to start its ranks
        from simulator import standin  # (lazy: the stand-in's import is heavy, and only --devices cuda needs it)

        if ns.gpus_per_node is None:
            launcher.gpus_per_node, launcher.gpus_follow_ranks = _LAUNCHER_GPUS, True
            _err(f"--devices cuda: the machine has {_LAUNCHER_GPUS} stand-in GPUs (torch.cuda.device_count()), and "
                 f"its ranks one per rank when the program starts more processes; pass --gpus-per-node N to choose")
        stand_in = standin.enabled(gpus_per_node=launcher.gpus_per_node)
    with stand_in:
        exc = _launch._execute(launcher, program, (), ns.script_args, other_style=_command(ns, "N"))
    code = 0 if exc is None else _report(exc)
    if code == 0 and launcher.failures:  # pragma: no cover  (_execute returns the failure in that case)
        code = _report(launcher.failures[0])
    return code, launcher.worlds


def _run_torchrun_style(ns: argparse.Namespace, program: per_rank_main.Program,
                        plan: cli_torchrun.TorchrunPlan) -> tuple[int, list[World]]:
    if plan.world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        # torchrun gives each of several processes one intra-op thread (OMP_NUM_THREADS=1); kernels whose results
        # depend on the thread count (bf16 matmuls) then match a real run bit for bit
        torch.set_num_threads(1)
        _err("OMP_NUM_THREADS is not set: as torchrun does, each rank computes with 1 intra-op thread "
             "(set OMP_NUM_THREADS to choose)")
    worlds: list[World] = []
    code = 0
    # set once for all ranks: a rank restoring them while another still runs would race
    old_argv, folder = sys.argv, program.folder
    sys.argv = [ns.script, *ns.script_args]  # (the path as typed, as python and torchrun give it; -m: run_path)
    sys.path.insert(0, folder)
    try:
        for attempt in range(plan.restarts + 1):  # torchrun's --max-restarts: the worker group starts again
            if attempt:
                _err(f"the run failed; starting it again, as torchrun restarts its workers (restart {attempt} of "
                     f"--max-restarts {plan.restarts}; TORCHELASTIC_RESTART_COUNT={attempt})")
            world = World(plan.world_size, seed=ns.seed, mode=ns.mode, timeout=ns.timeout,
                          stall_timeout=ns.stall_timeout, torchrun_env=True, p2p=ns.p2p,
                          cost=resolve_cost(None),  # --cost / --compute-scale, set by main()
                          isolation=ns.isolation, devices=ns.devices,
                          gpus_per_node=ns.gpus_per_node or (plan.nproc if plan.nodes > 1 else None),
                          env={**plan.env, "TORCHELASTIC_RESTART_COUNT": str(attempt)})
            world.bound_names = CLI  # its reports name --timeout / --stall-timeout
            if hasattr(world, "replay_hint"):
                world.replay_hint = _command(ns, plan.nproc)  # type: ignore[attr-defined]
            worlds.append(world)
            try:
                with _launch.patched(None, hint=_command(ns, None)):
                    world.run(ScriptMain(program, ns.script_args, plan.output, attempt,
                                         thread_rank=ns.isolation == "thread"))
                code = 0
                break
            except BaseException as e:  # noqa: BLE001  (report any failure as an exit code)
                if isinstance(e, KeyboardInterrupt):
                    raise
                code = _report(e)
                for path in plan.output.error_files(attempt):  # (torchrun's summary names them too)
                    _err(f"error file written by torch's @record: {path}")
    finally:
        sys.argv = old_argv
        if sys.path and sys.path[0] == folder:
            del sys.path[0]
    return code, worlds


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
