"""Trace export, virtual time, fault replay, and `python -m simulator` scripts.

The tests that hold for every isolation take ``isolation``: thread ranks, and rank processes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import simulator
import tensorplay as tp
import tensorplay.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(params=["thread", "process"])
def isolation(request: pytest.FixtureRequest) -> str:
    return request.param


def _step():
    x = tp.ones(1000)
    dist.all_reduce(x)
    y = [tp.empty(10) for _ in range(dist.get_world_size())]
    dist.all_gather(y, tp.ones(10))
    if dist.get_rank() == 0:
        dist.send(tp.ones(4), dst=1)
    elif dist.get_rank() == 1:
        dist.recv(tp.empty(4), src=0)
    return x.sum().item()


def test_trace_records_every_op_and_exports_chrome_json(tmp_path, isolation):
    simulator.run(_step, 3, isolation=isolation)
    tr = simulator.last_trace()
    assert {(e.rank, e.op) for e in tr.events} >= {(r, op) for r in range(3) for op in ("all_reduce", "all_gather")}
    ar = [e for e in tr.events if e.op == "all_reduce"]
    assert all(e.nbytes == 4000 and e.seq == 1 and e.group == (0, 1, 2) for e in ar)
    assert all(e.site.startswith("test_sim_trace_cli.py:") for e in tr.events)
    assert all(e.wall_end >= e.wall_start and e.vend >= e.vstart for e in tr.events)
    recv = next(e for e in tr.events if e.op == "recv")
    assert recv.peer == 0 and recv.rank == 1
    path = tmp_path / "t.json"
    tr.to_chrome(str(path))
    doc = json.loads(path.read_text())
    evs = doc["traceEvents"]
    xs = [e for e in evs if e["ph"] == "X"]
    assert len(xs) == len(tr.events)
    for e in xs:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] >= 0
    assert {e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"} == {"rank 0", "rank 1", "rank 2"}
    wall = tr.to_chrome(clock="wall")
    assert len([e for e in wall["traceEvents"] if e["ph"] == "X"]) == len(xs)


def test_virtual_time_follows_the_alpha_beta_model(isolation):
    cost = simulator.CostModel(latency_s=1e-3, bandwidth_Bps=1e6, compute_scale=0.0)

    def fn():
        dist.all_reduce(tp.ones(250))  # 1000 bytes
        dist.broadcast(tp.ones(250), src=0)
        dist.all_gather_into_tensor(tp.empty(1000), tp.ones(250))  # gathered: 4000 bytes

    simulator.run(fn, 4, cost=cost, isolation=isolation)
    tr = simulator.last_trace()
    n, a, b = 4, 1e-3, 1e6
    ar = 2 * (n - 1) * a + 2 * (n - 1) / n * 1000 / b
    bc = 2 * a + 1000 / b
    ag = (n - 1) * a + (n - 1) / n * 4000 / b
    for r in range(4):
        evs = tr.by_rank(r)
        assert [e.op for e in evs] == ["all_reduce", "broadcast", "all_gather_into_tensor"]
        assert evs[0].vend == pytest.approx(ar)
        assert evs[1].vend == pytest.approx(ar + bc)
        assert evs[2].vend == pytest.approx(ar + bc + ag)
    rows = tr.summary()
    assert rows[0]["end_s"] == pytest.approx(ar + bc + ag)
    assert "rank" in tr.format_summary()


def test_the_summary_says_when_the_schedule_was_not_a_pure_function_of_the_seed():
    # (thread ranks: on rank processes one sleep between two calls is computing, at once with the other processes)
    def fn(wait):
        dist.all_reduce(tp.ones(4))
        if wait and dist.get_rank() == 1:
            time.sleep(0.01)  # (a coop rank that sleeps steps out of the seeded schedule)
        dist.barrier()

    simulator.run(fn, 2, args=(False,))
    assert "pure function" not in simulator.last_trace().format_summary()
    simulator.run(fn, 2, args=(True,))
    last = simulator.last_trace().format_summary().splitlines()[-1]
    assert last.startswith("schedule: not a pure function of the seed") and "rank 1 called time.sleep(0.01)" in last


def test_delay_fault_makes_a_straggler_in_virtual_time(isolation):
    cost = simulator.CostModel(latency_s=0.0, bandwidth_Bps=1e12, compute_scale=0.0)

    def fn():
        dist.all_reduce(tp.ones(1))

    simulator.run(fn, 3, cost=cost, faults=[simulator.Delay(rank=1, seconds=0.5)], isolation=isolation)
    tr = simulator.last_trace()
    for e in tr.events:
        assert e.vend == pytest.approx(0.5)  # everyone waits for the straggler
    waits = {e.rank: e.vend - e.vstart for e in tr.events}
    assert waits[1] == pytest.approx(0.0, abs=1e-9) and waits[0] == pytest.approx(0.5)


def test_crash_fault_replays_identically(isolation):
    faults = simulator.random_faults(seed=5, world_size=4, max_at=4)
    assert faults == simulator.random_faults(seed=5, world_size=4, max_at=4)

    def fn():
        for _ in range(4):
            dist.all_reduce(tp.ones(1))

    sigs = []
    for _ in range(2):
        w = simulator.World(4, faults=faults, isolation=isolation)
        with pytest.raises(simulator.InjectedFault) as ei:
            w.run(fn)
        sigs.append((ei.value.rank, str(ei.value), w.trace.signature()))
    assert sigs[0] == sigs[1]
    assert sigs[0][0] == faults[0].rank


def test_real_delay_in_threads_mode_still_correct():
    def fn():
        x = tp.tensor([float(dist.get_rank())])
        dist.all_reduce(x)
        return x.item()

    out = simulator.run(fn, 3, mode="threads", faults=[simulator.Delay(rank=0, seconds=0.02, real=True)])
    assert out == [3.0, 3.0, 3.0]


SCRIPT = textwrap.dedent("""
    import os, sys
    import tensorplay as tp
    import tensorplay.distributed as dist
    dist.init_process_group(backend="gloo", init_method="env://")
    rank = int(os.environ["RANK"])
    assert rank == dist.get_rank() and int(os.environ["LOCAL_RANK"]) == rank
    assert int(os.environ["WORLD_SIZE"]) == dist.get_world_size() == int(os.environ["LOCAL_WORLD_SIZE"])
    assert os.environ["MASTER_ADDR"] and os.environ["MASTER_PORT"]
    x = tp.tensor([float(rank)])
    dist.all_reduce(x)
    print(f"rank={rank} sum={x.item()} argv={sys.argv[1:]}", flush=True)
    if "--fail" in sys.argv and rank == 1:
        raise ValueError("rank one fails on purpose")
    if "--exit3" in sys.argv and rank == 2:
        sys.exit(3)
    dist.destroy_process_group()
    if "--exit0" in sys.argv:
        sys.exit(0)
