"""The directory commit, as the background writer runs it (``api.directory.DirectoryTransaction`` sends it).

A framework's checkpoint directory is written by one or several ranks into a hidden staging
directory (``file_requests``); the commit runs after this rank's files, in queue order: each rank's
writer records its files' checksums in the staging directory and arrives at the save's barrier, and
rank 0's writer, once every rank arrived, writes the commit record listing every rank's files and
renames the directory into place. A memory-tier save on several nodes does the same on each node, its files
replicated between them (``replicas``). Kept free of torch: the writer unpickles it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from asyncckpt.core.errors import CheckpointWriteError
from asyncckpt.core.storage import owners
from asyncckpt.core.storage.backend import at_once, backend_for
from asyncckpt.core.storage.sidecar_io import take_files_records, write_files_record
from asyncckpt.core.storage.staging import publish_checkpoint
from asyncckpt.core.writer.barrier import BarrierSpec
from asyncckpt.core.writer.protocol import RequestContext
from asyncckpt.core.tier.nodes import Replicas, TierSave, commit_entries, publish_copy, spread


@dataclass
class CommitDirRequest:
    """Runs after this rank's files (queue order): arrive; rank 0 waits for every rank, publishes."""

    save_id: str
    final_path: str
    staging_dir: str
    rank: int
    step: Optional[int]
    barrier: BarrierSpec
    failed: Optional[str] = None  # this rank's part failed before reaching the writer
    tier: Optional[TierSave] = None  # a memory-tier save (``replicas``: on several nodes)

    @property
    def replicas(self) -> Optional[Replicas]:
        return self.tier.replicas if self.tier is not None else None

    def run(self, context: RequestContext) -> None:
        barrier = context.barrier(self.barrier, self.replicas)
        failure = self.failed or context.failure(self.barrier.key)
        if failure is not None:  # one of this rank's files failed (the others were told)
            barrier.fail(self.rank, failure)
            self._discard(context)
            raise CheckpointWriteError(f"rank {self.rank}: {failure}")
        context.tidy(os.path.dirname(self.staging_dir))
        try:
            owners.claim(self.staging_dir, self.rank, context.token())
            barrier.begin(self.rank)
            files = context.files(self.barrier.key)
            if self.replicas is None:
                write_files_record(self.staging_dir, self.rank, files)
            else:
                spread(self.replicas, self.staging_dir, self.rank, files)
            barrier.arrive(self.rank)
            if self.rank != 0:
                barrier.wait_commit()
                if self.replicas is not None and self.replicas.publishes:
                    publish_copy(self.replicas, self.staging_dir, self.final_path, context.token())
                return
            barrier.wait_all()
            replaced = publish_checkpoint(backend_for(self.final_path), self.staging_dir, self.final_path,
                                          self._record())
            barrier.committed()
        except BaseException as e:
            barrier.fail(self.rank, f"{type(e).__name__}: {e}")
            self._discard(context)
            raise
        if replaced is not None:
            context.after_reply(lambda: backend_for(replaced).remove_tree(replaced, context.token(), later=at_once))

    def _discard(self, context: RequestContext) -> None:
        """A failed save alone in its staging directory takes it along (after the reply). With
        several ranks the directory is also the others' (their barrier files, their writes still
        under way): it stays, a leftover the next save or ``asyncckpt clean`` removes once its
        writers are gone."""
        if self.barrier.world_size == 1:
            context.after_reply(lambda: backend_for(self.staging_dir).remove_tree(self.staging_dir, context.token(),
                                                                                  later=at_once))

    def _record(self) -> dict:
        """The commit record: every rank's file checksums (the ranks' lists of them go), and in the memory tier what
        binds the checkpoint to its job, which rank wrote which file and on several nodes which node holds it
        (``nodes.commit_entries``)."""
        gathered = take_files_records(self.staging_dir, self.barrier.world_size)
        checksums = {name: {"size": c.size, "xxh3": c.xxh3, **({"xxh3_128": c.content_id} if c.content_id else {})}
                     for name, c in ((name, file.checksum) for name, file in gathered.items())}
        record = {"save_id": self.save_id, "world_size": self.barrier.world_size, "step": self.step,
                  "checksums": checksums}
        if self.tier is not None:
            record.update(commit_entries(self.tier, self.staging_dir, gathered, checksums, []))
        return record
