"""The dependency set is honest: bounded both ways, satisfied by what is installed, and CI runs the README.

A fresh machine resolves the newest versions the project allows; a requirement without an upper bound lets
a future major release into a green project without anyone running it (cloudpickle 3.1.3 changed what a
pickled closure's code says about its file).  These checks read pyproject.toml, README.md and .ci/run.
"""
from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements() -> list[tuple[str, Requirement]]:
    out = [("dependencies", Requirement(r)) for r in PROJECT["dependencies"]]
    for extra, reqs in PROJECT["optional-dependencies"].items():
        out += [(f"[{extra}]", Requirement(r)) for r in reqs]
    return out


@pytest.mark.parametrize("where,req", _requirements(), ids=lambda v: str(v))
def test_every_requirement_has_a_lower_and_an_upper_bound(where: str, req: Requirement) -> None:
    ops = {spec.operator for spec in req.specifier}
    assert ops & {">=", "~=", "=="}, f"{where}: {req} has no lower bound; add '>=' the oldest release tested"
    assert ops & {"<", "~=", "=="}, (f"{where}: {req} has no upper bound; add '<' the next release that may "
                                     f"break the project (its next major)")


@pytest.mark.parametrize("where,req", _requirements(), ids=lambda v: str(v))
def test_what_is_installed_is_what_the_project_allows(where: str, req: Requirement) -> None:
    try:
        installed = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{req.name} is not installed here (extra {where})")
    # a local build label (torch's '+cpu') is the same release for the purpose of the bounds
    assert req.specifier.contains(Version(installed).public, prereleases=True), (
        f"{req.name}=={installed} is installed, but {where} asks for {req}")


def _fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_ci_builds_a_fresh_environment_and_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Set up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    commands = [block.strip() for block in _fenced(section, "bash")]
    setup = [c for c in commands if "pip install" in c and "-e" in c]
    assert len(setup) == 2, f"README's set-up section should have exactly two set-up commands, found {setup}"
    assert any("python -m conformance" in c for c in setup), setup
    tests = [c for c in setup if "pytest" in c]
    assert len(tests) == 1, setup
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests[0] in ci.splitlines(), f".ci/run must run README's test command as written: {tests[0]!r}"
    venv_line = next((i for i, line in enumerate(ci.splitlines()) if re.search(r"-m venv\b", line)), None)
    run_line = ci.splitlines().index(tests[0])
    assert venv_line is not None and venv_line < run_line, ".ci/run must install into a fresh virtual environment"


def test_readme_pins_the_torch_release_the_dependencies_allow() -> None:
    readme = (ROOT / "README.md").read_text()
    pins = set(re.findall(r"torch==([0-9][0-9.]*)", readme))
    torch_req = next(Requirement(r) for r in PROJECT["dependencies"] if r.startswith("torch"))
    assert pins, "README's install commands pin a torch release"
    for pin in pins:
        assert torch_req.specifier.contains(pin), f"README pins torch=={pin}, outside {torch_req}"
