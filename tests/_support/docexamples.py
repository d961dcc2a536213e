"""Test helper: collect the public API's docstring examples and run them as doctests (holds no tests).

One format for every example (docs/api-functional.md says it for users)::

    Example (3 ranks)::

        >>> x = tp.full((2,), float(dist.get_rank()))
        >>> dist.broadcast(x, src=2)
        >>> x
        tensor([2., 2.])

* A literal block (a paragraph ending in ``::``) whose header line mentions
  ``Example``, or that holds ``>>>`` lines, is an example; every example must
  hold ``>>>`` lines (:func:`format_problems` lists the ones that do not), and
  no ``>>>`` line may sit outside such a block (:func:`stray_prompts`).
* ``(N ranks)`` in the header: the block runs with :mod:`doctest`'s parser and
  output checker on each of N simulated ranks (``simulator.run``, coop mode,
  seed 0), every rank from a fresh namespace.  Expected output must hold on
  every rank, so per-rank results are shown with a rank-independent
  expression (``x.tolist() == [float(r), ...]`` -> ``True``) or printed only
  where a ``dist.get_rank() == k`` test says so.
* No rank count: the block runs once, in the calling process (the examples of
  ``simulator.run`` itself, of a trace, of the conformance suite).
* Every block starts in a temporary working directory (examples may write
  files such as ``f.json``) with ``tp``, ``dist``, ``df``, ``torch`` and
  ``simulator`` bound.

Ranks are threads of one process, so doctest's own runner (which swaps the
process-wide ``sys.stdout``) cannot be used per rank: :func:`run_example`
executes each ``>>>`` statement the way doctest does (compiled in ``"single"``
mode, so an expression's value is displayed) and captures what each rank
thread prints through a thread-dispatching ``sys.stdout``.
"""
from __future__ import annotations

import contextlib
import doctest
import importlib
import inspect
import io
import os
import re
import sys
import tempfile
import textwrap
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Iterator

#: modules whose docstring and public callables (``__all__``; for a class, its public methods too) are collected
MODULES = (
    "tensorplay",
    "tensorplay.distributed",
    "tensorplay.distributed.api",
    "tensorplay.distributed.nn.functional",
    "tensorplay.distributed.rpc",
    "simulator",
    "simulator.world",
    "simulator.core.trace",
    "conformance",
    "conformance.api",
)
#: packages whose objects count as ours (``tensorplay`` re-exports all of torch, which is not)
OURS = ("tensorplay", "simulator", "conformance")

_HEADER = re.compile(r"^(?P<indent>\s*)(?P<text>.*\S)::\s*$")
_RANKS = re.compile(r"\((?:[^)]*?\b)?(?P<n>\d+) ranks?\b")
_FLAGS = doctest.ELLIPSIS  # "..." in expected output matches anything; nothing else is relaxed


@dataclass(frozen=True)
class DocExample:
    """One ``Example`` literal block of one docstring."""

    qualname: str  # module.function, module.Class.method or module (its docstring)
    index: int  # position among the docstring's example blocks
    count: int  # how many example blocks the docstring has
    header: str  # the line that ends with "::"
    text: str  # the block, dedented
    world_size: int | None  # simulated ranks, or None: once in the calling process
    filename: str
    lineno: int  # line of the header in filename (0 when unknown)

    @property
    def id(self) -> str:
        return self.qualname if self.count == 1 else f"{self.qualname}#{self.index + 1}"

    @property
    def is_doctest(self) -> bool:
        return ">>>" in self.text

    def parsed(self) -> list[doctest.Example]:
        return doctest.DocTestParser().get_examples(self.text, name=self.id)


