"""torchrun's own options on `python -m simulator`: a torchrun command line runs as it is (simulator.cli_torchrun)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from _support.net import ROOT, torchrun

ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")

ENV_SCRIPT = textwrap.dedent(f"""\
    import os
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    line = "ENV " + " ".join(f"{{k}}={{os.environ.get(k)}}" for k in {ENV_KEYS!r}) + f" sum={{t.item()}}"
    os.write(1, (line + "\\n").encode())  # (one write: unbuffered prints of two processes interleave)
    dist.destroy_process_group()
""")


def _simulate(tmp_path, *args: str, **extra_env: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               **extra_env)
    return subprocess.run([sys.executable, "-m", "simulator", *args], capture_output=True, text=True, timeout=180,
                          env=env, cwd=str(tmp_path))


def _env_lines(out: str) -> list[str]:
    return sorted(line for line in out.splitlines() if line.startswith("ENV "))


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_torchrun_command_line_gives_the_ranks_torchruns_environment(tmp_path, isolation: str) -> None:
    """The same options, on torchrun (real gloo processes) and on the simulator: every rank reads the same
    environment (the role, the run id, the restart budget, the master address and port)."""
    script = tmp_path / "envs.py"
    script.write_text(ENV_SCRIPT)
    options = ("--nnodes", "1", "--role", "trainer", "--max-restarts", "1", "--rdzv-id", "job7")
    real = torchrun(str(script), options=options)  # (on 127.0.0.1 and a free port, which it names)
    port = re.search(r"MASTER_PORT=(\d+)", real.stdout)
    assert real.returncode == 0 and port, real.stdout + real.stderr[-3000:]
    sim = _simulate(tmp_path, "--isolation", isolation, "--nproc-per-node", "2", *options, "--master-addr",
                    "127.0.0.1", "--master-port", port.group(1), "envs.py")
    assert real.returncode == 0 and sim.returncode == 0, real.stderr[-2000:] + sim.stderr[-2000:]
    assert len(_env_lines(real.stdout)) == 2 and _env_lines(sim.stdout) == _env_lines(real.stdout), (
        real.stdout, sim.stdout)


def test_several_nodes_run_in_one_simulation(tmp_path) -> None:
    """--nnodes 2 --nproc-per-node 2: the job's 4 ranks, two per node, as torchrun gives them on each node; the
    rendezvous options are accepted."""
    (tmp_path / "envs.py").write_text(ENV_SCRIPT)
    p = _simulate(tmp_path, "--standalone", "--nnodes=1:2", "--nproc-per-node=2", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", "localhost:0", "--node-rank", "0", "--start-method", "spawn", "envs.py")
    assert p.returncode == 0, p.stderr
    got = [dict(kv.split("=", 1) for kv in line.split()[1:]) for line in _env_lines(p.stdout)]
    assert len(got) == 4, p.stdout
    for r in range(4):  # (sorted lines: RANK=0..3)
        e = got[r]
        assert (e["RANK"], e["LOCAL_RANK"], e["GROUP_RANK"]) == (str(r), str(r % 2), str(r // 2)), e
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_WORLD_SIZE"], e["sum"]) == ("4", "2", "2", "10.0"), e
    assert "the 2 nodes of the job run here" in p.stderr, p.stderr
    assert all(e["MASTER_ADDR"] == "localhost" for e in got), got  # (a c10d rendezvous gives its host, as torchrun)


RESTART_SCRIPT = textwrap.dedent("""\
    import os
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    start = int(open("snapshot").read()) if os.path.exists("snapshot") else 0
    for epoch in range(start, 4):
        t = torch.ones(1)
        dist.all_reduce(t)
        if epoch == 2 and attempt == 0 and rank == 1:
            raise RuntimeError("node lost")
        dist.barrier()
        if rank == 0:
            open("snapshot", "w").write(str(epoch + 1))
        print(f"rank {rank} attempt {attempt} epoch {epoch}", flush=True)
    dist.destroy_process_group()
