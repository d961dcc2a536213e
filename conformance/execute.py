"""What runs on each rank: build this rank's inputs, call the collective, run the backward.

:func:`run_case` is the one function every runner executes on every rank
(a simulator thread, a gloo or nccl process).  It never raises: whatever
happens comes back as a :class:`RankOutcome` (outputs, gradients, or the error
and the stage it happened in), and the parent compares the outcomes of all
ranks with the expectations (:mod:`conformance.expect`).

The implementation under test is any module with torch.distributed.nn.functional's
signatures (:data:`DEFAULT_IMPL` by default); ``all_gather_single`` may be
spelled ``_all_gather_base``.  Groups come from the process-group module
(``new_group``/``get_rank``/``ReduceOp``): tensorplay.distributed for our
implementation, torch.distributed for torch's.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from tensorplay.distributed import state as dist_state

from .cases import Case, output_buffers, rank_inputs, split_sizes, upstream_grads

__all__ = ["DEFAULT_IMPL", "KNOWN_IMPLS", "NOT_IMPLS", "RankOutcome", "check_impl_name", "default_dist_module",
           "load_module", "resolve_function", "run_case"]

DEFAULT_IMPL = "tensorplay.distributed.nn.functional"
#: names an implementation may use instead of ours
ALIASES = {"all_gather_single": ("_all_gather_base", "all_gather_base", "all_gather_into_tensor")}


#: implementations that ship with tensorplay and torch (any module or .py file with the same signatures works too)
KNOWN_IMPLS = {
    DEFAULT_IMPL: "the default: tensorplay's autograd collectives",
    "torch.distributed.nn.functional": "torch's autograd collectives, with --backend gloo or nccl",
}
#: modules people pass by mistake: they have functions with the collectives' names but other meanings
NOT_IMPLS = {
    "torch": "torch's tensor library (torch.gather and torch.scatter are indexing ops)",
    "torch.nn.functional": "torch's neural-network functions",
    "torch.distributed": "torch's c10d collectives: they write into their arguments and have no autograd",
    "torch.distributed._functional_collectives": "torch's traceable collectives: other signatures "
                                                 "(group as a required argument, AsyncCollectiveTensor results)",
    "tensorplay": "tensorplay's tensor namespace",
    "tensorplay.distributed": "tensorplay's c10d-style collectives: they write into their arguments and have no "
                              "autograd",
}


def check_impl_name(impl: str) -> str:
    """Empty when ``impl`` can be an implementation (a findable module or an existing ``.py`` file), else
    why not, with the valid values.  Nothing is imported: the ranks import the implementation."""
    valid = ", ".join(f"{k} ({v})" for k, v in KNOWN_IMPLS.items())
    choices = (f"Valid values: {valid}, or any module (a dotted name or a path to a .py file) with "
               f"torch.distributed.nn.functional's signatures")
    name = impl.strip()
    if name in NOT_IMPLS:
        return f"impl={impl!r} is not an implementation of the collectives: it is {NOT_IMPLS[name]}. {choices}"
    if name.endswith(".py") or os.sep in name:
        if not os.path.isfile(name):
            return f"impl={impl!r}: no such file. {choices}"
        return ""
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return f"impl={impl!r}: no module of that name can be imported here. {choices}"
    return ""


def default_dist_module(impl: str) -> str:
    """The process-group module that goes with ``impl``: torch.distributed for torch's modules."""
    return "torch.distributed" if impl.startswith("torch.") else "tensorplay.distributed"


