"""Every Python example in README.md and docs/ runs as a reader would run it, and says what it does.

A ```python block is one of four kinds (told apart by its text, so that a new block is checked without
registering it here):

* **signature** — ``name(params) -> result`` lines: checked against the real function's signature
  (names, kinds, defaults), so the documented signatures cannot drift from the code;
* **pytest file** — it imports pytest and defines ``test_`` functions: written to a file and run with pytest;
* **per-rank fragment** — on the pages whose examples are the body of a rank (``PER_RANK`` below): run on
  simulated ranks after the page's preamble, with ``r``/``W`` bound; the world size comes from the block's
  ``# N ranks`` / ``# W = N`` comment (default: the page's).  Claims written as ``# rank k: expr == [values]``
  (also ``ranks 0, 1:``, ``both ranks:``, ``every rank:``, ``rank i:``) are evaluated on those ranks;
* **program** — everything else: the page's blocks run in order as one script, as a reader continues
  an example from the block above (a block that starts with imports starts afresh).  A ``print(...)``
  line whose comment shows a value must print it.

Blocks that cannot run on one machine are listed in ``NOT_RUN`` with the reason; a stale entry fails.
"""
from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

@dataclass(frozen=True)
class Context:
    """How a page's fragments run: what each rank does before and after, and who runs the fragment."""

    preamble: str
    epilogue: str = ""
    ranks: tuple[int, ...] | None = None  # None: every rank runs the fragment
    world: int = 4  # when the block does not say '# N ranks' / '# W = N'


_IMPORTS = "import torch\nimport tensorplay as tp\nimport tensorplay.distributed as dist\n"
#: pages whose examples are the body of a rank, and how they run
PER_RANK = {
    "docs/collectives.md": Context(_IMPORTS + "r, W = dist.get_rank(), dist.get_world_size()\n"),
    "docs/api-functional.md": Context(_IMPORTS + "import tensorplay.distributed.nn.functional as df\n"
                                      "r, W = dist.get_rank(), dist.get_world_size()\n"),
    # the caller's side of an RPC world of three workers (worker0..worker2); a block that calls init_rpc
    # itself runs on every rank
    "docs/rpc.md": Context(_IMPORTS + "import tensorplay.distributed.rpc as rpc\n"
                           "from tensorplay.distributed.nn import RemoteModule\n"
                           "r = me = dist.get_rank()\nx = tp.randn(4, 16)\n",
                           epilogue="rpc.shutdown()\n", ranks=(0,), world=3),
}

#: (page, first line of the block) -> why the test does not run it
NOT_RUN = {
    ("docs/rpc.md", 'opts = rpc.TensorPipeRpcBackendOptions(init_method="tcp://127.0.0.1:29500", rpc_timeout=60)'):
        "one process of a real two-process TensorPipe world (a torchrun program; tests/test_rpc_torch_native.py "
        "runs such worlds)",
    ("docs/conformance.md", "from conformance.runners import PoolRunner"):
        "the skeleton of a runner for the reader's own backend ('mybackend'); tests/test_conformance_usage.py "
        "runs it with a real one",
}


@dataclass
class Block:
    page: str
    line: int  # line of the opening fence
    code: str

    @property
    def first(self) -> str:
        return next((ln for ln in self.code.splitlines() if ln.strip()), "")

    @property
    def kind(self) -> str:
        if (self.page, self.first) in NOT_RUN:
            return "not run"
        if _signatures(self.code) is not None:
            return "signature"
        if "run with: python -m pytest" in self.first or (
                re.search(r"^def test_", self.code, re.M) and re.search(r"^import pytest", self.code, re.M)):
            return "pytest file"
        if self.page in PER_RANK and "simulator.run(" not in self.code:
            return "per-rank fragment"
        return "program"

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks() -> list[Block]:
    out = []
    for page in PAGES:
        lines = (ROOT / page).read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                j = i + 1
                while lines[j].strip() != "```":
                    j += 1
                indent = len(lines[i]) - len(lines[i].lstrip())
                out.append(Block(page, i + 1, textwrap.dedent("\n".join(ln[indent:] for ln in lines[i + 1:j]))))
                i = j
            i += 1
    return out


