"""What a process has of its own, for torch's harness on thread ranks (part of :mod:`simulator.torch_harness`).

torch's harness gives every rank a process; thread ranks share one. Each context manager here gives a test's
thread ranks, while the test runs, one thing a process has of its own, or marks the test when they cannot have it
(it then runs again on rank processes): class state (``distributed_test.Barrier``), torch.nn's module hooks, the
device-type tests' thread-local precision, torch's backend registry, pytest's log handlers, class attributes a test
sets, patches (``unittest.mock``, torch's ``common_fsdp.patch_*``), and torch's profiler.

Like the plugin, this module imports pytest and the simulator's light actor lookup only; torch is imported when a
test runs with the switch on.
"""
from __future__ import annotations

import contextlib
import operator
import os
import sys
import threading
import types
import unittest
from typing import Any, Iterator

import pytest

from simulator.core._actor import current_rank_state  # (light: no torch)

__all__ = ["GLOBALS_WHY", "NEEDS_A_PROCESS", "PATCH_WHY", "PROFILER_WHY", "classes_put_back",
           "module_globals_put_back", "no_pytest_log_handlers",
           "one_profiler_per_process", "own_class_state", "patches_are_per_process", "test_process_registries",
           "torch_settings_put_back"]

_DIST_TEST_MODULE = "torch.testing._internal.distributed.distributed_test"
#: why a test that starts torch's profiler on a rank runs on rank processes under --sim-harness thread
PROFILER_WHY = ("torch's profiler is one per process (each thread rank's would record the other ranks' operations, "
                "and a second rank's start or stop crashes the process); the test started it on a rank")
#: why a test whose ranks patched with unittest.mock, then failed on thread ranks, runs on rank processes
PATCH_WHY = ("unittest.mock's patch, and torch's test helpers that patch by assignment (common_fsdp.patch_*), set an "
             "attribute of the one process (each thread rank's patch is every rank's, and the ranks' exits, not "
             "last-in first-out, can leave a mock in place); code run on a rank (the test, or torch itself, as "
             "inductor does while it compiles) patched")
#: set on a test's item when one of its thread ranks needed a process of its own (why): see
#: simulator.torch_harness._thread_only_failure
NEEDS_A_PROCESS = pytest.StashKey[str]()


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
def test_process_registries() -> Iterator[None]:
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
def no_pytest_log_handlers() -> Iterator[None]:
    """A rank process's loggers have the handlers its own imports gave them.  pytest's logging plugin attaches its
    capture handlers (``_pytest.logging``'s) to every logger that does not propagate, in this process: torch's
    ``c10d-NullHandler-default``, which torch's ``test_c10d_logger.py`` expects to hold its one ``NullHandler``,
    showed thread ranks 5.  While a test's ranks are threads of this process, such loggers hold none of pytest's
    handlers; they get them back after the test (each rank's root logger starts without pytest's too, as a started
    process's does: see simulator.torch_harness._started_process_state)."""
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
def torch_settings_put_back() -> Iterator[None]:
    """Each test's rank processes start from torch's defaults; thread ranks share this process, so torch's
    process-wide settings a test's ranks change (the default dtype, deterministic algorithms, matmul precision,
    cuDNN's flags, the intra-op threads, anomaly mode) are put back after it, or the next test would start from
    them (module globals a test sets are not: docs/torch-native.md)."""
    import torch  # (a test with the switch on: see the module's docstring)

    cudnn = torch.backends.cudnn
    flags = ("enabled", "benchmark", "deterministic")
    saved = (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), torch.get_float32_matmul_precision(),
             [getattr(cudnn, f) for f in flags], torch.get_num_threads(), torch.is_anomaly_enabled(),
             torch.is_anomaly_check_nan_enabled())
    try:
        yield
    finally:
        dtype, det, warn_only, precision, was, threads, anomaly, check_nan = saved
        for flag, value in zip(flags, was):
            if getattr(cudnn, flag) != value:  # (torch's harness locks these flags: set only what a test changed)
                setattr(cudnn, flag, value)
        torch.set_default_dtype(dtype)
        torch.use_deterministic_algorithms(det, warn_only=warn_only)
        torch.set_float32_matmul_precision(precision)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.set_anomaly_enabled(anomaly, check_nan)


@contextlib.contextmanager
def own_class_state() -> Iterator[None]:
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
def classes_put_back(item: pytest.Item) -> Iterator[None]:
    """A test's thread ranks that set or delete an attribute of a class of the test's module or of torch's test
    helpers (``UnitModule.get_extra_state = ...``, PyTorch's ``checkpoint/test_state_dict.py``) changed it for
    every later test of the session; each test's rank processes start from the classes as imported. When the test
    ends, those classes are as they were before it."""
    modules = [getattr(item, "module", None)] + _torch_test_helpers()
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


def _torch_test_helpers() -> list[Any]:
    # (an entry may be None: an import blocked on purpose)
    return [m for n, m in list(sys.modules.items())
            if n.startswith("torch.testing._internal.") and isinstance(m, types.ModuleType)]


def _test_dir_modules(item: pytest.Item) -> list[Any]:
    """The test's module and the modules imported from its folder (helpers a test file imports by name; not pytest's
    plugins there, conftest.py, whose hooks run in the parent; not the simulator's own, should the test live
    beside them)."""
    module = getattr(item, "module", None)
    folder = os.path.dirname(getattr(module, "__file__", None) or "")
    if not folder:
        return [module] if module is not None else []
    prefix = folder + os.sep
    plugins = item.config.pluginmanager
    return [m for n, m in list(sys.modules.items())
            if m is module or (isinstance(m, types.ModuleType) and _in_folder(getattr(m, "__file__", None), prefix)
                               and not n.startswith(("simulator", "tensorplay")) and not plugins.is_registered(m))]


