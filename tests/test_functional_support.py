"""Transitional alias: the autograd-collective helpers moved to ``tests/_support/functional.py``.

``test_functional_collectives.py`` and ``test_functional_gradcheck.py`` still import them from here;
once they import ``from _support.functional import ...`` this file goes.  It holds no tests.
"""
from _support.functional import (  # noqa: F401  re-exported for the two importers above
    COLLECTIVES,
    Case,
    ERROR_CASES,
    RECEIVER_STYLES,
    REDUCING,
    ROOTED,
    ScatterCase,
    call,
    errors_body,
    example_body,
    get_group,
    hvp_body,
    hvp_inputs,
    hvp_loss,
    inputs,
    int_body,
    matrix,
    run_checked,
    scatter_blocks,
    scatter_hvp_body,
    scatter_receivers_body,
    scatter_receivers_reference,
    scatter_torch_style_body,
    scatter_upstream,
)
