"""torchrun called from Python (torch's ``elastic_launch`` and ``torch.distributed.run.main``) in a launcher script:
the agent's workers are simulated ranks (simulator.launch_elastic). Each program runs unmodified on torch's real
agent (real gloo processes) and under ``python -m simulator``, and what each side prints is compared."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from _support.net import ROOT, run_bounded
from tensorplay.testing import free_port

ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")

LAUNCHER = textwrap.dedent(f"""\
    import os
    import sys
    import torch
    import torch.distributed as dist
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    def train(scale, fail_rank):
        dist.init_process_group("gloo")
        r = dist.get_rank()
        t = torch.tensor([float(r + 1) * scale])
        dist.all_reduce(t)
        env = " ".join(f"{{k}}={{os.environ.get(k)}}" for k in {ENV_KEYS!r})
        os.write(1, f"ENV {{env}} sum={{t.item()}}\\n".encode())
        dist.barrier()
        if r == fail_rank:
            raise ValueError(f"rank {{r}} broke")
        dist.destroy_process_group()
        return {{"rank": r, "part": torch.arange(3) * r}}

    if __name__ == "__main__":
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=int(sys.argv[2]), run_id="job7",
                              role="trainer", rdzv_backend="static", rdzv_endpoint="127.0.0.1:" + sys.argv[1],
                              rdzv_configs={{"rank": 0}}, max_restarts=0, monitor_interval=0.1)
        try:
            out = elastic_launch(config, train)(2.0, int(sys.argv[3]))
            print("RESULT", sorted((k, v["rank"], v["part"].tolist()) for k, v in out.items()))
        except Exception as e:
            print("FAILED", type(e).__name__, {{k: (f.local_rank, f.exitcode, f.message["message"])
                                                for k, f in e.failures.items()}})
""")


def _lines(out: str) -> list[str]:
    return sorted(line for line in out.splitlines() if line.startswith(("ENV ", "RESULT", "FAILED", "CHILD")))


def _real(script: str, *args: str) -> subprocess.CompletedProcess:
    return run_bounded([sys.executable, script, *args], timeout=180)


def _simulated(script: str, isolation: str, *args: str) -> subprocess.CompletedProcess:
    return run_bounded([sys.executable, "-m", "simulator", "--isolation", isolation, script, *args], timeout=180)


@pytest.mark.parametrize("isolation", ["thread", "process"])
@pytest.mark.parametrize("fail_rank", [-1, 1])
def test_elastic_launch_runs_its_workers_as_ranks(tmp_path, isolation: str, fail_rank: int) -> None:
    """elastic_launch(config, fn)(*args) from a launcher: each worker reads the agent's environment, the collectives
    agree, and the launcher gets the workers' return values by global rank, or torch's ChildFailedError naming the
    failed rank with the message @record wrote, as from torch's own agent."""
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    port = str(free_port())
    real = _real(str(script), port, "3", str(fail_rank))
    sim = _simulated(str(script), isolation, port, "3", str(fail_rank))
    assert len([x for x in _lines(real.stdout) if x.startswith("ENV ")]) == 3, real.stdout + real.stderr[-3000:]
    assert _lines(sim.stdout) == _lines(real.stdout), (real.stdout, sim.stdout, sim.stderr[-3000:])
    if fail_rank < 0:
        assert "RESULT [(0, 0, [0, 0, 0]), (1, 1, [0, 1, 2]), (2, 2, [0, 2, 4])]" in sim.stdout
        assert real.returncode == sim.returncode == 0, sim.stderr[-3000:]
    else:
        assert "FAILED ChildFailedError {1: (1, 1, 'ValueError: rank 1 broke')}" in sim.stdout
        assert sim.returncode == 1 and "rank 1 failed (ValueError)" in sim.stderr  # (a failed rank fails the run)


RESTART = textwrap.dedent("""\
    import os
    import torch
    import torch.distributed as dist
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    def train():
        dist.init_process_group("gloo")
        r, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        dist.barrier()
        if r == 1 and attempt == 0:
            raise ValueError("rank 1 broke")
        return attempt

    if __name__ == "__main__":
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="job", max_restarts=2,
                              rdzv_backend="c10d", rdzv_endpoint="localhost:0", monitor_interval=0.1)
        print("RESULT", elastic_launch(config, train)())
""")


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_elastic_launch_restarts_a_failed_worker_group(tmp_path, isolation: str) -> None:
    """max_restarts: the agent starts the whole group again (TORCHELASTIC_RESTART_COUNT=1), the second attempt's
    values are the launcher's, and the failure it recovered from does not fail the run."""
    script = tmp_path / "restart.py"
    script.write_text(RESTART)
    sim = _simulated(str(script), isolation)
    assert sim.returncode == 0 and "RESULT {0: 1, 1: 1}" in sim.stdout, sim.stdout + sim.stderr[-3000:]
    assert "restart 1 of max_restarts=2" in sim.stderr


RUN_MAIN = textwrap.dedent("""\
    import sys
    from torch.distributed.run import main

    main(["--nproc-per-node", "2", "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port",
          sys.argv[1], "--rdzv-id", "r7", "child.py", "--steps", "3"])
    print("LAUNCHER DONE")
""")

CHILD = textwrap.dedent("""\
    import os
    import sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    os.write(1, f"CHILD {dist.get_rank()} {sys.argv} {__name__} {os.environ['LOCAL_RANK']} {t.item()}\\n".encode())
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_torchruns_main_called_from_a_script_runs_its_script_on_ranks(tmp_path, isolation: str) -> None:
    """torch.distributed.run.main([...]) in a launcher with no __main__ guard: the agent runs `python -u child.py
    --steps 3` per worker (a subprocess: the launcher's code does not run again on the ranks)."""
    (tmp_path / "launch_it.py").write_text(RUN_MAIN)
    (tmp_path / "child.py").write_text(CHILD)
    port = str(free_port())
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")

    def run(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *cmd, "launch_it.py", port], cwd=tmp_path, env=env, text=True,
                              capture_output=True, timeout=180)

    real, sim = run(), run("-m", "simulator", "--isolation", isolation)
    assert real.returncode == sim.returncode == 0, real.stderr[-3000:] + sim.stderr[-3000:]
    assert _lines(sim.stdout) == _lines(real.stdout) == [
        "CHILD 0 ['child.py', '--steps', '3'] __main__ 0 3.0", "CHILD 1 ['child.py', '--steps', '3'] __main__ 1 3.0"]
    assert sim.stdout.count("LAUNCHER DONE") == 1, sim.stdout


def test_an_entrypoint_that_is_not_python_is_refused_with_the_fix(tmp_path) -> None:
    (tmp_path / "exe.py").write_text(textwrap.dedent("""\
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch
        if __name__ == "__main__":
            elastic_launch(LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2), "/bin/echo")("hello")
    """))
    sim = _simulated(str(tmp_path / "exe.py"), "thread")
    assert sim.returncode == 1 and "entrypoint='/bin/echo' is an executable, and simulated ranks run Python" in \
        sim.stderr, sim.stderr[-3000:]
