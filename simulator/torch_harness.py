"""pytest plugin: PyTorch's own distributed test harness on simulated thread ranks, through one switch.

Suites written on ``torch.testing._internal.common_distributed.MultiProcessTestCase`` (and on its
subclasses: ``DTensorTestBase`` with ``@with_comms``, ``TestDistBackend`` with
``DistributedTest._DistTestBase``) start one real process per rank for every test.  With the switch
on, the processes such a test starts are ranks of a simulated world instead, threads of the pytest
process, and the suite itself is unmodified::

    python -m pytest -p simulator.torch_harness --sim-harness thread test_my_dtensor.py
    TENSORPLAY_SIM_HARNESS=thread python -m pytest -p simulator.torch_harness test_my_dtensor.py

Each test runs inside a launcher run (:mod:`simulator.launch`): ``_spawn_processes`` in ``setUp``
adds the ranks, the harness's first poll of ``Process.exitcode`` in ``_join_processes`` runs the
world to its end, and the launcher is finished when the test ends.  The harness's protocol is kept:
each rank's exit code (``TEST_ERROR_EXIT_CODE``, the ``TEST_SKIPS`` codes, which become unittest
skips), the pipe that carries a failing rank's traceback to the parent, ``world_size``, ``rank``,
``self.file_name`` (``init_process_group(init_method=f"file://{self.file_name}")`` and a
``FileStore`` on it bind to the simulated world), ``destroy_pg_upon_exit``.  What a process has of
its own, a rank has too, as far as these suites need: ``os.getpid()`` (the ``Process`` object's pid),
its own test-case object (``_run`` builds it on the rank), and ``distributed_test.Barrier``'s class
state; ``time.sleep`` on a rank lets the other ranks run (see :mod:`simulator.adapters.threads`).

The schedule's options are the simulator plugin's (:mod:`simulator.pytest_plugin`): ``--sim-seed``,
``--sim-mode``, ``--sim-timeout`` (default: torch's per-test timeout, ``get_timeout``) and
``--sim-stall-timeout`` (default 300 s).  ``--sim-harness process`` gives each rank a process of its own.
``MultiProcContinuousTest``'s workers are simulated ranks too, threads or rank processes as the switch says
(:mod:`simulator.torch_harness_continuous`).  Tests of torch's RPC test fixtures (``RpcAgentTestFixture``: they
test torch's own RPC agent) run on rank processes whatever the switch says, and the run says so; so does a test
that failed on thread ranks for a named reason of their sharing one process (it started torch's profiler on a rank,
or torch's module trackers saw the other ranks' modules): it runs again on rank processes, whose verdict is its.
A failed test's report ends with a section that says how it ran, how to replay it, the simulator's report when
it stopped the ranks itself (a timeout, a deadlock: torch's harness sees exit code 1 only), and, where the failure
is a known effect of ranks sharing one process, what to do instead.

Loading this module costs a session with the switch off nothing: it imports pytest (and the simulator's
light actor lookup) only, and torch and the rest of the simulator are imported when a test of the harness runs
with the switch on.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import traceback
from typing import Any, Iterator, NamedTuple

import pytest

from simulator.torch_harness_state import (NEEDS_A_PROCESS, classes_put_back, module_globals_put_back,
                                           no_pytest_log_handlers, one_profiler_per_process, own_class_state,
                                           patches_are_per_process, test_process_registries, torch_settings_put_back)

ENV = "TENSORPLAY_SIM_HARNESS"
_CHOICES = ("off", "thread", "process")
_HARNESS_MODULE = "torch.testing._internal.common_distributed"
#: torch's MultiProcessTestCase bounds a test at 300 s; a rank that waits that long without progress hangs
DEFAULT_STALL_TIMEOUT = 300.0
#: failures that come from ranks sharing one process, and why (the report names the fix; the test runs again on
#: rank processes)
_SHARED_PROCESS_SIGNS = (
    (("Module hierarchy tracking", "module hierarchy tracking", "comm_module_operation_counts"),
     "torch's module trackers (ModTracker, CommDebugMode's tracker, torch.utils.module_tracker) register their "
     "hooks for every module of the process; on thread ranks each rank's tracker sees the other ranks' modules"),
    (("the process-based async checkpointer keeps one background process per process",),
     "DCP's process-based async_save keeps one background checkpoint process per process (a module global): thread "
     "ranks would share one"),
)


#: how many of the tests moved to rank processes the end-of-run note names, for each reason
_NAMED = 10

#: test classes that run on rank processes under ``--sim-harness thread``: (module, class, why)
_PROCESS_ONLY = (
    ("torch.testing._internal.distributed.rpc.rpc_agent_test_fixture", "RpcAgentTestFixture",
     "torch's RPC test fixtures test torch's own RPC agent (TorchScript RPC, its RRef, autograd and profiler "
     "internals, its error texts), which the simulator's RPC on thread ranks stands in for but does not "
     "reproduce; a rank process runs torch's own agent"),
)


#: test classes that start no process: torch's LocalTensor tests run every rank in the test's own process (a "fake"
#: group, LocalTensorMode), so there is nothing to simulate
_ONE_PROCESS = (("torch.testing._internal.distributed._tensor.common_dtensor", "LocalDTensorTestBase"),
                ("torch.testing._internal.distributed._tensor.common_dtensor", "LocalDTensorContinuousTestBase"))


def _subclass_of_any(item: pytest.Item, bases: Any) -> bool:
    cls = getattr(item, "cls", None)
    return isinstance(cls, type) and any(isinstance(b, type) and issubclass(cls, b) for b in (
        getattr(sys.modules.get(module), name, None) for module, name, *_ in bases))


def _process_only(item: pytest.Item) -> str | None:
    """Why ``item`` runs on rank processes whatever the switch says, or None."""
    return next((why for module, name, why in _PROCESS_ONLY if _subclass_of_any(item, [(module, name)])), None)


def _message(call: str, problem: str, values: dict[str, Any], fix: str) -> str:
    """tensorplay.distributed.errors.format_message's layout, written here so that a usage error imports no torch."""
    return f"{call}: {problem}: " + ", ".join(f"{k}={v!r}" for k, v in values.items()) + f". Fix: {fix}"


