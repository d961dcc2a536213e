"""torch's RPC test fixtures (``RpcAgentTestFixture`` on TensorPipe, ``dist_init``), as test/distributed/rpc uses
them: tests of torch's own RPC agent. With the switch on they run on rank processes whatever the isolation asked
for (the run says so), since thread ranks stand in for torch's agent without reproducing its internals."""
import os

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.rpc import _rref_context_get_debug_info
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.dist_utils import dist_init, worker_name
from torch.testing._internal.distributed.rpc.rpc_agent_test_fixture import RpcAgentTestFixture
from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
    TensorPipeRpcAgentTestFixture,
)
from torch.testing._internal.common_distributed import MultiProcessTestCase


def add_then_nested(to, x, y, z):
    out = torch.futures.Future()

    def first_done(fut1):
        rpc.rpc_async(to, torch.add, args=(fut1.wait(), z)).then(lambda fut2: out.set_result(fut2.wait()))

    rpc.rpc_async(to, torch.add, args=(x, y)).then(first_done)
    return out.wait()


def raise_value():
    raise ValueError("Expected error")


class RpcCases(RpcAgentTestFixture):
    @dist_init
    def test_rpc_sync_and_pid(self):
        dst = worker_name((self.rank + 1) % self.world_size)
        got = rpc.rpc_sync(dst, torch.add, args=(torch.full((2,), float(self.rank)), 1))
        self.assertEqual(got, torch.full((2,), self.rank + 1.0))
        # each rank its own process: what torch's fixtures assume of its agent
        pids = rpc.api._all_gather(os.getpid())
        self.assertEqual(len(set(pids.values())), self.world_size)

    @dist_init
    def test_nested_callbacks_and_errors(self):
        dst1 = worker_name((self.rank + 1) % self.world_size)
        dst2 = worker_name((self.rank + 2) % self.world_size)
        got = rpc.rpc_sync(dst1, add_then_nested, args=(dst2, torch.ones(2, 2), 1, 2))
        self.assertEqual(got, torch.ones(2, 2) + 3)
        with self.assertRaisesRegex(ValueError, "Expected error"):
            rpc.rpc_async(dst1, raise_value).wait()

    @dist_init
    def test_rref_context_is_torchs(self):
        # torch's own RRef context: only torch's agent has one
        info = _rref_context_get_debug_info()
        self.assertEqual(0, int(info["num_owner_rrefs"]))


class TensorPipeRpcCases(TensorPipeRpcAgentTestFixture, RpcCases, MultiProcessTestCase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
