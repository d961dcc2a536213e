"""`python -m simulator script.py`: scripts that start their own ranks (mp.spawn, multiprocessing.Process).

Each script is written as a PyTorch tutorial writes it and run unmodified, by
the CLI in a subprocess; two of them also run for real (gloo on 127.0.0.1) and
their output is compared with the simulated run's.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from simulator.launch import LaunchStyleError, launch
from tensorplay.testing import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the mp.spawn tutorial shape: MASTER_ADDR/PORT set in the rank, env:// rendezvous, fn(rank, *args)
SPAWN = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def setup(rank, world_size):
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = "{port}"
        dist.init_process_group("gloo", rank=rank, world_size=world_size)

    def demo(rank, world_size, mode):
        setup(rank, world_size)
        x = torch.arange(3, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(x)
        gathered = [torch.zeros(1) for _ in range(world_size)]
        dist.all_gather(gathered, torch.tensor([float(rank * rank)]))
        print(f"rank {{rank}}/{{dist.get_world_size()}} sum={{x.tolist()}} squares={{[g.item() for g in gathered]}}",
              flush=True)
        if mode == "fail" and rank == 1:
            raise ValueError("rank one fails on purpose")
        if mode == "exit" and rank == 2:
            sys.exit(3)
        dist.barrier()
        dist.destroy_process_group()
        if mode == "exit0":
            sys.exit(0)  # a normal end, as for a process

    if __name__ == "__main__":
        mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
        try:
            mp.spawn(demo, args=(3, mode), nprocs=3, join=True)
        except mp.ProcessRaisedException as e:
            print(f"launcher: ProcessRaisedException index={{e.error_index}}", flush=True)
            raise
        except mp.ProcessExitedException as e:
            print(f"launcher: ProcessExitedException index={{e.error_index}} code={{e.exit_code}}", flush=True)
            raise
        print("launcher: done", flush=True)
""")

# the "Writing distributed applications" tutorial shape: Process + tcp:// init, start all, then join all;
# also what each rank gets of the launcher's objects (a shared-memory tensor is shared, a dict is a copy)
PROCESS = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    from multiprocessing import Process

    def run(rank, size, shared, plain):
        tensor = torch.zeros(1)
        if rank == 0:
            tensor += 1
            dist.send(tensor=tensor, dst=1)
        elif rank == 1:
            dist.recv(tensor=tensor, src=0)
        print(f"Rank {{rank}} has data {{tensor[0].item()}}", flush=True)
        shared += rank + 1
        plain[rank] = "seen"
        if "--exit" in sys.argv and rank == 1:
            sys.exit(3)
        dist.barrier()

    def init_process(rank, size, fn, shared, plain, backend="gloo"):
        dist.init_process_group(backend, rank=rank, world_size=size, init_method="tcp://127.0.0.1:{port}")
        fn(rank, size, shared, plain)
        dist.destroy_process_group()

    if __name__ == "__main__":
        size = 3
        shared = torch.zeros(1).share_memory_()
        plain = {{}}
        processes = []
        for rank in range(size):
            p = Process(target=init_process, args=(rank, size, run, shared, plain))
            p.start()
            processes.append(p)
        for p in processes:
            p.join()
        print(f"exitcodes={{[p.exitcode for p in processes]}} alive={{[p.is_alive() for p in processes]}}",
              flush=True)
        print(f"shared={{shared.item()}} plain={{plain}}", flush=True)
""")

TORCHRUN = textwrap.dedent("""
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    x = torch.ones(1)
    dist.all_reduce(x)
    print("rank", dist.get_rank(), x.item(), flush=True)
""")


def _write(tmp_path, name, text, port=None):
    path = tmp_path / name
    path.write_text(text.format(port=port if port is not None else free_port()))
    return path


# the shape of pytorch/examples' ddp_rpc: every process joins RPC (world of 4), two of them also make a default
# process group of their own (world_size=2, its own address) and train with DDP over it; the other two make a
# second 2-rank group at another address, so the two rendezvous must not meet
SUBSET = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    import torch.distributed.rpc as rpc
    import torch.multiprocessing as mp

    def ping(x):
        return x + 1

    def worker(rank, n, rpc_port, pg_port, other_port):
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{{rpc_port}}")
        if rank < 2:
            dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{{pg_port}}")
            torch.manual_seed(0)
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(2):
                opt.zero_grad()
                model(torch.full((4, 3), float(rank + step + 1))).sum().backward()
                opt.step()
            w = [round(v, 5) for v in model.module.weight.flatten().tolist()]
            print(f"rank {{rank}} group {{dist.get_rank()}}/{{dist.get_world_size()}} weight={{w}}", flush=True)
        else:
            # claimed ranks in reverse: launched rank 3 is rank 0 of this group
            dist.init_process_group("gloo", rank=3 - rank, world_size=2,
                                    init_method=f"tcp://127.0.0.1:{{other_port}}")
            x = torch.tensor([10.0 * (dist.get_rank() + 1)])
            dist.all_reduce(x)
            print(f"rank {{rank}} group {{dist.get_rank()}}/{{dist.get_world_size()}} sum={{x.item()}}", flush=True)
        rpc.init_rpc(f"w{{rank}}", rank=rank, world_size=n, rpc_backend_options=opts)
        if rank == 2:
            print(f"rank 2 rpc={{[rpc.rpc_sync(f'w{{r}}', ping, args=(r,)) for r in range(n)]}}", flush=True)
        rpc.shutdown()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(4, {rpc_port}, {pg_port}, {other_port}), nprocs=4, join=True)
""")


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _sim(tmp_path, *args, timeout=240):
    return subprocess.run([sys.executable, "-m", "simulator", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=str(tmp_path))


def _real(tmp_path, script, *args, timeout=240):
    return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=str(tmp_path))


