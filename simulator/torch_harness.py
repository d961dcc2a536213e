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
import os
import sys
import threading
import unittest
from typing import Any, Iterator, NamedTuple

import pytest

from simulator.core._actor import current_rank_state  # (light: no torch)

ENV = "TENSORPLAY_SIM_HARNESS"
_CHOICES = ("off", "thread", "process")
_HARNESS_MODULE = "torch.testing._internal.common_distributed"
_DIST_TEST_MODULE = "torch.testing._internal.distributed.distributed_test"
#: torch's MultiProcessTestCase bounds a test at 300 s; a rank that waits that long without progress hangs
DEFAULT_STALL_TIMEOUT = 300.0
#: why a test that starts torch's profiler on a rank runs on rank processes under --sim-harness thread
PROFILER_WHY = ("torch's profiler is one per process (each thread rank's would record the other ranks' operations, "
                "and a second rank's start or stop crashes the process); the test started it on a rank")
#: why a test whose ranks patched with unittest.mock, then failed on thread ranks, runs on rank processes
PATCH_WHY = ("unittest.mock's patch, and torch's test helpers that patch by assignment (common_fsdp.patch_*), set an "
             "attribute of the one process (each thread rank's patch is every rank's, and the ranks' exits, not "
             "last-in first-out, can leave a mock in place); the test patched on a rank")
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


#: set on a test's item when one of its thread ranks needed a process of its own (why): see _thread_only_failure
_NEEDS_A_PROCESS = pytest.StashKey[str]()
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

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        if self._undo_continuous is not None:
            self._undo_continuous()

    def pytest_report_header(self, config: pytest.Config) -> str:
        s = self.settings
        what = "threads of this process" if self.isolation == "thread" else "processes"
        return (f"simulator.torch_harness: MultiProcessTestCase ranks are simulated {what} (--sim-harness "
                f"{self.isolation}, seed={s.seed}, mode={s.mode})")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Any:
        if _subclass_of_any(item, _ONE_PROCESS):
            return (yield)
        if self._undo_continuous is None and _is_continuous_test(item):
            # here, not at the top: it imports torch's harness (see the module's docstring)
            from simulator import torch_harness_continuous

            self._undo_continuous = torch_harness_continuous.install(sys.modules[_HARNESS_MODULE], self.settings,
                                                                     self.isolation)
        if not _is_harness_test(item):
            return (yield)
        isolation = self.isolation_of(item)
        with _simulated(item, self.settings, self.replay(item), isolation):
            result = yield
        why = _thread_only_failure(item) if isolation == "thread" else None
        if why is not None:
            # the failure is one of thread ranks sharing this process, named: the test's verdict is that of
            # ranks with a process each, as gloo's would be (the run's summary says which tests moved, and why)
            self._moved[item.nodeid] = ("they failed on thread ranks first, for a reason of ranks sharing one "
                                        f"process: {why}")
            item.__dict__.pop("_excinfo", None)  # (pytest's unittest item keeps the failures it reports here)
            with _simulated(item, self.settings, self.replay(item), "process"):
                item.runtest()
        return result

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
            n = sum(1 for w in self._moved.values() if w == why)
            terminalreporter.write_line(
                f"simulator.torch_harness: {n} test(s) ran on rank processes (as --sim-harness process) although "
                f"--sim-harness thread was asked for: {why}")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report = yield
        if report.failed and call.when == "call" and _is_harness_test(item):
            report.sections.append(("simulated ranks (simulator.torch_harness)", self.explain(item, report)))
        return report

    def replay(self, item: pytest.Item) -> str:
        s = self.settings
        load = "" if self.config.pluginmanager.get_plugin(__name__) is None else f" -p {__name__}"
        return (f"python -m pytest '{item.nodeid}'{load} --sim-harness {self.isolation_of(item)} --sim-seed "
                f"{s.seed} --sim-mode {s.mode}")

    def explain(self, item: pytest.Item, report: pytest.TestReport) -> str:
        s = self.settings
        isolation = self.isolation_of(item)
        what = "threads of this process" if isolation == "thread" else "processes"
        lines = [f"The ranks of this test ran as simulated {what} (seed={s.seed}, mode={s.mode}).",
                 f"Replay: {self.replay(item)}",
                 f"On real processes: python -m pytest '{item.nodeid}' --sim-harness off"]
        for e in item.stash.get(_WORLD_REPORTS, ()):
            lines.append(f"The simulator's report ({type(e).__name__}):\n{str(e)[:_REPORT_CHARS]}")
        text = report.longreprtext
        for signs, why in _SHARED_PROCESS_SIGNS:
            if isolation == "thread" and any(sign in text for sign in signs):
                lines.append(f"This failure is a known effect of thread ranks sharing one process: {why}. Fix: run "
                             f"it with --sim-harness process (simulated ranks with a process each)")
        return "\n".join(lines)


