"""Plan the cases, run them (optionally over N worker processes), check them, collect the result.

Planning: for every (collective, op) row of the matrix, every world size and
both group kinds (the world; a subgroup whose global ranks differ from its
group ranks, for world sizes >= 2), hypothesis draws ``examples`` cases from
:func:`conformance.strategies.cases`.  Each of those draws is seeded from the
suite seed and the cell, so the same options give the same cases.
"""
from __future__ import annotations

import contextlib
import hashlib
import queue
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .cases import COLLECTIVES, OPS, Case, cell_rows, parse_case_id
from .execute import DEFAULT_IMPL, check_impl_name, default_dist_module
from .expect import Verdict, check_case
from .report import CaseResult, Progress, Result, repro_command
from .runners import (BACKENDS, DEFAULT_TIMEOUT, DEVICES, RunnerError, main_free_children, make_runner,
                      refuse_while_bootstrapping, runner_label, validate_backend_device)

__all__ = ["DEFAULT_EXAMPLES", "ConfigError", "SuiteConfig", "plan_cases", "run_suite", "draw"]

#: hypothesis examples per (collective, op, world size, group kind); see docs/performance.md (conformance suite)
DEFAULT_EXAMPLES = 10
DEFAULT_WORLD_SIZES = (1, 2, 3, 4)
#: collectives without a reduce op have no op axis, but more shapes (roots, splits, ragged blocks) to cover:
#: they draw this many times ``examples`` per cell
OPLESS_FACTOR = 3


class ConfigError(ValueError):
    """A bad option, named as ``name=value`` with the fix."""


@dataclass
class SuiteConfig:
    """Every option of a run (the CLI, the pytest plugin and :func:`conformance.check` build one)."""

    backend: str = "sim"
    device: str = "cpu"
    impl: str = DEFAULT_IMPL
    dist_module: str | None = None
    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES
    collectives: tuple[str, ...] = COLLECTIVES
    ops: tuple[str, ...] = OPS
    examples: int = DEFAULT_EXAMPLES
    seed: int = 0
    timeout: float | None = None
    workers: int = 1
    cases: tuple[Case, ...] = ()
    command: str = ""
    #: sim only: "thread" (ranks are threads) or "process" (each rank its own process; simulator.isolation)
    isolation: str = "thread"

    def validate(self) -> "SuiteConfig":
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r} is unknown; use one of {', '.join(BACKENDS)}")
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r} is unknown; use one of {', '.join(DEVICES)}")
        ws = tuple(self.world_sizes)
        if not ws or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in ws):
            raise ConfigError(f"world_sizes={list(ws)} must be ints >= 1, e.g. world_sizes=(1, 2, 3, 4)")
        self.world_sizes = tuple(sorted(set(ws)))
        bad = [c for c in self.collectives if c not in COLLECTIVES]
        if bad or not self.collectives:
            raise ConfigError(f"collectives={list(self.collectives)}: unknown {bad}; choose from {', '.join(COLLECTIVES)}")
        self.collectives = tuple(c for c in COLLECTIVES if c in self.collectives)
        ops = tuple(o.upper() for o in self.ops)
        bad = [o for o in ops if o not in OPS]
        if bad or not ops:
            raise ConfigError(f"ops={list(self.ops)}: unknown {bad}; choose from {', '.join(OPS)}")
        self.ops = tuple(o for o in OPS if o in ops)
        if isinstance(self.examples, bool) or not isinstance(self.examples, int) or self.examples < 1:
            raise ConfigError(f"examples={self.examples!r} must be an int >= 1")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"workers={self.workers!r} (-n) must be an int >= 1")
        if self.timeout is not None and not self.timeout > 0:
            raise ConfigError(f"timeout={self.timeout!r} must be a positive number of seconds")
        if self.isolation not in ("thread", "process"):
            raise ConfigError(f"isolation={self.isolation!r} is unknown; use thread or process")
        if self.isolation == "process" and (self.backend != "sim" or self.device != "cpu"):
            raise ConfigError(f"isolation='process' with backend={self.backend!r}, device={self.device!r}: rank "
                              "processes are an option of the simulator on the CPU; pass --backend sim --device cpu, "
                              "or leave --isolation out (gloo and nccl ranks are processes already)")
        why = check_impl_name(self.impl) if isinstance(self.impl, str) else f"impl={self.impl!r} must be a str"
        if why:
            raise ConfigError(why)
        try:
            validate_backend_device(self.backend, self.device, self.impl, self.dist_module)
        except RunnerError as e:
            raise ConfigError(str(e)) from None
        cases = []
        for c in self.cases:
            cases.append(parse_case_id(c) if isinstance(c, str) else c)
        self.cases = tuple(cases)
        return self

    @property
    def label(self) -> str:
        return runner_label(self.backend, self.device, self.isolation)

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "device": self.device, "label": self.label, "impl": self.impl,
            "default_impl": DEFAULT_IMPL, "dist_module": self.dist_module or default_dist_module(self.impl),
            "dist_module_given": self.dist_module is not None
            and self.dist_module != default_dist_module(self.impl),
            "world_sizes": list(self.world_sizes), "collectives": list(self.collectives), "ops": list(self.ops),
            "examples": self.examples, "seed": self.seed,
            "timeout": self.timeout if self.timeout is not None else DEFAULT_TIMEOUT[self.backend],
            "timeout_given": self.timeout is not None, "workers": self.workers,
            "explicit_cases": [c.id() for c in self.cases], "command": self.command, "isolation": self.isolation,
        }


