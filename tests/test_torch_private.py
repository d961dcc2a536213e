"""The table of torch's private names the simulator depends on (simulator/adapters/torch_private.py).

Every listed name must exist in the installed torch (and standard library), and every access of a private
torch name in the simulator's source must be listed, so that a new touch of torch's internals is one more
line in the table, with its reason, and a torch upgrade has one list to check.
"""
from __future__ import annotations

import ast
import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest

from tensorplay.distributed.errors import DistRuntimeError

from simulator.adapters.torch_private import (PRIVATE_NAMES, PrivateName, _resolve, check_private_names,
                                              missing_private_names)

ROOT = Path(__file__).resolve().parents[1]
SIMULATOR = ROOT / "simulator"
_DOTTED = re.compile(r"torch(\.[A-Za-z_][A-Za-z0-9_]*)+")
_HOW = {"reads", "patches", "overrides", "subclasses"}


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


# ---------------------------------------------------------------------------
# the scan: which torch names a source file reaches
# ---------------------------------------------------------------------------
class _Scan:
    """The dotted torch names one file reaches: attribute chains on names bound to torch (imports, module-level
    assignments, ``importlib.import_module("torch...")``, ``sys.modules["torch..."]``), ``from torch... import``,
    string constants that are a dotted torch name, and the methods a subclass of a torch class overrides."""

    def __init__(self, source: str, filename: str) -> None:
        self.tree = ast.parse(source, filename)
        self.alias: dict[str, str] = {}
        self.found: set[str] = set()
        self.overrides: set[tuple[str, str]] = set()  # (torch base class, a private name defined in the subclass)

    def resolve(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return self.alias.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return None if base is None else f"{base}.{node.attr}"
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):  # sys.modules["torch..."]
            if ast.unparse(node.value) == "sys.modules" and _DOTTED.fullmatch(str(node.slice.value)):
                return str(node.slice.value)
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            if ast.unparse(node.func).endswith("import_module") and _DOTTED.fullmatch(str(node.args[0].value)):
                return str(node.args[0].value)
        return None

    def run(self) -> "_Scan":
        for node in ast.walk(self.tree):  # names bound to torch anywhere in the file
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "torch":
                        self.alias[a.asname or "torch"] = a.name if a.asname else "torch"
                        self.found.add(a.name)
            elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
                for a in node.names:
                    self.alias[a.asname or a.name] = f"{node.module}.{a.name}"
                    self.found.add(f"{node.module}.{a.name}")
        for node in self.tree.body:  # module-level aliases (``aten = torch.ops.aten``)
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                target = self.resolve(node.value)
                if target is not None:
                    self.alias[node.targets[0].id] = target
        inner = {id(n.value) for n in ast.walk(self.tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute) and id(node) not in inner:  # whole chains only
                target = self.resolve(node)
                if target is not None:
                    self.found.add(target)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.fullmatch(node.value):
                self.found.add(node.value)
            elif isinstance(node, ast.ClassDef):
                for base in filter(None, map(self.resolve, node.bases)):
                    for stmt in node.body:
                        names = [stmt.name] if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) else [
                            t.id for t in getattr(stmt, "targets", []) if isinstance(t, ast.Name)]
                        self.overrides |= {(base, n) for n in names if _private(n)}
        return self


def _is_module(name: str) -> bool:
    """Whether ``name`` is a module, found without running a module that was not imported (only packages)."""
    if name in sys.modules:
        return True
    parent, _, last = name.rpartition(".")
    if not parent:
        return importlib.util.find_spec(name) is not None
    owner = sys.modules.get(parent)
    if owner is not None and isinstance(getattr(owner, last, None), types.ModuleType):
        return True
    if not _is_module(parent):
        return False
    spec = sys.modules[parent].__spec__ if parent in sys.modules else importlib.util.find_spec(parent)
    if spec is None or spec.submodule_search_locations is None:
        return False
    return importlib.util.find_spec(name) is not None  # (runs the package above it, never the module)


def _key(name: str) -> str | None:
    """The private name ``name`` reaches: through its last private part, then on through modules to the first
    object that is not one (``torch._C.TensorBase.data`` -> ``torch._C.TensorBase``); None: nothing private."""
    parts = name.split(".")
    private = [i for i, p in enumerate(parts) if i and _private(p)]
    if not private:
        return None
    n = private[-1] + 1
    while n < len(parts) and _is_module(".".join(parts[:n])):
        n += 1
    return ".".join(parts[:n])


