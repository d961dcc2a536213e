"""PyTorch's own distributed test harness (MultiProcessTestCase and its subclasses) on simulated ranks.

The suites under ``tests/torch_harness_cases/`` are written as users write them on torch's harness.  Each is run
in a subprocess with ``-p simulator.torch_harness --sim-harness thread`` (its ranks are simulated threads), with
``--sim-harness process`` (simulated ranks with a process each) and as it is, on real gloo processes; the verdicts
(passed/failed/skipped per test, from a junit file) must be the table's, which says so where they differ.  The rest checks the pieces: which processes become ranks, the
switch, ``time.sleep`` and ``os.getpid`` on ranks.
"""
from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.managers
import multiprocessing.pool
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from torch.testing._internal.common_distributed import MultiProcessTestCase

import simulator
from simulator.launch import _is_user_process, launch
from simulator.world import current_rank_state
from tensorplay.testing import free_port

from _support.warm_starts import run_counting

ROOT = Path(__file__).resolve().parents[1]
CASES = ROOT / "tests" / "torch_harness_cases"
ISOLATIONS = ("thread", "process")
SIM_TIMEOUT_S = 300
GLOO_TIMEOUT_S = 600

# the verdict of every test of a case file; a dict (thread, process, gloo) where the runs differ
MULTIPROCESS = {
    "test_all_reduce": "passed",
    "test_fails_on_rank_one": "failed",
    "test_skip_generic": "skipped",
    "test_needs_many_gpus": "skipped",
    "test_file_store": "passed",
    "test_getpid_is_per_rank": "passed",
    # pytest's capture handlers stay off the ranks' loggers; each rank's basicConfig is its own
    "test_loggers_are_the_processs_own": "passed",
    "test_sleep_polling_a_file": "passed",
    # fails on thread ranks with the text of torch's module trackers: runs again on rank processes, as the run says
    "test_module_tracker_of_the_whole_process": "passed",
    "test_compile_fullgraph_of_a_module_calling_modules": "passed",
    # unittest.mock's patch on every rank: a process's own attribute; on thread ranks a failure runs again on rank
    # processes, and what the ranks patched is restored with the test's end
    "test_mock_patch_on_every_rank": "passed",
    "test_zz_patches_ended_with_their_test": "passed",
}
DTENSOR = {"test_redistribute_shard_to_replicate": "passed", "test_wrong_expectation_fails": "failed"}
DISTRIBUTED_TEST = {
    "test_barrier": "passed",
    "test_get_rank": "passed",
    # a group's timeout fails the waiting rank (" Timed out "), and monitored_barrier names the missing rank
    "test_barrier_timeout_global": "passed",
    "test_monitored_barrier_gloo": "passed",
    "test_monitored_barrier_gloo_rank_0_timeout": "passed",
    # call_dist_op runs the collective under torch's autograd profiler, one per process: refused on thread ranks,
    # where the test runs again on rank processes; a rank process records the events gloo records (gloo:all_reduce,
    # asynchronous, with the input's shape)
    "test_all_reduce_sum": "passed",
}
# instantiate_device_type_tests' thread-local precision, and torch.nn's global module hooks (CommDebugMode) around a
# collective that writes into a module's output: per rank on thread ranks, a process's own on rank processes
DEVICE_TYPE = {"test_all_reduce_cpu": "passed", "test_comm_debug_mode_around_a_module_collective_cpu": "passed"}
# a group's own methods as c10d's gloo tests call them (ProcessGroupGloo(store, ...), several tensors, gloo's checks)
C10D_GLOO = {t: "passed" for t in (
    "test_several_inputs_reduce_into_each", "test_reduce_scatter_with_a_size_per_rank",
    "test_broadcast_root_tensor_and_overload",
    "test_allgather_several_inputs_and_future_value", "test_argument_checks_match_gloo",
    "test_scatter_and_gather_checks_and_values", "test_sparse_several_inputs_sum", "test_options_timeout_and_stress",
    "test_coalesced_async_with_a_tensor_given_twice", "test_init_process_group_names_its_backend",
    "test_a_backend_the_program_registers_is_its_own", "test_zz_what_a_test_registered_ended_with_its_processes")}
# c10d's behaviour as its common tests observe it on gloo (DDP hooks, sparse gradients, sequence numbers, ...)
C10D_COMMON = {t: "passed" for t in (
    "test_sparse_gradients", "test_comm_hook_sparse", "test_comm_hook_future_passing", "test_invalid_hook_return",
    "test_broadcast_coalesced", "test_new_group_local_sync_dup", "test_new_group_ordered", "test_rank_membership",
    "test_seq_num", "test_dtype_mismatch", "test_complex_and_bool", "test_debug_level", "test_local_rank",
    "test_a2a_contiguous", "test_ignored_output_unused", "test_all_backends_names",
    "test_registered_backend_is_the_registering_ranks", "test_rank_zero_spins_on_the_default_store_until_the_others_add")}
# MultiProcContinuousTest: thread ranks with the switch on (a world per test), real workers under "process"; a
# failing test poisons the rest of its class, as torch's harness does
CONTINUOUS = {"test_1_ranks_are_what_the_switch_says": "passed", "test_2_all_reduce": "passed",
              "test_2b_environment_is_the_workers_own": "passed", "test_parent_environment_untouched": "passed",
              "test_3_rank_and_group": "passed", "test_a_fails_on_rank_1": "failed", "test_b_after_failure": "skipped",
              "test_1_leaves_state_on_the_worker": "passed", "test_2_finds_it": "passed"}
# torch's RPC test fixtures: torch's own agent, its RRef context, a torch future completed by RPC callbacks
RPC = {"test_rpc_sync_and_pid": "passed", "test_nested_callbacks_and_errors": "passed",
       "test_rref_context_is_torchs": "passed"}
# torch's LocalTensor tests: no process started, all ranks in the test's process ("fake" group): run as torch runs them
LOCAL_TENSOR = {"test_shard_to_replicate": "passed"}
# a file that runs itself (run_tests()): MultiProcContinuousTest workers, a one-process "fake" group, a failing rank
LAUNCHER = {"test_fake_group": "passed", "test_2_all_reduce": "passed", "test_3_fails_on_rank_1": "failed"}
CASE_TABLES = {"case_multiprocess.py": MULTIPROCESS, "case_dtensor.py": DTENSOR,
               "case_distributed_test.py": DISTRIBUTED_TEST, "case_device_type.py": DEVICE_TYPE,
               "case_c10d_gloo.py": C10D_GLOO, "case_c10d_common.py": C10D_COMMON, "case_continuous.py": CONTINUOUS,
               "case_rpc.py": RPC, "case_local_tensor.py": LOCAL_TENSOR, "case_launcher.py": LAUNCHER}
