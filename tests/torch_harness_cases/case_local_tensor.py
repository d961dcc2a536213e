"""torch's LocalTensor tests (``create_local_tensor_test_class``): every rank runs in the test's own process on a
"fake" group under LocalTensorMode, no process is started; with the switch on they run as torch runs them."""
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import (
    DTensorTestBase, create_local_tensor_test_class, with_comms,
)


class RedistributeCases(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 4

    @with_comms
    def test_shard_to_replicate(self) -> None:
        mesh = self.build_device_mesh()
        full = torch.arange(16.0).reshape(8, 2)
        d = distribute_tensor(full, mesh, [Shard(0)])
        self.assertEqual(d.redistribute(mesh, [Replicate()]).to_local(), full)


RedistributeCasesWithLocalTensor = create_local_tensor_test_class(RedistributeCases)
del RedistributeCases  # (only the local-tensor variant: the process-spawning one is case_dtensor.py's business)

if __name__ == "__main__":
    run_tests()