class Settings(NamedTuple):
    """How the harness's tests run with the switch on."""

    seed: int
    mode: str
    timeout: float | None  # None: torch's per-test timeout (get_timeout)
    stall_timeout: float


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("simulator-harness", "PyTorch's MultiProcessTestCase on simulated ranks")
    group.addoption("--sim-harness", choices=_CHOICES, default=None,
                    help=f"thread: the processes MultiProcessTestCase tests start are simulated ranks (threads of "
                         f"this process); off: real processes (the default; the environment variable {ENV} sets it "
                         f"too); process: simulated ranks with a process each")


def switch(config: pytest.Config) -> str:
    """``off``, ``thread`` or ``process``: ``--sim-harness``, else ``$TENSORPLAY_SIM_HARNESS``, else off (raises for others)."""
    given = config.getoption("sim_harness", None)
    source = "--sim-harness"
    if given is None:
        given, source = (os.environ.get(ENV) or "off").strip().lower(), ENV
    if given not in _CHOICES:
        raise pytest.UsageError(_message(
            "simulator.torch_harness", f"{source} takes one of {', '.join(_CHOICES)}", {source: given},
            f"set {ENV}=thread to run MultiProcessTestCase ranks as simulated threads, or unset it"))
    return given


def pytest_configure(config: pytest.Config) -> None:
    isolation = switch(config)
    if isolation != "off":
        config.pluginmanager.register(_Harness(config, isolation), "simulator-torch-harness")


#: where a test's item keeps the simulator's reports of its worlds that failed (timeouts, deadlocks)
_WORLD_REPORTS = pytest.StashKey[list]()
_REPORT_CHARS = 6000


