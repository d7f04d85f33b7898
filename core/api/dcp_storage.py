"""``AsyncCkptStorageWriter`` / ``AsyncCkptStorageReader``: our storage behind DCP's own API.

``dcp.save(sd, storage_writer=AsyncCkptStorageWriter(path))`` writes the same files as our
pipeline does (in-process, synchronously, in place like DCP); ``dcp.load(sd,
storage_reader=AsyncCkptStorageReader(path))`` reads any DCP checkpoint, verified and zero-copy
for ours. The checkpoint directory is always readable by torch's stock ``FileSystemReader``.
"""
from __future__ import annotations

import functools
import io
import os
import uuid
from itertools import repeat
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from asyncckpt.core.storage import commit
from asyncckpt.core.storage import local
from asyncckpt.core.storage.backend import backend_for
from asyncckpt.core.formats import names
from asyncckpt.core.errors import CorruptCheckpointError
from asyncckpt.core.loading.metadata_io import load_dcp_metadata, write_dcp_metadata
from asyncckpt.core.snapshot.planner import byte_items, layout_for_plan, tensor_items
from asyncckpt.core.loading.reader import RAW_DTYPES, Span, can_read_into, group_by_file, overlapping, read_spans
from asyncckpt.core.snapshot.shared_buffer import StagingBuffer, copy_into
from asyncckpt.core.formats.sidecar import ShareRecord
from asyncckpt.core.storage.sidecars import read_sidecar, write_rank_sidecar
from asyncckpt.core.storage.local import LocalDestination
from asyncckpt.core.writer.shard_requests import write_share
from asyncckpt.core.snapshot.tensor_copy import CopyThreads

