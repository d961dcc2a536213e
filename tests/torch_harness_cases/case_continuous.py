"""MultiProcContinuousTest: workers that live across the tests of a class (simulated ranks with the switch on)."""
import os
import unittest

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import run_tests

_PARENT_LOCAL_RANK = os.environ.get("LOCAL_RANK")  # the test process's, before any worker ran

class _GlooOnCpu:
    """Both classes run on gloo and the CPU (a mixin, not a test class: it starts no workers itself)."""
    @classmethod
    def backend_str(cls): return "gloo"
    @classmethod
    def device_type(cls): return "cpu"

class ContinuousCases(_GlooOnCpu, MultiProcContinuousTest):
    world_size = 2
    def test_1_ranks_are_what_the_switch_says(self):
        # TP_EXPECT_SIMULATED=1: the test that runs this case simulated checks the workers are simulated ranks
        if os.environ.get("TP_EXPECT_SIMULATED") == "1":
            import simulator.isolation
            from simulator.core._actor import current_rank_state

            # a thread rank of this process, or a rank process of the simulator
            self.assertTrue(current_rank_state() is not None or simulator.isolation._in_rank_process)
    def test_2_all_reduce(self):
        t = torch.tensor(self.rank + 1)
        dist.all_reduce(t)
        self.assertEqual(t, 3)
    def test_2b_environment_is_the_workers_own(self):
        # torch's _init_pg sets LOCAL_RANK in each worker: a worker's environment, not the parent's
        self.assertEqual(os.environ.get("LOCAL_RANK"), str(self.rank))
    def test_3_rank_and_group(self):
        self.assertEqual(dist.get_rank(), self.rank)
        self.assertEqual(self.pg.size(), 2)
        x = [None, None]
        dist.all_gather_object(x, self.rank * 5)
        self.assertEqual(x, [0, 5])

class ContinuousWorkersKeepTheirState(_GlooOnCpu, MultiProcContinuousTest):
    # torch starts a class's workers once: what one test leaves on a worker (its class, its group) the next finds
    world_size = 2
    def test_1_leaves_state_on_the_worker(self):
        type(self).left = ("left by test_1", self.rank, id(self.pg))
        dist.barrier()
    def test_2_finds_it(self):
        self.assertEqual(getattr(type(self), "left", None), ("left by test_1", self.rank, id(self.pg)))
        dist.barrier()

class ContinuousFailure(_GlooOnCpu, MultiProcContinuousTest):
    world_size = 3
    def test_a_fails_on_rank_1(self):
        dist.barrier()
        self.assertNotEqual(self.rank, 1)
    def test_b_after_failure(self):
        dist.barrier()

class ContinuousParentAfterwards(unittest.TestCase):
    def test_parent_environment_untouched(self):
        # (runs in the test's process, after the classes above) the workers' LOCAL_RANK stayed theirs
        self.assertEqual(os.environ.get("LOCAL_RANK"), _PARENT_LOCAL_RANK)

if __name__ == "__main__":
    run_tests()
