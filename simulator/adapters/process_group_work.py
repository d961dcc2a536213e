"""What a simulated torch process group's operations return, and how their errors reach the caller.

Part of the torch.distributed adapter (:mod:`simulator.adapters.torch_native`): :class:`SimWork` is torch's
``Work`` for an operation the simulator runs; :func:`_backend_errors` wraps each operation of
:class:`~simulator.adapters.process_group.SimProcessGroup` so that its errors look like gloo's (and NCCL's
device rule on CUDA stand-ins), with the profiler event a real backend records.  The private torch names
these override are listed in :mod:`simulator.adapters.torch_private`.
"""
from __future__ import annotations

import functools
import os
import re
import sys
import threading
import weakref
from sys import modules as _loaded  # (bound once: while a world runs, sys's attributes are looked up in Python)
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist
from torch.utils import _python_dispatch

from tensorplay.distributed.backends.base import completed_future
from tensorplay.distributed.errors import DistBackendError, DistError, DistRuntimeError, format_message

from simulator.adapters import torch_profiling
from simulator.adapters.torch_private import check_torch_version
from simulator.core.errors import also_a
from simulator.core.state import Incident

__all__ = ["SimWork", "forget_unwaited"]

#: the works not yet waited for, kept alive here (id -> work). pybind finds the Python overrides (``wait``,
#: ``get_future``) only while the Python object lives, and a holder in C++ keeps the C++ part alone: DDP's reducer
#: keeps the forward pass's work under ``join()`` and, in backward, after Python dropped it, calls ``wait`` and
#: then ``getFuture``; torch's base ``Work.wait`` blocked forever there (a completion the base never gets)
_UNWAITED: dict[int, "SimWork"] = {}
#: the work each thread waited for last (thread id -> work), kept until that thread's next wait ends, for a C++
#: holder's calls right after its wait (the reducer's ``getFuture``); one per thread, so a loop of waited
#: operations holds on to no more than one of them
_LAST_WAITED: dict[int, "SimWork"] = {}


def forget_unwaited() -> None:
    """Let go of the works kept alive (when the worlds end: nothing waits on them any more)."""
    _UNWAITED.clear()
    _LAST_WAITED.clear()

check_torch_version()  # (refuses an unsupported torch before its classes are subclassed below)


#: per thread, ``.works``: the works issued since an NCCL group's ``_start_coalescing`` (see LanesMixin)
coalescing = threading.local()


