"""Authenticated RPC worlds: every message carries an HMAC under a secret only the members hold.

The secret never passes through the rendezvous store (which anyone on the
host who can reach its port may read and write).  Every member gets it from
its own environment:

* ``TENSORPLAY_RPC_SECRET`` - the secret itself (at least 16 characters), or
* ``TENSORPLAY_RPC_SECRET_FILE`` - a file holding it, readable by its owner
  only (a group- or world-readable file is refused).

Launchers that start the members themselves (:class:`tensorplay.testing.RpcPool`,
the simulator) generate one with :func:`generate_secret` when none is set.

A message on the wire is ``mac + header + payload`` where the header holds
a magic string, the sender's session id (random, one per agent), a counter
(one per message, per session) and the sender's wall-clock time; the mac is
keyed BLAKE2b-256 (a MAC by design, RFC 7693; in CPython it costs about a
third of HMAC-SHA256 on a small message) over header and payload, one
contiguous span so checking it copies nothing, under a key derived from the
secret with HMAC-SHA256.
:meth:`Authenticator.open` checks, in this order and *before anything of the
payload is unpickled*: the magic and length, the mac (constant-time compare),
the age of the message (``TENSORPLAY_RPC_AUTH_MAX_AGE`` seconds, default 300,
in either direction), and that this (session, counter) was never accepted
before (a sliding window per session).  A message failing any check is
refused with :class:`AuthenticationError` and logged on the logger
``tensorplay.distributed.rpc.auth``; the refusal says nothing about why.

Both transports call the same two methods: TensorPipe around torch's
Python-call pickler (:func:`install_tensorpipe`), the simulator around its
message codec.  See ``docs/rpc.md`` ("Trust model") for what this protects and
what it does not (payloads are not encrypted; tensor bytes sent out of band
are not covered; torch's C++-only messages on TensorPipe are not covered).
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import ipaddress
import secrets
import socket
import stat
import struct
import threading
import time
from typing import Any, Callable

from ..errors import DistValueError
from .errors import RpcError, rpc_message

__all__ = ["ENV_SECRET", "ENV_SECRET_FILE", "ENV_MAX_AGE", "AuthenticationError", "Authenticator", "load_secret",
           "generate_secret", "install_tensorpipe", "uninstall_tensorpipe", "HEADER_LEN", "logger"]

ENV_SECRET = "TENSORPLAY_RPC_SECRET"
ENV_SECRET_FILE = "TENSORPLAY_RPC_SECRET_FILE"
ENV_MAX_AGE = "TENSORPLAY_RPC_AUTH_MAX_AGE"
MIN_SECRET_LEN = 16

logger = logging.getLogger("tensorplay.distributed.rpc.auth")

_MAGIC = b"TPA1"
_HEADER = struct.Struct("!4s16sQd")  # magic, session, counter, sender's time.time()
_MAC_LEN = 32
HEADER_LEN = _HEADER.size + _MAC_LEN  # bytes an envelope adds to a message
#: counters a message may lag behind the newest accepted from its session (delivery out of order across pipes and
#: handler threads) before it is refused as too old; the receiver keeps at most 2x this many counters per session
#: (about 2 MB per peer at worst)
_WINDOW = 1 << 14
#: the text an unauthenticated peer gets back: nothing about the world, nothing about what failed
REFUSAL = "tensorplay.distributed.rpc: message refused: this RPC world requires authentication"


class AuthenticationError(RpcError):
    """A message was not authenticated for this RPC world (no envelope, a wrong mac, too old, or replayed)."""


def generate_secret() -> str:
    """A fresh random secret (64 hex characters) for a launcher to give every member it starts."""
    return secrets.token_hex(32)


def load_secret(call: str = "init_rpc", environ: "os._Environ[str] | dict[str, str] | None" = None) -> bytes | None:
    """The world's secret from the environment, ``None`` when neither variable is set.

    Raises a clear error for a secret that is too short, for both variables set at
    once, and for a secret file that is missing, empty or readable by others.
    """
    env = os.environ if environ is None else environ
    value, path = env.get(ENV_SECRET), env.get(ENV_SECRET_FILE)
    gen = 'python -c "import secrets; print(secrets.token_hex(32))"'
    if value is not None and path is not None:
        raise DistValueError(rpc_message(
            call, f"both {ENV_SECRET} and {ENV_SECRET_FILE} are set", values={ENV_SECRET_FILE: path},
            fix=f"set only one of them on every member"))
    if path is not None:
        try:
            st = os.stat(path)
        except OSError as e:
            raise DistValueError(rpc_message(
                call, f"the RPC secret file {path} cannot be read", values={"path": path, "error": f"{type(e).__name__}: {e}"},
                fix=f"write the secret to that file ({gen} > {path}; chmod 600 {path}) or unset {ENV_SECRET_FILE}")) from e
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise DistValueError(rpc_message(
                call, f"the RPC secret file {path} is readable or writable by others than its owner "
                  f"(mode {oct(mode)})", values={"path": path, "mode": oct(mode)}, fix=f"run `chmod 600 {path}`"))
        with open(path, "rb") as f:
            secret = f.read().strip()
        where = f"{ENV_SECRET_FILE}={path}"
    elif value is not None:
        secret = value.strip().encode()
        where = ENV_SECRET
    else:
        return None
    if len(secret) < MIN_SECRET_LEN:
        raise DistValueError(rpc_message(
            call, f"the RPC secret is too short (at least {MIN_SECRET_LEN} characters)",
            values={"source": where, "length": len(secret)}, fix=f"generate one with {gen}"))
    return secret


def _max_age() -> float:
    raw = os.environ.get(ENV_MAX_AGE, "300")
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not v > 0:
        raise DistValueError(rpc_message("init_rpc", f"{ENV_MAX_AGE} must be a positive number of seconds",
                                         values={ENV_MAX_AGE: raw}, fix=f"unset it or set e.g. {ENV_MAX_AGE}=300"))
    return v


class _Window:
    """The counters accepted from one session: the newest, and which of the last ``_WINDOW`` were seen."""

    __slots__ = ("high", "seen", "last")

    def __init__(self) -> None:
        self.high = 0
        self.seen: set[int] = set()
        self.last = 0.0

    def accept(self, n: int, now: float) -> bool:
        if n <= self.high - _WINDOW or n in self.seen:
            return False
        self.seen.add(n)
        if n > self.high:
            self.high = n
            if len(self.seen) > 2 * _WINDOW:  # forget what the window no longer needs
                floor = self.high - _WINDOW
                self.seen = {c for c in self.seen if c > floor}
        self.last = now
        return True


class Authenticator:
    """One agent's end of an authenticated world: seals what it sends, opens (checks) what it receives.

    Args:
        secret: the world's shared secret (from :func:`load_secret` or :func:`generate_secret`).
        max_age_s: how old (or how far in the future) a message may be; ``None`` reads
            ``TENSORPLAY_RPC_AUTH_MAX_AGE`` (default 300 s).  Members' clocks must agree this well.
    """

    def __init__(self, secret: bytes | str, max_age_s: float | None = None) -> None:
        if isinstance(secret, str):
            secret = secret.encode()
        # a key for this purpose only: the secret itself is never used directly as a mac key
        self._key = hmac.new(secret, b"tensorplay.distributed.rpc message v1", hashlib.sha256).digest()
        self.session = secrets.token_bytes(16)
        self.max_age_s = _max_age() if max_age_s is None else float(max_age_s)
        self._counter = itertools.count(1)  # next() on it is atomic under the GIL: no lock to seal
        self._lock = threading.Lock()
        self._windows: dict[bytes, _Window] = {}
        self.refused = 0

    def _mac(self, body: bytes | memoryview) -> bytes:
        return hashlib.blake2b(body, key=self._key, digest_size=_MAC_LEN).digest()

    def same_key(self, other: "Authenticator") -> bool:
        """Whether ``other`` seals under the same secret (constant-time)."""
        return hmac.compare_digest(self._key, other._key)

    def seal(self, payload: bytes) -> bytes:
        """``payload`` in an envelope only members can produce, usable once."""
        body = _HEADER.pack(_MAGIC, self.session, next(self._counter), time.time()) + payload
        return self._mac(body) + body

    def open(self, data: bytes, peer: "str | Callable[[], str]" = "unknown peer") -> memoryview:
        """The payload of a sealed message; :class:`AuthenticationError` (logged) if it is not authentic.

        ``peer`` names the sender for the log line (a callable is asked only when a message is refused).
        Nothing of ``data`` is interpreted beyond the fixed-size header before the mac is verified.
        """
        view = memoryview(data)
        if len(view) < HEADER_LEN or view[_MAC_LEN:_MAC_LEN + 4] != _MAGIC:
            self._refuse(peer, "no authentication envelope (a peer without the world's secret)")
        body = view[_MAC_LEN:]
        if not hmac.compare_digest(view[:_MAC_LEN], self._mac(body)):
            self._refuse(peer, "wrong message authentication code (a different secret, or an altered message)")
        _, session, n, sent = _HEADER.unpack_from(body)
        payload = view[HEADER_LEN:]
        now = time.time()
        if abs(now - sent) > self.max_age_s:
            self._refuse(peer, f"message is {now - sent:.1f}s old, more than {ENV_MAX_AGE}={self.max_age_s:g}s "
                               f"(a replay, or clocks that disagree)")
        with self._lock:
            w = self._windows.get(session)
            if w is None:
                self._forget(now)
                w = self._windows[session] = _Window()
            ok = w.accept(n, now)
        if not ok:
            self._refuse(peer, f"replayed message (session {session.hex()[:8]}, counter {n} already accepted "
                               f"or too far behind)")
        return payload

    def _forget(self, now: float) -> None:
        """Drop sessions idle for longer than the maximum age: any replay of theirs is refused as too old."""
        if len(self._windows) < 64:
            return
        for s in [s for s, w in self._windows.items() if now - w.last > self.max_age_s + 1.0]:
            del self._windows[s]

    def _refuse(self, peer: "str | Callable[[], str]", why: str) -> None:
        self.refused += 1
        if callable(peer):
            try:
                peer = peer()
            except Exception as e:  # noqa: BLE001  naming the peer must never hide the refusal
                peer = f"an unknown peer ({type(e).__name__} while looking it up)"
        logger.warning("refused an RPC message from %s: %s", peer, why)
        raise AuthenticationError(REFUSAL)


# ---------------------------------------------------------------------------
# TensorPipe: around torch's pickler for Python calls, answers and RRef values
# ---------------------------------------------------------------------------
_tp_lock = threading.Lock()
_tp_installed: Authenticator | None = None
_tp_peers: "_TensorPipePeers | None" = None
def _decode_endpoint(hexaddr: str) -> str:
    """``/proc/net/tcp*``'s ``0100007F:1F90`` as ``127.0.0.1:8080`` (IPv4 or IPv6, host byte order per word)."""
    addr, port = hexaddr.split(":")
    raw = bytes.fromhex(addr)
    # the kernel prints each 32-bit word in host order (little-endian here): reverse within each word
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)) if socket.htonl(1) != 1 else raw
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"{ip}:{int(port, 16)}" if ip.version == 4 else f"[{ip}]:{int(port, 16)}"


