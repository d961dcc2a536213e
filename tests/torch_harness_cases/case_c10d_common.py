"""c10d behaviour as c10d's common tests observe it on gloo: DDP with sparse gradients and communication hooks,
_broadcast_coalesced, groups in the order given, sequence numbers, torch's dtype checks, the debug level and
LOCAL_RANK from each rank's environment, and every registered backend's name."""
import copy
import os
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torch.distributed as c10d
from torch.nn.parallel import DistributedDataParallel
from torch.testing._internal.common_distributed import MultiProcessTestCase, verify_ddp_error_logged
from torch.testing._internal.common_utils import run_tests


class SparseGradientModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.EmbeddingBag(10, 10, sparse=True)
    def forward(self, x):
        return F.softmax(self.embedding(x), dim=1)

class Task(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.p = nn.Parameter(torch.randn(40, 20))
    def forward(self, x):
        return self.p * x

class ModuleForDdpCommHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.t0 = Task()
    def forward(self, x, rank):
        return self.t0(x + rank)


class CommonCases(MultiProcessTestCase):
    @property
    def world_size(self):
        return 4
    def setUp(self):
        super().setUp(); self._spawn_processes()
    def _pg(self):
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world_size)
        return c10d.distributed_c10d._get_default_group()

    def test_sparse_gradients(self):
        pg = self._pg()
        torch.manual_seed(1337)
        vanilla = SparseGradientModule()
        ddp = DistributedDataParallel(copy.deepcopy(vanilla), process_group=pg)
        mult = 2; bs = mult * self.world_size
        crit = nn.CrossEntropyLoss()
        inp = torch.randint(0, 10, [bs, 2]); tgt = torch.randint(0, 10, [bs])
        crit(vanilla(inp), tgt).backward()
        crit(ddp(inp.split(mult)[self.rank]), tgt.split(mult)[self.rank]).backward()
        self.assertEqual(next(vanilla.parameters()).grad.coalesce(), next(ddp.parameters()).grad.coalesce())

    def test_comm_hook_sparse(self):
        pg = self._pg()
        torch.manual_seed(1337)
        vanilla = SparseGradientModule()
        ddp = DistributedDataParallel(copy.deepcopy(vanilla), process_group=pg)
        ws = self.world_size
        def hook(state, bucket):
            return pg.allreduce([bucket.buffer()]).get_future().then(lambda f: f.wait()[0] / ws)
        ddp.register_comm_hook(None, hook)
        mult = 2; bs = mult * ws
        crit = nn.CrossEntropyLoss()
        inp = torch.randint(0, 10, [bs, 2]); tgt = torch.randint(0, 10, [bs])
        crit(vanilla(inp), tgt).backward()
        crit(ddp(inp.split(mult)[self.rank]), tgt.split(mult)[self.rank]).backward()
        self.assertEqual(next(vanilla.parameters()).grad.coalesce(), next(ddp.parameters()).grad.coalesce())

    def test_comm_hook_future_passing(self):
        pg = self._pg()
        model = DistributedDataParallel(ModuleForDdpCommHook(), process_group=pg)
        def simple(state, bucket):
            fut = torch.futures.Future(); fut.set_result(torch.ones_like(bucket.buffer()))
            return fut.then(lambda f: f.value() + torch.ones_like(f.value()))
        model.register_comm_hook(None, simple)
        out = model(8, self.rank); out.mean().backward()
        for p in model.parameters(): self.assertEqual(p.grad, 2 * torch.ones(40, 20))

    def test_invalid_hook_return(self):
        pg = self._pg()
        model = DistributedDataParallel(ModuleForDdpCommHook(), process_group=pg)
        expected = "Communication hook: return annotation should be torch.futures.Future"
        with self.assertRaisesRegex(ValueError, expected):
            def h(state: object, bucket: dist.GradBucket) -> int:
                return torch.futures.Future()
            model.register_comm_hook(state=None, hook=h)
        verify_ddp_error_logged(model, expected)
        with self.assertRaisesRegex(RuntimeError, "callback must return a torch.futures.Future object, but got"):
            def h2(state: object, bucket: dist.GradBucket):
                return 1
            model.register_comm_hook(state=None, hook=h2)
            model(8, self.rank).mean().backward()

    def test_broadcast_coalesced(self):
        pg = self._pg()
        for root in range(self.world_size):
            target = torch.arange(60, dtype=torch.float32).chunk(5)
            target += torch.arange(60, dtype=torch.float64).chunk(5)
            tensors = [t.clone() for t in target] if self.rank == root else [torch.zeros_like(t) for t in target]
            c10d._broadcast_coalesced(pg, tensors, buffer_size=256, src=root)
            self.assertEqual(tensors, target)

    def test_new_group_local_sync_dup(self):
        self._pg()
        rank = dist.get_rank(); pg_idx = rank // 2
        ranks_in = [pg_idx * 2, pg_idx * 2 + 1]
        pgs = [dist.new_group(ranks=ranks_in, use_local_synchronization=True) for _ in range(2)]
        for new_pg in pgs:
            out = [torch.tensor([-1, -1]) for _ in range(new_pg.size())]
            dist.all_gather(out, torch.tensor([pg_idx, rank]), group=new_pg)
            self.assertEqual(out, [torch.tensor([pg_idx, ranks_in[0]]), torch.tensor([pg_idx, ranks_in[1]])])

    def test_new_group_ordered(self):
        self._pg()
        rank = dist.get_rank()
        rev = list(range(self.world_size - 1, -1, -1))
        new_pg = dist.new_group(ranks=rev, sort_ranks=False)
        self.assertEqual(dist.get_group_rank(new_pg, rank), rev.index(rank))
        self.assertEqual(dist.get_process_group_ranks(new_pg), rev)
        out = [torch.tensor([-1]) for _ in range(self.world_size)]
        dist.all_gather(out, torch.tensor([rank]), group=new_pg)
        self.assertEqual(out, [torch.tensor([r]) for r in rev])

    def test_rank_membership(self):
        self._pg()
        group = dist.new_group(ranks=[1])
        self.assertEqual(dist.get_group_rank(group, 1), 0)
        with self.assertRaisesRegex(ValueError, "not part of group"):
            dist.get_group_rank(group, 0)
        self.assertEqual(dist.get_global_rank(group, 0), 1)
        self.assertEqual(dist.get_process_group_ranks(group), [1])

    def test_seq_num(self):
        self._pg()
        default_pg = c10d.distributed_c10d._get_default_group()
        seq = default_pg._get_sequence_number_for_group()
        objs = [None] * self.world_size
        dist.all_gather_object(objs, seq)
        self.assertEqual(len(set(objs)), 1)

    def test_dtype_mismatch(self):
        self._pg()
        t = torch.ones(2, 2) * 7
        th = t.half()
        tl = [torch.zeros(2, 2) for _ in range(self.world_size)]
        tlh = list(tl); tlh[1] = tlh[1].half()
        with self.assertRaisesRegex(ValueError, "tensors with different dtypes"):
            dist.all_gather(tlh, t)
        with self.assertRaisesRegex(ValueError, "tensors with different dtypes"):
            dist.all_reduce_coalesced(tlh)
        with self.assertRaisesRegex(ValueError, "tensors with different dtypes"):
            dist.all_to_all_single(th, t)
        with self.assertRaisesRegex(ValueError, "tensors with different dtypes"):
            dist.scatter(th, tl)

    def test_complex_and_bool(self):
        self._pg()
        t = torch.rand(2); tc = torch.view_as_complex(t)
        tl = [torch.rand(2) for _ in range(self.world_size)]
        tlc = list(tl); tlc[1] = torch.view_as_complex(tlc[1])
        dist.all_gather(tl, t); dist.all_gather(tl, tc); dist.all_gather(tlc, t); dist.all_gather(tlc, tc)
        tensor = torch.tensor([1, 0, 0, 1], dtype=torch.bool)
        out = torch.zeros(4, dtype=torch.bool) if self.rank > 0 else tensor
        dist.broadcast(out, src=0)
        self.assertEqual(out, tensor)

    def test_debug_level(self):
        os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        dist.set_debug_level_from_env()
        self.assertEqual(dist.get_debug_level(), dist.DebugLevel.OFF)
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "INFO"
        dist.set_debug_level_from_env()
        self.assertEqual(dist.get_debug_level(), dist.DebugLevel.INFO)
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "foo"
        with self.assertRaisesRegex(ValueError, "The value of TORCH_DISTRIBUTED_DEBUG must"):
            dist.set_debug_level_from_env()

    def test_local_rank(self):
        with self.assertRaisesRegex(RuntimeError, "LOCAL_RANK"):
            dist.get_node_local_rank()
        os.environ["LOCAL_RANK"] = str(self.rank)
        self.assertEqual(dist.get_node_local_rank(fallback_rank=123), self.rank)

    def test_a2a_contiguous(self):
        self._pg()
        i = torch.ones(2, 2); o = torch.zeros(2, 2)
        if self.world_size == 2:
            dist.all_to_all_single(o, i)
        with self.assertRaisesRegex(ValueError, "Tensors must be contiguous"):
            dist.all_to_all_single(o, i.t())

    def test_ignored_output_unused(self):
        pg = self._pg()
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc1 = nn.Linear(2, 10, bias=False); self.fc2 = nn.Linear(10, 4, bias=False); self.fc3 = nn.Linear(4, 4, bias=False)
            def forward(self, x):
                return F.softmax(F.relu(self.fc2(F.relu(self.fc1(x)))), dim=1)
        model = DistributedDataParallel(M().float(), process_group=pg, find_unused_parameters=True)
        inp = torch.rand([4, 2]); tgt = torch.LongTensor([1, 2, 3, 0])
        for _ in range(4):
            del_out = model(inp); del del_out
        for _ in range(4):
            nn.CrossEntropyLoss()(model(inp), tgt).backward()

    def test_all_backends_names(self):
        for backend in dist.Backend.backend_list:
            expected = backend
            if backend == dist.Backend.UNDEFINED: continue
            elif backend in (dist.Backend.MPI, dist.Backend.UCC, dist.Backend.XCCL, dist.Backend.NCCL): continue
            elif backend == dist.Backend.GLOO: pass
            elif backend != "threaded": expected = "custom"
            store = dist.FileStore(self.file_name + backend, self.world_size)
            dist.init_process_group(backend=backend, rank=self.rank, world_size=self.world_size, store=store)
            pg = c10d.distributed_c10d._get_default_group()
            self.assertEqual(pg.rank(), self.rank)
            self.assertEqual(pg.size(), self.world_size)
            self.assertEqual(pg.name(), str(expected))
            dist.destroy_process_group()

    def test_registered_backend_is_the_registering_ranks(self):
        # Backend.register_backend fills class-level tables: a process's own
        store = dist.FileStore(self.file_name, self.world_size)
        dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size, store=store)
        if self.rank == 0:
            dist.Backend.register_backend("tpregprobe", lambda *args: None)
        dist.barrier()
        self.assertEqual(dist.is_backend_available("tpregprobe"), self.rank == 0)
        dist.destroy_process_group()

    def test_rank_zero_spins_on_the_default_store_until_the_others_add(self):
        # torch's DummyProcessGroup.barrier: rank 0 polls the default store in a loop with no sleep
        dist.init_process_group("gloo", init_method=f"file://{self.file_name}", rank=self.rank,
                                world_size=self.world_size)
        store = c10d.distributed_c10d._get_default_store()
        if self.rank == 0:
            count = 0
            while count < self.world_size - 1:
                count = store.add("spin", 0)
            self.assertEqual(count, self.world_size - 1)
        else:
            store.add("spin", 1)
        dist.barrier()
        dist.destroy_process_group()

if __name__ == "__main__":
    run_tests()