class SimWork(tdist.Work):
    """torch's ``Work`` for an operation issued on the simulator with ``async_op=True``.

    ``wait()`` waits on the simulator's own work objects, so the scheduler sees
    the wait (deadlock detection, coop hand-offs); nothing ever blocks in C++ on
    something the simulator cannot see.  torch's C++ side (DDP's reducer,
    functional collectives' ``wait_tensor``) reaches ``wait`` and
    ``get_future`` through pybind's trampoline, so they run this code too.

    ``result()``/``get_future().value()`` follow gloo: the op's output tensors.
    """

    def __init__(self, works: list[Any], result: list[Any], *, source: Any = None, refuse: str | None = None,
                 after: Any = None, weak_result: bool = False) -> None:
        super().__init__()
        collected = coalescing.__dict__.get("works")
        if collected is not None:  # (issued inside an NCCL group's coalescing: its end's work waits for it)
            collected.append(self)
        self._weak = weak_result  # once waited, hold the outputs weakly (see wait)
        self._after = after  # () -> None: writes the results out once the exchange is done (several-tensor calls)
        self._refuse = refuse  # an error gloo gives this rank once the exchange is done (see _autograd_refusal)
        self._works = [w for w in works if w is not None]
        self._result = result
        self._source = source  # () -> sender's group rank, for receives
        self._done = False
        self._exc: BaseException | None = None
        self._fut: torch.futures.Future | None = None
        self._event: Any = None  # the profiler's event of this operation, closed when it is waited for
        self._timeout: timedelta | None = None  # its group's bound on the operation
        _UNWAITED[id(self)] = self

    def wait(self, timeout: Any = None) -> bool:
        """Block (visibly to the simulator) until the operation finished, at most ``timeout`` (default: its group's
        timeout; torch's ``timedelta(0)`` means the same); raise its error if it failed."""
        if not self._done:
            bound = timeout if isinstance(timeout, timedelta) and timeout else self._timeout
            try:
                for w in self._works:
                    w.wait(bound)
                if self._refuse is not None:
                    raise DistBackendError(self._refuse)
                if self._after is not None:
                    self._after()
            except BaseException as e:  # noqa: BLE001  kept for exception(), then re-raised as is
                self._exc = e
                raise
            finally:
                self._done = True
                if _UNWAITED.pop(id(self), None) is not None:
                    _LAST_WAITED[threading.get_ident()] = self
                # done: a C++ holder may still ask for its outputs (result(), getFuture(), which DDP's join hook
                # reads after dropping them), never for the simulator's call records
                self._works = []
                if self._weak:  # (a broadcast: DDP's module-state broadcast buffer is freed when dropped)
                    self._result = [_Held(t) for t in self._result]
                if self._event is not None:
                    event, self._event = self._event, None
                    torch_profiling.completed(event)
        elif self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if not all(w.is_completed() for w in self._works):
            return False
        if self._after is not None:  # the exchange is done: write the results out now, as gloo has by then
            try:
                self.wait()
            except BaseException:  # noqa: BLE001  completed with an error: exception()/wait() report it
                pass
        return True

    def is_success(self) -> bool:
        if not self._done:
            if not self.is_completed():
                return False
            try:
                self.wait()
            except BaseException:  # noqa: BLE001  the failure is what is_success reports
                return False
        return self._exc is None

    def exception(self) -> Any:
        return self._exc

    def result(self) -> list[Any]:
        self.wait()
        return self._outputs()

    def _outputs(self) -> list[Any]:
        if not self._weak or not self._done:  # (a waited broadcast holds _Held references: see wait)
            return self._result
        return [t for t in (h.ref() for h in self._result) if t is not None]

    def source_rank(self) -> int:
        if self._source is None:
            raise DistRuntimeError(format_message(
                "Work.source_rank", "sourceRank() may only be called on work objects that correspond to a recv "
                "or recv-from-any call", values={"work": "send" if not self._result else type(self).__name__},
                fix="call source_rank() on the work that irecv returned"))
        self.wait()
        return int(self._source())

    _source_rank = source_rank

    def get_future(self) -> torch.futures.Future:
        """A future holding the op's outputs.

        It is returned completed: torch waits on futures in C++ (DDP's reducer),
        where the simulator could not see the wait, so the operation is waited
        for here, visibly, first.
        """
        if self._fut is None:
            try:
                self.wait()
            except Exception as e:  # noqa: BLE001  delivered through the future, as c10d does
                self._fut = _failed_future(e)
            else:
                self._fut = _typed_future(self._outputs())
        return self._fut

    def synchronize(self) -> None:
        self.wait()


class _Held:
    """A waited broadcast's output, held weakly (what its holders still hold)."""

    __slots__ = ("ref",)

    def __init__(self, t: torch.Tensor) -> None:
        self.ref = weakref.ref(t)


def _failed_future(error: Exception) -> torch.futures.Future:
    """A future completed with ``error`` as C++ sees one.  A Python ``Future.set_exception`` keeps the error as the
    future's *value* (its Python waiters raise it), and a C++ holder takes that value for the result: DDP's reducer
    read it as the bucket's gradients and crashed the process (a rank failing while another was in backward).  An
    error raised in a callback is one in C++ too: C++ holders get it thrown, Python waiters a RuntimeError naming
    it, as for gloo's failed works."""
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(None)

    def fail(_: Any) -> None:
        raise error

    return done.then(fail)


def _typed_future(result: list[Any]) -> torch.futures.Future:
    """A future completed with ``result`` typed as TorchScript infers it (a list of tensors is a ``TensorList``), as a
    C++ backend's future is: c10d's built-in DDP hooks (``FP16_COMPRESS``) require that type, while a Python
    ``Future()`` holds any Python object. (``torch._C.fork`` calls the function at once, outside TorchScript.)"""
    try:
        return torch._C.fork(list, result)
    except RuntimeError:  # a type TorchScript cannot infer (an empty list): any object will do
        return completed_future(lambda: None, lambda: result)


