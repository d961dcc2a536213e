"""Object collectives (all_gather_object, broadcast_object_list, gather_object, scatter_object_list,
send_object_list, recv_object_list) and batched point to point (P2POp, batch_isend_irecv), on every backend.

Each rank's objects are a pure function of its global rank (:func:`obj`: a dict holding a string, a tuple
and a tensor whose sizes differ per rank, so the pickles differ in length and the padding is exercised).
The test process recomputes them and derives what every member must hold after each call, sharing no code
with the library.  The bodies run on the world and on subgroups whose global and group ranks differ
(``new_group([2, 0])`` at W >= 3, ``new_group([3, 1, 2])`` at W = 4).  Real gloo processes run W = 3
only: they are slow to start, and W = 3 already has a subgroup.

Bad inputs (sim only: the checks run on the calling rank before anything is sent, whatever the backend):
each message names the call, the group, the rank, the offending values and a fix.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

import tensorplay as tp
import tensorplay.distributed as dist
from tensorplay.distributed import DistTypeError, DistValueError, RankNotInGroupError

from _support.backends import SIM, Ranks, on_backends, on_backends_with
from _support.worlds import gname, group, group_specs, members

#: gloo and the process-isolated simulator start real processes: one world size is enough there
FEW = {"gloo": (3,), "sim-process": (3,)}


# ---------------------------------------------------------------------------
# the per-rank objects and an equality that sees into tensors
# ---------------------------------------------------------------------------
def obj(rank: int, salt: str = "") -> dict[str, Any]:
    """Rank ``rank``'s object: distinct per rank, its pickle's length growing with the rank."""
    return {"rank": rank, "name": f"r{rank}{salt}" * (rank + 1), "tup": (rank,) * rank,
            "t": torch.arange(rank + 2, dtype=torch.float64) * 0.5 + rank}


def same(a: Any, b: Any) -> bool:
    """Deep equality where tensors compare by dtype, shape and values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


# ---------------------------------------------------------------------------
# every call on every member, once per group
# ---------------------------------------------------------------------------
def _objects_body(spec: tuple[int, ...] | None) -> dict[str, Any] | None:
    pg = group(spec)
    ms = members(dist.get_world_size(), spec)
    rank = dist.get_rank()
    if rank not in ms:
        return None
    n, me = len(ms), ms.index(rank)
    out: dict[str, Any] = {}

    ag = [None] * n
    assert dist.all_gather_object(ag, obj(rank), group=pg) is None
    out["all_gather"] = ag

    # broadcast from every member; src's own entries are left as they are (the same objects)
    bc = []
    for src in ms:
        mine = [obj(src, "b"), f"from {src}", None] if rank == src else ["stale", 0, 1]
        before = list(mine)
        dist.broadcast_object_list(mine, src=src, group=pg, device="cpu")
        bc.append((mine, rank != src or all(x is y for x, y in zip(mine, before))))
    out["broadcast"] = bc

    # gather to the last member, then to the first by group rank
    gl = [None] * n if me == n - 1 else None
    dist.gather_object(obj(rank, "g"), gl, dst=ms[-1], group=pg)
    gl0 = ["x"] * n if me == 0 else None
    dist.gather_object((rank, "g0"), gl0, group=pg, group_dst=0)
    out["gather"] = (gl, gl0)

    # scatter from the last member (by group rank) and from global rank ms[0] (the default src is 0 only
    # on the world: a subgroup without rank 0 must name its src)
    so = [None, "kept"]
    ins = [("to", i, "x" * i) for i in range(n)] if me == n - 1 else None
    dist.scatter_object_list(so, ins, group=pg, group_src=n - 1)
    so2 = [None]
    ins2 = [obj(100 + i) for i in range(n)] if me == 0 else [0]  # a non-src input list is ignored
    dist.scatter_object_list(so2, ins2, src=ms[0], group=pg)
    out["scatter"] = (so, so2)

    # a chain of blocking send/recv: group rank 0 sends first, the others receive first; rank 0 receives
    # from any source, with the batched path on one side
    if n > 1:
        nxt, prev = ms[(me + 1) % n], ms[(me - 1) % n]
        box = [None, None]
        payload = [obj(rank, "p"), ("from", rank)]
        if me == 0:
            dist.send_object_list(payload, dst=nxt, group=pg, use_batch=True)
            sender = dist.recv_object_list(box, group=pg)
        else:
            sender = dist.recv_object_list(box, group_src=(me - 1) % n, group=pg)
            dist.send_object_list(payload, dst=nxt, group=pg, device=torch.device("cpu"))
        out["p2p"] = (sender, box, prev)

        # a ring in one batch: send to the next, receive from the previous (torch's own irecv accepted)
        x = tp.full((3,), 10.0 * rank + 1)
        y = tp.zeros(3)
        z = tp.zeros(3)
        ops = [dist.P2POp(dist.isend, x, group_peer=(me + 1) % n, group=pg),
               dist.P2POp(torch.distributed.irecv, y, prev, group=pg),
               dist.P2POp(torch.distributed.isend, x + 1, prev, group=pg, tag=7),
               dist.P2POp(dist.irecv, z, nxt, group=pg, tag=7)]
        works = dist.batch_isend_irecv(ops)
        for w in works:
            w.wait()
        out["batch"] = (len(works), y, z, [(op.peer, op.group_peer) for op in ops])
    return out


