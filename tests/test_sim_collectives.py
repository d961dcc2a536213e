"""Every collective on the simulator, at world sizes 1-8, on the world and on subgroups, against a
reference computed here from all ranks' inputs (distinct per rank)."""
from __future__ import annotations

import pytest
import torch

import simulator
import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed import ReduceOp

from _sim_helpers import case_id, cases, fold, members, value

CASES = cases()


def _run(body, w, g, mode="coop", seed=0):
    """Run ``body(pg, me, ms)`` on members of the group ``g`` (None = world); non-members return None."""

    def fn():
        pg = dist.new_group(list(g)) if g is not None else None
        ms = members(w, g)
        if dist.get_rank() not in ms:
            return None
        return body(pg, ms.index(dist.get_rank()), ms)

    return simulator.run(fn, w, mode=mode, seed=seed, timeout=20)


def _exact(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
    assert torch.equal(a, b), (a, b)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_broadcast_every_src(case):
    w, g = case
    ms = members(w, g)

    def body(pg, me, ms):
        outs = []
        for src in ms:
            x = value(dist.get_rank())
            dist.broadcast(x, src=src, group=pg)
            outs.append(x)
        return outs

    res = _run(body, w, g)
    for r in ms:
        for k, src in enumerate(ms):
            _exact(res[r][k], value(src))


FLOAT_OPS = ["sum", "avg", "product", "min", "max"]
INT_OPS = ["sum", "product", "min", "max", "band", "bor", "bxor"]
BOOL_OPS = ["band", "bor", "bxor", "sum", "product"]


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype,ops", [(torch.float64, FLOAT_OPS), (torch.int64, INT_OPS), (torch.bool, BOOL_OPS)],
                         ids=["f64", "i64", "bool"])
