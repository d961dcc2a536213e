"""Point to point on every backend: send/recv, isend/irecv, tags, any-source receives, subgroups.

Every test runs on each backend of ``tests/_support/backends.py`` through the
``ranks`` fixture.  :func:`test_point_to_point` runs one batch of exchanges in
which each rank records ``label -> (sender the call reported, tensor
received)``; the test process rebuilds what every receiver must hold from
:func:`values` of the sender.  Senders are always reported as *global* ranks,
also inside subgroups and for any-source receives.  The smaller tests each
check one rule (rings under both simulator schedules, message order, tags,
any-source under several simulator seeds, subgroups, mismatches, what a
blocking send waits for).  The last section tests the simulator's own p2p
options (``simulator.run(p2p=...)``, ``python -m simulator --p2p``).
"""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import simulator
import tensorplay as tp
import tensorplay.distributed as dist

from _support.backends import Ranks, on_backends
from _support.worlds import group, group_specs, value

F64, I64, C128 = torch.float64, torch.int64, torch.complex128


def values(sender: int, shape: tuple[int, ...], dtype: torch.dtype = F64, salt: int = 0) -> torch.Tensor:
    """What ``sender`` sends under ``salt``: distinct per sender and message."""
    i = torch.arange(math.prod(shape), dtype=torch.float64)
    t = i * 0.5 + 100.0 * sender + 10.0 * salt + 1.0
    if dtype.is_complex:
        t = torch.complex(t, -t)
    return t.to(dtype).reshape(shape)


# -- the exchanges, run on every rank ------------------------------------------
def _subgroups(world: int) -> dict[tuple[int, ...], Any]:
    """The same subgroups as the collective tests (tests/_support/worlds.py), created once per world."""
    return {spec: group(spec) for spec in group_specs(world)[1:] if spec is not None}


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


@on_backends((2, 3, 4))
def test_point_to_point(ranks: Ranks) -> None:
    world_size = ranks.world_size
    got = ranks.run(_exchanges)
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
    assert not problems, f"{ranks.name} W={world_size}:\n" + "\n".join(problems)


def _self_send() -> list[str]:
    x = torch.zeros(1)
    out = []
    for fn in (dist.send, dist.isend):
        try:
            fn(x, dst=dist.get_rank())
        except dist.DistValueError as e:
            out.append(str(e))
    return out


@on_backends((1,))
def test_send_to_self_is_refused(ranks: Ranks) -> None:
    """At world size 1 there is no peer: a send to oneself is an error, not a hang."""
    (messages,) = ranks.run(_self_send)
    assert len(messages) == 2, messages
    assert "tensorplay.distributed.send" in messages[0] and "dst=0" in messages[0]
    assert "tensorplay.distributed.isend" in messages[1]


# -- one rule per test ---------------------------------------------------------------------
def _ring_isend_irecv() -> tuple[torch.Tensor, int]:
    r, w = dist.get_rank(), dist.get_world_size()
    out = tp.empty(5, dtype=torch.float64)
    s = dist.isend(value(r), dst=(r + 1) % w)
    q = dist.irecv(out, src=(r - 1) % w)
    s.wait()
    q.wait()
    return out, q.source_rank()


@on_backends((2, 3, 4, 8), modes=("coop", "threads"))
def test_ring_with_isend_irecv(ranks: Ranks) -> None:
    w = ranks.world_size
    for r, (out, src) in enumerate(ranks.run(_ring_isend_irecv)):
        assert torch.equal(out, value((r - 1) % w))
        assert src == (r - 1) % w


def _three_in_order() -> list[tuple[int, float]] | None:
    if dist.get_rank() == 0:
        for k in range(3):
            dist.send(tp.tensor([float(k)]), dst=1)
        return None
    got = []
    for _ in range(3):
        x = tp.empty(1)
        src = dist.recv(x, src=0)
        got.append((src, x.item()))
    return got