#: cases whose run on gloo processes takes most of a minute or more (a process start-up per rank and test): their
#: table is checked against gloo in the slow tier; the default run checks the cheap ones (and every case simulated)
SLOW_ON_GLOO = ("case_distributed_test.py", "case_c10d_gloo.py", "case_c10d_common.py", "case_rpc.py",
                "case_multiprocess.py", "case_continuous.py", "case_device_type.py", "case_dtensor.py",
                "case_launcher.py")

#: runs on rank processes that another default test covers: in the slow tier, the thread side by default (the c10d and
#: device-type cases: MultiProcessTestCase on rank processes is case_multiprocess.py's and case_distributed_test.py's;
#: the RPC case: its thread side runs every test on rank processes; distributed_test.py: its thread side runs its
#: profiler test on rank processes; MultiProcContinuousTest on rank processes:
#: test_a_continuous_tests_failure_names_the_rank_that_failed_first)
ISOLATIONS_PROCESS_SLOW = [pytest.param(i, marks=[pytest.mark.slow] if i == "process" else []) for i in ISOLATIONS]



class Outcome:
    def __init__(self, proc: subprocess.CompletedProcess, junit: Path, wall_s: float) -> None:
        self.output = proc.stdout + proc.stderr
        self.wall_s = wall_s
        self.verdicts: dict[str, str] = {}
        if not junit.exists():
            pytest.fail(f"pytest wrote no junit file (exit {proc.returncode}):\n{self.output[-6000:]}")
        for case in ET.parse(junit).getroot().iter("testcase"):
            kinds = {child.tag for child in case}
            verdict = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
            self.verdicts[case.get("name", "?")] = verdict


def _run_case(tmp_path: Path, case: str, *, sim: str | None, tests: tuple[str, ...] = (),
              extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Outcome:
    """pytest on a copy of ``case`` in a folder of its own (no conftest of ours), bounded, loopback only; ``sim``: the
    isolation of the simulated ranks (None: real gloo processes)."""
    work = tmp_path / (sim or "gloo")
    work.mkdir(exist_ok=True)
    shutil.copy(CASES / case, work / case)
    junit = work / "junit.xml"
    nodes = [f"{case}::{t}" for t in tests] or [case]
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", f"--junitxml={junit}",
           *(("-p", "simulator.torch_harness", "--sim-harness", sim) if sim else ()), *extra, *nodes]
    full_env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TENSORPLAY_SIM_HARNESS"):
        full_env.pop(k, None)
    full_env.update(env or {})
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=work, env=full_env, capture_output=True, text=True,
                              timeout=SIM_TIMEOUT_S if sim else GLOO_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish in time:\n{e.stdout}\n{e.stderr}")
    return Outcome(proc, junit, time.perf_counter() - start)


def _want(table: dict[str, object], backend: str) -> dict[str, str]:
    return {t: v[backend] if isinstance(v, dict) else v for t, v in table.items()}  # type: ignore[index]


