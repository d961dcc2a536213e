"""The product (tensorplay/) never imports the harness (simulator/, conformance/), not even in a docstring example
(a multi-rank example says ``(N ranks)`` and the doctest runner starts the ranks)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ("simulator", "conformance")


def test_tensorplay_imports_nothing_from_the_harness() -> None:
    found = []
    for path in sorted((ROOT / "tensorplay").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] in HARNESS]
    assert not found, "the product must not depend on the harness:\n" + "\n".join(found)


def test_no_product_text_imports_the_harness() -> None:
    """Docstring examples are read and copied: one that imports the simulator makes the product look dependent."""
    line = re.compile(r"^\s*(>>>\s*)?(import|from)\s+(simulator|conformance)\b")
    found = [f"{path.relative_to(ROOT)}:{i}: {text.strip()}"
             for path in sorted((ROOT / "tensorplay").rglob("*.py"))
             for i, text in enumerate(path.read_text().splitlines(), 1) if line.match(text)]
    assert not found, "write the example as '(N ranks)' instead:\n" + "\n".join(found)


def test_without_the_testing_extra_the_product_and_simulator_work() -> None:
    """``pip install .`` (no extras) leaves out ``multiprocess``: tensorplay.distributed, a simulated world and
    the conformance suite on sim still work, and the pools say which extra they need."""
    import subprocess
    import sys

    program = r'''
import sys
sys.modules["multiprocess"] = None          # as if the package were not installed
import torch
import tensorplay.distributed as dist
import simulator

def body():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()

assert simulator.run(body, 3) == [6.0, 6.0, 6.0]
import conformance
r = conformance.check(backend="sim", world_sizes=(2,), collectives=("all_reduce",), examples=3)
assert r.exit_code == 0 and len(r.results) > 0, r.failures
import tensorplay.testing as tt
assert tt.free_port() > 0
try:
    tt.RankPool
except ImportError as e:
    assert "tensorplay[testing]" in str(e), e
else:
    raise SystemExit("RankPool imported without multiprocess")
print("OK")
'''
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout + out.stderr


def test_both_schedulers_implement_the_scheduler_protocol() -> None:
    """The scheduler contract is one Protocol; each scheduler has every call, with the protocol's parameters."""
    import inspect

    from simulator.core.protocol import Scheduler
    from simulator.core.sched import CoopScheduler, ThreadScheduler

    calls = [n for n, v in vars(Scheduler).items() if callable(v) and not n.startswith("_")]
    assert len(calls) >= 10
    for cls in (CoopScheduler, ThreadScheduler):
        for name in calls:
            impl = getattr(cls, name, None)
            assert callable(impl), f"{cls.__name__} lacks {name}()"
            want = list(inspect.signature(getattr(Scheduler, name)).parameters)
            got = list(inspect.signature(impl).parameters)
            assert got[:len(want)] == want, f"{cls.__name__}.{name}{tuple(got)} does not match the protocol {want}"


def test_a_running_world_uses_a_scheduler_that_satisfies_the_protocol() -> None:
    import simulator
    from simulator.core.protocol import Scheduler
    from simulator.core.state import current_rank_state

    def body():
        return isinstance(current_rank_state().run.sched, Scheduler)

    for mode in ("coop", "threads"):
        assert simulator.run(body, 2, mode=mode) == [True, True]


def test_no_import_circles_in_any_package() -> None:
    """No module of the product, the simulator or the conformance suite imports itself back, even lazily."""
    from _support.imports import cycles, graph

    g = graph(["tensorplay", "simulator", "conformance"])
    assert {"simulator.core.state", "simulator.core.backend", "tensorplay.distributed.api"} <= set(g)
    assert "simulator.core.state" in g["simulator.core.backend"]  # the walk sees imports
    assert not cycles(g), cycles(g)


