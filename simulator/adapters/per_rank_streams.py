"""``sys.stdout``, ``sys.stderr``, ``builtins.print``, warning filters and logging's configuration: each thread
rank's own.

Training scripts silence every rank but the first by replacing these for their process: research code bases
(DETR, DeiT, MAE, DINO...) install a ``print`` that drops what a non-master rank prints unless forced
(``builtins.print = print`` in their ``setup_for_distributed(is_master)``), others send a rank's
``sys.stdout`` to ``os.devnull`` or tee it into a log file.  Thread ranks share one interpreter, so without
this adapter the last rank to replace them decided for every rank, and rank 0's lines vanished.

While a world runs, an assignment to one of these names on a rank (or a thread it started) is that rank's
own, and reading the name on the rank gives the rank's own value (at first the process's), so a wrapper that
calls the ``print`` it found calls the real one.  The module dictionaries hold a dispatcher that forwards to
the calling thread's rank's value: the interpreter's own lookups (``print()`` writing to ``sys.stdout``, a
bare ``print`` name) go through them.  Outside a rank everything is the process's, and the process's values
are back in place when the last world ends.  Rank processes are processes: nothing changes in them.

Warning filters are a process's too: ``warnings.filterwarnings("ignore")`` on every rank but the first silences
those ranks; on thread ranks it silenced rank 0 as well.  A rank's ``filterwarnings``, ``simplefilter``,
``resetwarnings`` and ``catch_warnings`` act on filters of its own, a copy of the process's made when it first
changes them, and the interpreter reads the calling rank's when a warning is issued.  So is where a warning
goes: ``catch_warnings(record=True)`` (unittest's ``assertWarns``) records by replacing
``warnings.showwarning`` and ``warnings._showwarnmsg_impl``, and on thread ranks a rank's block caught the
others' warnings (or none of its own) and could leave the process's hook pointing at a rank's list; both names
are per rank, and a warning is shown through the issuing rank's.

Logging is configured per process too: ``logging.basicConfig(level=INFO if rank == 0 else WARNING,
format=f"[rank{rank}] ...")`` gives each process its own root handler and level.  On thread ranks the first
rank to call it configured the root logger for all of them, whichever the schedule ran first.  While a world
runs, the fields a rank configures of each ``logging.Logger`` (its level, handlers, ``propagate``, ``disabled``
and its level cache) are the rank's own, starting from the process's; the logger tree (``getLogger``) stays
shared, so a library's module-level logger reaches each rank's own handlers, as in each process.  A module that
calls ``basicConfig`` as it is imported (pytorch/examples' ``log_utils.py``) configures every process that
imports it; thread ranks share the module, so its one import configures every rank that has not configured the
root logger itself.

Example (three ranks; only rank 0 prints, as on three processes)::

    import builtins, simulator, tensorplay.distributed as dist

    def fn():
        real = builtins.print
        builtins.print = lambda *a, **k: real(*a, **k) if dist.get_rank() == 0 else None
        print("only rank 0 prints this")

    simulator.run(fn, 3)
"""
from __future__ import annotations

import builtins
import logging
import sys
import types
import warnings
from typing import Any, Callable, Collection, ContextManager

from simulator.adapters._patch import Installation
from simulator.core.state import current_rank_state

__all__ = ["NAMES", "enabled", "process_start"]

#: the names made per rank, by module
NAMES: dict[types.ModuleType, tuple[str, ...]] = {sys: ("stdout", "stderr"), builtins: ("print",),
                                                  warnings: ("filters", "showwarning", "_showwarnmsg_impl")}
_PROCESS: dict[tuple[int, str], Any] = {}  # (id(module), name) -> the process's value while a world runs
_CLASSES: dict[int, type] = {}  # id(module) -> its class before the world


def _own() -> dict[tuple[int, str], Any] | None:
    """The calling rank's table of its own values (None outside a rank)."""
    rs = current_rank_state()
    return None if rs is None else rs.own()


def _value(module: types.ModuleType, name: str) -> Any:
    table = _own()
    key = (id(module), name)
    if table is not None and key in table:
        return table[key]
    try:
        return _PROCESS[key]
    except KeyError:  # another thread ended the last world meanwhile: the module holds the process's value again
        return module.__dict__[name]


