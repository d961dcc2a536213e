"""The real transport: torch.distributed.rpc's TensorPipe agent, made to fail clearly and stay local.

What this module adds on top of torch:

* **Loopback by default.**  The rendezvous store is bound to the address in
  ``init_method`` (torch's TCP store listens on every interface), and when
  that address is a loopback one TensorPipe and gloo are pinned to the
  loopback interface (``TP_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME``, unless
  already set).  Without ``init_method``, ``MASTER_ADDR`` defaults to
  ``127.0.0.1``.
* **Bounded waits.**  The rendezvous waits ``rpc_timeout`` at most; a call to
  a worker known to be dead fails at once; :meth:`TensorPipeAgent.shutdown`
  first runs its own bounded barrier and only does torch's graceful shutdown
  when every worker arrived (torch's waits forever for a dead peer).
* **Errors with their type.**  Remote exceptions come back unchanged (see
  :mod:`._call`); transport failures become :class:`WorkerUnavailableError`,
  :class:`RpcTimeoutError` or :class:`RpcError` naming the call and the peer.
"""
from __future__ import annotations

import ipaddress
import os
import pickle
import re
import socket
import threading
import time
import warnings
from datetime import timedelta
from typing import Any, Callable
from urllib.parse import parse_qs, urlencode, urlparse, urlunparse

import torch.distributed as tdist
import torch.distributed.rpc as trpc

from ..errors import DistError, DistRuntimeError, DistValueError
from . import _auth
from ._agent import Agent
from ._call import PickledFunction, RemoteFailure, is_async, run_call, run_call_async, unwrap
from .._rendezvous import bound_tcp_store
from .errors import RpcError, RpcTimeoutError, WorkerUnavailableError, rpc_message
from .futures import Future
from .rref import RRef
from .worker import WorkerInfo

__all__ = ["TensorPipeAgent", "start", "SCHEME", "loopback_interface", "is_loopback"]

#: our rendezvous scheme: like ``tcp://`` but the store binds only the given address, and waits are bounded
SCHEME = "tensorplay-tcp"

_PICKLE_ERRORS = (pickle.PicklingError, AttributeError, TypeError)
_DEAD_PATTERNS = re.compile(
    r"EOF|end of file|pipe closed|connection reset|connection refused|ECONNREFUSED|ECONNRESET|broken pipe|"
    r"EPIPE|shut ?down|closed|unreachable|no route",
    re.IGNORECASE,
)
_TIMEOUT_PATTERNS = re.compile(r"timeout|timed out|ran for more than", re.IGNORECASE)


