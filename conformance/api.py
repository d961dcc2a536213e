"""The public entry point of the conformance suite: :func:`check`."""
from __future__ import annotations

from typing import Any, Iterable

from .cases import COLLECTIVES, OPS, Case
from .execute import DEFAULT_IMPL
from .report import Result
from .suite import DEFAULT_EXAMPLES, DEFAULT_WORLD_SIZES, ConfigError, SuiteConfig, run_suite

__all__ = ["check"]


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

        >>> import conformance
        >>> result = conformance.check(backend="sim", collectives="all_reduce,broadcast", world_sizes="2,3")
        >>> result.passed                  # if not, result.report_markdown() says what failed and how to rerun it
        True
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
