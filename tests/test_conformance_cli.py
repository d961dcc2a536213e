"""``python -m conformance`` end to end: passes on our implementation, fails (with a working
reproduction) on deliberately broken ones, and says why it skips CUDA on a CPU-only machine."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
IMPLS = Path(__file__).resolve().parent / "conformance_impls"

pytest.importorskip("tensorplay.distributed.nn.functional", reason="the autograd collectives are not built yet")


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "conformance", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def rerun_lines(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"rerun: (python -m conformance .*)", text)]


#: the simulator's two isolations: ranks as threads, ranks as processes (label sim/cpu, sim-process/cpu)
ISOLATIONS = {"thread": "sim/cpu", "process": "sim-process/cpu"}


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_sim_tiny_selection_passes(isolation: str) -> None:
    p = run_cli("--collectives", "all_reduce,scatter,all_to_all_single", "--ops", "SUM,MAX",
                "--world-sizes", "1,3", "--examples", "2", "-q", "--isolation", isolation)
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(rf"\d+ cases on {ISOLATIONS[isolation]}: \d+ passed, 0 failed", p.stdout)


@pytest.mark.gloo
def test_gloo_tiny_selection_passes() -> None:
    p = run_cli("--backend", "gloo", "--collectives", "reduce,gather,all_to_all", "--ops", "AVG,MIN",
                "--world-sizes", "2,3", "--examples", "1", "-q")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "on gloo/cpu" in p.stdout and " 0 failed" in p.stdout


# (on rank processes in the slow tier: test_sim_tiny_selection_passes runs the suite there by default)
@pytest.mark.parametrize("isolation", [pytest.param(i, marks=[pytest.mark.slow] if i == "process" else [])
                                       for i in ISOLATIONS])
def test_broken_avg_gradient_fails_with_a_reproduction_that_reruns_the_case(isolation: str) -> None:
    impl = str(IMPLS / "avg_grad_without_1_over_w.py")
    p = run_cli("--impl", impl, "--collectives", "all_reduce", "--ops", "AVG,SUM", "--world-sizes", "2,3",
                "--examples", "2", "-q", "--isolation", isolation)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "gradient: gradient differs from the reference VJP (off by a factor W=" in p.stdout
    lines = rerun_lines(p.stdout)
    assert lines and all("op=AVG" in ln and f"--impl {impl}" in ln for ln in lines)
    # the reproduction names the ranks' shapes and dtypes and the seed
    assert re.search(r"rank \d+ \(group rank \d+\): input \(.*\) \w+", p.stdout) and "seed=" in p.stdout
    # the one-line command reruns exactly that case, and it fails the same way
    again = subprocess.run(shlex.split(lines[0]), cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert again.returncode == 1, again.stdout + again.stderr
    assert f"1 cases on {ISOLATIONS[isolation]}: 0 passed, 1 failed" in again.stdout
    case_id = re.search(r"--case '([^']+)'", lines[0]).group(1)
    assert case_id in again.stdout


def test_wrong_root_fails_in_the_values_stage() -> None:
    impl = str(IMPLS / "reduce_to_first_member.py")
    case = "reduce,W=3,group=2.1,root=2,op=SUM,dtype=float64,shape=3,layout=contiguous,values=random,seed=7"
    p = run_cli("--impl", impl, "--case", case)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "values: " in p.stdout and f"--case '{case}'" in p.stdout


def test_cuda_without_a_gpu_is_skipped_with_the_reason() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    p = run_cli("--device", "cuda", "--collectives", "broadcast", "--world-sizes", "2", "--examples", "1", "-q")
    assert p.returncode == 5, p.stdout + p.stderr
    assert "skipped" in p.stdout and "no CUDA device" in p.stdout


def test_nccl_without_gpus_is_skipped_with_the_reason() -> None:
    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has GPUs")
    p = run_cli("--backend", "nccl", "--device", "cuda", "--collectives", "broadcast", "--world-sizes", "2",
                "--examples", "1", "-q")
    assert p.returncode == 5, p.stdout + p.stderr
    assert "skipped" in p.stdout


@pytest.mark.parametrize("args,message", [
    (["--backend", "gloo", "--device", "cuda"], "gloo runner uses CPU tensors"),
    (["--impl", "torch.distributed.nn.functional"], "calls torch.distributed"),
    (["--collectives", "allreduce"], "unknown allreduce"),
    (["--case", "reduce,W=2,op=AVG,dtype=int64,root=0,seed=1"], "not allowed"),
    (["--backend", "gloo", "--isolation", "process"], "rank processes are an option of the simulator"),
])
def test_bad_options_exit_2_with_the_fix(args: list[str], message: str) -> None:
    p = run_cli(*args)
    assert p.returncode == 2 and message in p.stderr, p.stderr


def test_parallel_workers_give_the_same_cases() -> None:
    args = ["--collectives", "broadcast,reduce", "--ops", "MAX", "--world-sizes", "2,3", "--examples", "2", "-q"]
    p1 = run_cli(*args)
    p2 = run_cli(*args, "-n", "2")
    assert p1.returncode == p2.returncode == 0, p2.stdout + p2.stderr
    count = re.search(r"(\d+) cases on sim/cpu", p1.stdout).group(1)
    assert f"{count} cases on sim/cpu: {count} passed" in p2.stdout