def connections_to(port: int) -> list[str]:
    """Remote endpoints of this host's established TCP connections whose local port is ``port``, newest
    socket last (Linux ``/proc``; empty elsewhere)."""
    found: list[tuple[int, str]] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10 or parts[3] != "01":  # 01: ESTABLISHED
                continue
            if int(parts[1].rsplit(":", 1)[1], 16) != port:
                continue
            found.append((int(parts[9]), _decode_endpoint(parts[2])))
    return [ep for _, ep in sorted(found)]  # inode order: roughly creation order


class _TensorPipePeers:
    """Names the possible senders of a refused TensorPipe message.

    torch's agent does not tell Python which connection a message came from, so the log line lists the
    connections open to this worker's TensorPipe listener at that moment (the sender's is among them;
    connections from members are there too).  Looked up only when a message is refused.
    """

    def __init__(self, listen: str | None) -> None:
        self.listen: str | None = None
        self.port: int | None = None
        self.set(listen)

    def set(self, listen: str | None) -> None:
        """This worker's TensorPipe address (known once the agent started)."""
        self.listen = listen
        try:
            self.port = int(listen.rsplit(":", 1)[1]) if listen else None
        except ValueError:
            self.port = None

    def __call__(self) -> str:
        if self.port is None:
            return "an unknown TensorPipe peer (this worker's listening address is unknown)"
        peers = connections_to(self.port)
        return (f"one of the peers connected to this worker's TensorPipe listener {self.listen} "
                f"(torch does not tell which connection carried the message): {', '.join(peers) or 'none found'}")