def _real_run(tmp_path, name, text, ok):
    """Run ``text`` for real on a fresh port; retry once on another port when a rank lost a port race."""
    for attempt in range(2):
        script = _write(tmp_path, name, text)
        p = _real(tmp_path, script)
        if ok(p) or attempt == 1 or "ddress already in use" not in p.stderr + p.stdout:
            return script, p
    raise AssertionError("unreachable")  # pragma: no cover


def _lines(out):
    # real processes share the pipe and print() writes the text and the newline separately, so two ranks'
    # lines can interleave as "Rank 1 ...Rank 0 ...\n\n": split before every rank's line
    out = re.sub(r"(?<=[^\n])(?=[Rr]ank \d)", "\n", out)
    return sorted(line for line in out.splitlines() if line.strip())


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_spawn_script_runs_unmodified_with_the_expected_values(tmp_path, isolation):
    script = _write(tmp_path, "spawn_demo.py", SPAWN)
    p = _sim(tmp_path, "--seed", "2", "--isolation", isolation, script)
    assert p.returncode == 0, p.stderr
    # all_reduce of arange(3) * (r + 1) over 3 ranks: arange(3) * 6; all_gather of r^2
    expect = [f"rank {r}/3 sum=[0.0, 6.0, 12.0] squares=[0.0, 1.0, 4.0]" for r in range(3)]
    assert _lines(p.stdout) == sorted(expect + ["launcher: done"])


@pytest.mark.gloo
@pytest.mark.xdist_group("gloo-W3")
def test_spawn_script_output_matches_a_real_gloo_run(tmp_path):
    script, real = _real_run(tmp_path, "spawn_demo.py", SPAWN, lambda p: p.returncode == 0)
    assert real.returncode == 0, real.stderr
    sim = _sim(tmp_path, script)
    assert sim.returncode == 0, sim.stderr
    assert _lines(sim.stdout) == _lines(real.stdout), real.stderr


@pytest.mark.gloo
@pytest.mark.xdist_group("gloo-W3")
def test_process_script_output_matches_a_real_gloo_run(tmp_path):
    # the launcher exits 0 whatever its children did: a lost port race shows in the exit codes it prints
    script, real = _real_run(tmp_path, "process_demo.py", PROCESS, lambda p: "exitcodes=[0, 0, 0]" in p.stdout)
    assert real.returncode == 0 and "exitcodes=[0, 0, 0]" in real.stdout, real.stderr
    for isolation in ("thread", "process"):  # rank processes get the shared tensor as a spawned child does
        sim = _sim(tmp_path, "--mode", "threads", "--isolation", isolation, script)
        assert sim.returncode == 0, sim.stderr
        assert _lines(sim.stdout) == _lines(real.stdout), real.stderr
        # what both runs agree on, spelled out: ranks 0/1 exchanged, every rank added to the shared tensor,
        # the launcher's dict was copied into each rank
        assert "Rank 1 has data 1.0" in sim.stdout and "Rank 2 has data 0.0" in sim.stdout
        assert "exitcodes=[0, 0, 0] alive=[False, False, False]" in sim.stdout
        assert "shared=6.0 plain={}" in sim.stdout


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_failing_spawned_rank_reaches_the_launcher_as_torchs_exception(tmp_path, isolation):
    script = _write(tmp_path, "spawn_demo.py", SPAWN)
    p = _sim(tmp_path, "--seed", "5", "--isolation", isolation, script, "fail")
    assert p.returncode == 1
    assert "launcher: ProcessRaisedException index=1" in p.stdout
    assert "rank 1 (process 1 of torch.multiprocessing.spawn) failed (ValueError)" in p.stderr
    assert "-- Process 1 terminated with the following error:" in p.stderr
    assert p.stderr.count("ValueError: rank one fails on purpose") == 1  # the rank's traceback, once
    iso = "" if isolation == "thread" else " --isolation process"
    assert f"replay with python -m simulator --seed 5 --mode coop{iso} {script} fail" in p.stderr
    assert "[rank" not in p.stderr  # no excepthook prefixes