def test_the_product_does_not_branch_on_a_backend_name() -> None:
    """Backends declare what callers need (check_reinit, device_for, pins_loopback, ...): nothing in the product
    compares with a backend's name."""
    from _support.imports import files

    found = []
    for path in files(["tensorplay"]).values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                consts = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                if any(v in ("sim", "gloo", "nccl") for v in consts):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_the_product_neither_exports_nor_fetches_harness_objects() -> None:
    """No public name of a tensorplay module is a simulator/conformance object, and no product code asks a
    registry for the simulator by name (``transport("sim", ...)``): the harness registers itself."""
    import importlib
    import pkgutil

    import tensorplay

    found = []
    for info in pkgutil.walk_packages(tensorplay.__path__, "tensorplay."):
        if info.name.startswith("tensorplay.testing"):
            continue  # needs the optional extra; checked by the AST walks above
        mod = importlib.import_module(info.name)
        for name in getattr(mod, "__all__", ()):
            obj = getattr(mod, name, None)
            owner = getattr(obj, "__module__", None) or getattr(obj, "__name__", "") or ""
            if owner.split(".")[0] in HARNESS:
                found.append(f"{info.name}.{name} is {owner}'s")
    for path in sorted((ROOT / "tensorplay").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and a.value == "sim" for a in node.args):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "the product must not reach the harness:\n" + "\n".join(found)


# ---------------------------------------------------------------------------
# the simulator's wings (docs/design.md "The simulator's house")
# ---------------------------------------------------------------------------
#: wing -> the wings it may import (besides itself); the doors (top-level modules) may import any wing
WINGS: dict[str, set[str]] = {
    "core": set(),
    "timing": {"core"},
    "adapters": {"core", "timing"},
    "rpc": {"core", "adapters", "timing"},
    "isolation": {"core", "adapters", "timing", "rpc"},
    "standin": {"core", "adapters"},
}


def _wing(module: str) -> str:
    """``simulator.core.state`` -> ``core``; a top-level module of the package is a door."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in WINGS) else "doors"


def test_each_wing_imports_only_the_wings_beneath_it() -> None:
    """The core imports no other wing; the arrows between wings go one way (the table above), and no wing
    imports a door (``simulator/__init__``, cli, launch, world, the pytest plugins)."""
    from _support.imports import graph

    g = graph(["simulator"])
    found = []
    for mod, deps in sorted(g.items()):
        wing = _wing(mod)
        if wing == "doors":
            continue
        for dep in sorted(deps):
            other = _wing(dep)
            if other != wing and other not in WINGS[wing]:
                found.append(f"{mod} ({wing}) imports {dep} ({other})")
    assert {_wing(m) for m in g} >= set(WINGS) | {"doors"}, sorted({_wing(m) for m in g})
    assert not found, "arrows between the simulator's wings go one way:\n" + "\n".join(found)


def test_the_core_names_no_adapter_and_no_cost_model() -> None:
    """What the core runs on is handed in: the scheduler by the world (a factory), the cost model as a
    ``Pricing`` (timing's CostModel implements it), the scheduler's kind as its ``baton`` property."""
    from simulator.core.protocol import Pricing, Scheduler
    from simulator.core.sched import CoopScheduler, ThreadScheduler
    from simulator.timing.cost import CostModel

    assert isinstance(CostModel(), Pricing)
    assert CoopScheduler.baton is True and ThreadScheduler.baton is False
    assert "baton" in Scheduler.__annotations__
    text = "\n".join(p.read_text() for p in sorted((ROOT / "simulator" / "core").rglob("*.py")))
    assert "isinstance(run.sched" not in text and 'mode == "coop"' not in text.replace("if mode == \"coop\":", "")


def _function_level_imports(package: str) -> list[str]:
    """``file:line module`` for every import of ``package`` made inside a function, without a comment why."""
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == package:
                    name = node.module
                elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == package for a in node.names):
                    name = node.names[0].name
                else:
                    continue
                # the reason is a comment on the import's line or on the line above it
                said = "#" in lines[node.lineno - 1] or lines[node.lineno - 2].strip().startswith("#")
                if not said:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    return sorted(set(out))


def test_the_simulator_imports_its_own_modules_at_the_top() -> None:
    """An import inside a function hides the structure (and a circle): each one left says why in a comment."""
    found = _function_level_imports("simulator")
    assert not found, "move these imports to the top of the module, or say why they cannot be:\n" + "\n".join(found)