STAGED_BYTES = 64 << 20  # temporaries of a resharding read, at most, at a time


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
        backend_for(self.path).uncommit(self.path)
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
        items = write_share(LocalDestination(self.path, self.path, self.direct_io, self.io_threads), self.rank,
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
        local.write_commit_record(self.path, {"save_id": self.save_id, "world_size": len(results), "step": None})

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class AsyncCkptStorageReader(StorageReader):
    """DCP StorageReader: restricted metadata unpickling, checksum verification, direct reads.

    A request for a whole saved chunk of ours, into a plain CPU tensor, is read straight into it
    (``reader.read_spans``); narrowed requests (resharding) and the containers of plain DCP
    checkpoints are read into a temporary first, at most ``STAGED_BYTES`` at a time.
    """

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

    def _load_sidecars(self) -> dict[tuple[str, int], tuple[Any, int]]:
        """(file, start) -> (sidecar columns, item index), for every rank sidecar present (none for plain DCP)."""
        located: dict[tuple[str, int], tuple[Any, int]] = {}
        for name in backend_for(self.path).list_names(self.path):
            match = names.SIDECAR_PATTERN.match(name)
            if match is None:
                continue
            sidecar = read_sidecar(self.path, int(match.group(1)))
            for columns in (sidecar.tensors, sidecar.objects):
                located.update(zip(zip(repeat(columns.file), columns.start), zip(repeat(columns), range(len(columns.fqn)))))
        return located

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        jobs = [self._job(request, planner) for request in plan.items]
        _repeats, clashes = overlapping([(job.info.relative_path, job.span) for job in jobs if job.span is not None])
        direct = [job for job in jobs if job.span is not None and id(job.span) not in clashes]
        # Narrowed reads, plain DCP containers, and targets sharing memory with different sources
        # (which must be copied one by one, in plan order, so that the last key wins as in DCP).
        staged = [job for job in jobs if job.span is None or id(job.span) in clashes]
        read_spans(self.path, group_by_file([(job.info.relative_path, job.span, job.info.offset + job.info.length)
                                             for job in direct]), threads=self.io_threads)
        for job in direct:
            job.hand_over()
        for batch in _batches(staged):
            self._read_staged(batch, planner)
        future: Future = Future()
        future.set_result(None)
        return future

    def _job(self, request: ReadItem, planner: LoadPlanner) -> "_Job":
        """Where a request's bytes are, where they go, and whether they can go there directly."""
        info: _StorageInfo = self.storage_data[request.storage_index]
        if info.transform_descriptors:
            raise CorruptCheckpointError(
                f"{self.path}: key '{request.storage_index.fqn}' uses stream transforms {info.transform_descriptors}, "
                "which this reader does not support; load it with torch's FileSystemReader"
            )
        found = self._sidecar_items.get((info.relative_path, info.offset))
        digest = found[0].xxh3[found[1]] if found is not None and self.verify else None
        fqn = request.storage_index.fqn
        if request.type == LoadItemType.BYTE_IO:
            blob = bytearray(info.length)
            return _Job(request, info, found, None, Span(info.offset, info.length, blob, digest, fqn),
                        functools.partial(_load_bytes, planner, request, blob))
        target = planner.resolve_tensor(request).detach()
        if found is None or not _reads_whole_chunk(request, target, *found):
            return _Job(request, info, found, target, None, None)
        columns, index = found
        return _Job(request, info, found, target, Span(columns.data_start[index], columns.nbytes[index], target, digest, fqn),
                    functools.partial(planner.commit_tensor, request, target))

    def _read_staged(self, jobs: list["_Job"], planner: LoadPlanner) -> None:
        """Read chunks into temporaries (verified raw bytes of ours, whole containers of plain DCP
        checkpoints), then copy the requested part of each into its target."""
        reads, buffers = [], []
        for job in jobs:
            fqn = job.request.storage_index.fqn
            if job.found is not None:
                columns, index = job.found
                span = Span(columns.data_start[index], columns.nbytes[index], bytearray(columns.nbytes[index]),
                            columns.xxh3[index] if self.verify else None, fqn)
            else:
                span = Span(job.info.offset, job.info.length, bytearray(job.info.length), None, fqn)
            reads.append((job.info.relative_path, span, job.info.offset + job.info.length))
            buffers.append(span.target)
        read_spans(self.path, group_by_file(reads), threads=self.io_threads)
        for job, buffer in zip(jobs, buffers):
            if job.found is not None:
                columns, index = job.found
                dtype = getattr(torch, columns.dtype[index], None)  # any dtype DCP saves, not only the raw-readable ones
                if not isinstance(dtype, torch.dtype):
                    raise CorruptCheckpointError(f"{self.path}: the sidecar gives key '{job.request.storage_index.fqn}' "
                                                 f"an unknown dtype {columns.dtype[index]!r}")
                source = (torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)).view(
                    columns.chunk_shape(index))
            else:
                source = torch.load(io.BytesIO(buffer), map_location="cpu", weights_only=True)
            job.target.copy_(_narrow(source, job.request))
            planner.commit_tensor(job.request, job.target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class _Job(NamedTuple):
    """One read request of a plan, resolved against the checkpoint."""

    request: ReadItem
    info: _StorageInfo  # where .metadata says the item is
    found: Optional[tuple[Any, int]]  # (sidecar columns, index) of the item, if a sidecar has it
    target: Optional[torch.Tensor]  # None for objects
    span: Optional[Span]  # the direct read (objects, whole chunks); None: staged
    hand_over: Optional[Callable[[], None]]  # gives the planner the result of the direct read


def _load_bytes(planner: LoadPlanner, request: ReadItem, blob: bytearray) -> None:
    planner.load_bytes(request, io.BytesIO(blob))


def _narrow(tensor: torch.Tensor, request: ReadItem) -> torch.Tensor:
    """The part of a saved chunk that ``request`` asks for."""
    for dim, (offset, length) in enumerate(zip(request.storage_offsets, request.lengths)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


def _reads_whole_chunk(request: ReadItem, target: torch.Tensor, columns: Any, index: int) -> bool:
    """The request is a whole saved chunk of ours and can land in ``target``'s memory as it is."""
    shape = columns.chunk_shape(index)
    return (not any(request.storage_offsets) and tuple(request.lengths) == shape
            and can_read_into(target, RAW_DTYPES.get(columns.dtype[index]), shape, columns.nbytes[index]))


def _batches(staged: list[_Job]) -> list[list[_Job]]:
    """Staged reads in groups of at most STAGED_BYTES of temporaries (a single larger one alone)."""
    groups: list[list[_Job]] = []
    size = 0
    for job in staged:
        if not groups or size + job.info.length > STAGED_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(job)
        size += job.info.length
    return groups