def test_sys_exit_in_a_spawned_rank_is_a_failure_with_its_code(tmp_path):
    script = _write(tmp_path, "spawn_demo.py", SPAWN)
    p = _sim(tmp_path, script, "exit")
    assert p.returncode == 1
    assert "launcher: ProcessExitedException index=2 code=3" in p.stdout
    assert "rank 2 (process 2 of torch.multiprocessing.spawn) exited with code 3" in p.stderr
    ok = _sim(tmp_path, script, "exit0")
    assert ok.returncode == 0, ok.stderr
    assert "launcher: done" in ok.stdout


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_sys_exit_in_a_process_rank_sets_its_exitcode_and_fails_the_cli(tmp_path, isolation):
    script = _write(tmp_path, "process_demo.py", PROCESS)
    p = _sim(tmp_path, "--isolation", isolation, script, "--exit")
    assert p.returncode == 1
    # the launcher itself carries on, as on a real run, and sees rank 1's status; the others were released
    assert "exitcodes=[1, 3, 1]" in p.stdout
    assert "rank 1 exited with code 3" in p.stderr and "sys.exit(3)" in p.stderr


def test_wrong_script_style_is_a_usage_error_not_a_hang(tmp_path):
    spawn = _write(tmp_path, "spawn_demo.py", SPAWN)
    p = _sim(tmp_path, "--nproc-per-node", "3", spawn)
    assert p.returncode == 2
    assert "torch.multiprocessing.spawn was called on a simulated thread rank" in p.stderr
    assert "a helper of the rank (a producer, a server), run with --isolation process" in p.stderr
    assert f"without --nproc-per-node: python -m simulator --seed 0 --mode coop {spawn}" in p.stderr
    assert p.stderr.count("Fix:") == 1  # every rank raised it; said once

    torchrun = _write(tmp_path, "torchrun_demo.py", TORCHRUN)
    p = _sim(tmp_path, torchrun)
    assert p.returncode == 2
    assert "init_process_group was called by the launcher" in p.stderr
    assert f"python -m simulator --nproc-per-node N --seed 0 --mode coop {torchrun}" in p.stderr
    ok = _sim(tmp_path, "--nproc-per-node", "2", torchrun)
    assert ok.returncode == 0, ok.stderr
    assert _lines(ok.stdout) == ["rank 0 2.0", "rank 1 2.0"]


# ---- the Python API, in this process ------------------------------------------
def _ring(rank, size, out):
    import torch.distributed as tdist

    tdist.init_process_group("gloo", rank=rank, world_size=size, init_method="tcp://127.0.0.1:1")
    x = torch.tensor([float(rank + 1)])
    tdist.all_reduce(x)
    out[rank] = x.item()  # a copy of `out` per rank: the launcher does not see it
    if rank == 1 and size == 3:
        raise KeyError("three is a crowd")


def _launcher(size, seen):
    import torch.multiprocessing as mp

    out: dict = {}
    mp.spawn(_ring, args=(size, out), nprocs=size)
    seen.append(out)


def test_launch_api_runs_a_launcher_function_and_restores_the_patches():
    import multiprocessing.process as mp_process

    import torch.multiprocessing as mp

    start, spawn = mp_process.BaseProcess.start, mp.spawn
    seen: list = []
    worlds = launch(_launcher, args=(2, seen), seed=1)
    assert [w.world_size for w in worlds] == [2] and seen == [{}]
    assert "all_reduce" in [e.op for e in worlds[0].trace.by_rank(0)]
    with pytest.raises(mp.ProcessRaisedException) as ei:
        launch(_launcher, args=(3, seen))
    assert ei.value.error_index == 1 and ei.value.rank == 1 and "KeyError: 'three is a crowd'" in str(ei.value)
    assert mp_process.BaseProcess.start is start and mp.spawn is spawn


def test_launch_api_refuses_a_launcher_that_joins_a_group_itself():
    import torch.distributed as tdist

    def launcher():
        tdist.init_process_group("gloo", rank=0, world_size=2, init_method="tcp://127.0.0.1:1")

    with pytest.raises(LaunchStyleError, match="init_process_group was called by the launcher"):
        launch(launcher)


