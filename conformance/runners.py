"""Runners: where a case's ranks actually run.

=============  ==============================================================
``sim``        in-process, one thread per rank, via ``simulator.run`` (CPU or CUDA tensors)
``gloo``       a persistent :class:`~tensorplay.testing.RankPool` of real rank
               processes on loopback per world size, reused across cases
``nccl``       the same with the nccl backend, one GPU per rank (needs >= 2 GPUs)
=============  ==============================================================

Every runner executes :func:`conformance.execute.run_case` on every rank of
the world and hands back each rank's :class:`~conformance.execute.RankOutcome`.
A runner never lets a case hang: each case is bounded by ``timeout``; the
process runners then kill and restart their ranks (the survivors may be stuck
in a collective the others never joined) and report the case as timed out.

A case the runner cannot run here (no GPU, too few GPUs) comes back with a
skip reason from :meth:`Runner.skip_reason` instead.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .cases import Case
from .execute import DEFAULT_IMPL, RankOutcome, default_dist_module, run_case

__all__ = ["BACKENDS", "DEVICES", "MAIN_FREE_PREFIXES", "RunnerError", "runner_label", "Runner", "RunReport", "SimRunner",
           "PoolRunner", "main_free_children", "make_runner", "refuse_while_bootstrapping", "validate_backend_device"]

BACKENDS = ("sim", "gloo", "nccl")
DEVICES = ("cpu", "cuda")
#: per-case bound, seconds: legitimate cases take milliseconds
DEFAULT_TIMEOUT = {"sim": 10.0, "gloo": 10.0, "nccl": 60.0}


def runner_label(backend: str, device: str, isolation: str = "thread") -> str:
    """How results name where they ran: ``sim/cpu``, ``sim-process/cpu``, ``gloo/cpu``, ``nccl/cuda``."""
    return f"{backend}{'-process' if isolation == 'process' else ''}/{device}"


class RunnerError(ValueError):
    """A backend/device/impl combination that cannot work, with the fix."""


@dataclass
class RunReport:
    """What a runner observed for one case: each rank's outcome (by global rank) and how it ended."""

    outcomes: dict[int, RankOutcome] = field(default_factory=dict)
    timed_out: bool = False
    note: str = ""
    skipped: str = ""
    #: the runner itself could not run the case (no simulator, ranks that do not start): not the impl's fault
    error: str = ""
    seconds: float = 0.0


def validate_backend_device(backend: str, device: str, impl: str, dist_module: str | None,
                            known_only: bool = True) -> None:
    """Raise :class:`RunnerError` (name=value, then the fix) for combinations that cannot run.

    ``known_only=False`` lets a process runner start ranks on a backend registered elsewhere.
    """
    if known_only and backend not in BACKENDS:
        raise RunnerError(f"backend={backend!r} is unknown; use one of {', '.join(BACKENDS)}")
    if device not in DEVICES:
        raise RunnerError(f"device={device!r} is unknown; use one of {', '.join(DEVICES)}")
    if backend == "gloo" and device != "cpu":
        raise RunnerError(f"backend=gloo with device={device!r}: the gloo runner uses CPU tensors; "
                          "use --backend nccl (or --backend sim) for --device cuda")
    if backend == "nccl" and device != "cuda":
        raise RunnerError(f"backend=nccl with device={device!r}: nccl runs CUDA tensors; pass --device cuda")
    dm = dist_module or default_dist_module(impl)
    if backend == "sim" and dm == "torch.distributed":
        raise RunnerError(f"backend=sim with impl={impl!r}: that module calls torch.distributed, which the simulator "
                          "does not initialise; use --backend gloo, or pass an implementation built on "
                          "tensorplay.distributed")


