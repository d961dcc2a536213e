"""Process groups: an ordered list of global ranks plus the backend's handle.

Rank conventions (see docs/design.md): a *global* rank numbers a process in the
world; a *group* rank is its position in ``ProcessGroup.ranks``.  Group ranks
follow torch's order: :func:`new_group` sorts the ranks it is given, so
``new_group([2, 0])`` has group rank 0 = global 0 and group rank 1 = global 2.
Public functions take global ``src``/``dst``; the API converts them to group
ranks once, and backends only ever see group ranks.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from .backends.base import Backend

__all__ = ["ProcessGroup", "group", "GroupMember"]


@functools.lru_cache(maxsize=8)
def _range_ranks(n: int) -> tuple[int, ...]:
    return tuple(range(n))


@functools.lru_cache(maxsize=64)
def _interned(ranks: tuple[int, ...]) -> tuple[tuple[int, ...], dict[int, int]]:
    """One shared (read-only) ranks tuple and rank -> group-rank index per distinct rank list."""
    return ranks, {g: i for i, g in enumerate(ranks)}


class ProcessGroup:
    """A group of ranks on one backend.

    Attributes:
        ranks: global ranks in group-rank order (``ranks[i]`` has group rank ``i``).
        backend: the per-rank backend object that runs the group's collectives.
        handle: whatever the backend needs to address the group (a torch
            ProcessGroup on c10d backends, a group id on the simulator).
        group_id: 0 for the world group, then 1, 2, ... in creation order.
    """

    __slots__ = ("ranks", "_index", "backend", "handle", "group_id", "__weakref__")

    def __init__(self, ranks: Sequence[int], backend: "Backend", handle: Any, group_id: int) -> None:
        # Interned: every simulated rank builds its own world group, and one
        # tuple + dict per rank would cost O(world_size^2) memory and time.
        key = _range_ranks(len(ranks)) if isinstance(ranks, range) and ranks == range(len(ranks)) \
            else tuple(int(r) for r in ranks)
        self.ranks, self._index = _interned(key)
        self.backend = backend
        self.handle = handle
        self.group_id = group_id

    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    def rank(self) -> int:
        """The calling rank's group rank, or -1 when it is not a member."""
        return self._index.get(self.backend.rank, -1)

    def group_rank(self, global_rank: int) -> int | None:
        """Group rank of ``global_rank``, or ``None`` when it is not a member."""
        return self._index.get(global_rank)

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def __contains__(self, global_rank: object) -> bool:
        return global_rank in self._index

    def __repr__(self) -> str:
        return f"ProcessGroup(ranks={list(self.ranks)}, backend={self.backend.name!r}, id={self.group_id})"


class _WorldSentinel:
    """``group.WORLD``: stands for the default (world) group of the calling rank.

    A sentinel rather than the group object itself, because on the simulator
    every rank thread has its own world.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "group.WORLD"


class group:  # noqa: N801  (torch spells it in lower case)
    """Namespace mirroring ``torch.distributed.group``: ``group.WORLD`` is the default group."""

    WORLD = _WorldSentinel()


class GroupMember:
    """Mirror of ``torch.distributed.GroupMember``."""

    WORLD = group.WORLD
    NON_GROUP_MEMBER = -100
