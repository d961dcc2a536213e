"""The case files are run by tests/test_torch_harness.py, each copied into a folder of its own (simulated and on
real gloo processes); collected here, ``case_distributed_test.py`` (a ``*_test.py`` name) would run without the
environment torch's distributed_test needs."""
collect_ignore_glob = ["case_*.py"]
