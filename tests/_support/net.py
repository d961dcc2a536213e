"""Test helpers for real multi-process runs: the TCP sockets this process listens on (Linux /proc), to check
loopback-only binding, a bounded launch of one script per rank, and a bounded torchrun launch on loopback."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tensorplay.testing import free_port

ROOT = Path(__file__).resolve().parents[2]

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def listening() -> list[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] != "0A" or parts[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = parts[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if v6:
                addr = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            else:
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            out.append((addr, int(hexport, 16)))
    return out


def run_ranks(script: str, n: int, *args: str, env: dict[str, str] | None = None,
              timeout: float = 120) -> list[tuple[int | None, str, str]]:
    """Run ``python script <free port> <rank> *args`` for ranks 0..n-1 at once; ``(returncode, stdout, stderr)``
    per rank.  Every process is killed after ``timeout`` seconds at the latest."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, script, port, str(r), *args], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(n)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def run_bounded(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` from the repository root on loopback-only gloo; fails the test (with the output) past ``timeout``."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout}s:\n{e.stdout}\n{e.stderr}")


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 180, attempts: int = 3,
             options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc [options] script args`` on 127.0.0.1 and a free port.

    The port is free when chosen but the launcher binds it later; if another process took it in between
    (EADDRINUSE in the launcher's output), the run is repeated on a new port, at most ``attempts`` times.
    """
    for _ in range(attempts):
        proc = run_bounded([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *options, script,
                            *args],
                           timeout)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stderr:
            break
    return proc