# ---------------------------------------------------------------------------
# loopback-only rendezvous
# ---------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_interface() -> str:
    """Name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    try:
        for _, name in socket.if_nameindex():
            if name.startswith("lo"):
                return name
    except OSError:  # pragma: no cover  platforms without if_nameindex
        pass
    return "lo"


def _store_rendezvous(url: str, timeout: timedelta = timedelta(seconds=60), **_: Any):
    """Rendezvous handler for ``tensorplay-tcp://host:port?rank=&world_size=&timeout_s=``.

    Rank 0 hosts the TCP store on a socket it binds to ``host`` itself (torch's
    store would listen on all interfaces); every wait is bounded by ``timeout_s``.
    """
    u = urlparse(url)
    q = {k: v[0] for k, v in parse_qs(u.query).items()}
    rank, world_size = int(q["rank"]), int(q["world_size"])
    if "timeout_s" in q:
        timeout = timedelta(seconds=float(q["timeout_s"]))
    host, port = u.hostname or "127.0.0.1", u.port
    if port is None:
        raise DistValueError(rpc_message("init_rpc", "init_method has no port", values={"init_method": url},
                                         fix="write init_method='tcp://127.0.0.1:<port>'"))
    store = bound_tcp_store(host, port, rank, world_size, timeout, caller="init_rpc")
    # Everyone arrives here before torch's agent starts: its internal gloo group would otherwise
    # wait for a missing worker for DEFAULT_PROCESS_GROUP_TIMEOUT (24 days).
    keys = [f"tensorplay-rpc-arrived/{r}" for r in range(world_size)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, timeout)
    except Exception as e:  # noqa: BLE001
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise DistRuntimeError(rpc_message(
            "init_rpc", "not every worker arrived at the rendezvous in time",
            values={"rank": rank, "world_size": world_size, "missing_ranks": missing,
                    "timeout_s": timeout.total_seconds()},
            fix="start every worker with the same init_method and world_size, or raise rpc_timeout")) from e
    yield (store, rank, world_size)
    raise RuntimeError("tensorplay-tcp:// rendezvous cannot re-rendezvous")


def _register_scheme() -> None:
    try:
        tdist.register_rendezvous_handler(SCHEME, _store_rendezvous)
    except RuntimeError:  # already registered (module re-imported)
        pass


_register_scheme()


def _init_method(options: Any, timeout_s: float) -> tuple[str, str]:
    """Our ``tensorplay-tcp://`` URL for the options' ``init_method``, and the host it names."""
    url = options.init_method
    u = urlparse(url)
    if u.scheme == "env":
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = os.environ.get("MASTER_PORT")
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return url, host  # under torchrun: join the store its agent already serves there
        if not port:
            raise DistValueError(rpc_message(
                "init_rpc", "no rendezvous port: MASTER_PORT is not set and no init_method was given",
                values={"MASTER_ADDR": host}, fix="set MASTER_PORT, or pass "
                "rpc_backend_options=TensorPipeRpcBackendOptions(init_method='tcp://127.0.0.1:<port>')"))
        u = urlparse(f"tcp://{host}:{port}")
    if u.scheme not in ("tcp", SCHEME):
        return url, ""  # file:// and friends: torch's own handler
    q = {k: v[0] for k, v in parse_qs(u.query).items()}
    q.setdefault("timeout_s", str(timeout_s))
    new = urlunparse((SCHEME, u.netloc, u.path, "", urlencode(q), ""))
    return new, u.hostname or ""


# ---------------------------------------------------------------------------
# the transport (see tensorplay.distributed.rpc._agent.Transport)
# ---------------------------------------------------------------------------
WHERE = "in a process of its own"
USAGE = "start each worker as a process with init_rpc(name, rank=..., world_size=...) and a rendezvous"


def claims_caller() -> bool:
    """TensorPipe is the default transport: it serves whoever no other transport claims."""
    return False


def default_rank_and_size() -> tuple[int, int | None]:
    """``RANK`` and ``WORLD_SIZE`` from the environment (as torchrun sets them)."""
    size = os.environ.get("WORLD_SIZE")
    return int(os.environ.get("RANK", "-1")), (int(size) if size else None)