@on_backends_with("spec", group_specs, gname, (1, 2, 3, 4), worlds_on=FEW)
def test_object_collectives_match_the_reference(ranks: Ranks, spec: tuple[int, ...] | None) -> None:
    ms = members(ranks.world_size, spec)
    n = len(ms)
    got = ranks.run(_objects_body, spec)
    for r in range(ranks.world_size):
        if r not in ms:
            assert got[r] is None
            continue
        res, me, where = got[r], ms.index(r), f"{ranks} group {ms} rank {r}"
        assert same(res["all_gather"], [obj(s) for s in ms]), where

        for (lst, untouched), src in zip(res["broadcast"], ms):
            assert same(lst, [obj(src, "b"), f"from {src}", None]), (where, src)
            assert untouched, (where, "src's entries must be the same objects after broadcast_object_list")

        gl, gl0 = res["gather"]
        assert same(gl, [obj(s, "g") for s in ms]) if me == n - 1 else gl is None, where
        assert same(gl0, [(s, "g0") for s in ms]) if me == 0 else gl0 is None, where

        so, so2 = res["scatter"]
        assert same(so, [("to", me, "x" * me), "kept"]), where  # only entry 0 is written
        assert same(so2, [obj(100 + me)]), where

        if n > 1:
            sender, box, prev = res["p2p"]
            assert sender == prev, where  # the sender's global rank
            assert same(box, [obj(prev, "p"), ("from", prev)]), where

            count, y, z, peers = res["batch"]
            nxt = ms[(me + 1) % n]
            assert count == 4, where
            assert torch.equal(y, torch.full((3,), 10.0 * prev + 1)), where
            assert torch.equal(z, torch.full((3,), 10.0 * nxt + 2)), where
            assert peers == [(nxt, (me + 1) % n), (prev, ms.index(prev)), (prev, ms.index(prev)),
                             (nxt, (me + 1) % n)], where


# ---------------------------------------------------------------------------
# bad inputs: every rank checks its own arguments before anything is sent
# ---------------------------------------------------------------------------
def _lam() -> Any:
    return lambda: None  # pickle refuses lambdas


#: case -> what the calling rank does; a rank whose case is None calls nothing (so nobody waits on it)
BAD: dict[str, Any] = {
    "all_gather_short": lambda r: dist.all_gather_object([None, None], r),
    "all_gather_tuple": lambda r: dist.all_gather_object((None,) * 3, r),
    "all_gather_unpicklable": lambda r: dist.all_gather_object([None] * 3, _lam()),
    "broadcast_src_out": lambda r: dist.broadcast_object_list([1], src=5),
    "broadcast_empty": lambda r: dist.broadcast_object_list([], src=0),
    "broadcast_bad_device": lambda r: dist.broadcast_object_list([1], src=0, device="no-such-device"),
    "gather_none_on_dst": lambda r: dist.gather_object(r, None, dst=0) if r == 0 else
    dist.gather_object(r, [None] * 3, dst=0) if r == 1 else None,
    "gather_long": lambda r: dist.gather_object(r, [None] * 4, dst=r),
    "scatter_out_empty": lambda r: dist.scatter_object_list([], [1, 2, 3]),
    "scatter_in_missing": lambda r: dist.scatter_object_list([None], None) if r == 0 else None,
    "scatter_in_short": lambda r: dist.scatter_object_list([None], [1, 2], src=1) if r == 1 else None,
    "send_self": lambda r: dist.send_object_list([1], dst=r),
    "send_no_dst": lambda r: dist.send_object_list([1]),
    "recv_empty": lambda r: dist.recv_object_list([], src=(r + 1) % 3),
    "p2p_bad_op": lambda r: dist.P2POp(dist.send, tp.zeros(1), (r + 1) % 3),
    "p2p_bad_tensor": lambda r: dist.P2POp(dist.isend, [1.0], (r + 1) % 3),
    "p2p_no_peer": lambda r: dist.P2POp(dist.irecv, tp.zeros(1)),
    "p2p_self": lambda r: dist.P2POp(dist.isend, tp.zeros(1), r),
    "batch_empty": lambda r: dist.batch_isend_irecv([]),
    "batch_not_op": lambda r: dist.batch_isend_irecv([dist.P2POp(dist.isend, tp.zeros(1), (r + 1) % 3), 3]),
    "batch_two_groups": lambda r: dist.batch_isend_irecv([
        dist.P2POp(dist.isend, tp.zeros(1), (r + 1) % 3),
        dist.P2POp(dist.irecv, tp.zeros(1), (r + 2) % 3, group=dist.new_group([0, 1, 2]))]),
}
#: every case: BAD's, and a rank outside the group (its own body, :func:`_member_body`)
CASES = sorted([*BAD, "not_a_member"])


def _bad_body(case: str) -> tuple[str, str] | None:
    r = dist.get_rank()
    try:
        BAD[case](r)
    except Exception as e:  # noqa: BLE001  (the test looks at the class and the message)
        return type(e).__name__, str(e)
    return None