class DocExampleError(AssertionError):
    """A docstring example whose output or behaviour differs from its text."""

    def __init__(self, message: str, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank


# ---------------------------------------------------------------------------
# collection
# ---------------------------------------------------------------------------
def _blocks(doc: str) -> Iterator[tuple[int, str, str]]:
    """(line offset of the header, header text, dedented block) for every literal block of ``doc``."""
    lines = inspect.cleandoc(doc).splitlines()
    i = 0
    while i < len(lines):
        m = _HEADER.match(lines[i])
        if not m:
            i += 1
            continue
        base = len(m.group("indent"))
        j, body = i + 1, []
        while j < len(lines) and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > base):
            body.append(lines[j])
            j += 1
        while body and not body[-1].strip():
            body.pop()
        text = "\n".join(body)
        # the header is the whole paragraph that ends in "::" (a long one wraps over several lines)
        k = i
        while k > 0 and lines[k - 1].strip() and not _HEADER.match(lines[k - 1]):
            k -= 1
        header = " ".join([ln.strip() for ln in lines[k:i]] + [m.group("text").strip()])
        if text.strip():
            yield i, header, _dedent(text)
        i = max(j, i + 1)


def _dedent(text: str) -> str:
    return textwrap.dedent(text).strip("\n") + "\n"


def _is_ours(obj: Any) -> bool:
    mod = getattr(obj, "__module__", None) or ""
    return mod.split(".")[0] in OURS


def _public_objects(module: Any) -> Iterator[tuple[str, Any]]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    for name in names:
        obj = getattr(module, name, None)
        if obj is None or not (inspect.isfunction(obj) or inspect.isclass(obj)) or not _is_ours(obj):
            continue
        yield f"{obj.__module__}.{obj.__qualname__}", obj
        if inspect.isclass(obj):
            for mname, member in vars(obj).items():
                if mname.startswith("_"):
                    continue
                member = getattr(member, "__func__", member)  # classmethod / staticmethod
                if isinstance(member, property):
                    member = member.fget
                if inspect.isfunction(member):
                    yield f"{obj.__module__}.{member.__qualname__}", member


def _lineno(obj: Any, module: Any, header: str) -> tuple[str, int]:
    """File and line of the example's header (0 when the source cannot be found)."""
    try:
        target = module if inspect.ismodule(obj) else obj
        filename = inspect.getsourcefile(target) or "?"
        lines, start = inspect.getsourcelines(target)
    except (OSError, TypeError):
        return getattr(module, "__file__", "?") or "?", 0
    for k, line in enumerate(lines):
        if line.strip().endswith("::") and header.endswith(line.strip()[:-2]):
            return filename, max(start, 1) + k
    return filename, start


def docstring_examples(qualname: str, obj: Any, module: Any) -> list[DocExample]:
    """Every ``Example`` block of ``obj``'s own docstring."""
    doc = obj.__doc__ if inspect.ismodule(obj) else inspect.getdoc(obj)
    if not doc or (not inspect.ismodule(obj) and obj.__doc__ is None):
        return []
    found = [(header, text) for _, header, text in _blocks(doc) if "Example" in header or ">>>" in text]
    out = []
    for k, (header, text) in enumerate(found):
        m = _RANKS.search(header)
        filename, lineno = _lineno(obj, module, header)
        out.append(DocExample(qualname, k, len(found), header, text, int(m.group("n")) if m else None,
                              filename, lineno))
    return out


def collect(modules: tuple[str, ...] = MODULES) -> list[DocExample]:
    """Every example block of the modules' docstrings and of their public callables, each object once."""
    seen: set[int] = set()
    out: list[DocExample] = []
    for modname in modules:
        module = importlib.import_module(modname)
        out.extend(docstring_examples(modname, module, module))
        for qualname, obj in _public_objects(module):
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            out.extend(docstring_examples(qualname, obj, module))
    return out


