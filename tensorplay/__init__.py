"""tensorplay: distributed deep learning on PyTorch, simulation first.

``import tensorplay as tp`` is the tensor front door.  Tensors *are* torch
tensors: every name torch exports is re-exported unchanged (``tp.randn``,
``tp.float32``, ``tp.nn``, ``tp.optim``...), so ``tp.nn.Linear is
torch.nn.Linear``.  The one part that is ours is :mod:`tensorplay.distributed`.

Example::

    >>> import torch
    >>> import tensorplay as tp
    >>> tp.nn.Linear is torch.nn.Linear
    True
    >>> x = tp.randn(4, 8, requires_grad=True)
    >>> layer = tp.nn.Linear(8, 2)
    >>> layer(x).sum().backward()
    >>> tuple(layer.weight.grad.shape)
    (2, 8)
"""
from __future__ import annotations

import torch as _torch
from torch import *  # noqa: F401,F403  (the front door re-exports torch as is)
from torch import (  # noqa: F401  submodules are not in torch.__all__
    Tensor,
    autograd,
    cuda,
    fft,
    linalg,
    nn,
    optim,
    special,
    testing,
    utils,
)

__version__ = "0.1.0"

from . import distributed  # noqa: E402  (ours, not torch.distributed)


def __getattr__(name: str):
    # Anything torch has that the star import did not bring (private helpers,
    # lazily loaded submodules) resolves to torch's own object.
    try:
        return getattr(_torch, name)
    except AttributeError:
        raise AttributeError(f"module 'tensorplay' has no attribute {name!r}") from None
