"""Reading and checking cost profiles (the JSON ``python -m simulator calibrate --out PATH`` writes).

A profile that cannot be used is refused when it is loaded, with its file, the
field (a JSON path such as ``classes.all_reduce.regimes[0].alpha_s``), the
offending value and the fix -- never a raw ``KeyError``/``TypeError``, a read
that blocks on a FIFO, or a model whose costs are infinite.

Every number must lie in :data:`LIMITS`: wide enough for any real machine,
narrow enough that no operation's cost (nor a run's virtual time, nor the
Chrome trace written from it) overflows to ``inf``/``nan``.

Example::

    >>> from simulator.timing.profile import number_problem
    >>> number_problem(1e308, "alpha_s")
    'must be a number in [0, 3600]'
"""
from __future__ import annotations

import json
import math
import os
import stat
from typing import Any, Collection, Mapping, NoReturn

from tensorplay.distributed.errors import DistValueError, format_message

__all__ = ["LIMITS", "REWRITE_FIX", "number_problem", "profile_error", "read_profile", "check_profile",
           "check_class"]

#: the call profile errors name
CALL = "simulator.CostModel.load"
#: how to get a valid profile back
REWRITE_FIX = "rewrite it with `python -m simulator calibrate --out PATH` (or correct the field by hand)"

#: field name -> (lowest, highest) value.  Times are seconds: an hour per latency step or call overhead, one
#: second per byte (1 B/s) and a million times the measured compute are far beyond any machine, and keep
#: ``overhead + alpha * L(n) + beta * F(n) * S`` finite for any group and message size
LIMITS: dict[str, tuple[float, float]] = {
    "latency_s": (0.0, 3600.0),
    "bandwidth_Bps": (1.0, 1e18),
    "compute_scale": (0.0, 1e6),
    "upto_bytes": (0.0, 1e18),
    "overhead_s": (0.0, 3600.0),
    "alpha_s": (0.0, 3600.0),
    "beta_s_per_byte": (0.0, 1.0),
}

_REGIME_FIELDS = ("overhead_s", "alpha_s", "beta_s_per_byte")


def number_problem(value: Any, kind: str) -> str | None:
    """What is wrong with ``value`` as the number ``kind`` of :data:`LIMITS` (``None``: nothing)."""
    lo, hi = LIMITS[kind]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number, not {type(value).__name__}"
    try:
        v = float(value)
    except OverflowError:  # an integer with hundreds of digits
        v = math.inf
    if not (math.isfinite(v) and lo <= v <= hi):
        return f"must be a number in [{lo:g}, {hi:g}]"
    return None


class _Shown:
    """A value as an error message shows it: scalars as they are, containers by type and size only."""

    def __init__(self, v: Any) -> None:
        if isinstance(v, str):
            self.text = repr(v if len(v) <= 60 else v[:57] + "...")
        elif v is None or isinstance(v, (bool, int, float)):
            self.text = repr(v) if not (isinstance(v, int) and abs(v) > 10**30) else f"<int of {len(str(v))} digits>"
        elif isinstance(v, (list, dict)):
            self.text = f"<{'array' if isinstance(v, list) else 'object'} of {len(v)} item{'s' * (len(v) != 1)}>"
        else:
            self.text = f"<{type(v).__name__}>"

    def __repr__(self) -> str:
        return self.text


def profile_error(source: str, field: str | None, what: str, value: Any = None, *,
                  fix: str = REWRITE_FIX, shown: bool = True) -> DistValueError:
    """The error of a profile: ``what`` is wrong with ``field`` (a JSON path; ``None``: the whole file)."""
    values: dict[str, Any] = {"path": source}
    if field is not None:
        values["field"] = field
    if shown:
        values["value"] = _Shown(value)
    head = f"{field} {what}" if field is not None else what
    return DistValueError(format_message(CALL, head, values=values, fix=fix))


def _fail(source: str, field: str | None, what: str, value: Any = None, **kw: Any) -> NoReturn:
    raise profile_error(source, field, what, value, **kw)


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


def _refuse_special(name: str, mode: int) -> None:
    if stat.S_ISREG(mode):
        return
    kind = next((k for test, k in _FILE_KINDS if test(mode)), "a special file")
    _fail(name, None, f"the profile path is {kind}, not a regular file (only a regular file is read: a FIFO or a "
          f"device could block or never end)", shown=False,
          fix="pass the path of a profile file written by `python -m simulator calibrate --out PATH`")


