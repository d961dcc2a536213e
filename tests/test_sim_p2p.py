"""send/recv/isend/irecv on the simulator: rings, tags, any-source, subgroups, async works."""
from __future__ import annotations

import pytest
import torch

import simulator
import tensorplay as tp
import tensorplay.distributed as dist

from _sim_helpers import value


@pytest.mark.parametrize("w", [2, 3, 4, 8])
@pytest.mark.parametrize("mode", ["coop", "threads"])
def test_ring_with_isend_irecv(w, mode):
    def fn():
        r = dist.get_rank()
        out = tp.empty(5, dtype=torch.float64)
        s = dist.isend(value(r), dst=(r + 1) % w)
        q = dist.irecv(out, src=(r - 1) % w)
        s.wait()
        q.wait()
        return out, q.source_rank()

    res = simulator.run(fn, w, mode=mode, timeout=20)
    for r, (out, src) in enumerate(res):
        assert torch.equal(out, value((r - 1) % w))
        assert src == (r - 1) % w


def test_blocking_send_recv_returns_sender_and_matches_in_order():
    def fn():
        r = dist.get_rank()
        if r == 0:
            for k in range(3):
                dist.send(tp.tensor([float(k)]), dst=1)
            return None
        got = []
        for _ in range(3):
            x = tp.empty(1)
            src = dist.recv(x, src=0)
            got.append((src, x.item()))
        return got

    assert simulator.run(fn, 2)[1] == [(0, 0.0), (0, 1.0), (0, 2.0)]


def test_tags_select_the_message():
    def fn():
        r = dist.get_rank()
        if r == 0:
            a = dist.isend(tp.tensor([1.0]), dst=1, tag=1)
            b = dist.isend(tp.tensor([2.0]), dst=1, tag=2)
            a.wait()
            b.wait()
            return None
        x2, x1 = tp.empty(1), tp.empty(1)
        dist.recv(x2, src=0, tag=2)
        dist.recv(x1, src=0, tag=1)
        return x1.item(), x2.item()

    assert simulator.run(fn, 2)[1] == (1.0, 2.0)


def test_any_source_recv_gets_every_sender_once():
    def fn():
        r = dist.get_rank()
        if r == 0:
            seen = []
            for _ in range(3):
                x = tp.empty(1)
                src = dist.recv(x)  # any source
                assert x.item() == 10.0 * src
                seen.append(src)
            return seen
        dist.send(tp.tensor([10.0 * r]), dst=0)
        return None

    for seed in range(5):
        assert sorted(simulator.run(fn, 4, seed=seed)[0]) == [1, 2, 3]


def test_p2p_in_subgroup_uses_global_ranks_for_users():
    def full():
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
            return w.source_rank(), x.item()
        return None

    res = simulator.run(full, 4)
    assert res[1] == (3, 3.0)
    assert res[2] == (1, 1.0)


def test_send_recv_shape_mismatch_is_reported_on_both_ranks():
    def fn():
        if dist.get_rank() == 0:
            dist.send(tp.ones(3), dst=1)
        else:
            dist.recv(tp.empty(4), src=0)

    with pytest.raises(simulator.CollectiveMismatchError) as ei:
        simulator.run(fn, 2)
    msg = str(ei.value)
    assert "sends dtype=float32 shape=(3,)" in msg and "shape=(4,)" in msg
    assert "test_sim_p2p.py" in msg
    assert "ranks [0, 1]" in "".join(ei.value.__notes__)


# -- what a blocking send waits for (World(p2p=...)) -----------------------------
def _both_send_first():
    r = dist.get_rank()
    x = tp.full((3,), float(r))
    y = tp.empty(3)
    dist.send(x, 1 - r)
    x.fill_(-1.0)  # the buffer is reusable once send returned: the peer must still get the value sent
    dist.recv(y, 1 - r)
    return y


@pytest.mark.parametrize("mode", ["coop", "threads"])
def test_rendezvous_sends_deadlock_like_gloo_and_say_why(mode):
    with pytest.raises(simulator.DeadlockError) as ei:
        simulator.run(_both_send_first, 2, mode=mode, timeout=20)
    text = str(ei.value)
    assert "ranks 0 and 1 wait in a blocking send" in text and "p2p='eager'" in text and "isend" in text


@pytest.mark.parametrize("mode", ["coop", "threads"])
def test_eager_sends_complete_before_the_recv_with_the_value_at_send_time(mode):
    out = simulator.run(_both_send_first, 2, mode=mode, p2p="eager")
    assert [t.tolist() for t in out] == [[1.0] * 3, [0.0] * 3]


def test_unknown_p2p_model_is_refused():
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
def test_cli_p2p_option(tmp_path, p2p):
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
