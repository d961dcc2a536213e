"""The product (tensorplay/) never imports the harness (simulator/, conformance/); docstring examples may use it."""
from __future__ import annotations

import ast
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