#: case -> (ranks that raise, error class, substrings of the message)
EXPECT: dict[str, tuple[tuple[int, ...], type, tuple[str, ...]]] = {
    "all_gather_short": ((0, 1, 2), DistValueError, (
        "tensorplay.distributed.all_gather_object (group [0, 1, 2], rank {r})", "len(object_list)=2",
        "group_size=3", "Fix: pass a list of exactly 3 entries")),
    "all_gather_tuple": ((0, 1, 2), DistTypeError, ("all_gather_object", "type(object_list)='tuple'", "Fix:")),
    "all_gather_unpicklable": ((0, 1, 2), DistTypeError, ("all_gather_object", "obj cannot be pickled",
                                                           "type(obj)='function'", "Fix:")),
    "broadcast_src_out": ((0, 1, 2), RankNotInGroupError, ("broadcast_object_list", "src=5",
                                                            "group_ranks=[0, 1, 2]", "Fix:")),
    "broadcast_empty": ((0, 1, 2), DistValueError, ("broadcast_object_list", "len(object_list)=0", "Fix:")),
    "broadcast_bad_device": ((0, 1, 2), DistTypeError, ("broadcast_object_list", "device='no-such-device'")),
    "gather_none_on_dst": ((0, 1), DistValueError, ("gather_object (group [0, 1, 2], rank {r})",
                                                    "object_gather_list", "Fix:")),
    "gather_long": ((0, 1, 2), DistValueError, ("gather_object", "len(object_gather_list)=4", "group_size=3")),
    "scatter_out_empty": ((0, 1, 2), DistValueError, ("scatter_object_list", "len(scatter_object_output_list)=0")),
    "scatter_in_missing": ((0,), DistValueError, ("scatter_object_list", "scatter_object_input_list=None",
                                                  "on src=0")),
    "scatter_in_short": ((1,), DistValueError, ("scatter_object_list", "len(scatter_object_input_list)=2",
                                                "group_size=3")),
    "send_self": ((0, 1, 2), DistValueError, ("send_object_list", "dst={r}", "Fix:")),
    "send_no_dst": ((0, 1, 2), DistValueError, ("send_object_list", "no dst was given", "dst=None")),
    "recv_empty": ((0, 1, 2), DistValueError, ("recv_object_list", "len(object_list)=0")),
    "p2p_bad_op": ((0, 1, 2), DistValueError, ("tensorplay.distributed.P2POp (group [0, 1, 2], rank {r})",
                                               "op must be isend or irecv", "op=<function send", "Fix:")),
    "p2p_bad_tensor": ((0, 1, 2), DistTypeError, ("P2POp", "tensor='list'")),
    "p2p_no_peer": ((0, 1, 2), DistValueError, ("P2POp", "no peer was given", "peer=None")),
    "p2p_self": ((0, 1, 2), DistValueError, ("P2POp", "cannot send to or from itself", "peer={r}")),
    "batch_empty": ((0, 1, 2), DistValueError, ("tensorplay.distributed.batch_isend_irecv (rank {r})",
                                                "p2p_op_list=[]", "Fix:")),
    "batch_not_op": ((0, 1, 2), DistValueError, ("batch_isend_irecv", "type(p2p_op_list[1])='int'")),
    "batch_two_groups": ((0, 1, 2), DistValueError, (
        "batch_isend_irecv", "same group", "p2p_op_list[0].group=ProcessGroup(ranks=[0, 1, 2], backend='sim', id=0)",
        "p2p_op_list[1].group=ProcessGroup(ranks=[0, 1, 2], backend='sim', id=1)")),
    "not_a_member": ((2,), RankNotInGroupError, ("all_gather_object", "not a member")),
}


@on_backends((3,), backends=[SIM])
@pytest.mark.parametrize("case", CASES)
def test_bad_input_names_the_call_the_values_and_a_fix(ranks: Ranks, case: str) -> None:
    raisers, cls, parts = EXPECT[case]
    if case == "not_a_member":
        got = ranks.run(_member_body)
    else:
        got = ranks.run(_bad_body, case)
    for r, res in enumerate(got):
        if r not in raisers:
            assert res is None, (case, r, res)
            continue
        assert res is not None, (case, r, "no error")
        name, msg = res
        assert name == cls.__name__, (case, r, name, msg)
        for p in parts:
            assert p.format(r=r) in msg, (case, r, p, msg)


def _member_body() -> tuple[str, str] | None:
    # members 0 and 1 run the collective; rank 2 (not a member) must be refused before anything is sent
    g = dist.new_group([0, 1])
    r = dist.get_rank()
    try:
        out = [None, None]
        dist.all_gather_object(out, r, group=g)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)
    assert out == [0, 1]
    return None


def test_the_error_classes_are_the_builtins_torch_raises() -> None:
    # torch raises ValueError for a bad P2POp op, a bad p2p_op_list and a missing gather/scatter list
    assert issubclass(DistValueError, ValueError) and issubclass(DistTypeError, TypeError)
    assert sorted(EXPECT) == CASES