""")


def test_max_restarts_starts_a_failed_run_again_as_torchrun_does(tmp_path) -> None:
    """A rank fails in epoch 2: with --max-restarts 1 the run starts again, resumes from its snapshot and
    succeeds (TORCHELASTIC_RESTART_COUNT=1); without, the failure is the run's."""
    (tmp_path / "train.py").write_text(RESTART_SCRIPT)
    p = _simulate(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1", "train.py")
    assert p.returncode == 0, p.stderr
    lines = sorted(p.stdout.splitlines())
    assert lines == sorted([f"rank {r} attempt 0 epoch {e}" for r in (0, 1) for e in (0, 1)] +
                           [f"rank {r} attempt 1 epoch 2" for r in (0, 1)] +
                           [f"rank {r} attempt 1 epoch 3" for r in (0, 1)]), p.stdout
    assert "node lost" in p.stderr and "restart 1 of --max-restarts 1" in p.stderr, p.stderr
    os.remove(tmp_path / "snapshot")
    once = _simulate(tmp_path, "--nproc-per-node", "2", "train.py")
    assert once.returncode == 1 and "node lost" in once.stderr and "starting it again" not in once.stderr, once.stderr


@pytest.mark.parametrize("args, says", [
    (["--no-python"], "--no-python runs an executable"),
    (["--nproc-per-node", "2", "--virtual-local-rank"], "--virtual-local-rank"),
    (["--nnodes", "0", "--nproc-per-node", "2"], "--nnodes must be a number of nodes"),
    (["--nnodes", "3:2", "--nproc-per-node", "2"], "--nnodes must be a number of nodes"),
    (["--nproc-per-node", "gpu"], "--nproc-per-node gpu counts the node's GPUs"),
    (["--nproc-per-node", "0"], "--nproc-per-node must be at least 1"),
    (["--nproc-per-node", "2", "--max-restarts", "-1"], "--max-restarts must be 0 or more"),
    (["--nnodes", "2", "--nproc-per-node", "2", "--devices", "cuda", "--gpus-per-node", "4"],
     "one rank per GPU"),
])
def test_torchrun_options_the_simulator_cannot_honour_are_usage_errors(tmp_path, args: list[str], says: str) -> None:
    (tmp_path / "envs.py").write_text(ENV_SCRIPT)
    p = _simulate(tmp_path, *args, "envs.py")
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert "ENV " not in p.stdout  # (nothing ran)


def test_fewer_gpus_per_node_than_processes_says_the_ranks_run_as_several_nodes(tmp_path) -> None:
    (tmp_path / "envs.py").write_text(ENV_SCRIPT)
    p = _simulate(tmp_path, "--nproc-per-node", "3", "--devices", "cuda", "--gpus-per-node", "2", "envs.py")
    assert p.returncode == 0, p.stderr
    assert ("--gpus-per-node 2 with --nproc-per-node 3: the ranks run as 2 nodes of 2 GPUs (LOCAL_RANK = rank % 2, "
            "the last node holding 1 rank(s))") in p.stderr, p.stderr
    lines = _env_lines(p.stdout)
    assert [re.search(r"LOCAL_RANK=(\d)", line)[1] for line in lines] == ["0", "1", "0"], lines


def test_standalone_alone_runs_one_rank_as_torchrun(tmp_path) -> None:
    """torchrun's default is one process per node: `--standalone script.py` is a torchrun-style run of one rank."""
    (tmp_path / "envs.py").write_text(ENV_SCRIPT)
    p = _simulate(tmp_path, "--standalone", "envs.py")
    assert p.returncode == 0 and len(_env_lines(p.stdout)) == 1 and "WORLD_SIZE=1" in p.stdout, p.stderr


OUTPUT_SCRIPT = textwrap.dedent("""\
    import sys
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    r = dist.get_rank()
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t)
    print(f"out of {r}: {t.item()}", flush=True)
    print(f"err of {r}", file=sys.stderr, flush=True)
    dist.destroy_process_group()
""")


def _logs(folder) -> dict[str, str]:
    """{"attempt_0/1/stdout.log": text} under the one run folder torchrun's layout makes in ``folder``."""
    (run,) = list(folder.iterdir())
    return {str(p.relative_to(run)): p.read_text() for p in sorted(run.rglob("*.log"))}


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_tee_redirects_and_the_ranks_filter_send_output_where_torchrun_does(tmp_path, isolation: str) -> None:
    """--role rank --tee 3 --local-ranks-filter 0 --log-dir D (torchtitan's command line): on the console only rank
    0's lines, behind "[rank0]:"; every rank's streams in D/<run>/attempt_0/<local rank>/{stdout,stderr}.log.
    Compared with torchrun's own console lines and files."""
    script = tmp_path / "out.py"
    script.write_text(OUTPUT_SCRIPT)
    options = ("--nproc-per-node", "3", "--role", "rank", "--tee", "3", "--local-ranks-filter", "0")
    real = torchrun(str(script), nproc=3, options=(*options[2:], "--log-dir", str(tmp_path / "real")))
    sim = _simulate(tmp_path, "--isolation", isolation, *options, "--log-dir", str(tmp_path / "sim"), "out.py")
    assert real.returncode == 0 and sim.returncode == 0, real.stderr[-2000:] + sim.stderr[-2000:]

    def console(text: str) -> list[str]:
        return sorted(line for line in text.splitlines() if line.startswith("[rank"))

    assert console(real.stdout) == console(sim.stdout) == ["[rank0]:out of 0: 6.0"], (real.stdout, sim.stdout)
    assert console(real.stderr) == console(sim.stderr) == ["[rank0]:err of 0"], (real.stderr, sim.stderr)
    files = _logs(tmp_path / "sim")
    assert files == _logs(tmp_path / "real") and len(files) == 6, files
    assert files["attempt_0/2/stdout.log"] == "out of 2: 6.0\n"


DDP_EXIT_SCRIPT = textwrap.dedent("""\
    import os, sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    r, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    for epoch in range(8):
        loss = ((ddp(x[r::2]) - y[r::2]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        dist.barrier()
        if epoch == 3 and r == 1 and attempt == 0:
            sys.exit(1)  # (rank 0 goes on into the next backward, whose all-reduce can never complete)
    print(f"RES r{r} attempt {attempt} w={ddp.module.weight.detach().sum().item():.6f}", flush=True)
    dist.destroy_process_group()
""")


def test_a_rank_exiting_while_another_is_in_ddps_backward_fails_the_run_cleanly(tmp_path) -> None:
    """Rank 0's gradient all-reduce fails inside DDP's reducer (C++) when rank 1 has exited: the failed work's
    future must carry a C++ error (a Python future's set_exception is a *value* to C++: the reducer read it as the
    gradients and the process died of a segmentation fault, rc 139). The run fails with rank 1's exit, and
    --max-restarts starts it again to the end."""
    (tmp_path / "train.py").write_text(DDP_EXIT_SCRIPT)
    once = _simulate(tmp_path, "--nproc-per-node", "2", "--seed", "0", "train.py")
    assert once.returncode == 1 and "rank 1 exited with code 1" in once.stderr, (once.returncode, once.stderr[-3000:])
    again = _simulate(tmp_path, "--nproc-per-node", "2", "--seed", "0", "--max-restarts", "1", "train.py")
    assert again.returncode == 0, again.stderr[-3000:]
    done = sorted(line for line in again.stdout.splitlines() if line.startswith("RES"))
    assert len(done) == 2 and done[0].split("w=")[1] == done[1].split("w=")[1] and "attempt 1" in done[0], done


def test_torchruns_environment_defaults_set_its_options(tmp_path) -> None:
    """Job templates set PET_<OPTION> instead of options (torchrun reads them as the options' defaults)."""
    (tmp_path / "envs.py").write_text(ENV_SCRIPT)
    p = _simulate(tmp_path, "envs.py", PET_NPROC_PER_NODE="2", PET_ROLE="trainer", PET_MASTER_PORT="1234")
    got = _env_lines(p.stdout)
    assert p.returncode == 0 and len(got) == 2, p.stderr[-3000:]
    assert all("ROLE_NAME=trainer" in line and "MASTER_PORT=1234" in line for line in got), got
    over = _simulate(tmp_path, "--nproc-per-node", "1", "envs.py", PET_NPROC_PER_NODE="2")  # an option wins
    assert over.returncode == 0 and len(_env_lines(over.stdout)) == 1, over.stderr[-3000:]


def test_a_failed_ranks_traceback_is_in_its_redirected_stderr(tmp_path) -> None:
    """As a process that dies of an exception: its traceback (the program's frames) in its stderr.log."""
    (tmp_path / "fail.py").write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                                      "if dist.get_rank() == 1:\n    raise ValueError('rank one broke')\n")
    p = _simulate(tmp_path, "--nproc-per-node", "2", "-r", "3", "--log-dir", str(tmp_path / "logs"), "fail.py")
    assert p.returncode == 1, p.stderr[-3000:]
    logs = _logs(tmp_path / "logs")
    assert logs["attempt_0/1/stderr.log"].startswith("Traceback (most recent call last):\n  File ") and \
        logs["attempt_0/1/stderr.log"].endswith("ValueError: rank one broke\n"), logs
    assert "simulator" not in logs["attempt_0/1/stderr.log"] and logs["attempt_0/0/stderr.log"] == "", logs


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_module_that_is_not_there_is_one_line_as_python_says_it(tmp_path, isolation: str) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    p = _simulate(tmp_path, "--isolation", isolation, "--nproc-per-node", "2", "-m", "pkg.nothere")
    lines = [line for line in p.stderr.splitlines() if "OMP_NUM_THREADS" not in line and "rank interpreters" not in line]
    assert p.returncode == 1 and lines == ["python -m simulator: No module named pkg.nothere"], p.stderr


