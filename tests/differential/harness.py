"""The differential harness: one case, run on simulated ranks and on real gloo ranks, outcomes compared.

A *case* is a module-level function of a :class:`Ctx`, registered with :func:`case`::

    @case(world_sizes=(1, 2, 3, 4))
    def all_reduce_sum(ctx):
        x = torch.arange(4.0, device=ctx.device) + 10 * ctx.rank
        ctx.dist.all_reduce(x)
        return x

The harness runs it

- on the simulator: ``simulator`` ``World(W, torchrun_env=True)``, where every rank first calls
  ``torch.distributed.init_process_group("gloo")`` exactly as a user script would (the torch-native
  adapter binds it to the simulated world), and
- on gloo: the session's persistent ``RankPool`` of world size ``W`` (real processes, loopback),

and compares, per rank, what each side observed: the returned value (tensors bitwise or within
tolerance, objects exactly) or, for cases that declare ``raises=True``, the nearest builtin class
of the exception each rank raised.  Case functions travel to the gloo ranks by reference (module
and name), so they must live at module level of an importable ``cases_*`` module.

Reproduce one (case, world size, front door) outside pytest::

    python -c "import tests.differential.harness as h; h.reproduce('c10d.all_reduce_sum', 2, 'torch')"
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
import shutil
import sys
import tempfile
import traceback
import types
from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = [
    "Case", "Ctx", "Outcome", "TensorValue", "REGISTRY", "FRONT_DOORS", "case", "load_cases", "run_sim", "run_gloo",
    "compare_outcomes", "check", "reproduce", "divergence_for", "device_kind", "doors", "iter_params",
]

#: the two front doors a case can run through: ``ctx.dist`` is ``torch.distributed`` or ``tensorplay.distributed``
FRONT_DOORS = ("torch", "tensorplay")
_DOOR_MODULES = {"torch": "torch.distributed", "tensorplay": "tensorplay.distributed"}
#: the simulator's schedule seed for every case (coop mode: one fixed interleaving, reproducible)
SIM_SEED = int(os.environ.get("TENSORPLAY_DIFF_SEED", "0"))
#: the seconds a gloo pool call may take beyond the case's own timeout (process start on a restarted pool)
_GLOO_SLACK_S = 30.0


# ---------------------------------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    """A registered case and its options (see :func:`case`)."""

    name: str
    fn: Callable[["Ctx"], Any]
    module: str
    func: str
    world_sizes: tuple[int, ...]
    front_doors: tuple[str, ...]
    slow: bool
    gloo: str | None
    expect_sim: Callable[[list[Any]], None] | None
    compare: str
    timeout: float
    raises: bool
    known_divergence: str | Mapping[Any, str] | None
    door_drift: str | None = None


#: every registered case by name (``<module suffix>.<function name>``, e.g. ``c10d.all_reduce_sum``)
REGISTRY: dict[str, Case] = {}


def _case_name(module: str, func: str) -> str:
    short = module.rsplit(".", 1)[-1]
    if short.startswith("cases_"):
        short = short[len("cases_"):]
    return f"{short}.{func}"


def case(fn: Callable[["Ctx"], Any] | None = None, *, world_sizes: Sequence[int] = (1, 2, 3, 4),
         front_doors: Sequence[str] = FRONT_DOORS, slow: bool = False, gloo: str | None = None,
         expect_sim: Callable[[list[Any]], None] | None = None, compare: str = "exact", timeout: float = 60.0,
         raises: bool = False, known_divergence: str | Mapping[Any, str] | None = None,
         door_drift: str | None = None) -> Any:
    """Register a module-level function of a :class:`Ctx` as a differential case.

    Args:
        world_sizes: the world sizes to run at (1..4 on gloo).
        front_doors: ``("torch", "tensorplay")`` or ``("torch",)`` for APIs only torch.distributed has.
        slow: put the case in the slow tier (``-m slow``).
        gloo: a reason the case cannot run on gloo on CPU; it then runs on the simulator only and must
            check its expectation itself (in its body or through ``expect_sim``).
        expect_sim: ``f(per_rank)`` checked on the simulator's outcome, where ``per_rank[r]`` is rank
            ``r``'s normalised result or its exception; for deliberate deviations (the simulator detects
            what gloo lets through), which replace the comparison with gloo.
        compare: ``"exact"`` (bitwise) or ``"close"`` (``torch.testing.assert_close`` default tolerances).
        timeout: seconds one run may take, on each side.
        raises: ranks may raise (through some front door at least); exceptions are then compared by class:
            the simulator's must be an instance of gloo's nearest builtin class.  Such ranks must raise before
            communicating, and the others must not communicate.
        known_divergence: a diagnosis of a simulator/gloo divergence not fixed yet; the test is marked
            ``xfail(strict=True)``.  A string applies to every (world size, front door); a mapping takes
            keys ``W``, ``door`` or ``(W, door)`` to limit it.
        door_drift: why tensorplay.distributed deliberately differs from torch.distributed on gloo here (it
            emulates what gloo lacks, e.g. ragged list all_to_all); skips the front-door comparison.
    """
    world_sizes = tuple(world_sizes)
    front_doors = tuple(front_doors)
    where = "differential.case"
    if not world_sizes or any(not isinstance(w, int) or w < 1 for w in world_sizes):
        raise ValueError(f"{where}: world_sizes={world_sizes!r} must be a non-empty tuple of ints >= 1")
    if not front_doors or any(d not in FRONT_DOORS for d in front_doors) or "torch" not in front_doors:
        raise ValueError(f"{where}: front_doors={front_doors!r} must be ('torch',) or ('torch', 'tensorplay')")
    if compare not in ("exact", "close"):
        raise ValueError(f"{where}: compare={compare!r} must be 'exact' or 'close'")
    if gloo is not None and not (isinstance(gloo, str) and gloo):
        raise ValueError(f"{where}: gloo={gloo!r} must be None or a non-empty reason")
    if timeout <= 0:
        raise ValueError(f"{where}: timeout={timeout!r} must be > 0 seconds")

    def register(f: Callable[["Ctx"], Any]) -> Callable[["Ctx"], Any]:
        if not callable(f) or getattr(f, "__qualname__", None) != getattr(f, "__name__", None):
            raise ValueError(f"{where}: {f!r} must be a module-level function (it travels to the gloo ranks by "
                             f"reference)")
        name = _case_name(f.__module__, f.__name__)
        old = REGISTRY.get(name)
        if old is not None and old.module != f.__module__:
            raise ValueError(f"{where}: two cases are named {name!r} ({old.module} and {f.__module__}); rename one")
        REGISTRY[name] = Case(name=name, fn=f, module=f.__module__, func=f.__name__, world_sizes=world_sizes,
                              front_doors=front_doors, slow=slow, gloo=gloo, expect_sim=expect_sim, compare=compare,
                              timeout=float(timeout), raises=raises, known_divergence=known_divergence,
                              door_drift=door_drift)
        return f

    return register(fn) if fn is not None else register


def doors(*names: str) -> tuple[str, ...]:
    """Both front doors when ``tensorplay.distributed`` has every one of ``names``, else ``("torch",)``.

    Cases of APIs that tensorplay may or may not export use this, so a function tensorplay gains is
    compared through both doors without editing the case.
    """
    import tensorplay.distributed as tpd

    return FRONT_DOORS if all(hasattr(tpd, n) for n in names) else ("torch",)


def divergence_for(c: Case, world_size: int, door: str) -> str | None:
    """The known-divergence diagnosis that applies to ``(world_size, door)``, if any."""
    kd = c.known_divergence
    if kd is None or isinstance(kd, str):
        return kd
    for key in ((world_size, door), world_size, door):
        if key in kd:
            return kd[key]
    return None


def load_cases() -> dict[str, Case]:
    """Import every ``cases_*`` module of this package (new modules are picked up without registration)."""
    pkg = __package__ or "differential"
    here = os.path.dirname(os.path.abspath(__file__))
    for info in sorted(pkgutil.iter_modules([here]), key=lambda i: i.name):
        if info.name.startswith("cases_"):
            importlib.import_module(f"{pkg}.{info.name}")
    return REGISTRY


# ---------------------------------------------------------------------------------------------------------------------
# rank side: the context, the call, the normalised outcome
# ---------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Ctx:
    """What a case sees: the front door module, its rank, the world size, the device and a shared directory.

    ``backend`` ("sim" or "gloo") is for reporting only; cases must not branch on it.
    """

    dist: types.ModuleType
    rank: int
    world_size: int
    device: Any
    tmpdir: str
    backend: str


@dataclasses.dataclass(frozen=True)
class TensorValue:
    """A returned tensor, moved to CPU, with what is observable about it besides its values."""

    device_type: str
    requires_grad: bool
    tensor: Any  # torch.Tensor on CPU

    def __repr__(self) -> str:
        t = self.tensor
        extra = f", device_type={self.device_type!r}" if self.device_type != "cpu" else ""
        extra += ", requires_grad=True" if self.requires_grad else ""
        return f"tensor({t.tolist()!r}, dtype={t.dtype}, shape={tuple(t.shape)}{extra})"


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One rank's outcome: ``kind`` is ``"ok"`` (``value``), ``"raise"`` (an exception) or ``"lost"`` (no answer)."""

    kind: str
    value: Any = None
    builtin: str = ""       # nearest builtin exception class, e.g. "ValueError"
    builtins: tuple[str, ...] = ()  # every builtin class it derives from, nearest first
    exc_type: str = ""      # the exception's own class, e.g. "DistValueError"
    message: str = ""
    exc: BaseException | None = dataclasses.field(default=None, compare=False)  # sim side only

    def short(self) -> str:
        if self.kind == "ok":
            return f"returned {self.value!r}"
        if self.kind == "raise":
            first = self.message.strip().splitlines()[0] if self.message.strip() else ""
            return f"raised {self.exc_type} (builtin {self.builtin}): {first[:300]}"
        return f"no outcome: {self.message[:300]}"


