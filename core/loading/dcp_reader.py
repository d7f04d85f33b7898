"""``AsyncCkptStorageReader``: DCP's own load API over our reader.

``dcp.load(sd, storage_reader=AsyncCkptStorageReader(path))`` reads any DCP checkpoint,
verified and zero-copy for ours (``api.dcp_writer`` is the writing half).
"""
from __future__ import annotations

import functools
import io
import os
from itertools import repeat
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from asyncckpt.core.storage import commit
from asyncckpt.core.storage.backend import backend_for
from asyncckpt.core.formats import names
from asyncckpt.core.errors import CorruptCheckpointError
from asyncckpt.core.loading import cooperative
from asyncckpt.core.loading.metadata_io import load_dcp_metadata
from asyncckpt.core.loading.reader import RAW_DTYPES, Span, can_read_into, group_by_file, overlapping, read_spans
from asyncckpt.core.storage.sidecar_io import read_sidecar

STAGED_BYTES = 64 << 20  # temporaries of a resharding read, at most, at a time


class AsyncCkptStorageReader(StorageReader):
    """DCP StorageReader: restricted metadata unpickling, checksum verification, direct reads.

    A request for a whole saved chunk of ours, into a plain CPU tensor, is read straight into it
    (``reader.read_spans``), and where several ranks of a cooperative load ask for the same chunk, by one of
    them, which sends it to the others (``cooperative.share_spans``); narrowed requests (resharding) and the
    containers of plain DCP checkpoints are read into a temporary first, at most ``STAGED_BYTES`` at a time.
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = True, io_threads: int = 2,
                 require_commit: bool = True, metadata: Optional[Metadata] = None,
                 group: Optional[dist.ProcessGroup] = None, timeout: float = 600.0,
                 readers: cooperative.Readers = "off") -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.verify = verify
        self.io_threads = io_threads
        self.require_commit = require_commit
        self._metadata = metadata  # already read (and checked) by the caller
        # A cooperative load (``readers`` "job" or "node", with ``dcp.load``'s process group: ``group``, None for the
        # default one): whole chunks several ranks read are read once and sent to the others (``cooperative``).
        self.group, self.timeout, self.readers = group, timeout, readers

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
        for name in backend_for(self.path).names(self.path):
            match = names.SIDECAR_PATTERN.match(name)
            if match is None:
                continue
            sidecar = read_sidecar(self.path, int(match.group(1)))
            for columns in (sidecar.tensors, sidecar.objects):
                located.update(zip(zip(columns.item_files(), columns.start), zip(repeat(columns), range(len(columns.fqn)))))
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
        files = group_by_file([(job.info.relative_path, job.span, job.info.offset + job.info.length) for job in direct])
        read = functools.partial(read_spans, self.path, threads=self.io_threads)
        shared = cooperative.share_spans(files, self.group, timeout=self.timeout, readers=self.readers,
                                         remote=backend_for(self.path).remote)
        if shared is not None:
            shared.load(read)
        else:
            read(files)
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
