"""The memory tier of one ``Checkpointer``: where each checkpoint goes, and what follows its commit.

With ``memory_tier`` on, a checkpoint asked for at its durable path (``run/checkpoint-20``) is saved at its memory
path on this node (``storage.tier.memory_path``) by the usual save machinery, so it is committed there exactly as a
checkpoint is anywhere (staging, commit record, checksums), at the speed of a copy into shared memory. Behind its
commit, in the writer's queue, come:

* every ``persist_every``-th checkpoint of a durable root (and, at the end of a run, the last one): its copy to
  the durable path, committed there as any checkpoint (``CopyRequest``): no second snapshot, the writer reads the
  memory copy;
* the memory tier's own retention: the memory checkpoints of the root beyond the newest ``keep`` are removed
  (the durable ones are the framework's to rotate, as without the tier).

A root whose checkpoints do not fit in the memory the tier may use is saved durably only, with one warning saying
what would fit. A run that ends normally (``finish``) persists its last checkpoint and leaves nothing in memory.
"""
from __future__ import annotations

import logging
import os
import posixpath
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from asyncckpt.core.api.options import MemoryTier
from asyncckpt.core.storage import tier
from asyncckpt.core.storage.backend import is_url
from asyncckpt.core.writer.mirror import CopyRequest
from asyncckpt.core.writer.retention import MemoryRetentionRequest

logger = logging.getLogger("asyncckpt.core")


@dataclass
class _Run:
    """The checkpoints of one durable root, as this process saved them."""

    directory: str  # its run directory in memory on this node
    owner: str  # this process's owner token in it (``tier.claim_run``)
    saves: int = 0  # checkpoints saved: distinct steps (a framework may save one step under two names)
    last_step: Optional[int] = None
    last_bytes: int = 0  # the size of its last checkpoint: what the next one is expected to need
    unpersisted: Optional[str] = None  # the memory path of its newest checkpoint not written durably (yet)
    durable_only: bool = False  # its checkpoints do not fit in memory


@dataclass
class Placement:
    """Where one checkpoint went: its memory path and its durable one, and whether it is also persisted."""

    memory: str
    durable: str
    persist: bool
    run: _Run = field(repr=False)


class MemoryTiers:
    def __init__(self, options: MemoryTier, object_store: Any) -> None:
        self.options, self.object_store = options, object_store
        self.root = tier.memory_root(options.root)
        self._runs: dict[str, _Run] = {}
        self._placed: dict[str, Placement] = {}  # by memory path
        self._lock = threading.Lock()

    def place(self, durable: str, nbytes: int, step: Optional[int], *, durable_too: Optional[bool] = None) -> str:
        """Where the checkpoint of ``step`` asked for at ``durable`` (of ``nbytes`` on this rank, 0 where not known
        yet) is saved: its memory path (counted for the persist cadence, one count per step: Lightning saves a
        step's ``last.ckpt`` beside its top-k file; ``durable_too`` overrides the cadence), or ``durable`` itself
        where its root's checkpoints do not fit in memory (one warning saying what would)."""
        root = posixpath.dirname(durable) if is_url(durable) else os.path.dirname(durable)
        with self._lock:
            run = self._runs.get(root)
            if run is None:
                run = self._runs[root] = self._open(root)
            if not run.durable_only:
                run.durable_only = not self._fits(run, max(nbytes, run.last_bytes))
            if run.durable_only:
                return durable
            if step is None or step != run.last_step:
                run.saves, run.last_step = run.saves + 1, step
            memory = os.path.join(run.directory, os.path.basename(durable.rstrip("/")))
            persist = run.saves % self.options.persist_every == 0 if durable_too is None else durable_too
            self._placed[memory] = Placement(memory, durable, persist, run)
            return memory

    def placement(self, memory: str) -> Optional[Placement]:
        """Where the checkpoint saved at ``memory`` went (None: not a memory save of this process)."""
        return self._placed.get(memory)

    def run_dir(self, durable_root: str) -> str:
        """The memory run directory of ``durable_root`` on this node (whether or not it exists)."""
        return tier.run_dir(durable_root, self.options.root)

    def memory_path(self, durable: str) -> str:
        """Where the memory copy of the checkpoint at ``durable`` lives on this node (whether or not it is there)."""
        return tier.memory_path(durable, self.options.root)

    def _open(self, root: str) -> _Run:
        """A root's run directory, this process its owner (first: a restart must not take its own tier for an
        orphan), and the orphaned runs of dead jobs on this node gone."""
        directory = tier.open_run(root, self.options.root)
        run = _Run(directory, tier.claim_run(directory))
        tier.remove_orphans(self.root)
        return run

    def _fits(self, run: _Run, nbytes: int) -> bool:
        capacity = tier.capacity(self.root, self.options.max_bytes, for_run=run.directory)
        if tier.fits(tier.needed_bytes(nbytes, self.options.keep), capacity):
            return True
        logger.warning("asyncckpt: the memory tier does not fit the checkpoints of %s: %s; saving them to storage "
                       "only", tier.durable_root_of(run.directory), tier.what_would_fit(nbytes, self.options.keep,
                                                                                         capacity))
        return False

    def follow_ups(self, memory: str, nbytes: int, *, publishes: bool) -> list[tuple[str, str, Any]]:
        """The writer jobs behind the commit of the checkpoint saved at ``memory`` (``nbytes`` on this rank), as
        ``(kind, path, request)``: its persistence when due, by the rank that publishes it (``publishes``); then,
        by one rank per node, the tier's retention on this node."""
        placed = self._placed.get(memory)
        if placed is None:
            return []
        placed.run.unpersisted = None if placed.persist else memory
        placed.run.last_bytes = nbytes
        jobs = []
        if placed.persist and publishes:
            jobs.append(("persist", placed.durable, CopyRequest(memory, placed.durable, self.object_store)))
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            jobs.append(("retention", placed.run.directory, MemoryRetentionRequest(placed.run.directory,
                                                                                   self.options.keep)))
        return jobs

    def unpersisted(self) -> list[Placement]:
        """The newest checkpoint of each root that is in memory only: what the end of a run persists."""
        with self._lock:
            return [self._placed[run.unpersisted] for run in self._runs.values() if run.unpersisted is not None]

    def clear(self, *, remove: bool) -> None:
        """The end of a run: this process no longer owns its run directories; with ``remove`` (one process per
        node), this node's memory copies of every root it saved go."""
        with self._lock:
            runs, self._runs, self._placed = list(self._runs.values()), {}, {}
        for run in runs:
            tier.release_run(run.directory, run.owner)
            if remove:
                tier.remove_run(run.directory)