def builtin_class(cls: type) -> str:
    """The nearest builtin ancestor of an exception class (``DistValueError`` -> ``ValueError``)."""
    for k in cls.__mro__:
        if k.__module__ == "builtins":
            return k.__name__
    return "BaseException"  # pragma: no cover  (every exception derives from one)


def builtin_classes(cls: type) -> tuple[str, ...]:
    """Every builtin exception class ``cls`` derives from, nearest first."""
    return tuple(k.__name__ for k in cls.__mro__ if k.__module__ == "builtins" and k is not object)


def _exc_outcome(e: BaseException) -> Outcome:
    return Outcome("raise", builtin=builtin_class(type(e)), builtins=builtin_classes(type(e)),
                   exc_type=type(e).__qualname__,
                   message=f"{e}\n{''.join(traceback.format_exception(e))[-4000:]}")


def normalize(v: Any) -> Any:
    """Turn a case's return value into a picklable, comparable value (tensors become :class:`TensorValue`)."""
    import torch

    if isinstance(v, torch.Tensor):
        act = sys.modules.get("torch.distributed._functional_collectives")
        if act is not None and isinstance(v, act.AsyncCollectiveTensor):
            v = v.wait()  # an un-waited async result: its value is what the program would read
        dt = sys.modules.get("torch.distributed.tensor")
        if dt is not None and isinstance(v, dt.DTensor):
            return {"dtensor_placements": repr(tuple(v.placements)), "dtensor_shape": tuple(v.shape),
                    "local": normalize(v.to_local())}
        if type(v) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"differential: a case returned a {type(v).__name__} tensor subclass; return a plain "
                            f"tensor (e.g. .full_tensor() or .to_local() of a DTensor)")
        return TensorValue(v.device.type, bool(v.requires_grad), v.detach().to("cpu", copy=True))
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return v
    if isinstance(v, (torch.dtype, torch.device)):
        return str(v)
    if isinstance(v, torch.Size):
        return tuple(v)
    if isinstance(v, list):
        return [normalize(x) for x in v]
    if isinstance(v, tuple):
        return tuple(normalize(x) for x in v)
    if isinstance(v, dict):
        return {k: normalize(x) for k, x in v.items()}
    raise TypeError(f"differential: a case returned {type(v).__module__}.{type(v).__qualname__}, which is not "
                    f"comparable; return tensors, numbers, str, None or lists/tuples/dicts of them")


