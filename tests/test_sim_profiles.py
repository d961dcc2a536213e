"""Cost profiles, calibration reports, traces and faults: what a new user meets when something is off.

Malformed profiles are refused with file, field, value and fix (never a raw KeyError, a hang on a FIFO, or a
model whose costs are infinite); calibration says how good its fit is and how to use the profile; a
calibrated model's repr is short; a trace file is strict JSON; a fault that never fires is reported."""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import simulator
import tensorplay.distributed as dist
from simulator.timing.calibrate import FIT_WARN_REL_ERROR, fit_profile, fit_report
from simulator.timing.cost import CLASSES, ClassCost, CostModel, Regime
from simulator.core.trace import Event, Trace
from tensorplay.distributed.errors import DistTypeError, DistValueError

SIZES = (1_000, 4_000, 16_000, 65_536, 262_144, 1_000_000, 4_000_000, 10_000_000)


def _rows(noise: dict[str, float] | None = None) -> list[dict]:
    """Synthetic measurements of every class at W=2 and 4; ``noise[cls]`` makes every other point of a class
    that many times slower (a fit cannot follow it)."""
    truth = Regime(math.inf, overhead_s=5e-5, alpha_s=2e-5, beta_s_per_byte=1e-9)
    rows = []
    for cls, algos in CLASSES.items():
        cost = ClassCost(algos[0], (truth,))
        for w in (2, 4):
            for i, s in enumerate((0,) if cls == "barrier" else SIZES):
                t = cost.time(s, w) * ((noise or {}).get(cls, 1.0) if i % 2 else 1.0)
                rows.append({"class": cls, "world_size": w, "bytes": s, "median_s": t, "samples_s": [t] * 3})
    return rows


# ---------------------------------------------------------------------------
# calibrate: the fit's error, a warning for a poor fit, how to use the profile
# ---------------------------------------------------------------------------
def test_fit_report_gives_each_class_error_and_how_to_use_the_profile() -> None:
    _, reports, _ = fit_profile(_rows())
    lines = fit_report(reports, "prof.json")
    for cls in CLASSES:
        line = next(line for line in lines if line.split()[:1] == [cls])
        assert "median 0.0%" in line and "max 0.0%" in line, line
    assert not [line for line in lines if "WARNING" in line], lines
    text = "\n".join(lines)
    assert "python -m simulator --nproc-per-node N --cost prof.json --summary script.py" in text
    assert "simulator.run(fn, N, cost='prof.json')" in text


def test_fit_report_warns_about_a_class_the_model_does_not_describe() -> None:
    _, reports, _ = fit_profile(_rows(noise={"broadcast": 3.0}))
    assert reports["broadcast"]["max_rel_error"] > FIT_WARN_REL_ERROR
    warned = [line for line in fit_report(reports) if line.startswith("WARNING")]
    assert len(warned) == 1 and warned[0].startswith("WARNING: broadcast: the fit is off by"), warned
    w = reports["broadcast"]["worst"]
    assert f"at {w['bytes']:.0f} bytes, W={w['world_size']}" in warned[0] and "--repeats" in warned[0]
    # the threshold is the caller's: a lax one lets it through
    assert not [line for line in fit_report(reports, threshold=10.0) if line.startswith("WARNING")]
    # the report of a profile written before median and worst point were recorded
    old = fit_report({"gather": {"algorithm": "ring", "regimes": 1, "rms_rel_error": 0.5, "max_rel_error": 0.9}})
    assert "median ?, max 90.0%, rms 50.0%" in old[0] and old[1].startswith("WARNING: gather: the fit is off by up "
                                                                              "to 90.0% (more than 20%)"), old


