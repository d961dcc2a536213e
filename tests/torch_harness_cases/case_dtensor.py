"""DTensorTestBase with @with_comms on CPU: a redistribute from Shard(0) to Replicate()."""
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms


class DTensorCases(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 2

    @with_comms
    def test_redistribute_shard_to_replicate(self) -> None:
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        full = torch.arange(12.0).reshape(4, 3)
        dt = distribute_tensor(full, mesh, [Shard(0)])
        self.assertEqual(dt.to_local(), full[2 * self.rank: 2 * self.rank + 2])
        self.assertEqual(dt.redistribute(mesh, [Replicate()]).to_local(), full)

    @with_comms
    def test_wrong_expectation_fails(self) -> None:
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        dt = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
        self.assertEqual(dt.full_tensor().sum().item(), 9.0, msg="dtensor-sum-marker")


if __name__ == "__main__":
    run_tests()
