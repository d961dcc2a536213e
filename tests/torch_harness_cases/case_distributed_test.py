"""torch's distributed_test.py suite, set up as test_distributed_spawn.py sets it up.

Run with BACKEND=gloo WORLD_SIZE=3 TEMP_DIR=<a folder with a barrier/ folder> INIT_METHOD=file://...
in the environment (distributed_test reads them at import).
"""
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