""")


def _records(out: str) -> list[str]:
    """The ``rank=...`` lines SCRIPT prints; rank processes print at once, so two may share a line of the pipe."""
    return re.findall(r"rank=\d+ sum=\S+ argv=\[[^\]]*\]", out)


def _cli(tmp_path, *args, isolation="thread"):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RANK", None)
    return subprocess.run([sys.executable, "-m", "simulator", "--isolation", isolation, *args[:-1], str(script),
                           *args[-1]],
                          capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))


def test_cli_runs_a_torchrun_script_with_per_rank_env(tmp_path, isolation):
    trace = tmp_path / "run.json"
    p = _cli(tmp_path, "--nproc-per-node", "3", "--seed", "4", "--trace", str(trace), ["--lr", "0.1"],
             isolation=isolation)
    assert p.returncode == 0, p.stderr
    lines = sorted(_records(p.stdout))
    assert lines == [f"rank={r} sum=3.0 argv=['--lr', '0.1']" for r in range(3)]
    assert json.loads(trace.read_text())["traceEvents"]


def test_cli_failure_exits_non_zero_with_the_rank_traceback(tmp_path, isolation):
    p = _cli(tmp_path, "--nproc-per-node", "3", "--mode", "threads", ["--fail"], isolation=isolation)
    assert p.returncode == 1
    assert "rank 1 failed (ValueError)" in p.stderr
    assert "rank one fails on purpose" in p.stderr and "train.py" in p.stderr
    # the replay hint is the command line (issue 16), the traceback is printed once, without "[rankN]:" prefixes
    assert "replay with python -m simulator --nproc-per-node 3 --seed 0 --mode threads" in p.stderr
    if isolation == "process":
        assert "--isolation process" in p.stderr
    assert p.stderr.count("ValueError: rank one fails on purpose") == 1
    assert "[rank" not in p.stderr


def test_cli_rank_exit_status(tmp_path, isolation):
    p = _cli(tmp_path, "--nproc-per-node", "3", ["--exit3"], isolation=isolation)
    assert p.returncode == 1
    assert "rank 2 exited with code 3" in p.stderr and "sys.exit(3)" in p.stderr
    ok = _cli(tmp_path, "--nproc-per-node", "3", ["--exit0"], isolation=isolation)  # sys.exit(0) is a normal end of a rank
    assert ok.returncode == 0, ok.stderr
    assert len(_records(ok.stdout)) == 3


NO_INIT = textwrap.dedent("""
    import sys
    import tensorplay as tp
    import tensorplay.distributed as dist
    print(f"initialised before: {dist.is_initialized()} argv0: {sys.argv[0]}", flush=True)
    dist.destroy_process_group()  # (nothing to destroy yet: a no-op, as on gloo)
    if "--init" in sys.argv:
        dist.init_process_group("gloo")
        print(f"initialised after: {dist.is_initialized()}", flush=True)
    x = tp.ones(2)
    dist.all_reduce(x)
    print(f"sum {x.tolist()}", flush=True)  # (one string: rank processes share the pipe)
    dist.destroy_process_group()
