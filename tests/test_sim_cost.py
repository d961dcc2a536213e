"""Calibrated virtual time (issue 15): the cost model's arithmetic, profiles, the fit, honest clocks, async
overlap and the per-rank summary.  No test looks at wall time: compute is driven by a fake per-thread CPU clock
(each rank "computes" by advancing it), so every expected virtual time is exact."""
from __future__ import annotations

import builtins
import json
import math
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import simulator
import simulator.core.backend as sim_backend
import simulator.core.works as sim_works
import tensorplay.distributed as dist
from simulator.timing.calibrate import class_nbytes, fit_class, fit_profile, measure
from simulator.timing.cost import ALGORITHMS, CLASSES, ClassCost, CostModel, Regime, op_class
from tensorplay.distributed.errors import DistTypeError, DistValueError

# ---------------------------------------------------------------------------
# a fake CPU clock per thread: a rank computes `s` seconds with burn(s)
# ---------------------------------------------------------------------------
_cpu = threading.local()


def _fake_thread_time() -> float:
    return getattr(_cpu, "t", 0.0)


def burn(seconds: float) -> None:
    """What a rank's compute of ``seconds`` CPU seconds looks like to the simulator."""
    _cpu.t = getattr(_cpu, "t", 0.0) + seconds


@pytest.fixture
def fake_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(time, "thread_time", _fake_thread_time)
    monkeypatch.setattr(sim_backend, "_thread_time", _fake_thread_time)
    monkeypatch.setattr(sim_works, "_thread_time", _fake_thread_time)  # the waits mark the clock too


A, B = 1e-3, 1e6  # 1 ms per step, 1 MB/s: costs in milliseconds, easy to read
MODEL = CostModel(latency_s=A, bandwidth_Bps=B)


def ar_cost(nbytes: int, n: int) -> float:
    return 2 * (n - 1) * A + 2 * (n - 1) / n * nbytes / B


# ---------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------
def test_uncalibrated_model_keeps_the_alpha_beta_formulas() -> None:
    m = MODEL
    assert not m.calibrated and "uncalibrated" in m.describe()
    assert m.cost("all_reduce", 1000, 4) == pytest.approx(ar_cost(1000, 4))
    assert m.cost("all_gather_into_tensor", 4000, 4) == pytest.approx(3 * A + 0.75 * 4000 / B)
    assert m.cost("broadcast", 1000, 8) == pytest.approx(3 * A + 1000 / B)
    assert m.cost("send", 500, 2) == pytest.approx(A + 500 / B)
    assert m.cost("barrier", 0, 4) == pytest.approx(2 * A)
    assert m.cost("all_reduce", 10**6, 1) == 0.0 and m.cost("send", 0, 1) == pytest.approx(A)
    assert simulator.CostModel is CostModel  # the package exports the timing wing's model


def test_op_classes_cover_every_backend_operation() -> None:
    assert {op_class(o) for o in ("all_gather", "all_gather_into_tensor")} == {"all_gather"}
    assert {op_class(o) for o in ("reduce_scatter", "reduce_scatter_tensor")} == {"reduce_scatter"}
    assert {op_class(o) for o in ("all_to_all", "all_to_all_single")} == {"all_to_all"}
    assert op_class("recv") == op_class("send") == "p2p" and op_class("new_group") == "barrier"
    for cls, algos in CLASSES.items():
        assert algos and all(a in ALGORITHMS for a in algos), cls


def test_calibrated_class_uses_its_regime_and_algorithm() -> None:
    small = Regime(65536, overhead_s=1e-4, alpha_s=2e-5, beta_s_per_byte=1e-9)
    large = Regime(math.inf, overhead_s=5e-4, alpha_s=1e-5, beta_s_per_byte=3e-10)
    m = CostModel(classes={"all_reduce": ClassCost("ring_allreduce", (small, large))})
    assert m.calibrated
    n = 4
    assert m.cost("all_reduce", 1000, n) == pytest.approx(1e-4 + 2e-5 * 6 + 1e-9 * 1.5 * 1000)
    assert m.cost("all_reduce", 10**6, n) == pytest.approx(5e-4 + 1e-5 * 6 + 3e-10 * 1.5 * 10**6)
    # a class the profile lacks falls back to the alpha-beta formula
    assert m.cost("broadcast", 1000, 4) == pytest.approx(CostModel().cost("broadcast", 1000, 4))