def _cli_env() -> dict[str, str]:
    """The environment of a ``python -m simulator`` command a test runs: this checkout importable, and no
    ``TENSORPLAY_SIM_HARNESS`` of the outer run (the command's own options choose)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TENSORPLAY_SIM_HARNESS", None)
    return env


def _distributed_test_env(tmp_path: Path, name: str) -> dict[str, str]:
    """What torch's test_distributed_spawn.py needs in the environment: the backend, world size and a TEMP_DIR
    with a barrier folder (distributed_test reads them at import)."""
    temp = tmp_path / f"temp-{name}"
    (temp / "barrier").mkdir(parents=True)
    return {"BACKEND": "gloo", "WORLD_SIZE": "3", "TEMP_DIR": str(temp), "INIT_METHOD": f"file://{temp}/init"}


def _run(tmp_path: Path, case: str, *, sim: str | None) -> Outcome:
    """A whole case file (its selected tests), simulated (``sim``: the isolation) or on gloo (None)."""
    if case == "case_distributed_test.py":
        tests = tuple(f"TestDistBackendWithSpawn::{t}" for t in DISTRIBUTED_TEST)
        return _run_case(tmp_path, case, sim=sim, tests=tests, env=_distributed_test_env(tmp_path, sim or "gloo"))
    if case == "case_multiprocess.py":
        return _run_case(tmp_path, case, sim=sim, tests=tuple(f"HarnessCases::{t}" for t in MULTIPROCESS))
    return _run_case(tmp_path, case, sim=sim)


_PIDS = re.compile(r"Started process \d+ with pid (\d+)")


def _pid_max() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read())


# ---------------------------------------------------------------------------------------------------------------
# the suites, simulated
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_multiprocess_test_case_runs_on_simulated_ranks_with_the_harness_protocol(tmp_path: Path,
                                                                                   isolation: str) -> None:
    out = _run(tmp_path, "case_multiprocess.py", sim=isolation)
    assert out.verdicts == _want(MULTIPROCESS, isolation), out.output[-8000:]
    what = {"thread": "threads of this process", "process": "processes"}[isolation]
    assert f"simulator.torch_harness: MultiProcessTestCase ranks are simulated {what}" in out.output
    # the failing rank's traceback came back through the harness's pipe, and only that rank failed
    assert "Process 1 exited with error code 10 and exception" in out.output
    assert "AssertionError: rank one disagrees: pid-check-1-marker" in out.output
    assert "Process 0 exited with error code 10" not in out.output
    # (the harness's own exit code for a failed test is no report of the simulator's, with its "return normally")
    assert "Fix: return normally" not in out.output, out.output[-8000:]
    assert "Need at least 8 CUDA devices" in out.output  # skip_if_lt_x_gpu's skip, with its reason
    assert "Replay: python -m pytest 'case_multiprocess.py::HarnessCases::test_fails_on_rank_one'" in out.output
    pids = {int(p) for p in _PIDS.findall(out.output)}
    assert pids and min(pids) > _pid_max(), pids  # the launcher's pids: no real process was started
    # a failure of thread ranks sharing one process (a module tracker's text) ran again on rank processes, and the
    # run says why; with a process each, nothing ran twice
    moved = ("1 test(s) ran on rank processes (as --sim-harness process) although --sim-harness thread was asked "
             "for: they failed on thread ranks first, for a reason of ranks sharing one process: torch's module "
             "trackers")
    assert (moved in out.output) == (isolation == "thread"), out.output[-8000:]


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_dtensor_test_base_with_comms_redistributes_on_simulated_ranks(tmp_path: Path, isolation: str) -> None:
    out = _run(tmp_path, "case_dtensor.py", sim=isolation)
    assert out.verdicts == _want(DTENSOR, isolation), out.output[-8000:]
    assert "dtensor-sum-marker" in out.output and "Expected 9.0 but got 8.0" in out.output


@pytest.mark.parametrize("isolation", ISOLATIONS_PROCESS_SLOW)
def test_device_type_suites_and_module_trackers_on_simulated_ranks(tmp_path: Path, isolation: str) -> None:
    out = _run(tmp_path, "case_device_type.py", sim=isolation)
    assert out.verdicts == _want(DEVICE_TYPE, isolation), out.output[-8000:]


@pytest.mark.parametrize("isolation", ISOLATIONS_PROCESS_SLOW)
def test_a_groups_own_methods_follow_gloo_on_simulated_ranks(tmp_path: Path, isolation: str) -> None:
    out = _run(tmp_path, "case_c10d_gloo.py", sim=isolation)
    assert out.verdicts == _want(C10D_GLOO, isolation), out.output[-8000:]


@pytest.mark.parametrize("isolation", ISOLATIONS_PROCESS_SLOW)
def test_c10d_behaviour_that_its_common_tests_observe_on_simulated_ranks(tmp_path: Path, isolation: str) -> None:
    out = _run(tmp_path, "case_c10d_common.py", sim=isolation)
    assert out.verdicts == _want(C10D_COMMON, isolation), out.output[-8000:]


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_torchs_local_tensor_tests_run_in_the_tests_process_as_torch_runs_them(tmp_path: Path, isolation: str) -> None:
    out = _run(tmp_path, "case_local_tensor.py", sim=isolation)
    assert out.verdicts == _want(LOCAL_TENSOR, isolation), out.output[-8000:]


@pytest.mark.parametrize("isolation", ISOLATIONS_PROCESS_SLOW)
def test_torchs_rpc_fixtures_run_on_rank_processes_and_the_run_says_so(tmp_path: Path, isolation: str) -> None:
    out = _run(tmp_path, "case_rpc.py", sim=isolation)
    assert out.verdicts == _want(RPC, isolation), out.output[-8000:]
    note = "3 test(s) ran on rank processes (as --sim-harness process) although --sim-harness thread was asked for"
    assert (note in out.output) == (isolation == "thread"), out.output[-3000:]
    if isolation == "thread":  # (the note names them)
        assert re.search(r"The tests: case_rpc\.py::\w+::test_\w+, case_rpc\.py::", out.output), out.output[-3000:]


@pytest.mark.parametrize("isolation", ISOLATIONS_PROCESS_SLOW)
def test_continuous_test_workers_are_simulated_ranks_with_torchs_verdicts(tmp_path: Path, isolation: str) -> None:
    out = _run_case(tmp_path, "case_continuous.py", sim=isolation, env={"TP_EXPECT_SIMULATED": "1"})
    assert out.verdicts == _want(CONTINUOUS, isolation), out.output[-8000:]


@pytest.mark.parametrize("isolation", ISOLATIONS_PROCESS_SLOW)
def test_distributed_test_suite_selected_tests_on_simulated_ranks(tmp_path: Path, isolation: str) -> None:
    out = _run(tmp_path, "case_distributed_test.py", sim=isolation)
    assert out.verdicts == _want(DISTRIBUTED_TEST, isolation), out.output[-8000:]
    # test_barrier and test_get_rank pass through distributed_test's file barrier: per-rank pids and barrier
    # counts, and ranks that sleep-poll the barrier files while the others run; the profiler is refused on thread
    # ranks (one per process), and the test that started it ran again on rank processes, as the summary says
    moved = "1 test(s) ran on rank processes (as --sim-harness process) although --sim-harness thread was asked for"
    assert (moved in out.output) == (isolation == "thread"), out.output[-8000:]
    if isolation == "thread":
        assert "torch's profiler is one per process" in out.output


def _two_rank_case(imports: str, body: str) -> str:
    """A test file of one two-rank ``MultiProcessTestCase`` whose test is ``body`` (indented as a method's)."""
    return f"""{imports}
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import run_tests

class Case(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2
    def setUp(self):
        super().setUp()
        self._spawn_processes()
{body}
if __name__ == "__main__":
    run_tests()
"""


def _pytest_written(work: Path, text: str, isolation: str, *extra: str) -> tuple[int, str]:
    """Write ``text`` as ``work/test_case.py`` and run it under the switch: (exit code, output)."""
    work.mkdir(exist_ok=True)
    (work / "test_case.py").write_text(text)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "simulator.torch_harness",
                           "--sim-harness", isolation, *extra, "test_case.py"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=SIM_TIMEOUT_S)
    return proc.returncode, proc.stdout + proc.stderr


_FOUR_RANK_CASE = """
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import run_tests

class Case(MultiProcessTestCase):  # torch's default world: 4 ranks
    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def _sum(self):
        dist.init_process_group("gloo", init_method=f"file://{self.file_name}", rank=self.rank,
                                world_size=self.world_size)
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        return t.item()

    def test_first(self):
        self.assertEqual(self._sum(), 10.0)

    def test_second(self):
        self.assertEqual(self._sum(), 10.0)

if __name__ == "__main__":
    run_tests()
"""


def test_rank_processes_interpreters_start_while_pytest_collects_and_serve_every_test(tmp_path: Path) -> None:
    """Under ``--sim-harness process`` the first test file on torch's harness starts its ranks' warm interpreters
    before pytest imports it; the first test's world uses them, and so does the next: 4 in all."""
    (tmp_path / "test_case.py").write_text(_FOUR_RANK_CASE)
    p, starts = run_counting(tmp_path, "pytest", ["-p", "no:cacheprovider", "-p", "simulator.torch_harness",
                                                  "--sim-harness", "process", "-q", "test_case.py"], "test_case")
    assert p.returncode == 0 and "2 passed" in p.stdout, p.stdout + p.stderr
    assert starts == (4, 4, 4), p.stderr