def _fake_group_then_spawn(seen):
    import torch.distributed as tdist
    import torch.multiprocessing as mp
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # a group that lives in this one process (torch's test harness: LocalTensor, FakeStore tests) meets no peer, so
    # the launcher may make one, as `python script.py` does; a world of one likewise
    tdist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    seen.append(tdist.get_world_size())
    tdist.destroy_process_group()
    tdist.init_process_group(backend="gloo", store=tdist.HashStore(), rank=0, world_size=1)
    seen.append(tdist.get_world_size())
    tdist.destroy_process_group()
    mp.spawn(_ring, args=(2, seen), nprocs=2)


def test_launch_api_lets_the_launcher_make_a_group_of_its_own_process():
    seen: list = []
    worlds = launch(_fake_group_then_spawn, args=(seen,))
    assert seen[:2] == [4, 1] and [w.world_size for w in worlds] == [2]


# ---- the bounds of a launched world -------------------------------------------------------------------------
STUCK_SPAWN = textwrap.dedent("""
    import os, time
    import torch, torch.distributed as dist, torch.multiprocessing as mp

    def run(rank, size):
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = "29512"
        dist.init_process_group("gloo", rank=rank, world_size=size)
        if rank == 1:
            time.sleep(4.0)  # longer than the stall bound the test passes
        dist.all_reduce(torch.ones(1))

    if __name__ == "__main__":
        mp.spawn(run, args=(2,), nprocs=2)
""")


def test_launched_worlds_get_the_command_lines_bounds(tmp_path):
    """--stall-timeout / --timeout reach the worlds a launcher starts, and their reports name the flags."""
    script = _write(tmp_path, "stuck_spawn.py", STUCK_SPAWN)
    p = _sim(tmp_path, "--stall-timeout", "1.5", script)
    assert p.returncode == 1, p.stderr
    assert "stall: no operation completed for 1.5 s (--stall-timeout 1.5" in p.stderr, p.stderr
    assert "rank 1 has been computing since" in p.stderr and "stuck_spawn.py:10 in run (" in p.stderr
    assert "raise --stall-timeout if it is just slow" in p.stderr
    p = _sim(tmp_path, "--timeout", "0.5", script)
    assert p.returncode == 1, p.stderr
    assert "timeout: the run did not finish within 0.5 s (--timeout 0.5)" in p.stderr, p.stderr


def _stuck_rank(rank, size):
    import time

    import torch.distributed as tdist

    tdist.init_process_group("gloo", rank=rank, world_size=size, init_method="tcp://127.0.0.1:1")
    if rank == 1:
        time.sleep(3.0)  # longer than the stall bound the test passes
    tdist.all_reduce(torch.ones(1))


def _stuck_launcher():
    import torch.multiprocessing as mp

    mp.spawn(_stuck_rank, args=(2,), nprocs=2)


@pytest.mark.filterwarnings("ignore:.*still running after the run timed out:RuntimeWarning")  # (rank 1 sleeps on)
def test_launch_api_passes_both_bounds():
    import torch.multiprocessing as mp

    with pytest.raises(mp.ProcessRaisedException) as ei:
        launch(_stuck_launcher, stall_timeout=1.5)
    assert "stall: no operation completed for 1.5 s (stall_timeout=1.5" in str(ei.value)
    with pytest.raises(mp.ProcessRaisedException) as ei:
        launch(_stuck_launcher, timeout=0.5)
    assert "the run did not finish within 0.5 s (timeout=0.5)" in str(ei.value)
    time.sleep(3.0)  # let the sleeping rank thread end before the next test


def _subset_text():
    text = SUBSET.format(rpc_port=free_port(), pg_port=free_port(), other_port=free_port())
    return text.replace("{", "{{").replace("}", "}}")  # (_write formats it once more)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_default_groups_over_part_of_the_spawned_ranks_run_ddp_beside_rpc(tmp_path, isolation):
    script = _write(tmp_path, "subset_demo.py", _subset_text())
    p = _sim(tmp_path, "--isolation", isolation, script)
    assert p.returncode == 0, p.stderr
    lines = _lines(p.stdout)
    assert "rank 2 rpc=[1, 2, 3, 4]" in lines, p.stdout
    assert "rank 2 group 1/2 sum=30.0" in lines and "rank 3 group 0/2 sum=30.0" in lines, p.stdout
    trained = [line for line in lines if "weight=" in line]
    assert [t.split(" weight=")[0] for t in trained] == ["rank 0 group 0/2", "rank 1 group 1/2"], p.stdout
    assert trained[0].split("weight=")[1] == trained[1].split("weight=")[1], p.stdout  # DDP kept them equal


@pytest.mark.gloo
@pytest.mark.xdist_group("gloo-W4")
def test_default_groups_over_part_of_the_spawned_ranks_match_a_real_gloo_run(tmp_path):
    script, real = _real_run(tmp_path, "subset_demo.py", _subset_text(), lambda p: p.returncode == 0)
    assert real.returncode == 0, real.stderr
    sim = _sim(tmp_path, script)
    assert sim.returncode == 0, sim.stderr
    assert _lines(sim.stdout) == _lines(real.stdout), real.stderr


