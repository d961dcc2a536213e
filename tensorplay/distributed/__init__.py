"""tensorplay.distributed: process groups and collectives with torch.distributed's signatures.

Three backends behind one interface: ``"gloo"`` and ``"nccl"`` (torch's c10d,
launched with torchrun) and ``"sim"`` (the in-process simulator, see
:mod:`simulator`).  Code written against ``torch.distributed`` ports by
changing the import.

Example (4 ranks)::

    >>> x = tp.tensor([float(dist.get_rank())])
    >>> dist.all_reduce(x)
    >>> x.item()                              # 0 + 1 + 2 + 3, on each of the 4 ranks
    6.0
"""
from __future__ import annotations

from .api import (
    DEFAULT_TIMEOUT,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    destroy_process_group,
    gather,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    init_process_group,
    irecv,
    is_available,
    is_initialized,
    isend,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
)
from .backends import Backend, Work, register_backend
from .errors import (
    DistBackendError,
    DistError,
    DistRuntimeError,
    DistTimeoutError,
    DistTypeError,
    DistValueError,
    NotInitializedError,
    RankNotInGroupError,
)
from .group import GroupMember, ProcessGroup, group
from .objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from .p2p_batch import P2POp, batch_isend_irecv
from .reduce_op import ReduceOp

__all__ = [
    "DEFAULT_TIMEOUT", "Backend", "DistBackendError", "DistError", "DistRuntimeError", "DistTimeoutError",
    "DistTypeError", "DistValueError", "GroupMember", "NotInitializedError", "ProcessGroup", "RankNotInGroupError",
    "ReduceOp", "Work", "all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all", "all_to_all_single",
    "barrier", "broadcast", "destroy_process_group", "gather", "get_backend", "get_global_rank", "get_group_rank",
    "get_process_group_ranks", "get_rank", "get_world_size", "group", "init_process_group", "irecv",
    "is_available", "is_initialized", "isend", "new_group", "recv", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "register_backend", "scatter", "send",
    # objects and batched point to point (objects.py, p2p_batch.py)
    "P2POp", "all_gather_object", "batch_isend_irecv", "broadcast_object_list", "gather_object",
    "recv_object_list", "scatter_object_list", "send_object_list",
]