_LEAF_INPLACE = "a leaf Variable that requires grad is being used in an in-place operation"


def _autograd_refusal(name: str, rank: int, outputs: Any) -> str | None:
    """The error gloo gives this rank after the exchange, where it writes results with autograd-checked torch ops.

    gloo (torch 2.13) writes the results of all_reduce, broadcast, reduce,
    scatter, all_to_all_single and recv as raw memory, but copies those of
    all_gather, gather (on the root), all_to_all, reduce_scatter_tensor,
    all_reduce_coalesced and all_gather_into_tensor into the outputs with torch
    ops, in the caller's grad mode: a leaf output that requires grad makes that
    rank fail, while the other ranks finish.  Measured per collective on 2 gloo
    processes; none fails under ``torch.no_grad()``.  (An all_gather_into_tensor
    *input* that requires grad fails on some gloo ranks and not others, varying
    between runs: not imitated.)  tensorplay's own API writes every result as
    memory on every backend, so this is the torch front door's only.
    """
    if not torch.is_grad_enabled():
        return None
    bad = [i for i, t in enumerate(outputs or ()) if t.requires_grad and t.is_leaf]
    if not bad:
        return None
    what = {"outputs_requiring_grad": bad}
    return format_message(
        f"torch.distributed.{name}", f"{_LEAF_INPLACE} (gloo writes this collective's results with torch ops that "
        f"autograd checks, so this rank fails once the exchange is done, as it does on gloo)", rank=rank, values=what,
        fix="pass tensors that do not require grad (torch.empty(...), or .detach()), or call it under "
            "torch.no_grad(); for a collective that autograd differentiates, use "
            "tensorplay.distributed.nn.functional")


_OURS = re.compile(r"tensorplay\.distributed\.[\w.]+")
_C10D = tdist.distributed_c10d.__file__
_TORCH_DIST = os.path.dirname(tdist.__file__) + os.sep
_SIMULATOR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _torch_call() -> str | None:
    """The torch.distributed function the program called, on this thread's stack (``send`` for ``send`` ->
    ``isend`` -> the group's ``send``): the outermost of torch's ``distributed_c10d`` functions below the
    program's frame; None when the program called the group itself."""
    found, frame = None, sys._getframe(1)
    while frame is not None:
        file = frame.f_code.co_filename
        if file == _C10D and hasattr(tdist, frame.f_code.co_name) and not frame.f_code.co_name.startswith("_"):
            found = frame.f_code.co_name
        elif found is not None and not file.startswith((_TORCH_DIST, _SIMULATOR)):
            break  # the program's own frame
        frame = frame.f_back
    return found


def _named_as_called(e: DistError) -> None:
    """Name the torch call the program made in a refusal tensorplay words (``tensorplay.distributed.isend (group
    [0, 1], rank 1): ...`` for ``torch.distributed.send(t, dst=3)``): the program never called tensorplay."""
    message = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else None
    if message is None or not _OURS.match(message):
        return
    call = _torch_call()
    if call is not None:
        e.args = (_OURS.sub(f"torch.distributed.{call}", message, count=1),)


def _backend_errors(method: Any) -> Any:
    """Validation errors raised inside a group's call reach the caller as gloo's do: as RuntimeError.

    torch validates its own arguments in Python before calling the group; what
    tensorplay then refuses (an unknown op, a root outside the group, a shape)
    gloo refuses in C++, which torch raises as ``RuntimeError``
    (``DistBackendError``, torch's and tensorplay's).  The message and the original error are kept.
    """
    name = method.__name__

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        # the pybind overloads' per-call bound (pg.allreduce(t, timeout=...), pg.barrier(timeout=...))
        timeout = kwargs.pop("timeout", None)
        if self._named == "nccl":
            _nccl_devices(self, name, args)
        elif name not in _ANY_DTYPE:
            _gloo_dtypes(self, name, args)
        if "nccl" in self._named:
            _nccl_tensors(self, name, args)
        seq = self.__dict__.get("_tp_seq", 0)
        checks = self.__dict__.get("_tp_wrapper")
        if checks is not None:  # torch's ProcessGroupWrapper (adapters.pg_wrapper): before the call, on every rank
            checks(name, args, seq)
        self._tp_seq = seq + 1  # (the group's sequence number counts operations)
        event = torch_profiling.issued(self._named, name, args)  # (None unless a profiler is on)
        try:
            work = _through_comm_modes(name, lambda: method(self, *args, **kwargs))
        except DistError as e:
            torch_profiling.completed(event)
            _named_as_called(e)
            if isinstance(e, RuntimeError):  # (torch's own DistBackendError too, as gloo's failures are)
                also_a(e, tdist.DistBackendError)
                raise
            raise also_a(DistBackendError(str(e)), tdist.DistBackendError) from e
        except BaseException:
            torch_profiling.completed(event)
            raise
        if event is not None:
            work._event = event
        work._timeout = timeout if timeout is not None else self._bound  # (the call's own, else the group's)
        if name in _GLOO_VERSION_BUMPS:
            _bump_versions(self, name, args)
        return work

    return call