# ---------------------------------------------------------------------------
# starting the agent
# ---------------------------------------------------------------------------
def start(name: str, rank: int, world_size: int, options: Any, timeout_s: float = 60.0, *,
          default_timeout: float | None = None) -> "TensorPipeAgent":
    """Rendezvous on loopback (unless configured otherwise) and start torch's TensorPipe agent.

    ``default_timeout`` (or ``timeout_s``) is the per-call timeout when ``options`` is ``None``.
    With ``TENSORPLAY_RPC_SECRET``/``_FILE`` set, the world is authenticated (:mod:`._auth`).
    """
    if default_timeout is not None:
        timeout_s = default_timeout
    if options is None:
        options = trpc.TensorPipeRpcBackendOptions(rpc_timeout=timeout_s, _transports=["uv"])
    elif not isinstance(options, trpc.TensorPipeRpcBackendOptions):
        from ..errors import DistTypeError

        raise DistTypeError(rpc_message(
            "init_rpc", "rpc_backend_options must be a TensorPipeRpcBackendOptions",
            values={"rpc_backend_options": type(options).__name__},
            fix="build it with tensorplay.distributed.rpc.TensorPipeRpcBackendOptions(...)"))
    if not options.rpc_timeout or options.rpc_timeout <= 0:
        raise DistValueError(rpc_message(
            "init_rpc", "rpc_timeout must be a positive number of seconds (every call is bounded)",
            values={"rpc_timeout": options.rpc_timeout}, fix="pass rpc_timeout=60 (the default)"))
    url, host = _init_method(options, options.rpc_timeout)
    options.init_method = url
    if host and is_loopback(host):
        lo = loopback_interface()
        os.environ.setdefault("TP_SOCKET_IFNAME", lo)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    try:
        import numpy  # noqa: F401  torch's init exchanges device maps with all_gather_object
    except ImportError as e:  # pragma: no cover
        raise DistRuntimeError(rpc_message("init_rpc", "the TensorPipe agent needs numpy", fix="pip install numpy")) from e
    secret = _auth.load_secret("init_rpc")  # before any communication: a bad secret file fails here
    auth = _auth.Authenticator(secret) if secret is not None else None
    if auth is not None:  # every Python payload of this process's agent is sealed and checked from now on
        _auth.install_tensorpipe(auth)
    with warnings.catch_warnings():
        # torch's agent uses a bare ProcessGroupGloo internally and warns about it
        warnings.filterwarnings("ignore", message=".*as a ProcessGroup.*")
        try:
            trpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=options)
        except DistError:  # ours (the rendezvous), already explained
            _auth.uninstall_tensorpipe()
            raise
        except Exception as e:
            _auth.uninstall_tensorpipe()
            refused_here = auth.refused if auth is not None else 0
            if _auth.REFUSAL in str(e) or refused_here:
                # members that do not share one secret refuse each other's start-up messages
                raise DistRuntimeError(rpc_message(
                    "init_rpc", "the workers do not share one RPC secret: "
                    + ("another worker refused this worker's messages" if _auth.REFUSAL in str(e)
                       else f"this worker refused {refused_here} unauthenticated message(s) during start-up"),
                    worker=name, values={"rank": rank, "authenticated_here": auth is not None},
                    fix=f"set the same {_auth.ENV_SECRET} (or {_auth.ENV_SECRET_FILE}) on every worker, "
                        f"or on none of them")) from e
            raise DistRuntimeError(rpc_message(
                "init_rpc", "the TensorPipe agent did not start", worker=name,
                values={"rank": rank, "world_size": world_size, "init_method": url, "error": f"{type(e).__name__}: {e}"},
                fix="check that every worker uses the same init_method and world_size, distinct ranks and names, "
                    "and that all of them start within rpc_timeout")) from e
    agent = TensorPipeAgent(name, rank, world_size, float(options.rpc_timeout))
    agent.auth = auth
    if auth is not None:
        _auth.set_tensorpipe_listen(_listen_address(name))
    return agent


def _listen_address(name: str) -> str | None:
    """This worker's TensorPipe address as torch's agent published it (``uv://127.0.0.1:port``), if readable."""
    try:
        raw = trpc.api._get_current_rpc_agent().store.get(f"addrs/{name}")
    except Exception:  # noqa: BLE001  only used to name peers in a log line
        return None
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)


def ready_barrier(agent: "TensorPipeAgent") -> None:
    """Return once every worker has finished init_rpc (bounded by the agent's timeout)."""
    try:
        trpc.api._all_gather(None, timeout=agent.timeout)
    except Exception as e:  # noqa: BLE001
        raise DistRuntimeError(rpc_message(
            "init_rpc", "not every worker finished starting in time", worker=agent.name,
            values={"timeout": agent.timeout, "error": f"{type(e).__name__}: {str(e)[:200]}"},
            fix="start every worker with the same world_size and rendezvous, within rpc_timeout")) from e


