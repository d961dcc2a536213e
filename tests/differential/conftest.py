"""Options of the differential suite: ``--device cuda`` runs every case with CUDA tensors.

``--device`` is read when pytest is pointed at this directory (``pytest tests/differential
--device cuda``); from the repository root use ``TENSORPLAY_DIFF_DEVICE=cuda python -m pytest ...``,
which works for any invocation.
"""
from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("differential", "tensorplay differential suite (sim vs gloo)").addoption(
        "--device", choices=("cpu", "cuda"), default=None,
        help="tensor device of the differential cases (default cpu, or $TENSORPLAY_DIFF_DEVICE)")


def pytest_configure(config: pytest.Config) -> None:
    dev = config.getoption("--device", default=None)
    if dev:
        os.environ["TENSORPLAY_DIFF_DEVICE"] = dev  # the harness and the rank processes read it


@pytest.fixture
def diff_device() -> str:
    """``cpu`` or ``cuda``; cuda runs are skipped with a reason where no GPU is present."""
    dev = os.environ.get("TENSORPLAY_DIFF_DEVICE", "cpu")
    if dev not in ("cpu", "cuda"):
        raise pytest.UsageError(f"TENSORPLAY_DIFF_DEVICE={dev!r}: use cpu or cuda")
    if dev == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("--device cuda: no CUDA device on this machine (torch.cuda.is_available() is False)")
    return dev
