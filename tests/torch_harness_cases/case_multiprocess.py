"""MultiProcessTestCase written as users write it: one process per rank, file:// rendezvous, gloo."""
import json
import os
import sys
import threading
import time
from unittest import mock

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import (
    TEST_SKIPS,
    MultiProcessTestCase,
    skip_if_lt_x_gpu,
)
from torch.testing._internal.common_utils import run_tests

ORIGINAL_DUMPS = json.dumps
POLL_DEADLINE_S = 20.0  # a rank polling for another rank's file gives up after this long


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu())


class HarnessCases(MultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 3

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    def _init(self) -> None:
        dist.init_process_group("gloo", init_method=f"file://{self.file_name}", rank=self.rank,
                                world_size=self.world_size)

    def test_all_reduce(self) -> None:
        self._init()
        x = torch.full((4,), float(self.rank + 1))
        dist.all_reduce(x)
        self.assertEqual(x, torch.full((4,), 6.0))
        self.assertEqual(dist.get_world_size(), 3)

    def test_fails_on_rank_one(self) -> None:
        self._init()
        dist.barrier()
        if self.rank == 1:
            raise AssertionError(f"rank one disagrees: pid-check-{self.rank}-marker")

    def test_skip_generic(self) -> None:
        sys.exit(TEST_SKIPS["generic"].exit_code)

    @skip_if_lt_x_gpu(8)
    def test_needs_many_gpus(self) -> None:
        self._init()

    def test_file_store(self) -> None:
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        objs = [None] * self.world_size
        dist.all_gather_object(objs, self.rank * 10)
        self.assertEqual(objs, [0, 10, 20])

    def test_loggers_are_the_processs_own(self) -> None:
        """A rank process's loggers hold what its imports gave them (torch's c10d logger: its NullHandler, not the
        test runner's capture handlers), and a rank configures its own root logger (basicConfig per rank)."""
        import io
        import logging

        from torch.distributed.c10d_logger import _c10d_logger

        self.assertEqual([type(h).__name__ for h in _c10d_logger.handlers], ["NullHandler"])
        self._init()
        buffer = io.StringIO()
        logging.basicConfig(level=logging.INFO if self.rank == 0 else logging.WARNING, stream=buffer,
                            format=f"[rank{self.rank}] %(message)s", force=True)
        dist.barrier()  # every rank has configured its logging before any logs
        logging.getLogger("case").info("info")
        self.assertEqual(buffer.getvalue(), "[rank0] info\n" if self.rank == 0 else "")

    def test_getpid_is_per_rank(self) -> None:
        self._init()
        pids = [None] * self.world_size
        dist.all_gather_object(pids, os.getpid())
        self.assertEqual(len(set(pids)), self.world_size)

    def test_sleep_polling_a_file(self) -> None:
        # ranks wait for rank 0's file outside torch.distributed, sleeping between looks, as harness barriers do
        self._init()
        flag = self.file_name + ".ready"
        if self.rank == 0:
            time.sleep(0.2)
            with open(flag, "w") as f:
                f.write("ready")
        else:
            start = time.time()
            while not os.path.exists(flag):
                if time.time() - start > POLL_DEADLINE_S:
                    raise AssertionError(f"rank {self.rank} never saw {flag}")
                time.sleep(0.05)
        dist.barrier()

    def test_module_tracker_of_the_whole_process(self) -> None:
        # torch's module trackers see every module of their process: where ranks share one (threads) a tracker
        # fails with this text. This rank fails so where it is not its process's main thread, as a tracker would
        self._init()
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("The Module hierarchy tracking is wrong (another rank's module entered)")
        dist.barrier()

    def test_compile_fullgraph_of_a_module_calling_modules(self) -> None:
        # dynamo traces Module.__call__, which asks torch.nn's global hook tables for truth (per rank on thread
        # ranks): fullgraph=True fails on anything it cannot trace there
        self._init()
        torch.manual_seed(0)
        inner = _TwoLayers()
        compiled = torch.compile(inner, backend="eager", fullgraph=True)
        x = torch.ones(3, 4) * (self.rank + 1)
        self.assertEqual(compiled(x), inner(x))
        dist.barrier()

    def test_mock_patch_on_every_rank(self) -> None:
        # each rank patches a module's attribute around collectives, as tests patch helpers (DCP's get_free_port):
        # a process's own attribute, which thread ranks share (the test runs again on rank processes)
        self._init()
        with mock.patch("json.dumps", return_value=f"rank{self.rank}"):
            dist.barrier()
            self.assertEqual(json.dumps({}), f"rank{self.rank}")
            dist.barrier()
        dist.barrier()
        self.assertIs(json.dumps, ORIGINAL_DUMPS)

    def test_zz_patches_ended_with_their_test(self) -> None:
        # whatever the ranks patched is as before once their test ended, as after processes that patched their own
        self.assertIs(json.dumps, ORIGINAL_DUMPS)
        self.assertIs(sys.modules["json"].dumps, ORIGINAL_DUMPS)


if __name__ == "__main__":
    run_tests()