class _PerRankModule(types.ModuleType):
    """The class of the modules in :data:`NAMES` while a world runs: their per-rank names read and set per rank."""

    def __getattribute__(self, name: str) -> Any:
        if name in _LOOKED_AFTER and (id(self), name) in _PROCESS:
            return _value(self, name)
        return types.ModuleType.__getattribute__(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        key = (id(self), name)
        if name in _LOOKED_AFTER and key in _PROCESS:
            table = _own()
            if table is not None:
                table[key] = value
            else:
                _PROCESS[key] = value  # the launcher's thread (pytest's capture, say): the process's value
            return
        types.ModuleType.__setattr__(self, name, value)


_LOOKED_AFTER = frozenset(n for names in NAMES.values() for n in names)


class _Stream:
    """What ``sys.stdout``/``sys.stderr`` hold in the module's dictionary: forwards to the calling rank's stream."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def _target(self) -> Any:
        return _value(sys, object.__getattribute__(self, "_name"))

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._target(), attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._target(), attr, value)


def _print(*args: Any, **kwargs: Any) -> None:
    """What ``builtins.print`` holds in the module's dictionary: calls the calling rank's ``print``."""
    return _value(builtins, "print")(*args, **kwargs)


def _showwarning(*args: Any, **kwargs: Any) -> None:
    """What ``warnings.showwarning`` holds in the module's dictionary: calls the calling rank's."""
    return _value(warnings, "showwarning")(*args, **kwargs)


def _showwarnmsg_impl(msg: Any) -> None:
    """What ``warnings._showwarnmsg_impl`` holds in the module's dictionary (``showwarning``'s own body reads it
    there): calls the calling rank's."""
    return _value(warnings, "_showwarnmsg_impl")(msg)


def _showwarnmsg(msg: Any) -> None:
    """``warnings._showwarnmsg`` (what the interpreter calls to show a warning), reading the calling rank's
    ``showwarning`` and ``_showwarnmsg_impl``: ``warnings``' own logic, through the per-rank names."""
    sw = _value(warnings, "showwarning")
    if sw is not warnings._showwarning_orig:  # type: ignore[attr-defined]  (a program's own hook)
        if not callable(sw):
            raise TypeError("warnings.showwarning() must be set to a function or method")
        sw(msg.message, msg.category, msg.filename, msg.lineno, msg.file, msg.line)
        return
    _value(warnings, "_showwarnmsg_impl")(msg)


#: (``warnings.filters`` keeps the process's list in the module: the interpreter reads it through the attribute)
_DISPATCHERS: dict[str, Any] = {"stdout": _Stream("stdout"), "stderr": _Stream("stderr"), "print": _print,
                                "showwarning": _showwarning, "_showwarnmsg_impl": _showwarnmsg_impl}


def _own_filters() -> list[Any]:
    """The calling rank's warning filters, a copy of the process's made when it first changes them; the process's
    outside a rank."""
    table = _own()
    key = (id(warnings), "filters")
    if table is None:
        return _PROCESS[key]
    if key not in table:
        table[key] = list(_PROCESS[key])
    return table[key]


def _add_filter(*item: Any, append: bool) -> None:
    """``warnings._add_filter`` (under ``filterwarnings``/``simplefilter``) on the calling rank's own filters."""
    filters = _own_filters()
    if not append:
        try:
            filters.remove(item)
        except ValueError:
            pass
        filters.insert(0, item)
    elif item not in filters:
        filters.append(item)
    warnings._filters_mutated()  # type: ignore[attr-defined]


def process_start(drop_filters: Collection[Any], drop_handler: Callable[[logging.Handler], bool]
                  ) -> dict[tuple[int, str], Any]:
    """What each rank of a world that stands for processes a test runner started has of its own at its start
    (``World.rank_start``): the process's warning filters and root log handlers, less the runner's own
    (``drop_filters``, ``drop_handler``), which a started process does not inherit (pytest's ``-W`` and
    ``filterwarnings``, its log capture: on thread ranks ``-W error::FutureWarning`` failed torch's own warnings,
    and ``logging.basicConfig`` did nothing)."""
    return {(id(warnings), "filters"): [f for f in warnings.filters if f not in drop_filters],
            (id(logging.root), "handlers"): [h for h in logging.root.handlers if not drop_handler(h)],
            # a warning shows on the process's stderr, not in the runner's record of its own (pytest's summary)
            (id(warnings), "showwarning"): warnings._showwarning_orig,  # type: ignore[attr-defined]
            (id(warnings), "_showwarnmsg_impl"): _to_stderr}


def _to_stderr(msg: Any) -> None:
    """``warnings._showwarnmsg_impl`` as a new interpreter has it: the warning's text on ``sys.stderr``."""
    file = msg.file if msg.file is not None else sys.stderr
    if file is None:  # (no stderr: pythonw)
        return
    try:
        file.write(warnings._formatwarnmsg(msg))  # type: ignore[attr-defined]
    except OSError:
        pass


def resetwarnings() -> None:
    """``warnings.resetwarnings`` on the calling rank's own filters."""
    _own_filters()[:] = []
    warnings._filters_mutated()  # type: ignore[attr-defined]


