"""Authenticated RPC worlds (issue 16): only members holding the world's secret can make a worker run anything.

* the envelope itself (seal/open, tampering, a wrong secret, replays, old messages, the refusal's log line);
* where the secret comes from (environment variable, owner-only file, the errors for everything else);
* the simulator's transport (authenticated by default, same check code on every message);
* TensorPipe with a real attacker process on loopback: it reads the worker's address from the rendezvous
  store, starts an agent of its own and asks the worker to run ``os.system``; nothing may run, and a
  member's message it captured and replays is refused too.  A control run against an unauthenticated
  world shows the same attacker does get in there.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import simulator
import tensorplay.distributed as dist
import tensorplay.distributed.rpc as rpc
from tensorplay.distributed.errors import DistRuntimeError, DistValueError
from tensorplay.distributed.rpc import _agent, _auth
from tensorplay.distributed.rpc._auth import AuthenticationError, Authenticator

ROOT = Path(__file__).resolve().parents[1]
ATTACKER = ROOT / "tests" / "_support" / "rpc_attacker.py"
MEMBER = ROOT / "tests" / "_support" / "rpc_member.py"
SECRET = "correct horse battery staple 42"


def _append_line(path: str, text: str) -> int:
    """The side effect a call leaves: one line per run."""
    with open(path, "a") as f:
        f.write(text + "\n")
    return len(Path(path).read_text().splitlines())


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


# ---------------------------------------------------------------------------
# the envelope
# ---------------------------------------------------------------------------
def test_sealed_message_opens_once_and_tampering_or_another_secret_is_refused(caplog) -> None:
    sender, receiver = Authenticator(SECRET), Authenticator(SECRET)
    payload = b"\x80\x05 any pickle bytes"
    msg = sender.seal(payload)
    assert len(msg) == len(payload) + _auth.HEADER_LEN
    assert bytes(receiver.open(msg, "peer 127.0.0.1:1")) == payload

    caplog.set_level(logging.WARNING, logger="tensorplay.distributed.rpc.auth")
    with pytest.raises(AuthenticationError) as e:  # the very same bytes again
        receiver.open(msg, "peer 127.0.0.1:2")
    assert str(e.value) == _auth.REFUSAL  # the refusal says nothing about why
    tampered = msg[:-1] + bytes([msg[-1] ^ 1])
    with pytest.raises(AuthenticationError):
        receiver.open(tampered, "peer 127.0.0.1:3")
    with pytest.raises(AuthenticationError):
        receiver.open(Authenticator("another secret, not the world's").seal(payload), "peer 127.0.0.1:4")
    with pytest.raises(AuthenticationError):
        receiver.open(payload, "peer 127.0.0.1:5")  # no envelope at all
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 4 and receiver.refused == 4
    assert "replayed" in logged[0] and "127.0.0.1:2" in logged[0]
    assert "authentication code" in logged[1] and "authentication code" in logged[2]
    assert "no authentication envelope" in logged[3] and "127.0.0.1:5" in logged[3]
    # a second message of the same sender still opens: the replay window tracks each counter
    assert bytes(receiver.open(sender.seal(b"next"), "peer")) == b"next"


def test_out_of_order_messages_open_and_old_ones_are_refused(monkeypatch) -> None:
    sender, receiver = Authenticator(SECRET), Authenticator(SECRET, max_age_s=30.0)
    first, second, third = (sender.seal(bytes([i])) for i in range(3))
    assert [bytes(receiver.open(m)) for m in (third, first, second)] == [b"\x02", b"\x00", b"\x01"]
    # a message further behind than the replay window is refused, and the window's memory stays bounded
    late = sender.seal(b"late")
    for _ in range(2 * _auth._WINDOW + 10):
        receiver.open(sender.seal(b"."))
    (window,) = receiver._windows.values()
    assert len(window.seen) <= 2 * _auth._WINDOW
    with pytest.raises(AuthenticationError):
        receiver.open(late)
    real_time = _auth.time.time
    monkeypatch.setattr(_auth.time, "time", lambda: real_time() - 31.0)
    stale = sender.seal(b"from the past")
    monkeypatch.setattr(_auth.time, "time", real_time)
    with pytest.raises(AuthenticationError):
        receiver.open(stale)


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp (Linux)")
def test_refusal_names_the_peers_connected_to_the_listener(caplog) -> None:
    """TensorPipe does not say which connection carried a message: the log names those open to the listener."""
    import socket

    assert _auth._decode_endpoint("0100007F:1F90") == "127.0.0.1:8080"
    assert _auth._decode_endpoint("0000000000000000FFFF00000100007F:0050") == "127.0.0.1:80"
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    accepted, _ = server.accept()
    try:
        me = "127.0.0.1:%d" % client.getsockname()[1]
        assert _auth.connections_to(port) == [me]
        caplog.set_level(logging.WARNING, logger="tensorplay.distributed.rpc.auth")
        with pytest.raises(AuthenticationError):
            Authenticator(SECRET).open(b"not sealed", _auth._TensorPipePeers(f"uv://127.0.0.1:{port}"))
        (line,) = [r.getMessage() for r in caplog.records]
        assert f"TensorPipe listener uv://127.0.0.1:{port}" in line and me in line, line
    finally:
        for s in (client, accepted, server):
            s.close()


# ---------------------------------------------------------------------------
# where the secret comes from
# ---------------------------------------------------------------------------
def test_secret_from_environment_and_owner_only_file(tmp_path: Path) -> None:
    assert _auth.load_secret(environ={}) is None
    assert _auth.load_secret(environ={_auth.ENV_SECRET: SECRET}) == SECRET.encode()
    with pytest.raises(DistValueError, match=r"too short.*length=5.*token_hex"):
        _auth.load_secret(environ={_auth.ENV_SECRET: "short"})

    f = tmp_path / "rpc.secret"
    f.write_text(SECRET + "\n")
    f.chmod(0o600)
    assert _auth.load_secret(environ={_auth.ENV_SECRET_FILE: str(f)}) == SECRET.encode()
    f.chmod(0o644)
    with pytest.raises(DistValueError) as e:
        _auth.load_secret(environ={_auth.ENV_SECRET_FILE: str(f)})
    msg = str(e.value)
    assert f"secret file {f} " in msg and "mode 0o644" in msg and f"chmod 600 {f}" in msg
    with pytest.raises(DistValueError, match="cannot be read"):
        _auth.load_secret(environ={_auth.ENV_SECRET_FILE: str(tmp_path / "missing")})
    with pytest.raises(DistValueError, match="both"):
        _auth.load_secret(environ={_auth.ENV_SECRET: SECRET, _auth.ENV_SECRET_FILE: str(f)})


def test_bad_secret_file_fails_init_rpc_before_any_communication(tmp_path: Path, monkeypatch) -> None:
    f = tmp_path / "rpc.secret"
    f.write_text(SECRET)
    f.chmod(0o640)
    monkeypatch.setenv(_auth.ENV_SECRET_FILE, str(f))

    def body():
        rpc.init_rpc(f"worker{dist.get_rank()}")

    with pytest.raises(BaseException) as e:
        simulator.run(body, 2)
    assert "chmod 600" in str(e.value) and "mode 0o640" in str(e.value)


# ---------------------------------------------------------------------------
# the simulator's transport
# ---------------------------------------------------------------------------
def _sim_attempts(side: str, forged: str) -> dict | None:
    """worker0: a member call, then a member's sealed message delivered twice, then forged ones."""
    from simulator.rpc import codec

    me = dist.get_rank()
    rpc.init_rpc(f"worker{me}")
    out = None
    if me == 0:
        a = _agent.current()
        peer = a.world.agents["worker1"]
        n_member = rpc.rpc_sync("worker1", _append_line, args=(side, "member"))
        sealed = codec.encode((_append_line, (side, "sealed"), {}), a.name).seal(a.auth)
        first = peer._as_sender(lambda: peer._serve(sealed))
        again = peer._as_sender(lambda: peer._serve(sealed))
        bare = codec.encode((os.system, (f"touch {forged}",), {}), a.name)  # no envelope
        other = codec.encode((os.system, (f"touch {forged}",), {}), a.name).seal(Authenticator("not the world's secret"))
        out = {"member": n_member, "first": first,
               "refused": [type(r).__name__ + ":" + r.type_name for r in
                           (again, peer._as_sender(lambda: peer._serve(bare)),
                            peer._as_sender(lambda: peer._serve(other)))],
               "secret_from_env": _auth.ENV_SECRET in os.environ
               and a.auth.same_key(Authenticator(os.environ[_auth.ENV_SECRET]))}
    rpc.shutdown()
    return out


