"""Backend names real torch refuses, and what it raises for them: the reference both front doors are held to."""
from __future__ import annotations

import re
import warnings
from typing import Any

#: names torch's init_process_group refuses: misspelt, empty, a bad device:backend string (and, at the end, a
#: value that is not a string at all)
REFUSED_NAMES: list[Any] = ["glo", "glooo", "GLO", "", "cpu:glo", "gloo,nccl", "cpu:gloo:x", "cpu:gloo,cpu:gloo"]
NOT_A_NAME: list[Any] = [5]


def torch_refusal(backend: Any) -> tuple[type, str]:
    """What torch's own ``init_process_group`` raises for ``backend`` (one rank on an in-memory store)."""
    import torch.distributed as tdist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that an unknown name's devices are unknown, then refuses it
        try:
            tdist.init_process_group(backend, store=tdist.HashStore(), rank=0, world_size=1)
        except Exception as e:  # noqa: BLE001
            return type(e), re.sub(r"\s+", " ", str(e))  # (torch's ValueError spans indented lines)
    tdist.destroy_process_group()
    raise AssertionError(f"torch accepted backend={backend!r}; take it out of the refused names")
