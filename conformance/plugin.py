"""pytest plugin: ``pytest --pyargs conformance`` runs the suite, one test per case, ids = case ids.

Registered through the ``pytest11`` entry point (``conformance = "conformance.plugin"``),
or by hand with ``pytest -p conformance.plugin``.  It adds the CLI's options
with a ``--conformance-`` prefix, registers the ``conformance`` marker, offers
fixtures for other suites and writes the report at the end of the session::

    pytest --pyargs conformance --conformance-backend gloo --conformance-world-sizes 2,3
    pytest --pyargs conformance -k "reduce and MAX" -n 2     # -k matches case ids; xdist works
    pytest --pyargs conformance --conformance-report conformance-report   # .md and .json

Fixtures: ``conformance_config`` (the :class:`~conformance.suite.SuiteConfig` from
the options) and ``conformance_runner`` (a session-wide runner; gloo pools are
started once per world size and reused).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import pytest

if TYPE_CHECKING:  # pragma: no cover
    from .report import CaseResult
    from .suite import SuiteConfig

# Nothing here imports torch at module level: pytest loads this plugin at every start-up, in every
# project where tensorplay is installed.  The suite's modules are imported when a session uses them.

__all__ = ["config_from_pytest", "results_of"]

_RESULTS = pytest.StashKey[list]()
_OPTIONS = [
    # (name, kwargs)
    ("--conformance-backend", dict(choices=("sim", "gloo", "nccl"), default=None,
                                   help="where the ranks run: sim (default), gloo or nccl")),
    ("--conformance-device", dict(choices=("cpu", "cuda"), default=None, help="tensor device (default cpu)")),
    ("--conformance-world-sizes", dict(default=None, metavar="1,2,3,4", help="world sizes (default 1,2,3,4)")),
    ("--conformance-collectives", dict(default=None, metavar="NAMES",
                                       help="comma-separated collectives (default all; `python -m conformance "
                                            "--help` lists them)")),
    ("--conformance-ops", dict(default=None, metavar="OPS",
                               help="comma-separated reduce ops (default all): SUM, AVG, PRODUCT, MIN, MAX, ...")),
    ("--conformance-examples", dict(type=int, default=None, metavar="N",
                                    help="examples per (collective, op, world size, group kind) (default: the "
                                         "CLI's)")),
    ("--conformance-seed", dict(type=int, default=None, metavar="S", help="suite seed (default 0)")),
    ("--conformance-impl", dict(default=None, metavar="MODULE",
                                help="module under test (default tensorplay.distributed.nn.functional); dotted "
                                     "name or .py path")),
    ("--conformance-dist-module", dict(default=None, metavar="MODULE",
                                       help="process-group module of the implementation")),
    ("--conformance-report", dict(default=None, metavar="FILE",
                                  help="write the report to FILE.md / FILE.json (both without an extension)")),
    ("--conformance-timeout", dict(type=float, default=None, metavar="SECONDS", help="per-case bound")),
    ("--conformance-case", dict(action="append", default=None, metavar="ID",
                                help="run exactly this case id (repeatable)")),
]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("conformance", "tensorplay conformance suite (pytest --pyargs conformance)")
    for name, kwargs in _OPTIONS:
        group.addoption(name, **kwargs)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "conformance: one case of the tensorplay conformance suite")
    config.stash[_RESULTS] = []


def _opt(config: pytest.Config, name: str) -> Any:
    try:
        return config.getoption(name)
    except ValueError:  # the plugin is not loaded: defaults
        return None


def config_from_pytest(config: pytest.Config) -> "SuiteConfig":
    """The suite configuration the ``--conformance-*`` options describe (defaults without the plugin)."""
    from .cases import COLLECTIVES, OPS, parse_case_id
    from .execute import DEFAULT_IMPL
    from .suite import DEFAULT_EXAMPLES, DEFAULT_WORLD_SIZES, SuiteConfig

    def csv(v: str | None) -> tuple[str, ...] | None:
        return None if v is None else tuple(t.strip() for t in v.split(",") if t.strip())

    ws = csv(_opt(config, "conformance_world_sizes"))
    cases = tuple(parse_case_id(c) for c in (_opt(config, "conformance_case") or ()))
    cfg = SuiteConfig(
        backend=_opt(config, "conformance_backend") or "sim",
        device=_opt(config, "conformance_device") or "cpu",
        impl=_opt(config, "conformance_impl") or DEFAULT_IMPL,
        dist_module=_opt(config, "conformance_dist_module"),
        world_sizes=tuple(int(w) for w in ws) if ws else DEFAULT_WORLD_SIZES,
        collectives=csv(_opt(config, "conformance_collectives")) or COLLECTIVES,
        ops=csv(_opt(config, "conformance_ops")) or OPS,
        examples=_opt(config, "conformance_examples") or DEFAULT_EXAMPLES,
        seed=_opt(config, "conformance_seed") or 0,
        timeout=_opt(config, "conformance_timeout"),
        cases=cases,
        command="pytest --pyargs conformance " + " ".join(config.invocation_params.args),
    )
    try:
        return cfg.validate()
    except ValueError as e:
        raise pytest.UsageError(f"conformance: {e}") from None


def results_of(config: pytest.Config) -> "list[CaseResult]":
    """The case results recorded so far in this session (the report is built from them)."""
    if _RESULTS not in config.stash:
        config.stash[_RESULTS] = []
    return config.stash[_RESULTS]


@pytest.fixture(scope="session")
def conformance_config(pytestconfig: pytest.Config) -> "SuiteConfig":
    """The session's :class:`~conformance.suite.SuiteConfig`."""
    return config_from_pytest(pytestconfig)


@pytest.fixture(scope="session")
def conformance_runner(conformance_config: "SuiteConfig") -> Iterator[Any]:
    """A runner for the session's backend/device/implementation, closed at the end of the session."""
    from .runners import make_runner

    c = conformance_config
    runner = make_runner(c.backend, c.device, c.impl, c.dist_module, c.timeout)
    try:
        yield runner
    finally:
        runner.close()


#: where an xdist worker hands its case results to the controller (``workeroutput`` carries plain data only)
_WORKER_KEY = "conformance_results_json"


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist controller: collect the case results a worker sent when it finished (see pytest_sessionfinish)."""
    data = getattr(node, "workeroutput", {}).get(_WORKER_KEY)
    if not data:
        return
    import json

    from .report import Result

    results_of(node.config).extend(Result.from_json({"cases": json.loads(data)}).results)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    path = _opt(config, "conformance_report")
    results = results_of(config)
    if not path or not results:
        return
    if hasattr(config, "workerinput"):
        # an xdist worker: hand the results to the controller, which writes the one documented report
        import json

        config.workeroutput[_WORKER_KEY] = json.dumps([r.to_json() for r in results])
        return
    from .report import Result

    cfg = config_from_pytest(config)
    ordered = list(results)
    if cfg.cases or len(ordered) > 1:  # workers finish in any order: report in the planned order
        from .suite import plan_cases

        rank = {c.id(): i for i, c in enumerate(plan_cases(cfg))}
        ordered.sort(key=lambda r: rank.get(r.case.id(), len(rank)))
    res = Result(config=cfg.as_dict(), results=ordered)
    res.seconds = sum(r.seconds for r in ordered)
    for p in res.write(path):
        tr = config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line(f"conformance report written to {p}")