@pytest.mark.parametrize("from_env", [False, True], ids=["generated-secret", "env-secret"])
def test_sim_transport_checks_every_message(tmp_path: Path, monkeypatch, caplog, from_env: bool) -> None:
    if from_env:
        monkeypatch.setenv(_auth.ENV_SECRET, SECRET)
    else:
        monkeypatch.delenv(_auth.ENV_SECRET, raising=False)
    monkeypatch.delenv(_auth.ENV_SECRET_FILE, raising=False)
    side, forged = tmp_path / "side", tmp_path / "forged"
    caplog.set_level(logging.WARNING, logger="tensorplay.distributed.rpc.auth")
    out = simulator.run(lambda: _sim_attempts(str(side), str(forged)), 2)[0]
    assert out["member"] == 1 and out["first"] == 2
    assert out["refused"] == ["RemoteFailure:tensorplay.distributed.rpc._auth.AuthenticationError"] * 3
    assert out["secret_from_env"] is from_env
    assert _lines(side) == ["member", "sealed"] and not forged.exists()
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 3 and all("simulated worker 'worker0'" in m for m in logged)
    assert "replayed" in logged[0] and "no authentication envelope" in logged[1]


def _init_with(secrets: dict) -> str:
    """A rank that sets its own secret (per-rank environment) before init_rpc."""
    me = dist.get_rank()
    os.environ.pop(_auth.ENV_SECRET, None)
    if secrets.get(me) is not None:
        os.environ[_auth.ENV_SECRET] = secrets[me]
    try:
        rpc.init_rpc(f"worker{me}")
    except DistRuntimeError as e:
        return str(e)
    out = rpc.rpc_sync(f"worker{1 - me}", max, args=(me, 7))
    rpc.shutdown()
    return f"OK {out}"


