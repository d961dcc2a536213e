"""Libraries' process-wide singletons are one per rank on thread ranks (simulator/adapters/per_rank_state.py).

The Hydra program below is the shape of pytorch/examples' minGPT entry point (``@hydra.main`` around a torchrun
program); it runs on real gloo processes under torchrun and, with default options, on simulated thread ranks, and
the two print the same.  The rest checks the table itself: a rank's own entries, shared registries, a copy.
"""
from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import simulator
from simulator.adapters.per_rank_state import PerRankTable
from tensorplay.testing import free_port

ROOT = Path(__file__).resolve().parents[1]

HYDRA_PROGRAM = textwrap.dedent("""
    import hydra
    import torch, torch.distributed as dist
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    @hydra.main(version_base=None, config_path=None, config_name=None)
    def main(cfg) -> None:
        dist.init_process_group("gloo")
        x = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(x)
        print(f"rank {dist.get_rank()} sum={x.item()} hydra={GlobalHydra.instance().is_initialized()} "
              f"job={HydraConfig.get().job.name}", flush=True)
        dist.destroy_process_group()

    if __name__ == "__main__":
        main()
""")


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _rank_lines(out: str) -> list[str]:
    # real processes share the pipe: one rank's line can start where another's newline has not come yet
    out = re.sub(r"(?<=[^\n])(?=rank \d)", "\n", out)
    return sorted(line for line in out.splitlines() if line.startswith("rank "))


def test_a_hydra_program_runs_on_thread_ranks_with_default_options(tmp_path: Path) -> None:
    pytest.importorskip("hydra")
    (tmp_path / "main.py").write_text(HYDRA_PROGRAM)
    overrides = [f"hydra.run.dir={tmp_path / 'out'}", "hydra.output_subdir=null"]
    sim = _run([sys.executable, "-m", "simulator", "--nproc-per-node", "3", "main.py", *overrides], tmp_path)
    assert sim.returncode == 0, sim.stderr[-3000:]
    assert _rank_lines(sim.stdout) == [f"rank {r} sum=6.0 hydra=True job=main" for r in range(3)], sim.stdout


@pytest.mark.gloo
def test_the_hydra_program_prints_the_same_under_torchrun(tmp_path: Path) -> None:
    pytest.importorskip("hydra")
    (tmp_path / "main.py").write_text(HYDRA_PROGRAM)
    overrides = [f"hydra.run.dir={tmp_path / 'out'}", "hydra.output_subdir=null"]
    real = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr",
                 "127.0.0.1", "--master-port", str(free_port()), "main.py", *overrides], tmp_path)
    assert real.returncode == 0, real.stderr[-3000:]
    sim = _run([sys.executable, "-m", "simulator", "--nproc-per-node", "3", "main.py", *overrides], tmp_path)
    assert _rank_lines(sim.stdout) == _rank_lines(real.stdout), (sim.stdout, real.stdout)


class _Own:
    pass


class _Registry:
    pass


_TABLE = PerRankTable({_Registry: "filled at import"}, lambda key: key is _Own)


def _use_table() -> tuple:
    rs = simulator.current_rank_state()
    first = _Own in _TABLE
    _TABLE[_Own] = f"rank {rs.rank}"  # type: ignore[union-attr]
    return first, _TABLE[_Own], _TABLE[_Registry], dict(copy.deepcopy(_TABLE)) == {_Own: _TABLE[_Own],
                                                                                    _Registry: "filled at import"}


def test_each_rank_has_its_own_entries_and_shares_the_registries() -> None:
    out = simulator.run(_use_table, 3)
    assert out == [(False, f"rank {r}", "filled at import", True) for r in range(3)]
    assert _Own not in _TABLE and _TABLE[_Registry] == "filled at import"  # outside a rank: the original


def _counts() -> tuple[int, bool, int, bool]:
    before = (len(_TABLE), bool(_TABLE))
    _TABLE[_Own] = "mine"
    return (*before, len(_TABLE), bool(_TABLE))


def test_a_ranks_size_and_truth_count_the_shared_entries_and_its_own() -> None:
    # the shared registry (1 entry) from the start, then the rank's own entry too: what len(view) would give
    assert simulator.run(_counts, 2) == [(1, True, 2, True)] * 2
    empty = PerRankTable({}, lambda key: True)
    assert simulator.run(lambda: (len(empty), bool(empty)), 2) == [(0, False)] * 2


CHILDREN_PROGRAM = textwrap.dedent("""
    import os, subprocess, sys
    import torch
    from torch.utils.data import DataLoader, Dataset

    class RankSeenByTheWorker(Dataset):
        def __len__(self):
            return 2
        def __getitem__(self, i):
            return int(os.environ["RANK"])

    if __name__ == "__main__":
        out = subprocess.run([sys.executable, "-c", "import os; print(os.environ['RANK'], os.environ['LOCAL_RANK'])"],
                             capture_output=True, text=True).stdout.split()
        # (GPU scripts start their loader workers by spawn: fork and CUDA do not mix)
        loader = DataLoader(RankSeenByTheWorker(), batch_size=2, num_workers=1, multiprocessing_context="spawn")
        print(f"rank {os.environ['RANK']} subprocess={out} worker={next(iter(loader)).tolist()}", flush=True)
""")


def test_children_a_thread_rank_starts_inherit_its_environment(tmp_path: Path) -> None:
    """A process's children inherit its environment (torchrun's RANK, LOCAL_RANK): so do the children of a thread
    rank, started by subprocess or by a spawn-context DataLoader, though the C environment is the launcher's."""
    (tmp_path / "main.py").write_text(CHILDREN_PROGRAM)
    sim = _run([sys.executable, "-m", "simulator", "--nproc-per-node", "2", "main.py"], tmp_path)
    assert sim.returncode == 0, sim.stderr[-3000:]
    assert _rank_lines(sim.stdout) == ["rank 0 subprocess=['0', '0'] worker=[0, 0]",
                                       "rank 1 subprocess=['1', '1'] worker=[1, 1]"], sim.stdout


def test_a_print_under_way_as_the_last_world_ends_reaches_the_process_stream(capsys) -> None:
    """A thread that looked ``print`` up while the per-rank streams were installed (it finds the dispatcher in
    ``builtins``) and calls it after the last world removed them prints to the process's stream (a launcher's print
    beside a world ending in the background once raised ``KeyError``)."""
    import builtins

    from simulator.adapters import per_rank_streams

    with per_rank_streams.enabled():
        looked_up = builtins.__dict__["print"]
        written = sys.__dict__["stdout"]
    assert looked_up is not print  # (the dispatcher, kept past the world's end)
    looked_up("after the world", flush=True)
    written.write("and its stream\n")
    assert capsys.readouterr().out == "after the world\nand its stream\n"