def device_kind() -> str:
    """The tensor device the suite runs with: ``cpu`` (default) or ``cuda`` (``--device cuda`` /
    ``TENSORPLAY_DIFF_DEVICE=cuda``)."""
    return os.environ.get("TENSORPLAY_DIFF_DEVICE", "cpu")


def _call(module: str, func: str, door: str, backend: str, device: str, tmpdir: str) -> Any:
    """Run one case on this rank (the process group already exists) and normalise its result."""
    import torch
    import torch.distributed as tdist

    fn = getattr(importlib.import_module(module), func)
    rank, world = tdist.get_rank(), tdist.get_world_size()
    dev = torch.device("cpu")
    if device == "cuda":
        dev = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    ctx = Ctx(dist=importlib.import_module(_DOOR_MODULES[door]), rank=rank, world_size=world, device=dev,
              tmpdir=tmpdir, backend=backend)
    return normalize(fn(ctx))


def _sim_entry(module: str, func: str, door: str, device: str, tmpdir: str) -> Any:
    """A simulated rank: initialise torch's default group as a torchrun script does, then run the case."""
    import torch.distributed as tdist

    tdist.init_process_group("gloo")  # the torch-native adapter binds it to the simulated world
    return _call(module, func, door, "sim", device, tmpdir)


def _gloo_entry(module: str, func: str, door: str, device: str, tmpdir: str) -> Outcome:
    """A gloo pool rank: run the case and report an exception as an outcome (the pool must not restart for it)."""
    import torch.distributed as tdist

    try:
        out = Outcome("ok", value=_call(module, func, door, "gloo", device, tmpdir))
    except BaseException as e:  # noqa: BLE001  the exception is this rank's outcome
        out = _exc_outcome(e)
    # Every rank meets here so the next case starts together on every rank.  The meeting goes through the
    # store, not ``tdist.barrier()``: gloo's barrier first waits on the group's work still in flight and
    # rethrows its error, and a failed collective stays in flight for a moment after its ``wait()`` raised,
    # so a barrier right after a raising case can fail on one rank without reaching the others (which then
    # wait for it).  Groups a case created are left alive: torch caches them (device meshes, the functional
    # collectives' rank-list lookup), and destroying one under a cache makes a later case hang.
    _meet(tdist)
    return out