@pytest.mark.parametrize("secrets", [{0: SECRET, 1: SECRET}, {0: SECRET, 1: SECRET + " but another"},
                                     {0: SECRET, 1: None}], ids=["same", "different", "one-without"])
def test_sim_members_must_share_one_secret_as_on_tensorpipe(secrets: dict) -> None:
    """The simulator's transport behaves as TensorPipe's does when the members' environments disagree."""
    world = simulator.World(2, env={"TENSORPLAY_TEST_PER_RANK_ENV": "1"})  # each rank gets its own os.environ
    world.run(lambda: _init_with(secrets))
    outs = world.results
    if secrets[0] == secrets[1]:
        assert outs == ["OK 7", "OK 7"], outs
        return
    for r, line in enumerate(outs):
        assert "do not share one RPC secret" in line and "ranks_by_secret=[[0], [1]]" in line, (r, line)
        assert f"set the same {_auth.ENV_SECRET}" in line and f"(worker 'worker{r}')" in line, line


# ---------------------------------------------------------------------------
# TensorPipe, with a real attacker process
# ---------------------------------------------------------------------------
def _record_refusals() -> None:
    """worker1: keep the auth logger's lines in memory, to show the worker logged the refusals."""
    from tensorplay.distributed.rpc import _auth as auth

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            _KEPT.append(record.getMessage())

    auth.logger.addHandler(_Keep())