_FRESH_PROCESS_CASE = _two_rank_case("""
import logging
import warnings

import torch""", """
    def test_a_rank_warns(self):  # (pytest's -W error::FutureWarning is pytest's process's, not a started one's)
        warnings.warn("an old spelling, rank=%d" % self.rank, FutureWarning)

    def test_b_basic_config_configures_the_rank(self):  # (pytest's log capture is its process's too)
        logging.basicConfig(level=logging.INFO)
        self.assertEqual((logging.getLogger().level, len(logging.getLogger().handlers)), (logging.INFO, 1))

    def test_c_sets_torchs_defaults(self):
        torch.set_default_dtype(torch.float64)
        torch.use_deterministic_algorithms(True)

    def test_d_starts_from_torchs_defaults(self):
        self.assertEqual(torch.get_default_dtype(), torch.float32)
        self.assertFalse(torch.are_deterministic_algorithms_enabled())
""")


# (on gloo processes, "off", in the slow tier: four tests of real process starts cost most of a minute or more)
@pytest.mark.parametrize("isolation", [pytest.param("off", marks=[pytest.mark.slow, pytest.mark.gloo]), *ISOLATIONS])
def test_ranks_start_as_started_processes_do_without_pytests_filters_handlers_or_the_last_tests_settings(
        tmp_path: Path, isolation: str) -> None:
    """A started process has a new interpreter's warning filters and root logger, and torch's defaults: pytest's
    -W and log capture, and the settings an earlier test's ranks changed, are not its (thread ranks had them all:
    a FutureWarning failed, basicConfig did nothing, the next test saw float64)."""
    rc, out = _pytest_written(tmp_path / isolation, _FRESH_PROCESS_CASE, isolation, "-W", "error::FutureWarning")
    assert rc == 0 and "4 passed" in out, out[-4000:]
    # the ranks' warning went to their stderr (pytest captured it), not into pytest's own warnings summary
    assert "an old spelling" not in out, out[-4000:]


_STUCK_CASE = _two_rank_case("import time", """
    def test_rank_zero_never_arrives(self):
        if self.rank == 0:
            for _ in range(100):  # (bounded: a thread rank cannot be stopped from outside)
                time.sleep(0.05)
""")


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_simulated_timeout_shows_the_simulators_report_in_the_tests_failure(tmp_path: Path, isolation: str) -> None:
    # torch's harness sees a rank the simulator stopped as exit code 1 and nothing else; the report says who waited
    rc, out = _pytest_written(tmp_path / isolation, _STUCK_CASE, isolation, "--sim-timeout", "1.5")
    assert rc == 1 and "1 failed" in out, out[-4000:]
    assert "The simulator's report (SimTimeoutError)" in out, out[-4000:]
    assert "timeout" in out.split("The simulator's report (SimTimeoutError)", 1)[1][:2000], out[-4000:]
    # (thread ranks: where the failure may be one of ranks sharing the process, the report names the other switch)
    assert ("Thread ranks share this process" in out) == (isolation == "thread"), out[-4000:]


_MODULE_GLOBALS_CASE = _two_rank_case("""
import random

import torch.distributed as dist
from torch.testing._internal.distributed._shard.sharded_tensor import _test_st_common

ORDER = [0, 1, 2, 3]""", """
    def _agree(self, value):
        dist.init_process_group("gloo", rank=self.rank, world_size=2, init_method=f"file://{self.file_name}")
        got = [None, None]
        dist.all_gather_object(got, value)
        dist.destroy_process_group()
        self.assertEqual(got[0], got[1])

    def test_a_each_rank_shuffles_a_list_of_its_module(self):
        random.Random(0).shuffle(ORDER)
        self._agree(list(ORDER))

    def test_b_a_torch_helper_shuffles_its_modules_list_on_each_rank(self):
        spec = _test_st_common._chunk_sharding_specs_list_for_test([0], seed=0)[0]
        self._agree([str(p) for p in spec.placements])

    def test_c_the_lists_are_as_imported(self):
        self.assertEqual(ORDER, [0, 1, 2, 3])
        self.assertEqual(_test_st_common.PLACEMENTS, [f"rank:{r}/cuda:{r}" for r in range(4)])
""")


@pytest.mark.parametrize("isolation", [pytest.param("off", marks=[pytest.mark.slow, pytest.mark.gloo]), *ISOLATIONS])
def test_module_globals_a_tests_ranks_change_are_each_ranks_own_and_end_with_the_test(tmp_path: Path,
                                                                                      isolation: str) -> None:
    """Each rank process changes its own module globals (a list torch's sharded-tensor helper shuffles in place,
    seeded); thread ranks each see the others' changes: such a test that fails on thread ranks runs again on rank
    processes, and the globals are as imported when the test ends (the next test's ranks start from them)."""
    rc, out = _pytest_written(tmp_path / isolation, _MODULE_GLOBALS_CASE, isolation)
    assert rc == 0 and "3 passed" in out, out[-4000:]
    if isolation == "thread":  # (the run names the tests that moved, and the globals their ranks changed)
        for name in ("(test_case.ORDER)", "(torch.testing._internal.distributed._shard.sharded_tensor._test_st_common"
                     ".PLACEMENTS)"):
            assert f"the test's ranks changed some {name}" in out, (name, out[-4000:])


_REGISTERING_CASE = _two_rank_case("""
import registry""", """
    def test_a_a_rank_imports_a_plugin_that_registers_itself(self):
        import plugin  # noqa: F401  (lazily, on the rank: its import adds to the folder's registry)
        self.assertIn("x", registry.HANDLERS)

    def test_b_its_registration_stands(self):
        import plugin  # noqa: F401  (imported already: no second registration)
        self.assertIn("x", registry.HANDLERS)
""")
_CONFTEST_RECORDING = """import sys

import pytest

sys.modules["torch.testing._internal.blocked_on_purpose"] = None  # (an import blocked the standard way)
CALLED = []


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    CALLED.append(item.nodeid)


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"conftest saw {len(CALLED)} calls")
"""


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_what_is_not_a_tests_ranks_own_stays_as_a_process_leaves_it(tmp_path: Path, isolation: str) -> None:
    """Putting module globals back leaves alone what a process keeps too: a registration made by a module a rank
    imported first (its import does not run again), the state of the folder's conftest.py (its hooks run in pytest's
    process), and a blocked import (None) among torch's test helpers in sys.modules."""
    work = tmp_path / isolation
    work.mkdir()
    (work / "registry.py").write_text("HANDLERS = {}\n")
    (work / "plugin.py").write_text("import registry\n\nregistry.HANDLERS['x'] = 1\n")
    (work / "conftest.py").write_text(_CONFTEST_RECORDING)
    rc, out = _pytest_written(work, _REGISTERING_CASE, isolation)
    assert rc == 0 and "2 passed" in out and "conftest saw 2 calls" in out, out[-4000:]