def test_all_reduce_every_op(case, dtype, ops):
    w, g = case
    ms = members(w, g)

    def body(pg, me, ms):
        outs = []
        for op in ops:
            x = value(dist.get_rank(), dtype=dtype)
            dist.all_reduce(x, op=ReduceOp[op.upper()], group=pg)
            outs.append(x)
        return outs

    res = _run(body, w, g)
    for k, op in enumerate(ops):
        want = fold([value(r, dtype=dtype) for r in ms], op)
        for r in ms:
            _exact(res[r][k], want)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_reduce_every_op_and_dst(case):
    w, g = case
    ms = members(w, g)

    def body(pg, me, ms):
        outs = []
        for op in FLOAT_OPS:
            for dst in ms:
                x = value(dist.get_rank())
                dist.reduce(x, dst=dst, op=ReduceOp[op.upper()], group=pg)
                outs.append(x)
        return outs

    res = _run(body, w, g)
    k = 0
    for op in FLOAT_OPS:
        want = fold([value(r) for r in ms], op)
        for dst in ms:
            for r in ms:
                _exact(res[r][k], want if r == dst else value(r))  # non-dst tensors are left as they were
            k += 1


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_all_gather_and_into_tensor(case):
    w, g = case
    ms = members(w, g)
    n = len(ms)

    def body(pg, me, ms):
        x = value(dist.get_rank(), n=3)
        lst = [tp.empty(3, dtype=torch.float64) for _ in ms]
        dist.all_gather(lst, x, group=pg)
        cat = tp.empty(3 * n, dtype=torch.float64)
        dist.all_gather_into_tensor(cat, x, group=pg)
        stk = tp.empty(n, 3, dtype=torch.float64)
        dist.all_gather_into_tensor(stk, x, group=pg)
        scal = tp.empty(n, dtype=torch.float64)
        dist.all_gather_into_tensor(scal, x[1].clone(), group=pg)  # 0-d inputs stack to (n,)
        return lst, cat, stk, scal

    res = _run(body, w, g)
    want = [value(r, n=3) for r in ms]
    for r in ms:
        lst, cat, stk, scal = res[r]
        for a, b in zip(lst, want):
            _exact(a, b)
        _exact(cat, torch.cat(want))
        _exact(stk, torch.stack(want))
        _exact(scal, torch.stack([v[1] for v in want]))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_gather_and_scatter(case):
    w, g = case
    ms = members(w, g)
    n = len(ms)
    root = ms[-1]

    def body(pg, me, ms):
        rank = dist.get_rank()
        gl = [tp.empty(4, dtype=torch.float64) for _ in ms] if rank == root else None
        dist.gather(value(rank, n=4), gl, dst=root, group=pg)
        out = tp.empty(4, dtype=torch.float64)
        sl = [value(100 + i, n=4) for i in range(n)] if rank == root else None
        dist.scatter(out, sl, src=root, group=pg)
        return gl, out

    res = _run(body, w, g)
    for i, r in enumerate(ms):
        gl, out = res[r]
        if r == root:
            for a, src in zip(gl, ms):
                _exact(a, value(src, n=4))
        else:
            assert gl is None
        _exact(out, value(100 + i, n=4))


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("op", ["sum", "max", "avg"])
def test_reduce_scatter_list_and_tensor(case, op):
    w, g = case
    ms = members(w, g)
    n = len(ms)
    rop = ReduceOp[op.upper()]

    def chunks(rank):
        return [value(rank * 10 + i, n=2) for i in range(n)]

    def body(pg, me, ms):
        rank = dist.get_rank()
        out = tp.empty(2, dtype=torch.float64)
        dist.reduce_scatter(out, chunks(rank), op=rop, group=pg)
        out2 = tp.empty(2, dtype=torch.float64)
        dist.reduce_scatter_tensor(out2, torch.cat(chunks(rank)), op=rop, group=pg)
        out3 = tp.empty(2, dtype=torch.float64)
        dist.reduce_scatter_tensor(out3, torch.stack(chunks(rank)), op=rop, group=pg)
        return out, out2, out3

    res = _run(body, w, g)
    for i, r in enumerate(ms):
        want = fold([chunks(s)[i] for s in ms], op)
        for t in res[r]:
            _exact(t, want)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_all_to_all_ragged(case):
    w, g = case
    ms = members(w, g)

    def block(i, j):  # what group rank i sends to group rank j: ragged shape (1 + i + 2j,)
        return torch.arange(1 + i + 2 * j, dtype=torch.float64) + 100 * i + j

    def body(pg, me, ms):
        n = len(ms)
        ins = [block(me, j) for j in range(n)]
        outs = [tp.empty(1 + j + 2 * me, dtype=torch.float64) for j in range(n)]
        dist.all_to_all(outs, ins, group=pg)
        return outs

    res = _run(body, w, g)
    for i, r in enumerate(ms):
        for j in range(len(ms)):
            _exact(res[r][j], block(j, i))


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_all_to_all_single_uneven_and_zero_splits(case):
    w, g = case
    ms = members(w, g)
    n = len(ms)

    def rows(i, j):  # rows group rank i sends to group rank j (zeros included)
        return (i + 2 * j) % 3

    def data(i):
        total = sum(rows(i, j) for j in range(n))
        return torch.arange(total * 2, dtype=torch.float64).reshape(total, 2) + 1000 * i

    def body(pg, me, ms):
        ins = [rows(me, j) for j in range(n)]
        outs = [rows(j, me) for j in range(n)]
        out = tp.empty(sum(outs), 2, dtype=torch.float64)
        dist.all_to_all_single(out, data(me), outs, ins, group=pg)
        even = tp.empty(2 * n, dtype=torch.float64)
        dist.all_to_all_single(even, torch.arange(2. * n, dtype=torch.float64) + 10 * me, group=pg)
        return out, even

    res = _run(body, w, g)
    for i, r in enumerate(ms):
        parts = []
        for j in range(n):
            off = sum(rows(j, k) for k in range(i))
            parts.append(data(j)[off:off + rows(j, i)])
        out, even = res[r]
        _exact(out, torch.cat(parts))
        _exact(even, torch.cat([torch.arange(2. * n, dtype=torch.float64)[2 * i:2 * i + 2] + 10 * j for j in range(n)]))