@on_backends((2,))
def test_blocking_send_recv_returns_sender_and_matches_in_order(ranks: Ranks) -> None:
    assert ranks.run(_three_in_order)[1] == [(0, 0.0), (0, 1.0), (0, 2.0)]


def _tags_select() -> tuple[float, float] | None:
    if dist.get_rank() == 0:
        a = dist.isend(tp.tensor([1.0]), dst=1, tag=1)
        b = dist.isend(tp.tensor([2.0]), dst=1, tag=2)
        a.wait()
        b.wait()
        return None
    x2, x1 = tp.empty(1), tp.empty(1)
    dist.recv(x2, src=0, tag=2)
    dist.recv(x1, src=0, tag=1)
    return x1.item(), x2.item()


@on_backends((2,))
def test_tags_select_the_message(ranks: Ranks) -> None:
    assert ranks.run(_tags_select)[1] == (1.0, 2.0)


def _any_source() -> list[int] | None:
    r = dist.get_rank()
    if r == 0:
        seen = []
        for _ in range(dist.get_world_size() - 1):
            x = tp.empty(1)
            src = dist.recv(x)  # any source
            assert x.item() == 10.0 * src
            seen.append(src)
        return seen
    dist.send(tp.tensor([10.0 * r]), dst=0)
    return None


@on_backends((4,))
def test_any_source_recv_gets_every_sender_once(ranks: Ranks) -> None:
    for seed in range(5):  # five simulator schedules; on a real backend, five runs of the OS's schedule
        assert sorted(ranks.run(_any_source, seed=seed)[0]) == [1, 2, 3]


def _subgroup_users_see_global_ranks() -> tuple[int, float] | None:
    g = dist.new_group([3, 1, 2])
    r = dist.get_rank()
    if r == 3:
        dist.send(tp.tensor([3.0]), dst=1, group=g)
    elif r == 1:
        x = tp.empty(1)
        src = dist.recv(x, src=3, group=g)
        dist.send(tp.tensor([1.0]), dst=2, group=g)
        return src, x.item()
    elif r == 2:
        x = tp.empty(1)
        w = dist.irecv(x, group=g)
        return w.source_rank(), x.item()  # source_rank() waits for the receive
    return None


@on_backends((4,))
def test_p2p_in_subgroup_uses_global_ranks_for_users(ranks: Ranks) -> None:
    res = ranks.run(_subgroup_users_see_global_ranks)
    assert res[1] == (3, 3.0)
    assert res[2] == (1, 1.0)


def _shape_mismatch() -> None:
    if dist.get_rank() == 0:
        dist.send(tp.ones(3), dst=1)
    else:
        dist.recv(tp.empty(4), src=0)


@on_backends((2,), skip={"gloo": "a receive of the wrong size fails inside gloo's transport on the receiving "
                                 "pair (or waits for the process-group timeout), which breaks the shared pool; "
                                 "the simulator's report of it is its own (CollectiveMismatchError)"})
def test_send_recv_shape_mismatch_is_reported_on_both_ranks(ranks: Ranks) -> None:
    with pytest.raises(simulator.CollectiveMismatchError) as ei:
        ranks.run(_shape_mismatch)
    msg = str(ei.value)
    assert "sends dtype=float32 shape=(3,)" in msg and "shape=(4,)" in msg
    assert "test_p2p.py" in msg  # the call site of the user's code
    assert "ranks [0, 1]" in "".join(ei.value.__notes__)


# -- what a blocking send waits for ------------------------------------------------------
def _both_send_first() -> torch.Tensor:
    r = dist.get_rank()
    x = tp.full((3,), float(r))
    y = tp.empty(3)
    dist.send(x, 1 - r)
    x.fill_(-1.0)  # the buffer is reusable once send returned: the peer must still get the value sent
    dist.recv(y, 1 - r)
    return y


@on_backends((2,), modes=("coop", "threads"),
             skip={"gloo": "gloo deadlocks here too (a send waits for the matching receive), but it ends only at "
                           "the process-group timeout and leaves the shared pool to restart: too slow for CI"})