_BASE_EXCEPTION_CASE = _two_rank_case("""
import torch.distributed as dist

class Abandon(BaseException):  # (as torch's dcp CheckpointException: not an Exception)
    pass""", """
    def test_rank_zero_raises_a_base_exception(self):
        dist.init_process_group("gloo", rank=self.rank, world_size=2, init_method=f"file://{self.file_name}")
        dist.barrier()
        if self.rank == 0:
            raise Abandon("rank 0 abandons, step=3")
        dist.destroy_process_group()
""")


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_rank_that_dies_of_an_uncaught_base_exception_shows_its_traceback(tmp_path: Path, isolation: str) -> None:
    """torch's harness catches a test's Exception only; a BaseException ends the rank's process, and the harness sees
    exit code 1. A process would print the traceback to its stderr: the test's report shows it."""
    rc, out = _pytest_written(tmp_path / isolation, _BASE_EXCEPTION_CASE, isolation)
    assert rc == 1 and "1 failed" in out, out[-4000:]
    shown = out.split("does not catch", 1)[-1]
    assert "Abandon: rank 0 abandons, step=3" in shown and 'raise Abandon("rank 0 abandons' in shown, out[-4000:]


_FSDP_PATCH_CASE = _two_rank_case("""
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param_group import RegisterPostBackwardFunction
from torch.testing._internal.common_fsdp import patch_register_post_backward_hook_backward""", """
    def test_each_rank_counts_its_own_post_backwards(self):
        dist.init_process_group("gloo", rank=self.rank, world_size=2, init_method=f"file://{self.file_name}")
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        fully_shard(model[0])
        fully_shard(model[1])
        fully_shard(model)
        orig, count = RegisterPostBackwardFunction.backward, [0]
        def counted(*args, **kwargs):
            count[0] += 1
            return orig(*args, **kwargs)
        with patch_register_post_backward_hook_backward(counted):  # each rank assigns its own, between barriers
            model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        self.assertGreaterEqual(count[0], 2)
""")


def test_a_test_patching_with_torchs_fsdp_helpers_runs_again_on_rank_processes(tmp_path: Path) -> None:
    """torch's common_fsdp.patch_* assign a class attribute on every rank: on thread ranks the last rank's closure
    counts for all, so the test fails there and runs again on rank processes, where it passes as on gloo."""
    rc, out = _pytest_written(tmp_path / "thread", _FSDP_PATCH_CASE, "thread")
    assert rc == 0 and "1 passed" in out, out[-4000:]
    assert "ran on rank processes" in out and "common_fsdp.patch_*" in out, out[-4000:]


_CLASS_ATTRIBUTE_CASE = _two_rank_case("""
import torch

class Unit(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)""", """
    def test_a_sets_a_class_attribute(self):
        Unit.get_extra_state = lambda self: "state"  # (PyTorch's checkpoint/test_state_dict.py::test_extra_state)
        Unit.set_extra_state = lambda self, state: None
        self.assertIn("_extra_state", Unit().state_dict())
    def test_b_sees_the_class_as_imported(self):
        self.assertEqual(sorted(Unit().state_dict()), ["lin.bias", "lin.weight"])
""")


def test_a_class_attribute_a_test_sets_on_thread_ranks_ends_with_the_test(tmp_path: Path) -> None:
    """Each test's rank processes import the classes afresh: on thread ranks, what a test's ranks set on a class of
    the test module is put back when the test ends, so the next test sees the class as imported."""
    rc, out = _pytest_written(tmp_path / "thread", _CLASS_ATTRIBUTE_CASE, "thread")
    assert rc == 0 and "2 passed" in out, out[-4000:]


_CONTINUOUS_CASE = """
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import run_tests

class Case(MultiProcContinuousTest):
    world_size = 2
    @classmethod
    def backend_str(cls):
        return "gloo"
    def test_a_fsdp_forward_under_comm_debug_mode(self):
        # (torch's test_fully_shard_comm.py) CommDebugMode's module tracker hooks every module of the process:
        # each thread rank has module hooks of its own
        torch.manual_seed(42)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        with CommDebugMode() as mode:
            loss = model(torch.randn(2, 8))
        self.assertEqual(mode.get_comm_counts()[torch.ops.c10d._allgather_base_], 2)
        loss.sum().backward()
    def test_b_fails_on_thread_ranks_with_a_known_sign(self):
        import simulator.isolation
        if self.rank == 1 and not simulator.isolation._in_rank_process:  # (stands for torch's own trackers' failure)
            raise RuntimeError("The Module hierarchy tracking is wrong")
        dist.barrier()
    def test_c_rank_1_fails_and_rank_0_waits_for_it(self):
        if self.rank == 1:
            raise ValueError("rank 1's own failure, value=17")
        dist.all_reduce(torch.ones(2))

if __name__ == "__main__":
    run_tests()
"""


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_continuous_tests_failure_names_the_rank_that_failed_first(tmp_path: Path, isolation: str) -> None:
    """Each thread rank has torch.nn's module hooks of its own (CommDebugMode); a failure of thread ranks with a
    known sign of ranks sharing one process runs the test again on rank processes, whose verdict is gloo's; the
    failure the parent reads first (rank 0's: it waited for rank 1, which had failed) carries rank 1's too (on gloo
    rank 0 would hang until its timeout)."""
    rc, out = _pytest_written(tmp_path / isolation, _CONTINUOUS_CASE, isolation, "-rA")
    assert rc == 1 and "1 failed, 2 passed" in out, out[-6000:]
    for test in ("test_a_fsdp_forward_under_comm_debug_mode", "test_b_fails_on_thread_ranks_with_a_known_sign"):
        assert f"PASSED test_case.py::Case::{test}" in out, out[-6000:]
    moved = "1 test(s) ran on rank processes (as --sim-harness process) although --sim-harness thread was asked for"
    assert (moved in out) == (isolation == "thread") and ("module trackers" in out) == (isolation == "thread"), \
        out[-6000:]
    failure = out.split("test_c_rank_1_fails_and_rank_0_waits_for_it", 1)[1]
    assert "Simulated rank 1 failed too" in failure and "rank 1's own failure, value=17" in failure, out[-6000:]
    # its report says how the ranks ran and how to replay them, as a MultiProcessTestCase's does
    assert "simulated ranks (simulator.torch_harness)" in failure and "Replay: python -m pytest" in failure, \
        out[-6000:]