@pytest.mark.parametrize("w", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("mode", ["coop", "threads"])
def test_async_work_and_barrier(w, mode):
    def fn():
        r = dist.get_rank()
        xs = [value(r) + k for k in range(3)]
        works = [dist.all_reduce(x, async_op=True) for x in xs]
        assert all(hasattr(wk, "wait") for wk in works)
        b = dist.barrier(async_op=True)
        for wk in works:
            wk.wait()
            assert wk.is_completed()
        b.wait()
        dist.barrier()
        return xs

    res = simulator.run(fn, w, mode=mode, timeout=20)
    for k in range(3):
        want = fold([value(r) + k for r in range(w)], "sum")
        for r in range(w):
            _exact(res[r][k], want)


def test_non_contiguous_and_empty_tensors():
    def fn():
        r = dist.get_rank()
        base = torch.arange(12, dtype=torch.float64).reshape(3, 4) * (r + 1)
        x = base.t()  # non-contiguous, in place
        dist.all_reduce(x)
        e = tp.empty(0)
        dist.all_reduce(e)
        z = tp.tensor(float(r))  # 0-d
        dist.all_reduce(z, op=ReduceOp.MAX)
        return x.clone(), e, z

    res = simulator.run(fn, 3)
    for x, e, z in res:
        _exact(x, (torch.arange(12, dtype=torch.float64).reshape(3, 4) * 6).t())
        assert e.numel() == 0
        assert z.item() == 2.0


def test_large_all_reduce_uses_blocked_kernel_bitwise():
    n = 300_000  # above the cache-blocked threshold

    def fn():
        g = torch.Generator().manual_seed(dist.get_rank())
        x = torch.randn(n, generator=g, dtype=torch.float32)
        y = x.clone()
        dist.all_reduce(y, op=ReduceOp.AVG)
        return x, y

    res = simulator.run(fn, 4)
    want = fold([x for x, _ in res], "avg")
    for _, y in res:
        _exact(y, want)


_LARGE_CASES = [("sum", torch.float32), ("avg", torch.float64), ("product", torch.float64), ("min", torch.float32),
                ("max", torch.float32), ("band", torch.int64), ("bxor", torch.int32), ("sum", torch.bool),
                ("product", torch.bool)]


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("op,dtype", _LARGE_CASES, ids=[f"{o}-{d}".replace("torch.", "") for o, d in _LARGE_CASES])
def test_large_reductions_fold_into_outputs_bitwise(world, op, dtype):
    """The blocked kernel (folding straight into an output where it may) gives the rank-order fold, bit for bit:
    all_reduce in place, and reduce to a root whose input is read after the first step."""
    n = 300_017  # above the blocked threshold, not a multiple of anything
    root = world - 1

    def fn():
        g = torch.Generator().manual_seed(100 + dist.get_rank())
        if dtype.is_floating_point:
            x = 1.0 + 0.01 * torch.randn(n, generator=g, dtype=dtype)
        elif dtype == torch.bool:
            x = torch.rand(n, generator=g) < 0.7
        else:
            x = torch.randint(-(1 << 20), 1 << 20, (n,), generator=g, dtype=dtype)
        y, z = x.clone(), x.clone()
        dist.all_reduce(y, op=getattr(ReduceOp, op.upper()))
        dist.reduce(z, dst=root, op=getattr(ReduceOp, op.upper()))
        return x, y, z

    res = simulator.run(fn, world)
    want = fold([x for x, _, _ in res], op)
    for _, y, _ in res:
        _exact(y, want)
    _exact(res[root][2], want)


def test_inputs_never_alias_outputs_across_ranks():
    def fn():
        x = value(dist.get_rank())
        dist.broadcast(x, src=0)
        lst = [tp.empty(5, dtype=torch.float64) for _ in range(2)]
        dist.all_gather(lst, x)
        return x, lst

    res = simulator.run(fn, 2)
    ptrs = [t.data_ptr() for x, lst in res for t in [x, *lst]]
    assert len(set(ptrs)) == len(ptrs)