class Runner:
    """Runs cases; subclasses say where."""

    backend = "?"
    isolation = "thread"  # how the ranks are isolated from each other (the simulator can also use processes)

    def __init__(self, *, device: str = "cpu", impl: str = DEFAULT_IMPL, dist_module: str | None = None,
                 timeout: float | None = None) -> None:
        validate_backend_device(self.backend, device, impl, dist_module, known_only=self.backend == "sim")
        self.device = device
        self.impl = impl
        self.dist_module = dist_module or default_dist_module(impl)
        self.timeout = DEFAULT_TIMEOUT.get(self.backend, 10.0) if timeout is None else float(timeout)

    @property
    def label(self) -> str:
        return runner_label(self.backend, self.device, self.isolation)

    def skip_reason(self, case: Case) -> str:
        """Empty when ``case`` can run here, else why not."""
        if self.device == "cuda" and not torch.cuda.is_available():
            return "no CUDA device on this machine (torch.cuda.is_available() is False)"
        return ""

    def run(self, case: Case) -> RunReport:
        why = self.skip_reason(case)
        if why:
            return RunReport(skipped=why)
        t0 = time.perf_counter()
        rep = self._run(case)
        rep.seconds = time.perf_counter() - t0
        return rep

    def _run(self, case: Case) -> RunReport:  # pragma: no cover - abstract
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SimRunner(Runner):
    """Every case in a fresh simulated world (threads in this process, or rank processes).

    With ``isolation="process"`` every rank runs in its own process; the rank processes' hash seeds derive
    from the suite's seed (``hash_seed``), not the case's, so the cases share warm rank interpreters while
    each case's seed still picks its schedule.
    """

    backend = "sim"
    _warm = False

    def __init__(self, *, isolation: str = "thread", suite_seed: int = 0, **kw: Any) -> None:
        super().__init__(**kw)
        self.isolation = isolation
        self.suite_seed = suite_seed

    def _run(self, case: Case) -> RunReport:
        try:
            import simulator
        except ImportError as e:
            return RunReport(error=f"the simulator cannot be imported: {e}")
        if not self._warm:
            # the first simulated world of a process sets the simulator up (seconds on a loaded machine): do it
            # once, outside the per-case bound, so that the first case is not reported as timed out
            self._warm = True
            try:
                simulator.run(functools.partial(_warm_up, self.impl, self.dist_module), 1, timeout=120.0,
                              **self._isolated())
            except BaseException:  # noqa: BLE001  whatever fails here fails again in the case, and is reported there
                pass
        fn = functools.partial(run_case, case, self.impl, self.dist_module, self.device, 0)
        try:
            results = simulator.run(fn, case.world_size, seed=case.seed, timeout=self.timeout, device=self.device,
                                    **self._isolated())
        except BaseException as e:  # noqa: BLE001  the simulator's own report (deadlock, timeout) is the finding
            timed_out = "timeout" in type(e).__name__.lower() or isinstance(e, TimeoutError)
            return RunReport(timed_out=timed_out, note=f"simulator.run raised {type(e).__name__}: {e}")
        outcomes = {}
        for r, o in enumerate(results):
            if isinstance(o, RankOutcome):
                outcomes[o.rank if o.rank >= 0 else r] = o
        return RunReport(outcomes=outcomes)


    def _isolated(self) -> dict[str, Any]:
        return {"isolation": "process", "hash_seed": self.suite_seed} if self.isolation == "process" else {}


def _warm_up(impl: str, dist_module: str) -> str:
    """Import what every case needs on a rank (never raises: a broken import is the cases' finding)."""
    from .execute import load_module

    try:
        load_module(dist_module)
        load_module(impl)
    except BaseException as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return ""


def _probe() -> float:
    """A world all-reduce through torch's default group: proves the ranks still agree on their collectives."""
    import torch.distributed as tdist

    t = torch.ones(1)
    tdist.all_reduce(t)
    return t.item()


