"""FSDP1 (``FullyShardedDataParallel``) on stand-ins: where it moves tensors between the CPU and the GPU by
assigning ``.data`` or reads a wrapper subclass's storage, which a stand-in (a wrapper around a CPU tensor)
cannot follow, its step is taken as a GPU run's result requires (patched when FSDP1 is imported, while the
stand-in is enabled: see :mod:`simulator.standin.install`)."""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable

import torch

from simulator.adapters._patch import replace
from simulator.core.state import current_rank_state
from simulator.standin import cuda_api as api
from simulator.standin.tensor import StandInTensor

__all__ = ["ON_IMPORT"]


def _fsdp1_device_id(module: Any) -> Callable[[], None]:
    """``FullyShardedDataParallel`` of a module not on a GPU yet, without a ``device_id`` (or with one without an
    index): the module is given the current ``cuda:i`` as its ``device_id``, and so moved there now (a GPU moves it
    when the program does: a CPU parameter cannot become a stand-in in place once FSDP holds views of it).
    Returns the undo."""
    cls = module.FullyShardedDataParallel
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        dev = kwargs.get("device_id")
        wrapped = kwargs.get("module", args[0] if args else None)
        if isinstance(dev, torch.device) and dev.type == "cuda" and dev.index is None or dev is None and \
                isinstance(wrapped, torch.nn.Module) and not any(p.is_cuda for p in wrapped.parameters()):
            kwargs["device_id"] = torch.device("cuda", api.current_device())
        args = _keep_params_on_device(args, kwargs)
        init(self, *args, **kwargs)

    return replace(cls, "__init__", __init__)


def _keep_params_on_device(args: tuple, kwargs: dict) -> tuple:
    """``FullyShardedDataParallel(cpu_offload=CPUOffload(offload_params=True))``: FSDP1 moves its flat parameter
    between the CPU and the GPU by assigning ``.data``, which turns a GPU tensor into a CPU one in place; a
    stand-in cannot change its class in place once autograd holds it, so the parameters stay on their stand-in
    device (with a warning, once). Values are the same: offloading moves memory, not results. Returns the
    arguments to construct with."""
    at_3 = len(args) > 3  # FullyShardedDataParallel(module, process_group, sharding_strategy, cpu_offload, ...)
    offload = args[3] if at_3 else kwargs.get("cpu_offload")
    if not getattr(offload, "offload_params", False):
        return args
    from torch.distributed.fsdp import CPUOffload

    if at_3:
        args = (*args[:3], CPUOffload(offload_params=False), *args[4:])
    else:
        kwargs["cpu_offload"] = CPUOffload(offload_params=False)
    rs = current_rank_state()
    warned = rs.own() if rs is not None else _warned  # once per rank, as once per process on GPUs
    if (0, "cpu_offload") not in warned:
        warned[(0, "cpu_offload")] = True
        warnings.warn("simulator.standin: FullyShardedDataParallel(cpu_offload=CPUOffload(offload_params=True)) "
                      "keeps the parameters on their stand-in GPU: the results are the same, but memory figures "
                      "count them on the device (see docs/deviations.md)", UserWarning, stacklevel=3)
    return args


_warned: dict[tuple[int, str], bool] = {}  # what was warned about off the simulated ranks


def _fsdp1_sync_states(module: Any) -> Callable[[], None]:
    """FSDP1's ``sync_module_states=True`` broadcasts the tensors inside a wrapper subclass (a DTensor's local
    shard), and so took a stand-in's CPU storage for a CPU parameter ("requires them to be on GPU"): a stand-in
    is broadcast as itself, as a GPU tensor is. Returns the undo."""
    original = module.is_traceable_wrapper_subclass

    def is_traceable_wrapper_subclass(t: Any) -> bool:
        return not isinstance(t, StandInTensor) and original(t)

    return replace(module, "is_traceable_wrapper_subclass", is_traceable_wrapper_subclass)


def _state_dict_on_cpu(module: Any) -> Callable[[], None]:
    """A full state dict with ``offload_to_cpu=True`` (FSDP1's checkpoint recipe; also ``summon_full_params(
    offload_to_cpu=True)``): FSDP1 moves the unsharded flat parameter to the CPU by assigning ``.data`` and reads
    the parameters' views there. On stand-ins the flat parameter stays on its device (``to_cpu`` holds it there),
    and the state dict's parameters are copied to the CPU once cloned, so the state dict holds CPU tensors with a
    GPU's values. Returns the undo."""
    handle = module.FlatParamHandle
    to_cpu = handle.to_cpu

    @functools.wraps(to_cpu)
    def stays(self: Any) -> Any:
        return contextlib.nullcontext() if self.flat_param.is_cuda else to_cpu(self)

    return replace(handle, "to_cpu", stays)


def _cloned_params_to_cpu(module: Any) -> Callable[[], None]:
    """The other half of :func:`_state_dict_on_cpu`: the parameters FSDP1's hook cloned go to the CPU. Returns the
    undo."""
    hook = module._full_post_state_dict_hook

    @functools.wraps(hook)
    def post_hook(mod: Any, fsdp_state: Any, state_dict: dict[str, Any], prefix: str) -> dict[str, Any]:
        out = hook(mod, fsdp_state, state_dict, prefix)
        if fsdp_state._state_dict_config.offload_to_cpu:
            for k, v in out.items():
                if isinstance(v, torch.Tensor) and v.is_cuda and getattr(v, "_has_been_cloned", False):
                    out[k] = v.cpu()
                    out[k]._has_been_cloned = True
        return out

    return replace(module, "_full_post_state_dict_hook", post_hook)


#: (module, patch) pairs: each patch is applied when its module is imported while the stand-in is enabled
ON_IMPORT = (("torch.distributed.fsdp.fully_sharded_data_parallel", _fsdp1_device_id),
             ("torch.distributed.fsdp._init_utils", _fsdp1_sync_states),
             ("torch.distributed.fsdp._flat_param", _state_dict_on_cpu),
             ("torch.distributed.fsdp._state_dict_utils", _cloned_params_to_cpu))
