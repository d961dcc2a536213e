"""ProcessGroupGloo's own rules, for programs that call a process group's methods directly.

Part of the torch.distributed adapter (:mod:`simulator.adapters.torch_native`).  torch's Python front door
(``dist.all_reduce(t)`` …) hands a group one tensor per call; a program (PyTorch's own ``test_c10d_gloo.py``,
a DDP communication hook, a library holding a bare backend) may instead call ``pg.allreduce([t0, t1], opts)``
on a group, or build one itself with ``torch.distributed.ProcessGroupGloo(store, rank, size, opts)``.  gloo then
applies rules the front door never reaches:

* argument checks in C++, raised as ``RuntimeError`` with gloo's words ("invalid root rank", "invalid tensor
  type", "requires a single-element output tensor list" …), before anything is communicated;
* several tensors per call: ``allreduce`` reduces all the inputs of all ranks into every input,
  ``broadcast`` sends the root's ``tensors[rootTensor]`` into every tensor of every rank, ``allgather`` with
  ``n`` inputs per rank fills each output list with the ``n * size`` inputs in rank order;
* the pybind overloads (``pg.allreduce(t)``, ``pg.broadcast(t, root=0)``, ``pg.reduce(t, root, op)`` …).

:class:`~simulator.adapters.process_group.SimProcessGroup` applies them through :class:`GlooRules`; the
stand-in for ``torch.distributed.ProcessGroupGloo`` itself is :mod:`simulator.adapters.torch_globals`'.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as tdist

from tensorplay.distributed.errors import DistBackendError, format_message

__all__ = ["GlooRules", "combine", "premul_factor", "reduce_op", "root_of", "tensor_list"]


def tensor_list(x: Any) -> list[torch.Tensor]:
    """The pybind overloads take one tensor where the options form takes a list."""
    return [x] if isinstance(x, torch.Tensor) else list(x)


def root_of(opts: Any, root: Any) -> tuple[Any, int]:
    """(options, root rank) of a rooted call: the options' ``rootRank``, or the overloads' ``root`` (also given
    positionally where the options go)."""
    if opts is not None and not hasattr(opts, "rootRank"):
        opts, root = None, opts
    return opts, (opts.rootRank if opts is not None else int(root or 0))


def reduce_op(opts: Any = None, op: Any = None) -> Any:
    """The reduce op of a call: ``op=``, an options object's ``reduceOp``, a ``ReduceOp`` given positionally,
    or SUM (the overloads' default)."""
    x = op if op is not None else opts
    if x is None:
        return tdist.ReduceOp.SUM
    if hasattr(x, "reduceOp"):
        x = x.reduceOp
    return getattr(x, "op", x)  # torch's ReduceOp wraps a RedOpType; tensorplay understands the latter


def premul_factor(opts: Any, op: Any, nccl: bool) -> Any:
    """The factor of a call whose op (:func:`reduce_op`) is ``PREMUL_SUM`` (``ReduceOp.PREMUL_SUM(factor)``,
    ``_make_nccl_premul_sum``); ``nccl``: whether the call's tensors go to NCCL (an "nccl" group, or the CUDA side
    of "cpu:gloo,cuda:nccl").

    NCCL multiplies each rank's input by the factor, then sums (FSDP2's ``set_gradient_divide_factor`` reduces
    its gradients so); ProcessGroupGloo refuses it with its own words.  The caller sums ``factor * input``.
    """
    if not nccl:
        raise RuntimeError("Cannot use ReduceOp.PREMUL_SUM with Gloo")
    x = op if op is not None else opts
    return getattr(x, "reduceOp", x).factor


#: how gloo folds one rank's several inputs before it reduces across ranks (AVG: their mean, then the ranks')
_FOLD: dict[str, Callable[[list[torch.Tensor]], torch.Tensor]] = {
    "SUM": lambda ts: torch.stack(ts).sum(0),
    "AVG": lambda ts: torch.stack(ts).sum(0) / len(ts),
    "PRODUCT": lambda ts: torch.stack(ts).prod(0),
    "MIN": lambda ts: torch.stack(ts).amin(0),
    "MAX": lambda ts: torch.stack(ts).amax(0),
    "BAND": lambda ts: _chain(torch.bitwise_and, ts),
    "BOR": lambda ts: _chain(torch.bitwise_or, ts),
    "BXOR": lambda ts: _chain(torch.bitwise_xor, ts),
}


def _chain(fn: Callable[..., torch.Tensor], ts: list[torch.Tensor]) -> torch.Tensor:
    out = ts[0].clone()
    for t in ts[1:]:
        out = fn(out, t)
    return out


def combine(tensors: list[torch.Tensor], op: Any) -> torch.Tensor:
    """One rank's several all_reduce inputs folded into one with ``op`` (what gloo reduces across the ranks)."""
    name = getattr(op, "name", str(op)).split(".")[-1]
    return _FOLD[name](list(tensors)).to(tensors[0].dtype)


class GlooRules:
    """gloo's argument checks for one group's call, raised before anything is communicated.

    The problem text starts with gloo's own words (programs and PyTorch's tests match on them); the message
    adds the call, the rank, the values and a fix.  On an nccl group the call names ``ProcessGroupNCCL``, the
    class the program made (``backend="NCCL"``).
    """

    def __init__(self, call: str, rank: int, group: Any, backend: str = "Gloo") -> None:
        self.call = f"torch.distributed.ProcessGroup{backend}.{call}"
        self.rank = rank
        self.group = list(group)  # the group's ranks (global), named in every message
        self.size = len(self.group)

    def fail(self, problem: str, fix: str, **values: Any) -> DistBackendError:
        return DistBackendError(format_message(self.call, problem, group=self.group, rank=self.rank,
                                               values=values or None, fix=fix))

    def root_rank(self, root: int) -> None:
        if not 0 <= root < self.size:
            raise self.fail(f"invalid root rank: {root}", f"pass a rank of this group, 0..{self.size - 1}",
                            rootRank=root, group_size=self.size)

    def root_tensor(self, index: int, count: int) -> None:
        if not 0 <= index < count:
            raise self.fail(f"invalid root tensor: {index}", "pass opts.rootTensor as an index into the tensor list",
                            rootTensor=index, tensors=count)

    def tag(self, tag: Any, nccl: bool = False) -> None:
        """A point-to-point tag: a C int (torch's binding refuses others), non-negative on gloo (NCCL ignores it)."""
        op = self.call.rsplit(".", 1)[-1]
        if isinstance(tag, bool) or not isinstance(tag, int) or not -2 ** 31 <= tag < 2 ** 31:
            raise TypeError(format_message(
                self.call, f"{op}(): incompatible function arguments (the tag is a C int)", group=self.group,
                rank=self.rank, values={"tag": tag}, fix="pass a tag in 0..2**31-1"))
        if tag < 0 and not nccl:
            raise self.fail("Tag must be nonnegative", "pass a tag in 0..2**31-1", tag=tag)

    def non_empty(self, tensors: list[torch.Tensor], what: str = "tensor list") -> None:
        if not tensors:
            raise self.fail(f"requires non-empty {what}", "pass at least one tensor", tensors=0)

    def single(self, tensors: list[Any], what: str) -> None:
        if len(tensors) != 1:
            raise self.fail(f"requires a single-element {what}", f"pass exactly one entry in the {what}",
                            length=len(tensors))

    def dense(self, tensors: list[torch.Tensor]) -> None:
        for i, t in enumerate(tensors):
            if t.layout != torch.strided:
                raise self.fail(f"invalid tensor layout at index {i}", "pass dense (strided) tensors",
                                layout=str(t.layout))

    def layouts_match(self, tensors: list[torch.Tensor]) -> None:
        for i, t in enumerate(tensors):
            if t.layout != tensors[0].layout:
                raise self.fail(f"invalid tensor layout at index {i}", "pass tensors of one layout",
                                layout=str(t.layout), expected=str(tensors[0].layout))

    def type_and_sizes(self, tensors: list[torch.Tensor], like: torch.Tensor | None = None) -> None:
        """Every tensor of ``tensors`` has ``like``'s dtype and device ("type") and its shape ("size")."""
        ref = like if like is not None else (tensors[0] if tensors else None)
        for t in tensors:
            if t.dtype != ref.dtype or t.device.type != ref.device.type:
                raise self.fail("invalid tensor type", "pass tensors of one dtype and device",
                                dtype=str(t.dtype), expected=str(ref.dtype))
            if t.shape != ref.shape:
                raise self.fail("invalid tensor size", "pass tensors of one shape",
                                shape=tuple(t.shape), expected=tuple(ref.shape))

    def list_size(self, got: int, kind: str) -> None:
        if got != self.size:
            raise self.fail(f"Incorrect {kind} list size {got}. {kind.capitalize()} list size should be {self.size}, "
                            f"same as size of the process group.",
                            f"pass one tensor per rank of the group ({self.size})", length=got)

    def empty_off_root(self, entries: list[Any], what: str) -> None:
        if entries:
            raise self.fail(f"requires empty {what} on non-root", f"pass [] as the {what} on ranks other than the root",
                            length=len(entries))

    def rooted(self, root: int, is_root: bool, one: list[torch.Tensor], one_kind: str, lists: list[Any],
               kind: str) -> None:
        """gather's and scatter's checks: the root, the one tensor every rank gives (takes), and the root's list of
        one tensor per rank (``kind``: "output" for gather, "input" for scatter), empty elsewhere."""
        self.root_rank(root)
        self.single(one, one_kind)
        self.dense(one)
        if is_root:
            self.single(lists, f"{kind} list")
            self.list_size(len(lists[0]), kind)
            self.type_and_sizes(list(lists[0]), like=one[0])
        else:
            self.empty_off_root(lists, kind)
