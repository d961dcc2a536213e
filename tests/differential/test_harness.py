"""The harness's own comparison: it must see every kind of difference a case can show."""
from __future__ import annotations

import torch

from . import harness
from .harness import Outcome, TensorValue


def _case(**kw: object) -> harness.Case:
    opts = dict(name="t.x", fn=print, module="m", func="x", world_sizes=(2,), front_doors=("torch",), slow=False,
                gloo=None, expect_sim=None, compare="exact", timeout=1.0, raises=False, known_divergence=None)
    opts.update(kw)
    return harness.Case(**opts)  # type: ignore[arg-type]


def _t(*vals: float, dtype: torch.dtype = torch.float64) -> Outcome:
    return Outcome("ok", value=harness.normalize(torch.tensor(vals, dtype=dtype)))


def test_equal_outcomes_agree() -> None:
    assert harness.compare_outcomes(_case(), [_t(1.0, 2.0), _t(3.0)], [_t(1.0, 2.0), _t(3.0)]) == []


def test_value_dtype_shape_and_structure_differences_are_reported() -> None:
    c = _case()
    assert "rank 1" in harness.compare_outcomes(c, [_t(1.0), _t(3.0)], [_t(1.0), _t(3.5)])[0]
    assert "dtype" in harness.compare_outcomes(c, [_t(1.0)], [_t(1.0, dtype=torch.float32)])[0]
    assert "shape" in harness.compare_outcomes(c, [_t(1.0)], [_t(1.0, 1.0)])[0]
    assert "list [1] vs tuple (1,)" in harness.compare_outcomes(c, [Outcome("ok", value=[1])], [Outcome("ok", value=(1,))])[0]
    # one ulp apart: exact fails, close passes
    a, b = _t(1.0), _t(1.0 + 2 ** -52)
    assert harness.compare_outcomes(c, [a], [b])
    assert harness.compare_outcomes(_case(compare="close"), [a], [b]) == []


def test_exceptions_compare_by_nearest_builtin_class() -> None:
    from tensorplay.distributed.errors import DistValueError

    assert harness.builtin_class(DistValueError) == "ValueError"
    sim = [harness._exc_outcome(DistValueError("bad")), _t(1.0)]
    same = [harness._exc_outcome(ValueError("bad")), _t(1.0)]
    other = [harness._exc_outcome(RuntimeError("bad")), _t(1.0)]
    assert harness.compare_outcomes(_case(raises=True), sim, same) == []
    assert "exception class" in harness.compare_outcomes(_case(raises=True), sim, other)[0]
    assert "does not declare raises=True" in harness.compare_outcomes(_case(), sim, same)[0]
    # a sim error that also derives from gloo's class is catchable the same way
    class Both(ValueError, RuntimeError):
        pass

    assert harness.compare_outcomes(_case(raises=True), [harness._exc_outcome(Both("x"))], other[:1]) == []


def test_normalize_rejects_uncomparable_values() -> None:
    import pytest

    with pytest.raises(TypeError, match="not comparable"):
        harness.normalize(object())
    v = harness.normalize({"a": [torch.ones(2, requires_grad=True)]})
    assert isinstance(v["a"][0], TensorValue) and v["a"][0].requires_grad