_MEETINGS = [0]


def _meet(tdist: Any, timeout: float = 120.0) -> None:
    """A store-based barrier of the default group's ranks, bounded by ``timeout`` seconds."""
    import time

    from torch.distributed.distributed_c10d import _get_default_store

    _MEETINGS[0] += 1
    store, key = _get_default_store(), f"tensorplay-diff/meet/{_MEETINGS[0]}"
    store.add(key, 1)
    deadline = time.monotonic() + timeout
    while store.add(key, 0) < tdist.get_world_size():
        if time.monotonic() > deadline:
            raise TimeoutError(f"differential harness: ranks did not meet after case {_MEETINGS[0]} within "
                               f"{timeout}s (count={store.add(key, 0)}, world_size={tdist.get_world_size()})")
        time.sleep(0.001)


# ---------------------------------------------------------------------------------------------------------------------
# test-process side: run on each backend
# ---------------------------------------------------------------------------------------------------------------------
def _args(c: Case, door: str, device: str, tmpdir: str) -> tuple[Any, ...]:
    return (c.module, c.func, door, device, tmpdir)


def run_sim(c: Case, world_size: int, door: str, device: str = "cpu") -> tuple[list[Outcome], str]:
    """Run ``c`` on ``world_size`` simulated ranks; per-rank outcomes and the run's own error text (or "")."""
    from simulator import World

    tmpdir = tempfile.mkdtemp(prefix=f"diff-sim-{c.func}-")
    try:
        w = World(world_size, seed=SIM_SEED, mode="coop", timeout=c.timeout, device=device, torchrun_env=True)
        summary = ""
        try:
            results = w.run(_sim_entry, _args(c, door, device, tmpdir))
            return [Outcome("ok", value=v) for v in results], ""
        except BaseException as e:  # noqa: BLE001  per-rank outcomes below
            summary = "".join(traceback.format_exception(e))[-6000:]
            errors = getattr(w, "errors", None)
            results = getattr(w, "results", None)
            if errors is None:
                return [_exc_outcome(e) for _ in range(world_size)], summary
            outs = []
            for r in range(world_size):
                if errors[r] is not None:
                    o = _exc_outcome(errors[r])
                    outs.append(dataclasses.replace(o, exc=errors[r]))
                else:
                    outs.append(Outcome("ok", value=results[r]))
            return outs, summary
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def run_gloo(c: Case, world_size: int, door: str, pool: Any, device: str = "cpu") -> tuple[list[Outcome], str]:
    """Run ``c`` on a gloo ``RankPool`` of ``world_size``; per-rank outcomes and the pool's error text (or "")."""
    tmpdir = tempfile.mkdtemp(prefix=f"diff-gloo-{c.func}-")
    try:
        try:
            outs = pool.run_per_rank(_gloo_entry, [_args(c, door, device, tmpdir)] * world_size,
                                     timeout=c.timeout + _GLOO_SLACK_S)
            return list(outs), ""
        except Exception as e:  # noqa: BLE001  a hang or a dead rank: no per-rank outcome
            text = str(e)
            return [Outcome("lost", message=text) for _ in range(world_size)], text[-6000:]
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------------------------------------------------
def _diff_values(a: Any, b: Any, mode: str, path: str, out: list[str]) -> None:
    import torch

    if type(a) is not type(b):
        out.append(f"{path}: {type(a).__name__} {a!r} vs {type(b).__name__} {b!r}")
        return
    if isinstance(a, TensorValue):
        ta, tb = a.tensor, b.tensor
        for attr in ("dtype", "shape"):
            if getattr(ta, attr) != getattr(tb, attr):
                out.append(f"{path}: {attr} {getattr(ta, attr)} vs {getattr(tb, attr)} ({a!r} vs {b!r})")
                return
        if a.device_type != b.device_type or a.requires_grad != b.requires_grad:
            out.append(f"{path}: device/requires_grad ({a.device_type}, {a.requires_grad}) vs "
                       f"({b.device_type}, {b.requires_grad})")
            return
        if ta.dtype.is_floating_point or ta.dtype.is_complex:
            tol = {"rtol": 0.0, "atol": 0.0} if mode == "exact" else {}
            try:
                torch.testing.assert_close(ta, tb, equal_nan=True, **tol)
            except AssertionError as e:
                out.append(f"{path}: {a!r} vs {b!r} ({str(e).splitlines()[0]})")
        elif not torch.equal(ta, tb):
            out.append(f"{path}: {a!r} vs {b!r}")
        return
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            out.append(f"{path}: length {len(a)} vs {len(b)} ({a!r} vs {b!r})")
            return
        for i, (x, y) in enumerate(zip(a, b)):
            _diff_values(x, y, mode, f"{path}[{i}]", out)
        return
    if isinstance(a, dict):
        if list(a) != list(b):
            out.append(f"{path}: keys {list(a)!r} vs {list(b)!r}")
            return
        for k in a:
            _diff_values(a[k], b[k], mode, f"{path}[{k!r}]", out)
        return
    if isinstance(a, (float, complex)):
        same = a == b or (a != a and b != b)  # NaN == NaN here
        if not same and mode == "close":
            same = abs(a - b) <= 1e-5 + 1.3e-6 * abs(b)
        if not same:
            out.append(f"{path}: {a!r} vs {b!r}")
        return
    if a != b:
        out.append(f"{path}: {a!r} vs {b!r}")


