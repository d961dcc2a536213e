"""The cost model of virtual time, its calibrated profiles, and the per-rank clock rules.

A :class:`CostModel` says how long each operation takes on a network.  Out of
the box it is an *uncalibrated* alpha-beta model (5 us latency, 12.5 GB/s,
the formulas nccl-tests uses): good for comparing two schedules of one program,
not for predicting seconds.  ``python -m simulator calibrate`` measures each
collective class on real processes and writes a profile that
:meth:`CostModel.load` reads; a calibrated model then predicts, per class,

    ``t(S, n) = overhead + alpha * L(n) + beta * F(n) * S``

with ``S`` the bytes of the operation (the full gathered/scattered size for
all_gather, reduce_scatter, gather, scatter and all_to_all; one rank's buffer
otherwise), ``n`` the group size, and ``L``/``F`` the latency-step and
bandwidth factors of the algorithm the fit found the backend to use
(:data:`ALGORITHMS`).  A class may have two regimes (small and large
messages) with their own parameters, split at ``upto_bytes``.  A profile is
checked as it is read (:mod:`simulator.timing.profile`): a bad field is refused with
its file, JSON path, value and fix, and every parameter is bounded so that no
cost is infinite.

The clock rules that apply these costs to ranks are :mod:`simulator.core.clock`; the hooks that keep
imports and optimizer steps honest are :mod:`simulator.adapters.clock_hooks`.
"""
from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Mapping, Sequence

from tensorplay.distributed.errors import DistTypeError, DistValueError, format_message
from tensorplay.distributed.spec import BACKEND_COLLECTIVES, COST_CLASSES

from simulator.timing.profile import check_class, check_profile, number_problem, read_profile

__all__ = ["CostModel", "ClassCost", "Regime", "ALGORITHMS", "CLASSES", "op_class", "resolve_cost",
           "PROFILE_FORMAT", "default_cost"]

#: identifies the JSON written by ``python -m simulator calibrate`` (bumped on incompatible changes)
PROFILE_FORMAT = "tensorplay-sim-cost/1"


def _log2c(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


#: algorithm name -> (L(n): latency steps, F(n): bytes factor) for a group of n ranks
ALGORITHMS: dict[str, tuple[Callable[[int], float], Callable[[int], float]]] = {
    # reduce-scatter then all-gather around a ring
    "ring_allreduce": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    # one pass around a ring (or the root talking to each member in turn): n-1 steps of S/n
    "ring": (lambda n: n - 1, lambda n: (n - 1) / n),
    # a tree whose levels pipeline the message: log2 n steps, S once
    "tree": (lambda n: _log2c(n), lambda n: 1.0),
    # binomial tree without pipelining: log2 n steps of the full message
    "binomial": (lambda n: _log2c(n), lambda n: float(_log2c(n))),
    # recursive halving then doubling (allreduce): 2 log2 n steps, 2(n-1)/n S
    "halving_doubling": (lambda n: 2 * _log2c(n), lambda n: 2 * (n - 1) / n),
    # one message between two ranks
    "pair": (lambda n: 1.0, lambda n: 1.0),
    # no payload (barrier)
    "latency": (lambda n: _log2c(n), lambda n: 0.0),
}

#: the collective classes a profile calibrates, and the algorithms the fit may pick for each
CLASSES: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring_allreduce", "halving_doubling", "binomial", "tree"),
    "broadcast": ("tree", "binomial", "ring"),
    "reduce": ("tree", "binomial", "ring"),
    "all_gather": ("ring", "tree", "binomial"),
    "reduce_scatter": ("ring", "ring_allreduce", "tree", "binomial"),
    "all_to_all": ("ring", "tree", "binomial"),
    "gather": ("ring", "tree", "binomial"),
    "scatter": ("ring", "tree", "binomial"),
    "barrier": ("latency",),
    "p2p": ("pair",),
}

#: what the uncalibrated model uses per class (the nccl-tests formulas)
_DEFAULT_ALGORITHM = {"all_reduce": "ring_allreduce", "broadcast": "tree", "reduce": "tree", "all_gather": "ring",
                      "reduce_scatter": "ring", "all_to_all": "ring", "gather": "tree", "scatter": "tree",
                      "barrier": "latency", "p2p": "pair"}