#: each group call -> the c10d op torch's dispatcher runs for it on a real group (what a dispatch mode sees)
_C10D_OPS = {"allreduce": "allreduce_", "allreduce_coalesced": "allreduce_coalesced_", "broadcast": "broadcast_",
             "reduce": "reduce_", "barrier": "barrier", "allgather": "allgather_",
             "allgather_coalesced": "allgather_coalesced_", "all_gather_single": "_allgather_base_",
             "allgather_into_tensor_coalesced": "allgather_into_tensor_coalesced_", "gather": "gather_",
             "scatter": "scatter_", "reduce_scatter": "reduce_scatter_", "reduce_scatter_single": "_reduce_scatter_base_",
             "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced_", "all_to_all_single": "alltoall_base_",
             "alltoall": "alltoall_", "send": "send", "recv": "recv_", "recv_anysource": "recv_any_source_"}


class _C10dOp:
    """What a watching mode is handed as the operation: it names the c10d op (``_overloadpacket``) and runs the
    group's call with the dispatch modes off, as the op's kernel runs on a real group."""

    def __init__(self, packet: Any, run: Any) -> None:
        self._overloadpacket = packet
        self._run = run

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with _python_dispatch._disable_current_modes():
            return self._run()


def _through_comm_modes(name: str, run: Any) -> Any:
    """A group call, seen by torch's ``CommDebugMode`` when one is active.

    On a real group, ``dist.all_reduce`` reaches the backend through torch's dispatcher (``c10d.allreduce_``),
    where a ``TorchDispatchMode`` sees it: ``CommDebugMode`` counts it, per module.  A simulated group's
    calls are Python methods the dispatcher never runs, so the active ``CommDebugMode`` is handed the op
    here (only that mode: others, such as a fake-tensor mode, never see c10d ops on a real run either).
    """
    debug = _loaded.get("torch.distributed.tensor.debug._comm_mode")
    if debug is None or name not in _C10D_OPS:
        return run()
    modes = [m for m in _python_dispatch._get_current_dispatch_mode_stack() if isinstance(m, debug.CommDebugMode)]
    if not modes:
        return run()
    packet = getattr(torch.ops.c10d, _C10D_OPS[name])
    for m in modes[:-1]:  # (nested modes each count it; the innermost runs it)
        m.__torch_dispatch__(_C10dOp(packet, lambda: None), (), ())
    return modes[-1].__torch_dispatch__(_C10dOp(packet, run), (), ())


def _nccl_devices(group: Any, name: str, args: tuple) -> None:
    """NCCL's rules on CUDA stand-ins (``devices="cuda"``): a group the program made with "nccl" takes CUDA tensors
    only, and refuses a CPU tensor with torch's own error (a program that says "nccl" on plain CPU ranks keeps
    running on the simulated world, as before); a group bound to a device (``init_process_group(device_id=)``)
    takes that device's tensors only."""
    standin = _loaded.get("simulator.standin")
    if standin is None or not standin.is_active():
        return
    bound = getattr(group, "bound_device_id", None)
    for a in _tensors_in(args):
        dev = standin.device_of(a)
        if dev.type != "cuda":
            raise RuntimeError(f"No backend type associated with device type {dev.type}")
        if bound is not None and bound.type == "cuda" and bound.index is not None and dev.index != bound.index:
            raise also_a(DistBackendError(format_message(
                f"torch.distributed.ProcessGroupNCCL.{name}", "Attempt to perform collective on tensor not on "
                "device passed to init_process_group", group=group._g.ranks, rank=group._g.rank(),
                values={"device": str(dev), "device_id": str(bound)},
                fix="move the tensor to the device the group was bound to (t.to(device_id)), or bind the group to "
                    "the rank's own device: init_process_group(device_id=torch.device('cuda', local_rank))")),
                tdist.DistBackendError)