def read_profile(path: str | os.PathLike[str]) -> Any:
    """The parsed JSON of the profile at ``path``; refuses anything but a regular file before reading it."""
    name = os.fspath(path)
    read_fix = "pass the path of a profile written by `python -m simulator calibrate --out PATH`"
    try:
        _refuse_special(name, os.stat(name).st_mode)  # before opening: a FIFO's open blocks, a device's may act
        # O_NONBLOCK: should the path become a FIFO between the check and the open, the open still returns
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            _refuse_special(name, os.fstat(fd).st_mode)
            with os.fdopen(fd, "rb") as fh:
                fd = -1
                data = fh.read()
        finally:
            if fd >= 0:
                os.close(fd)
    except OSError as e:
        _fail(name, None, f"cannot read the profile ({e.strerror or e})", shown=False, fix=read_fix)
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        raise DistValueError(format_message(
            CALL, f"the profile is not valid JSON ({e.msg})", values={"path": name, "line": e.lineno,
                                                                      "column": e.colno},
            fix=REWRITE_FIX)) from None
    except (UnicodeDecodeError, RecursionError) as e:
        _fail(name, None, f"the profile is not valid JSON ({type(e).__name__})", shown=False)


def check_profile(d: Any, source: str, *, fmt: str, classes: Collection[str]) -> None:
    """Check the top level of a profile: a JSON object of format ``fmt``, numbers in :data:`LIMITS`, and a
    ``classes`` object whose keys are in ``classes`` (each class's own fit: :func:`check_class`)."""
    if not isinstance(d, Mapping):
        _fail(source, None, "a profile is a JSON object", d)
    if d.get("format") != fmt:
        _fail(source, "format", f"is not {fmt!r}: not a simulator cost profile", d.get("format"))
    for key in ("latency_s", "bandwidth_Bps", "compute_scale"):
        if key in d:
            problem = number_problem(d[key], key)
            if problem:
                _fail(source, key, problem, d[key])
    raw = d.get("classes")
    if raw is not None and not isinstance(raw, Mapping):
        _fail(source, "classes", "must be an object (collective class -> fit)", raw)
    for name in raw or {}:
        if name not in classes:
            _fail(source, f"classes.{name}", f"is not a collective class (known: {', '.join(sorted(classes))})",
                  name)


def check_class(d: Any, source: str, field: str, *, algorithms: Collection[str]) -> None:
    """Check one class's fit (``field``, e.g. ``classes.all_reduce``): an algorithm of ``algorithms`` and
    regimes (``regimes``, and per world size ``by_world``) whose numbers lie in :data:`LIMITS`."""
    if not isinstance(d, Mapping):
        _fail(source, field, "must be an object with 'algorithm' and 'regimes'", d)
    if d.get("algorithm") not in algorithms:
        _fail(source, f"{field}.algorithm", f"is not one of {', '.join(sorted(algorithms))}", d.get("algorithm"))
    _check_regimes(d.get("regimes"), source, f"{field}.regimes")
    by_world = d.get("by_world")
    if by_world is None:
        return
    if not isinstance(by_world, Mapping):
        _fail(source, f"{field}.by_world", "must be an object (world size -> regimes)", by_world)
    for w, regs in by_world.items():
        if not (isinstance(w, str) and w.isascii() and w.isdigit() and int(w) >= 1):
            _fail(source, f"{field}.by_world", "has a key that is not a world size", w)
        _check_regimes(regs, source, f"{field}.by_world.{w}")


def _check_regimes(raw: Any, source: str, field: str) -> None:
    if not isinstance(raw, list) or not raw:
        _fail(source, field, "must be a non-empty array of regimes (the last with upto_bytes null)", raw)
    for i, r in enumerate(raw):
        where = f"{field}[{i}]"
        if not isinstance(r, Mapping):
            _fail(source, where, "must be an object with upto_bytes, overhead_s, alpha_s and beta_s_per_byte", r)
        for key in ("upto_bytes", *_REGIME_FIELDS):
            if key not in r:
                _fail(source, f"{where}.{key}", "is missing", shown=False)
            if key == "upto_bytes" and r[key] is None:  # null: no upper bound (the last regime)
                continue
            problem = number_problem(r[key], key)
            if problem:
                _fail(source, f"{where}.{key}", problem, r[key])
