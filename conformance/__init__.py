"""The conformance suite: the documented collective semantics as an executable specification.

It checks every autograd-aware collective's forward *and* gradient, for any
backend and device, against expectations computed independently of the code
under test (the spec's single-process reference differentiated by
torch.autograd, the documented backward rules, the adjoint identity and
finite differences).  Three front doors share one engine:

* the CLI: ``python -m conformance [--backend sim|gloo|nccl] [--device cpu|cuda] ...``;
* pytest: ``pytest --pyargs conformance --conformance-backend gloo ...`` (plugin :mod:`conformance.plugin`);
* this function, for your own test suite::

    import conformance

    def test_my_backend_conforms():
        result = conformance.check(backend="gloo", world_sizes=(2, 3), collectives=("all_reduce",))
        result.raise_for_failures()          # AssertionError with every reproduction

Bring your own implementation with ``impl="my_pkg.functional"`` (same
signatures as torch.distributed.nn.functional) and, if it does not use
torch.distributed's process groups, ``dist_module="my_pkg.distributed"``.
Cases come from hypothesis strategies that are public too
(:mod:`conformance.strategies`); every failure carries a one-line command that
reruns exactly that case.  See docs/conformance.md.
"""
from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "COLLECTIVES", "DEFAULT_EXAMPLES", "DEFAULT_IMPL", "DEFAULT_WORLD_SIZES", "DTYPES", "OPS", "STAGES",
    "Case", "CaseIdError", "CaseResult", "ConfigError", "Result", "Verdict", "check", "parse_case_id",
    "plan_cases", "strategies",
]

# Loaded on first use: pytest loads this package's plugin at every start-up (pytest11 entry point),
# and the modules below import torch, which costs a second that a session not using the suite
# should not pay.
_WHERE = {
    "COLLECTIVES": "cases", "DTYPES": "cases", "OPS": "cases", "Case": "cases", "CaseIdError": "cases",
    "parse_case_id": "cases", "DEFAULT_IMPL": "execute", "STAGES": "expect", "Verdict": "expect",
    "CaseResult": "report", "Result": "report", "DEFAULT_EXAMPLES": "suite", "DEFAULT_WORLD_SIZES": "suite",
    "ConfigError": "suite", "SuiteConfig": "suite", "plan_cases": "suite", "run_suite": "suite",
    "check": "api",
}


def __getattr__(name: str) -> Any:
    if name == "strategies":  # a submodule (imports hypothesis)
        return importlib.import_module(".strategies", __name__)
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'conformance' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