class PoolRunner(Runner):
    """Cases on real rank processes: one persistent pool per world size (gloo on CPU, nccl on GPUs).

    ``backend`` is the name each rank passes to ``tensorplay.distributed.init_process_group``:
    ``"gloo"``, ``"nccl"``, or a backend you registered yourself (register it when the module
    that defines it is imported, and name that module in ``impl`` or ``dist_module``).
    """

    backend = "gloo"
    #: after one rank failed, how long the others may still take before they count as stuck
    grace = 1.0

    def __init__(self, *, backend: str = "gloo", **kwargs: Any) -> None:
        self.backend = backend
        super().__init__(**kwargs)
        self._pools: dict[int, Any] = {}
        self._generation = 0
        self.restarts = 0
        self.start_seconds = 0.0

    def skip_reason(self, case: Case) -> str:
        why = super().skip_reason(case)
        if why:
            return why
        if self.backend == "nccl":
            n = torch.cuda.device_count()
            if n < 2:
                return f"nccl needs at least 2 GPUs; this machine has {n}"
            if case.world_size > n:
                return f"world size {case.world_size} needs {case.world_size} GPUs for nccl; this machine has {n}"
        return ""

    def _pool(self, w: int) -> Any:
        main_free_children()
        pool = self._pools.get(w)
        if pool is None:
            pool = _CasePool(w, self.backend, call_timeout=self.timeout, pg_timeout=max(60.0, 4 * self.timeout))
            self._pools[w] = pool
        if not pool.alive:
            t0 = time.perf_counter()
            pool.start()
            # the first call of fresh ranks imports the implementation: do it now, under the start-up bound,
            # so that a loaded machine does not turn the first case of every world into "timed out"
            pool.gather(_warm_up, [(self.impl, self.dist_module)] * w, timeout=pool.start_timeout, grace=1.0,
                        is_failure=_is_failure)
            self.start_seconds += time.perf_counter() - t0
        return pool

    def _run(self, case: Case) -> RunReport:
        w = case.world_size
        try:
            pool = self._pool(w)
        except Exception as e:  # noqa: BLE001
            return RunReport(error=f"the {self.backend} ranks did not start: {type(e).__name__}: {e}")
        args = (case, self.impl, self.dist_module, self.device, self._generation)
        replies, complete = pool.gather(run_case, [args] * w, timeout=self.timeout, grace=self.grace,
                                         is_failure=_is_failure)
        outcomes: dict[int, RankOutcome] = {}
        notes = []
        for r, (kind, value) in sorted(replies.items()):
            if kind == "ok" and isinstance(value, RankOutcome):
                outcomes[r] = value
            else:
                # the worker itself failed (not the case): keep its words
                tname, text, _tb = value if isinstance(value, tuple) and len(value) == 3 else ("?", str(value), "")
                outcomes[r] = RankOutcome(rank=r, stage="runner", error_type=tname, error=text)
        if not complete:
            self.restarts += 1
            self._generation += 1
            notes.append(f"the {self.backend} ranks were killed and restarted after the timeout of {self.timeout:g}s")
            return RunReport(outcomes=outcomes, timed_out=True, note="; ".join(notes))
        if any(o.failed for o in outcomes.values()):
            # every rank answered, but some failed half-way: make sure the world still agrees
            self._generation += 1
            probe, ok = pool.gather(_probe, [()] * w, timeout=min(self.timeout, 5.0), grace=0.5,
                                     is_failure=_is_failure)
            if not ok or any(k != "ok" or v != float(w) for k, v in probe.values()):
                self.restarts += 1
                pool.kill()
        return RunReport(outcomes=outcomes, note="; ".join(notes))

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


#: the suite's own processes (rank processes, ``-n`` workers) are named with these prefixes
MAIN_FREE_PREFIXES = ("conformance-rank", "conformance-worker")
_MAIN_FREE_LOCK = threading.Lock()


