"""The one backend interface of tensorplay.distributed.

The public API (``tensorplay/distributed/api.py``) validates every argument,
resolves the group and converts global src/dst to *group* ranks before it
calls a backend.  A backend therefore receives only well-formed calls:

* ``group`` is a :class:`~tensorplay.distributed.group.ProcessGroup` the
  calling rank belongs to;
* ``root`` / ``peer`` are group ranks;
* ``op`` is a :class:`~tensorplay.distributed.reduce_op.ReduceOp` the dtype
  allows;
* list lengths, split sizes, shapes and dtypes are consistent on this rank
  (cross-rank agreement is the backend's business: the simulator checks it,
  c10d backends trust the caller like torch does).

Each collective writes its result into the given output tensors (in place, as
torch.distributed does) and returns ``None`` when ``async_op`` is false, else
a :class:`Work`.  A backend fills its own gaps (a primitive it lacks is
emulated inside the backend), so callers never branch on backend names.
"""
from __future__ import annotations

import abc
import inspect
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch

from ..errors import DistRuntimeError, format_message
from ..group import ProcessGroup
from ..reduce_op import ReduceOp

__all__ = ["Backend", "Work", "CompletedWork"]


class Work(abc.ABC):
    """Handle of an asynchronous operation (``async_op=True``)."""

    @abc.abstractmethod
    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Block until the operation finished; raise its error if it failed."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True once the operation finished (successfully or not)."""

    def is_success(self) -> bool:
        return self.is_completed()

    def source_rank(self) -> int:
        """For a receive: the sender's rank (a group rank at the backend level)."""
        raise DistRuntimeError(format_message(
            "Work.source_rank", "only a receive knows its sender", values={"work": type(self).__name__},
            fix="call source_rank() on the work returned by irecv (or use recv's return value)"))

    def result(self) -> list[torch.Tensor]:
        return []

    def exception(self) -> BaseException | None:
        """The error a finished operation failed with, or ``None`` (also while it is still running)."""
        if not self.is_completed():
            return None
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001  the failure is what this reports
            return e
        return None

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` of the operation's output tensors (:meth:`result`), as c10d's Work gives.

        The operation is waited for first, where the backend can see the wait
        (the simulator's scheduler cannot see a wait inside a torch future), so
        the future is returned completed, with the result or the error.
        """
        return completed_future(self.wait, self.result)


def completed_future(wait: Callable[[], Any], result: Callable[[], Any]) -> torch.futures.Future:
    """A ``torch.futures.Future`` completed after ``wait()``: with ``result()``, or with the error ``wait`` raised."""
    fut: torch.futures.Future = torch.futures.Future()
    try:
        wait()
    except Exception as e:  # noqa: BLE001  delivered through the future, as c10d does
        fut.set_exception(e)
    else:
        fut.set_result(result())
    return fut


class CompletedWork(Work):
    """A Work that is already done (the result was produced synchronously)."""

    def __init__(self, source: int | None = None, tensors: Sequence[torch.Tensor] = ()) -> None:
        self._source = source
        self._tensors = list(tensors)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def source_rank(self) -> int:
        if self._source is None:
            return super().source_rank()
        return self._source

    def result(self) -> list[torch.Tensor]:
        return self._tensors


class ChainedWork(Work):
    """Wait for an inner work, then run a finishing step once (e.g. copy a staging buffer out)."""

    def __init__(self, inner: Any, finish: Callable[[], None]) -> None:
        self._inner = inner
        self._finish: Callable[[], None] | None = finish

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        ok = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True if ok is None else bool(ok)

    def is_completed(self) -> bool:
        return self._finish is None or self._inner.is_completed()

    def source_rank(self) -> int:
        return self._inner.source_rank() if hasattr(self._inner, "source_rank") else self._inner._source_rank()


class Backend(abc.ABC):
    """A per-rank object that runs collectives for one process (or one simulated rank).

    Subclasses are registered by name with
    :func:`tensorplay.distributed.backends.register_backend`.
    """

    #: the name users pass to ``init_process_group``
    name: str = "?"
    #: the rank's world outlives ``destroy_process_group``: a later ``init_process_group`` joins it again (a world
    #: started for the program before it runs, the simulator's), where a process group backend starts a new one
    rejoinable: bool = False
    #: a world started for a script before it runs (``python -m simulator script.py``) is the rank's default process
    #: group only once the script calls ``init_process_group`` (tensorplay's or torch's), as a process torchrun
    #: started has none before: until then the rank is not initialised
    awaiting_init: bool = False

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    # -- life cycle -------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def create(
        cls,
        *,
        rank: int,
        world_size: int,
        init_method: str | None,
        store: Any,
        timeout: timedelta,
    ) -> "Backend":
        """Join (or create) the world and return this rank's backend."""

    @abc.abstractmethod
    def world_handle(self) -> Any:
        """The handle of the world group."""

    @abc.abstractmethod
    def new_group_handle(self, ranks: tuple[int, ...], timeout: timedelta) -> Any:
        """Create the handle for a new group; called on every rank of the world, members or not.

        Returns ``None`` on ranks that are not members.
        """

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release every resource; the rank may initialise again afterwards."""

    def released(self) -> None:
        """Called after :meth:`shutdown` once tensorplay dropped its own references to the backend's groups."""
        return None

    def supports_device(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` can take part in this backend's collectives."""
        return device.type == "cpu"

    def device_for(self, kind: str) -> torch.device:
        """The device of kind ``kind`` (``"cpu"``/``"cuda"``) this rank's tensors live on.

        The default is torch's current device of that kind; a backend that places ranks itself (one GPU
        per rank, or simulated ranks sharing a machine) says where.
        """
        if kind == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(kind)

    def check_reinit(self, rank: int | None, world_size: int | None) -> None:
        """``init_process_group`` was called again while this backend runs the default group.

        A process-group backend refuses (the program must destroy the group first).  A backend whose world
        is started for the program before it runs (the simulator) accepts the call when ``rank`` and
        ``world_size`` (``None``/-1 when not given) agree with the rank it is.
        """
        raise DistRuntimeError(format_message(
            "init_process_group", "the default process group is already initialised", rank=self.rank,
            values={"backend": self.name}, fix="call destroy_process_group() before initialising again"))

    def joined(self, backend: str | None, timeout: timedelta | None) -> None:  # noqa: ARG002
        """The program's ``init_process_group(backend, timeout=...)`` joined this backend's world, which was started
        for it before it ran (the simulator's); a process group backend is never joined."""
        return None

    def supports_op(self, op: ReduceOp, dtype: torch.dtype) -> bool:  # noqa: ARG002
        """Whether the backend reduces ``dtype`` with ``op`` natively (else it emulates)."""
        return True

    # -- collectives (group ranks, validated arguments) -------------------
    @abc.abstractmethod
    def barrier(self, group: ProcessGroup, async_op: bool) -> Work | None: ...

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int, group: ProcessGroup, async_op: bool) -> Work | None: ...

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, group: ProcessGroup, async_op: bool) -> Work | None: ...

    @abc.abstractmethod
    def reduce(
        self, tensor: torch.Tensor, root: int, op: ReduceOp, group: ProcessGroup, async_op: bool
    ) -> Work | None: ...

    @abc.abstractmethod
    def all_gather(
        self, output_list: list[torch.Tensor], tensor: torch.Tensor, group: ProcessGroup, async_op: bool
    ) -> Work | None: ...

    @abc.abstractmethod
    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, group: ProcessGroup, async_op: bool
    ) -> Work | None: ...

    @abc.abstractmethod
    def gather(
        self,
        tensor: torch.Tensor,
        gather_list: list[torch.Tensor] | None,
        root: int,
        group: ProcessGroup,
        async_op: bool,
    ) -> Work | None: ...

    @abc.abstractmethod
    def scatter(
        self,
        tensor: torch.Tensor,
        scatter_list: list[torch.Tensor] | None,
        root: int,
        group: ProcessGroup,
        async_op: bool,
    ) -> Work | None: ...

    @abc.abstractmethod
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input_list: list[torch.Tensor],
        op: ReduceOp,
        group: ProcessGroup,
        async_op: bool,
    ) -> Work | None: ...

    @abc.abstractmethod
    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, group: ProcessGroup, async_op: bool
    ) -> Work | None: ...

    @abc.abstractmethod
    def all_to_all(
        self,
        output_list: list[torch.Tensor],
        input_list: list[torch.Tensor],
        group: ProcessGroup,
        async_op: bool,
    ) -> Work | None:
        """List all_to_all; shapes may differ per (sender, receiver) pair (ragged)."""

    @abc.abstractmethod
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        group: ProcessGroup,
        async_op: bool,
    ) -> Work | None:
        """Split sizes are always explicit lists here (the API fills in even splits)."""

    @abc.abstractmethod
    def send(self, tensor: torch.Tensor, peer: int, group: ProcessGroup, tag: int, async_op: bool) -> Work | None: ...

    @abc.abstractmethod
    def recv(
        self, tensor: torch.Tensor, peer: int | None, group: ProcessGroup, tag: int, async_op: bool
    ) -> Work | int:
        """Receive into ``tensor``; ``peer=None`` means any source.

        Returns the sender's *group* rank when blocking, else a Work whose
        ``source_rank()`` gives the sender's *group* rank (the API maps it to
        a global rank for users).
        """


def _check_interface() -> None:
    """Every collective of ``spec.BACKEND_COLLECTIVES`` is an abstract method of :class:`Backend` and back,
    with the parameters the table names (``args``, then ``group``, ``tag`` for point-to-point, ``async_op``)."""
    from ..spec import BACKEND_COLLECTIVES

    declared = {n for n in Backend.__abstractmethods__} - {"create", "world_handle", "new_group_handle", "shutdown"}
    if declared != set(BACKEND_COLLECTIVES):
        raise ImportError(f"the Backend interface and spec.BACKEND_COLLECTIVES disagree: only in Backend: "
                          f"{sorted(declared - set(BACKEND_COLLECTIVES))}, only in the table: "
                          f"{sorted(set(BACKEND_COLLECTIVES) - declared)}")
    for name, b in BACKEND_COLLECTIVES.items():
        params = tuple(inspect.signature(getattr(Backend, name)).parameters)[1:]
        if params != b.parameters:
            raise ImportError(f"Backend.{name} takes {params!r} but spec.BACKEND_COLLECTIVES[{name!r}] says "
                              f"{b.parameters!r}; change the table's args= (or the method) so they agree")


_check_interface()
