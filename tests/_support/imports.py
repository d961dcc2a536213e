"""Import-graph helpers for the layering tests: which modules a file imports, and the circles among them.

Every import counts, including those inside functions (a lazy import hides a circle, it does not remove
it); only ``if TYPE_CHECKING:`` blocks are left out.
"""
from __future__ import annotations

import ast
from pathlib import Path

__all__ = ["ROOT", "files", "imports", "cycles", "graph"]

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def files(spec: list[str]) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for s in spec:
        p = ROOT / s
        for f in ([p] if p.is_file() else sorted(p.rglob("*.py"))):
            out[module_name(f)] = f
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports (anywhere but under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    found: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            # ``from pkg import sub`` imports the submodule; ``from pkg import name`` runs pkg/__init__
            cands = subs if len(subs) == len(node.names) else [target, *subs]
        elif isinstance(node, ast.Import):
            cands = [a.name for a in node.names]
        else:
            continue
        found |= {c for c in cands if c in known and c != name}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def graph(spec: list[str]) -> dict[str, set[str]]:
    """The import graph of the modules under ``spec`` (paths relative to the repository)."""
    found = files(spec)
    return {m: imports(m, p, set(found)) for m, p in found.items()}