class _Harness:
    """The switch, on: tests of MultiProcessTestCase run their ranks on a simulated world."""

    def __init__(self, config: pytest.Config, isolation: str) -> None:
        self.config = config
        self.isolation = isolation
        seed = config.getoption("sim_seed", None)
        self.settings = Settings(
            seed=0 if seed is None else seed, mode=config.getoption("sim_mode", None) or "coop",
            timeout=config.getoption("sim_timeout", None),
            stall_timeout=config.getoption("sim_stall_timeout", None) or DEFAULT_STALL_TIMEOUT)
        self._undo_continuous: Any = None  # MultiProcContinuousTest's workers as thread ranks, once one runs
        self._moved: dict[str, str] = {}  # tests run on rank processes under --sim-harness thread -> why
        self._prestarted = False

    def pytest_collect_file(self, file_path: Any) -> None:
        """On rank processes, the first test file that uses torch's distributed test harness starts the warm
        interpreters of its ranks (each imports torch: seconds) while pytest imports the file and collects it."""
        if self.isolation != "process" or self._prestarted or file_path.suffix != ".py":
            return
        worker = hasattr(self.config, "workerinput")
        if (not worker and self.config.getoption("dist", "no") != "no") or self.config.getoption("collectonly"):
            return  # (pytest-xdist's controller runs no test: its workers start their own)
        try:
            text = file_path.read_text(errors="replace")
        except OSError:
            return
        if "torch.testing._internal" not in text or "distributed" not in text:
            return
        from simulator.core.hash_seeds import rank_envs  # (here: the plugin loads light; both import no torch)
        from simulator.isolation import warm  # (likewise)

        self._prestarted = True
        if warm.enabled():
            # the harness's worlds: this process's environment, each rank's hash seed; torch's harness makes worlds
            # of 4 ranks unless a class says otherwise (distributed_test.py: WORLD_SIZE)
            n = int(os.environ["WORLD_SIZE"]) if os.environ.get("WORLD_SIZE", "").isdigit() else 4
            warm.POOL.prestart(rank_envs(self.settings.seed, n, os.environ))

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self._undo_continuous is not None:
            self._undo_continuous()

    def pytest_report_header(self, config: pytest.Config) -> str:
        s = self.settings
        what = "threads of this process" if self.isolation == "thread" else "processes"
        return (f"simulator.torch_harness: MultiProcessTestCase ranks are simulated {what} (--sim-harness "
                f"{self.isolation}, seed={s.seed}, mode={s.mode})")

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        # MultiProcContinuousTest classes as their module made them, before the parent's setUpClass: what a worker
        # process, which imports the module afresh, sees of them (imported only then: a session without such a
        # class imports nothing more, so torch's own threaded tests run exactly as under plain pytest)
        classes = {item.cls for item in items if _is_continuous_test(item)}  # type: ignore[union-attr]
        if classes:
            from simulator import torch_harness_continuous  # (only here: see above)

            for cls in classes:
                torch_harness_continuous.remember_as_imported(cls)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Any:
        if _subclass_of_any(item, _ONE_PROCESS):
            return (yield)
        if self._undo_continuous is None and _is_continuous_test(item):
            # here, not at the top: it imports torch's harness (see the module's docstring)
            from simulator import torch_harness_continuous

            self._undo_continuous = torch_harness_continuous.install(
                sys.modules[_HARNESS_MODULE], self.settings, self.isolation,
                thread_only=functools.partial(_shared_process_reason, mode=self.settings.mode),
                moved=lambda test_id, why: self._moved.__setitem__(test_id, self._MOVED + why),
                before_processes=_hint_libraries)
        if not _is_harness_test(item):
            return (yield)
        isolation = self.isolation_of(item)
        with _simulated(item, self.settings, self.replay(item), isolation):
            result = yield
        why = _thread_only_failure(item, self.settings.mode) if isolation == "thread" else None
        if why is not None:
            # the failure is one of thread ranks sharing this process, named: the test's verdict is that of
            # ranks with a process each, as gloo's would be (the run's summary says which tests moved, and why)
            self._moved[item.nodeid] = self._MOVED + why
            item.__dict__.pop("_excinfo", None)  # (pytest's unittest item keeps the failures it reports here)
            with _simulated(item, self.settings, self.replay(item), "process"):
                item.runtest()
        return result

    _MOVED = "they failed on thread ranks first, for a reason of ranks sharing one process: "

    def isolation_of(self, item: pytest.Item) -> str:
        """The isolation ``item`` runs in: the switch's, or rank processes for the classes that need them and for
        tests that failed on thread ranks for a named reason of thread ranks sharing one process."""
        if item.nodeid in self._moved:
            return "process"
        if self.isolation == "thread":
            why = _process_only(item)
            if why is not None:
                self._moved[item.nodeid] = why
                return "process"
        return self.isolation

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self._moved:
            return
        for why in sorted(set(self._moved.values())):
            ids = [node for node, w in self._moved.items() if w == why]
            shown = ", ".join(ids[:_NAMED]) + (f", and {len(ids) - _NAMED} more" if len(ids) > _NAMED else "")
            terminalreporter.write_line(
                f"simulator.torch_harness: {len(ids)} test(s) ran on rank processes (as --sim-harness process) "
                f"although --sim-harness thread was asked for: {why}. The tests: {shown}")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report = yield
        if report.failed and call.when == "call" and (_is_harness_test(item) or
                                                      (_is_continuous_test(item) and self.isolation != "off")):
            report.sections.append(("simulated ranks (simulator.torch_harness)", self.explain(item, report)))
        return report

    def replay(self, item: pytest.Item) -> str:
        s = self.settings
        load = "" if self.config.pluginmanager.get_plugin(__name__) is None else f" -p {__name__}"
        return (f"python -m pytest '{item.nodeid}'{load} --sim-harness {self.isolation_of(item)} --sim-seed "
                f"{s.seed} --sim-mode {s.mode}")

    def explain(self, item: pytest.Item, report: pytest.TestReport) -> str:
        from simulator.core.errors import SimError  # (imports torch: see _simulated)

        s = self.settings
        isolation = self.isolation_of(item)
        what = "threads of this process" if isolation == "thread" else "processes"
        lines = [f"The ranks of this test ran as simulated {what} (seed={s.seed}, mode={s.mode}).",
                 (f"Replay: {self.replay(item)}" if s.mode == "coop" else
                  f"Rerun (--sim-mode threads runs free: not a replay of this schedule): {self.replay(item)}"),
                 f"On real processes: python -m pytest '{item.nodeid}' --sim-harness off"]
        for e in item.stash.get(_WORLD_REPORTS, ()):
            if isinstance(e, SimError):
                lines.append(f"The simulator's report ({type(e).__name__}):\n{str(e)[:_REPORT_CHARS]}")
            else:
                text = "".join(traceback.format_exception(e))[-_REPORT_CHARS:]
                lines.append(f"A rank ended with an exception that torch's harness does not catch (a process "
                             f"would print it and exit with code 1):\n{text}")
        text = report.longreprtext
        known = [why for signs, why in _SHARED_PROCESS_SIGNS if any(sign in text for sign in signs)]
        for why in known if isolation == "thread" else ():
            lines.append(f"This failure is a known effect of thread ranks sharing one process: {why}. Fix: run "
                         f"it with --sim-harness process (simulated ranks with a process each)")
        if isolation == "thread" and not known:
            # (what the plugin cannot see: a change a later rank undid, a C++ global, another library's singleton)
            lines.append("Thread ranks share this process: its module globals, torch's global settings and other "
                         "libraries' singletons. A test whose ranks each change one (a helper that shuffles a "
                         "module-level list in place, seeded) sees the other ranks' changes here and its own in a "
                         f"process. If the failure may be such a change: python -m pytest '{item.nodeid}' "
                         "--sim-harness process")
        return "\n".join(lines)