def load_module(name: str) -> ModuleType:
    """Import ``name`` (a dotted module name, or a path to a ``.py`` file)."""
    if name.endswith(".py") or os.sep in name:
        path = os.path.abspath(name)
        modname = "conformance_impl_" + os.path.splitext(os.path.basename(path))[0]
        mod = sys.modules.get(modname)
        if mod is not None and getattr(mod, "__file__", None) == path:
            return mod
        spec = importlib.util.spec_from_file_location(modname, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load a module from {path!r}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        spec.loader.exec_module(mod)
        return mod
    return importlib.import_module(name)


def resolve_function(impl: ModuleType, collective: str) -> Any:
    """``impl``'s function for ``collective`` (trying the known aliases); ``AttributeError`` says which."""
    for name in (collective, *ALIASES.get(collective, ())):
        fn = getattr(impl, name, None)
        if callable(fn):
            return fn
    tried = ", ".join((collective, *ALIASES.get(collective, ())))
    raise AttributeError(f"the implementation {impl.__name__} has no function for {collective} (tried {tried})")


@dataclass
class RankOutcome:
    """What one rank reports back for one case.

    ``stage`` is where an error happened: ``"setup"`` (groups, inputs),
    ``"forward"``, ``"backward"``; ``None`` when the rank finished.
    """

    rank: int
    member: bool = True
    outputs: Any = None
    grads: list[Any] | None = None
    stage: str | None = None
    error_type: str | None = None
    error: str | None = None
    traceback: str | None = None
    mutated: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: device type of each result before it was copied to the CPU for the trip home
    output_devices: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.error_type is not None


def _group_for(case: Case, dist: Any, generation: int) -> Any:
    """The case's subgroup: every rank of the world calls new_group, members or not, with the ranks in the drawn
    order.  Groups are cached for as long as the rank's world lives (a pool's world serves many cases; a
    simulated world, one), and dropped after a failure (the old groups may hold half-finished collectives)."""
    if case.group is None:
        return None
    st = dist_state.current()
    cache = st.cache if st is not None else {}
    if cache.get("conformance-generation") != generation:
        cache.clear()
        cache["conformance-generation"] = generation
    key = ("conformance-group", dist.__name__, case.world_size, case.group)
    g = cache.get(key)
    if g is None:
        g = cache[key] = dist.new_group(list(case.group))
    return g


def _detach(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, (list, tuple)):
        return type(x)(_detach(v) for v in x) if isinstance(x, tuple) else [_detach(v) for v in x]
    return x


def _flat(x: Any) -> list[Any]:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _call(fn: Any, case: Case, x: Any, group: Any, dist: Any, rank: int, device: Any) -> Any:
    """Call the collective as its spec says it is called: ``fn([output,] x, [root,] [splits...,] [op=], group=)``."""
    sp = case.spec
    args = [output_buffers(case, rank, device)] if sp.takes_output else []
    args.append(x)
    if sp.root is not None:
        args.append(case.root)
    if sp.splits:
        args.extend(split_sizes(case, rank))
    kwargs = {"op": getattr(dist.ReduceOp, case.op) if case.op is not None else None} if sp.takes_op else {}
    return fn(*args, **kwargs, group=group)


def run_case(case: Case, impl: str = DEFAULT_IMPL, dist_module: str | None = None, device: str = "cpu",
             generation: int = 0) -> RankOutcome:
    """Run ``case`` on the calling rank and report what happened (never raises).

    Every rank of the world calls this (non-members too: ``new_group`` needs
    everyone).  A member builds its inputs from the case, calls the
    collective, checks it did not modify its inputs, then runs
    ``torch.autograd.backward`` with its own upstream gradient and returns its
    results and its inputs' gradients (as CPU copies).
    """
    out = RankOutcome(rank=-1)
    stage = "setup"
    _quiet_deprecations()
    try:
        dist = load_module(dist_module or default_dist_module(impl))
        out.rank = rank = dist.get_rank()
        st = dist_state.current()
        # the backend places its ranks (one GPU per rank on nccl, cuda:<rank % count> on the simulator)
        dev: Any = st.backend.device_for(device) if st is not None else torch.device(device)
        group = _group_for(case, dist, generation)
        if rank not in case.members:
            out.member = False
            return out
        fn = resolve_function(load_module(impl), case.collective)
        x = rank_inputs(case, rank, dev)
        leaves = [t for t in _flat(x) if isinstance(t, torch.Tensor)]
        before = [t.detach().clone() for t in leaves]

        stage = "forward"
        y = _call(fn, case, x, group, dist, rank, dev)
        for i, (t, b) in enumerate(zip(leaves, before)):
            if not torch.equal(t.detach(), b):
                out.mutated.append("input" if len(leaves) == 1 else f"input[{i}]")
        out.output_devices = [t.device.type for t in _flat(y) if isinstance(t, torch.Tensor)]
        out.outputs = _detach(y)

        if case.differentiable:
            stage = "backward"
            g = upstream_grads(case, rank, dev)
            ys, gs = _flat(y), _flat(g)
            pairs = [(a, b) for a, b in zip(ys, gs) if isinstance(a, torch.Tensor) and a.requires_grad]
            if not pairs:
                out.notes.append("no result requires grad, so this rank could not join the backward")
                out.grads = [None] * len(leaves)
                return out
            if len(pairs) < len(ys):
                out.notes.append(f"{len(ys) - len(pairs)} of {len(ys)} results do not require grad")
            # backward() as a user would call it: it runs every node of the graph, so this rank joins every
            # backward collective even where its own inputs get no gradient (autograd.grad would prune those)
            torch.autograd.backward([a for a, _ in pairs], [b for _, b in pairs])
            out.grads = [_detach(t.grad) for t in leaves]
        return out
    except BaseException as e:  # noqa: BLE001  every failure goes back to the checker
        out.stage = stage
        out.error_type = type(e).__name__
        out.error = str(e)
        out.traceback = traceback.format_exc()
        return out


_QUIET: list[bool] = []


def _quiet_deprecations() -> None:
    """torch.distributed.nn.functional warns on every call that it is deprecated: once per process is enough."""
    if not _QUIET:
        import warnings

        warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.\w+ is deprecated",
                                category=FutureWarning)
        _QUIET.append(True)
