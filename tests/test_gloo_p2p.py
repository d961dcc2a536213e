"""Point-to-point on real gloo ranks: send/recv, isend/irecv, tags, any-source receives, subgroups.

Each rank records ``label -> (sender the call reported, tensor received)``;
the test process rebuilds what every receiver must hold from
:func:`values` of the sender.  Senders are always reported as *global* ranks,
also inside subgroups and for any-source receives.
"""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import tensorplay.distributed as dist

F64, I64, C128 = torch.float64, torch.int64, torch.complex128


def gloo_param(world_size: int, *values: object, id: str) -> Any:  # noqa: A002
    return pytest.param(world_size, *values, id=id,
                        marks=[pytest.mark.gloo, pytest.mark.xdist_group(f"gloo-W{world_size}")])


def values(sender: int, shape: tuple[int, ...], dtype: torch.dtype = F64, salt: int = 0) -> torch.Tensor:
    """What ``sender`` sends under ``salt``: distinct per sender and message."""
    i = torch.arange(math.prod(shape), dtype=torch.float64)
    t = i * 0.5 + 100.0 * sender + 10.0 * salt + 1.0
    if dtype.is_complex:
        t = torch.complex(t, -t)
    return t.to(dtype).reshape(shape)


# -- the exchanges, run on every rank ------------------------------------------
_GROUPS: dict[tuple[int, ...], Any] = {}


def _subgroups(world: int) -> dict[tuple[int, ...], Any]:
    """The same subgroups as the collective tests, created once per process in a fixed order."""
    if not _GROUPS:
        for spec in [(2, 0)] * (world >= 3) + [(3, 1, 2)] * (world == 4):
            _GROUPS[spec] = dist.new_group(list(spec))
    return _GROUPS


#: (label, shape, dtype, strided receive buffer)
RING_CASES = [("ring", (4,), F64, False), ("ring-strided", (3, 4), F64, True), ("ring-0d", (), I64, False),
              ("ring-empty", (0, 3), F64, False), ("ring-complex", (2,), C128, False)]


def _strided_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros((*shape[:-1], 2 * shape[-1]), dtype=dtype)[..., ::2]


def _exchanges() -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    rec: dict[str, Any] = {}
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    # blocking ring; even ranks send first so no cycle of blocked senders forms
    for k, (label, shape, dtype, strided) in enumerate(RING_CASES):
        buf = _strided_zeros(shape, dtype) if strided else torch.zeros(shape, dtype=dtype)
        msg = values(rank, shape, dtype, salt=k)
        if strided:
            msg = _strided_zeros(shape, dtype).copy_(msg)  # a non-contiguous send as well
        if rank % 2 == 0:
            dist.send(msg, dst=nxt)
            who = dist.recv(buf, src=prv)
        else:
            who = dist.recv(buf, src=prv)
            dist.send(msg, dst=nxt)
        rec[label] = (who, buf.clone())

    # isend/irecv with every other rank at once
    works, bufs = [], {}
    for peer in range(world):
        if peer != rank:
            works.append(dist.isend(values(rank, (3,), salt=20 + peer), dst=peer))
            bufs[peer] = torch.zeros(3, dtype=F64)
            works.append(dist.irecv(bufs[peer], src=peer))
    for w in works:
        w.wait()
    recv_works = works[1::2]
    for (peer, buf), w in zip(bufs.items(), recv_works):
        rec[f"all-pairs-from{peer}"] = (w.source_rank(), buf.clone())

    # tags: rank 0 sends tag 7 then tag 3 to rank 1, which receives tag 3 first
    if rank == 0:
        a = dist.isend(values(0, (2,), salt=7), dst=1, tag=7)
        b = dist.isend(values(0, (2,), salt=3), dst=1, tag=3)
        a.wait()
        b.wait()
    elif rank == 1:
        first, second = torch.zeros(2, dtype=F64), torch.zeros(2, dtype=F64)
        rec["tag3"] = (dist.recv(first, src=0, tag=3), first)
        rec["tag7"] = (dist.recv(second, src=0, tag=7), second)

    # any source: every other rank sends to rank 0 (blocking recv), then to the last rank (irecv)
    for label, dst, use_irecv in (("any-blocking", 0, False), ("any-irecv", world - 1, True)):
        if rank == dst:
            got = []
            for _ in range(world - 1):
                buf = torch.zeros(2, dtype=F64)
                if use_irecv:
                    w = dist.irecv(buf)
                    got.append((w.source_rank(), buf))
                else:
                    got.append((dist.recv(buf, src=None), buf))
            rec[label] = got
        else:
            dist.send(values(rank, (2,), salt=40 + dst), dst=dst)

    # subgroups: group ranks differ from global ranks
    groups = _subgroups(world)
    if (2, 0) in groups and rank in (0, 2):
        g = groups[(2, 0)]  # group rank 0 = global 0, group rank 1 = global 2
        if rank == 2:
            dist.send(values(2, (3,), salt=50), group=g, group_dst=0)
            dist.send(values(2, (3,), salt=51), dst=0, group=g)
            dist.send(values(2, (3,), salt=52), group=g, group_dst=0)
        else:
            a, b, c = (torch.zeros(3, dtype=F64) for _ in range(3))
            rec["g20-group_src"] = (dist.recv(a, group=g, group_src=1), a)
            rec["g20-src"] = (dist.recv(b, src=2, group=g), b)
            rec["g20-any"] = (dist.recv(c, group=g), c)
    if (3, 1, 2) in groups and rank in (1, 2, 3):
        g = groups[(3, 1, 2)]  # group ranks 0, 1, 2 = global 1, 2, 3
        if rank == 1:
            got = []
            for _ in range(2):
                buf = torch.zeros(3, dtype=F64)
                got.append((dist.recv(buf, group=g), buf))
            rec["g312-any"] = got
            buf = torch.zeros(3, dtype=F64)
            w = dist.irecv(buf, group=g, group_src=2, tag=5)  # tag 5: the any-source receives take tag 0 only
            rec["g312-irecv-group_src"] = (w.source_rank(), buf)
        else:
            dist.send(values(rank, (3,), salt=60), group=g, group_dst=0)
            if rank == 3:
                dist.isend(values(3, (3,), salt=61), dst=1, group=g, tag=5).wait()
    return rec


