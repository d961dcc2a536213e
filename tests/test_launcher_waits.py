"""multiprocessing's waits in a launcher script and its ranks (simulator.adapters.os_waits, simulator.launch): a rank
waiting on a queue or an event another rank fills does not keep coop's turn, and a launcher that reads its ranks'
queue before joining them (as Python's documentation advises) finds them running. Each program runs on real
processes and under ``python -m simulator`` in both isolations, and what each prints is compared."""
from __future__ import annotations

import sys
import textwrap

import pytest

from _support.net import run_bounded

RANK_TO_RANK = textwrap.dedent("""\
    import os
    import sys
    import torch
    import torch.distributed as dist
    import multiprocessing as mp

    def work(rank, n, q, ev, bar, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
        if rank == 0:
            ev.wait()        # set by rank 1, outside torch.distributed
            os.write(1, f"[r0] got {q.get()}\\n".encode())
        elif rank == 1:
            q.put("hello from 1")
            ev.set()
        bar.wait()           # a multiprocessing Barrier of the three ranks
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        os.write(1, f"[r{rank}] sum={t.item()}\\n".encode())  # (one write: real processes print at once)
        dist.destroy_process_group()

    if __name__ == "__main__":
        ctx = mp.get_context(sys.argv[2])
        q, ev, bar = ctx.Queue(), ctx.Event(), ctx.Barrier(3)
        procs = [ctx.Process(target=work, args=(r, 3, q, ev, bar, sys.argv[1])) for r in range(3)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        print("codes", [p.exitcode for p in procs])
""")

LAUNCHER_READS = textwrap.dedent("""\
    import sys
    import torch
    import torch.distributed as dist
    import multiprocessing as mp

    def work(rank, n, q, done, port):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        q.put((rank, t.item()))
        done.wait()          # until the launcher has every result (torch's elastic agent does the same)
        dist.destroy_process_group()

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q, done = ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=work, args=(r, 3, q, done, sys.argv[1])) for r in range(3)]
        for p in procs:
            p.start()
        print("got", sorted(q.get(timeout=60) for _ in procs), flush=True)
        done.set()
        for p in procs:
            p.join()
        print("codes", [p.exitcode for p in procs])
""")


def _lines(out: str) -> list[str]:
    return sorted(line for line in out.splitlines() if line.startswith(("[r", "codes", "got")))


def _port() -> str:
    from tensorplay.testing import free_port

    return str(free_port())


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_ranks_that_wait_on_each_others_queue_and_event_finish_under_every_seed(tmp_path, isolation: str) -> None:
    """Rank 0 waits on an Event and a Queue that rank 1 fills, then all three meet at a multiprocessing Barrier:
    whichever rank coop's seed runs first, the waiting one steps out of the schedule, and the run finishes as on
    real processes."""
    script = tmp_path / "r2r.py"
    script.write_text(RANK_TO_RANK)
    real = run_bounded([sys.executable, str(script), _port(), "spawn"], timeout=120)
    assert real.returncode == 0 and "codes [0, 0, 0]" in real.stdout, real.stdout + real.stderr[-2000:]
    for seed in ("1", "2"):  # (the schedules under which rank 0 took the turn first and kept it)
        sim = run_bounded([sys.executable, "-m", "simulator", "--isolation", isolation, "--seed", seed,
                           "--stall-timeout", "60", str(script), _port(), "spawn"], timeout=120)
        assert _lines(sim.stdout) == _lines(real.stdout), (seed, sim.stdout, sim.stderr[-3000:])


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_launcher_that_reads_its_ranks_queue_before_joining_finds_them_running(tmp_path, isolation: str) -> None:
    """The launcher gets every rank's result from a queue, then sets the event the ranks wait for, then joins:
    its first wait on the queue starts the ranks (they run while it waits, as processes would)."""
    script = tmp_path / "reads.py"
    script.write_text(LAUNCHER_READS)
    real = run_bounded([sys.executable, str(script), _port()], timeout=120)
    sim = run_bounded([sys.executable, "-m", "simulator", "--isolation", isolation, str(script), _port()],
                      timeout=120)
    assert "got [(0, 6.0), (1, 6.0), (2, 6.0)]" in real.stdout, real.stdout + real.stderr[-2000:]
    assert _lines(sim.stdout) == _lines(real.stdout), (sim.stdout, sim.stderr[-3000:])
    assert real.returncode == sim.returncode == 0


