"""A persistent TensorPipe RPC world on loopback, for tests and benchmarks.

:class:`RpcPool` starts ``world_size`` real processes once (a
:class:`~tensorplay.testing.RankPool`), initialises RPC in each as
``worker0``, ``worker1``, ... on ``127.0.0.1`` at a free port, and then runs
any number of functions on them.  Starting costs seconds (``import torch``);
a call on a warm pool costs milliseconds.  When a call fails (a rank raised or
died) the processes are restarted, and RPC re-initialised, on the next call.

Functions travel with dill: module-level functions of importable modules
(test modules included) go by reference.

The pool starts its members itself, so its world is authenticated by
default: it generates a secret for each world it starts (a restart gets a
fresh one, so no message of an earlier world is accepted by a later one;
:func:`tensorplay.distributed.rpc._auth.generate_secret`)
and gives it to each member through the pool's own pipe, which the member
puts in its environment (``TENSORPLAY_RPC_SECRET``) before ``init_rpc``; the
secret never passes through the rendezvous store.  ``authenticate=False``
starts an unauthenticated world (as torch's own).

Example::

    from tensorplay.testing import RpcPool

    def body():
        import torch, tensorplay.distributed.rpc as rpc
        return rpc.rpc_sync("worker1", torch.add, args=(torch.ones(2), 1))

    with RpcPool(2) as pool:
        print(pool.run_on(0, body))       # tensor([2., 2.])
"""
from __future__ import annotations

from typing import Any, Callable

from .pool import RankPool, free_port

__all__ = ["RpcPool"]


def _init_worker(name: str, rank: int, world_size: int, port: int, rpc_timeout: float,
                 secret: str | None = None) -> str:
    import os

    import tensorplay.distributed.rpc as rpc
    from tensorplay.distributed.rpc import _auth

    if rpc.is_initialized():
        rpc.shutdown(graceful=False)
    os.environ.pop(_auth.ENV_SECRET_FILE, None)
    if secret is None:
        os.environ.pop(_auth.ENV_SECRET, None)
    else:
        os.environ[_auth.ENV_SECRET] = secret
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=rpc_timeout,
                                           _transports=["uv"])
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=opts)
    return name


def _shutdown_worker(timeout: float) -> None:
    import tensorplay.distributed.rpc as rpc

    if rpc.is_initialized():
        rpc.shutdown(timeout=timeout)


def _on_rank(target: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    import tensorplay.distributed.rpc as rpc

    if rpc.get_worker_info().id != target:
        return None
    return fn(*args, **kwargs)


class RpcPool:
    """``world_size`` processes with an initialised TensorPipe RPC agent each (``worker0``...).

    Args:
        world_size: number of workers.
        rpc_timeout: the workers' default per-call timeout, seconds.
        call_timeout: bound on one :meth:`run`, seconds.
        authenticate: give the members a shared secret (generated for each world the pool starts unless
            ``secret`` is given), so only they can call each other; ``False`` for an unauthenticated world.
        secret: the secret to use (at least 16 characters) instead of a generated one.
    """

    def __init__(self, world_size: int, *, rpc_timeout: float = 20.0, call_timeout: float = 60.0,
                 authenticate: bool = True, secret: str | None = None) -> None:
        from ..distributed.rpc import _auth

        self.world_size = world_size
        self.rpc_timeout = rpc_timeout
        self._authenticate, self._fixed_secret = authenticate, secret
        #: the current world's shared secret (``None`` for an unauthenticated pool); keep it out of logs
        self.secret: str | None = (secret or _auth.generate_secret()) if authenticate else None
        self.pool = RankPool(world_size, call_timeout=call_timeout, pg_timeout=call_timeout)
        self._started_at_restart = -1
        #: the rendezvous port of the current world (its store is served by worker0 on 127.0.0.1)
        self.port: int | None = None

    def __enter__(self) -> "RpcPool":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def names(self) -> list[str]:
        return [f"worker{r}" for r in range(self.world_size)]

    def start(self) -> None:
        """Start the processes (if needed) and initialise RPC in them."""
        if self.pool.alive and self._started_at_restart == self.pool.restarts:
            return
        from ..distributed.rpc import _auth

        self.pool.start()
        if self._authenticate and self._fixed_secret is None:
            self.secret = _auth.generate_secret()
        port = free_port()
        self.pool.run_per_rank(_init_worker, [(f"worker{r}", r, self.world_size, port, self.rpc_timeout,
                                               self.secret) for r in range(self.world_size)])
        self.port = port
        self._started_at_restart = self.pool.restarts

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker; results in rank order."""
        self.start()
        return self.pool.run(fn, *args, timeout=timeout, **kwargs)

    def run_on(self, rank: int, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
               **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on worker ``rank`` only (the others stay idle, serving RPCs)."""
        self.start()
        return self.pool.run(_on_rank, rank, fn, args, kwargs, timeout=timeout)[rank]

    def kill(self, rank: int) -> None:
        """Kill worker ``rank``'s process (SIGKILL); the pool restarts after the next failing call."""
        self.pool._procs[rank].kill()
        self.pool._procs[rank].join(5.0)

    def close(self, timeout: float = 10.0) -> None:
        if self.pool.alive and self._started_at_restart == self.pool.restarts:
            try:
                self.pool.run(_shutdown_worker, timeout, timeout=timeout + 5.0)
            except Exception:  # noqa: BLE001  closing anyway
                pass
        self.pool.close()
