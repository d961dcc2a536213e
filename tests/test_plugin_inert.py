"""tensorplay's pytest plugins (pytest11 entry points ``tensorplay-simulator`` and ``conformance``) load in every
pytest run of any environment where tensorplay is installed: in a project that does not use them they must
cost nothing (no torch, tensorplay or simulator import), warn about nothing, and take no name of the project's."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "tensorplay", "simulator.world", "simulator.core.backend", "conformance.suite", "conformance.cases")

CONFTEST = f'''
import sys

import pytest

HEAVY = {HEAVY!r}


def pytest_configure(config):
    # conftest files load after the entry-point plugins: this is what loading those cost
    loaded = [m for m in HEAVY if m in sys.modules]
    plugins = [p for p in ("tensorplay-simulator", "conformance") if config.pluginmanager.has_plugin(p)]
    print(f"AFTER PLUGINS: heavy={{loaded}} plugins={{plugins}}")


def pytest_sessionfinish(session):
    print(f"AT THE END: heavy={{[m for m in HEAVY if m in sys.modules]}}")


@pytest.fixture
def rank():
    return 7  # the project's own fixture of that name
'''

TESTS = '''
import warnings


def test_trivial():
    assert 1 + 1 == 2


def test_own_rank_fixture(rank):
    assert rank == 7


def test_no_warning_was_filtered_out():
    warnings.warn("the ini's filterwarnings=error is in force", UserWarning)
'''


def _unrelated_project(tmp_path: Path) -> Path:
    (tmp_path / "pytest.ini").write_text("[pytest]\nfilterwarnings =\n    error\n")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_unrelated.py").write_text(TESTS)
    return tmp_path


def _pytest(project: Path, *args: str) -> subprocess.CompletedProcess:
    # this run's own pytest settings (xdist workers, PYTEST_ADDOPTS) are not the unrelated project's
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONWARNINGS"))}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(project), "-s",
                           "-rA", *args], cwd=project, env=env, capture_output=True, text=True, timeout=300)


def test_an_unrelated_project_loads_the_plugins_and_pays_nothing(tmp_path: Path) -> None:
    project = _unrelated_project(tmp_path)
    p = _pytest(project)
    out = p.stdout + p.stderr
    # the last test raises its warning as an error: the ini's filter is in force, and nothing before it warned
    assert p.returncode == 1, out
    assert "1 failed, 2 passed" in out and "UserWarning: the ini's filterwarnings=error is in force" in out, out
    assert "AFTER PLUGINS: heavy=[] plugins=['tensorplay-simulator', 'conformance']" in out, out
    assert "AT THE END: heavy=[]" in out, out
    assert "warnings summary" not in out, out


def test_the_plugins_options_and_marker_are_registered_without_loading_anything(tmp_path: Path) -> None:
    project = _unrelated_project(tmp_path)
    help_ = _pytest(project, "--help")
    assert help_.returncode == 0, help_.stdout + help_.stderr
    assert "--sim-seed" in help_.stdout and "--conformance-backend" in help_.stdout
    assert "AFTER PLUGINS: heavy=[]" in help_.stdout, help_.stdout
    markers = _pytest(project, "--markers")
    assert "@pytest.mark.world_size(n, " in markers.stdout and "@pytest.mark.conformance" in markers.stdout
    assert "AFTER PLUGINS: heavy=[]" in markers.stdout, markers.stdout


@pytest.mark.parametrize("module", ["simulator.pytest_plugin", "conformance.plugin"])
def test_importing_a_plugin_module_imports_only_pytest(module: str) -> None:
    probe = (f"import sys; import {module}; "
             f"print(sorted(m for m in {HEAVY!r} + ('simulator.core.errors', 'conformance.api') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-W", "error", "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "[]", p.stdout + p.stderr


LAZY_PACKAGE = r'''
import sys
import simulator
assert "torch" not in sys.modules and "simulator.world" not in sys.modules, "import simulator loaded the simulator"
names = {}
exec("from simulator import *", names)
assert set(simulator.__all__) <= set(names), set(simulator.__all__) - set(names)
assert callable(simulator.explore) and simulator.explore.__module__ == "simulator.exploring"  # the function
from tensorplay.distributed.backends import _REGISTRY
from tensorplay.distributed.rpc import _agent
assert "sim" in _REGISTRY and {"sim", "sim-process"} <= set(_agent.transport_names())
assert simulator.run(lambda: 1, 2) == [1, 1]
print("OK")
'''

SUBMODULE_FIRST = r'''
import simulator.world
from tensorplay.distributed.rpc import _agent
# a world's ranks find the RPC transports (registered with the "sim" backend, which every world imports)
assert simulator.world.run(lambda: {"sim", "sim-process"} <= set(_agent.transport_names()), 2) == [True, True]
print("OK")
'''


@pytest.mark.parametrize("program", [LAZY_PACKAGE, SUBMODULE_FIRST], ids=["names", "submodule-first"])
def test_the_lazy_simulator_package_does_what_importing_it_did(program: str) -> None:
    """First use of a name imports the simulator and registers the "sim" backend and RPC transports; importing
    a world run from one of its modules first (not the package's names) finds them too."""
    p = subprocess.run([sys.executable, "-W", "error", "-c", program], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("OK"), p.stdout + p.stderr
