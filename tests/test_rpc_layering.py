"""The RPC family's import rules (issue 13): no import circles, no branching on a transport's name, the
simulator's pieces in simulator/.

Every import counts, including those inside functions (a lazy import hides a circle, it does not remove
it); only ``if TYPE_CHECKING:`` blocks are left out.
"""
from __future__ import annotations

import ast
from pathlib import Path

from _support.imports import ROOT, cycles as _cycles, files as _files, imports as _imports

PRODUCT = ["tensorplay/distributed/rpc", "tensorplay/distributed/autograd", "tensorplay/distributed/optim",
           "tensorplay/distributed/nn/api", "tensorplay/testing/rpc.py"]
SIM = ["simulator/rpc/", "simulator/rpc/autograd.py", "simulator/adapters/torch_rpc.py"]


def test_no_import_circles_among_the_rpc_modules() -> None:
    files = _files(PRODUCT + SIM)
    graph = {m: _imports(m, p, set(files)) for m, p in files.items()}
    assert "tensorplay.distributed.rpc.api" in graph and "simulator.rpc" in graph  # the walk found the files
    assert graph["tensorplay.distributed.rpc.rref"], "rref imports its neighbours: the walk sees imports"
    assert not _cycles(graph), _cycles(graph)


def test_the_checker_finds_a_circle(tmp_path: Path) -> None:
    """The check above is not vacuous: an import inside a function closes a circle, and it is reported;
    one under ``if TYPE_CHECKING:`` is not an import."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import thing\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    known = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    graph = {m: _imports(m, pkg / f"{m.split('.')[-1]}.py", known) for m in ("pkg.a", "pkg.b", "pkg.c")}
    graph["pkg"] = set()
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == set()
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]


def test_the_product_does_not_branch_on_a_transport_name() -> None:
    """Callers ask the transport (registry, agent capabilities); nobody compares a kind with 'sim'/'tensorpipe'."""
    found = []
    for name, path in _files(PRODUCT).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare):
                consts = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                if any(v in ("sim", "tensorpipe") for v in consts):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_the_simulators_autograd_engine_lives_in_the_simulator() -> None:
    assert not (ROOT / "tensorplay/distributed/autograd/_sim.py").exists()
    import simulator.rpc as srpc
    import simulator.rpc.autograd as engine

    assert srpc.SimAgent.distributed_autograd(object.__new__(srpc.SimAgent)) is engine