RECORD_SCRIPT = textwrap.dedent("""\
    import os
    import torch.distributed as dist
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        dist.init_process_group("gloo")
        r = dist.get_rank()
        where = os.environ["TORCHELASTIC_ERROR_FILE"].split(os.sep)[-3:]
        os.write(1, f"FILE {r} {'/'.join(where)} {os.path.isdir(os.path.dirname(os.environ['TORCHELASTIC_ERROR_FILE']))}\\n".encode())
        dist.barrier()
        if r == 1:
            raise ValueError("rank one broke")
        dist.destroy_process_group()

    main()
""")


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_record_writes_the_failed_ranks_error_file_where_torchrun_has_it(tmp_path, isolation: str) -> None:
    """Each worker's TORCHELASTIC_ERROR_FILE names error.json in its own log folder (made, redirected or not);
    torch's @record writes the failing rank's exception there, and nothing for the others. Compared with
    torchrun's files."""
    script = tmp_path / "rec.py"
    script.write_text(RECORD_SCRIPT)
    real = torchrun(str(script), options=("--log-dir", str(tmp_path / "real")))
    sim = _simulate(tmp_path, "--isolation", isolation, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "sim"),
                    "rec.py")
    assert real.returncode == sim.returncode == 1, real.stderr[-2000:] + sim.stderr[-2000:]

    def lines(out: str) -> list[str]:
        return sorted(line for line in out.splitlines() if line.startswith("FILE "))

    assert lines(real.stdout) == lines(sim.stdout) == ["FILE 0 attempt_0/0/error.json True",
                                                      "FILE 1 attempt_0/1/error.json True"], (real.stdout, sim.stdout)

    def errors(folder) -> dict[str, str]:
        (run,) = list(folder.iterdir())
        return {str(p.relative_to(run)): json.loads(p.read_text())["message"]["message"]
                for p in sorted(run.rglob("error.json"))}

    assert errors(tmp_path / "sim") == errors(tmp_path / "real") == {
        "attempt_0/1/error.json": "ValueError: rank one broke"}
    assert "error file written by torch's @record: " in sim.stderr, sim.stderr[-2000:]


