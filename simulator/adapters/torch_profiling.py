"""What a real backend shows torch's profiler: one asynchronous event per process-group operation.

ProcessGroupGloo (and NCCL, MPI, UCC) opens a ``RecordFunction`` named ``"<backend>:<operation>"`` (``gloo:all_reduce``,
``gloo:broadcast``, ``gloo:send``...) when an operation is issued, with the operation's input tensors as its inputs
(``record_shapes=True`` shows their shapes), and closes it from its worker thread when the operation completes, so
the profiler marks the event asynchronous.  Programs and torch's own tests look for those events
(``distributed_test.py``'s ``call_dist_op`` counts them and checks their shapes).  The simulated process group does
the same while a profiler is on: :func:`issued` opens the event, :func:`completed` closes it on a thread of its own.

Thread ranks share one profiler (one per process): each rank's profiler would record every rank's operations, and
a second rank's start or stop crashes the process (a segmentation fault in torch's ``_disable_profiler``).  While a
world runs, :func:`enabled` makes a profiler started on one of several thread ranks fail at once, naming the fix
(rank processes, which have a profiler each); PyTorch's test harness names its own fix and runs the test again on
rank processes (:data:`harness_refusal`).

The private torch names it reads are listed in :mod:`simulator.adapters.torch_private`.
"""
from __future__ import annotations

import _thread
import contextlib
import os
import queue
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.autograd.profiler as autograd_profiler

from tensorplay.distributed.errors import format_message

from simulator.adapters._patch import Installation, replace
from simulator.core._actor import current_rank_state
from simulator.core.errors import SimError

__all__ = ["TITLES", "issued", "completed", "enabled", "harness_refusal"]


def _first(a: Sequence[Any]) -> list[torch.Tensor]:
    return list(a[0])


def _second_list(a: Sequence[Any]) -> list[torch.Tensor]:
    return list(a[1])


def _second(a: Sequence[Any]) -> list[torch.Tensor]:
    return [a[1]]


def _none(a: Sequence[Any]) -> list[torch.Tensor]:
    return []


def _root_lists(a: Sequence[Any]) -> list[torch.Tensor]:
    return list(a[1][0]) if len(a) > 1 and a[1] else []  # scatter: the root's tensors to send (none elsewhere)


#: the process group's call -> (the event's operation name, the call's input tensors), as ProcessGroupGloo names them
TITLES: dict[str, tuple[str, Callable[[Sequence[Any]], list[torch.Tensor]]]] = {
    "allreduce": ("all_reduce", _first), "allreduce_coalesced": ("all_reduce", _first),
    "broadcast": ("broadcast", _first), "reduce": ("reduce", _first), "barrier": ("barrier", _none),
    "allgather": ("all_gather", _second_list), "allgather_coalesced": ("all_gather", _second_list),
    "all_gather_single": ("all_gather_into_tensor", _second),
    "allgather_into_tensor_coalesced": ("all_gather_into_tensor", _second_list),
    "gather": ("gather", _second_list), "scatter": ("scatter", _root_lists),
    "reduce_scatter": ("reduce_scatter", _first), "reduce_scatter_single": ("reduce_scatter_tensor", _second),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter_tensor", _second_list),
    "all_to_all_single": ("all_to_all", _second), "alltoall": ("all_to_all", _second_list),
    "send": ("send", _first), "recv": ("recv", _first), "recv_anysource": ("recvAnySource", _first),
}

_CLOSE_S = 10.0  # bound on closing one event (a few microseconds of the profiler's own work)
_profiler_enabled = torch._C._autograd._profiler_enabled
_RecordFunction = torch._C._profiler._RecordFunctionFast


def issued(backend: str, call: str, args: Sequence[Any]) -> Any:
    """The event of ``call`` (a process-group method) issued with ``args``, opened; None while no profiler is on."""
    if not _profiler_enabled():
        return None
    entry = TITLES.get(call)
    if entry is None:
        return None
    title, inputs = entry
    try:
        tensors = [t for t in inputs(args) if isinstance(t, torch.Tensor)]
    except (IndexError, TypeError):  # (a malformed call: the group's own validation reports it)
        tensors = []
    event = _RecordFunction(f"{backend}:{title}", tensors)
    event.__enter__()
    return event


# the thread that closes events, as the backend's worker thread does; a raw thread, so that no simulator adapter of
# threading (actors of ranks, see simulator.adapters.threads) mistakes it for one of the program's
_requests: "queue.SimpleQueue[tuple[Any, Any]]" = queue.SimpleQueue()
_started = 0  # the pid of the process whose closing thread runs (a forked child starts its own)
_start_lock = _thread.allocate_lock()


def _closer() -> None:
    while True:
        event, done = _requests.get()
        try:
            event.__exit__(None, None, None)
        except Exception:  # noqa: BLE001  (a profiler that stopped meanwhile: nothing left to record)
            pass
        finally:
            done.release()


def completed(event: Any) -> None:
    """Close ``event`` (from :func:`issued`) on the closing thread; returns once it is closed."""
    global _started
    if event is None:
        return
    with _start_lock:
        if _started != os.getpid():
            _thread.start_new_thread(_closer, ())
            _started = os.getpid()
    done = _thread.allocate_lock()
    done.acquire()
    _requests.put((event, done))
    done.acquire(timeout=_CLOSE_S)


# ---------------------------------------------------------------------------
# one profiler per process: refused on thread ranks that share one
# ---------------------------------------------------------------------------
#: while PyTorch's harness runs a test on thread ranks: ``(fix, mark)``, its own fix for the message and ``mark()``,
#: which has the test run again on rank processes (see simulator.torch_harness_state.one_profiler_per_process)
harness_refusal: list[Any] = [None]


def _refusing(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def refused(self: Any) -> Any:
        rs = current_rank_state()
        if rs is not None and len(rs.run.ranks) > 1:  # (one rank alone has the process's profiler to itself)
            fix = ("run the ranks with a process each, which have a profiler each: isolation='process' "
                   "(python -m simulator --isolation process ...)")
            hook = harness_refusal[0]
            if hook is not None:
                fix = hook[0]
                hook[1]()
            raise SimError(format_message(
                "torch.profiler.profile", "torch's profiler was started on a simulated thread rank; the profiler is "
                "one per process, and thread ranks share this process (each rank would record the others' "
                "operations, and a second rank's start or stop crashes the process)", rank=rs.rank,
                values={"world_size": len(rs.run.ranks)}, fix=fix))
        return original(self)

    refused.__name__ = original.__name__
    return refused


_undo: list[Callable[[], None]] = []


def _install() -> None:
    cls = autograd_profiler.profile
    # both steps of a start: a scheduled profiler whose step() was refused still starts the trace on its way out
    # (torch.profiler.profile.__exit__ moves its schedule on), which must fail as loudly, not crash in C++
    for step in ("_prepare_trace", "_start_trace"):
        _undo.append(replace(cls, step, _refusing(cls.__dict__[step])))


def _uninstall() -> None:
    while _undo:
        _undo.pop()()


_INSTALLATION = Installation(_install, _uninstall)


def enabled() -> ContextManager[None]:
    """While a world runs: torch's profiler started on one of several thread ranks fails, naming the fix."""
    return _INSTALLATION.enabled()


@contextlib.contextmanager
def harness_names_the_fix(fix: str, mark: Callable[[], None]) -> Any:
    """For PyTorch's harness: a refusal while the block runs names ``fix`` and calls ``mark()``."""
    harness_refusal[0] = (fix, mark)
    try:
        yield
    finally:
        harness_refusal[0] = None