def _base_has(base: str, name: str) -> bool:
    try:
        return hasattr(_resolve(base), name)
    except (ImportError, AttributeError):
        return False


def _touches(source: str, filename: str) -> set[str]:
    """The private torch names ``source`` reaches (as :func:`_key` names them)."""
    scan = _Scan(source, filename).run()
    keys = {_key(name) for name in scan.found}
    # a subclass's private method overrides torch's only where torch's class has it (else it is the subclass's own)
    keys |= {f"{base}.{name}" for base, name in scan.overrides if _base_has(base, name)}
    return {k for k in keys if k is not None}


def _listed(key: str) -> bool:
    """Listed: the name itself, or a name inside it (a private module or object whose names are listed)."""
    return any(p.name == key or p.name.startswith(key + ".") for p in PRIVATE_NAMES)


# ---------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------
def test_every_listed_name_exists_in_the_installed_torch() -> None:
    check_private_names()


def test_every_private_torch_name_the_simulator_touches_is_listed() -> None:
    unlisted = []
    for path in sorted(SIMULATOR.rglob("*.py")):
        rel = path.relative_to(ROOT)
        unlisted += [f"{rel}: {key}" for key in sorted(_touches(path.read_text(), str(rel))) if not _listed(key)]
    assert not unlisted, ("list these private torch names, with what uses them and why, in "
                          "simulator/adapters/torch_private.py:\n" + "\n".join(unlisted))


def test_the_scan_finds_each_kind_of_touch() -> None:
    source = '''
import importlib, sys
import torch
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import _set_thread_isolation_mode
rdzv = importlib.import_module("torch.distributed.rendezvous")

class Group(torch.distributed.ProcessGroup):
    def _get_backend_name(self): ...
    def _own_helper(self): ...

def f():
    c10d._world.pg_names.get(1)
    rdzv._rendezvous_handlers
    sys.modules["torch.distributed.rendezvous"]._query_to_dict
    torch._C.default_generator
    torch._C._brand_new_binding
    return "torch.testing._internal.common_distributed"
'''
    assert _touches(source, "<test>") == {
        "torch._C._distributed_c10d._set_thread_isolation_mode", "torch.distributed.distributed_c10d._world",
        "torch.distributed.rendezvous._rendezvous_handlers", "torch.distributed.rendezvous._query_to_dict",
        "torch._C.default_generator", "torch._C._brand_new_binding", "torch.testing._internal.common_distributed",
        "torch.distributed.ProcessGroup._get_backend_name"}
    assert not _listed("torch._C._brand_new_binding") and _listed("torch.testing._internal.common_distributed")


def test_a_missing_name_is_named_with_what_uses_it() -> None:
    gone = [PrivateName("torch._C._no_such_binding", "adapters.torch_native", "reads", "a reason"),
            PrivateName("torch.testing._internal.common_utils.TestCase._no_such_attribute", "torch_harness", "reads",
                        "another reason", static=True),
            PrivateName("torch.distributed.distributed_c10d._world", "adapters.torch_native", "patches", "present")]
    assert missing_private_names(gone) == gone[:2]
    with pytest.raises(DistRuntimeError) as info:
        check_private_names(gone)
    message = str(info.value)
    assert "torch._C._no_such_binding (reads by simulator.adapters.torch_native: a reason)" in message
    assert "TestCase._no_such_attribute" in message and "_world" not in message
    # an optional library that is not installed is not checked
    assert missing_private_names([PrivateName("no_such_library_xyz.Thing._x", "adapters.per_rank_state", "patches",
                                              "a library a program may use", optional=True)]) == []


def test_each_record_names_modules_of_the_simulator_and_how() -> None:
    problems = []
    for p in PRIVATE_NAMES:
        if p.how not in _HOW:
            problems.append(f"{p.name}: how={p.how!r} (one of {sorted(_HOW)})")
        for user in p.users.split(", "):
            where = SIMULATOR.joinpath(*user.split("."))
            if not (where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()):
                problems.append(f"{p.name}: no module simulator.{user}")
    names = [p.name for p in PRIVATE_NAMES]
    problems += [f"{n}: listed twice" for n in sorted({n for n in names if names.count(n) > 1})]
    assert not problems, "\n".join(problems)