#: why any failure of free-running thread ranks is taken as one of ranks sharing a process
_FREE_RUNNING = ("free-running thread ranks (--sim-mode threads) share torch's random generator, so a rank's "
                 "seeded draws are interleaved with the other ranks', and, as every thread rank, the process's "
                 "module globals and settings: a failure there may be either")


def _thread_only_failure(item: pytest.Item, mode: str = "coop") -> str | None:
    """Why ``item`` failed on thread ranks because they share one process (a known, named reason), or None: then
    it runs again on rank processes, whose verdict is the test's."""
    failures = item.__dict__.get("_excinfo") or ()
    if not failures:
        return None
    why = item.stash.get(NEEDS_A_PROCESS, None)
    if why is not None:
        return why
    return _shared_process_reason("\n".join(str(f.value) for f in failures), mode)


def _shared_process_reason(text: str, mode: str = "coop") -> str | None:
    """Why the failure ``text`` of thread ranks is one of ranks sharing one process (a known sign; in threads mode,
    any failure: free-running ranks share torch's generator, each rank's own is swapped in only at coop's
    hand-offs), or None."""
    known = next((why for signs, why in _SHARED_PROCESS_SIGNS if any(sign in text for sign in signs)), None)
    return known or (_FREE_RUNNING if mode == "threads" else None)