BLOCKS = _blocks()


def _of_kind(kind: str) -> list[Block]:
    return [b for b in BLOCKS if b.kind == kind]


# -- signatures -------------------------------------------------------------------------------------
_SIG = re.compile(r"^([\w.]+)\((.*)\)\s*->\s*(.+)$", re.S)


def _signatures(code: str) -> list[tuple[str, str]] | None:
    """``[(dotted name, params)]`` when every statement of ``code`` is ``name(params) -> result``."""
    stmts, cur = [], ""
    for line in code.splitlines():
        line = line.split("  #", 1)[0].rstrip()
        if not line:
            continue
        cur = f"{cur} {line.strip()}" if cur else line.strip()
        if cur.count("(") == cur.count(")"):
            stmts.append(cur)
            cur = ""
    if cur or not stmts:
        return None
    out = []
    for stmt in stmts:
        m = _SIG.match(stmt)
        if not m:
            return None
        out.append((m.group(1), m.group(2)))
    return out


def _resolve(dotted: str) -> Any:
    import tensorplay.distributed as dist
    import tensorplay.distributed.nn.functional as df

    import simulator

    heads = {"df": df, "dist": dist, "simulator": simulator}
    head, *rest = dotted.split(".")
    obj = heads[head]
    for part in rest:
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("block", _of_kind("signature"), ids=str)
def test_documented_signatures_are_the_real_ones(block: Block) -> None:
    import tensorplay.distributed as dist

    names = {"group": dist.group, "ReduceOp": dist.ReduceOp}
    for dotted, params in _signatures(block.code) or []:
        real = inspect.signature(_resolve(dotted))
        doc = ast.parse(f"def f({params}): pass").body[0].args  # type: ignore[attr-defined]
        documented = []
        defaults = [None] * (len(doc.posonlyargs) + len(doc.args) - len(doc.defaults)) + list(doc.defaults)
        for a, d in zip(doc.posonlyargs + doc.args, defaults):
            documented.append((a.arg, "positional", d))
        if doc.vararg:
            documented.append((doc.vararg.arg, "*args", None))
        for a, d in zip(doc.kwonlyargs, doc.kw_defaults):
            documented.append((a.arg, "keyword-only", d))
        kinds = {inspect.Parameter.POSITIONAL_ONLY: "positional", inspect.Parameter.POSITIONAL_OR_KEYWORD:
                 "positional", inspect.Parameter.KEYWORD_ONLY: "keyword-only",
                 inspect.Parameter.VAR_POSITIONAL: "*args", inspect.Parameter.VAR_KEYWORD: "**kwargs"}
        actual = [(p.name, kinds[p.kind]) for p in real.parameters.values() if p.kind != p.VAR_KEYWORD]
        assert [(n, k) for n, k, _ in documented] == actual, (
            f"{block}: {dotted} is documented as ({params}) but is {real}")
        for name, _, node in documented:
            want = real.parameters[name].default
            if node is None:
                assert want is inspect.Parameter.empty, f"{block}: {dotted}({name}=...) has a default {want!r}"
                continue
            got = eval(compile(ast.Expression(node), str(block), "eval"), names)  # noqa: S307 (our own docs)
            assert got == want or got is want, f"{block}: {dotted}: documented {name}={got!r}, real {want!r}"


def test_signature_blocks_are_found() -> None:
    """The checker above checks something: the collective pages document their signatures in blocks."""
    assert len(_of_kind("signature")) >= 10, [str(b) for b in _of_kind("signature")]


# -- per-rank fragments -------------------------------------------------------------------------------
_WHO = re.compile(r"^#?\s*(?:(every rank|both ranks|rank i)|ranks?\s+([\d,\s]+?))\s*:\s*(.*)$")