# ---------------------------------------------------------------------------
# planning
# ---------------------------------------------------------------------------
def _cell_seed(seed: int, *parts: Any) -> int:
    text = "/".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


@contextlib.contextmanager
def _without_local_constants() -> Iterator[None]:
    """Keep hypothesis from mixing literals of whatever modules happen to be imported into the draws.

    Hypothesis sometimes draws an integer from the constants it finds in the
    source of local modules in ``sys.modules``; then the cases planned by the
    CLI, by pytest and by ``conformance.check`` inside someone's test suite
    would differ for the same seed.  Planning therefore sees no local
    constants.  (Private hypothesis API, used defensively: if it moves, plans
    are still valid, only less stable across import contexts.)
    """
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants

        original = providers._get_local_constants
        cache = providers.CONSTANTS_CACHE.cache
    except (ImportError, AttributeError):  # pragma: no cover - another hypothesis version
        yield
        return
    empty = Constants()
    cache.clear()
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = original
        cache.clear()


def draw(strategy: Any, n: int, seed: int) -> list[Any]:
    """``n`` distinct examples of ``strategy``, drawn by hypothesis deterministically from ``seed``."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    got: list[Any] = []

    @hseed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate], derandomize=False,
              suppress_health_check=list(HealthCheck), verbosity=settings.default.verbosity)
    @given(strategy)
    def collect(example: Any) -> None:
        got.append(example)

    with _without_local_constants():
        collect()
    seen, out = set(), []
    for ex in got:
        key = ex.id() if isinstance(ex, Case) else repr(ex)
        if key not in seen:
            seen.add(key)
            out.append(ex)
    return out[:n]


def plan_cases(config: SuiteConfig) -> list[Case]:
    """Every case of a run, in report order (explicit ``config.cases`` if given)."""
    if config.cases:
        return list(config.cases)
    from . import strategies as cst

    cases: list[Case] = []
    for collective, op in cell_rows(config.collectives, config.ops):
        for w in config.world_sizes:
            for kind in ("world", "subgroup"):
                if kind == "subgroup" and w < 2:
                    continue
                strat = cst.cases(collective=collective, op=op, world_size=w, group_kind=kind)
                n = config.examples * (OPLESS_FACTOR if op is None else 1)
                cases.extend(draw(strat, n, _cell_seed(config.seed, collective, op, w, kind)))
    return cases


# ---------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------
def run_one(runner: Any, case: Case, config_dict: dict[str, Any]) -> CaseResult:
    """Run ``case`` with ``runner`` and check it."""
    rep = runner.run(case)
    if rep.skipped:
        verdict = Verdict("skipped", None, rep.skipped)
    elif rep.error:
        verdict = Verdict("error", "runs", rep.error.splitlines()[0][:160], rep.error)
    else:
        try:
            verdict = check_case(case, rep.outcomes, timed_out=rep.timed_out, runner_note=rep.note,
                                 device=config_dict["device"])
        except Exception as e:  # noqa: BLE001  a bug in the checker must not hide the other cases
            import traceback

            verdict = Verdict("error", "runs", f"the checker raised {type(e).__name__}",
                              traceback.format_exc())
    repro = repro_command(case, config_dict) if verdict.status in ("failed", "error") else ""
    return CaseResult(case, verdict, runner.label, rep.seconds, repro)


def _worker_main(config: SuiteConfig, tasks: Any, results: Any) -> None:
    """A -n worker: its own runner (and rank pools), chunks of cases from ``tasks`` until ``None``."""
    import signal
    import warnings

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")  # unwind, so the runner closes its rank processes

    signal.signal(signal.SIGTERM, stop)
    warnings.simplefilter("ignore", FutureWarning)
    cd = config.as_dict()
    runner = make_runner(config.backend, config.device, config.impl, config.dist_module, config.timeout,
                         isolation=config.isolation, seed=config.seed)
    try:
        while True:
            chunk = tasks.get()
            if chunk is None:
                break
            for idx, case in chunk:
                results.put((idx, run_one(runner, case, cd)))
    finally:
        runner.close()
        results.put(None)


def run_suite(config: SuiteConfig, *, progress: bool | Progress = True,
              on_result: Callable[[CaseResult], None] | None = None) -> Result:
    """Run every planned case of ``config`` and return the :class:`~conformance.report.Result`."""
    import warnings

    config.validate()
    if config.backend != "sim" or config.workers > 1:
        try:
            refuse_while_bootstrapping("conformance.check()" if config.command.startswith("conformance.check")
                                       else "the conformance suite")
        except RunnerError as e:
            raise ConfigError(str(e)) from None
    t0 = time.perf_counter()
    cases = plan_cases(config)
    cd = config.as_dict()
    result = Result(config=cd)
    prog = progress if isinstance(progress, Progress) else Progress(len(cases), config.label, enabled=bool(progress))
    prog.total = len(cases)

    def record(r: CaseResult) -> None:
        result.results.append(r)
        prog.update(r)
        if on_result is not None:
            on_result(r)

    with warnings.catch_warnings():
        # torch.distributed.nn.functional warns on every call that it is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        if config.workers <= 1 or len(cases) <= 1:
            runner = make_runner(config.backend, config.device, config.impl, config.dist_module, config.timeout,
                         isolation=config.isolation, seed=config.seed)
            try:
                for case in cases:
                    record(run_one(runner, case, cd))
            finally:
                runner.close()
        else:
            ordered = _run_parallel(config, cases, record)
            order = {id(r): i for i, r in enumerate(ordered)}
            result.results.sort(key=lambda r: order.get(id(r), 0))
    prog.close()
    result.seconds = time.perf_counter() - t0
    return result


def _run_parallel(config: SuiteConfig, cases: list[Case], record: Callable[[CaseResult], None]) -> list[CaseResult]:
    """Split ``cases`` over ``config.workers`` processes (chunks grouped by world size); results in case order."""
    try:
        import multiprocess as mp
    except ImportError as e:
        raise ConfigError(f"workers={config.workers} (-n) runs the cases in worker processes, which need the "
                          "'multiprocess' package. Fix: pip install \"tensorplay[testing]\", or drop -n") from e

    main_free_children()
    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    indexed = sorted(enumerate(cases), key=lambda ic: (ic[1].world_size, ic[0]))
    size = max(1, min(32, len(indexed) // (4 * config.workers) or 1))
    for i in range(0, len(indexed), size):
        tasks.put(indexed[i:i + size])
    n = min(config.workers, max(1, len(indexed) // size))
    for _ in range(n):
        tasks.put(None)
    procs = [ctx.Process(target=_worker_main, args=(config, tasks, results), name=f"conformance-worker{i}")
             for i in range(n)]
    for p in procs:
        p.start()
    got: dict[int, CaseResult] = {}
    finished = 0
    try:
        while finished < n:
            try:
                item = results.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break  # a worker died without saying goodbye
                continue
            if item is None:
                finished += 1
                continue
            idx, r = item
            got[idx] = r
            record(r)
    finally:
        for p in procs:
            p.join(0.0 if finished < n else 10.0)
            if p.is_alive():
                p.terminate()  # the worker unwinds and closes its rank processes
                p.join(10.0)
            if p.is_alive():
                p.kill()
    missing = [i for i in range(len(cases)) if i not in got]
    for i in missing:  # a worker died: say so rather than drop the cases
        r = CaseResult(cases[i], Verdict("error", "runs", "worker process died", ""), config.label)
        got[i] = r
        record(r)
    return [got[i] for i in range(len(cases))]
