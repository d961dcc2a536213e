"""The documentation site builds cleanly: mkdocs in strict mode, API reference generated from docstrings.

The examples in README.md and docs/ are run by test_docs_examples.py.
"""
from __future__ import annotations

import subprocess

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_docs_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    api = (tmp_path / "site" / "reference" / "distributed" / "index.html").read_text()
    assert "all_reduce" in api and "init_process_group" in api  # generated from the docstrings