# ---------------------------------------------------------------------------
# the agent
# ---------------------------------------------------------------------------
class _TPRRef:
    """A torch RRef (PyRRef) behind our :class:`RRef` front."""

    __slots__ = ("r",)

    def __init__(self, r: Any) -> None:
        self.r = r

    def owner(self) -> WorkerInfo:
        wi = self.r.owner()
        return WorkerInfo(wi.name, wi.id)

    def here(self) -> str:
        a = _agent()
        return a.name if a is not None else "?"

    def is_owner(self) -> bool:
        return self.r.is_owner()

    def confirmed_by_owner(self) -> bool:
        return self.r.confirmed_by_owner()

    def ident(self) -> str:
        m = re.search(r"created_on=(\d+), local_id=(\d+)", repr(self.r))
        return f"{m.group(1)}:{m.group(2)}" if m else "?"

    def to_here(self, timeout: float | None) -> Any:
        a = _agent()
        t = a.timeout if (timeout is None and a is not None) else timeout
        try:
            v = self.r.to_here(t) if t is not None else self.r.to_here()
        except Exception as e:
            if a is None:
                raise
            raise a.translate("RRef.to_here", self.owner(), e, t) from e
        return unwrap(v)

    def local_value(self) -> Any:
        return unwrap(self.r.local_value())

    def reduce(self):
        return (_rebuild_tp_rref, (self.r,))


def _rebuild_tp_rref(r: Any) -> RRef[Any]:
    return RRef._wrap(_TPRRef(r))


def _agent() -> "TensorPipeAgent | None":
    from ._agent import current

    a = current()
    return a if isinstance(a, TensorPipeAgent) else None


# the graceful-shutdown barrier (state lives on the leader)
_barrier_lock = threading.Condition()
_barrier_arrived: dict[str, set[str]] = {}
_barrier_probed: dict[str, float] = {}
_barrier_answered: dict[str, int] = {}
_PROBE_EVERY_S = 0.5


def _ping() -> None:
    return None


def _probe(key: str, missing: list[str]) -> None:
    """Leader: ping workers that have not arrived; a dead one fails fast and stops being waited for."""
    now = time.monotonic()
    if now - _barrier_probed.get(key, 0.0) < _PROBE_EVERY_S:
        return
    _barrier_probed[key] = now
    a = _agent()
    if a is None:
        return
    for name in missing:
        if name in a.dead:
            continue
        try:
            trpc.rpc_async(name, _ping, timeout=2.0).add_done_callback(lambda f, n=name: _probed(f, n))
        except Exception:  # noqa: BLE001  refused at once: dead
            a.dead.add(name)


def _probed(fut: Any, name: str) -> None:
    try:
        fut.value()
    except Exception as e:  # noqa: BLE001
        a = _agent()
        if a is not None and _DEAD_PATTERNS.search(str(e)):
            a.dead.add(name)
            with _barrier_lock:
                _barrier_lock.notify_all()


def _barrier_arrive(key: str, name: str, expected: list[str], deadline_s: float) -> list[str]:
    """Runs on the leader: record ``name``, wait (bounded) for everyone alive, return who arrived."""
    end = time.monotonic() + deadline_s
    a = _agent()
    dead = a.dead if a is not None else set()
    with _barrier_lock:
        arrived = _barrier_arrived.setdefault(key, set())
        arrived.add(name)
        _barrier_lock.notify_all()
        try:
            while True:
                missing = [n for n in expected if n not in arrived and n not in dead]
                left = end - time.monotonic()
                if not missing or left <= 0:
                    break
                _probe(key, missing)
                _barrier_lock.wait(min(left, 0.25))
            return sorted(arrived)
        finally:
            _barrier_answered[key] = _barrier_answered.get(key, 0) + 1
            _barrier_lock.notify_all()


def _barrier_drain(key: str, limit_s: float = 2.0) -> None:
    """Leader: before stopping, let every follower's barrier call return (their answers must go out)."""
    end = time.monotonic() + limit_s
    with _barrier_lock:
        while _barrier_answered.get(key, 0) < len(_barrier_arrived.get(key, ())) and time.monotonic() < end:
            _barrier_lock.wait(0.05)
    time.sleep(0.05)  # the answers are written by TensorPipe's threads after the handlers return


