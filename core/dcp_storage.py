"""``AsyncCkptStorageWriter`` / ``AsyncCkptStorageReader``: our storage behind DCP's own API.

``dcp.save(sd, storage_writer=AsyncCkptStorageWriter(path))`` writes the same files as our
pipeline does (in-process, synchronously, in place like DCP); ``dcp.load(sd,
storage_reader=AsyncCkptStorageReader(path))`` reads any DCP checkpoint, verified and zero-copy
for ours. The checkpoint directory is always readable by torch's stock ``FileSystemReader``.
"""
from __future__ import annotations

import os
import uuid
from typing import Any, Optional

import torch.distributed as dist
from torch.futures import Future
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from . import commit
from .errors import CorruptCheckpointError
from .metadata_io import load_dcp_metadata, read_rank_sidecar, write_dcp_metadata, write_rank_sidecar
from .planner import byte_items, layout_for_plan, tensor_items
from .reader import ReadJob, is_bytes_request, read_file_jobs
from .staging import StagingBuffer, copy_into
from .storage import ShareRequest, sidecar_record, write_share


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
        copy_into(self._buffer, [planner.resolve_data(items_in_plan[i]) for i in layout.unique_slots()])
        objects = [(item.index.fqn, planner.resolve_data(item).getvalue()) for item in byte_items(plan)]
        items = write_share(self.path, self.rank, layout, memoryview(self._buffer.mmap), objects,
                            direct_io=self.direct_io, io_threads=self.io_threads)
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        request = ShareRequest(self.save_id, self.path, self.path, self.rank, world_size, self.is_coordinator, "", {}, [])
        write_rank_sidecar(self.path, sidecar_record(request, items))
        results = []
        for write_item, record in zip(tensor_items(plan) + byte_items(plan), items):
            results.append(
                WriteResult(write_item.index, record["length"], _StorageInfo(record["file"], record["start"], record["length"]))
            )
        future: Future = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        metadata.storage_meta = self.storage_meta()
        write_dcp_metadata(self.path, metadata)
        commit.write_commit_record(self.path, {"save_id": self.save_id, "world_size": len(results), "step": None})

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class AsyncCkptStorageReader(StorageReader):
    """DCP StorageReader: restricted metadata unpickling, checksum verification, direct reads."""

    def __init__(self, path: str | os.PathLike, *, verify: bool = True, io_threads: int = 2,
                 require_commit: bool = True, metadata: Optional[Metadata] = None) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.verify = verify
        self.io_threads = io_threads
        self.require_commit = require_commit
        self._metadata = metadata  # already read (and checked) by the caller

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is not None:
            return self._metadata
        if self.require_commit:
            commit.require_complete(self.path)
        return load_dcp_metadata(self.path)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self._sidecar_items = self._load_sidecars()

    def _load_sidecars(self) -> dict[tuple[str, int], dict]:
        """(file, start) -> sidecar item, for every rank sidecar present (none for plain DCP)."""
        items = {}
        for name in os.listdir(self.path):
            if name.startswith("__") and name.endswith(".asyncckpt.json"):
                rank = int(name[2:].split(".", 1)[0])
                for item in read_rank_sidecar(self.path, rank)["items"]:
                    items[(item["file"], item["start"])] = item
        return items

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadJob]] = {}
        for request in plan.items:
            info: _StorageInfo = self.storage_data[request.storage_index]
            if info.transform_descriptors:
                raise CorruptCheckpointError(
                    f"{self.path}: key '{request.storage_index.fqn}' uses stream transforms {info.transform_descriptors}, "
                    "which this reader does not support; load it with torch's FileSystemReader"
                )
            job = ReadJob(request, info.relative_path, info.offset, info.length,
                          self._sidecar_items.get((info.relative_path, info.offset)))
            if not is_bytes_request(request):
                job.target = planner.resolve_tensor(request).detach()
            per_file.setdefault(info.relative_path, []).append(job)
        for relative_path, jobs in per_file.items():
            read_file_jobs(self.path, relative_path, jobs, verify=self.verify, threads=self.io_threads,
                           load_bytes=planner.load_bytes)
            for job in jobs:
                if job.target is not None:
                    planner.commit_tensor(job.request, job.target)
        future: Future = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
