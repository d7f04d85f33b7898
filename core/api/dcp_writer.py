"""``AsyncCkptStorageWriter``: our layout behind DCP's own save API.

``dcp.save(sd, storage_writer=AsyncCkptStorageWriter(path))`` writes the same files as our
pipeline does (in-process, synchronously, in place like DCP: one file image per rank, checksums,
a commit record). The checkpoint directory stays readable by torch's stock ``FileSystemReader``;
``loading.dcp_reader`` is the reading half.
"""
from __future__ import annotations

import os
import uuid
from typing import Any, Optional

import torch.distributed as dist
from torch.futures import Future
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from asyncckpt.core.formats import commit_record
from asyncckpt.core.formats.names import COMMIT_RECORD
from asyncckpt.core.storage import commit
from asyncckpt.core.snapshot.dcp_metadata import write_dcp_metadata
from asyncckpt.core.snapshot.planner import byte_items, layout_for_plan, tensor_items
from asyncckpt.core.snapshot.shared_buffer import StagingBuffer, copy_into
from asyncckpt.core.formats.sidecar import ShareRecord
from asyncckpt.core.storage.sidecar_io import write_rank_sidecar
from asyncckpt.core.storage.staging import Staging
from asyncckpt.core.writer.shard_requests import write_share
from asyncckpt.core.snapshot.tensor_copy import CopyThreads


class AsyncCkptStorageWriter(StorageWriter):
    """DCP StorageWriter writing our layout: one file image per rank, checksums, commit record."""

    def __init__(self, path: str | os.PathLike, *, direct_io: bool = True, io_threads: int = 2) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.direct_io = direct_io
        self.io_threads = io_threads
        self.save_id = uuid.uuid4().hex
        self._buffer: Optional[StagingBuffer] = None
        self.rank = 0

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        self.rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        os.makedirs(self.path, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator, before any rank writes: un-commit a checkpoint being overwritten in place,
        so a crash mid-save can never leave the old commit record over new, partial data."""
        commit.uncommit(self.path)
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        layout = layout_for_plan(plan, self.rank)
        if self._buffer is None or self._buffer.layout != layout:
            if self._buffer is not None:
                self._buffer.close()
            self._buffer = StagingBuffer(layout)
        items_in_plan = tensor_items(plan)
        threads = CopyThreads()
        try:
            copy_into(self._buffer, [planner.resolve_data(items_in_plan[i]) for i in layout.unique_slots()], threads)
        finally:
            threads.stop()
        objects = [(item.index.fqn, planner.resolve_data(item).getvalue()) for item in byte_items(plan)]
        items = write_share(Staging(self.path, self.path, direct_io=self.direct_io, io_threads=self.io_threads), self.rank,
                            self._buffer.layout, memoryview(self._buffer.mmap)[: layout.buffer_size], objects)
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        write_rank_sidecar(self.path, ShareRecord(self.save_id, self.rank, world_size, "", self._buffer.layout.planner_data, items))
        results = [
            WriteResult(write_item.index, length, _StorageInfo(file, start, length))
            for write_item, (file, start, length) in zip(tensor_items(plan) + byte_items(plan), items.locations())
        ]
        future: Future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        metadata.storage_meta = self.storage_meta()
        write_dcp_metadata(self.path, metadata)
        Staging(self.path, self.path).write_bytes(COMMIT_RECORD, commit_record.encode(
            {"save_id": self.save_id, "world_size": len(results), "step": None}), atomic=True)

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