def test_rendezvous_sends_deadlock_like_gloo_and_say_why(ranks: Ranks) -> None:
    with pytest.raises(simulator.DeadlockError) as ei:
        ranks.run(_both_send_first)
    text = str(ei.value)
    assert "ranks 0 and 1 wait in a blocking send" in text and "p2p='eager'" in text and "isend" in text


# -- the simulator's p2p options (simulator.run(p2p=...), python -m simulator --p2p) -----------
@pytest.mark.parametrize("mode", ["coop", "threads"])
def test_eager_sends_complete_before_the_recv_with_the_value_at_send_time(mode: str) -> None:
    out = simulator.run(_both_send_first, 2, mode=mode, p2p="eager")
    assert [t.tolist() for t in out] == [[1.0] * 3, [0.0] * 3]


def _send_nobody_receives() -> None:
    if dist.get_rank() == 0:
        dist.send(tp.ones(1), dst=1, tag=7)


def test_an_eager_send_nobody_receives_is_named_when_the_run_ends() -> None:
    """A buffered send completes at once: the run would end well, yet the message was never received (on gloo it
    stays pending); the run warns, naming the send, its peer, its tag and where it was posted."""
    with pytest.warns(RuntimeWarning, match=r"1 point-to-point operation\(s\) never met their peer before the run "
                                            r"ended: rank 0's send to rank 1 \(tag 7\) at test_p2p.py:\d+.*Fix: post "
                                            r"the matching recv"):
        assert simulator.run(_send_nobody_receives, 2, p2p="eager") == [None, None]


def test_unknown_p2p_model_is_refused() -> None:
    with pytest.raises(dist.DistValueError, match="p2p='buffered'.*Fix: pass p2p='rendezvous'"):
        simulator.run(_both_send_first, 2, p2p="buffered")


_SEND_FIRST_SCRIPT = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank(); x = torch.full((2,), float(r)); y = torch.empty(2)
dist.send(x, 1 - r); dist.recv(y, 1 - r)
print(f"rank {r} got {y.tolist()}")
"""


@pytest.mark.parametrize("p2p", ["rendezvous", "eager"])
def test_cli_p2p_option(tmp_path: Any, p2p: str) -> None:
    import subprocess
    import sys

    script = tmp_path / "send_first.py"
    script.write_text(_SEND_FIRST_SCRIPT)
    out = subprocess.run([sys.executable, "-m", "simulator", "--nproc-per-node", "2", "--p2p", p2p, str(script)],
                         capture_output=True, text=True, timeout=120)
    if p2p == "eager":
        assert out.returncode == 0, out.stderr
        assert "rank 0 got [1.0, 1.0]" in out.stdout and "rank 1 got [0.0, 0.0]" in out.stdout
    else:
        assert out.returncode == 1 and "DeadlockError" in out.stderr and "wait in a blocking send" in out.stderr


def _both_block_in_send() -> None:
    peer = 1 - dist.get_rank()
    dist.send(tp.ones(1), dst=peer)
    dist.recv(tp.zeros(1), src=peer)


def _send_to_a_rank_that_returns() -> None:
    if dist.get_rank() == 0:
        dist.isend(tp.ones(1), dst=1).wait()


def test_the_blocking_send_hint_is_given_where_the_receiver_is_itself_blocked() -> None:
    """Two ranks that both send first wait for each other's recv (gloo and NCCL hang there too): the report says
    so and how to reorder; a send to a rank that returned is the missing recv itself, with no such advice."""
    with pytest.raises(simulator.DeadlockError, match=r"(?s)Hint: ranks 0 and 1 wait in a blocking send.*post sends "
                                                      r"with isend"):
        simulator.run(_both_block_in_send, 2, timeout=60)
    with pytest.raises(simulator.DeadlockError) as e:
        simulator.run(_send_to_a_rank_that_returns, 2, timeout=60)
    assert "rank 1 has returned" in str(e.value) and "blocking send" not in str(e.value)