def _tensors_in(args: tuple) -> Any:
    """The tensors among a group call's arguments (in lists of lists too)."""
    stack = list(args)
    while stack:
        a = stack.pop()
        if isinstance(a, (list, tuple)):
            stack.extend(a)
        elif isinstance(a, torch.Tensor):
            yield a


#: the dtypes ProcessGroupGloo's collectives take (a complex tensor travels as its real pairs, except in gather);
#: any other (int16, uint16..uint64, float8) fails there with "Invalid scalar type"
_GLOO_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128})
#: the calls that move any dtype (as bytes) or none
_ANY_DTYPE = frozenset({"send", "recv", "recv_anysource", "barrier", "monitored_barrier"})


def _gloo_dtypes(group: Any, name: str, args: tuple) -> None:
    """gloo's dtype rule, before anything is communicated, on a group whose tensors go to gloo."""
    for a in _tensors_in(args):
        if (a.dtype not in _GLOO_DTYPES or (name == "gather" and a.is_complex())) and group._speaks_gloo(a):
            raise DistBackendError(format_message(
                f"torch.distributed.ProcessGroupGloo.{name}",
                "Invalid scalar type: gloo does not take tensors of this dtype",
                group=group._g.ranks, rank=group._g.rank(), values={"dtype": str(a.dtype)},
                fix="cast to a dtype gloo takes (float32, float64, float16, bfloat16, int8, uint8, int32, int64, "
                    "bool) and back, or move the bytes with send/recv, which take any dtype"))


#: the dtypes ProcessGroupNCCL maps to NCCL's own (its ``ncclDataType`` table; bool and the float8 types NCCL has no
#: reduction for travel as bytes); a complex tensor is sent as its real pairs by torch's front door
_NCCL_DTYPES = frozenset({torch.int8, torch.uint8, torch.float32, torch.float64, torch.int32, torch.int64,
                          torch.float16, torch.bool, torch.bfloat16, torch.complex64, torch.complex128} |
                         {getattr(torch, n) for n in ("float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz",
                                                      "float8_e5m2fnuz") if hasattr(torch, n)})
#: ATen's names of the dtypes NCCL refuses, as its error prints them
_SCALAR_NAMES = {torch.int16: "Short", torch.uint16: "UInt16", torch.uint32: "UInt32", torch.uint64: "UInt64",
                 torch.complex32: "ComplexHalf"}


#: the arguments (by position) each call of ProcessGroupNCCL requires contiguous, in their suggested memory format
#: (its check_gpu_single_tensor); point-to-point and all-to-all only warn, list outputs and coalesced calls are copied
_NCCL_CONTIGUOUS = {"allreduce": (0,), "broadcast": (0,), "reduce": (0,), "allgather": (1,),
                    "all_gather_single": (0, 1), "reduce_scatter": (0,), "reduce_scatter_single": (0,), "gather": (1,),
                    "scatter": (0,)}