#: the class of each backend collective comes from the one table (spec.BACKEND_COLLECTIVES); these are the
#: other names operations are recorded under (object collectives, torch's async p2p calls)
_OP_CLASS = {
    **{name: b.cost_class for name, b in BACKEND_COLLECTIVES.items()},
    "all_gather_object": "all_gather", "isend": "p2p", "irecv": "p2p",
}
if set(_OP_CLASS.values()) - set(COST_CLASSES) or set(_DEFAULT_ALGORITHM) != set(COST_CLASSES):  # pragma: no cover
    raise ImportError(f"simulator/timing/cost.py: the cost classes {sorted(_DEFAULT_ALGORITHM)} and "
                      f"spec.COST_CLASSES {sorted(COST_CLASSES)} disagree")


def op_class(op: str) -> str:
    """The calibrated class of an operation name (``all_gather_into_tensor`` -> ``all_gather``; anything
    without a payload class, e.g. ``barrier`` or ``new_group``, -> ``barrier``)."""
    return _OP_CLASS.get(op, "barrier")


@dataclass(frozen=True)
class Regime:
    """One message-size regime of a class: ``overhead_s + alpha_s * L(n) + beta_s_per_byte * F(n) * S`` for
    ``S < upto_bytes`` (the last regime has ``upto_bytes = inf``)."""

    upto_bytes: float
    overhead_s: float
    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        for name in ("upto_bytes", "overhead_s", "alpha_s", "beta_s_per_byte"):
            v = getattr(self, name)
            problem = None if name == "upto_bytes" and v == math.inf else number_problem(v, name)
            if problem:  # out of range, a cost would be infinite or negative
                raise DistValueError(format_message("simulator.Regime", f"{name} {problem}", values={name: v},
                                                    fix="fit regimes with `python -m simulator calibrate`"))

    def time(self, algorithm: str, nbytes: float, n: int) -> float:
        lat, bw = ALGORITHMS[algorithm]
        return self.overhead_s + self.alpha_s * lat(n) + self.beta_s_per_byte * bw(n) * nbytes


def _regimes_dict(regimes: Sequence[Regime]) -> list[dict[str, Any]]:
    return [{"upto_bytes": None if math.isinf(r.upto_bytes) else r.upto_bytes, "overhead_s": r.overhead_s,
             "alpha_s": r.alpha_s, "beta_s_per_byte": r.beta_s_per_byte} for r in regimes]


@dataclass(frozen=True)
class ClassCost:
    """The fitted cost of one collective class: its algorithm and its regimes (ascending ``upto_bytes``).

    ``by_world`` holds regimes fitted at one measured world size alone: a group of that size uses them (the
    measured sizes are predicted as measured), any other size uses ``regimes``, the fit across world sizes,
    extrapolated by the algorithm's ``L(n)`` and ``F(n)``.
    """

    algorithm: str
    regimes: tuple[Regime, ...]
    by_world: Mapping[int, tuple[Regime, ...]] = field(default_factory=dict, hash=False)

    def time(self, nbytes: float, n: int) -> float:
        regimes = self.by_world.get(n, self.regimes)
        for r in regimes:
            if nbytes < r.upto_bytes:
                return r.time(self.algorithm, nbytes, n)
        return regimes[-1].time(self.algorithm, nbytes, n)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"algorithm": self.algorithm, "regimes": _regimes_dict(self.regimes)}
        if self.by_world:
            d["by_world"] = {str(w): _regimes_dict(r) for w, r in sorted(self.by_world.items())}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], field: str = "class", source: str = "<dict>") -> "ClassCost":
        """Build a class from :meth:`to_dict`'s shape; ``field`` (e.g. ``classes.all_reduce``) and ``source``
        (the profile's path) name what is wrong when it is refused."""
        check_class(d, source, field, algorithms=ALGORITHMS)
        by_world = {int(w): _parse_regimes(regs) for w, regs in (d.get("by_world") or {}).items()}
        return cls(d["algorithm"], _parse_regimes(d["regimes"]), by_world)