# pytorch/examples' ddp_rpc as it is written: the master (rank 2) and the parameter server (rank 3) make no process
# group; the trainers (0, 1) make a 2-rank one and then join RPC (whose agent builds its own gloo group over all 4);
# the master runs the training loop *in an RPC handler* on each trainer, where DDP takes the trainer's default
# group. Written for GPUs: with "cuda", both trainers put their model on cuda:<master's rank> (cuda:2), as the
# example does. Each trainer looks up rows of its own, so the parameter server's updates commute and a real run
# is deterministic.
DDP_RPC = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc
    import torch.multiprocessing as mp
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer
    from torch.distributed.rpc import RRef
    from torch.nn.parallel import DistributedDataParallel as DDP

    CUDA = sys.argv[1:] == ["cuda"]

    def on(t, device):
        return t.cuda(device) if CUDA else t

    class Hybrid(torch.nn.Module):
        def __init__(self, emb, device):
            super().__init__()
            self.emb = emb
            torch.manual_seed(0)
            self.fc = DDP(on(torch.nn.Linear(4, 3), device), device_ids=[device] if CUDA else None)
            self.device = device

        def forward(self, indices, offsets):
            return self.fc(on(self.emb.forward(indices, offsets), self.device))

    def train(emb, device):
        rank = dist.get_rank()
        model = Hybrid(emb, device)
        params = model.emb.remote_parameters() + [RRef(p) for p in model.fc.parameters()]
        opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.1)
        g = torch.Generator().manual_seed(rank)
        for step in range(3):
            indices = torch.randint(0, 5, (6,), generator=g) + 5 * rank
            target = on(torch.randint(0, 3, (3,), generator=g), device)
            with dist_autograd.context() as cid:
                loss = torch.nn.functional.cross_entropy(model(indices, torch.tensor([0, 2, 4])), target)
                dist_autograd.backward(cid, [loss])
                opt.step(cid)
        w = [round(v, 5) for v in model.fc.module.weight.flatten().tolist()]
        return f"trainer {{rank}}/{{dist.get_world_size()}} loss={{loss.item():.5f}} weight={{w}}"

    def worker(rank, n, rpc_port, pg_port):
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{{rpc_port}}")
        if rank == 2:
            rpc.init_rpc("master", rank=rank, world_size=n, rpc_backend_options=opts)
            emb = RemoteModule("ps", torch.nn.EmbeddingBag, args=(10, 4), kwargs={{"mode": "sum"}})
            futs = [rpc.rpc_async(f"trainer{{t}}", train, args=(emb, rank)) for t in (0, 1)]
            for f in futs:
                print(f.wait(), flush=True)
        elif rank <= 1:
            dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{{pg_port}}")
            rpc.init_rpc(f"trainer{{rank}}", rank=rank, world_size=n, rpc_backend_options=opts)
        else:
            torch.manual_seed(1)  # the table is made here
            rpc.init_rpc("ps", rank=rank, world_size=n, rpc_backend_options=opts)
        rpc.shutdown()

    if __name__ == "__main__":
        mp.spawn(worker, args=(4, {rpc_port}, {pg_port}), nprocs=4, join=True)
""")


def _ddp_rpc_text():
    text = DDP_RPC.format(rpc_port=free_port(), pg_port=free_port())
    return text.replace("{", "{{").replace("}", "}}")


def _trainers(out):
    lines = [line for line in _lines(out) if line.startswith("trainer ")]
    assert [line.split(" loss=")[0] for line in lines] == ["trainer 0/2", "trainer 1/2"], out
    assert lines[0].split("weight=")[1] == lines[1].split("weight=")[1], out  # DDP kept the replicas equal
    return lines


@pytest.mark.parametrize("isolation,devices", [("thread", "cpu"), ("process", "cuda")])
def test_ddp_rpc_as_written_trains_inside_rpc_handlers(tmp_path, isolation, devices):
    # an RPC handler of a trainer runs in the trainer: its default group is the trainer's (thread ranks used to
    # find none); a trainer inside a 2-rank group still joins the 4-rank group of torch's RPC agent (process
    # ranks used to wait for it in a rendezvous); with --devices cuda the 2 stand-in GPUs grow to one per rank
    script = _write(tmp_path, "ddp_rpc.py", _ddp_rpc_text())
    p = _sim(tmp_path, "--isolation", isolation, "--devices", devices, script, *(["cuda"] if devices == "cuda" else []))
    assert p.returncode == 0, p.stderr
    _trainers(p.stdout)
    if devices == "cuda":
        assert "the program started 4 processes, so its ranks see 4 stand-in GPUs each" in p.stderr


@pytest.mark.gloo
@pytest.mark.xdist_group("gloo-W4")
def test_ddp_rpc_as_written_matches_a_real_gloo_run(tmp_path):
    script, real = _real_run(tmp_path, "ddp_rpc.py", _ddp_rpc_text(), lambda p: p.returncode == 0)
    assert real.returncode == 0, real.stderr
    expect = _trainers(real.stdout)
    for args in ((script,), ("--devices", "cuda", "--isolation", "thread", script, "cuda")):
        sim = _sim(tmp_path, *args)
        assert sim.returncode == 0, sim.stderr
        assert _trainers(sim.stdout) == expect, (args, real.stderr)


# where spawned children's torch RNGs start: a spawned child imports the script (its top level runs) but not its
# main block; two spawns are two sets of fresh processes
SPAWN_SEEDS = textwrap.dedent("""
    import sys
    import torch
    import torch.multiprocessing as mp

    if sys.argv[1:] == ["top"]:
        torch.manual_seed(7)

    def child(rank):
        print(f"child {{rank}} seed={{torch.initial_seed()}} draw={{torch.rand(1).item():.6f}}", flush=True)

    if __name__ == "__main__":
        if sys.argv[1:] == ["main"]:
            torch.manual_seed(7)
        torch.rand(3)  # (the launcher's own draws reach no child)
        mp.spawn(child, nprocs=2)
        mp.spawn(child, nprocs=2)