def _dense_in_some_format(t: torch.Tensor) -> bool:
    """``t.is_contiguous(t.suggest_memory_format())``: contiguous, or channels-last (2-D or 3-D)."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)) or \
        (t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))


def _nccl_tensors(group: Any, name: str, args: tuple) -> None:
    """NCCL's rules for the tensors of a call that go to NCCL, before anything is communicated (one pass): its dtype
    table (send and recv too: NCCL moves typed elements), and contiguity where the call requires it."""
    dense_at = _NCCL_CONTIGUOUS.get(name, ())
    for at, arg in enumerate(args):
        for a in _tensors_in((arg,)):
            if not group._speaks_nccl(a):
                continue
            if a.dtype not in _NCCL_DTYPES:
                kind = _SCALAR_NAMES.get(a.dtype, str(a.dtype).replace("torch.", ""))
                raise TypeError(format_message(
                    f"torch.distributed.ProcessGroupNCCL.{name}",
                    f"Input tensor data type is not supported for NCCL process group: {kind}",
                    group=group._g.ranks, rank=group._g.rank(), values={"dtype": str(a.dtype)},
                    fix="cast to a dtype NCCL takes (float32, float64, float16, bfloat16, float8, int8, uint8, "
                        "int32, int64, bool) and back, e.g. t.to(torch.int32)"))
            if at in dense_at and not _dense_in_some_format(a):
                raise ValueError(format_message(
                    f"torch.distributed.ProcessGroupNCCL.{name}", "Tensors must be contiguous",
                    group=group._g.ranks, rank=group._g.rank(),
                    values={"shape": list(a.shape), "stride": list(a.stride())},
                    fix="pass t.contiguous() (and copy the result back into the view where the call writes it)"))


#: how many times gloo's collectives count a write of each output in its autograd version counter (measured on
#: torch 2.13: these write their outputs through copies that autograd counts; all_reduce, broadcast, reduce,
#: scatter, all_to_all_single and recv write in place, uncounted): an output saved for backward then fails the
#: backward ("modified by an inplace operation") as on gloo.  0: once per rank of the group (all_gather_into_tensor
#: copies each rank's part into the output)
_GLOO_VERSION_BUMPS = {"all_gather_single": 0, "allgather": 1, "reduce_scatter_single": 1, "alltoall": 1,
                       "gather": 1}


def _bump_versions(group: Any, name: str, args: tuple) -> None:
    for t in _tensors_in(args[:1]):  # (the outputs are every one of these calls' first argument)
        if not t.is_inference() and group._speaks_gloo(t):
            for _ in range(_GLOO_VERSION_BUMPS[name] or group._g.size()):
                torch.autograd.graph.increment_version(t)


class NcclDeviceRule:
    """NCCL's rule for a communicator (``SimGroup.rule``): two ranks of one node may not use one GPU. NCCL refuses
    at the communicator's set-up ("Duplicate GPU detected"): the commonest torchrun mistake (no
    ``torch.cuda.set_device(local_rank)``, so every rank computes on ``cuda:0``) fails there, on every rank.
    Only stand-ins count: a "cpu:gloo,cuda:nccl" group's CPU calls are gloo's."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks

    def tag(self, data: Any) -> int | None:
        """The GPU of a call, read on the issuing rank's thread (a functional collective hands the group CPU
        tensors, whose stand-in device only that thread knows: ``standin.device_of``)."""
        device_of = _loaded["simulator.standin"].device_of  # (enabled: the rule is made only then)
        stack = [data]
        while stack:
            a = stack.pop()
            if isinstance(a, (list, tuple)):
                stack.extend(a)
            elif isinstance(a, torch.Tensor):
                d = device_of(a)
                if d.type == "cuda":  # the node's GPU (CUDA_VISIBLE_DEVICES may renumber the rank's)
                    return _loaded["simulator.standin"].ranks.physical(d.index)
        return None

    def check(self, name: str, calls: list[Any]) -> Any:
        """The refusal of collective ``name`` when two members' calls are on one GPU of a node, else None."""
        # (None: one node, as many GPUs as ranks)
        ranks, per_node = self.ranks, _loaded["simulator.standin"].ranks.config().gpus_per_node
        seen: dict[tuple[int, int], int] = {}
        for i, c in enumerate(calls):
            if c.tag is None:
                continue
            first = seen.setdefault((ranks[i] // per_node if per_node else 0, c.tag), i)
            if first != i:
                return Incident(DistBackendError, format_message(
                    f"torch.distributed.{name} (nccl)", f"ncclInvalidUsage: Duplicate GPU detected : rank {i} and rank "
                    f"{first} both on CUDA device {c.tag} (NCCL refuses two ranks of a communicator on one GPU)",
                    group=list(ranks), rank=ranks[i],
                    values={"other_rank": ranks[first], "device": f"cuda:{c.tag}"},
                    fix="give each rank its own GPU before its first collective: torch.cuda.set_device(local_rank) "
                        "(LOCAL_RANK from the environment), and put its tensors and model on that device"))
        return None