_KEPT: list[str] = []


def _refusals() -> tuple[list[str], int]:
    from tensorplay.distributed.rpc import _auth as auth

    a = auth.tensorpipe_authenticator()
    return list(_KEPT), (a.refused if a is not None else -1)


def _member_calls(side: str) -> dict:
    """worker0: an ordinary call, then a sealed message sent twice by hand (the second is a replay)."""
    import torch.distributed.rpc as trpc
    from torch._C._distributed_rpc import _invoke_rpc_python_udf
    from torch.distributed.rpc.internal import PythonUDF, _internal_rpc_pickler

    n = rpc.rpc_sync("worker1", _append_line, args=(side, "member"))
    data, tensors = _internal_rpc_pickler.serialize(PythonUDF(_append_line, (side, "sealed"), {}))
    dst = trpc.get_worker_info("worker1")
    first = _invoke_rpc_python_udf(dst, data, tensors, 10.0, False).wait()
    try:
        _invoke_rpc_python_udf(dst, data, tensors, 10.0, False).wait()
        replay = "ran"
    except Exception as e:  # noqa: BLE001
        replay = str(e)
    return {"member": n, "first": first, "replay": replay, "data": data}


def _attack(port: int, side: Path, replay: Path | None = None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORPLAY_RPC_SECRET")}
    cmd = [sys.executable, str(ATTACKER), str(port), "worker1", str(side)] + ([str(replay)] if replay else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("RAN", "REFUSED"))]
    assert out.returncode == 0 and lines, out.stdout + out.stderr[-3000:]
    return lines


@pytest.mark.gloo
@pytest.mark.xdist_group("rpc-auth")
def test_tensorpipe_attacker_without_the_secret_runs_nothing(tmp_path: Path) -> None:
    from tensorplay.testing import RpcPool

    side, member_side, captured = tmp_path / "pwned", tmp_path / "member", tmp_path / "captured.bin"
    with RpcPool(2, rpc_timeout=10.0, call_timeout=60.0) as pool:
        assert pool.secret is not None and pool.port is not None
        pool.run_on(1, _record_refusals)
        calls = pool.run_on(0, _member_calls, str(member_side))
        assert calls["member"] == 1 and calls["first"] == 2
        assert _auth.REFUSAL in calls["replay"], calls["replay"]  # a member cannot replay either
        captured.write_bytes(calls["data"])

        lines = _attack(pool.port, side, captured)
        assert len(lines) == 2 and all(ln.startswith("REFUSED") for ln in lines), lines
        assert all(_auth.REFUSAL in ln for ln in lines), lines
        assert not side.exists(), "the attacker's os.system ran on the worker"
        assert _lines(member_side) == ["member", "sealed"], "a captured message ran again"

        kept, refused = pool.run_on(1, _refusals)
        assert refused == 3, (refused, kept)  # the member's replay, the attacker's call, its replay
        assert sum("replayed" in m for m in kept) == 2 and sum("no authentication envelope" in m for m in kept) == 1
        # the log line names the peers connected to the worker's listener (the attacker's among them)
        attack_line = next(m for m in kept if "no authentication envelope" in m)
        assert re.search(r"TensorPipe listener uv://127\.0\.0\.1:\d+ .*: 127\.0\.0\.1:\d+", attack_line), attack_line
        # the members still work after all that
        assert pool.run_on(0, rpc.rpc_sync, "worker1", _append_line, args=(str(member_side), "after")) == 3


@pytest.mark.slow  # a control of the attacker itself (about 20 s): run with -m slow
@pytest.mark.gloo
@pytest.mark.xdist_group("rpc-auth")
def test_tensorpipe_attacker_gets_in_without_authentication(tmp_path: Path) -> None:
    """The control: the same attacker against a world started without a secret (as torch's own) runs its command,
    so the refusal above is the authentication's doing, not a broken attacker."""
    from tensorplay.testing import RpcPool

    side = tmp_path / "pwned"
    with RpcPool(2, rpc_timeout=10.0, call_timeout=60.0, authenticate=False) as pool:
        assert pool.secret is None
        pool.run_on(0, rpc.rpc_sync, "worker1", _append_line, args=(str(tmp_path / "m"), "member"))
        lines = _attack(pool.port, side)
    assert lines == ["RAN 0"] and side.exists()