_SEEDED_DRAWS_CASE = _two_rank_case("""
import torch
import torch.distributed as dist""", """
    def test_seeded_draws_agree(self):
        dist.init_process_group("gloo", init_method=f"file://{self.file_name}", rank=self.rank,
                                world_size=self.world_size)
        torch.manual_seed(0)
        dist.barrier()  # (both seeded before either draws: one shared generator then gives them different numbers)
        mine = torch.randn(4)
        both = [torch.empty(4) for _ in range(2)]
        dist.all_gather(both, mine)
        self.assertEqual(both[0], both[1])
        dist.destroy_process_group()
""")


def test_free_running_thread_ranks_failure_runs_again_on_rank_processes(tmp_path: Path) -> None:
    """--sim-mode threads: thread ranks share torch's random generator, so seeded draws differ between ranks; the
    failed test runs again on rank processes (gloo's verdict: pass), the run says why, and nothing calls the free
    run a replay."""
    rc, out = _pytest_written(tmp_path, _SEEDED_DRAWS_CASE, "thread", "--sim-mode", "threads", "-rA")
    assert rc == 0 and "1 passed" in out, out[-6000:]
    assert "free-running thread ranks (--sim-mode threads) share torch's random generator" in out, out[-6000:]


_CONTINUOUS_DEVICE_TYPE_AND_SKIP_CASE = """
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.common_device_type import instantiate_device_type_tests
from torch.testing._internal.common_distributed import TEST_SKIPS, MultiProcContinuousTest
from torch.testing._internal.common_utils import run_tests

class DeviceType(MultiProcContinuousTest):
    world_size = 2
    @classmethod
    def backend_str(cls):
        return "gloo"
    def test_all_reduce(self, device):  # (the test reads the device-type tests' thread-local precision)
        t = torch.full((2,), float(self.rank + 1), device=device)
        dist.all_reduce(t)
        self.assertEqual(t, torch.full((2,), 3.0))

instantiate_device_type_tests(DeviceType, globals(), only_for=["cpu"])

class InitSkips(MultiProcContinuousTest):  # (FSDPTestContinuous on a machine with too few GPUs)
    world_size = 2
    @classmethod
    def backend_str(cls):
        return "gloo"
    @classmethod
    def _init_pg(cls, rank, world_size, rdvz_file):
        sys.exit(TEST_SKIPS[f"multi-gpu-{world_size}"].exit_code)
    def test_a(self):
        dist.barrier()
    def test_b(self):
        dist.barrier()

if __name__ == "__main__":
    run_tests()
"""


@pytest.mark.parametrize("isolation", ISOLATIONS_PROCESS_SLOW)
def test_continuous_device_type_tests_and_skipped_set_ups_keep_torchs_verdicts(tmp_path: Path, isolation: str) -> None:
    """Each worker has the device-type tests' thread-local precision of its own; a worker whose set-up exits with a
    skip code answers every test with the skip, then fails destroying the group it never made (torch's loop): the
    parent has the skips already, as from real workers."""
    rc, out = _pytest_written(tmp_path / isolation, _CONTINUOUS_DEVICE_TYPE_AND_SKIP_CASE, isolation, "-rA")
    assert rc == 0 and "1 passed, 2 skipped" in out, out[-6000:]
    assert "PASSED test_case.py::DeviceTypeCPU::test_all_reduce_cpu" in out, out[-6000:]
    assert out.count("Need at least 2 CUDA devices") >= 2, out[-6000:]


_CONTINUOUS_SET_UP_CLASS_CASE = """
import torch
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import run_tests

class _SetsStateInSetUpClass:
    world_size = 2
    seen_at_import = "module"
    @classmethod
    def backend_str(cls):
        return "gloo"
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.device = torch.device("cpu")  # (the parent's: a worker process never runs this)
        cls.seen_at_import = "parent"

class UsesTheParentsDevice(_SetsStateInSetUpClass, MultiProcContinuousTest):
    def test_device_from_set_up_class(self):
        torch.ones(2, device=self.device)

class SeesTheModulesState(_SetsStateInSetUpClass, MultiProcContinuousTest):
    def test_state_as_imported(self):
        assert not hasattr(type(self), "device") and self.seen_at_import == "module", self.seen_at_import
        type(self).device = "the worker's own"  # (a worker sets class state of its own)
        assert self.device == "the worker's own"

if __name__ == "__main__":
    run_tests()
"""


@pytest.mark.parametrize("isolation", ISOLATIONS_PROCESS_SLOW)
def test_continuous_workers_see_the_class_as_imported_not_the_parents_set_up_class(tmp_path: Path,
                                                                                   isolation: str) -> None:
    """torch runs a MultiProcContinuousTest's setUpClass in the parent only; its workers import the module afresh, so
    class state the parent's setUpClass set is not theirs (on gloo the first test fails with AttributeError)."""
    rc, out = _pytest_written(tmp_path / isolation, _CONTINUOUS_SET_UP_CLASS_CASE, isolation, "-rA")
    assert rc == 1 and "1 failed, 1 passed" in out, out[-6000:]
    assert "PASSED test_case.py::SeesTheModulesState::test_state_as_imported" in out, out[-6000:]
    assert "'UsesTheParentsDevice' object has no attribute 'device'" in out, out[-6000:]


def test_the_environment_variable_turns_the_switch_on(tmp_path: Path) -> None:
    out = _run_case(tmp_path, "case_multiprocess.py", sim=None, tests=("HarnessCases::test_all_reduce",),
                    extra=("-p", "simulator.torch_harness"), env={"TENSORPLAY_SIM_HARNESS": "thread"})
    assert out.verdicts == {"test_all_reduce": "passed"}, out.output[-4000:]
    pids = {int(p) for p in _PIDS.findall(out.output)}
    assert pids and min(pids) > _pid_max(), out.output[-4000:]


@pytest.mark.parametrize("value, text", [("threads", "takes one of off, thread, process"),
                                         ("proc", "takes one of off, thread, process")])
def test_a_switch_value_that_cannot_run_is_a_usage_error(tmp_path: Path, value: str, text: str) -> None:
    work = tmp_path / "w"
    work.mkdir()
    (work / "test_x.py").write_text("def test_x():\n    pass\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TENSORPLAY_SIM_HARNESS=value)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "simulator.torch_harness",
                           "test_x.py"], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4 and text in proc.stderr and "TENSORPLAY_SIM_HARNESS" in proc.stderr, proc.stderr