""")


def test_a_script_that_never_initialises_its_group_fails_as_under_torchrun(tmp_path, isolation):
    """A script's ranks have no default process group until the script makes one, as processes torchrun starts:
    a forgotten init_process_group fails here too (it used to pass, the world being started for the script).
    Its sys.argv[0] is the path as typed, as python and torchrun give it."""
    script = tmp_path / "noinit.py"
    script.write_text(NO_INIT)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def cli(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "simulator", "--isolation", isolation, "--nproc-per-node", "2",
                               script.name, *extra], capture_output=True, text=True, timeout=120, env=env,
                              cwd=str(tmp_path))

    p = cli()
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stdout.count("initialised before: False argv0: noinit.py") == 2, p.stdout  # (argv[0] as typed)
    assert "NotInitializedError" in p.stderr and "the default process group is not initialised" in p.stderr, p.stderr
    ok = cli("--init")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("initialised after: True") == 2 and ok.stdout.count("sum [2.0, 2.0]") == 2, ok.stdout


def test_a_missing_script_is_a_usage_error_naming_only_the_script():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "simulator", "--nproc-per-node", "2"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 2 and "required: script" in p.stderr and "script_args" not in p.stderr, p.stderr


def _package(root) -> None:
    """A package whose module uses a relative import and whose __main__ prints its argv: what `python -m` runs."""
    pkg = root / "trainer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "base.py").write_text("OFFSET = 10\n")
    (pkg / "train.py").write_text(textwrap.dedent("""\
        import os, sys
        import torch
        import torch.distributed as dist
        from .base import OFFSET
        if __name__ == "__main__":
            dist.init_process_group("gloo")
            t = torch.tensor([float(dist.get_rank() + OFFSET)])
            dist.all_reduce(t)
            here = os.path.relpath(sys.argv[0]), sys.argv[1:], __package__, sys.path[0] == os.getcwd()
            print(f"rank {dist.get_rank()} sum {t.item()} {here}", flush=True)
            dist.destroy_process_group()
    """))
    (pkg / "__main__.py").write_text("import sys, os\nprint('package main', os.path.relpath(sys.argv[0]), "
                                     "sys.argv[1:], __package__)\n")


def test_a_module_runs_as_python_m_runs_it(tmp_path, isolation):
    """`python -m simulator -m pkg.mod` as `torchrun -m pkg.mod`: the module's relative imports work, sys.argv[0] is
    its file, the working directory is first on sys.path; a package runs its __main__; a missing module fails
    before any rank starts, naming it."""
    _package(tmp_path)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "simulator", "--isolation", isolation, *args],
                              capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))

    p = cli("--nproc-per-node", "2", "-m", "trainer.train", "--lr", "0.1")
    assert p.returncode == 0, p.stderr
    for r in (0, 1):  # 10 + 11
        assert f"rank {r} sum 21.0 ('trainer/train.py', ['--lr', '0.1'], 'trainer', True)" in p.stdout, p.stdout
    whole = cli("--nproc-per-node", "1", "--module", "trainer", "x")
    assert whole.returncode == 0 and "package main trainer/__main__.py ['x'] trainer" in whole.stdout, whole.stderr
    missing = cli("--nproc-per-node", "2", "-m", "no_such_pkg.train")
    assert missing.returncode == 1 and "no module named 'no_such_pkg.train'" in missing.stderr, missing.stderr


def test_a_launcher_module_and_script_see_argv_as_python_gives_it(tmp_path):
    """Launcher style (no --nproc-per-node): a module's launcher runs as python -m runs it, and a script's
    sys.argv[0] is its path as typed (runpy.run_path used to make it absolute)."""
    _package(tmp_path)
    (tmp_path / "trainer" / "spawner.py").write_text(textwrap.dedent("""\
        import os, sys
        import torch
        import torch.distributed as dist
        import torch.multiprocessing as mp
        from .base import OFFSET

        def run(rank):
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=2)
            t = torch.tensor([float(rank + OFFSET)])
            dist.all_reduce(t)
            print(f"rank {rank} sum {t.item()}", flush=True)
            dist.destroy_process_group()

        if __name__ == "__main__":
            print("launcher", os.path.relpath(sys.argv[0]), sys.argv[1:], flush=True)
            mp.spawn(run, nprocs=2)
    """))
    (tmp_path / "plain.py").write_text("import sys\nprint('plain', sys.argv)\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "simulator", "-m", "trainer.spawner", "y"], capture_output=True,
                       text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert "launcher trainer/spawner.py ['y']" in p.stdout and p.stdout.count("sum 21.0") == 2, p.stdout
    plain = subprocess.run([sys.executable, "-m", "simulator", "plain.py", "z"], capture_output=True, text=True,
                           timeout=120, env=env, cwd=str(tmp_path))
    assert plain.returncode == 0 and "plain ['plain.py', 'z']" in plain.stdout, plain.stdout + plain.stderr


def test_environ_is_restored_after_a_run(isolation):
    before = os.environ

    def fn():
        return os.environ["RANK"], os.getenv("WORLD_SIZE")

    out = simulator.run(fn, 2, torchrun_env=True, isolation=isolation)
    assert out == [("0", "2"), ("1", "2")]
    assert os.environ is before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tensors_round_robin():
    def fn():
        dev = simulator.rank_device()
        x = torch.full((4,), float(dist.get_rank()), device=dev)
        dist.all_reduce(x)
        outs = [torch.empty(4, device=dev) for _ in range(dist.get_world_size())]
        dist.all_gather(outs, x)
        return x.cpu(), dev.type

    res = simulator.run(fn, 4, device="cuda")
    for x, t in res:
        assert t == "cuda" and torch.equal(x, torch.full((4,), 6.0))


# -- a bounded trace (trace_limit) ----------------------------------------------------------------------------------
def _many_all_reduces(n: int = 2000):
    import tensorplay as tp
    import tensorplay.distributed as dist

    x = tp.ones(4)
    for _ in range(n):
        dist.all_reduce(x)
    return x.sum().item()


@pytest.mark.parametrize("limit", [None, 500, 0])
def test_trace_keeps_the_last_events_and_totals_of_all(limit):
    import tracemalloc

    import simulator

    tracemalloc.start()
    try:
        simulator.run(_many_all_reduces, 3, trace_limit=limit)
        kept_bytes = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    tr = simulator.last_trace()
    total = 3 * 2000
    assert len(tr.events) == (total if limit is None else limit)
    assert tr.dropped == (0 if limit is None else total - limit)
    assert [row["ops"] for row in tr.summary()] == [2000] * 3  # the summary counts every event
    if limit:
        assert tr.events[-1].seq == 2000  # the newest are kept
    if limit is not None:
        assert kept_bytes < 1 << 20  # a long run's memory does not grow with its length


def test_default_trace_is_bounded():
    import simulator
    from simulator.core.trace import DEFAULT_TRACE_LIMIT

    assert simulator.World(2).trace_limit == DEFAULT_TRACE_LIMIT
    with pytest.raises(ValueError, match="trace_limit=-1"):
        simulator.World(2, trace_limit=-1)


def test_torchrun_style_ranks_see_torchruns_environment(tmp_path, isolation):
    """The variables torchrun sets for each of several local processes, OMP_NUM_THREADS=1 included."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "env.py"
    script.write_text("import json, os, torch\nkeys = ['RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'GROUP_WORLD_SIZE', "
                      "'ROLE_NAME', 'TORCHELASTIC_RESTART_COUNT', 'TORCHELASTIC_MAX_RESTARTS', 'OMP_NUM_THREADS']\n"
                      "print(json.dumps({k: os.environ.get(k) for k in keys} | {'threads': torch.get_num_threads()}))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-m", "simulator", "--isolation", isolation, "--nproc-per-node", "2",
                          str(script)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = sorted((json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")), key=lambda r: r["RANK"])
    assert [r["RANK"] for r in rows] == ["0", "1"]
    for r in rows:
        assert r["WORLD_SIZE"] == "2" and r["GROUP_WORLD_SIZE"] == "1" and r["ROLE_NAME"] == "default"
        assert r["TORCHELASTIC_RESTART_COUNT"] == "0" and r["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert r["OMP_NUM_THREADS"] == "1" and r["threads"] == 1
    assert "OMP_NUM_THREADS is not set" in out.stderr


# -- the command line's bounds, flags and signals ----------------------------------------------------------------
STUCK = textwrap.dedent("""
    import sys, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    print(f"started {dist.get_rank()}", flush=True)
    if dist.get_rank() == 1:
        if "--forever" in sys.argv:
            while True:  # a rank that never comes back (Ctrl-C stops it)
                time.sleep(0.05)
        time.sleep(4.0)  # STUCK: longer than the bounds the tests pass
    dist.all_reduce(torch.ones(1))
""")


def _sim_cli(tmp_path, *args, text=STUCK, cwd=None):
    script = tmp_path / "stuck.py"
    script.write_text(text)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "simulator", *[str(script) if a == "SCRIPT" else a for a in args]]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=str(cwd or tmp_path))


def test_cli_stall_and_timeout_reports_name_the_flags(tmp_path, isolation):
    """The report says which bound ran out, in the command line's terms, and the replay command keeps it."""
    p = _sim_cli(tmp_path, "--isolation", isolation, "--nproc-per-node", "2", "--stall-timeout", "1.5", "SCRIPT")
    assert p.returncode == 1, p.stderr
    assert "stall: no operation completed for 1.5 s (--stall-timeout 1.5" in p.stderr, p.stderr
    line = next(i for i, text in enumerate(STUCK.splitlines(), 1) if "# STUCK:" in text)
    assert re.search(r"rank 1 has been computing since \d+\.\d s into the run \(for \d+\.\d s\)", p.stderr)
    assert f"at stuck.py:{line} in <module> (" in p.stderr  # where it computes: the script's line, nothing else
    assert "raise --stall-timeout if it is just slow" in p.stderr and "stall_timeout=" not in p.stderr
    assert "replay with python -m simulator --nproc-per-node 2 --seed 0 --mode coop --stall-timeout 1.5" in p.stderr
    if isolation == "thread":  # the whole-run bound, the same way (its process twin is in test_sim_failures.py)
        p = _sim_cli(tmp_path, "--nproc-per-node", "2", "--timeout", "0.5", "SCRIPT")
        assert p.returncode == 1, p.stderr
        assert "timeout: the run did not finish within 0.5 s (--timeout 0.5)" in p.stderr, p.stderr
        assert "raise --timeout if it is just slow" in p.stderr and "--stall-timeout" not in p.stderr
        assert "replay with python -m simulator --nproc-per-node 2 --seed 0 --mode coop --timeout 0.5" in p.stderr


@pytest.mark.parametrize("flag, value", [("--timeout", "nan"), ("--timeout", "-1"), ("--stall-timeout", "0"),
                                         ("--stall-timeout", "soon")])
def test_cli_bad_bounds_are_usage_errors(tmp_path, flag, value):
    p = _sim_cli(tmp_path, "--nproc-per-node", "2", flag, value, "SCRIPT")
    assert p.returncode == 2, p.stderr
    assert f"argument {flag}:" in p.stderr and repr(value) in p.stderr and "seconds" in p.stderr
    assert "started" not in p.stdout  # the script did not run: a usage error, not the script's failure


def test_cli_trace_path_that_cannot_be_written_is_a_usage_error_before_the_run(tmp_path):
    p = _sim_cli(tmp_path, "--nproc-per-node", "2", "--trace", str(tmp_path / "no-such-dir" / "t.json"), "SCRIPT")
    assert p.returncode == 2, p.stderr
    assert "--trace" in p.stderr and "no-such-dir" in p.stderr and "fix: name a file" in p.stderr, p.stderr
    assert "started" not in p.stdout  # the script did not run


def test_cli_script_that_does_not_compile_fails_as_python_does_before_any_rank(tmp_path):
    p = _sim_cli(tmp_path, "--nproc-per-node", "2", "SCRIPT", text="print('started')\nx = (1,\n")
    assert p.returncode == 1 and "started" not in p.stdout, p.stderr
    assert p.stderr.rstrip().endswith("SyntaxError: '(' was never closed"), p.stderr
    assert "simulator" not in p.stderr.replace(str(tmp_path), ""), p.stderr  # no frame of ours, no rank framing


def test_cli_keyboard_interrupt_a_rank_raises_is_that_ranks_failure(tmp_path):
    """Not Ctrl-C: the rank's own exception, reported with its traceback and rank; exit status 130, as a process
    that dies of it."""
    text = ("import torch.distributed as dist\ndist.init_process_group('gloo')\nif dist.get_rank() == 1:\n"
            "    raise KeyboardInterrupt('stop here')\ndist.barrier()\n")
    p = _sim_cli(tmp_path, "--nproc-per-node", "2", "SCRIPT", text=text)
    assert p.returncode == 130, p.stderr
    assert "rank 1 failed (KeyboardInterrupt); its traceback:" in p.stderr, p.stderr
    assert "KeyboardInterrupt: stop here" in p.stderr and "interrupted" not in p.stderr.splitlines()[-1], p.stderr


def test_cli_nproc_abbreviations_work(tmp_path):
    """``--nproc-per-node`` has two spellings; an abbreviation of both (``--nproc``) is not ambiguous."""
    quick = "import torch.distributed as dist\ndist.init_process_group('gloo')\nprint('rank', dist.get_rank())\n"
    for args in (["--nproc", "2"], ["--nproc=2"], ["--npr", "2"]):
        p = _sim_cli(tmp_path, *args, "SCRIPT", text=quick)
        assert p.returncode == 0, (args, p.stderr)
        assert sorted(p.stdout.split("\n"))[-2:] == ["rank 0", "rank 1"], (args, p.stdout)


def test_cli_help_lists_calibrate():
    p = subprocess.run([sys.executable, "-m", "simulator", "--help"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0
    assert "python -m simulator calibrate [" in p.stdout  # in the usage, next to running a script
    assert "subcommands:" in p.stdout and "calibrate --help" in p.stdout
    assert "--stall-timeout SECONDS" in p.stdout and "--timeout SECONDS" in p.stdout


def test_cli_trace_says_where_it_wrote_and_how_to_open_it(tmp_path):
    quick = "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\ndist.all_reduce(torch.ones(1))\n"
    (tmp_path / "out").mkdir()
    p = _sim_cli(tmp_path, "--nproc-per-node", "2", "--trace", "t.json", "SCRIPT", text=quick, cwd=tmp_path / "out")
    assert p.returncode == 0, p.stderr
    where = tmp_path / "out" / "t.json"
    assert json.loads(where.read_text())["traceEvents"]
    assert f"trace written to {where}" in p.stderr  # the absolute path, although a relative one was given
    assert "https://ui.perfetto.dev" in p.stderr and "chrome://tracing" in p.stderr


def test_cli_ctrl_c_prints_one_line_and_exits_130(tmp_path, isolation):
    import select
    import signal
    import time

    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RANK", None)
    p = subprocess.Popen([sys.executable, "-m", "simulator", "--isolation", isolation, "--nproc-per-node", "2",
                          str(script), "--forever"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, cwd=str(tmp_path))
    try:
        started, deadline = "", time.monotonic() + 90
        while "started 1" not in started:  # rank 1 sleeps in its loop now (rank 0 waits for it, or for its turn)
            assert time.monotonic() < deadline and p.poll() is None, "rank 1 did not start"
            if select.select([p.stdout], [], [], 1.0)[0]:
                started += p.stdout.readline()
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
    assert p.returncode == 130, err
    lines = [line for line in err.splitlines() if "OMP_NUM_THREADS" not in line and "rank interpreters" not in line]
    assert lines == ["python -m simulator: interrupted"], err
