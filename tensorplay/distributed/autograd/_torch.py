"""torch's distributed-autograd engine, as the TensorPipe transport's :class:`DistributedAutograd`."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ..errors import DistValueError
from ..rpc.errors import rpc_message

__all__ = ["TorchAutograd"]


@contextlib.contextmanager
def _torch_context(call: str, worker: str, context_id: int) -> Iterator[None]:
    """torch's "Could not find autograd context" as our DistValueError naming the call, worker and context."""
    try:
        yield
    except RuntimeError as e:
        if "Could not find autograd context" in str(e):
            raise DistValueError(rpc_message(
                call, "no such autograd context on this worker", worker=worker,
                values={"context_id": context_id}, fix="call it inside `with context() as context_id:`")) from e
        raise


class TorchAutograd:
    """``torch.distributed.autograd`` for worker ``worker`` of a TensorPipe world."""

    def __init__(self, worker: str) -> None:
        self.worker = worker

    def context(self) -> Any:
        import torch.distributed.autograd as tda

        return tda.context()

    def backward(self, context_id: int, roots: list[torch.Tensor], retain_graph: bool) -> None:
        import torch.distributed.autograd as tda

        with _torch_context("autograd.backward", self.worker, context_id):
            tda.backward(context_id, roots, retain_graph)

    def get_gradients(self, context_id: int) -> dict[torch.Tensor, torch.Tensor]:
        import torch.distributed.autograd as tda

        with _torch_context("autograd.get_gradients", self.worker, context_id):
            return tda.get_gradients(context_id)