def _world_size(block: Block) -> int:
    m = re.search(r"#\s*(\d+)\s+ranks\b", block.code) or re.search(r"#\s*W\s*=\s*(\d+)", block.code)
    return int(m.group(1)) if m else PER_RANK[block.page].world


def _claims(code: str, world: int) -> list[tuple[int, str, str, str]]:
    """``(rank, expr, value, text)`` for each ``rank k: expr == value`` written in the block's comments."""
    out = []
    for line in code.splitlines():
        if "#" not in line:
            continue
        for part in line.split("#", 1)[1].split(";"):
            m = _WHO.match(part.strip())
            if not m or "==" not in m.group(3):
                continue
            ranks = range(world) if m.group(1) else [int(x) for x in re.findall(r"\d+", m.group(2))]
            # 'a == [1.], b == [2.]': several claims for the same ranks
            for claim in re.split(r",\s+(?=[\w.\[\]]+\s*==)", m.group(3)):
                if "==" not in claim:
                    continue
                expr, value = (s.strip() for s in claim.split("==", 1))
                value = re.sub(r"\s*\(.*\)\s*$", "", value)  # a parenthetical remark after the value
                out += [(k, expr, value, part.strip()) for k in ranks]
    return out


def _run_fragment(block: Block, world: int, claims: list[tuple[int, str, str, str]]) -> list[Any]:
    import simulator

    ctx = PER_RANK[block.page]
    init_rpc = "rpc.init_rpc(" in block.code
    preamble = ctx.preamble + ("" if init_rpc or not ctx.epilogue else 'rpc.init_rpc(f"worker{r}")\n')

    def body() -> list[Any]:
        import tensorplay.distributed as dist

        me = dist.get_rank()
        ns: dict[str, Any] = {"__name__": "__docs_example__"}
        exec(compile(preamble, f"{block.page} (preamble)", "exec"), ns)  # noqa: S102 (our own docs)
        if ctx.ranks is None or me in ctx.ranks or init_rpc:
            exec(compile(block.code, str(block), "exec"), ns)  # noqa: S102
        exec(compile(ctx.epilogue, f"{block.page} (epilogue)", "exec"), ns)  # noqa: S102
        wrong, checked = [], 0
        for k, expr, value, text in claims:
            if k != me:
                continue
            try:
                got = eval(expr, ns)  # noqa: S307
                want = eval(value, {**ns, "i": me, "W": world})  # noqa: S307
            except Exception:  # noqa: BLE001  (prose, not a value: not a claim this checker reads)
                continue
            got, want = _plain(got), _plain(want)
            checked += 1
            if not _close(got, want):
                wrong.append(f"rank {me}: {text!r}: {expr} is {got!r}")
        return [checked, wrong]

    return simulator.run(body, world, timeout=60)


def _plain(v: Any) -> Any:
    """Tensors (also inside lists and tuples) as nested lists of numbers."""
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= 1e-5 * max(1.0, abs(b))
    return a == b


_CHECKED: dict[str, int] = {}


@pytest.mark.parametrize("block", _of_kind("per-rank fragment"), ids=str)
def test_per_rank_examples_run_and_hold(block: Block) -> None:
    world = _world_size(block)
    claims = _claims(block.code, world)
    outs = _run_fragment(block, world, claims)
    wrong = [w for _, ws in outs for w in ws]
    _CHECKED[str(block)] = sum(c for c, _ in outs)
    assert not wrong, f"{block}: the page's claims do not hold:\n" + "\n".join(wrong)


def test_the_claim_reader_reads_claims() -> None:
    """The fragments' ``rank k: x == [...]`` comments are evaluated (a reader that read none would pass)."""
    claims = [c for b in _of_kind("per-rank fragment") for c in _claims(b.code, _world_size(b))]
    assert len(claims) >= 20, claims
    b = next(b for b in _of_kind("per-rank fragment") if "df.reduce(x, dst=1" in b.code)
    false = Block(b.page, b.line, b.code.replace("x.grad == [2.]", "x.grad == [7.]"))
    [(n0, w0), (n1, w1)] = _run_fragment(false, 2, _claims(false.code, 2))
    assert n0 >= 1 and w0 and n1 >= 1 and not w1, "a false claim on rank 0 (and only there) must be reported"