def _members(secrets: list[str | None], timeout: float = 4.0) -> list[str]:
    """Start one member process per secret (``None``: no secret) in one world; each one's report line."""
    from tensorplay.testing import free_port

    port = free_port()
    procs = []
    for rank, secret in enumerate(secrets):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORPLAY_RPC_SECRET")}
        if secret is not None:
            env[_auth.ENV_SECRET] = secret
        procs.append(subprocess.Popen([sys.executable, str(MEMBER), str(rank), str(len(secrets)), str(port),
                                       str(timeout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=env, cwd=ROOT))
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        lines = [ln for ln in out.splitlines() if ln.startswith(("OK", "ERR"))]
        assert lines, out + err[-3000:]
        outs.append(lines[-1])
    return outs


@pytest.mark.gloo
@pytest.mark.xdist_group("rpc-auth")
@pytest.mark.parametrize("secrets", [
    # "same" is what every authenticated RpcPool test does already; both run with -m slow (about 20 s each)
    pytest.param([SECRET, SECRET], id="same", marks=pytest.mark.slow),
    pytest.param([SECRET, SECRET + " but another"], id="different"),
    pytest.param([SECRET, None], id="one-without", marks=pytest.mark.slow),
])
def test_members_must_share_one_secret(secrets: list) -> None:
    """Members with the same secret work; a member with another secret, or none, makes start-up fail on
    every member (bounded by rpc_timeout) with an error that says so and how to fix it."""
    outs = _members(secrets)
    if secrets[0] == secrets[1]:
        assert outs == ["OK 7", "OK 7"], outs
        return
    for line in outs:
        assert line.startswith("ERR DistRuntimeError") and "do not share one RPC secret" in line, outs
        assert f"set the same {_auth.ENV_SECRET}" in line, line


# ---------------------------------------------------------------------------
# process-isolated simulated ranks (every message through the coordinator)
# ---------------------------------------------------------------------------
def _process_rank_rpc(side: str) -> tuple[list, bool, bool]:
    """A rank process of a world whose program sets no secret: its worker listens on no port (its messages go
    through its own socket to the coordinator), seals what it sends, and the run's secret is not in its
    environment."""
    from _support.net import listening
    from simulator.isolation import rpc_process

    rpc.init_rpc(f"worker{dist.get_rank()}")
    leaked = _auth.ENV_SECRET in os.environ
    sealed = isinstance(_agent.current(), rpc_process.ProcAgent) and _agent.current().auth is not None
    if dist.get_rank() == 0:
        assert rpc.rpc_sync("worker1", _append_line, args=(side + ".member", "member")) == 1  # members work
    sockets = listening()
    rpc.shutdown()
    return sockets, leaked, sealed


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp (Linux)")
def test_process_ranks_rpc_is_authenticated_and_listens_nowhere(tmp_path: Path, monkeypatch) -> None:
    """RPC between rank processes has nothing a local attacker can reach: no worker listens on a port (a
    TensorPipe agent would, and its rendezvous store names the address); every message is sealed under the run's
    secret anyway, which is not left in the rank processes' environment."""
    monkeypatch.delenv(_auth.ENV_SECRET, raising=False)
    monkeypatch.delenv(_auth.ENV_SECRET_FILE, raising=False)
    side = tmp_path / "side"
    outs = simulator.run(_process_rank_rpc, 2, args=(str(side),), isolation="process", timeout=120)
    for rank, (sockets, leaked, sealed) in enumerate(outs):
        assert sockets == [] and not leaked and sealed, (rank, sockets, leaked, sealed)
    assert _lines(tmp_path / "side.member") == ["member"]