NO_GUARD_FORK = textwrap.dedent("""\
    import os
    import multiprocessing as mp
    os.write(1, b"body\\n")  # a fork child never runs this again

    SCALE = {"factor": 10}   # a global the children read (a fork child has the launcher's memory)

    def worker(rank, conn):
        conn.send(rank * SCALE["factor"])

    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=worker, args=(r, pipes[r][1])) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    print("got", [a.recv() for a, _ in pipes], "codes", [p.exitcode for p in procs])
""")

FORK_QUEUE = textwrap.dedent("""\
    import multiprocessing as mp

    def worker(rank, q):
        q.put(rank)

    if __name__ == "__main__":
        ctx = mp.get_context("fork")
        q = ctx.SimpleQueue()
        procs = [ctx.Process(target=worker, args=(r, q)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        print(sorted(q.get() for _ in procs))
""")


def test_a_fork_queue_that_cannot_reach_rank_processes_fails_the_launchers_wait(tmp_path) -> None:
    """A fork context's lock (in its queue) cannot reach a rank process, which is spawned: the launcher's later
    wait on the queue fails with multiprocessing's reason rather than waiting for ranks that never started."""
    script = tmp_path / "forkq.py"
    script.write_text(FORK_QUEUE)
    sim = run_bounded([sys.executable, "-m", "simulator", "--isolation", "process", str(script)], timeout=120)
    assert sim.returncode == 1 and "A SemLock created in a fork context" in sim.stderr, sim.stderr[-3000:]


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_fork_launcher_without_a_main_guard_runs_its_body_once(tmp_path, isolation: str) -> None:
    """The fork start method copies the launcher into each child, which never runs the script's top-level code:
    on rank processes the children's code travels by value instead of the script being imported again."""
    script = tmp_path / "noguard.py"
    script.write_text(NO_GUARD_FORK)
    real = run_bounded([sys.executable, str(script)], timeout=120)
    sim = run_bounded([sys.executable, "-m", "simulator", "--isolation", isolation, str(script)], timeout=120)
    assert real.stdout == "body\ngot [0, 10] codes [0, 0]\n", real.stdout + real.stderr[-2000:]
    assert sim.stdout == real.stdout and sim.returncode == 0, sim.stdout + sim.stderr[-3000:]


NO_GUARD_SPAWN = textwrap.dedent("""\
    import os
    import torch.multiprocessing as mp
    os.write(1, f"body as {__name__}\\n".encode())

    def fn(rank):
        os.write(1, f"[r{rank}] ran\\n".encode())

    try:
        mp.spawn(fn, nprocs=2)
        os.write(1, b"spawn ok\\n")
    except RuntimeError as e:
        os.write(1, f"spawn raised {'bootstrapping phase' in str(e)}\\n".encode())
""")


def test_a_spawn_launcher_without_a_main_guard_meets_multiprocessings_bootstrapping_error(tmp_path) -> None:
    """A spawned child imports the script as __mp_main__, and its own spawn call fails with multiprocessing's
    bootstrapping error; rank processes import it the same way, with the same error (no nested processes)."""
    script = tmp_path / "noguard_spawn.py"
    script.write_text(NO_GUARD_SPAWN)
    real = run_bounded([sys.executable, str(script)], timeout=120)
    sim = run_bounded([sys.executable, "-m", "simulator", "--isolation", "process", str(script)], timeout=120)
    assert sorted(real.stdout.splitlines()) == [
        "[r0] ran", "[r1] ran", "body as __main__", "body as __mp_main__", "body as __mp_main__", "spawn ok",
        "spawn raised True", "spawn raised True"], real.stdout + real.stderr[-2000:]
    assert sorted(sim.stdout.splitlines()) == sorted(real.stdout.splitlines()), sim.stdout + sim.stderr[-3000:]


TWO_WORLDS = textwrap.dedent("""\
    import sys
    import multiprocessing as mp

    def worker(k, rank, q):
        q.put((k, rank))

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        for k in range(3):
            if sys.argv[1] == "fresh":
                q = ctx.Queue()
            procs = [ctx.Process(target=worker, args=(k, r, q)) for r in range(2)]
            for p in procs:
                p.start()
            print("got", sorted(q.get(timeout=60) for _ in procs), flush=True)   # read before join
            for p in procs:
                p.join()
            print("codes", [p.exitcode for p in procs], flush=True)
""")


