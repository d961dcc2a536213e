"""A persistent pool of real rank processes on loopback, for tests and the conformance suite.

Starting a rank costs seconds (``import torch``), so a :class:`RankPool`
starts its ``world_size`` processes once, initialises a process group in each
(gloo by default, rendezvous on 127.0.0.1 at a free port) and then runs any
number of functions on every rank.  Functions travel with ``dill`` (through
``multiprocess``), so module-level test functions and closures both work.

Every wait is bounded.  When a rank raises, or a call runs past its timeout,
the pool reports which ranks answered and what they said, then restarts its
processes before the next call (the survivors may be stuck inside a
collective the failed rank never joined).

Example::

    from tensorplay.testing import RankPool

    def body(x):
        import tensorplay.distributed as dist
        t = x + dist.get_rank()
        dist.all_reduce(t)
        return t

    with RankPool(2) as pool:
        print(pool.run(body, 1.0))        # [tensor(3.), tensor(3.)] in rank order
"""
from __future__ import annotations

import os
import time
import traceback
from typing import Any, Callable, Sequence

import multiprocess as mp

from ..distributed.errors import DistError, DistTimeoutError
from ._ports import _ephemeral_range, free_port  # noqa: F401  re-exported

__all__ = ["RankPool", "RankError", "free_port"]


class RankError(DistError, RuntimeError):
    """One or more pool ranks raised; carries each failing rank's exception type, message and traceback."""

    def __init__(self, message: str, failures: dict[int, tuple[str, str, str]]) -> None:
        super().__init__(message)
        self.failures = failures

    @property
    def ranks(self) -> list[int]:
        return sorted(self.failures)

    def exc_types(self) -> set[str]:
        return {t for t, _, _ in self.failures.values()}