def stray_prompts(modules: tuple[str, ...] = MODULES) -> list[str]:
    """Docstrings with ``>>>`` lines outside any collected block (they would never run): ``qualname: count``."""
    out = []
    seen: set[int] = set()
    for modname in modules:
        module = importlib.import_module(modname)
        for qualname, obj in [(modname, module), *_public_objects(module)]:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            doc = obj.__doc__ if inspect.ismodule(obj) else (inspect.getdoc(obj) if obj.__doc__ else None)
            if not doc:
                continue
            total = sum(line.lstrip().startswith(">>>") for line in doc.splitlines())
            ran = sum(line.lstrip().startswith(">>>") for ex in docstring_examples(qualname, obj, module)
                      for line in ex.text.splitlines())
            if total != ran:
                out.append(f"{qualname}: {total - ran} '>>>' line(s) outside an 'Example ...::' block")
    return out


def documented_with_example(obj: Any) -> bool:
    """Whether ``obj``'s docstring has an ``Example`` block (the no-silent-skip check uses it)."""
    doc = inspect.getdoc(obj) if obj.__doc__ else None
    return bool(doc) and any("Example" in h for _, h, _ in _blocks(doc))


def format_problems(examples: list[DocExample]) -> list[str]:
    """Example blocks that are not doctests, or that doctest's parser finds nothing to run in."""
    bad = []
    for ex in examples:
        if not ex.is_doctest:
            bad.append(f"{ex.id} ({ex.filename}:{ex.lineno}): an Example block without '>>>' lines")
        elif not ex.parsed():
            bad.append(f"{ex.id} ({ex.filename}:{ex.lineno}): no statement doctest can run")
    return bad


# ---------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------
class _ThreadStdout(io.TextIOBase):
    """A ``sys.stdout`` that sends each thread's writes to that thread's buffer, if it has one."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._local = threading.local()

    @property
    def buffer(self) -> io.StringIO | None:
        return getattr(self._local, "buf", None)

    def capture(self) -> io.StringIO:
        self._local.buf = io.StringIO()
        return self._local.buf

    def release(self) -> None:
        self._local.buf = None

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        buf = self.buffer
        (buf if buf is not None else self._real).write(s)
        return len(s)

    def flush(self) -> None:
        if self.buffer is None:
            self._real.flush()


_install_lock = threading.Lock()


@contextlib.contextmanager
def _captured_stdout() -> Iterator[_ThreadStdout]:
    with _install_lock:
        saved = sys.stdout
        proxy = _ThreadStdout(saved)
        sys.stdout = proxy
        try:
            yield proxy
        finally:
            sys.stdout = saved


@contextlib.contextmanager
def _scratch_dir() -> Iterator[str]:
    old = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="tp-docex-") as d:
        os.chdir(d)
        try:
            yield d
        finally:
            os.chdir(old)


def namespace() -> dict[str, Any]:
    """What every example starts with."""
    import torch

    import simulator
    import tensorplay
    import tensorplay.distributed
    import tensorplay.distributed.nn.functional

    return {"__name__": "__docexample__", "tp": tensorplay, "dist": tensorplay.distributed,
            "df": tensorplay.distributed.nn.functional, "torch": torch, "simulator": simulator}


def _where(ex: DocExample, rank: int | None) -> str:
    world = f"rank {rank} of a simulated world of {ex.world_size}" if rank is not None else "the calling process"
    return (f"docstring example {ex.id} failed on {world}\n"
            f"  File \"{ex.filename}\", line {ex.lineno}, in {ex.qualname}\n"
            f"  {ex.header}::\n{_indent(ex.text, 4)}")


def _indent(text: str, n: int) -> str:
    return "".join(" " * n + line if line.strip() else line for line in text.splitlines(True))


def _statement(example: doctest.Example) -> str:
    return "Failed example:\n" + _indent(example.source, 4)


def run_statements(ex: DocExample, proxy: _ThreadStdout, rank: int | None) -> None:
    """Run ``ex``'s statements in a fresh namespace on the calling thread; raise at the first difference."""
    import simulator

    checker = doctest.OutputChecker()
    globs = namespace()
    buf = proxy.capture()
    try:
        for example in ex.parsed():
            flags = _FLAGS
            for flag, on in example.options.items():
                flags = flags | flag if on else flags & ~flag
            buf.seek(0)
            buf.truncate()
            try:
                exec(compile(example.source, f"<docstring example {ex.id}>", "single"), globs)  # noqa: S102
            except simulator.SimError:
                raise  # the world failed because of another rank: the simulator reports that rank
            except Exception as e:  # an example that raises is compared like doctest does
                got_exc = "".join(traceback.format_exception_only(type(e), e))
                if example.exc_msg is None:
                    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
                    raise DocExampleError(f"{_where(ex, rank)}\n{_statement(example)}Exception raised:\n"
                                          f"{_indent(tb, 4)}", rank) from e
                if not checker.check_output(example.exc_msg, got_exc, flags):
                    raise DocExampleError(f"{_where(ex, rank)}\n{_statement(example)}Expected exception:\n"
                                          f"{_indent(example.exc_msg, 4)}Got:\n{_indent(got_exc, 4)}", rank) from e
                continue
            got = buf.getvalue()
            if example.exc_msg is not None:
                raise DocExampleError(f"{_where(ex, rank)}\n{_statement(example)}Expected an exception:\n"
                                      f"{_indent(example.exc_msg, 4)}Got output instead:\n{_indent(got, 4)}", rank)
            if not checker.check_output(example.want, got, flags):
                raise DocExampleError(f"{_where(ex, rank)}\n{checker.output_difference(example, got, flags)}",
                                      rank)
    finally:
        proxy.release()


