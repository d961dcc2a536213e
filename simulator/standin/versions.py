"""The versions a CUDA build names, as the stand-in answers them (``torch.version.cuda``, cuDNN's, NCCL's)."""
from __future__ import annotations

import torch

__all__ = ["CUDA_BUILD", "STANDIN_NCCL_VERSION", "STANDIN_CUDA_VERSION", "STANDIN_CUDNN_VERSION"]

#: whether this torch is a CUDA build (on a machine without a GPU, or the stand-in would not start): the versions
#: below are then the build's own, which it answers with or without a GPU
CUDA_BUILD = torch.version.cuda is not None
#: what ``torch.cuda.nccl.version()`` answers on stand-ins (a release of NCCL's 2.x line; nothing depends on it)
STANDIN_NCCL_VERSION = torch.cuda.nccl.version() if CUDA_BUILD else (2, 27, 5)
#: what ``torch.version.cuda`` answers on stand-ins: a CUDA build names its toolkit there, and programs (and DDP's
#: ``bf16_compress_hook`` check) read "a CUDA build" from it; a 12.x release, as torch's GPU wheels are built with
STANDIN_CUDA_VERSION = torch.version.cuda if CUDA_BUILD else "12.8"
#: what ``torch.backends.cudnn.version()`` answers on stand-ins (a cuDNN 9 release, as GPU wheels bundle; nothing
#: depends on it: no operator takes a cuDNN path, see :func:`_cudnn_acceptable`)
STANDIN_CUDNN_VERSION = (torch.backends.cudnn.version() if CUDA_BUILD else None) or 91002
