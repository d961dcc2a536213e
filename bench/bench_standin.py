"""Overhead of the CUDA stand-in: one training step (forward, backward, SGD step) on stand-ins vs plain CPU.

Run: ``python bench/bench_standin.py`` (optionally ``--repeat N``).  Prints, per model, the median step time
on the CPU and on a stand-in ``cuda:0`` device and their ratio.  The models: pytorch/examples' DDP toy model
(Linear(10, 10)-ReLU-Linear(10, 5), batch 20) and a 512-wide MLP (3 layers, batch 64).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from simulator import standin


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "toy":
        return torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.ReLU(), torch.nn.Linear(10, 5))
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 512))


def _shapes(kind: str) -> tuple[tuple[int, int], tuple[int, int]]:
    return ((20, 10), (20, 5)) if kind == "toy" else ((64, 512), (64, 512))


def step_time(kind: str, device: str, repeat: int) -> float:
    """Median seconds of one step of model ``kind`` on ``device`` ("cpu" or "cuda")."""
    model = _model(kind).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = _shapes(kind)
    x, y = torch.randn(*xs).to(device), torch.randn(*ys).to(device)
    times = []
    for i in range(repeat + 5):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if i >= 5:  # warm-up steps excluded
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the stand-in's cost is per operator: measure it without intra-op parallelism
    for kind, label in (("toy", "Linear(10,10)-ReLU-Linear(10,5), batch 20"), ("mlp", "3x Linear(512,512), batch 64")):
        cpu = step_time(kind, "cpu", args.repeat)
        with standin.enabled(gpus_per_node=1):
            cuda = step_time(kind, "cuda", args.repeat)
        print(f"{label:45s} cpu {cpu * 1e6:8.1f} us   stand-in {cuda * 1e6:8.1f} us   ratio {cuda / cpu:5.2f}x")


if __name__ == "__main__":
    main()
