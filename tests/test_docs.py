"""The documentation site builds cleanly: mkdocs in strict mode, API reference generated from docstrings."""
from __future__ import annotations

import subprocess

import pytest
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_docs_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    api = (tmp_path / "site" / "reference" / "distributed" / "index.html").read_text()
    assert "all_reduce" in api and "init_process_group" in api  # generated from the docstrings


def _readme_programs() -> list[tuple[int, str]]:
    """The README's Python blocks that are whole programs (they start a simulated world)."""
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks, lines, inside, start = [], [], False, 0
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip() == "```python":
            inside, lines, start = True, [], i
        elif line.strip() == "```" and inside:
            inside = False
            code = "\n".join(lines)
            if "simulator.run(" in code:
                blocks.append((start, code))
        elif inside:
            lines.append(line)
    return blocks


@pytest.mark.parametrize("line,code", _readme_programs(), ids=lambda v: f"README.md:{v}" if isinstance(v, int) else "")
def test_readme_snippets_run_as_copied(tmp_path: Path, line: int, code: str) -> None:
    """A newcomer copies a README block into a file and runs it: it must work, and print what its comments say."""
    script = tmp_path / "snippet.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, f"README.md line {line}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    for stmt in code.splitlines():  # `print(...)  # expected` lines: the comment is the documented output
        if stmt.startswith("print(") and "# " in stmt:
            expected = stmt.split("# ", 1)[1].split(":", 1)[0].strip()
            assert expected in proc.stdout, f"README.md line {line}: expected {expected!r}, got {proc.stdout!r}"