""")


@pytest.mark.parametrize("where,isolation", [("main", "thread"), ("top", "process")])
def test_spawned_children_start_from_what_a_fresh_interpreter_importing_the_script_has(tmp_path, where, isolation):
    script = _write(tmp_path, "spawn_seeds.py", SPAWN_SEEDS)
    p = _sim(tmp_path, "--isolation", isolation, script, where)
    assert p.returncode == 0, p.stderr
    # matched, not split into lines: under PYTHONUNBUFFERED a print is two writes, and two processes' prints can
    # interleave between them (real processes' too)
    lines = re.findall(r"child \d+ seed=(\d+) draw=(\d+\.\d{6})", p.stdout)
    assert len(lines) == 4, p.stdout
    seeds = [int(seed) for seed, _ in lines]
    if where == "main":  # seeded in the main block: each child of each spawn has a seed of its own
        assert len(set(seeds)) == 4 and 7 not in seeds, lines
    else:  # seeded at the top: every child starts there, not where the launcher's draws left it
        draw = f"{torch.rand(1, generator=torch.Generator().manual_seed(7)).item():.6f}"
        assert seeds == [7] * 4 and all(d == draw for _, d in lines), lines


# env:// in a process the program started: it has what it inherited and what it sets, nothing a launcher adds
ENV_RENDEZVOUS = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def rank_fn(rank, size, given):
        for name in given.split(","):
            if name:
                os.environ[name] = {{"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
                                     "MASTER_PORT": "{port}"}}[name]
        try:
            dist.init_process_group("gloo")
        except ValueError as e:
            print(f"rank {{rank}}: ValueError: {{e}}", flush=True)
            return
        x = torch.tensor([rank + 1.0])
        dist.all_reduce(x)
        print(f"rank {{rank}}: sum={{x.item()}}", flush=True)
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(rank_fn, args=(2, sys.argv[1] if len(sys.argv) > 1 else ""), nprocs=2)
""")
ENV_CASES = {"": "RANK", "RANK": "WORLD_SIZE", "RANK,WORLD_SIZE": "MASTER_ADDR",
             "RANK,WORLD_SIZE,MASTER_ADDR": "MASTER_PORT"}


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_env_rendezvous_of_a_spawned_rank_needs_what_a_spawned_process_needs(tmp_path, isolation):
    # torch's env:// reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; a spawned child that set none of them
    # fails with torch's own error, naming the first one missing (simulator.run and torchrun-style runs set them)
    script = _write(tmp_path, "env_demo.py", ENV_RENDEZVOUS)
    # (rank processes: the first and last case; each run starts its own rank interpreters, seconds each)
    cases = ENV_CASES if isolation == "thread" else dict(list(ENV_CASES.items())[::3])
    for given, missing in cases.items():
        p = _sim(tmp_path, "--isolation", isolation, script, given)
        assert p.returncode == 0, p.stderr
        want = [f"rank {r}: ValueError: Error initializing torch.distributed using env:// rendezvous: environment "
                f"variable {missing} expected, but not set" for r in range(2)]
        assert _lines(p.stdout) == want, (given, p.stdout, p.stderr[-3000:])
    p = _sim(tmp_path, "--isolation", isolation, script, "RANK,WORLD_SIZE,MASTER_ADDR,MASTER_PORT")
    assert p.returncode == 0, p.stderr
    assert _lines(p.stdout) == ["rank 0: sum=3.0", "rank 1: sum=3.0"], p.stdout