def test_loading_the_plugin_with_the_switch_off_imports_no_torch_and_warns_nothing() -> None:
    program = ("import sys, warnings\nwarnings.simplefilter('error')\nimport simulator.torch_harness\n"
               "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n")
    proc = subprocess.run([sys.executable, "-W", "error", "-c", program], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------------------------------------------
# the same suites on real gloo processes: the verdicts of the table
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gloo
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW_ON_GLOO else [])
                                  for c in sorted(CASE_TABLES)])
def test_the_same_suite_on_gloo_processes_gives_the_tables_verdicts(tmp_path: Path, case: str) -> None:
    real = _run(tmp_path, case, sim=None)
    assert real.verdicts == _want(CASE_TABLES[case], "gloo"), real.output[-8000:]
    pids = {int(p) for p in _PIDS.findall(real.output)}
    # (MultiProcContinuousTest logs its workers' pids at debug level only; LocalTensor tests start no process)
    if case not in ("case_continuous.py", "case_local_tensor.py", "case_launcher.py"):
        assert pids and max(pids) <= _pid_max(), pids  # real processes, this time
    # (the same table's simulated verdicts: the tests of each case above; the speed-ups:
    # bench/bench_harness.py)
    print(f"{case}: wall time on gloo processes {real.wall_s:.1f} s")


# ---------------------------------------------------------------------------------------------------------------
# the pieces
# ---------------------------------------------------------------------------------------------------------------
class _UserCase(MultiProcessTestCase):  # a class of the program whose _run is torch's
    pass


class _UserManager(multiprocessing.managers.BaseManager):  # its server runs the standard library's method
    pass


def _plain_target() -> None:
    pass


@pytest.mark.parametrize("target, rank", [
    (_UserCase._run, True),                  # torch's classmethod, bound to the program's class
    (_plain_target, True),                   # the program's function
    (_UserManager._run_server, False),       # the standard library's classmethod on the program's class
    (torch.utils.data._utils.worker._worker_loop, False),  # a DataLoader worker
    (multiprocessing.pool.worker, False),    # a pool worker
], ids=["harness-run", "program-function", "manager-server", "dataloader-worker", "pool-worker"])
def test_which_processes_become_ranks(target: object, rank: bool) -> None:
    proc = multiprocessing.get_context("spawn").Process(target=target)
    assert _is_user_process(proc) is rank


def _poll_for_flag(flag: list[bool]) -> str:
    """Rank 1 waits for rank 0's flag outside torch.distributed, sleeping between looks."""
    rs = current_rank_state()
    if rs.rank == 0:  # type: ignore[union-attr]
        time.sleep(0.05)
        flag.append(True)
    else:
        deadline = time.monotonic() + 10
        while not flag:
            assert time.monotonic() < deadline, "rank 1 never saw rank 0's flag: the sleeping rank starved rank 0"
            time.sleep(0.01)
    return getattr(rs.run, "deterministic", True)  # type: ignore[union-attr]


def test_a_sleeping_rank_lets_the_others_run_in_coop_mode_and_the_run_says_it_is_not_seeded() -> None:
    for seed in range(4):  # either rank may run first
        assert simulator.run(_poll_for_flag, 2, args=([],), seed=seed, timeout=60) == [False, False]


def _wait_on_a_store_key(path: str) -> object:
    """Rank 1 reads a key of a file store before rank 0 has set it: a wait in C++ the scheduler cannot see."""
    import datetime

    import torch.distributed as tdist

    import tensorplay.distributed as dist

    store = tdist.FileStore(path, 2)
    if dist.get_rank() == 0:
        store.set("ready", "yes")
        return "set"
    store.set_timeout(datetime.timedelta(seconds=20))
    return store.get("ready").decode()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_rank_waiting_on_a_store_key_lets_the_rank_that_sets_it_run_in_coop_mode(tmp_path: Path,
                                                                                    isolation: str) -> None:
    for seed in range(2):  # either rank may run first
        path = str(tmp_path / f"store-{seed}")
        # (one hash seed: the schedule seeds share one set of rank interpreters)
        assert simulator.run(_wait_on_a_store_key, 2, args=(path,), seed=seed, timeout=60,
                             isolation=isolation, hash_seed=0) == ["set", "yes"]


def _meet_on_a_tcp_store(port: int) -> object:
    """Rank 0 is the master of a TCPStore of two, rank 1 its worker (PyTorch's ``test_remote_group_merge``): the
    master's constructor waits in C++ for its worker, the worker's for its master."""
    import torch.distributed as tdist

    import tensorplay.distributed as dist

    r = dist.get_rank()
    store = tdist.TCPStore("127.0.0.1", port, 2, r == 0, timeout=datetime.timedelta(seconds=30))
    store.set(f"k{r}", f"v{r}")
    got = store.get(f"k{1 - r}").decode(), isinstance(store, tdist.TCPStore)
    dist.barrier()  # the master serves the store until its worker has read (as a real program must)
    return got


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_ranks_meeting_on_a_tcp_store_of_their_own_both_run_in_coop_mode(isolation: str) -> None:
    for seed in range(2):  # either rank may construct its store first
        got = simulator.run(_meet_on_a_tcp_store, 2, args=(free_port(),), seed=seed, timeout=60,
                            isolation=isolation, hash_seed=0)
        assert got == [("v1", True), ("v0", True)], got


def _spin_on_a_store_counter(path: str) -> object:
    """Rank 0 spins on ``store.add(key, 0)`` until the others have added (torch's c10d tests' DummyProcessGroup
    barrier): on coop thread ranks it must let them run, without a sleep of its own."""
    import torch.distributed as tdist

    import tensorplay.distributed as dist

    store = tdist.FileStore(path, 3)
    if dist.get_rank() == 0:
        n, polls = 0, 0
        while n < 2:
            n = store.add("arrived", 0)
            polls += 1
        return polls >= 1
    store.add("arrived", 1)
    return getattr(current_rank_state().run, "deterministic", True)  # type: ignore[union-attr]


def test_a_rank_spinning_on_a_store_counter_lets_the_others_run_in_coop_mode(tmp_path: Path) -> None:
    for seed in range(3):  # rank 0 may run first
        got = simulator.run(_spin_on_a_store_counter, 3, args=(str(tmp_path / f"s{seed}"),), seed=seed, timeout=60)
        assert got[0] is True and len(got) == 3, got


def _no_sleep() -> object:
    x = torch.ones(2)
    import tensorplay.distributed as dist

    dist.all_reduce(x)
    time.sleep(0)  # a yield: a plain sleep(0), not a wall-clock wait that steps out of the schedule
    return getattr(current_rank_state().run, "deterministic", True)  # type: ignore[union-attr]


