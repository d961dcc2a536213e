"""Unmodified torch.distributed code (DDP, FSDP2, DTensor, functional collectives) on simulated ranks.

These exercise simulator/torch_native.py, the one module that depends on
private torch hooks; they are the per-release check that the adapter still
works with the pinned torch.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as tdist

import simulator
from simulator import torch_native

W = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    return [(torch.randn(W * 2, 5, generator=g, dtype=torch.float64),
             torch.randn(W * 2, 3, generator=g, dtype=torch.float64)) for _ in range(steps)]


def _reference(steps: int) -> list[torch.Tensor]:
    """Single process, full batch: what data parallelism must reproduce."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_ddp_three_steps_match_single_process_full_batch() -> None:
    def body() -> list[torch.Tensor]:
        tdist.init_process_group("sim")
        r = tdist.get_rank()
        model = torch.nn.parallel.DistributedDataParallel(_model())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _batches(3):
            xs, ys = x[2 * r:2 * r + 2], y[2 * r:2 * r + 2]  # this rank's shard of the batch
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xs), ys).backward()
            opt.step()
        tdist.destroy_process_group()
        return [p.detach().clone() for p in model.parameters()]

    ref = _reference(3)
    for rank, params in enumerate(simulator.run(body, W)):
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12, msg=f"rank {rank}")


def test_fsdp2_fully_shard_matches_single_process() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def body() -> list[torch.Tensor]:
        tdist.init_process_group("sim")
        r = tdist.get_rank()
        mesh = init_device_mesh("cpu", (W,))
        model = _model()
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _batches(2):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[2 * r:2 * r + 2]), y[2 * r:2 * r + 2]).backward()
            opt.step()
        return [p.full_tensor().detach().clone() for p in model.parameters()]

    ref = _reference(2)
    for rank, params in enumerate(simulator.run(body, W)):
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-10, msg=f"rank {rank}")


def test_dtensor_and_functional_collectives() -> None:
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def body() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tdist.init_process_group("sim")
        r = tdist.get_rank()
        mesh = init_device_mesh("cpu", (W,))
        full = torch.arange(24.0).reshape(8, 3)
        dt = distribute_tensor(full, mesh, [Shard(0)])
        local = dt.to_local().clone()
        total = (dt * 2).sum().full_tensor()
        y = fc.wait_tensor(fc.all_reduce(torch.full((2,), float(r + 1)), "sum", mesh))
        return local, total, y

    full = torch.arange(24.0).reshape(8, 3)
    for r, (local, total, y) in enumerate(simulator.run(body, W)):
        torch.testing.assert_close(local, full[2 * r:2 * r + 2])
        torch.testing.assert_close(total, full.sum() * 2)
        torch.testing.assert_close(y, torch.full((2,), float(sum(range(1, W + 1)))))


def test_plain_collectives_subgroups_and_any_source_recv() -> None:
    def body() -> tuple:
        tdist.init_process_group("sim")
        r = tdist.get_rank()
        x = torch.tensor([float(r + 1)])
        tdist.all_reduce(x, op=tdist.ReduceOp.PRODUCT)
        g = tdist.new_group([3, 1])
        sub = None
        if r in (1, 3):
            sub = torch.tensor([float(r)])
            tdist.broadcast(sub, src=3, group=g)
        got = None
        if r == 0:
            t = torch.empty(1)
            got = sorted(tdist.recv(t) for _ in range(W - 1))
        else:
            tdist.send(torch.tensor([float(r)]), dst=0)
        return x, sub, got

    outs = simulator.run(body, W, seed=3)
    for r, (x, sub, got) in enumerate(outs):
        assert x.item() == 24.0
        assert sub is None if r not in (1, 3) else sub.item() == 3.0
    assert outs[0][2] == [1, 2, 3]


def test_mismatch_in_torch_native_code_is_caught_by_the_simulator() -> None:
    def body() -> None:
        tdist.init_process_group("sim")
        x = torch.ones(2)
        if tdist.get_rank() == 1:
            tdist.broadcast(x, src=0)
        else:
            tdist.all_reduce(x)

    with pytest.raises(BaseException) as info:
        simulator.run(body, 2)
    assert "CollectiveMismatchError" in repr(info.value) or isinstance(info.value, simulator.CollectiveMismatchError)


def test_unsupported_torch_version_is_refused_with_a_clear_message() -> None:
    with pytest.raises(RuntimeError, match="not supported.*supported="):
        torch_native.check_torch_version("2.99.0")
    torch_native.check_torch_version(torch.__version__)  # the installed one is supported


def test_torch_state_outside_the_simulated_world_is_untouched() -> None:
    before = copy.copy(torch.distributed.distributed_c10d._world)
    simulator.run(lambda: tdist.init_process_group("sim"), 2)
    assert type(torch.distributed.distributed_c10d._world) is type(before)
    assert not tdist.is_initialized()


def test_torchrun_style_script_with_torch_distributed_runs_under_python_m_simulator(tmp_path) -> None:
    import subprocess
    import sys

    script = tmp_path / "plain_torch.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')  # names a real backend; the simulator binds it to the simulated world\n"
        "x = torch.ones(1) * dist.get_rank()\n"
        "dist.all_reduce(x)\n"
        "print(f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: sum={x.item()}\")\n"
        "dist.destroy_process_group()\n"
    )
    out = subprocess.run([sys.executable, "-m", "simulator", "--nproc-per-node", "3", str(script)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank {r} of 3: sum=3.0" for r in range(3)]
