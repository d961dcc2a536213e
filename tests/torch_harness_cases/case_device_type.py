"""A device-type suite on MultiProcessTestCase, as torch's own c10d suites write them (instantiate_device_type_tests),
and a module tracker around a collective inside a module's forward (CommDebugMode registers torch.nn's global
module hooks; the collective writes its result into the module's output)."""
import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode
from torch.testing._internal.common_device_type import instantiate_device_type_tests
from torch.testing._internal.common_distributed import MultiProcessTestCase
from torch.testing._internal.common_utils import run_tests


class _Summed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        dist.all_reduce(y)  # in place, on the output of a submodule
        return y


class DeviceTypeCases(MultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 2

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    def _init(self) -> None:
        dist.init_process_group("gloo", init_method=f"file://{self.file_name}", rank=self.rank,
                                world_size=self.world_size)

    def test_all_reduce(self, device: str) -> None:
        self._init()
        x = torch.full((4,), float(self.rank + 1), device=device)
        dist.all_reduce(x)
        self.assertEqual(x, torch.full((4,), 3.0))  # uses the test's thread-local precision

    def test_comm_debug_mode_around_a_module_collective(self, device: str) -> None:
        self._init()
        torch.manual_seed(0)  # the same weights on every rank
        model = _Summed()
        with CommDebugMode() as comm:
            out = model(torch.ones(2, 3, device=device))
        comm.get_total_counts()  # (its module tracker walked every module of this rank, and only those)
        expected = model.proj(torch.ones(2, 3)).detach() * self.world_size
        self.assertEqual(out.detach(), expected)


instantiate_device_type_tests(DeviceTypeCases, globals(), only_for="cpu")

if __name__ == "__main__":
    run_tests()