def test_bad_parameters_and_profiles_are_refused_with_the_value(tmp_path) -> None:
    with pytest.raises(DistValueError, match=r"bandwidth_Bps=0.*Fix"):
        CostModel(bandwidth_Bps=0)
    with pytest.raises(DistValueError, match=r"compute_scale=-1"):
        simulator.run(lambda: None, 2, compute_scale=-1)
    with pytest.raises(DistTypeError, match=r"not a int.*cost=3"):
        simulator.World(2, cost=3)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(DistValueError, match=r"not a simulator cost profile.*field='format', value='something else'"):
        CostModel.load(bad)
    bad.write_text(json.dumps({"format": "tensorplay-sim-cost/1", "classes": {"allreduce": {}}}))
    with pytest.raises(DistValueError, match=r"classes.allreduce is not a collective class.*value='allreduce'"):
        CostModel.load(bad)
    bad.write_text(json.dumps({"format": "tensorplay-sim-cost/1", "classes": {"all_reduce": {
        "algorithm": "ring_allreduce", "regimes": [{"upto_bytes": None, "overhead_s": -1, "alpha_s": 0,
                                                    "beta_s_per_byte": 0}]}}}))
    with pytest.raises(DistValueError, match=r"regimes\[0\].overhead_s must be a number in \[0, 3600\].*value=-1"):
        CostModel.load(bad)
    bad.write_text("{not json")
    with pytest.raises(DistValueError, match=r"not valid JSON"):
        CostModel.load(bad)
    with pytest.raises(DistValueError, match=r"cannot read"):
        CostModel.load(tmp_path / "missing.json")


def test_profile_round_trip_and_run_with_a_profile_path(tmp_path) -> None:
    reg = Regime(math.inf, overhead_s=2e-4, alpha_s=1e-4, beta_s_per_byte=1e-8)
    m = CostModel(classes={"all_reduce": ClassCost("ring_allreduce", (reg,))}, meta={"backend": "gloo"})
    path = tmp_path / "profile.json"
    m.save(path)
    back = CostModel.load(path)
    assert back == m and back.meta["backend"] == "gloo" and back.meta["source"] == str(path)

    def fn() -> None:
        dist.all_reduce(torch.ones(250))  # 1000 bytes

    simulator.run(fn, 3, cost=str(path), compute_scale=0.0)
    tr = simulator.last_trace()
    assert tr.cost.calibrated and tr.cost.compute_scale == 0.0
    want = 2e-4 + 1e-4 * 4 + 1e-8 * (4 / 3) * 1000
    assert [e.vend for e in tr.events] == pytest.approx([want] * 3)
    assert "calibrated on gloo" in tr.format_summary()


# ---------------------------------------------------------------------------
# the fit (synthetic measurements: the fit must find what generated them)
# ---------------------------------------------------------------------------
SIZES = (1_000, 4_000, 16_000, 65_536, 262_144, 1_000_000, 4_000_000, 10_000_000)


def _points(cost: ClassCost, worlds=(2, 4)) -> list[tuple[float, int, float]]:
    return [(s, n, cost.time(s, n)) for n in worlds for s in SIZES]


def test_fit_recovers_parameters_and_algorithm() -> None:
    truth = ClassCost("ring_allreduce", (Regime(math.inf, 3e-5, 2e-5, 4e-10),))
    got, rep = fit_class(_points(truth), cls="all_reduce")
    assert got.algorithm == "ring_allreduce" and len(got.regimes) == 1
    r = got.regimes[0]
    assert (r.overhead_s, r.alpha_s, r.beta_s_per_byte) == pytest.approx((3e-5, 2e-5, 4e-10), rel=1e-6)
    assert rep["rms_rel_error"] < 1e-9 and set(rep["candidates_rms_rel_error"]) == set(CLASSES["all_reduce"])
    # a binomial broadcast (full message at every level) is told apart from a pipelined tree
    truth = ClassCost("binomial", (Regime(math.inf, 1e-5, 3e-5, 1e-9),))
    got, _ = fit_class(_points(truth), cls="broadcast")
    assert got.algorithm == "binomial"
    assert got.time(10**6, 8) == pytest.approx(truth.time(10**6, 8))  # extrapolates to W=8 by the algorithm