def _expected(rank: int, world: int) -> dict[str, Any]:
    prv = (rank - 1) % world
    want: dict[str, Any] = {}
    for k, (label, shape, dtype, _) in enumerate(RING_CASES):
        want[label] = (prv, values(prv, shape, dtype, salt=k))
    for peer in range(world):
        if peer != rank:
            want[f"all-pairs-from{peer}"] = (peer, values(peer, (3,), salt=20 + rank))
    if rank == 1:
        want["tag3"] = (0, values(0, (2,), salt=3))
        want["tag7"] = (0, values(0, (2,), salt=7))
    for label, dst in (("any-blocking", 0), ("any-irecv", world - 1)):
        if rank == dst:
            want[label] = {p: values(p, (2,), salt=40 + dst) for p in range(world) if p != dst}
    if world >= 3 and rank == 0:
        want["g20-group_src"] = (2, values(2, (3,), salt=50))
        want["g20-src"] = (2, values(2, (3,), salt=51))
        want["g20-any"] = (2, values(2, (3,), salt=52))
    if world == 4 and rank == 1:
        want["g312-any"] = {p: values(p, (3,), salt=60) for p in (2, 3)}
        want["g312-irecv-group_src"] = (3, values(3, (3,), salt=61))
    return want


@pytest.mark.parametrize("world_size", [gloo_param(w, id=f"W{w}") for w in (2, 3, 4)])
def test_point_to_point(rank_pool: Any, world_size: int) -> None:
    got = rank_pool(world_size).run(_exchanges)
    problems = []
    for r in range(world_size):
        want = _expected(r, world_size)
        if set(got[r]) != set(want):
            problems.append(f"rank {r}: recorded {sorted(got[r])}, expected {sorted(want)}")
            continue
        for label, w in want.items():
            g = got[r][label]
            if isinstance(w, dict):  # any-source: the set of senders, and each message from its sender
                senders = [s for s, _ in g]
                if sorted(senders) != sorted(w):
                    problems.append(f"rank {r} {label}: senders seen {senders}, expected each of {sorted(w)} once")
                    continue
                pairs = [(s, t, w[s]) for s, t in g]
            else:
                if g[0] != w[0]:
                    problems.append(f"rank {r} {label}: reported sender {g[0]}, expected global rank {w[0]}")
                pairs = [(w[0], g[1], w[1])]
            for s, t, expect in pairs:
                try:
                    torch.testing.assert_close(t, expect, rtol=0, atol=0)
                except AssertionError as e:
                    problems.append(f"rank {r} {label} (from {s}): {str(e)[:300]}")
    assert not problems, f"W={world_size}:\n" + "\n".join(problems)


def _self_send() -> list[str]:
    x = torch.zeros(1)
    out = []
    for fn in (dist.send, dist.isend):
        try:
            fn(x, dst=dist.get_rank())
        except dist.DistValueError as e:
            out.append(str(e))
    return out


@pytest.mark.parametrize("world_size", [gloo_param(1, id="W1")])
def test_send_to_self_is_refused(rank_pool: Any, world_size: int) -> None:
    """At world size 1 there is no peer: a send to oneself is an error, not a hang."""
    (messages,) = rank_pool(world_size).run(_self_send)
    assert len(messages) == 2, messages
    assert "tensorplay.distributed.send" in messages[0] and "dst=0" in messages[0]
    assert "tensorplay.distributed.isend" in messages[1]
