"""The report: markdown and JSON are well-formed, failures group by cause, the JSON round-trips;
and the pytest plugin runs the suite as one test per case."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import conformance
from conformance.cases import Case
from conformance.expect import Verdict
from conformance.report import CaseResult, Progress, Result, repro_command

ROOT = Path(__file__).resolve().parents[1]


def plugin_args() -> list[str]:
    """``-p conformance.plugin`` unless the pytest11 entry point registers it already (twice is an error)."""
    from importlib.metadata import entry_points

    registered = any(ep.value.startswith("conformance.plugin") for ep in entry_points(group="pytest11"))
    return [] if registered else ["-p", "conformance.plugin"]


def sample_result() -> Result:
    cfg = {"backend": "gloo", "device": "cpu", "label": "gloo/cpu", "impl": "my.impl", "default_impl": "x",
           "dist_module": "torch.distributed", "world_sizes": [2, 3], "collectives": ["reduce", "broadcast"],
           "ops": ["SUM", "MAX"], "examples": 1, "seed": 0, "command": "python -m conformance ..."}
    ok = Case("broadcast", 2, root=1, shape=(2,), seed=1)
    bad1 = Case("reduce", 3, group=(2, 0), root=2, op="MAX", shape=(3,), seed=2)
    bad2 = Case("reduce", 2, root=0, op="MAX", shape=(1, 2), seed=3)
    hung = Case("broadcast", 3, group=(2, 1), root=1, shape=(), seed=4)
    grad = Verdict("failed", "gradient", "gradient differs from the reference VJP", "rank 2 input.grad: ...")
    res = Result(config=cfg, seconds=1.5)
    res.results = [
        CaseResult(ok, Verdict("passed"), "gloo/cpu", 0.01),
        CaseResult(bad1, grad, "gloo/cpu", 0.02, repro_command(bad1, cfg)),
        CaseResult(bad2, Verdict(grad.status, grad.stage, grad.reason, "rank 0 ..."), "gloo/cpu", 0.02,
                   repro_command(bad2, cfg)),
        CaseResult(hung, Verdict("failed", "runs", "timed out", "ranks [1, 2] never returned"), "gloo/cpu", 4.0,
                   repro_command(hung, cfg)),
    ]
    return res


def test_markdown_has_the_matrix_and_groups_failures_by_cause() -> None:
    md = sample_result().report_markdown()
    assert md.startswith("# Conformance report")
    assert "| collective | op | world gloo/cpu | subgroup gloo/cpu |" in md
    assert "| reduce | MAX | **0/1** | **0/1** |" in md
    assert "| broadcast | - | 1/1 | **0/1** |" in md
    assert "## Failures by cause" in md
    # the two gradient failures form one cause, listed first
    assert "| 1 | gradient | gradient differs from the reference VJP | 2 |" in md
    assert "| 2 | runs | timed out | 1 |" in md
    assert "rerun: python -m conformance --backend gloo --impl my.impl --case 'reduce,W=3,group=2.0" in md
    # every table row has as many cells as its header
    for block in md.split("\n\n"):
        rows = [ln for ln in block.splitlines() if ln.startswith("|")]
        if rows:
            widths = {ln.replace("\\|", "").count("|") for ln in rows}
            assert len(widths) == 1, block


def test_json_is_well_formed_and_round_trips(tmp_path: Path) -> None:
    res = sample_result()
    paths = res.write(str(tmp_path / "rep"))
    assert sorted(Path(p).name for p in paths) == ["rep.json", "rep.md"]
    data = json.loads((tmp_path / "rep.json").read_text())
    assert data["schema_version"] == 1 and data["passed"] is False and data["exit_code"] == 1
    assert data["totals"] == {"cases": 4, "passed": 1, "failed": 3, "error": 0, "skipped": 0}
    assert {c["reason"] for c in data["causes"]} == {"gradient differs from the reference VJP", "timed out"}
    cell = next(c for c in data["matrix"] if c["collective"] == "reduce" and c["group_kind"] == "subgroup")
    assert (cell["op"], cell["backend"], cell["passed"], cell["failed"]) == ("MAX", "gloo/cpu", 0, 1)
    for c in data["cases"]:
        assert conformance.parse_case_id(c["id"]).id() == c["id"]
    again = Result.from_json(data)
    assert again.to_json()["cases"] == data["cases"]
    assert again.report_markdown() == res.report_markdown()


def test_report_extension_picks_the_format(tmp_path: Path) -> None:
    res = sample_result()
    assert res.write(str(tmp_path / "a.md")) == [str(tmp_path / "a.md")]
    assert res.write(str(tmp_path / "b.json")) == [str(tmp_path / "b.json")]
    json.loads((tmp_path / "b.json").read_text())
    assert not (tmp_path / "a.json").exists()


def test_exit_codes_and_summary() -> None:
    res = sample_result()
    assert res.exit_code == 1 and not res.passed
    res.results = [r for r in res.results if r.status == "passed"]
    assert res.exit_code == 0 and res.passed
    res.results = [CaseResult(Case("broadcast", 2, root=0), Verdict("skipped", None, "no CUDA device"), "sim/cuda")]
    assert res.exit_code == 5 and not res.passed and "no CUDA device" in res.summary()


def test_raise_for_failures_carries_the_reproductions() -> None:
    with pytest.raises(AssertionError, match=r"rerun: python -m conformance"):
        sample_result().raise_for_failures()


def test_progress_updates_one_line_on_a_tty_and_prints_lines_otherwise() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    res = sample_result()
    tty = Tty()
    p = Progress(len(res.results), "gloo/cpu", stream=tty)
    for r in res.results:
        p.update(r)
    p.close()
    out = tty.getvalue()
    assert "\r" in out and out.count("\n") == 1 and "4/4" in out and "3 failed" in out
    plain = io.StringIO()
    p = Progress(len(res.results), "gloo/cpu", stream=plain, every=3600)
    for r in res.results:
        p.update(r)
    assert "\r" not in plain.getvalue() and plain.getvalue().count("\n") == 2  # the first and the last


def test_check_returns_a_result_and_writes_the_report(tmp_path: Path) -> None:
    pytest.importorskip("tensorplay.distributed.nn.functional")
    res = conformance.check(collectives="all_gather", world_sizes="2,3", examples=1, report=str(tmp_path / "r"))
    assert res.passed, res.report_markdown()
    assert (tmp_path / "r.md").exists() and json.loads((tmp_path / "r.json").read_text())["passed"]


def test_check_validates_its_arguments() -> None:
    with pytest.raises(conformance.ConfigError, match="examples=0"):
        conformance.check(examples=0)
    with pytest.raises(conformance.ConfigError, match="collectives="):
        conformance.check(collectives="allreduce")
    with pytest.raises(conformance.ConfigError, match="backend=gloo with device='cuda'"):
        conformance.check(backend="gloo", device="cuda")


def test_pytest_pyargs_runs_one_test_per_case(tmp_path: Path) -> None:
    pytest.importorskip("tensorplay.distributed.nn.functional")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(
        [sys.executable, "-m", "pytest", *plugin_args(), "--pyargs", "conformance", "-q",
         "-p", "no:cacheprovider", "--conformance-collectives", "broadcast,all_reduce", "--conformance-ops", "MAX",
         "--conformance-world-sizes", "3", "--conformance-examples", "1",
         "--conformance-report", str(tmp_path / "rep"), "-k", "broadcast or MAX"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert " passed" in p.stdout
    data = json.loads((tmp_path / "rep.json").read_text())
    assert data["passed"] and data["totals"]["cases"] >= 2
    listing = subprocess.run(
        [sys.executable, "-m", "pytest", *plugin_args(), "--pyargs", "conformance", "--collect-only",
         "-q", "-p", "no:cacheprovider", "--conformance-collectives", "reduce", "--conformance-ops", "AVG",
         "--conformance-world-sizes", "2", "--conformance-examples", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    ids = [ln for ln in listing.stdout.splitlines() if "test_case[" in ln]
    assert ids and all("test_case[reduce,W=2," in ln and "op=AVG" in ln for ln in ids), listing.stdout