@pytest.mark.parametrize("queue", ["shared", "fresh"])
def test_successive_worlds_that_answer_on_a_queue_before_the_join_each_reach_the_launcher(tmp_path, queue: str
                                                                                          ) -> None:
    """Three worlds in a row, each read from a queue before it is joined: a world still ending in the background
    when the launcher starts the next and waits on the queue no longer keeps that next one from starting."""
    script = tmp_path / "two_worlds.py"
    script.write_text(TWO_WORLDS)
    real = run_bounded([sys.executable, str(script), queue], timeout=120)
    assert real.returncode == 0 and real.stdout.count("codes [0, 0]") == 3, real.stdout + real.stderr[-2000:]
    for flags in (["--mode", "coop"], ["--mode", "threads"], ["--isolation", "process"]):
        sim = run_bounded([sys.executable, "-m", "simulator", *flags, str(script), queue], timeout=120)
        assert sim.stdout == real.stdout and sim.returncode == 0, (flags, sim.stdout, sim.stderr[-3000:])


FORK_QUEUE_READ = textwrap.dedent("""\
    import multiprocessing as mp

    def worker(rank, q):
        q.put(rank)

    if __name__ == "__main__":
        q = mp.Queue()   # the default context: fork, on Linux
        procs = [mp.Process(target=worker, args=(r, q)) for r in range(2)]
        for p in procs:
            p.start()
        print(sorted(q.get() for _ in procs))   # read before join: the ranks start in the background
        for p in procs:
            p.join()
""")


def test_a_fork_queue_read_before_the_join_fails_the_wait_once_the_rank_processes_cannot_start(tmp_path) -> None:
    """The same refusal when the launcher reads the queue first: its wait ends with it as soon as the world in the
    background fails to start, rather than blocking for good on a queue nothing can fill."""
    script = tmp_path / "forkq_read.py"
    script.write_text(FORK_QUEUE_READ)
    sim = run_bounded([sys.executable, "-m", "simulator", "--isolation", "process", str(script)], timeout=120)
    assert sim.returncode == 1 and "A SemLock created in a fork context" in sim.stderr, sim.stderr[-3000:]


RANK_DIES = textwrap.dedent("""\
    import sys
    import multiprocessing as mp

    def worker(rank, q):
        if rank == 1:
            raise RuntimeError("rank 1 dies before answering")
        q.put(rank)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        wait = None if sys.argv[1] == "none" else float(sys.argv[1])
        for r in range(2):
            ctx.Process(target=worker, args=(r, q)).start()   # (joined at exit, as Python joins its children)
        print("got", [q.get(timeout=wait) for _ in range(2)], flush=True)   # rank 1 never answers
""")


def _died(err: str) -> list[str]:
    """The child's report of its death, as it prints it: its name, the traceback's head, the rank's own frame
    (a real child's shows multiprocessing's frames before it) and the exception."""
    report = err[err.index("Process SpawnProcess-2:\n"):]
    lines = report.splitlines()
    return [lines[0], lines[1], next(line.split(", ", 1)[1] for line in lines if "in worker" in line),
            next(line for line in lines if line.startswith("RuntimeError"))]


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_rank_that_dies_while_the_launcher_reads_its_queue_prints_its_traceback_at_once(tmp_path, isolation: str
                                                                                          ) -> None:
    """A real child prints its traceback as it dies, while its parent still waits on the queue (then the parent's
    bounded get gives up); a rank does the same, before the launcher's get gives up.  Without a bound the wait
    would last for good, as the real one does: the run's --timeout bounds it."""
    script = tmp_path / "dies.py"
    script.write_text(RANK_DIES)
    real = run_bounded([sys.executable, str(script), "4"], timeout=120)
    sim = run_bounded([sys.executable, "-m", "simulator", "--isolation", isolation, str(script), "4"], timeout=120)
    for run in (real, sim):
        assert run.returncode == 1 and "_queue.Empty" in run.stderr, run.stderr[-3000:]
        assert run.stderr.index("Process SpawnProcess-2:") < run.stderr.index("_queue.Empty"), run.stderr[-3000:]
    assert _died(real.stderr) == ["Process SpawnProcess-2:", "Traceback (most recent call last):", "line 6, in worker",
                                  "RuntimeError: rank 1 dies before answering"], real.stderr[-3000:]
    assert _died(sim.stderr) == _died(real.stderr), (sim.stderr[-3000:], real.stderr[-3000:])
    bounded = run_bounded([sys.executable, "-m", "simulator", "--isolation", isolation, "--timeout", "3",
                           str(script), "none"], timeout=120)
    assert bounded.returncode == 1 and "SimTimeoutError" in bounded.stderr, bounded.stderr[-3000:]
    assert "rank 1 failed (RuntimeError: rank 1 dies before answering)" in bounded.stderr, bounded.stderr[-3000:]
    assert "Process SpawnProcess-2:" in bounded.stderr, bounded.stderr[-3000:]