def test_fit_finds_a_small_large_regime_switch() -> None:
    truth = ClassCost("ring", (Regime(65_536, 1e-5, 5e-6, 5e-9), Regime(math.inf, 4e-4, 1e-5, 1e-9)))
    got, rep = fit_class(_points(truth), cls="all_gather")
    assert len(got.regimes) == 2 and got.regimes[0].upto_bytes == 65_536 and rep["max_rel_error"] < 1e-6
    # without a real break, no split is kept (it would not pay for its parameters)
    plain = ClassCost("ring", (Regime(math.inf, 1e-5, 5e-6, 1e-9),))
    noisy = [(s, n, t * (1 + 0.01 * ((i % 3) - 1))) for i, (s, n, t) in enumerate(_points(plain))]
    got, _ = fit_class(noisy, cls="all_gather")
    assert len(got.regimes) == 1


def test_fit_profile_reports_residuals_per_measurement() -> None:
    truth = ClassCost("ring", (Regime(math.inf, 1e-5, 5e-6, 1e-9),))
    rows = [{"class": "all_to_all", "world_size": n, "bytes": s, "median_s": t * 1.1 if s == 1000 else t}
            for s, n, t in _points(truth)]
    classes, reports, resid = fit_profile(rows)
    assert set(classes) == {"all_to_all"} and len(resid) == len(rows)
    for row in resid:
        assert row["error_pct"] == pytest.approx(100 * (row["predicted_s"] - row["median_s"]) / row["median_s"])
    assert reports["all_to_all"]["max_rel_error"] == pytest.approx(max(abs(r["error_pct"]) for r in resid) / 100)


def test_per_world_regimes_predict_their_size_and_round_trip(tmp_path) -> None:
    shared = (Regime(math.inf, 1e-5, 5e-6, 1e-9),)
    at4 = (Regime(math.inf, 0.0, 1e-4, 4e-9),)  # W=4 measured slower than the algorithm extrapolates
    c = ClassCost("ring", shared, {4: at4})
    assert c.time(1000, 4) == pytest.approx(1e-4 * 3 + 4e-9 * 0.75 * 1000)
    assert c.time(1000, 8) == pytest.approx(ClassCost("ring", shared).time(1000, 8))
    m = CostModel(classes={"all_gather": c})
    m.save(tmp_path / "p.json")
    assert CostModel.load(tmp_path / "p.json").classes["all_gather"].by_world == {4: at4}
    # the fit keeps a world size's own regimes only where they beat the shared fit on its points
    pts = _points(ClassCost("ring", shared), worlds=(2,)) + _points(ClassCost("ring", at4), worlds=(4,))
    got, rep = fit_class(pts, cls="all_gather")
    assert rep["rms_rel_error"] < rep["shared_fit_rms_rel_error"] and 4 in got.by_world
    assert got.time(1_000_000, 4) == pytest.approx(ClassCost("ring", at4).time(1_000_000, 4), rel=1e-6)


def test_one_world_size_fixes_the_overhead() -> None:
    truth = ClassCost("pair", (Regime(math.inf, 0.0, 5e-5, 2e-9),))
    got, rep = fit_class(_points(truth, worlds=(2,)), cls="p2p")
    assert not rep["overhead_fitted"] and got.regimes[0].overhead_s == 0.0
    assert got.time(1000, 2) == pytest.approx(truth.time(1000, 2))


def test_class_sizes_follow_the_cost_models_byte_convention() -> None:
    assert class_nbytes("all_reduce", 1000, 4) == (250, 1000)
    assert class_nbytes("all_gather", 1000, 4) == (62, 992)  # chunk per rank, full gathered size counted
    assert class_nbytes("barrier", 1000, 4) == (0, 0)


