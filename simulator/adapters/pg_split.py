"""``ProcessGroup.split_group`` and ``merge_remote_group`` of a simulated group.

torch's C++ ``ProcessGroup`` splits a group by splitting the backends registered in it; a simulated group has
none on the C++ side, so torch's own methods would dereference a missing backend (a segfault: PyTorch's
``test_dist2.py`` took the whole test session down). A split is a group over some of the members, made by those
members only, as gloo's split is; a merge is a group over the ranks that merge through one store.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Sequence

import torch.distributed.distributed_c10d as c10d

from tensorplay.distributed import state as dist_state
from tensorplay.distributed.errors import DistRuntimeError, format_message

from simulator.adapters import torch_groups

__all__ = ["SplitMixin"]


class SplitMixin:
    """What :class:`~simulator.adapters.process_group.SimProcessGroup` answers for torch's splitting methods."""

    #: builds a group the program made itself over some ranks (``process_group.direct_group``, set there)
    direct: Any = None

    def split_group(self, ranks: Sequence[int], timeout: timedelta | None = None, opts: Any = None,
                    group_name: str | None = None, group_desc: str | None = None) -> Any:
        """A group over ``ranks`` (ranks of this group) for its members, ``None`` for the others (torch's rule)."""
        chosen = sorted({int(r) for r in ranks})
        bad = [r for r in chosen if not 0 <= r < self.size()]
        if bad or not chosen:
            raise DistRuntimeError(format_message(
                "ProcessGroup.split_group", "the ranks must be ranks of this group", rank=self.rank(),
                values={"ranks": list(ranks), "group_size": self.size()},
                fix=f"pass ranks between 0 and {self.size() - 1} (ranks of the group being split)"))
        if self.rank() not in chosen:
            return None
        return self._made(tuple(self._g.ranks[r] for r in chosen), opts, timeout,  # type: ignore[attr-defined]
                          group_name or f"{self._parent_name()}:split:{chosen}", group_desc)

    def merge_remote_group(self, store: Any, size: int, timeout: timedelta | None = None,
                           group_name: str | None = None, group_desc: str | None = None) -> Any:
        """A group of ``size`` over the ranks that merge through ``store``: each takes the next rank the store
        counts out, as torch's C++ does (in the order the simulator's schedule brings them)."""
        st = dist_state.current()
        rank = int(store.add("mergeGroupRank", 1)) - 1
        key = ("merge_remote_group", torch_groups.store_key(store))
        members = torch_groups.join(st.backend.world_key(), key, rank, int(size), st.rank, st.world_size)
        return self._made(members, None, timeout, group_name or f"{self._parent_name()}:merged", group_desc)

    def _parent_name(self) -> str:
        # (a group built by the program itself has no name: torch's own says "ProcessGroup name not set")
        return self.__dict__.get("_tp_name") or c10d._world.pg_names.get(self) or "unnamed"

    def _made(self, members: tuple[int, ...], opts: Any, timeout: timedelta | None, name: str,
              desc: str | None) -> Any:
        options = opts if opts is not None else c10d.ProcessGroupGloo._Options()
        options._timeout = timeout or getattr(opts, "_timeout", None) or self.options._timeout  # type: ignore
        made = self.direct(members, options)
        made._named = self._named  # type: ignore[attr-defined]
        made._tp_name = name
        if desc:
            made._set_group_desc(desc)
        return made
