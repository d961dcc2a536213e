"""A test file run by its own main (``python FILE``, torch's run_tests), as PyTorch runs its test files: under
``python -m simulator FILE`` its ranks are simulated, and what runs in the test process itself stays there."""
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcContinuousTest
from torch.testing._internal.common_utils import TestCase, run_tests
from torch.testing._internal.distributed.fake_pg import FakeStore


class InTheTestProcess(TestCase):
    def test_fake_group(self):
        # a one-process "fake" group (LocalTensor and FakeStore tests make one in the test process itself)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        self.assertEqual(dist.get_world_size(), 4)
        dist.destroy_process_group()


class Workers(MultiProcContinuousTest):
    world_size = 2

    @classmethod
    def backend_str(cls):
        return "gloo"

    @classmethod
    def device_type(cls):
        return "cpu"

    def test_2_all_reduce(self):
        # (the workers wait on their task queue between tests, for the test process to send the next)
        t = torch.tensor(self.rank + 1)
        dist.all_reduce(t)
        self.assertEqual(t, 3)

    def test_3_fails_on_rank_1(self):
        dist.barrier()
        self.assertNotEqual(self.rank, 1)


if __name__ == "__main__":
    run_tests()