def _thread_only_failure(item: pytest.Item) -> str | None:
    """Why ``item`` failed on thread ranks because they share one process (a known, named reason), or None: then
    it runs again on rank processes, whose verdict is the test's."""
    failures = item.__dict__.get("_excinfo") or ()
    if not failures:
        return None
    why = item.stash.get(_NEEDS_A_PROCESS, None)
    if why is not None:
        return why
    text = "\n".join(str(f.value) for f in failures)
    return next((why for signs, why in _SHARED_PROCESS_SIGNS if any(sign in text for sign in signs)), None)


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


@contextlib.contextmanager
def _simulated(item: pytest.Item, settings: Settings, replay: str, isolation: str) -> Iterator[None]:
    """One test as a launcher run: the processes it starts are ranks; the launcher is finished at its end."""
    import multiprocessing

    # here, not at the top, as the other imports of the simulator below: they import torch, and this plugin
    # loads at every pytest start-up (see the module's docstring)
    from simulator.core.progress import BoundNames
    from simulator.core.errors import SimError  # (imports torch: see above)
    from simulator.launch import _Launcher, patched  # (imports torch: see above)

    harness = sys.modules[_HARNESS_MODULE]
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
    default_ctx = multiprocessing.context._default_context  # type: ignore[attr-defined]
    saved_method = getattr(default_ctx, "_actual_context", None)
    hook = sys.excepthook
    try:
        per_process = ((_own_class_state(), _one_profiler_per_process(item), _patches_are_per_process(item),
                        _test_process_registries(), _no_pytest_log_handlers(), _classes_put_back(item))
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
                item.stash[_WORLD_REPORTS] = [e for e in launcher.failures if isinstance(e, SimError)]
    finally:
        sys.excepthook = hook
        if hasattr(default_ctx, "_actual_context"):
            default_ctx._actual_context = saved_method  # _spawn_processes' set_start_method belongs to this test


# ---------------------------------------------------------------------------------------------------------------
# class state a process has of its own
# ---------------------------------------------------------------------------------------------------------------
class _PerRankClass:
    """Stands for a class in its module: each rank sees a subclass of its own, so that class attributes the rank
    sets are its own, as in a spawned process that imported the module afresh (the parent sees the class).

    ``distributed_test.Barrier`` counts barriers in ``Barrier.barrier_id``: shared by thread ranks, every rank's
    increment would count for all of them and no rank would ever see the others arrive.
    """

    def __init__(self, cls: type) -> None:
        object.__setattr__(self, "_tp_cls", cls)
        object.__setattr__(self, "_tp_copies", {})

    def _tp_mine(self) -> type:
        rs = current_rank_state()
        cls: type = object.__getattribute__(self, "_tp_cls")
        if rs is None:
            return cls
        root = rs.parent or rs  # a rank's threads share its process
        copies: dict[Any, type] = object.__getattribute__(self, "_tp_copies")
        mine = copies.get(root)
        if mine is None:
            mine = copies[root] = type(cls.__name__, (cls,), {"__module__": cls.__module__,
                                                              "__qualname__": cls.__qualname__})
        return mine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tp_mine(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._tp_mine(), name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tp_mine()(*args, **kwargs)


#: (module, class) pairs whose class state each rank process has of its own
_PER_RANK_CLASSES = ((_DIST_TEST_MODULE, "Barrier"),)
#: torch.nn's process-wide module hooks (register_module_forward_hook & co, which ModTracker and CommDebugMode use)
_MODULE_HOOK_TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
                       "_global_forward_hooks_with_kwargs", "_global_backward_pre_hooks", "_global_backward_hooks")


def _device_type_tls() -> Any:
    """``DeviceTypeTestBase._tls`` as each process makes it at import: a thread-local whose importing thread holds
    the default precision (instantiate_device_type_tests' classes read it on the thread that runs the test)."""
    from torch.testing._internal.common_utils import TestCase

    class _ImportedTls(threading.local):
        def __init__(self) -> None:
            self.precision = TestCase._precision
            self.rel_tol = TestCase._rel_tol

    return _ImportedTls()


@contextlib.contextmanager
def _test_process_registries() -> Iterator[None]:
    """What a test's processes register process-wide is their own and ends with them: torch's backend registry
    (``Backend.register_backend``) is one per rank while a test runs on thread ranks, and it and c10d's debug level
    are put back as they were after the test, so the next test sees what fresh processes see."""
    import torch.distributed as tdist  # (imports torch: see _simulated)

    from simulator.adapters.per_rank_state import PerRankDict, PerRankList  # (imports torch: see _simulated)

    b = tdist.Backend
    tables = {name: getattr(b, name) for name in ("_plugins", "backend_list", "default_device_backend_map",
                                                   "backend_capability", "backend_type_map")}
    copies = {name: type(t)(t) for name, t in tables.items()}
    attrs, level = set(vars(b)), tdist.get_debug_level()
    for name, t in tables.items():  # while the test runs, each rank registers in a copy of its own
        setattr(b, name, (PerRankList if isinstance(t, list) else PerRankDict)(t))
    try:
        yield
    finally:
        for name, t in tables.items():
            setattr(b, name, t)
            t.clear()  # (in place: torch's functions hold these objects)
            if isinstance(t, list):
                t.extend(copies[name])
            else:
                t.update(copies[name])
        for name in set(vars(b)) - attrs:  # register_backend's Backend.<NAME> = "<name>"
            delattr(b, name)
        tdist.set_debug_level(level)


@contextlib.contextmanager
def _no_pytest_log_handlers() -> Iterator[None]:
    """A rank process's loggers have the handlers its own imports gave them.  pytest's logging plugin attaches its
    capture handlers (``_pytest.logging``'s) to every logger that does not propagate, in this process: torch's
    ``c10d-NullHandler-default``, which torch's ``test_c10d_logger.py`` expects to hold its one ``NullHandler``,
    showed thread ranks 5.  While a test's ranks are threads of this process, such loggers hold none of pytest's
    handlers; they get them back after the test (the root logger keeps pytest's: the report still shows what the
    ranks logged there)."""
    import logging

    taken: list[tuple[logging.Logger, logging.Handler]] = []
    for logger in list(logging.root.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger) and not logger.propagate:
            for handler in list(logger.handlers):
                if type(handler).__module__ == "_pytest.logging":
                    logger.removeHandler(handler)
                    taken.append((logger, handler))
    try:
        yield
    finally:
        for logger, handler in taken:  # (before pytest's own exit takes them off again: this wrapper is inner)
            logger.addHandler(handler)


@contextlib.contextmanager
def _own_class_state() -> Iterator[None]:
    """What each rank process has of its own, per thread rank: the classes above, the module hooks, the device-type
    tests' thread-local precision."""
    from simulator.adapters.per_rank_state import PerRankTable  # (imports torch: see _simulated)

    saved: list[tuple[Any, str, Any]] = []
    for mod_name, name in _PER_RANK_CLASSES:
        mod = sys.modules.get(mod_name)
        cls = getattr(mod, name, None) if mod is not None else None
        if isinstance(cls, type):
            saved.append((mod, name, cls))
            setattr(mod, name, _PerRankClass(cls))
    nn_module = sys.modules["torch.nn.modules.module"]
    for name in _MODULE_HOOK_TABLES:
        table = getattr(nn_module, name, None)
        if isinstance(table, dict):
            saved.append((nn_module, name, table))
            setattr(nn_module, name, PerRankTable(table, lambda key: True))
    device_type = sys.modules.get("torch.testing._internal.common_device_type")
    if device_type is not None:
        base = device_type.DeviceTypeTestBase
        saved.append((base, "_tls", base.__dict__["_tls"]))
        base._tls = _device_type_tls()
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


@contextlib.contextmanager
def _classes_put_back(item: pytest.Item) -> Iterator[None]:
    """A test's thread ranks that set or delete an attribute of a class of the test's module or of torch's test
    helpers (``UnitModule.get_extra_state = ...``, PyTorch's ``checkpoint/test_state_dict.py``) changed it for
    every later test of the session; each test's rank processes start from the classes as imported. When the test
    ends, those classes are as they were before it."""
    modules = [getattr(item, "module", None)] + [m for n, m in list(sys.modules.items())
                                                   if n.startswith("torch.testing._internal.")]
    # (not the test classes: the harness keeps its own state on them, a continuous test's worker pool included)
    classes = [c for m in modules if m is not None for c in vars(m).values()
               if isinstance(c, type) and c.__module__ == getattr(m, "__name__", None)
               and not issubclass(c, unittest.TestCase)]
    before = [dict(vars(c)) for c in classes]
    try:
        yield
    finally:
        for c, was in zip(classes, before):
            now = dict(vars(c))
            for name in now.keys() | was.keys():
                _put_back(c, name, was.get(name, _MISSING), now.get(name, _MISSING))


#: an attribute that was not there
_MISSING = object()


def _put_back(owner: Any, name: str, was: Any, now: Any) -> None:
    """``owner.name`` as it ``was`` (:data:`_MISSING`: absent), where it is ``now``."""
    with contextlib.suppress(AttributeError, TypeError):  # (a built-in type's attributes cannot be set)
        if was is _MISSING:
            if now is not _MISSING:
                delattr(owner, name)
        elif now is not was:
            setattr(owner, name, was)


def _torch_test_patchers() -> set[Any]:
    """The code of torch's test helpers that patch by plain assignment (``common_fsdp.patch_all_gather``,
    ``patch_register_post_backward_hook_backward``, ...: each rank assigns its own closure between two barriers)."""
    fsdp = sys.modules.get("torch.testing._internal.common_fsdp")
    helpers = [getattr(fsdp, n) for n in dir(fsdp) if n.startswith("patch_")] if fsdp is not None else []
    return {h.__wrapped__.__code__ for h in helpers if hasattr(getattr(h, "__wrapped__", None), "__code__")}


@contextlib.contextmanager
def _patches_are_per_process(item: pytest.Item) -> Iterator[None]:
    """A rank entering ``unittest.mock.patch`` (or one of torch's test helpers that patch by assignment) marks the
    test: patching is per process, so if the test then fails on thread ranks it runs again on rank processes,
    where each rank patches its own (one that passes stands)."""
    from unittest import mock

    patchers = _torch_test_patchers()
    # (test modules bind torch's helpers by name at import: their entry is seen where every @contextmanager enters)
    enter_cm = contextlib._GeneratorContextManager.__enter__

    def enter_helper(self: Any) -> Any:
        if getattr(self.gen, "gi_code", None) in patchers and current_rank_state() is not None:
            item.stash[_NEEDS_A_PROCESS] = PATCH_WHY
        return enter_cm(self)

    if patchers:
        contextlib._GeneratorContextManager.__enter__ = enter_helper  # type: ignore[method-assign]
    original = mock._patch.__enter__
    before: dict[tuple[int, str], tuple[Any, str, Any]] = {}  # what each patched attribute was before any rank's patch

    def __enter__(self: Any) -> Any:
        if current_rank_state() is not None:
            item.stash[_NEEDS_A_PROCESS] = PATCH_WHY
            target = self.getter()
            before.setdefault((id(target), self.attribute),
                              (target, self.attribute, target.__dict__.get(self.attribute, _MISSING)
                               if hasattr(target, "__dict__") else getattr(target, self.attribute, _MISSING)))
        return original(self)

    mock._patch.__enter__ = __enter__  # type: ignore[method-assign]
    try:
        yield
    finally:
        mock._patch.__enter__ = original  # type: ignore[method-assign]
        contextlib._GeneratorContextManager.__enter__ = enter_cm  # type: ignore[method-assign]
        # the ranks' exits, in no particular order, may each have restored another rank's mock: the attributes
        # are as they were before the test's ranks patched them, as after processes that patched their own
        for target, attribute, value in before.values():
            _put_back(target, attribute, value, getattr(target, attribute, _MISSING))


@contextlib.contextmanager
def _one_profiler_per_process(item: pytest.Item) -> Iterator[None]:
    """torch's profiler (``torch.autograd.profiler.profile``, ``torch.profiler.profile``) is one per process: on
    thread ranks each rank's would record every rank's operations, and a second rank's start or stop crashes the
    process (a segmentation fault in ``_disable_profiler``).  Starting one on a rank fails instead, naming the fix,
    and marks the test, which then runs again on rank processes (see :func:`_thread_only_failure`).
    """
    nodeid = item.nodeid
    import torch.autograd.profiler as autograd_profiler

    from tensorplay.distributed.errors import format_message  # (imports torch: see _simulated)

    from simulator.core.errors import SimError  # (imports torch: see _simulated)

    cls = autograd_profiler.profile
    original = cls.__dict__["_prepare_trace"]

    def _prepare_trace(self: Any) -> Any:
        rs = current_rank_state()
        if rs is not None:
            item.stash[_NEEDS_A_PROCESS] = PROFILER_WHY
            raise SimError(format_message(
                "simulator.torch_harness", "torch's profiler was started on a simulated thread rank; the profiler "
                "is one per process, and thread ranks share this process (each rank would record the others' "
                "operations, and a second rank's start or stop crashes the process)", rank=rs.rank,
                values={"test": nodeid},
                fix=f"run it on simulated ranks with a process each: python -m pytest '{nodeid}' --sim-harness "
                    f"process"))
        return original(self)

    cls._prepare_trace = _prepare_trace
    try:
        yield
    finally:
        cls._prepare_trace = original
