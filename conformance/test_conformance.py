"""The conformance suite as pytest tests: ``pytest --pyargs conformance`` (one test per case).

Options come from the plugin (``--conformance-backend`` ...; see
:mod:`conformance.plugin`); without the plugin the defaults apply (sim, CPU,
world sizes 1-4, every collective and op).  Test ids are case ids, so
``-k`` selects by words of the id (collective, op, dtype; ``-k`` cannot contain ``=``)::

    pytest --pyargs conformance -k "all_reduce and MAX and float64"
"""
from __future__ import annotations

import warnings

import pytest

from conformance.plugin import config_from_pytest, results_of
from conformance.suite import plan_cases, run_one

pytestmark = pytest.mark.conformance


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "conformance_case" in metafunc.fixturenames:
        cases = plan_cases(config_from_pytest(metafunc.config))
        metafunc.parametrize("conformance_case", cases, ids=[c.id() for c in cases])


@pytest.fixture(scope="session")
def _runner(pytestconfig: pytest.Config):
    from conformance.runners import make_runner

    c = config_from_pytest(pytestconfig)
    runner = make_runner(c.backend, c.device, c.impl, c.dist_module, c.timeout)
    yield runner
    runner.close()


def test_case(conformance_case, _runner, pytestconfig: pytest.Config) -> None:
    config = config_from_pytest(pytestconfig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.distributed.nn.functional's deprecation notes
        result = run_one(_runner, conformance_case, config.as_dict())
    results_of(pytestconfig).append(result)
    if result.status == "skipped":
        pytest.skip(result.verdict.reason)
    if result.status != "passed":
        pytest.fail(result.describe(), pytrace=False)