def test_calibrate_command_prints_the_report(monkeypatch, tmp_path, capsys) -> None:
    import simulator.timing.calibrate as cal

    rows = _rows(noise={"gather": 3.0})

    def fake(**kw):  # the measurement needs real processes; the report is what is tested here
        classes, reports, resid = fit_profile(rows)
        return CostModel(classes=classes, meta={"backend": "gloo", "fit": reports, "measurements": resid})

    monkeypatch.setattr(cal, "calibrate", fake)
    out = tmp_path / "p.json"
    assert cal.main(["--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert [line.split(":")[1].strip() for line in text.splitlines() if line.startswith("WARNING")] == ["gather"]
    assert f"--cost {out} --summary script.py" in text and f"cost={str(out)!r}" in text
    assert CostModel.load(out).meta["fit"]["gather"]["worst"]["rel_error"] != 0


# ---------------------------------------------------------------------------
# repr
# ---------------------------------------------------------------------------
def test_repr_of_a_calibrated_model_is_short_and_says_what_it_is(tmp_path) -> None:
    classes, reports, resid = fit_profile(_rows())
    path = tmp_path / "profile.json"
    CostModel(classes=classes, meta={"backend": "gloo", "fit": reports, "measurements": resid}).save(path)
    model = CostModel.load(path)
    text = repr(model)
    assert len(text) < 300, (len(text), text[:400])
    assert text == (f"CostModel(calibrated: {len(CLASSES)} classes, {len(resid)} points, gloo, compute_scale=1, "
                    f"source={str(path)!r})")
    assert repr(CostModel()) == "CostModel(uncalibrated, latency_s=5e-06, bandwidth_Bps=1.25e+10, compute_scale=1)"


# ---------------------------------------------------------------------------
# malformed profiles: file, field, value, fix
# ---------------------------------------------------------------------------
GOOD = {"format": "tensorplay-sim-cost/1", "latency_s": 5e-6, "classes": {"all_reduce": {
    "algorithm": "ring_allreduce",
    "regimes": [{"upto_bytes": None, "overhead_s": 1e-4, "alpha_s": 1e-5, "beta_s_per_byte": 1e-9}],
    "by_world": {"2": [{"upto_bytes": None, "overhead_s": 1e-4, "alpha_s": 1e-5, "beta_s_per_byte": 1e-9}]}}}}
REG0 = "classes.all_reduce.regimes[0]"


def _set(path: str, value) -> dict:
    """GOOD with the field at ``path`` (dots and [i]) set to ``value`` (or removed when value is _DROP)."""
    doc = copy.deepcopy(GOOD)
    keys = path.replace("[", ".").replace("]", "").split(".")
    node = doc
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    if value is _DROP:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return doc


_DROP = object()
BAD_FIELDS = [  # (field, value, what the message says)
    (f"{REG0}.alpha_s", _DROP, "is missing"),
    (f"{REG0}.alpha_s", "fast", "must be a number, not str"),
    (f"{REG0}.beta_s_per_byte", [1], "must be a number, not list"),
    (f"{REG0}.overhead_s", -1e-6, "must be a number in"),
    (f"{REG0}.alpha_s", 1e308, "must be a number in"),
    (f"{REG0}.beta_s_per_byte", math.nan, "must be a number in"),
    (f"{REG0}.upto_bytes", math.inf, "must be a number in"),
    ("latency_s", 1e308, "must be a number in"),
    ("latency_s", "5us", "must be a number, not str"),
    ("bandwidth_Bps", 0, "must be a number in"),
    ("compute_scale", True, "must be a number, not bool"),
    ("classes", [1], "must be an object"),
    ("classes.all_reduce.regimes", 5, "must be a non-empty array"),
    ("classes.all_reduce.regimes", [], "must be a non-empty array"),
    ("classes.all_reduce.algorithm", "ring2", "is not one of"),
    ("classes.all_reduce.by_world", [2], "must be an object"),
    ("classes.all_reduce.by_world.2", {"x": 1}, "must be a non-empty array"),
    ("format", _DROP, "is not 'tensorplay-sim-cost/1': not a simulator cost profile"),
]


@pytest.mark.parametrize("field,value,what", BAD_FIELDS,
                         ids=[f"{f}={'missing' if v is _DROP else v!r}" for f, v, _ in BAD_FIELDS])
def test_a_bad_field_is_refused_with_file_field_value_and_fix(tmp_path, field, value, what) -> None:
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(_set(field, value)))  # NaN/Infinity as Python writes them: what a user may have
    with pytest.raises(DistValueError) as ei:
        simulator.World(2, cost=str(path))
    msg = str(ei.value)
    assert msg.startswith(f"simulator.CostModel.load: {field} {what}"), msg
    assert f"path={str(path)!r}" in msg and f"field={field!r}" in msg, msg
    if value is not _DROP:
        assert "value=" in msg, msg
    assert "Fix: rewrite it with `python -m simulator calibrate --out PATH`" in msg, msg


def test_the_unchanged_profile_loads() -> None:
    model = CostModel.from_dict(GOOD, "good.json")
    assert model.classes["all_reduce"].by_world[2][0].alpha_s == 1e-5 and model.meta["source"] == "good.json"


def test_malformed_json_names_file_line_and_column(tmp_path) -> None:
    path = tmp_path / "prof.json"
    path.write_text('{"format": "tensorplay-sim-cost/1",\n "latency_s": 5e-6,,}')
    with pytest.raises(DistValueError, match=r"not valid JSON .*path='.*prof.json', line=2, column=20\. Fix: "):
        CostModel.load(path)
    path.write_text("[" * 100_000)  # nested beyond the parser's recursion
    with pytest.raises(DistValueError, match=r"not valid JSON \(RecursionError\)"):
        CostModel.load(path)
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(DistValueError, match=r"not valid JSON"):
        CostModel.load(path)


def test_a_hand_written_meta_does_not_break_the_summary() -> None:
    model = CostModel.from_dict({**GOOD, "machine": "my laptop"}, "p.json")
    assert model.describe().startswith("calibrated on ? (?,")


def _load_in_thread(path: str) -> list:
    """Load ``path`` on a daemon thread: a load that blocks (a FIFO's open) must not hang the test."""
    out: list = []

    def go() -> None:
        try:
            out.append(CostModel.load(path))
        except BaseException as e:  # noqa: BLE001  (the test inspects it)
            out.append(e)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # unblock it: a writer opens the FIFO and closes it at once
        with open(path, "w"):
            pass
        t.join(5)
        pytest.fail(f"loading {path} blocked")
    return out


def test_a_fifo_a_directory_and_a_device_are_refused_before_reading(tmp_path) -> None:
    fifo = tmp_path / "prof.fifo"
    os.mkfifo(fifo)
    for path, kind in [(fifo, "a FIFO (named pipe)"), (tmp_path, "a directory"), ("/dev/zero", "a character device")]:
        if not os.path.exists(path):
            continue
        (got,) = _load_in_thread(str(path))
        assert isinstance(got, DistValueError), got
        assert f"the profile path is {kind}, not a regular file" in str(got), got
        assert f"path={str(path)!r}" in str(got) and "Fix: pass the path of a profile file" in str(got)


def test_cli_cost_naming_a_fifo_exits_with_the_fix(tmp_path) -> None:
    fifo = tmp_path / "prof.fifo"
    os.mkfifo(fifo)
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    try:
        out = subprocess.run([sys.executable, "-m", "simulator", "--nproc-per-node", "2", "--cost", str(fifo),
                              str(script)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:  # subprocess.run killed it
        pytest.fail("python -m simulator --cost FIFO blocked")
    assert out.returncode == 2 and "a FIFO (named pipe), not a regular file" in out.stderr, out.stderr
    assert "ran" not in out.stdout


def test_direct_parameters_out_of_range_are_refused() -> None:
    with pytest.raises(DistValueError, match=r"CostModel: latency_s must be a number in \[0, 3600\]: latency_s=1e\+308"):
        CostModel(latency_s=1e308)
    with pytest.raises(DistValueError, match=r"compute_scale must be a number in .*compute_scale=1e\+300"):
        simulator.run(lambda: None, 2, compute_scale=1e300)
    with pytest.raises(DistValueError, match=r"Regime: alpha_s must be a number in .*alpha_s=inf"):
        Regime(math.inf, 0.0, math.inf, 0.0)
    assert Regime(math.inf, 0.0, 0.0, 0.0).upto_bytes == math.inf  # the last regime's open end


# ---------------------------------------------------------------------------
# the Chrome trace is strict JSON
# ---------------------------------------------------------------------------
def _strict(text: str):
    def refuse(token: str):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def test_a_written_trace_parses_with_a_strict_parser(tmp_path) -> None:
    def fn() -> None:
        dist.all_reduce(torch.ones(100))

    # the most expensive parameters allowed: 2(n-1) latency steps of an hour, 400 bytes at 1 B/s
    simulator.run(fn, 2, cost=CostModel(latency_s=3600.0, bandwidth_Bps=1.0, compute_scale=0.0))
    path = tmp_path / "t.json"
    simulator.last_trace().to_chrome(str(path))
    doc = _strict(path.read_text())
    assert [e["dur"] for e in doc["traceEvents"] if e["ph"] == "X"] == pytest.approx([(7200.0 + 400.0) * 1e6] * 2)


def test_a_trace_with_a_non_finite_time_is_refused_and_not_written(tmp_path) -> None:
    ok = Event(0, "all_reduce", (0, 1), 1, 4, "a.py:1", None, 0.0, 1.0, 0.0, 1e-3, None)
    bad = ok._replace(rank=1, vend=math.inf)
    tr = Trace([ok, bad], 2, seed=0, mode="coop", cost=CostModel(), wall_origin=0.0, end_vtime=[1e-3, math.inf])
    path = tmp_path / "t.json"
    with pytest.raises(DistValueError, match=r"Trace.to_chrome: the trace holds a time that is not a finite number.*"
                                             r"field='traceEvents\[4\].dur', value=inf, event='all_reduce on rank 1'"):
        tr.to_chrome(str(path))
    assert not path.exists()
    tr.to_chrome(str(path), clock="wall")  # the wall clock of the same events is finite
    assert len(_strict(path.read_text())["traceEvents"]) == 5


# ---------------------------------------------------------------------------
# faults: refused when they cannot fire, reported when they did not
# ---------------------------------------------------------------------------
def _two_ops() -> None:
    dist.all_reduce(torch.ones(2))
    dist.all_reduce(torch.ones(2))


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_fault_that_never_fires_is_reported(isolation) -> None:
    faults = [simulator.Crash(rank=2, at=3), simulator.Delay(rank=1, seconds=0.1, at=2),
              simulator.Delay(rank=0, seconds=0.1, at=5)]
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        simulator.run(_two_ops, 3, faults=faults, isolation=isolation)
    msgs = [str(w.message) for w in got if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 2, msgs  # the Delay at operation 2 fired
    assert msgs[0].startswith("simulator.run: a fault never fired: rank 0 returned after 2 operation(s), before "
                              "operation 5: fault=Delay(rank=0"), msgs
    assert msgs[1].startswith("simulator.run: a fault never fired: rank 2 returned after 2 operation(s), before "
                              "operation 3: fault=Crash(rank=2, at=3), operations=2. Fix: pass at=2 or less"), msgs


def test_a_fault_that_fires_or_whose_rank_failed_first_is_not_reported() -> None:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        simulator.run(_two_ops, 2, faults=[simulator.Delay(rank=1, seconds=0.1), simulator.Delay(rank=0, seconds=0.1, at=2)])
        with pytest.raises(simulator.InjectedFault):  # rank 0 fails first: rank 1 never reaches its crash
            simulator.run(_two_ops, 2, faults=[simulator.Crash(rank=0, at=1), simulator.Crash(rank=1, at=2)])
    assert not [w for w in got if "never fired" in str(w.message)], [str(w.message) for w in got]


def test_a_fault_in_a_rank_whose_operations_run_on_its_threads_says_so() -> None:
    def fn() -> None:
        if dist.get_rank() == 1:
            t = threading.Thread(target=_two_ops)
            t.start()
            t.join()
        else:
            _two_ops()

    with pytest.warns(RuntimeWarning, match=r"rank 1 returned after 0 operation\(s\) \(the 2 operation\(s\) of "
                                            r"threads it started are not counted\).*Fix: faults count the operations "
                                            r"of a rank's main thread only"):
        simulator.run(fn, 2, faults=[simulator.Crash(rank=1, at=1)])


@pytest.mark.parametrize("fault,err,what", [
    (simulator.Crash(rank=3, at=1), DistValueError, r"names rank 3, not a rank of the world of 3.*Fix: name a rank in 0\.\.2"),
    (simulator.Crash(rank=-1), DistValueError, r"names rank -1"),
    (simulator.Crash(rank=0, at=0), DistValueError, r"has at=0, which is not an operation number"),
    (simulator.Delay(rank=0, seconds=0.1, at=0), DistValueError, r"has at=0"),
    (simulator.Delay(rank=0, seconds=math.inf), DistValueError, r"has seconds=inf"),
    (simulator.Delay(rank=0, seconds=-1.0), DistValueError, r"has seconds=-1\.0"),
    ("crash", DistTypeError, r"faults must be simulator.Crash / simulator.Delay objects: fault='crash'"),
])
def test_a_fault_that_cannot_fire_is_refused_when_the_world_is_made(fault, err, what) -> None:
    with pytest.raises(err, match=what):
        simulator.World(3, faults=[fault])
