"""``WorkerInfo`` and the rules for naming a destination worker."""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["WorkerInfo", "NAME_PATTERN"]

#: what torch accepts as a worker name: letters, digits, ``_``, ``:``, ``-``; at most 127 characters
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_:\-]{1,127}$")


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's name and its id (its rank in the RPC world).

    Every call that takes a destination (``to=``) accepts a ``WorkerInfo``, a
    worker name or a rank.  ``torch.distributed.rpc.WorkerInfo`` objects are
    accepted too and compare by ``(name, id)``.
    """

    name: str
    id: int

    def __repr__(self) -> str:
        return f"WorkerInfo(name={self.name!r}, id={self.id})"
