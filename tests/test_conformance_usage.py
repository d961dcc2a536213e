"""The conformance suite used the way its docs show, as a new user would (issue 16, "rough edges").

Each test copies a documented usage into a fresh script or command line and runs it in a
subprocess with a timeout: the ``conformance.check`` example of docs/conformance.md as a script
with and without its ``if __name__ == "__main__":`` guard, a script whose own child processes
re-run an unguarded call, ``--impl torch``, ``--conformance-report`` under ``pytest -n 2``, and
the simulator plugin's failure footer when every rank raised the same error.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "conformance.md"
#: bound on one documented command; they take seconds to a minute on a loaded two-core machine
RUN_TIMEOUT_S = 600


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def python_example() -> str:
    """The Python block of the "From Python" section of docs/conformance.md, as written there."""
    section = DOC.read_text().split("### From Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def without_guard(code: str) -> str:
    """The same program with its ``if __name__ == "__main__":`` line removed and its body dedented."""
    head, body = code.split('if __name__ == "__main__":\n', 1)
    return head + textwrap.dedent(body)


def test_the_documented_example_shows_the_guard() -> None:
    code = python_example()
    assert 'if __name__ == "__main__":' in code and "conformance.check(" in code
    compile(without_guard(code), "unguarded.py", "exec")  # the variant below is the same program


@pytest.mark.gloo
@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_the_documented_example_runs_as_a_script(tmp_path: Path, guarded: bool) -> None:
    """Saved as a script, with or without the guard, the example finishes and passes: the suite's
    rank processes do not run the user's script again (they used to, and the run hung for minutes)."""
    code = python_example()
    script = tmp_path / "check_conformance.py"
    script.write_text(code if guarded else without_guard(code))
    p = _run([sys.executable, str(script)], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "bootstrapping" not in p.stderr, p.stderr[-3000:]


SELF_SPAWNING = """\
import multiprocessing
import conformance

def work():
    pass

# no guard: every child this script starts with "spawn" runs these lines again
result = conformance.check(backend="gloo", cases=[{case!r}])
print("parent passed:", result.passed, flush=True)
child = multiprocessing.get_context("spawn").Process(target=work)
child.start()
child.join(300)
print("child exit code:", child.exitcode, flush=True)
"""


@pytest.mark.gloo
def test_check_reached_while_a_child_starts_up_fails_at_once(tmp_path: Path) -> None:
    """A script that starts processes of its own and calls check() unguarded: in the parent the suite
    runs; in the child, which re-runs the script to start up, check() fails at once, naming the script
    and the guard, instead of trying to start ranks from a half-started process."""
    case = "all_reduce,W=1,group=world,op=SUM,dtype=float64,shape=2,layout=contiguous,values=random,seed=1"
    script = tmp_path / "self_spawning.py"
    script.write_text(SELF_SPAWNING.format(case=case))
    p = _run([sys.executable, str(script)], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert "parent passed: True" in p.stdout, p.stdout + p.stderr[-3000:]
    assert "child exit code: 1" in p.stdout, p.stdout + p.stderr[-3000:]
    assert "ConfigError: conformance.check() was called while this process" in p.stderr, p.stderr[-3000:]
    assert 'if __name__ == "__main__":' in p.stderr and str(script) in p.stderr, p.stderr[-3000:]


@pytest.mark.parametrize("impl", ["torch", "no_such_module_xyz"])
def test_impl_that_is_not_an_implementation_is_a_usage_error(tmp_path: Path, impl: str) -> None:
    """``--impl torch`` (whose gather/scatter are indexing ops) used to run 90 meaningless failures;
    now it and the other non-implementations exit 2 before anything runs, listing the valid values."""
    p = _run([sys.executable, "-m", "conformance", "--impl", impl, "--backend", "gloo"], tmp_path)
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr
    assert f"impl={impl!r}" in err and "Valid values: tensorplay.distributed.nn.functional" in err, err
    assert "torch.distributed.nn.functional" in err, err


@pytest.mark.parametrize("impl,why", [("torch", "indexing ops"), ("torch.distributed", "no autograd"),
                                      ("tensorplay.distributed", "no autograd"), ("torch.nn.functional", "neural")])
def test_check_refuses_non_implementations_at_once(impl: str, why: str) -> None:
    import conformance

    with pytest.raises(conformance.ConfigError, match=rf"impl='{impl}' is not an implementation.*{why}"):
        conformance.check(impl=impl, backend="gloo")


def test_pytest_n2_report_is_the_documented_pair(tmp_path: Path) -> None:
    """``--conformance-report report`` under ``-n 2`` writes report.md and report.json (not one pair per
    worker), holding every case that ran, in the planned order."""
    pytest.importorskip("xdist")
    # the documented command, narrowed to a few cases
    args = [sys.executable, "-m", "pytest", "--pyargs", "conformance", "-k", "all_reduce and MAX", "-n", "2",
            "--conformance-report", "report", "--conformance-world-sizes", "1,2", "--conformance-examples", "2",
            "-p", "no:cacheprovider", "-q"]
    p = _run(args, tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    reports = sorted(f.name for f in tmp_path.iterdir() if f.name.startswith("report"))
    assert reports == ["report.json", "report.md"], reports
    ran = int(re.search(r"(\d+) passed", p.stdout).group(1))
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["totals"]["cases"] == data["totals"]["passed"] == ran >= 4, (data["totals"], ran)
    ids = [c["id"] for c in data["cases"]]
    assert len(set(ids)) == len(ids) and all(i.startswith("all_reduce,") and "op=MAX" in i for i in ids), ids
    sizes = [int(re.search(r",W=(\d+),", i).group(1)) for i in ids]
    assert sizes == sorted(sizes), ids  # the planned order (world size 1 before 2), not the order workers ended
    md = (tmp_path / "report.md").read_text()
    assert f"{ran} cases on sim/cpu: {ran} passed" in md, md[:800]
    assert "report written to" in p.stdout and "report-gw" not in p.stdout, p.stdout[-2000:]


SAME_ERROR_TEST = """\
import pytest


@pytest.mark.world_size(2)
def test_same_error_everywhere(rank, world_size):
    raise ValueError("every rank fails the same way")
"""


def test_simulator_plugin_footer_names_every_rank_that_raised(tmp_path: Path) -> None:
    """The simulator's pytest plugin (simulator/pytest_plugin.py): when every rank raised the same
    error, the footer lists all of them, as the line above it does."""
    (tmp_path / "test_same.py").write_text(SAME_ERROR_TEST)
    p = _run([sys.executable, "-m", "pytest", "test_same.py", "-p", "no:cacheprovider", "-p", "no:xdist", "-q"],
             tmp_path)
    assert p.returncode == 1, p.stdout + p.stderr
    same = re.search(r"the same error was raised on ranks \[([\d, ]+)\]", p.stdout)
    footer = re.search(r"failed on rank\(s\) \[([\d, ]+)\]", p.stdout)
    assert same and footer, p.stdout[-3000:]
    assert same.group(1) == footer.group(1) == "0, 1", p.stdout[-3000:]