def compare_outcomes(c: Case, left: Sequence[Outcome], right: Sequence[Outcome],
                     names: tuple[str, str] = ("sim", "gloo"), *, classes: bool = True) -> list[str]:
    """Per-rank differences between two runs of ``c`` (empty when they agree).

    An exception on the left matches one on the right when it is an instance of the right one's nearest
    builtin class (a program's ``except RuntimeError`` then catches both); ``classes=False`` compares
    only which ranks raised.
    """
    diffs: list[str] = []
    a_name, b_name = names
    for r, (a, b) in enumerate(zip(left, right)):
        if a.kind == "lost" or b.kind == "lost":
            diffs.append(f"rank {r}: {a_name} {a.short()} | {b_name} {b.short()}")
        elif a.kind != b.kind:
            diffs.append(f"rank {r}: {a_name} {a.short()} | {b_name} {b.short()}")
        elif a.kind == "raise":
            if not c.raises:
                diffs.append(f"rank {r}: raised on both sides but the case does not declare raises=True: "
                             f"{a_name} {a.short()} | {b_name} {b.short()}")
            elif classes and b.builtin not in a.builtins:
                diffs.append(f"rank {r}: exception class {a_name} {a.builtin} ({a.exc_type}) vs {b_name} "
                             f"{b.builtin} ({b.exc_type}): {a_name} {a.short()} | {b_name} {b.short()}")
        else:
            sub: list[str] = []
            _diff_values(a.value, b.value, c.compare, "result", sub)
            diffs.extend(f"rank {r}: {d}  [{a_name} vs {b_name}]" for d in sub)
    return diffs


def _own_check(c: Case, outs: Sequence[Outcome], name: str) -> list[str]:
    """Checks a single run can fail on its own: an undeclared exception, or raises=True with none raised."""
    diffs = []
    for r, o in enumerate(outs):
        if o.kind == "lost" or (o.kind == "raise" and not c.raises):
            diffs.append(f"rank {r}: {name} {o.short()}")
    if c.raises and not any(o.kind == "raise" for o in outs):
        diffs.append(f"the case declares raises=True but no rank raised on {name}")
    return diffs