@pytest.mark.gloo
def test_env_rendezvous_of_a_spawned_rank_fails_on_gloo_as_simulated(tmp_path):
    script = _write(tmp_path, "env_demo.py", ENV_RENDEZVOUS)
    for given in ("", "RANK,WORLD_SIZE"):  # (fails before any connection: quick on real processes)
        real, sim = _real(tmp_path, script, given), _sim(tmp_path, script, given)
        assert real.returncode == sim.returncode == 0, (real.stderr[-3000:], sim.stderr[-3000:])
        assert _lines(sim.stdout) == _lines(real.stdout) and "ValueError" in real.stdout, (real.stdout, sim.stdout)


_SET_ORDER = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
params = {"weight": torch.ones(3), "bias": torch.ones(1), "scale": torch.ones(2), "emb": torch.ones(5)}
for name in set(params):  # a set of strings: its order is the interpreter's hash order
    dist.all_reduce(params[name])
if dist.get_rank() == 0:
    print("order", list(set(params)))
"""


def test_the_cli_string_hash_order_follows_the_seed(tmp_path):
    """Thread ranks share one interpreter: `python -m simulator` starts it with PYTHONHASHSEED from --seed (rank 0's
    value, as rank processes get theirs), so a program that iterates a set of strings repeats itself per seed.
    (On rank processes, whose hash seeds differ per rank, this program is a collective mismatch, as on gloo.)"""
    script = tmp_path / "set_order.py"
    script.write_text(_SET_ORDER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}

    def order(seed: int, **extra: str) -> str:
        out = subprocess.run([sys.executable, "-m", "simulator", "--nproc-per-node", "2", "--seed", str(seed),
                              str(script)], capture_output=True, text=True, timeout=300, env={**env, **extra})
        assert out.returncode == 0, out.stderr[-3000:]
        return next(line for line in out.stdout.splitlines() if line.startswith("order"))

    orders = {seed: order(seed) for seed in range(4)}
    assert len(set(orders.values())) > 1  # the seed moves it (4 seeds: all alike would be a 1 in 10^4 chance)
    assert order(0) == orders[0] and order(3) == orders[3]
    assert order(0, PYTHONHASHSEED="12") == order(3, PYTHONHASHSEED="12")  # the user's own choice stands


def test_the_cli_seed_is_read_before_the_script_and_its_value_options_are_the_parsers():
    from simulator.cli import _parser
    from simulator.core.hash_seeds import CLI_VALUE_OPTIONS, cli_seed

    takes_value = {o for a in _parser()._actions if a.option_strings and a.nargs != 0 for o in a.option_strings}
    assert takes_value == CLI_VALUE_OPTIONS
    assert cli_seed(["--nproc-per-node", "2", "--seed", "5", "train.py", "--seed", "9"]) == 5
    assert cli_seed(["--seed=7", "--summary", "train.py"]) == 7
    assert cli_seed(["--trace", "--seed", "train.py"]) == 0  # (--seed here is --trace's value)
    assert cli_seed(["train.py"]) == 0
    assert cli_seed(["pytest", "--seed", "3"]) is None and cli_seed(["calibrate"]) is None


#: a torchrun-style script whose RPC handler keeps state in the script's globals (torch's parameter-server shape)
MAIN_GLOBALS = textwrap.dedent("""\
    import os, pickle
    import __main__
    import torch.distributed.rpc as rpc
    COUNT = 0
    RANK = int(os.environ["RANK"])

    def incr():
        global COUNT
        COUNT += 1
        return COUNT, RANK

    r, w = RANK, int(os.environ["WORLD_SIZE"])
    assert __main__.RANK == r and pickle.loads(pickle.dumps(incr)) is incr  # this rank's module, by name
    rpc.init_rpc(f"worker{{r}}", rank=r, world_size=w)
    if r > 0:
        print(f"rank {{r}} answers", [rpc.rpc_sync("worker0", incr) for _ in range(2)])
    rpc.shutdown()
    if r == 0:
        print("rank 0 counted", COUNT)
