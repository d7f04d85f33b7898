"""Plan cache: a save whose structure did not change on any rank re-plans nothing.

The cache key is every rank's structure hash, agreed in one tiny all-gather (two int64 per
rank) that also carries rank 0's save id. A change on any one rank changes the key on all ranks
at once, so they all re-plan together: no rank can use a stale plan while another re-plans (no
wrong plan, no hang).
"""
from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

from torch.distributed.checkpoint.planner import SavePlan, WriteItem

from asyncckpt.core.snapshot.collectives import Collectives
from asyncckpt.core.storage import commit
from asyncckpt.core.formats.layout import RankLayout
from asyncckpt.core.snapshot.structure import digest


@dataclass
class CachedPlan:
    plan: SavePlan  # this rank's final plan
    layout: RankLayout  # with the rank's planner_data
    sources: list[tuple[str, Optional[WriteItem]]]  # per unique slot: key, and the item if a shard lookup is needed
    byte_items: list[WriteItem]


class PlanCache:
    """The last few plans by structure key (a job alternating between a few structures stays warm)."""

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self._entries: "OrderedDict[Any, CachedPlan]" = OrderedDict()
        self._digests: "OrderedDict[tuple, str]" = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key) -> Optional[CachedPlan]:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return entry

    def peek(self, key) -> Optional[CachedPlan]:
        """The entry for ``key`` if cached, without counting a hit or a miss."""
        return self._entries.get(key)

    def put(self, key, entry: CachedPlan) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def digest(self, description: tuple) -> str:
        """The cross-process digest of a structure description, computed once per structure."""
        found = self._digests.get(description)
        if found is None:
            found = self._digests[description] = digest(description)
            while len(self._digests) > self.capacity:
                self._digests.popitem(last=False)
        return found

    def clear(self) -> None:
        self._entries.clear()
        self._digests.clear()


def agree_on_structure(local_hash: str, agreement: Optional[Collectives], world_size: int, use_collectives: bool, counter: int,
                       failed: bool = False) -> tuple[tuple, str, list[int]]:
    """(cache key, save id, ranks holding an unreported failure) agreed by all ranks, in one
    all-gather of 24 bytes per rank (or none). Sharing the failure flag lets every rank raise
    together instead of one rank leaving the others waiting in a collective."""
    if world_size == 1 or not use_collectives:
        save_id = secrets.token_hex(8) if world_size == 1 else f"n{counter}-{commit.job_token()}"
        return (local_hash, world_size), save_id, []
    values = agreement.gather_ints([int(local_hash[:15], 16), secrets.randbits(62), int(failed)])
    failed_ranks = [rank for rank, v in enumerate(values) if v[2]]
    return (tuple(v[0] for v in values), world_size), format(values[0][1], "016x"), failed_ranks