def _worker(rank: int, world_size: int, port: int, backend: str, conn: Any, timeout_s: float) -> None:
    # Loopback only, one compute thread per rank (many ranks share 2 cores).
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
    )
    from datetime import timedelta

    import torch

    torch.set_num_threads(1)
    import tensorplay.distributed as dist

    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        conn.send(("ready", None))
    except BaseException as e:  # report and leave: the parent restarts the pool
        conn.send(("err", (type(e).__name__, str(e), traceback.format_exc())))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            result = fn(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException as e:  # noqa: BLE001  every failure goes back to the parent
            conn.send(("err", (type(e).__name__, str(e), traceback.format_exc())))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001  leaving anyway
        pass


class RankPool:
    """``world_size`` persistent rank processes with an initialised process group each.

    Args:
        world_size: number of ranks.
        backend: process-group backend the ranks initialise (``"gloo"``, or ``"nccl"`` with GPUs).
        start_timeout: seconds to wait for every rank to come up.
        call_timeout: default bound on one :meth:`run`.
        pg_timeout: the ranks' process-group timeout (a collective some rank skipped fails after it).
        process_name: rank processes are named ``<process_name><rank>``.
        context: a callable returning the ``multiprocess`` context to start ranks from (or ``None`` for the
            default, spawn); e.g. a forkserver that preloaded torch makes restarts cheap.
    """

    def __init__(self, world_size: int, backend: str = "gloo", *, start_timeout: float = 120.0,
                 call_timeout: float = 120.0, pg_timeout: float = 60.0, process_name: str = "tensorplay-rank",
                 context: Callable[[], Any] | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"RankPool: world_size={world_size} must be >= 1")
        self.process_name = process_name
        self._context_factory = context
        self.world_size = world_size
        self.backend = backend
        self.start_timeout = start_timeout
        self.call_timeout = call_timeout
        self.pg_timeout = pg_timeout
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self.restarts = 0

    # -- life cycle ----------------------------------------------------------
    def __enter__(self) -> "RankPool":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        if self.alive:
            return
        self.close()
        ctx = self._context()
        port = free_port()
        for r in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, self.world_size, port, self.backend, child, self.pg_timeout),
                            daemon=True, name=f"{self.process_name}{r}")
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        replies = self._collect(self.start_timeout, "start")
        failed = {r: v for r, (k, v) in replies.items() if k == "err"}
        if failed or len(replies) < self.world_size:
            self.close()
            raise self._failure("start", replies, failed, self.start_timeout)

    def _context(self) -> Any:
        """The multiprocess context rank processes start from (spawn, safe with threads and CUDA, by default)."""
        ctx = self._context_factory() if self._context_factory is not None else None
        return ctx if ctx is not None else mp.get_context("spawn")

    def kill(self) -> None:
        """Kill the rank processes at once (a hung gloo rank does not leave politely); the next call restarts."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(5.0)
        self.close()
        self.restarts += 1

    def close(self) -> None:
        for c in self._conns:
            try:
                c.send(None)
            except (OSError, ValueError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5.0)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []

    def restart(self) -> None:
        self.restarts += 1
        self.close()
        self.start()

    # -- running -----------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        return self.run_per_rank(fn, [args] * self.world_size, timeout=timeout, kwargs=kwargs)

    def run_per_rank(self, fn: Callable[..., Any], per_rank_args: Sequence[Sequence[Any]], *,
                     timeout: float | None = None, kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``fn(*per_rank_args[r], **kwargs)`` on rank ``r``; results in rank order."""
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"RankPool.run_per_rank: len(per_rank_args)={len(per_rank_args)} != "
                             f"world_size={self.world_size}")
        if not self.alive:
            self.start()
        timeout = self.call_timeout if timeout is None else timeout
        for conn, a in zip(self._conns, per_rank_args):
            conn.send((fn, tuple(a), kwargs or {}))
        replies = self._collect(timeout, getattr(fn, "__name__", "call"))
        failed = {r: v for r, (k, v) in replies.items() if k == "err"}
        if failed or len(replies) < self.world_size:
            err = self._failure(getattr(fn, "__name__", "call"), replies, failed, timeout)
            self.close()  # restarted lazily by the next call
            self.restarts += 1
            raise err
        return [replies[r][1] for r in range(self.world_size)]

    def gather(self, fn: Callable[..., Any], per_rank_args: Sequence[Sequence[Any]], *, timeout: float,
               grace: float = 2.0, is_failure: Callable[[tuple[str, Any]], bool] | None = None,
               ) -> tuple[dict[int, tuple[str, Any]], bool]:
        """Like :meth:`run_per_rank`, but return every reply that came instead of raising on a failure.

        Replies are ``("ok", value)`` or ``("err", (type name, message, traceback))`` by rank; ranks that did
        not answer are missing.  Waiting stops ``grace`` seconds after the first failed reply (``is_failure``
        decides; by default an ``"err"``), since the others are then most likely stuck waiting for that
        rank.  On an incomplete answer the ranks are killed at once and the next call starts fresh ones.
        Returns ``(replies, complete)``.
        """
        if not self.alive:
            self.start()
        for conn, a in zip(self._conns, per_rank_args):
            conn.send((fn, tuple(a), {}))
        replies = self._collect(timeout, getattr(fn, "__name__", "call"), grace=grace,
                                **({} if is_failure is None else {"is_failure": is_failure}))
        complete = len(replies) == self.world_size and not any(k == "err" for k, _ in replies.values())
        if not complete:
            self.kill()
        return replies, complete

    def _collect(self, timeout: float, what: str, *, grace: float = 2.0,
                 is_failure: Callable[[tuple[str, Any]], bool] = lambda reply: reply[0] == "err",
                 ) -> dict[int, tuple[str, Any]]:
        """Wait (bounded) for one reply per rank; after the first failure only ``grace`` seconds more."""
        replies: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self._conns))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready = mp.connection.wait(list(pending.values()), timeout=min(left, 0.5))
            for conn in ready:
                r = next(k for k, v in pending.items() if v is conn)
                try:
                    replies[r] = conn.recv()
                except (EOFError, OSError):
                    replies[r] = ("err", ("ProcessDied", f"rank {r} exited (code {self._procs[r].exitcode})", ""))
                del pending[r]
            for r in list(pending):
                if not self._procs[r].is_alive():
                    replies[r] = ("err", ("ProcessDied", f"rank {r} exited (code {self._procs[r].exitcode})", ""))
                    del pending[r]
            if pending and any(is_failure(v) for v in replies.values()):
                # survivors may wait forever on the failed rank: give them a moment, not more
                deadline = min(deadline, time.monotonic() + grace)
        return replies

    def _failure(self, what: str, replies: dict[int, tuple[str, Any]], failed: dict[int, Any],
                 timeout: float) -> DistError:
        missing = [r for r in range(self.world_size) if r not in replies]
        if failed:
            lines = [f"RankPool({self.world_size}, {self.backend!r}).{what}: rank(s) {sorted(failed)} raised"]
            for r, (tname, text, tb) in sorted(failed.items()):
                lines.append(f"--- rank {r}: {tname}: {text}\n{tb}")
            if missing:
                lines.append(f"ranks {missing} did not answer (probably waiting for the failed rank)")
            return RankError("\n".join(lines), failed)
        return DistTimeoutError(
            f"RankPool({self.world_size}, {self.backend!r}).{what}: no answer within timeout={timeout}s from ranks "
            f"{missing}; ranks {sorted(replies)} answered. Fix: look for a collective some ranks skipped, or raise "
            f"the timeout")

    def __repr__(self) -> str:
        return f"RankPool(world_size={self.world_size}, backend={self.backend!r}, alive={self.alive})"