# -- programs ---------------------------------------------------------------------------------------
def _starts_afresh(code: str) -> bool:
    body = [ln for ln in code.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return bool(body) and body[0].startswith(("import ", "from "))


def _scripts() -> list[tuple[str, list[Block]]]:
    """Per page, the programs as a reader runs them: each block continues the script before it.

    A whole program under ``if __name__ == "__main__":`` stands alone (the blocks after it continue the
    script before it): its rank processes import it, so nothing may be appended to its top level.
    """
    out: list[tuple[str, list[Block]]] = []
    for page in PAGES:
        chain: list[Block] = []
        for b in (b for b in BLOCKS if b.page == page and b.kind == "program"):
            if _starts_afresh(b.code) and 'if __name__ == "__main__":' in b.code:
                out.append((f"{page}:{b.line}", [b]))
                continue
            if chain and _starts_afresh(b.code):
                out.append((f"{page}:{chain[0].line}", chain))
                chain = []
            chain.append(b)
        if chain:
            out.append((f"{page}:{chain[0].line}", chain))
    return out


#: files a page's shell commands make before its Python runs (the reader ran them), and how the test makes them
MADE_BY_COMMANDS = {
    # `python -m simulator calibrate --out profile.json` (real gloo processes, minutes): a profile of that format
    "docs/simulator.md": "import simulator; simulator.CostModel().save('profile.json')",
}


@pytest.mark.parametrize("name,chain", _scripts(), ids=[n for n, _ in _scripts()])
def test_programs_run_as_copied_and_print_what_they_say(tmp_path: Path, name: str, chain: list[Block]) -> None:
    setup = MADE_BY_COMMANDS.get(chain[0].page)
    if setup:
        subprocess.run([sys.executable, "-c", setup], cwd=tmp_path, check=True, timeout=120)
    parts, origin = [], []
    for b in chain:
        parts.append(b.code)
        origin += [str(b)] * (b.code.count("\n") + 1)
    script = tmp_path / "example.py"
    script.write_text("\n".join(parts) + "\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    where = ", ".join(str(b) for b in chain)
    assert proc.returncode == 0, f"{where}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
    for b in chain:
        for stmt in b.code.splitlines():
            expected = _shown(stmt)
            if expected is not None:
                assert expected in proc.stdout, f"{b}: expected {expected!r} in the output, got {proc.stdout!r}"


def _shown(stmt: str) -> str | None:
    """What a ``print(...)  # value`` line documents as its output (None: the comment is prose).

    The value is the comment up to a ``:`` remark; prose ("per rank: ...") is told from a value by its
    words: a value is one token (``DeadlockError``, ``2``) or starts like a literal or a repr.
    """
    stmt = stmt.strip()
    if not stmt.startswith("print(") or "# " not in stmt:
        return None
    value = stmt.split("# ", 1)[1].split(": ", 1)[0].strip()
    if " " not in value or re.match(r"^([\[({'\"\-\d]|\w+\()", value):
        return value
    return None


@pytest.mark.parametrize("block", _of_kind("pytest file"), ids=str)
def test_pytest_examples_pass(tmp_path: Path, block: Block) -> None:
    name = re.search(r"(test_\w+\.py)", block.first)
    path = tmp_path / (name.group(1) if name else "test_example.py")
    path.write_text(block.code)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, f"{block}: {proc.stdout[-3000:]}{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout


def test_not_run_entries_are_current() -> None:
    found = {(b.page, b.first) for b in BLOCKS}
    stale = [k for k in NOT_RUN if k not in found]
    assert not stale, f"NOT_RUN names blocks the docs no longer have: {stale}"