def _is_harness_test(item: pytest.Item) -> bool:
    """A test method of a MultiProcessTestCase subclass (its module imported torch's harness already)."""
    harness = sys.modules.get(_HARNESS_MODULE)
    cls = getattr(item, "cls", None)
    return (harness is not None and isinstance(cls, type) and issubclass(cls, harness.MultiProcessTestCase)
            and not _subclass_of_any(item, _ONE_PROCESS))


def _is_continuous_test(item: pytest.Item) -> bool:
    """A test method of a MultiProcContinuousTest subclass (workers that live across the tests of a class)."""
    harness = sys.modules.get(_HARNESS_MODULE)
    cls = getattr(item, "cls", None)
    base = getattr(harness, "MultiProcContinuousTest", None)
    return base is not None and isinstance(cls, type) and issubclass(cls, base)


_hinted: set[str] = set()


def _hint_libraries() -> None:
    """Tell the warm interpreters which of torch's modules the rank processes will import: those this process
    imported with the test files (the ranks import the same files).  Each warm interpreter then imports them
    before its first fork, not after the first world, while the second test waits."""
    from simulator.isolation import child, warm  # (import torch: see _simulated)

    new = [n for n in list(sys.modules) if (n == "torch" or n.startswith("torch.")) and n not in _hinted]
    if new:
        _hinted.update(new)
        warm.POOL.hint(child.library_modules(new))


def _pytest_filters(item: pytest.Item) -> list[tuple]:
    """The warning filters pytest adds around ``item`` (its ``-W``, ``filterwarnings`` ini and marks, and its
    "always show deprecations"), as ``warnings.filterwarnings`` enters them: a process the test starts has none."""
    import re

    from _pytest.config import parse_warning_filter  # (pytest's own parser: its entries exactly)

    config = item.config
    args = [(a, False) for a in config.getini("filterwarnings")]
    args += [(a, True) for a in config.known_args_namespace.pythonwarnings or []]
    args += [(a, False) for mark in item.iter_markers(name="filterwarnings") for a in mark.args]
    out: list[tuple] = []
    if not sys.warnoptions:
        out += [("always", None, c, None, 0) for c in (DeprecationWarning, PendingDeprecationWarning)]
    for arg, escape in args:
        try:
            action, message, category, module, lineno = parse_warning_filter(arg, escape=escape)
        except Exception:  # noqa: BLE001  (pytest reported it already)
            continue
        out.append((action, re.compile(message, re.I) if message else None, category,
                    re.compile(module) if module else None, lineno))
    return out