def test_a_run_that_never_sleeps_stays_seeded() -> None:
    assert simulator.run(_no_sleep, 3, seed=5) == [True, True, True]
    assert (time.sleep.__module__, os.getpid.__module__) == ("time", "posix")  # the adapters are gone again


_SEEN: dict[int, int] = {}
_SEEN_LOCK = threading.Lock()


def _record_pid(rank: int) -> None:
    with _SEEN_LOCK:
        _SEEN[rank] = os.getpid()


def _launch_three() -> list[int]:
    procs = [multiprocessing.get_context("spawn").Process(target=_record_pid, args=(r,)) for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return [p.pid for p in procs]  # type: ignore[misc]


def test_os_getpid_on_a_launched_rank_is_its_process_pid_and_elsewhere_the_real_one() -> None:
    _SEEN.clear()
    box: list[list[int]] = []
    launch(lambda: box.append(_launch_three()))
    assert [_SEEN[r] for r in range(3)] == box[0]
    assert len(set(box[0])) == 3 and min(box[0]) > _pid_max()
    assert simulator.run(lambda: os.getpid(), 2) == [os.getpid()] * 2  # simulator.run ranks are no processes


def test_the_command_line_runs_the_harness_on_simulated_ranks(tmp_path: Path) -> None:
    """``python -m simulator pytest FILE`` is the same switch as ``-p simulator.torch_harness --sim-harness process``."""
    shutil.copy(CASES / "case_multiprocess.py", tmp_path / "case_multiprocess.py")
    junit = tmp_path / "junit.xml"
    env = _cli_env()
    # a passing and a failing test of the file: the whole file on rank processes is the plugin's test above
    chosen = ("test_all_reduce", "test_fails_on_rank_one", "test_getpid_is_per_rank")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "simulator", "pytest", "-p", "no:cacheprovider", "-rA",
                           f"--junitxml={junit}", *(f"case_multiprocess.py::HarnessCases::{t}" for t in chosen)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SIM_TIMEOUT_S)
    got = Outcome(proc, junit, time.perf_counter() - start)
    assert got.verdicts == {t: _want(MULTIPROCESS, "process")[t] for t in chosen}, got.output[-6000:]
    assert "MultiProcessTestCase ranks are simulated processes" in got.output
    assert proc.returncode == 1, got.output[-3000:]  # one test of the file fails, on purpose
    pids = {int(p) for p in _PIDS.findall(got.output)}
    assert pids and min(pids) > _pid_max(), pids  # the ranks were simulated (their pids are the launcher's)


@pytest.mark.gloo
def test_a_test_file_run_by_its_own_main_runs_its_tests_as_the_switch_does(tmp_path: Path) -> None:
    """``python -m simulator FILE`` on a test file that runs itself (torch's ``run_tests()``, as PyTorch runs its test
    files, or unittest's ``unittest.main()``): its tests run on simulated ranks as ``python -m simulator pytest FILE``
    runs them, with gloo's verdicts (MultiProcContinuousTest's workers, a one-process "fake" group in the test
    process, a failing rank)."""
    # (the table's verdicts are gloo's: test_the_same_suite_on_gloo_processes_gives_the_tables_verdicts, slow tier)
    source = (CASES / "case_launcher.py").read_text()
    assert "    run_tests()\n" in source
    env = _cli_env()
    for name, text in (("case_launcher.py", source),
                       ("case_unittest_main.py", source.replace("    run_tests()\n", "    import unittest\n"
                                                                                  "    unittest.main()\n"))):
        (tmp_path / name).write_text(text)
        junit = tmp_path / f"{name}.xml"
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "simulator", name, "-v", f"--junitxml={junit}",
                               "-p", "no:cacheprovider"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=SIM_TIMEOUT_S)
        got = Outcome(proc, junit, time.perf_counter() - start)
        assert got.verdicts == LAUNCHER, (name, got.output[-6000:])
        assert "is a test file of PyTorch's distributed test harness" in got.output and proc.returncode == 1, name
        assert "MultiProcessTestCase ranks are simulated processes" in got.output, name  # (the switch's, processes)


def test_a_launcher_driving_continuous_test_workers_is_refused_with_the_command_that_runs_them(tmp_path: Path) -> None:
    """A script that drives a ``MultiProcContinuousTest`` class by other means than its own main (unittest's runner
    called directly) under ``python -m simulator``: its workers wait for tests only torch's harness hands them, so the
    launcher refuses them at once, naming the command that runs them, where it waited for ever (and thread ranks
    shared the class's ``rank``)."""
    source = (CASES / "case_launcher.py").read_text().replace(
        "    run_tests()\n", "    import unittest\n"
        "    unittest.TextTestRunner().run(unittest.defaultTestLoader.loadTestsFromTestCase(Workers))\n")
    (tmp_path / "drive.py").write_text(source)
    env = _cli_env()
    for isolation in ("thread", "process"):
        proc = subprocess.run([sys.executable, "-m", "simulator", "--isolation", isolation, "drive.py"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=SIM_TIMEOUT_S)
        out = proc.stdout + proc.stderr
        assert "the launcher started the workers of Workers, a MultiProcContinuousTest" in out, (isolation, out[-4000:])
        assert f"python -m simulator pytest {tmp_path / 'drive.py'}" in out, (isolation, out[-4000:])
        assert "FAILED (errors=2)" in out, (isolation, out[-4000:])  # (each test's error names it: no hang)


# ---------------------------------------------------------------------------------------------------------------
# the differential runner (python -m simulator.harness_diff)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.gloo
@pytest.mark.slow
def test_the_differential_runner_compares_a_suite_on_gloo_and_both_isolations(tmp_path: Path) -> None:
    shutil.copy(CASES / "case_dtensor.py", tmp_path / "test_dtensor_case.py")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "simulator.harness_diff", str(tmp_path / "test_dtensor_case.py")],
                          env=env, capture_output=True, text=True, timeout=GLOO_TIMEOUT_S)
    # the suite's failing test fails on every side, so nothing is lost: exit 0, and each side counted
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for side in ("gloo", "thread", "process"):
        assert re.search(rf"^\s+{side}\s+1 passed, 1 failed, 0 skipped", proc.stdout, re.M), proc.stdout
    assert "0 test(s) pass on gloo and not on simulated ranks" in proc.stdout


def test_the_differential_runner_needs_something_to_run() -> None:
    proc = subprocess.run([sys.executable, "-m", "simulator.harness_diff"], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "name test files or folders, or --distributed-test" in proc.stderr
