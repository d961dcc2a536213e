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

from typing import Any, Iterable

from .cases import COLLECTIVES, DTYPES, OPS, Case, CaseIdError, parse_case_id
from .execute import DEFAULT_IMPL
from .expect import STAGES, Verdict
from .report import CaseResult, Result
from .suite import DEFAULT_EXAMPLES, DEFAULT_WORLD_SIZES, ConfigError, SuiteConfig, plan_cases, run_suite

__all__ = [
    "COLLECTIVES", "DEFAULT_EXAMPLES", "DEFAULT_IMPL", "DEFAULT_WORLD_SIZES", "DTYPES", "OPS", "STAGES",
    "Case", "CaseIdError", "CaseResult", "ConfigError", "Result", "Verdict", "check", "parse_case_id",
    "plan_cases", "strategies",
]


def _names(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise ConfigError(f"{what}={value!r} must be a list of names or a comma-separated string")
    return tuple(value)


def check(
    backend: str = "sim",
    device: str = "cpu",
    impl: str | None = None,
    world_sizes: Iterable[int] | str | None = None,
    collectives: Iterable[str] | str | None = None,
    ops: Iterable[str] | str | None = None,
    examples: int | None = None,
    seed: int = 0,
    report: str | None = None,
    *,
    dist_module: str | None = None,
    timeout: float | None = None,
    workers: int = 1,
    cases: Iterable[Case | str] | None = None,
    progress: bool = False,
) -> Result:
    """Run the conformance suite and return its :class:`Result` (it does not raise on failures).

    Args:
        backend: ``"sim"`` (in-process), ``"gloo"`` (rank processes on loopback) or ``"nccl"``.
        device: ``"cpu"`` or ``"cuda"``; without a GPU, CUDA cases are skipped with the reason.
        impl: module under test (default ``tensorplay.distributed.nn.functional``), a dotted name or a
            path to a ``.py`` file, with torch.distributed.nn.functional's signatures.
        world_sizes: e.g. ``(1, 2, 3, 4)`` (the default) or ``"2,3"``.
        collectives: restrict the matrix to these collectives (default: all).
        ops: restrict the reducing collectives to these ops (default: all).
        examples: hypothesis examples per (collective, op, world size, group kind).
        seed: the suite seed (the same options and seed give the same cases).
        report: write the report there (``x.md``, ``x.json``, or ``x`` for both).
        dist_module: the process-group module the implementation uses (default: torch.distributed for
            ``torch.*`` implementations, tensorplay.distributed otherwise).
        timeout: per-case bound in seconds (a case that runs longer fails as "timed out").
        workers: worker processes the cases are split over.
        cases: run exactly these cases (Case objects or case ids) instead of drawing them.
        progress: show the progress line on stderr.

    Example::

        result = conformance.check(backend="sim", collectives="all_reduce,broadcast", world_sizes="2,3")
        assert result.passed, result.report_markdown()
    """
    if isinstance(world_sizes, str):
        try:
            world_sizes = tuple(int(w) for w in world_sizes.split(",") if w.strip())
        except ValueError:
            raise ConfigError(f"world_sizes={world_sizes!r} must be comma-separated ints, e.g. '1,2,3,4'") from None
    cfg = SuiteConfig(
        backend=backend, device=device, impl=impl or DEFAULT_IMPL, dist_module=dist_module,
        world_sizes=tuple(world_sizes) if world_sizes is not None else DEFAULT_WORLD_SIZES,
        collectives=_names(collectives, "collectives") or COLLECTIVES,
        ops=_names(ops, "ops") or OPS,
        examples=DEFAULT_EXAMPLES if examples is None else examples,
        seed=seed, timeout=timeout, workers=workers,
        cases=tuple(cases or ()),
        command=f"conformance.check(backend={backend!r}, device={device!r}, impl={impl!r}, ...)",
    )
    result = run_suite(cfg, progress=progress)
    if report:
        result.write(report)
    return result


def __getattr__(name: str) -> Any:
    if name == "strategies":  # imports hypothesis only when asked for
        import importlib

        return importlib.import_module(".strategies", __name__)
    raise AttributeError(f"module 'conformance' has no attribute {name!r}")