def main_free_children() -> None:
    """Start the suite's own processes without re-running the parent's main script.

    A spawn or forkserver child of ``multiprocess`` first re-executes the
    parent's ``__main__`` module (as ``__mp_main__``) so that functions defined
    there can be unpickled.  A script that calls ``conformance.check(...)`` at
    top level, without an ``if __name__ == "__main__":`` guard, would then run
    the whole suite again inside every rank process, which cannot start
    processes of its own while it bootstraps: every rank dies, every case
    restarts the ranks, and the run crawls for many minutes.  Nothing the suite
    sends its processes lives in ``__main__`` (targets, cases and configs are
    importable; the implementation is loaded by name or path), so for
    processes named with :data:`MAIN_FREE_PREFIXES` the preparation data
    leaves the main module out.  Other processes are not affected.
    """
    from multiprocess import spawn

    with _MAIN_FREE_LOCK:
        if getattr(spawn.get_preparation_data, "_conformance_main_free", False):
            return
        original = spawn.get_preparation_data

        def get_preparation_data(name: str) -> dict[str, Any]:
            data = original(name)
            if isinstance(name, str) and name.startswith(MAIN_FREE_PREFIXES):
                data.pop("init_main_from_path", None)
                data.pop("init_main_from_name", None)
            return data

        get_preparation_data._conformance_main_free = True  # type: ignore[attr-defined]
        spawn.get_preparation_data = get_preparation_data


def refuse_while_bootstrapping(call: str) -> None:
    """Raise :class:`RunnerError` at once when this process is a multiprocessing child still importing
    the main script (the script was run again by a child the *caller* started, and its top-level code
    reached ``call``); starting processes from there can only fail, and would fail obscurely."""
    for name in ("multiprocessing.process", "multiprocess.process"):
        mod = sys.modules.get(name)
        if mod is None or not getattr(mod.current_process(), "_inheriting", False):
            continue
        main = sys.modules.get("__main__")
        path = getattr(main, "__file__", None) or getattr(getattr(main, "__spec__", None), "name", "the main module")
        raise RunnerError(
            f"{call} was called while this process (pid {os.getpid()}) is a {name.split('.')[0]} child process "
            f"re-running the main script to start up (main={path!r}); it cannot start the suite's processes from "
            f"there. Fix: put the call under `if __name__ == \"__main__\":` in {path}, so that child processes "
            f"importing it do not run it")


_FORKSERVER: list[Any] = []


def _forkserver() -> Any:
    """The multiprocess forkserver context, preloading torch and tensorplay (``None`` where unavailable)."""
    if not _FORKSERVER:
        import multiprocess as mp

        main_free_children()
        ctx = None
        if "forkserver" in mp.get_all_start_methods():
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(["torch", "torch.distributed", "tensorplay.distributed",
                                        "tensorplay.testing.pool", "conformance.execute"])
        _FORKSERVER.append(ctx)
    return _FORKSERVER[0]


def _case_pool(world_size: int, backend: str, *, call_timeout: float, pg_timeout: float) -> Any:
    """The suite's RankPool: ranks named ``conformance-rank<r>`` (main-free children), forked from a server that
    imported torch once where the platform has one (the suite restarts its ranks after every hung case; a
    spawned rank spends seconds importing torch, a forked one about 0.05 s)."""
    from tensorplay.testing import RankPool

    return RankPool(world_size, backend, call_timeout=call_timeout, pg_timeout=pg_timeout,
                    process_name="conformance-rank", context=_forkserver)


def _is_failure(reply: tuple[str, Any]) -> bool:
    kind, value = reply
    return kind == "err" or (isinstance(value, RankOutcome) and value.failed)


_CasePool = _case_pool


def make_runner(backend: str = "sim", device: str = "cpu", impl: str = DEFAULT_IMPL, dist_module: str | None = None,
                timeout: float | None = None, *, isolation: str = "thread", seed: int = 0) -> Runner:
    """The runner for ``backend``/``device`` (raises :class:`RunnerError` for impossible combinations).

    ``isolation`` (sim only): ``"process"`` runs each rank in its own process; ``seed`` is the suite's.
    """
    validate_backend_device(backend, device, impl, dist_module)
    if backend == "sim":
        return SimRunner(device=device, impl=impl, dist_module=dist_module, timeout=timeout, isolation=isolation,
                         suite_seed=seed)
    if isolation != "thread":
        raise RunnerError(f"isolation={isolation!r} with backend={backend!r}: only the simulator has an isolation "
                          "option (gloo and nccl ranks are processes already)")
    return PoolRunner(backend=backend, device=device, impl=impl, dist_module=dist_module, timeout=timeout)