def install_tensorpipe(auth: Authenticator, listen: str | None = None) -> None:
    """Seal every payload torch's RPC pickles in this process and refuse every unsealed one it would unpickle.

    torch's agent hands each Python payload (a call of a Python function, its answer, an
    RRef's value) to ``torch.distributed.rpc.internal._internal_rpc_pickler``; its
    ``deserialize`` is replaced by one that checks the envelope before the original
    unpickles anything, and its ``serialize`` by one that seals.  ``listen`` is this worker's TensorPipe
    address (``uv://127.0.0.1:port``), named with the connected peers in the log line of a refusal.
    """
    global _tp_installed
    from torch.distributed.rpc import internal

    global _tp_peers
    p = internal._internal_rpc_pickler
    cls = type(p)
    peers = _tp_peers = _TensorPipePeers(listen)
    ser: Callable[[Any], Any] = cls.serialize.__get__(p)
    deser: Callable[[Any, Any], Any] = cls.deserialize.__get__(p)

    def serialize(obj: Any) -> tuple[bytes, list]:
        data, tensors = ser(obj)
        return auth.seal(data), tensors

    def deserialize(binary_data: bytes, tensor_table: list) -> Any:
        payload = auth.open(binary_data, peers)  # raises before a byte of the payload is unpickled
        return deser(payload, tensor_table)

    with _tp_lock:
        p.serialize = serialize  # instance attributes shadow the class's methods
        p.deserialize = deserialize
        _tp_installed = auth


def uninstall_tensorpipe() -> None:
    """Back to torch's own pickling (the agent stopped)."""
    global _tp_installed
    from torch.distributed.rpc import internal

    p = internal._internal_rpc_pickler
    with _tp_lock:
        for name in ("serialize", "deserialize"):
            p.__dict__.pop(name, None)
        _tp_installed = None


def set_tensorpipe_listen(listen: str | None) -> None:
    """Tell the installed check this worker's TensorPipe address, to name the connected peers on a refusal."""
    if _tp_peers is not None:
        _tp_peers.set(listen)


def tensorpipe_authenticator() -> Authenticator | None:
    """The authenticator installed on this process's TensorPipe agent, if any."""
    return _tp_installed