def _parse_regimes(raw: Sequence[Mapping[str, Any]]) -> tuple[Regime, ...]:
    """Regimes from checked JSON (:func:`simulator.timing.profile.check_class`), ascending ``upto_bytes``."""
    regs = [Regime(math.inf if r["upto_bytes"] is None else float(r["upto_bytes"]), float(r["overhead_s"]),
                   float(r["alpha_s"]), float(r["beta_s_per_byte"])) for r in raw]
    return tuple(sorted(regs, key=lambda r: r.upto_bytes))


@dataclass(frozen=True)
class CostModel:
    """How long each operation takes in virtual time.

    Without ``classes`` it is the *uncalibrated* alpha-beta model (``n`` the group
    size, ``S`` the bytes, ``a`` = ``latency_s``, ``B`` = ``bandwidth_Bps``):

    * all_reduce (ring): ``2(n-1)a + 2(n-1)/n * S/B``
    * reduce_scatter, all_gather, all_to_all: ``(n-1)a + (n-1)/n * S/B``
      (``S`` = the full, gathered size)
    * broadcast, reduce, gather, scatter: ``ceil(log2 n)a + S/B``
    * send/recv: ``a + S/B``; barrier: ``ceil(log2 n)a``.

    Its defaults (5 us, 12.5 GB/s) describe no particular machine: calibrate with
    ``python -m simulator calibrate`` and load the profile (:meth:`load`, or
    ``cost="profile.json"`` in :func:`simulator.run`) to predict seconds.
    ``classes`` maps a class of :data:`CLASSES` to its fitted :class:`ClassCost`;
    a class missing from it falls back to the alpha-beta formula.

    ``compute_scale`` multiplies the measured CPU time between operations
    (0 makes virtual time a pure function of the schedule, hence reproducible;
    e.g. 0.1 for a device ten times faster than this CPU).
    """

    latency_s: float = 5e-6
    bandwidth_Bps: float = 12.5e9
    compute_scale: float = 1.0
    classes: Mapping[str, ClassCost] = field(default_factory=dict, hash=False)
    #: what the profile recorded (machine, backend, torch version, fit residuals ...); empty when uncalibrated
    meta: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("latency_s", "bandwidth_Bps", "compute_scale"):
            v = getattr(self, name)
            problem = number_problem(v, name)  # the bounds keep every cost finite (simulator.timing.profile.LIMITS)
            if problem:
                raise DistValueError(format_message(
                    "simulator.CostModel", f"{name} {problem}", values={name: v},
                    fix=f"pass e.g. CostModel({name}="
                        f"{ {'latency_s': 5e-6, 'bandwidth_Bps': 12.5e9, 'compute_scale': 1.0}[name]})"))
        unknown = sorted(set(self.classes) - set(CLASSES))
        if unknown:
            raise DistValueError(format_message("simulator.CostModel", "unknown collective classes",
                                                values={"classes": unknown}, fix=f"use keys of {sorted(CLASSES)}"))

    @property
    def calibrated(self) -> bool:
        """True when at least one class comes from a measured profile."""
        return bool(self.classes)

    def cost(self, op: str, nbytes: int, n: int) -> float:
        """Seconds operation ``op`` moving ``nbytes`` takes in a group of ``n`` ranks."""
        cls = op_class(op)
        if n <= 1 and cls != "p2p":
            return 0.0
        fitted = self.classes.get(cls)
        if fitted is not None:
            return max(fitted.time(nbytes, n), 0.0)
        a, b = self.latency_s, self.bandwidth_Bps
        lat, bw = ALGORITHMS[_DEFAULT_ALGORITHM[cls]]
        return lat(n) * a + bw(n) * nbytes / b

    # -- profiles -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON-able profile: format, the fallback alpha-beta parameters, the classes and ``meta``."""
        return {"format": PROFILE_FORMAT, "latency_s": self.latency_s, "bandwidth_Bps": self.bandwidth_Bps,
                "compute_scale": self.compute_scale,
                "classes": {k: v.to_dict() for k, v in sorted(self.classes.items())}, **dict(self.meta)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "<dict>") -> "CostModel":
        """Build a model from :meth:`to_dict`'s shape (what ``calibrate`` writes); other keys go to ``meta``.

        A malformed profile raises :class:`~tensorplay.distributed.errors.DistValueError` naming ``source``,
        the field (e.g. ``classes.all_reduce.regimes[0].alpha_s``), its value and the fix.
        """
        check_profile(d, source, fmt=PROFILE_FORMAT, classes=CLASSES)
        classes = {k: ClassCost.from_dict(v, f"classes.{k}", source) for k, v in (d.get("classes") or {}).items()}
        meta = {k: v for k, v in d.items()
                if k not in ("format", "latency_s", "bandwidth_Bps", "compute_scale", "classes")}
        meta.setdefault("source", source)
        return cls(latency_s=float(d.get("latency_s", 5e-6)), bandwidth_Bps=float(d.get("bandwidth_Bps", 12.5e9)),
                   compute_scale=float(d.get("compute_scale", 1.0)), classes=classes, meta=meta)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "CostModel":
        """Read a profile written by ``python -m simulator calibrate`` (or :meth:`save`).

        Anything but a regular file (a directory, a FIFO, a device) is refused before it is opened; a file that
        is not a valid profile raises :class:`~tensorplay.distributed.errors.DistValueError` with the field.
        """
        return cls.from_dict(read_profile(path), os.fspath(path))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_dict` as JSON to ``path``."""
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=1, sort_keys=False)
            fh.write("\n")

    def describe(self) -> str:
        """One line: calibrated from where (machine, backend), or uncalibrated."""
        if not self.calibrated:
            return f"uncalibrated alpha-beta model (latency {self.latency_s:g} s, {self.bandwidth_Bps:g} B/s)"
        m = self.meta
        machine = m.get("machine")  # free-form in a hand-written profile
        cpu = machine.get("cpu_model", "?") if isinstance(machine, Mapping) else "?"
        return (f"calibrated on {m.get('backend', '?')} ({cpu}, "
                f"world sizes {m.get('world_sizes', '?')}, torch {m.get('torch_version', '?')})")

    def __repr__(self) -> str:
        # the dataclass repr printed ``meta`` in full: every measurement of a profile, tens of kB
        if not self.calibrated:
            return (f"CostModel(uncalibrated, latency_s={self.latency_s:g}, bandwidth_Bps={self.bandwidth_Bps:g}, "
                    f"compute_scale={self.compute_scale:g})")
        points = self.meta.get("measurements")
        npoints = f", {len(points)} points" if isinstance(points, list) else ""
        backend = self.meta.get("backend")
        on = f", {str(backend)[:20]}" if backend else ""
        source = self.meta.get("source")
        src = ""
        if isinstance(source, str) and source:
            src = f", source={source if len(source) <= 120 else '...' + source[-117:]!r}"
        return (f"CostModel(calibrated: {len(self.classes)} classes{npoints}{on}, "
                f"compute_scale={self.compute_scale:g}{src})")


_default: CostModel | None = None


@contextmanager
def default_cost(model: CostModel | None) -> Iterator[None]:
    """While active, a world created without ``cost=`` uses ``model`` (``python -m simulator --cost`` sets it,
    so that worlds a launcher script starts use the profile too)."""
    global _default
    prev, _default = _default, model
    try:
        yield
    finally:
        _default = prev


def resolve_cost(cost: "CostModel | str | os.PathLike[str] | None", compute_scale: float | None = None) -> CostModel:
    """``World(cost=...)``: a :class:`CostModel`, a profile path, or ``None`` (the uncalibrated default, or
    the one :func:`default_cost` set); ``compute_scale`` (when given) replaces the model's."""
    if cost is None:
        model = _default if _default is not None else CostModel()
    elif isinstance(cost, CostModel):
        model = cost
    elif isinstance(cost, (str, os.PathLike)):
        model = CostModel.load(cost)
    else:
        raise DistTypeError(format_message(
            "simulator.run", f"cost must be a simulator.CostModel, the path of a profile, or None, not a "
                             f"{type(cost).__name__}", values={"cost": cost},
            fix="pass cost=simulator.CostModel(...) or cost='profile.json' (python -m simulator calibrate --out ...)"))
    if compute_scale is not None:
        model = replace(model, compute_scale=compute_scale)  # __post_init__ checks it
    return model