def _in_folder(path: Any, prefix: str) -> bool:
    return isinstance(path, str) and path.startswith(prefix) and os.sep not in path[len(prefix):]


#: why a test whose ranks changed a module's globals, then failed on thread ranks, runs on rank processes
GLOBALS_WHY = ("a module's globals are one per process, and the test's ranks changed some ({names}): each thread rank "
               "saw the others' changes, where each process changes its own")
_CONTAINERS = (list, dict, set)


def _same(was: Any, now: Any) -> bool:
    """Whether a container holds what it held (by identity: its elements' ``==`` may be a tensor's)."""
    try:
        if isinstance(was, dict):
            return was.keys() == now.keys() and all(map(operator.is_, was.values(), map(now.__getitem__, was)))
        if isinstance(was, set):
            return len(was) == len(now) and all(map(now.__contains__, was))
        return len(was) == len(now) and all(map(operator.is_, was, now))
    except Exception:  # noqa: BLE001  (an element whose comparison fails: taken as changed)
        return False


@contextlib.contextmanager
def module_globals_put_back(item: pytest.Item) -> Iterator[None]:
    """A test's thread ranks that change a module's globals (rebind one, or change a list, dict or set in place:
    torch's ``_chunk_sharding_specs_list_for_test`` shuffles ``_test_st_common.PLACEMENTS``, seeded, on each rank)
    change them for every rank and for the tests after it; each rank process starts from the modules as imported
    and changes its own.  When the test ends, the test's modules (its own and those of its folder: rebound names
    and containers) and torch's test helpers (containers) hold what they held before it, in the same objects; if
    the test failed on thread ranks after such a change, it runs again on rank processes (``GLOBALS_WHY``)."""
    own = _test_dir_modules(item)
    spaces = [(m, dict(vars(m))) for m in own]
    containers = [(m, k, v, type(v)(v)) for m in own + _torch_test_helpers() for k, v in list(vars(m).items())
                  if type(v) in _CONTAINERS and not k.startswith("__")]
    imported = set(sys.modules)
    try:
        yield
    finally:
        # a module of the test's folder first imported during the test may have registered itself in them (a plugin
        # adding a handler to its folder's registry): its import will not run again, so what it changed stays (torch's
        # test helpers imported lazily, common_device_type and common_cuda, change none of the others)
        watched = {id(m) for m in _test_dir_modules(item)}
        restore = not any(id(sys.modules[n]) in watched for n in set(sys.modules) - imported)
        changed = []
        for m, was in spaces:
            now = vars(m)
            for name in [n for n in now.keys() | was.keys() if not n.startswith("__")]:
                if now.get(name, _MISSING) is not was.get(name, _MISSING):
                    changed.append(f"{m.__name__}.{name}")
                    if restore:
                        _put_back(m, name, was.get(name, _MISSING), now.get(name, _MISSING))
        for m, name, obj, was in containers:
            if not _same(was, obj):
                changed.append(f"{m.__name__}.{name}")
                if not restore:
                    continue
                if isinstance(obj, list):
                    obj[:] = was
                else:
                    obj.clear()
                    obj.update(was)
        if changed:
            item.stash.setdefault(NEEDS_A_PROCESS, GLOBALS_WHY.format(names=", ".join(sorted(set(changed))[:5])))


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
def patches_are_per_process(item: pytest.Item) -> Iterator[None]:
    """A rank entering ``unittest.mock.patch`` (or one of torch's test helpers that patch by assignment) marks the
    test: patching is per process, so if the test then fails on thread ranks it runs again on rank processes,
    where each rank patches its own (one that passes stands)."""
    from unittest import mock

    patchers = _torch_test_patchers()
    # (test modules bind torch's helpers by name at import: their entry is seen where every @contextmanager enters)
    enter_cm = contextlib._GeneratorContextManager.__enter__

    def enter_helper(self: Any) -> Any:
        if getattr(self.gen, "gi_code", None) in patchers and current_rank_state() is not None:
            item.stash[NEEDS_A_PROCESS] = PATCH_WHY
        return enter_cm(self)

    if patchers:
        contextlib._GeneratorContextManager.__enter__ = enter_helper  # type: ignore[method-assign]
    original = mock._patch.__enter__
    before: dict[tuple[int, str], tuple[Any, str, Any]] = {}  # what each patched attribute was before any rank's patch

    def __enter__(self: Any) -> Any:
        if current_rank_state() is not None:
            item.stash[NEEDS_A_PROCESS] = PATCH_WHY
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
def one_profiler_per_process(item: pytest.Item) -> Iterator[None]:
    """torch's profiler (``torch.autograd.profiler.profile``, ``torch.profiler.profile``) is one per process; a
    world refuses it on thread ranks (:mod:`simulator.adapters.torch_profiling`).  Under the harness the refusal
    names the harness's fix and marks the test, which then runs again on rank processes (see
    :func:`simulator.torch_harness._thread_only_failure`).
    """
    from simulator.adapters import torch_profiling  # (imports torch: see _simulated)

    def mark() -> None:
        item.stash[NEEDS_A_PROCESS] = PROFILER_WHY

    with torch_profiling.harness_names_the_fix(
            f"run it on simulated ranks with a process each: python -m pytest '{item.nodeid}' --sim-harness process",
            mark):
        yield