def run_example(ex: DocExample, *, timeout: float = 30.0) -> None:
    """Run one example as its header says: on ``world_size`` simulated ranks, or once here.

    Raises :class:`DocExampleError` naming the example, its text, the rank and
    doctest's diff at the first statement whose output differs.
    """
    import simulator

    with _captured_stdout() as proxy, _scratch_dir():
        if ex.world_size is None:
            run_statements(ex, proxy, None)
            return

        def rank_body() -> None:
            import tensorplay.distributed as dist

            run_statements(ex, proxy, dist.get_rank())

        try:
            simulator.run(rank_body, ex.world_size, seed=0, mode="coop", timeout=timeout)
        except DocExampleError:
            raise
        except (simulator.SimError, BaseExceptionGroup) as e:  # the world failed: mismatch, deadlock, timeout
            rank = getattr(e, "rank", None)
            what = "".join(traceback.format_exception_only(type(e), e))
            raise DocExampleError(f"{_where(ex, rank)}\nThe simulated world failed:\n{_indent(what, 4)}", rank) from e


def manages_its_process_group(ex: DocExample) -> bool:
    """Whether ``ex`` initialises or destroys the default process group itself (a torchrun-style program)."""
    return "init_process_group(" in ex.text or "destroy_process_group(" in ex.text


def run_on_current_rank(ex: DocExample) -> None:
    """Run ``ex`` on the calling rank of an already initialised world (a gloo process of a RankPool)."""
    import tensorplay.distributed as dist

    with _captured_stdout() as proxy, _scratch_dir():
        run_statements(ex, proxy, dist.get_rank())


def run_as_torchrun_rank(example_id: str) -> None:
    """Run the example ``example_id`` in this process as one rank of a torchrun launch (``RANK`` etc. set).

    The example sets up its own process group; used for the ones that
    :func:`manages_its_process_group`.
    """
    ex = {e.id: e for e in collect()}[example_id]
    with _captured_stdout() as proxy, _scratch_dir():
        run_statements(ex, proxy, int(os.environ["RANK"]))


if __name__ == "__main__":  # python -m _support.docexamples EXAMPLE_ID: one torchrun-style rank
    try:
        run_as_torchrun_rank(sys.argv[1])
    except DocExampleError as e:
        print(e, file=sys.stderr)
        sys.exit(1)
