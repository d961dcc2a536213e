"""A group's own methods, called as c10d's gloo tests call them: groups built with ProcessGroupGloo(store, ...),
several tensors per call, the pybind overloads, gloo's argument checks, options, and a backend the program
registers itself."""
from datetime import timedelta

import torch
import torch.distributed as c10d
from torch.testing._internal.common_distributed import MultiProcessTestCase, create_device
from torch.testing._internal.common_utils import run_tests


class _Dummy(c10d.ProcessGroup):
    """A backend of the program's own: every all_reduce adds 2, nothing is communicated."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)

    def getBackendName(self) -> str:  # noqa: N802
        return "Dummy"

    def allreduce(self, tensors, opts):
        for t in tensors:
            t.add_(2)
        fut = torch.futures.Future()
        fut.set_result(tensors)
        return _DoneWork(fut)


class _DoneWork(c10d.Work):
    def __init__(self, fut) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout=None) -> bool:
        return True

    def get_future(self):
        return self._fut


def _dummy(store, rank, size, timeout):
    return _Dummy(rank, size)


class GlooGroupCases(MultiProcessTestCase):
    @property
    def world_size(self) -> int:
        return 3

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()

    def _group(self, timeout_s: float = 50.0):
        store = c10d.FileStore(self.file_name, self.world_size)
        opts = c10d.ProcessGroupGloo._Options()
        opts._timeout = timeout_s
        opts._devices = [create_device(interface="lo")]
        opts._threads = 2
        pg = c10d.ProcessGroupGloo(store, self.rank, self.world_size, opts)
        c10d.barrier(group=pg)
        return pg

    def test_several_inputs_reduce_into_each(self) -> None:
        pg = self._group()
        w = self.world_size
        cases = [(c10d.ReduceOp.SUM, float(w * (2 * w - 1))), (c10d.ReduceOp.MAX, 2.0 * w),
                 (c10d.ReduceOp.MIN, 1.0)]
        for op, want in cases:
            base = 0.0 if op == c10d.ReduceOp.SUM else 1.0
            ts = [torch.tensor([2 * self.rank + base]), torch.tensor([2 * self.rank + base + 1])]
            opts = c10d.AllreduceOptions()
            opts.reduceOp = op
            fut = pg.allreduce(ts, opts).get_future()
            fut.wait()
            for t in fut.value():
                self.assertEqual(t, torch.tensor([want]))
        x = torch.tensor([self.rank + 1.0])  # the overload pg.allreduce(tensor): SUM
        pg.allreduce(x).wait()
        self.assertEqual(x, torch.tensor([w * (w + 1) / 2]))

    def test_reduce_scatter_with_a_size_per_rank(self) -> None:
        c10d.init_process_group("gloo", store=c10d.FileStore(self.file_name, self.world_size), rank=self.rank,
                                world_size=self.world_size)
        # rank j gets j + 1 elements: every rank's input_list[j], reduced (test_c10d_gloo's shape, values per rank)
        for op, fold in ((c10d.ReduceOp.SUM, lambda x: x.sum(0)), (c10d.ReduceOp.MAX, lambda x: x.max(0).values)):
            inputs = [torch.arange(j + 1.0) * (self.rank + 1) + 10 * j for j in range(self.world_size)]
            out = torch.empty(self.rank + 1)
            c10d.reduce_scatter(out, inputs, op=op, async_op=True).wait()
            sent = [torch.arange(self.rank + 1.0) * (r + 1) + 10 * self.rank for r in range(self.world_size)]
            self.assertEqual(out, fold(torch.stack(sent)))

    def test_broadcast_root_tensor_and_overload(self) -> None:
        pg = self._group()
        for root in range(self.world_size):
            xs = [torch.tensor([self.rank * 2 + 0.0]), torch.tensor([self.rank * 2 + 1.0])]
            opts = c10d.BroadcastOptions()
            opts.rootRank, opts.rootTensor = root, 1
            fut = pg.broadcast(xs, opts).get_future()
            fut.wait()
            self.assertEqual(fut.value(), [torch.tensor([root * 2 + 1.0])] * 2)
        x = torch.tensor([self.rank + 1.0])
        pg.broadcast(x, root=0).wait()
        self.assertEqual(x, torch.tensor([1.0]))

    def test_allgather_several_inputs_and_future_value(self) -> None:
        pg = self._group()
        for n in (1, 2, 3):
            ins = [torch.tensor([n * self.rank + i]) for i in range(n)]
            outs = [[torch.tensor([-1]) for _ in range(n * self.world_size)] for _ in range(n)]
            fut = pg.allgather(outs, ins).get_future()
            fut.wait()
            want = [[torch.tensor([i]) for i in range(n * self.world_size)] for _ in range(n)]
            self.assertEqual(outs, want)
            self.assertEqual(fut.value(), want[0] if n == 1 else want)

    def test_argument_checks_match_gloo(self) -> None:
        pg = self._group()
        t1, t2, t3 = torch.zeros([1]), torch.zeros([1], dtype=torch.float64), torch.zeros([2])
        w = self.world_size

        def expect(pattern, call):
            with self.assertRaisesRegex(RuntimeError, pattern):
                call()

        def bopts(root, tensor):
            o = c10d.BroadcastOptions()
            o.rootRank, o.rootTensor = root, tensor
            return o

        expect("invalid root rank", lambda: pg.broadcast([t1], bopts(-1, 0)))
        expect("invalid root rank", lambda: pg.broadcast([t1], bopts(w, 0)))
        expect("invalid root tensor", lambda: pg.broadcast([t1], bopts(self.rank, 1)))
        expect("invalid root tensor", lambda: pg.broadcast([], bopts(self.rank, 0)))
        expect("invalid tensor type", lambda: pg.broadcast([t1, t2], bopts(self.rank, 0)))
        expect("invalid tensor size", lambda: pg.broadcast([t1, t3], bopts(self.rank, 0)))
        expect("requires non-empty tensor list", lambda: pg.allreduce([], c10d.AllreduceOptions()))
        expect("invalid tensor type", lambda: pg.allreduce([t1, t2], c10d.AllreduceOptions()))
        expect("invalid tensor size", lambda: pg.allreduce([t1, t3], c10d.AllreduceOptions()))
        expect("requires non-empty input tensor list", lambda: pg.allgather([], []))
        expect("requires input/output tensor lists to have the same length", lambda: pg.allgather([], [t1]))
        expect("invalid output tensor list", lambda: pg.allgather([[t1] * (w - 1)], [t1]))
        expect("invalid tensor type", lambda: pg.allgather([([t1, t2] * w)[:w]], [t1]))
        expect("invalid tensor size", lambda: pg.allgather([([t1, t3] * w)[:w]], [t1]))
        sparse = torch.sparse_coo_tensor([[0]], [1.0], size=(1,))
        expect("tensors must all have the same type", lambda: pg.allreduce_coalesced([t1, t2]))
        expect("invalid tensor layout at index", lambda: pg.allreduce_coalesced([t1, sparse]))
        long_sparse = torch.sparse_coo_tensor([[0]], [1], size=(1,))  # (gloo names the layout before the type)
        expect("invalid tensor layout at index", lambda: pg.allreduce_coalesced([t1, long_sparse]))
        expect("unsupported layout", lambda: pg.allreduce_coalesced([sparse, sparse.clone()]))

        def ropts(root, tensor=0):
            o = c10d.ReduceOptions()
            o.rootRank, o.rootTensor = root, tensor
            return o

        expect("invalid root rank", lambda: pg.reduce([t1], ropts(w)))
        expect("invalid root tensor", lambda: pg.reduce([t1], ropts(self.rank, 1)))
        expect("requires a single-element tensor list", lambda: pg.reduce([t1, t1], ropts(self.rank)))
        c10d.barrier(group=pg)  # nothing above reached the other ranks: the group still works

    def test_scatter_and_gather_checks_and_values(self) -> None:
        pg = self._group()
        t1, t2 = torch.zeros([1]), torch.zeros([1], dtype=torch.float64)
        w, me = self.world_size, self.rank

        def sopts(root):
            o = c10d.ScatterOptions()
            o.rootRank = root
            return o

        def gopts(root):
            o = c10d.GatherOptions()
            o.rootRank = root
            return o

        for pattern, call in [
            ("invalid root rank", lambda: pg.scatter([t1], [], sopts(-1))),
            ("requires a single-element output tensor list", lambda: pg.scatter([t1, t1], [], sopts(0))),
            ("requires a single-element input list", lambda: pg.scatter([t1], [], sopts(me))),
            (f"Incorrect input list size {w - 1}. Input list size should be {w}",
             lambda: pg.scatter([t1], [[t1] * (w - 1)], sopts(me))),
            ("invalid tensor type", lambda: pg.scatter([t1], [[t2] * w], sopts(me))),
            ("requires empty input on non-root", lambda: pg.scatter([t1], [[t1] * w], sopts((me + 1) % w))),
            ("requires a single-element input tensor list", lambda: pg.gather([], [], gopts(0))),
            ("requires a single-element output list", lambda: pg.gather([], [t1], gopts(me))),
            (f"Incorrect output list size {w + 1}. Output list size should be {w}",
             lambda: pg.gather([[t1] * (w + 1)], [t1], gopts(me))),
            ("requires empty output on non-root", lambda: pg.gather([[t1] * w], [t1], gopts((me + 1) % w))),
        ]:
            with self.assertRaisesRegex(RuntimeError, pattern):
                call()
        outs = [torch.tensor([-1]) for _ in range(w)]
        futs = []
        for root in range(w):
            ins = [[torch.tensor([me * 10 + r]) for r in range(w)]] if root == me else []
            futs.append(pg.scatter([outs[root]], ins, sopts(root)).get_future())
        for root, fut in enumerate(futs):
            fut.wait()
            self.assertEqual(fut.value()[0], torch.tensor([root * 10 + me]))
        got = [torch.tensor([-1]) for _ in range(w)]
        fut = pg.gather([got] if me == 1 else [], [torch.tensor([me * 7])], gopts(1)).get_future()
        fut.wait()
        if me == 1:
            self.assertEqual(fut.value(), [torch.tensor([r * 7]) for r in range(w)])

    def test_sparse_several_inputs_sum(self) -> None:
        pg = self._group()
        ins = [torch.sparse_coo_tensor([[self.rank]], [1.0], size=(4,)),
               torch.sparse_coo_tensor([[3]], [float(self.rank)], size=(4,))]
        fut = pg.allreduce(ins).get_future()
        fut.wait()
        w = self.world_size
        want = torch.tensor([1.0] * w + [0.0] * (4 - w))
        want[3] += sum(range(w))
        for t in fut.value():
            self.assertEqual(t.to_dense(), want)
        with self.assertRaisesRegex(RuntimeError, "unsupported reduction operation"):
            opts = c10d.AllreduceOptions()
            opts.reduceOp = c10d.ReduceOp.MAX
            pg.allreduce([ins[0]], opts)

    def test_options_timeout_and_stress(self) -> None:
        pg = self._group()
        self.assertEqual(pg.options._timeout, timedelta(seconds=50))
        pg._set_default_timeout(timedelta(seconds=23))
        self.assertEqual(pg.options._timeout, timedelta(seconds=23))
        futs = [pg.allreduce(torch.tensor([i + self.rank])).get_future() for i in range(200)]
        w = self.world_size
        for i, fut in enumerate(futs):
            fut.wait()
            self.assertEqual(fut.value()[0], torch.tensor([i * w + w * (w - 1) // 2]))

    def test_coalesced_async_with_a_tensor_given_twice(self) -> None:
        c10d.init_process_group("gloo", store=c10d.FileStore(self.file_name, self.world_size), rank=self.rank,
                                world_size=self.world_size)
        w = self.world_size
        xs = [2 * [torch.tensor([i + self.rank])] for i in range(2)]  # one tensor object, twice in the list
        futs = [c10d.all_reduce_coalesced(x, async_op=True) for x in xs]
        torch.futures.wait_all(futs)
        for i, fut in enumerate(futs):  # reduced once, as gloo's flattened buffer is
            self.assertEqual(fut.wait(), 2 * [torch.tensor([i * w + w * (w - 1) // 2])])
        yys = [[[torch.zeros_like(x) for x in xx] for _ in range(w)] for xx in xs]
        futs = [c10d.all_gather_coalesced(yy, xx, async_op=True) for xx, yy in zip(xs, yys)]
        torch.futures.wait_all(futs)
        self.assertEqual(yys[1][w - 1], 2 * [torch.tensor([w + w * (w - 1) // 2])])
        c10d.destroy_process_group()

    def test_init_process_group_names_its_backend(self) -> None:
        c10d.init_process_group("gloo", store=c10d.FileStore(self.file_name, self.world_size), rank=self.rank,
                                world_size=self.world_size)
        pg = c10d.distributed_c10d._get_default_group()
        self.assertEqual(pg.name(), "gloo")
        self.assertEqual(pg.size(), self.world_size)
        c10d.destroy_process_group()

    def test_a_backend_the_program_registers_is_its_own(self) -> None:
        c10d.Backend.register_backend("dummy", _dummy)
        c10d.init_process_group("dummy", store=c10d.FileStore(self.file_name, self.world_size), rank=self.rank,
                                world_size=self.world_size)
        x = torch.ones(2) * 7
        c10d.all_reduce(x)
        self.assertEqual(x, torch.ones(2) * 9)  # the dummy's meaning, not a sum over the ranks
        c10d.destroy_process_group()

    def test_zz_what_a_test_registered_ended_with_its_processes(self) -> None:
        # (runs after test_a_backend_...: unittest sorts a class's tests by name) fresh processes know no "dummy"
        self.assertNotIn("dummy", c10d.Backend.backend_list)
        self.assertFalse(c10d.is_backend_available("dummy"))
        self.assertEqual(c10d.get_debug_level(), c10d.DebugLevel.OFF)


if __name__ == "__main__":
    run_tests()