def reproduction(c: Case, world_size: int, door: str, device: str, nodeid: str | None) -> str:
    """The header of every failure: which run, and the commands that repeat it."""
    node = nodeid or f"tests/differential/test_differential.py::test_case[{param_id(c, world_size, door)}]"
    dev = f" --device {device}" if device != "cpu" else ""
    env = f"TENSORPLAY_DIFF_DEVICE={device} " if device != "cpu" else ""
    return (f"[differential] case={c.name} W={world_size} front_door={door} device={device} "
            f"(sim seed={SIM_SEED}, coop) vs gloo; defined in {c.module}.{c.func}\n"
            f"  reproduce: python -m pytest '{node}' -p no:xdist -q{dev}\n"
            f"         or: {env}python -c \"import tests.differential.harness as h; "
            f"h.reproduce('{c.name}', {world_size}, '{door}')\"")


def param_id(c: Case, world_size: int, door: str) -> str:
    return f"{c.name}-W{world_size}-{door}"


def _render(title: str, outs: Sequence[Outcome]) -> str:
    return "\n".join([f"  {title}:"] + [f"    rank {r}: {o.short()}" for r, o in enumerate(outs)])


def check(c: Case, world_size: int, door: str, pool_for: Callable[[int], Any] | None,
          nodeid: str | None = None, device: str = "cpu") -> None:
    """Run ``c`` at ``world_size`` through ``door`` on sim and (unless ``c.gloo``) gloo; raise on any difference.

    Through the tensorplay door the gloo run is also compared with torch.distributed's own gloo run
    of the same case, so the two front doors cannot drift apart.
    """
    sim, sim_err = run_sim(c, world_size, door, device)
    problems: list[str] = []
    sections = [_render("simulator", sim)]
    if c.expect_sim is not None:
        try:
            c.expect_sim([o.value if o.kind == "ok" else o.exc for o in sim])
        except AssertionError as e:
            problems.append(f"expect_sim failed: {e}")
    if c.gloo is None and pool_for is not None:
        gloo, gloo_err = run_gloo(c, world_size, door, pool_for(world_size), device)
        sections.append(_render(f"gloo ({door} front door)", gloo))
        if c.expect_sim is None:
            problems += compare_outcomes(c, sim, gloo)
        else:
            problems += _own_check(c, gloo, "gloo")
        if door != "torch" and c.door_drift is None:
            ref, ref_err = run_gloo(c, world_size, "torch", pool_for(world_size), device)
            sections.append(_render("gloo (torch front door)", ref))
            # tensorplay's own error classes are a documented choice: compare which ranks raised, not the class
            problems += [f"front doors drift: {d}"
                         for d in compare_outcomes(c, gloo, ref, (door, "torch"), classes=False)]
            gloo_err = gloo_err or ref_err
        if gloo_err:
            sections.append(f"  gloo pool error:\n{gloo_err}")
    elif c.expect_sim is None:
        problems += _own_check(c, sim, "sim")
    if problems:
        if sim_err:
            sections.append(f"  simulator run error:\n{sim_err}")
        raise AssertionError("\n".join([reproduction(c, world_size, door, device, nodeid), "differences:"]
                                       + [f"  {p}" for p in problems] + sections))


def reproduce(name: str, world_size: int, door: str = "torch", *, gloo: bool = True) -> None:
    """Run one case outside pytest (sim, and gloo on a fresh pool unless ``gloo=False``) and print both sides."""
    load_cases()
    c = REGISTRY[name]
    device = device_kind()
    pool = None
    try:
        def pool_for(n: int) -> Any:
            nonlocal pool
            if pool is None:
                from tensorplay.testing import RankPool

                pool = RankPool(n, call_timeout=c.timeout + _GLOO_SLACK_S)
                pool.start()
            return pool

        check(c, world_size, door, pool_for if gloo else None, device=device)
        print(f"{param_id(c, world_size, door)}: sim and gloo agree")
    finally:
        if pool is not None:
            pool.close()


def iter_params(cases: Iterable[Case]) -> Iterable[tuple[Case, int, str]]:
    """Every (case, world size, front door) to run, in a stable order."""
    for c in sorted(cases, key=lambda k: k.name):
        for w in c.world_sizes:
            for d in c.front_doors:
                yield c, w, d