class TensorPipeAgent(Agent):
    """This process's worker in a TensorPipe RPC world."""

    kind = "tensorpipe"
    per_thread = False
    _generation = 0

    def __init__(self, name: str, rank: int, world_size: int, timeout: float) -> None:
        self.name, self.rank, self.world_size, self.timeout = name, rank, world_size, timeout
        self.objects: dict[Any, Any] = {}
        self.dead: set[str] = set()
        #: the world's authenticator when it is authenticated (a secret in the environment), else None
        self.auth: _auth.Authenticator | None = None
        infos = trpc.api._get_current_rpc_agent().get_worker_infos()
        self._infos = sorted((WorkerInfo(w.name, w.id) for w in infos), key=lambda w: w.id)
        TensorPipeAgent._generation += 1
        self._generation = TensorPipeAgent._generation

    def worker_infos(self) -> list[WorkerInfo]:
        return list(self._infos)

    def ready(self) -> None:
        ready_barrier(self)

    def distributed_autograd(self) -> Any:
        """torch's own engine (``torch.distributed.autograd``), with our errors."""
        from ..autograd._torch import TorchAutograd

        return TorchAutograd(self.name)

    # -- errors -----------------------------------------------------------------
    def translate(self, call: str, dst: WorkerInfo, exc: BaseException, timeout: float | None) -> BaseException:
        """A torch transport error as one of ours, naming the call, both workers and the fix."""
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        values = {"to": dst.name, "rank": dst.id, "timeout": timeout, "torch": text[:300]}
        if _TIMEOUT_PATTERNS.search(text):
            return RpcTimeoutError(rpc_message(
                call, "the call did not finish within its timeout", worker=self.name, values=values,
                fix="raise timeout= (or rpc_timeout in init_rpc), or find out what blocks the callee"))
        if _DEAD_PATTERNS.search(text):
            self.dead.add(dst.name)
            return self._unavailable(call, dst, text)
        return RpcError(rpc_message(
            call, "the transport could not run the call", worker=self.name, values=values,
            fix="check that the function and its arguments are importable and picklable on the callee"))

    def _unavailable(self, call: str, dst: WorkerInfo, why: str = "it failed an earlier call") -> WorkerUnavailableError:
        return WorkerUnavailableError(rpc_message(
            call, "the destination worker is unavailable (its process died, it shut down, or it is unreachable)",
            worker=self.name, values={"to": dst.name, "rank": dst.id, "reason": why[:300]},
            fix="restart the world; a TensorPipe RPC world cannot replace a lost worker"))

    def _check(self, call: str, dst: WorkerInfo) -> None:
        if dst.name in self.dead:
            raise self._unavailable(call, dst)

    # -- calls ----------------------------------------------------------------
    def _send(self, call: str, dst: WorkerInfo, send: Callable[..., Any], fn: Callable[..., Any], args: tuple,
              kwargs: dict, timeout: float) -> Any:
        """``send`` (torch's rpc_sync, rpc_async or remote) of ``run_call(fn, ...)``, with our errors.

        A function that does not pickle by reference (a lambda, a local function) is retried once by value.
        """
        self._check(call, dst)
        # an @async_execution function answers when its future completes: torch's agent does that for a
        # function carrying the marker, so the callee runs it through run_call_async (which carries it)
        runner = run_call_async if is_async(fn) else run_call
        try:
            return send(dst.name, runner, args=(fn, args, kwargs), timeout=timeout)
        except _PICKLE_ERRORS as e:
            if type(fn) is PickledFunction or not _fn_unpicklable(fn):
                raise _unpicklable(call, self.name, e) from e
            return self._send(call, dst, send, PickledFunction(fn), args, kwargs, timeout)
        except RuntimeError as e:
            raise self.translate(call, dst, e, timeout) from e

    def call_sync(self, call: str, dst: WorkerInfo, fn: Callable[..., Any], args: tuple, kwargs: dict,
                  timeout: float) -> Any:
        return unwrap(self._send(call, dst, trpc.rpc_sync, fn, args, kwargs, timeout))

    def call_async(self, call: str, dst: WorkerInfo, fn: Callable[..., Any], args: tuple, kwargs: dict,
                   timeout: float) -> Future[Any]:
        tf = self._send(call, dst, trpc.rpc_async, fn, args, kwargs, timeout)
        fut: Future[Any] = Future(what=call)

        def done(tfut: Any) -> None:
            try:
                v = tfut.value()
            except Exception as e:  # noqa: BLE001  a transport failure
                fut.set_exception(self.translate(call, dst, e, timeout))
                return
            if type(v) is RemoteFailure:
                fut.set_exception(v.to_exception())
            else:
                fut.set_result(v)

        tf.add_done_callback(done)
        return fut

    def remote(self, dst: WorkerInfo, fn: Callable[..., Any], args: tuple, kwargs: dict,
               timeout: float) -> RRef[Any]:
        return RRef._wrap(_TPRRef(self._send("remote", dst, trpc.remote, fn, args, kwargs, timeout)))

    def local_rref(self, value: Any) -> RRef[Any]:
        return RRef._wrap(_TPRRef(trpc.RRef(value)))

    # -- shutdown -------------------------------------------------------------
    def shutdown(self, graceful: bool, timeout: float) -> None:
        """Graceful: a bounded barrier of all workers, then torch's graceful shutdown; else local at once.

        If some worker never reaches the barrier (dead, or still busy after
        ``timeout`` seconds), this worker shuts down locally and warns, naming
        the workers that did not arrive.
        """
        end = time.monotonic() + timeout
        missing: list[str] = []
        if graceful:
            missing = self._barrier(timeout)
            graceful = not missing
        error: BaseException | None = None
        if graceful:
            error = _bounded(lambda: trpc.shutdown(graceful=True, timeout=max(1.0, end - time.monotonic())),
                             max(1.0, end - time.monotonic()) + 2.0)
        else:
            error = _bounded(lambda: trpc.shutdown(graceful=False), 10.0)
        if missing:
            warnings.warn(rpc_message(
                "shutdown", "graceful shutdown skipped: some workers did not reach shutdown in time",
                worker=self.name, values={"missing": missing, "timeout": timeout},
                fix="shut down on every worker; a worker that died cannot take part"), RuntimeWarning, stacklevel=3)
        if self.auth is not None:
            _auth.uninstall_tensorpipe()
        if error is not None:
            warnings.warn(rpc_message(
                "shutdown", "the TensorPipe agent reported an error while stopping", worker=self.name,
                values={"error": f"{type(error).__name__}: {error}"[:400]}), RuntimeWarning, stacklevel=3)

    def _barrier(self, timeout: float) -> list[str]:
        """Every worker reports to the lowest live rank; returns the names that did not arrive."""
        names = [w.name for w in self._infos]
        alive = [w for w in self._infos if w.name not in self.dead]
        leader = alive[0]  # this worker at least is alive; the leader also releases the followers
        key = f"shutdown-{self._generation}"
        try:
            if leader.name == self.name:
                arrived = _barrier_arrive(key, self.name, names, timeout)
                if set(arrived) != set(names):  # no torch graceful shutdown follows: drain by hand
                    _barrier_drain(key)
            else:
                arrived = trpc.rpc_sync(leader.name, _barrier_arrive, args=(key, self.name, names, timeout),
                                        timeout=timeout + 5.0)
        except Exception:  # noqa: BLE001  the leader is gone or late: nobody can be waited for
            return [leader.name]
        return [n for n in names if n not in arrived]


def _unpicklable(call: str, worker: str, e: BaseException) -> BaseException:
    from ..errors import DistTypeError

    return DistTypeError(rpc_message(
        call, "the call's arguments cannot be serialised", worker=worker,
        values={"error": f"{type(e).__name__}: {e}"[:300]},
        fix="send tensors, numbers, strings, containers of them, and objects of importable classes"))


def _fn_unpicklable(fn: Any) -> bool:
    try:
        pickle.dumps(fn)
        return False
    except Exception:  # noqa: BLE001
        return True


def _bounded(fn: Callable[[], Any], timeout: float) -> BaseException | None:
    """Run ``fn`` in a daemon thread for at most ``timeout`` seconds; its exception, or a timeout error."""
    box: list[BaseException | None] = [None]

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            box[0] = e

    t = threading.Thread(target=target, name="tensorplay-rpc-shutdown", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        return RpcTimeoutError(f"torch's RPC shutdown still running after {timeout:.1f}s; left it behind")
    return box[0]
