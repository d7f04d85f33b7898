"""A memory-tier checkpoint written durably: every rank's writer writes its own files, from its own node's memory.

More: docs/MODULES.md, core/tier/requests.py.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Optional

from asyncckpt.core.errors import CheckpointTimeoutError, CheckpointWriteError
from asyncckpt.core.formats import names
from asyncckpt.core import tier
from asyncckpt.core.storage import commit, spares
from asyncckpt.core.storage.staging import Staging, staging_dir_for
from asyncckpt.core.writer.barrier import BarrierSpec, poll
from asyncckpt.core.writer.mirror import mapped
from asyncckpt.core.writer.protocol import RequestContext

#: The durable copy's meeting point is named after its save's id with this after it: the Store keys of the memory
#: save's own meeting (``barrier.StoreBarrier``) are not the copy's.
DURABLE_SUFFIX = ".durable"

#: Durable copies saved beside their memory save (``save_beside``), by save id: their outcome.
_BESIDE: dict[str, "Future[None]"] = {}
_BESIDE_LOCK = threading.Lock()
_BESIDE_KEPT = 8  # saves whose memory commit failed leave theirs (nobody asks): the oldest beyond these are forgotten
_BESIDE_SAVES = ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-persist")  # starts no thread until used


def save_beside(save: Any, context: RequestContext) -> None:
    """Save this rank's part of the sharded memory-tier save ``save`` (a ``ShareRequest`` whose ``tier.persist_to``
    is a local durable path) there too, from the same snapshot, on a thread of its own beside the save in memory:
    its data file, objects and sidecar written as a durable save writes them, the ranks meeting by markers in its
    staging directory (``BarrierSpec`` of kind ``"files"``, the durable storage every node reaches; the Store's
    channel is the memory save's meanwhile), rank 0 committing it with the same save id. The durable copy is then
    committed about when a durable save would be, rather than after the memory commit and its replicas: on this
    project's machine, a replica took longer than the disk (docs/memory_tier.md). Its ``PersistRequest`` waits for
    the outcome."""
    target = save.tier.persist_to
    key = save.save_id + DURABLE_SUFFIX
    staging = staging_dir_for(target, key)
    durable = replace(save, final_path=target, staging_dir=staging, coordinator=save.rank == 0, tier=None,
                      object_store=None, barrier=BarrierSpec("files", key, save.world_size, staging, target,
                                                             save.barrier.timeout, None, save.save_id))
    with _BESIDE_LOCK:
        while len(_BESIDE) >= _BESIDE_KEPT:
            _BESIDE.pop(next(iter(_BESIDE)))
        _BESIDE[save.save_id] = _BESIDE_SAVES.submit(durable.run, context)


def _saved_beside(save_id: str) -> Optional["Future[None]"]:
    with _BESIDE_LOCK:
        return _BESIDE.pop(save_id, None)


@dataclass(frozen=True)
class PersistRequest:
    """This rank's part of writing the memory checkpoint ``source`` (this node's copy of the save ``save_id``)
    durably at ``target``. ``barrier_kind``: how the ranks meet, as they did for the save (``BarrierSpec.kind``)."""

    source: str
    target: str
    rank: int
    world_size: int
    save_id: str
    barrier_kind: str
    timeout: float
    direct_io: bool = True
    io_threads: int = 2
    object_store: Any = None

    def run(self, context: RequestContext) -> None:
        key = self.save_id + DURABLE_SUFFIX
        place = Staging(staging_dir_for(self.target, key), self.target, self.object_store, self.rank == 0,
                        self.direct_io, self.io_threads)
        barrier = context.barrier(BarrierSpec(self.barrier_kind, key, self.world_size, place.directory, self.target,
                                              self.timeout, self.object_store, self.save_id))
        beside = _saved_beside(self.save_id)
        if beside is not None:  # saved durably beside the memory save, from its snapshot
            beside.result()
            return
        try:
            record = node_copy(self.source, self.save_id, self.timeout)
            if place.tidy_parent() is not None:
                context.tidy(place.tidy_parent())
            place.claim(self.rank, context.token())
            barrier.begin(self.rank)
            for name in own_files(record, self.rank):
                with mapped(os.path.join(self.source, name)) as (view, size):
                    place.write_image(name, view, size, None)
            barrier.arrive(self.rank)
        except BaseException as e:
            barrier.fail(self.rank, f"{type(e).__name__}: {e}")
            raise CheckpointWriteError(f"rank {self.rank}: writing {self.source} durably: {type(e).__name__}: {e}") \
                from e
        if self.rank != 0:
            barrier.wait_commit()
            return
        try:
            barrier.wait_all()
            replaced = place.publish({key: value for key, value in record.items() if key != tier.TIER_ENTRY})
            barrier.committed()
        except BaseException as e:
            barrier.fail(self.rank, f"{type(e).__name__}: {e}")
            raise
        if replaced is not None:
            context.after_reply(lambda: place.delete(replaced, context.token()))


def own_files(record: dict, rank: int) -> list[str]:
    """The files of the checkpoint whose commit record is ``record`` that ``rank`` writes durably: those it wrote
    (``tier.writer_of``)."""
    return sorted(name for name in record.get("files", {}) if tier.writer_of(record, name) == rank)


def node_copy(source: str, save_id: str, timeout: float) -> dict:
    """The commit record of this node's copy of the memory checkpoint ``source`` of the save ``save_id``, once it is
    committed here (another rank of this node may still be publishing it, ``nodes.publish_copy``).
    ``CheckpointWriteError`` if this node has no copy of it (its staging directory gone: the copy was given up),
    ``CheckpointTimeoutError`` after ``timeout``."""
    staging = names.staging_dir_for(source, save_id)

    def committed() -> Optional[dict]:
        staged = os.path.isdir(staging)
        record = commit.read_commit_record(source)  # after the look at the staging directory: it is renamed to it
        if record is not None and record.get("save_id") == save_id:
            return record
        if not staged:
            raise CheckpointWriteError(f"this node holds no committed copy of {source} (save {save_id})")
        return None

    return poll(committed, timeout, lambda: CheckpointTimeoutError(
        f"this node's copy of {source} was not committed within {timeout:.0f}s"))


@dataclass
class MemoryRetentionRequest:
    """The memory tier's retention on this node, right after a checkpoint was published there, and only if it
    committed: the memory checkpoints of ``run_directory`` beyond the newest ``keep`` go (``tier.stale``), their
    large files kept for the next save to write over (``spares``)."""

    run_directory: str
    keep: int

    def run(self, context: RequestContext) -> None:
        spares.recycle(tier.stale(self.run_directory, self.keep), self.run_directory, context.token())
