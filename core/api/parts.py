"""The parts a ``Checkpointer`` is made of, built once and shared with the rooms that work for it.

The facade (``checkpointer``), what follows a commit (``follow_ups``) and a directory transaction
(``directory``) read the same ledger, hand-over, buffers and memory tier through this one object, so that
none of them takes the others' internals one argument at a time (docs/DESIGN.md, "The Checkpointer").
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.distributed as dist

from asyncckpt.core.api.commit_hooks import CommitHooks
from asyncckpt.core.api.options import CheckpointOptions
from asyncckpt.core.client.ledger import Ledger
from asyncckpt.core.snapshot.buffer_pool import BufferPool
from asyncckpt.core.snapshot.dist_env import default_store, dist_ready, rank_and_world
from asyncckpt.core.snapshot.handoff import Handoff, SnapshotThread
from asyncckpt.core.snapshot.file_snapshots import FileSnapshots
from asyncckpt.core.snapshot.sharded_save import ShardedSaves
from asyncckpt.core.snapshot.tensor_copy import CopyThreads
from asyncckpt.core.storage import object_store as object_store_module
from asyncckpt.core.storage.backend import backend_for, exists
from asyncckpt.core.tier.job import NoTier, Tier, tier_of


@dataclass(eq=False)
class Parts:
    """One Checkpointer's components (``build``), and the few questions every room asks of them."""

    options: CheckpointOptions
    process_group: Optional[dist.ProcessGroup]
    use_collectives: bool
    ledger: Ledger
    hooks: CommitHooks
    buffers: BufferPool
    copy_threads: CopyThreads
    handoff: Handoff
    snapshot_thread: SnapshotThread
    files: FileSnapshots
    sharded: ShardedSaves
    tier: Tier | NoTier
    stats: Counter = field(default_factory=Counter)  # requests by kind, and removals/links queued behind a pending save
    closed: bool = False

    @classmethod
    def build(cls, options: CheckpointOptions, process_group: Optional[dist.ProcessGroup], use_collectives: bool) -> "Parts":
        store = lambda: default_store() if use_collectives else None  # noqa: E731
        ledger = Ledger(max_in_flight=options.max_in_flight, timeout=options.timeout, store=store,
                        writer_idle_timeout=options.writer_idle_timeout)
        buffers, copy_threads = BufferPool(ledger.queue.drop_buffer), CopyThreads()
        return cls(options, process_group, use_collectives, ledger, CommitHooks(ledger), buffers, copy_threads,
                   Handoff(ledger, store), SnapshotThread(options.timeout), FileSnapshots(buffers, copy_threads),
                   ShardedSaves(buffers, copy_threads, direct_io=options.direct_io, io_threads=options.io_threads,
                                timeout=options.timeout, share_unchanged=options.share_unchanged),
                   tier_of(options, store=store, queue=ledger.queue, process_group=process_group))

    def store(self) -> Any:
        """The default group's Store where the Checkpointer runs collectives, else None."""
        return default_store() if self.use_collectives else None

    def collectives(self) -> bool:
        """Whether this Checkpointer's SPMD calls use torch.distributed (on, and running)."""
        return self.use_collectives and dist_ready()

    def rank(self) -> int:
        return rank_and_world(self.process_group)[0]

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("Checkpointer is closed")

    def will_exist(self, path: str) -> bool:
        """What the last queued work on ``path`` does to it (creates, deletes), else whether it exists now."""
        queued = self.ledger.will_exist(path)
        if queued is not None:
            return queued
        with object_store_module.using(self.options.object_store):
            return exists(backend_for(path), path)

    def placed(self, path: str, durable: Optional[bool], nbytes: Callable[[], int], step: Optional[int],
                agree_over: Any = False) -> str:
        """Where a checkpoint asked for at ``path`` (of ``nbytes()`` on this rank) is saved: with the memory tier,
        in memory (``Tier.place``; ``durable``: also written durably now, whatever the cadence), else at ``path``.
        ``agree_over``: the process group of a save every rank of it makes (None: the default group), whose ranks
        must all place it alike; False: a save of this rank alone."""
        if not self.tier.active:
            return path  # (``nbytes`` not taken: it costs a walk of the state)
        self.tier.connect()
        return self.tier.place(path, nbytes(), step, durable_too=durable, agree_over=agree_over)
