"""The differential suite: small torch.distributed programs run on the simulator and on real gloo ranks.

Each ``cases_*.py`` module registers cases with :func:`harness.case`; ``test_differential.py``
runs every case at each of its world sizes through each of its front doors (``torch.distributed``
and ``tensorplay.distributed``) and compares the simulator's per-rank outcome with gloo's.
See ``tests/README.md`` ("The differential suite") for how to add and run a case.
"""