def _started_process_state(item: pytest.Item) -> dict:
    """What each thread rank of ``item`` starts with of its own: a process's, not pytest's (see process_start)."""
    from simulator.adapters.per_rank_streams import process_start  # (imports torch: see the module's docstring)

    return process_start(_pytest_filters(item), lambda h: type(h).__module__.startswith("_pytest."))


@contextlib.contextmanager
def _simulated(item: pytest.Item, settings: Settings, replay: str, isolation: str) -> Iterator[None]:
    """One test as a launcher run: the processes it starts are ranks; the launcher is finished at its end."""
    import multiprocessing

    # here, not at the top, as the other imports of the simulator below: they import torch, and this plugin
    # loads at every pytest start-up (see the module's docstring)
    from simulator.core.progress import BoundNames
    from simulator.launch import _Launcher, patched  # (imports torch: see above)

    harness = sys.modules[_HARNESS_MODULE]
    if isolation == "process":
        _hint_libraries()
    timeout = settings.timeout
    if timeout is None:  # the harness's own bound on the test (300 s, or its TIMEOUT_OVERRIDE entry)
        timeout = float(harness.get_timeout(item.name))

    # a rank that exits with one of the harness's skip codes ends cleanly, as a process that exits does: the other
    # ranks go on (the simulator would release them with RankFailedError, as for a failed rank); the harness still
    # reads the code from Process.exitcode
    launcher = _Launcher(seed=settings.seed, mode=settings.mode, timeout=timeout,
                         stall_timeout=settings.stall_timeout, device="cpu", replay_hint=replay,
                         bound_names=BoundNames("--sim-timeout", "--sim-stall-timeout", " "), isolation=isolation,
                         clean_exit_codes=frozenset(skip.exit_code for skip in harness.TEST_SKIPS.values()))
    launcher.exit_codes = {harness.MultiProcessTestCase.TEST_ERROR_EXIT_CODE: (
        "torch's harness's code for a test that failed on this rank", "read that rank's own error, the test's failure")}
    launcher.own_torch_rpc = _process_only(item) is not None  # (torch's RPC fixtures test torch's own agent)
    launcher.rank_start = lambda: _started_process_state(item)
    default_ctx = multiprocessing.context._default_context  # type: ignore[attr-defined]
    saved_method = getattr(default_ctx, "_actual_context", None)
    hook = sys.excepthook
    try:
        per_process = ((own_class_state(), one_profiler_per_process(item), patches_are_per_process(item),
                        test_process_registries(), no_pytest_log_handlers(), classes_put_back(item),
                        module_globals_put_back(item),
                        torch_settings_put_back())
                       if isolation == "thread" else ())
        with patched(launcher, hint=f"python -m pytest '{item.nodeid}' --sim-harness off"), \
                contextlib.ExitStack() as stack:
            for cm in per_process:  # (rank processes have these of their own)
                stack.enter_context(cm)
            try:
                yield
            finally:
                launcher.finish()  # ranks started and never joined run now, as a process joins its children
                # the simulator's own reports (a timeout, a deadlock: who waited where) reach torch's harness as exit
                # code 1 only; the test's report shows them (see _Harness.explain)
                # (a rank's exit with sys.exit is its exit code, as for a process; what else escaped a rank's
                # target, a BaseException torch's harness does not catch, multiprocessing would print: shown too)
                # (a rank that exited with one of the harness's own codes: its traceback is the test's failure)
                item.stash[_WORLD_REPORTS] = [e for e in launcher.failures if not isinstance(e, SystemExit)
                                              and getattr(e, "exit_code", None) not in launcher.exit_codes]
    finally:
        sys.excepthook = hook
        if hasattr(default_ctx, "_actual_context"):
            default_ctx._actual_context = saved_method  # _spawn_processes' set_start_method belongs to this test