""")


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_scripts_functions_are_found_in_each_ranks_own_main_module(tmp_path, isolation):
    """Pickle names a script's function by ``__main__``: the receiving rank finds it in its own script module, so
    an RPC handler runs against the callee's globals, as in the callee's process (before, on thread ranks: in a
    copy of the caller's, and the server's count was lost)."""
    script = _write(tmp_path, "main_globals.py", MAIN_GLOBALS)
    p = _sim(tmp_path, "--nproc-per-node", "3", "--isolation", isolation, script)
    assert p.returncode == 0, p.stderr
    answers = {line for line in p.stdout.splitlines() if "answers" in line}
    calls = sorted(int(c) for line in answers for c in re.findall(r"\((\d), 0\)", line))
    assert calls == [1, 2, 3, 4] and len(answers) == 2 and "rank 0 counted 4" in p.stdout


# a launcher whose ranks send back instances of the script's own classes: a child pickles them as
# __mp_main__.Name (the script, imported under that name), and the launcher finds them in its __main__, which
# multiprocessing aliases as __mp_main__
SCRIPT_CLASSES = textwrap.dedent("""
    import dataclasses
    import multiprocessing as mp

    @dataclasses.dataclass
    class Answer:
        rank: int
        square: int

    def work(rank, q):
        q.put(Answer(rank, rank * rank))

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        ps = [ctx.Process(target=work, args=(r, q)) for r in range(3)]
        for p in ps:
            p.start()
        got = sorted(((a.rank, a.square, type(a).__module__) for a in (q.get(timeout=60) for _ in ps)))
        for p in ps:
            p.join()
        print("got", got, [p.exitcode for p in ps])
""")


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_the_scripts_own_classes_come_back_from_its_ranks_as_from_real_children(tmp_path, isolation):
    script = _write(tmp_path, "classes.py", SCRIPT_CLASSES)
    real = _real(tmp_path, script)
    assert real.returncode == 0 and "got [(0, 0, '__main__'), (1, 1, '__main__'), (2, 4, '__main__')]" in real.stdout, \
        real.stdout + real.stderr
    sim = _sim(tmp_path, "--isolation", isolation, script)
    assert sim.returncode == 0, sim.stderr
    assert sim.stdout == real.stdout, sim.stderr


# exit statuses as the OS reports them to the parent: the low 8 bits of sys.exit's or os._exit's int
EXIT_STATUSES = textwrap.dedent("""
    import multiprocessing as mp, os, sys

    def end(how):
        if how == "exit256":
            sys.exit(256)
        if how == "exit-3":
            sys.exit(-3)
        if how == "_exit300":
            os._exit(300)
        if how == "exit-str":
            sys.exit("a message")

    if __name__ == "__main__":
        hows = ["exit256", "exit-3", "_exit300", "exit-str", "return"]
        ps = [mp.get_context("spawn").Process(target=end, args=(h,)) for h in hows]
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        print("exit codes", dict(zip(hows, [p.exitcode for p in ps])))
""")


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_exit_statuses_keep_the_low_8_bits_as_the_os_reports_them(tmp_path, isolation):
    script = _write(tmp_path, "exits.py", EXIT_STATUSES)
    real = _real(tmp_path, script)
    assert "{'exit256': 0, 'exit-3': 253, '_exit300': 44, 'exit-str': 1, 'return': 0}" in real.stdout, real.stderr
    sim = _sim(tmp_path, "--isolation", isolation, script)
    assert sim.stdout == real.stdout, sim.stderr
    # torchrun-style: sys.exit(256) ends the rank well, sys.exit(-3) fails it with the status the OS reports
    tr = _write(tmp_path, "tr.py", "import os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(int(sys.argv[1]))\n")
    assert _sim(tmp_path, "--isolation", isolation, "--nproc-per-node", 2, tr, 256).returncode == 0
    failed = _sim(tmp_path, "--isolation", isolation, "--nproc-per-node", 2, tr, -3)
    assert failed.returncode == 1 and "rank 1 exited with code 253" in failed.stderr, failed.stderr


# a fork launcher's rank that hands the script's functions to a pool of its own: a fork child has the launcher's
# __main__ (found by name when pickled) and its file (which a spawn pool's children import)
FORK_RANK_POOLS = textwrap.dedent("""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    def square(x):
        return x * x

    def work(rank, q):
        with mp.get_context("spawn").Pool(2) as pool:
            a = sum(pool.map(square, range(rank + 3)))
        with ProcessPoolExecutor(2, mp_context=mp.get_context("fork")) as ex:
            b = sum(ex.map(square, range(rank + 2)))
        q.put((rank, a, b))

    if __name__ == "__main__":
        ctx = mp.get_context("fork")
        q = mp.get_context("spawn").SimpleQueue()  # (a fork context's locks cannot reach rank processes)
        ps = [ctx.Process(target=work, args=(r, q)) for r in range(2)]
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        print("got", sorted(q.get() for _ in ps), [p.exitcode for p in ps])
""")


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_fork_launchers_ranks_hand_the_scripts_functions_to_pools_of_their_own(tmp_path, isolation):
    script = _write(tmp_path, "pools.py", FORK_RANK_POOLS)
    real = _real(tmp_path, script)
    assert real.stdout == "got [(0, 5, 1), (1, 14, 5)] [0, 0]\n", real.stderr
    sim = _sim(tmp_path, "--isolation", isolation, script)
    assert sim.stdout == real.stdout, sim.stderr