_FUNCTIONS = {"_add_filter": _add_filter, "resetwarnings": resetwarnings, "_showwarnmsg": _showwarnmsg}
_ORIGINAL_FUNCTIONS: dict[str, Any] = {}
_ORIGINAL_BASIC_CONFIG: list[Any] = [logging.basicConfig]

#: what a rank configures of each ``logging.Logger`` (``basicConfig``, ``setLevel``, ``addHandler``...): its own
_LOGGER_FIELDS = ("level", "handlers", "propagate", "disabled", "_cache")


class _RankField:
    """A data descriptor on ``logging.Logger`` for one of :data:`_LOGGER_FIELDS`: on a rank, the rank's own value
    (at first a copy of the process's: an empty ``_cache``, a copy of ``handlers``); elsewhere the process's, in
    the logger's ``__dict__`` as before."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, logger: Any, owner: Any = None) -> Any:
        if logger is None:
            return self
        table = _own()
        try:
            if table is None:
                return logger.__dict__[self.name]
            key = (id(logger), self.name)
            if key in table:
                return table[key]
            value = logger.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None
        if type(value) is list or type(value) is dict:
            value = table[key] = [*value] if type(value) is list else {}
        return value

    def __set__(self, logger: Any, value: Any) -> None:
        table = _own()
        if table is None or self.name not in logger.__dict__:
            # outside a rank, or a logger a rank creates (``getLogger`` of a new name): the tree is the process's,
            # and so are a new logger's first values
            logger.__dict__[self.name] = value
        else:
            table[(id(logger), self.name)] = value


def _importing(frame: Any) -> bool:
    """Is ``frame`` (or a caller of it) the top-level code of a module being imported (not the script)?"""
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") not in ("__main__", "__mp_main__"):
            return True
        frame = frame.f_back
    return False


def basicConfig(**kwargs: Any) -> None:  # noqa: N802  (logging's name)
    """``logging.basicConfig``; called by a module's top-level code as it is imported on a thread rank, it
    configures every rank that has not configured the root logger itself. Every process runs that code when it
    imports the module, but thread ranks share the module, so only the rank that imported it first would have."""
    original = _ORIGINAL_BASIC_CONFIG[0]
    rs = current_rank_state()
    if rs is None or not _importing(sys._getframe(1)):
        return original(**kwargs)
    root = logging.root
    process = {name: root.__dict__.get(name) for name in ("handlers", "level")}
    original(**kwargs)
    configured = {"handlers": root.handlers, "level": root.level}  # (as the calling rank sees them now)
    for r in rs.run.ranks:
        table = r.own()
        for name, value in configured.items():
            key = (id(root), name)
            if key not in table or table[key] == process[name]:  # (a rank that has not configured its own)
                table[key] = [*value] if name == "handlers" else value
        for key in [k for k in table if k[1] == "_cache"]:  # levels the rank's loggers cached
            del table[key]


def _install() -> None:
    for name in _LOGGER_FIELDS:
        setattr(logging.Logger, name, _RankField(name))
    for module, names in NAMES.items():
        for name in names:
            _PROCESS[(id(module), name)] = module.__dict__[name]
            module.__dict__[name] = _DISPATCHERS.get(name, module.__dict__[name])
        _CLASSES[id(module)] = type(module)
        module.__class__ = _PerRankModule
    for name, function in _FUNCTIONS.items():
        _ORIGINAL_FUNCTIONS[name] = warnings.__dict__[name]
        warnings.__dict__[name] = function
    _ORIGINAL_BASIC_CONFIG[0] = logging.basicConfig
    logging.basicConfig = basicConfig


def _uninstall() -> None:
    for name in list(_ORIGINAL_FUNCTIONS):
        warnings.__dict__[name] = _ORIGINAL_FUNCTIONS.pop(name)
    if logging.basicConfig is basicConfig:
        logging.basicConfig = _ORIGINAL_BASIC_CONFIG[0]
    for name in _LOGGER_FIELDS:
        if isinstance(logging.Logger.__dict__.get(name), _RankField):
            delattr(logging.Logger, name)
    for module, names in NAMES.items():
        cls = _CLASSES.pop(id(module), None)
        if cls is not None:
            module.__class__ = cls  # (through _PerRankModule.__setattr__: not a per-rank name)
        for name in names:
            key = (id(module), name)
            if key in _PROCESS:  # (a process's value may be None: sys.stdout under pythonw)
                module.__dict__[name] = _PROCESS[key]  # (back first: a call under way finds it, see _value)
                del _PROCESS[key]


_INSTALLATION = Installation(_install, _uninstall)


def enabled() -> ContextManager[None]:
    """While active, thread ranks have their own ``sys.stdout``, ``sys.stderr`` and ``builtins.print``."""
    return _INSTALLATION.enabled()
