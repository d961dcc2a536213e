"""The product's public surfaces: the checks both front doors share, and the names backends and transports use.

* ``tensorplay.distributed.nn.functional`` (the autograd door) imports no private name of the product: its
  checks come from :mod:`tensorplay.distributed.validation`, as the torch.distributed-style door's do.
* A backend author's names are in :mod:`tensorplay.distributed.backends.kit`, a transport author's in
  :mod:`tensorplay.distributed.rpc.transport`, the rank's world in :mod:`tensorplay.distributed.state`; the
  private names they replace keep working and are the same objects.
* The simulator imports no private product name: it is a backend and a transport like any other.
"""
from __future__ import annotations

import ast
import importlib
import threading
import types
from pathlib import Path
from typing import Any, Iterator

import pytest

import tensorplay.distributed.backends.kit as kit
import tensorplay.distributed.rpc.transport as transport
from tensorplay.distributed import _state, api, state, validation
from tensorplay.distributed.rpc import _agent, _auth, _call

ROOT = Path(__file__).resolve().parents[1]

#: private product name -> its public name (a module maps each attribute to the same-named public one)
PUBLIC_FOR: dict[str, str] = {
    "tensorplay.distributed._state": "tensorplay.distributed.state",
    "tensorplay.distributed.api._install_backend": "tensorplay.distributed.state.install_backend",
    "tensorplay.distributed.api._backend_name_refusal": "tensorplay.distributed.validation.backend_name_refusal",
    "tensorplay.distributed.rpc._agent": "tensorplay.distributed.rpc.transport",
    "tensorplay.distributed.rpc._auth": "tensorplay.distributed.rpc.transport",
    "tensorplay.distributed.rpc._call": "tensorplay.distributed.rpc.transport",
    "tensorplay.distributed.rpc.rref.RRef._wrap": "tensorplay.distributed.rpc.transport.wrap_rref",
    "tensorplay.distributed.rpc.RRef._wrap": "tensorplay.distributed.rpc.transport.wrap_rref",
}


def _resolve(dotted: str) -> Any:
    """The object a dotted name names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))


def _product_names_used(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, dotted name)`` for every product name a file imports, and every attribute it reads off one."""
    tree = ast.parse(path.read_text(), str(path))
    alias: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("tensorplay"):
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
                yield node.lineno, f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("tensorplay"):
                    alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                    yield node.lineno, a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in alias:
            yield node.lineno, f"{alias[node.value.id]}.{node.attr}"
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
              and isinstance(node.value.value, ast.Name) and node.value.value.id in alias):
            yield node.lineno, f"{alias[node.value.value.id]}.{node.value.attr}.{node.attr}"


def _public_for(dotted: str) -> str | None:
    """The public name of a private one (``None``: no entry in :data:`PUBLIC_FOR`)."""
    for private, public in PUBLIC_FOR.items():
        if dotted == private:
            return public
        if dotted.startswith(private + "."):
            return public + dotted[len(private):]
    return None


def test_the_autograd_door_imports_no_private_product_name() -> None:
    path = ROOT / "tensorplay" / "distributed" / "nn" / "functional.py"
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("tensorplay")):
            names = [f"{node.module or ''}.{a.name}" for a in node.names]
            found += [f"line {node.lineno}: from {'.' * node.level}{n.lstrip('.')}" for n in names if _private(n)]
    assert not found, found
    assert "from ..validation import" in path.read_text()


def test_the_private_names_keep_working_as_the_same_objects() -> None:
    for name in _state.__all__:
        assert getattr(_state, name) is getattr(state, name), name
    assert _state._thread is state._thread
    assert api._backend_name_refusal is validation.backend_name_refusal
    for module in (_agent, _auth, _call):
        shared = [n for n in transport.__all__ if hasattr(module, n)]
        assert shared, module
        for n in shared:
            assert getattr(transport, n) is getattr(module, n), (module.__name__, n)
    for n in kit.__all__:
        assert getattr(kit, n) is not None, n
    assert kit.state is state and kit.validation is validation


def test_state_bound_through_the_old_name_is_seen_through_the_new() -> None:
    seen: list[Any] = []
    marker = object()

    def body() -> None:
        _state.bind_thread(marker)  # type: ignore[arg-type]
        try:
            seen.append(state.current())
        finally:
            state.unbind_thread()
        seen.append(_state.current())

    t = threading.Thread(target=body)
    t.start()
    t.join(timeout=10)
    assert seen == [marker, None]


def _simulator_private_uses() -> list[tuple[str, str]]:
    out = []
    for path in sorted((ROOT / "simulator").rglob("*.py")):
        for line, dotted in _product_names_used(path):
            if _private(dotted):
                out.append((f"{path.relative_to(ROOT)}:{line}", dotted))
    return out


def test_the_simulator_uses_no_private_product_name() -> None:
    """The simulator is a backend and a transport like any other: it reaches the product through the public
    surface for their authors (backends.kit, rpc.transport, state, validation), never a private name."""
    found = [f"{where}: {dotted}" for where, dotted in _simulator_private_uses()
             if not dotted.endswith("._fields")]  # (a NamedTuple's own API, spec.CallKey._fields)
    assert not found, "use the public name instead:\n" + "\n".join(found)


def test_every_private_product_name_the_simulator_uses_has_a_public_one() -> None:
    """(The simulator imports only public names now, so this list is empty and stays so.)"""
    missing, different = [], []
    for where, dotted in _simulator_private_uses():
        if dotted.endswith("._fields"):  # a NamedTuple's own API (spec.CallKey._fields), not a product name
            continue
        public = _public_for(dotted)
        if public is None:
            missing.append(f"{where}: {dotted}")
            continue
        obj, pub = _resolve(dotted), _resolve(public)
        if isinstance(obj, types.ModuleType):
            continue  # a module maps to a module: its attributes are checked one by one
        if dotted in PUBLIC_FOR:
            assert callable(pub), (where, dotted, public)  # a function under a public name (may be a wrapper)
        elif not (obj is pub or obj == pub):  # (==: a classmethod is a new bound method on each access)
            different.append(f"{where}: {dotted} is not {public}")
    assert not missing, "private product names without a public counterpart:\n" + "\n".join(missing)
    assert not different, "\n".join(different)


def test_install_backend_through_the_public_state_in_a_simulated_world() -> None:
    simulator = pytest.importorskip("simulator")

    def body() -> tuple[bool, int]:
        st = state.current()
        return st is not None and st.world.size() == 2, st.rank

    assert simulator.run(body, 2) == [(True, 0), (True, 1)]