@pytest.mark.gloo
def test_a_directory_with_a_main_module_runs_as_torchrun_runs_it(tmp_path) -> None:
    """``torchrun dir`` (as ``python dir``) runs ``dir/__main__.py`` with the directory first on ``sys.path``."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "helper.py").write_text("WHO = 'helper beside __main__'\n")
    (app / "__main__.py").write_text(textwrap.dedent("""
        import os, sys
        import torch, torch.distributed as dist
        from helper import WHO
        dist.init_process_group("gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        line = f"ENV rank={dist.get_rank()} argv0={os.path.basename(sys.argv[0])} who={WHO} sum={t.item()}"
        os.write(1, (line + "\\n").encode())
        dist.destroy_process_group()
    """))
    real = torchrun(str(app))
    assert real.returncode == 0, real.stderr
    assert len(_env_lines(real.stdout)) == 2, real.stdout
    for isolation in ("thread", "process"):
        sim = _simulate(tmp_path, "--isolation", isolation, "--nproc-per-node", "2", "app")
        assert sim.returncode == 0, sim.stderr
        assert _env_lines(sim.stdout) == _env_lines(real.stdout), (isolation, sim.stderr)
    (app / "__main__.py").unlink()
    missing = _simulate(tmp_path, "--nproc-per-node", "2", "app")
    assert missing.returncode == 2 and "__main__.py is missing" in missing.stderr, missing.stderr