# ---------------------------------------------------------------------------
# honest clocks
# ---------------------------------------------------------------------------
def test_compute_is_charged_and_imports_are_not(fake_cpu, tmp_path, monkeypatch) -> None:
    mod = tmp_path / "slow_import_for_cost_test.py"
    mod.write_text(textwrap.dedent("""
        import builtins
        builtins._sim_cost_test_burn(5.0)   # five CPU seconds of module import: start-up, not compute
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(builtins, "_sim_cost_test_burn", burn, raising=False)
    sys.modules.pop("slow_import_for_cost_test", None)

    def fn() -> None:
        burn(0.5 * dist.get_rank())  # start-up: before the first operation, off the clock
        dist.barrier()
        if dist.get_rank() == 0:
            import slow_import_for_cost_test  # noqa: F401
        burn(0.010 * (dist.get_rank() + 1))
        dist.all_reduce(torch.ones(250))

    simulator.run(fn, 3, cost=MODEL)
    tr = simulator.last_trace()
    c, bar = ar_cost(1000, 3), MODEL.cost("barrier", 0, 3)
    rows = tr.summary()
    assert [r["startup_s"] for r in rows] == pytest.approx([0.0, 0.5, 1.0])
    assert [r["compute_s"] for r in rows] == pytest.approx([0.010, 0.020, 0.030])
    assert [r["end_s"] for r in rows] == pytest.approx([bar + 0.030 + c] * 3)  # all wait for rank 2's compute
    assert [r["exposed_s"] for r in rows] == pytest.approx([bar + 0.020 + c, bar + 0.010 + c, bar + c])
    assert "startup (s)" in tr.format_summary()
    sys.modules.pop("slow_import_for_cost_test", None)


def test_compute_scale_scales_compute_only(fake_cpu) -> None:
    def fn() -> None:
        dist.barrier()
        burn(0.100)
        dist.all_reduce(torch.ones(250))

    simulator.run(fn, 2, cost=MODEL, compute_scale=0.25)
    rows = simulator.last_trace().summary()
    bar = MODEL.cost("barrier", 0, 2)
    assert [r["end_s"] for r in rows] == pytest.approx([bar + 0.025 + ar_cost(1000, 2)] * 2)


def test_compute_after_the_last_operation_counts_and_a_silent_rank_keeps_its_compute(fake_cpu) -> None:
    def fn() -> None:
        dist.barrier()
        burn(0.2)

    simulator.run(fn, 2, cost=MODEL)
    assert [r["end_s"] for r in simulator.last_trace().summary()] == pytest.approx(
        [MODEL.cost("barrier", 0, 2) + 0.2] * 2)
    simulator.run(lambda: burn(0.3), 2, cost=MODEL)  # no operation at all: nothing to align, all compute
    assert [r["end_s"] for r in simulator.last_trace().summary()] == pytest.approx([0.3, 0.3])


# ---------------------------------------------------------------------------
# async overlap
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("compute", [0.0005, 0.050])
def test_async_op_overlapping_compute_charges_the_max(fake_cpu, compute) -> None:
    nbytes = 40_000
    c = ar_cost(nbytes, 2)  # 2 ms + 40 ms

    def fn() -> None:
        w = dist.all_reduce(torch.ones(nbytes // 4), async_op=True)
        burn(compute)
        w.wait()
        burn(0.001)
        dist.barrier()

    simulator.run(fn, 2, cost=MODEL)
    tr = simulator.last_trace()
    ar = [e for e in tr.events if e.op == "all_reduce"]
    assert all(e.async_op and e.vstart == 0.0 and e.vend == pytest.approx(c) for e in ar)
    bar = CostModel(latency_s=A, bandwidth_Bps=B).cost("barrier", 0, 2)
    for row in tr.summary():
        assert row["end_s"] == pytest.approx(max(c, compute) + 0.001 + bar)  # max, not sum
        assert row["compute_s"] == pytest.approx(compute + 0.001)
        assert row["exposed_s"] == pytest.approx(max(c - compute, 0.0) + bar)
        assert row["comm_s"] == pytest.approx(c + bar)
        assert row["end_s"] == pytest.approx(row["compute_s"] + row["exposed_s"])


def test_sync_op_then_compute_adds_up(fake_cpu) -> None:
    def fn() -> None:
        dist.all_reduce(torch.ones(250))
        burn(0.004)
        dist.all_reduce(torch.ones(250))

    simulator.run(fn, 2, cost=MODEL)
    c = ar_cost(1000, 2)
    for row in simulator.last_trace().summary():
        assert row["end_s"] == pytest.approx(2 * c + 0.004)
        assert row["exposed_s"] == pytest.approx(2 * c) == row["comm_s"]


def test_concurrent_ops_serialise_on_the_ranks_links(fake_cpu) -> None:
    c1, c2 = ar_cost(4000, 2), ar_cost(8000, 2)

    def fn() -> None:
        w1 = dist.all_reduce(torch.ones(1000), async_op=True)
        w2 = dist.all_reduce(torch.ones(2000), async_op=True)
        burn(0.001)
        w2.wait()
        w1.wait()

    simulator.run(fn, 2, cost=MODEL)
    tr = simulator.last_trace()
    for r in range(2):
        e1, e2 = sorted(tr.by_rank(r), key=lambda e: e.seq)  # recorded in the order they were waited for
        assert (e1.vstart, e1.vend) == pytest.approx((0.0, c1))
        assert e2.vend == pytest.approx(c1 + c2)  # the second starts when the first leaves the link
    assert tr.summary()[0]["end_s"] == pytest.approx(c1 + c2)


def test_async_exchange_uses_both_directions_of_the_links(fake_cpu) -> None:
    c = MODEL.cost("send", 4000, 2)

    def fn() -> None:
        me, peer = dist.get_rank(), 1 - dist.get_rank()
        out, inp = torch.full((1000,), float(me)), torch.empty(1000)
        reqs = [dist.isend(out, peer), dist.irecv(inp, peer)]
        for q in reqs:
            q.wait()
        assert inp[0].item() == peer

    simulator.run(fn, 2, cost=MODEL)
    tr = simulator.last_trace()
    assert all(e.vend == pytest.approx(c) for e in tr.events)  # full duplex: both messages at once
    assert [r["end_s"] for r in tr.summary()] == pytest.approx([c, c])


def test_ddp_style_async_bucket_overlaps_through_the_torch_adapter(fake_cpu) -> None:
    import torch.distributed as tdist

    c = ar_cost(40_000, 2)

    def fn() -> None:
        tdist.init_process_group("gloo")
        w = tdist.all_reduce(torch.ones(10_000), async_op=True)
        burn(0.030)
        w.wait()
        tdist.all_reduce(torch.ones(1))  # synchronous: issued and waited for at once

    simulator.run(fn, 2, cost=MODEL)
    tr = simulator.last_trace()
    for row in tr.summary():
        assert row["end_s"] == pytest.approx(max(c, 0.030) + ar_cost(4, 2))
    assert sorted((e.nbytes, e.async_op) for e in tr.events) == [(4, False), (4, False), (40_000, True),
                                                                  (40_000, True)]


# ---------------------------------------------------------------------------
# summary, steps, Chrome trace
# ---------------------------------------------------------------------------
def test_step_time_from_optimizer_steps(fake_cpu) -> None:
    def fn() -> None:
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        other = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)  # a second optimizer: not a step
        for _ in range(4):
            model(torch.ones(2, 4)).sum().backward()
            burn(0.005)
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            other.step()

    simulator.run(fn, 2, cost=MODEL)
    per_step = 0.005 + ar_cost(16, 2) + ar_cost(4, 2)
    for row in simulator.last_trace().summary():
        assert row["steps"] == 4
        assert row["step_s"] == pytest.approx(per_step, rel=1e-6)


def test_async_ops_get_their_own_chrome_track(fake_cpu, tmp_path) -> None:
    def fn() -> None:
        w = dist.all_reduce(torch.ones(10), async_op=True)
        dist.barrier()
        w.wait()

    simulator.run(fn, 2, cost=MODEL)
    doc = simulator.last_trace().to_chrome(str(tmp_path / "t.json"))
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"}
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    ar = [e for e in xs if e["name"] == "all_reduce"]
    assert {names[e["tid"]] for e in ar} == {"rank 0 async ops", "rank 1 async ops"}
    assert {names[e["tid"]] for e in xs if e["name"] == "barrier"} == {"rank 0", "rank 1"}
    assert "cost_model" in doc["otherData"]


def test_cli_summary_and_cost_option(tmp_path) -> None:
    reg = Regime(math.inf, overhead_s=1e-3, alpha_s=0.0, beta_s_per_byte=0.0)
    prof = tmp_path / "p.json"
    CostModel(classes={"all_reduce": ClassCost("ring_allreduce", (reg,))}, meta={"backend": "gloo"}).save(prof)
    script = tmp_path / "s.py"
    script.write_text("import torch, torch.distributed as d\nd.init_process_group('gloo')\n"
                      "for _ in range(3):\n    d.all_reduce(torch.ones(4))\n")
    out = subprocess.run([sys.executable, "-m", "simulator", "--nproc-per-node", "2", "--cost", str(prof),
                          "--compute-scale", "0", "--summary", str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "calibrated on gloo" in out.stdout and "compute_scale=0" in out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [float(r[7]) for r in rows] == pytest.approx([3e-3, 3e-3])  # end = 3 calls x 1 ms
    # a launcher script (mp.spawn): the worlds it starts use the profile too
    spawn = tmp_path / "spawn.py"
    spawn.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist, torch.multiprocessing as mp
        def run(rank, world):
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29512", rank=rank, world_size=world)
            for _ in range(2):
                dist.all_reduce(torch.ones(4))
        if __name__ == "__main__":
            mp.spawn(run, args=(2,), nprocs=2)
    """))
    out = subprocess.run([sys.executable, "-m", "simulator", "--cost", str(prof), "--compute-scale", "0",
                          "--summary", str(spawn)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [float(r[7]) for r in rows] == pytest.approx([2e-3, 2e-3])
    bad = subprocess.run([sys.executable, "-m", "simulator", "--cost", str(tmp_path / "nope.json"), str(script)],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "cannot read the profile" in bad.stderr


def test_calibrate_refuses_nccl_without_cuda_and_bad_options(tmp_path) -> None:
    from simulator.timing.calibrate import main

    if not torch.cuda.is_available():
        assert main(["--backend", "nccl", "--out", str(tmp_path / "p.json")]) == 2
    assert main(["--world-sizes", "1", "--out", str(tmp_path / "p.json")]) == 2
    assert main(["--sizes", "2", "--out", str(tmp_path / "p.json")]) == 2
    assert main(["--classes", "allreduce", "--out", str(tmp_path / "p.json")]) == 2
    assert not (tmp_path / "p.json").exists()


# ---------------------------------------------------------------------------
# calibration on real gloo processes (quick sweep; structure only, never the times' values)
# ---------------------------------------------------------------------------
@pytest.mark.gloo
@pytest.mark.xdist_group("gloo-W2")
def test_quick_calibration_on_gloo(rank_pool, tmp_path) -> None:
    pool = rank_pool(2)
    rows = measure(pool, ["all_reduce", "all_gather", "barrier", "p2p"], (1_000, 100_000), repeats=2,
                   target_s=0.001)
    assert {(r["class"], r["bytes"]) for r in rows} == {
        ("all_reduce", 1000), ("all_reduce", 100_000), ("all_gather", 1000), ("all_gather", 100_000),
        ("barrier", 0), ("p2p", 1000), ("p2p", 100_000)}
    assert all(r["median_s"] > 0 and len(r["samples_s"]) == 2 and r["world_size"] == 2 for r in rows)
    classes, reports, resid = fit_profile(rows)
    model = CostModel(classes=classes, meta={"backend": "gloo", "fit": reports, "measurements": resid})
    path = tmp_path / "profile.json"
    model.save(path)
    back = CostModel.load(path)
    assert back.classes == model.classes and back.calibrated
    assert all(math.isfinite(r["error_pct"]) for r in back.meta["measurements"])
    # non-negative parameters: never cheaper for more bytes (equal when the noise hid the slope), never free
    assert back.cost("all_reduce", 10**6, 4) >= back.cost("all_reduce", 10**3, 4) > 0
