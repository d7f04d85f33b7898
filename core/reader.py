"""Reading tensor and object items back, straight into the caller's tensors where possible.

For checkpoints we wrote, the sidecar tells where each tensor's bytes start, so a full-chunk
read of a contiguous target is a single ``preadv`` into the target's memory (no ``torch.load``,
no temporary); small neighbouring items are read with one large request and copied out.
Checksums are verified unless disabled. Checkpoints written by plain DCP (no sidecar) fall back
to ``torch.load`` per item, as torch's own reader does.
"""
from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from . import diskio
from .checksum import checksum
from .errors import CorruptCheckpointError

DIRECT_READ_MIN_BYTES = 1 << 20
COALESCE_MAX_BYTES = 64 << 20


@dataclass
class ReadJob:
    """One read request resolved against the checkpoint: where its bytes are and where they go."""

    request: ReadItem
    file: str
    start: int
    length: int
    sidecar_item: Optional[dict]
    target: Optional[torch.Tensor] = None  # for tensor items
    chunk_sizes: Optional[tuple] = None


def _as_bytes(tensor: torch.Tensor):
    """A writable, zero-copy byte view of a contiguous CPU tensor."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _verify(job: ReadJob, data, path: str) -> None:
    expected = job.sidecar_item["xxh3"]
    actual = checksum(data)
    if actual != expected:
        raise CorruptCheckpointError(
            f"{path}: checksum mismatch for key '{job.request.storage_index.fqn}' "
            f"(bytes {job.sidecar_item['data_start']}..{job.sidecar_item['data_start'] + job.sidecar_item['nbytes']}): "
            f"expected xxh3 {expected}, found {actual}"
        )


def _is_direct(job: ReadJob) -> bool:
    item, target = job.sidecar_item, job.target
    return (
        item is not None
        and item["nbytes"] >= DIRECT_READ_MIN_BYTES
        and target.device.type == "cpu"
        and target.is_contiguous()
        and tuple(target.shape) == tuple(item["chunk_sizes"])
        and str(target.dtype).removeprefix("torch.") == item["dtype"]
    )


def _coalesce(jobs: list[ReadJob]) -> list[list[ReadJob]]:
    """Group jobs (sorted by offset) into runs read by one request of at most COALESCE_MAX_BYTES."""
    runs: list[list[ReadJob]] = []
    for job in sorted(jobs, key=lambda j: j.start):
        if runs and job.start + job.length - runs[-1][0].start <= COALESCE_MAX_BYTES:
            runs[-1].append(job)
        else:
            runs.append([job])
    return runs


def _tensor_from_container(job: ReadJob, region: memoryview, region_start: int, verify: bool, path: str) -> torch.Tensor:
    item = job.sidecar_item
    if item is None:  # plain DCP container
        local = region[job.start - region_start : job.start - region_start + job.length]
        return torch.load(io.BytesIO(local), map_location="cpu", weights_only=True)
    begin = item["data_start"] - region_start
    data = region[begin : begin + item["nbytes"]]
    if verify:
        _verify(job, data, path)
    flat = torch.frombuffer(data, dtype=getattr(torch, item["dtype"])) if item["nbytes"] else torch.empty(0, dtype=getattr(torch, item["dtype"]))
    return flat.view(tuple(item["chunk_sizes"]))


def _narrow(tensor: torch.Tensor, request: ReadItem) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(request.storage_offsets, request.lengths)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


def read_file_jobs(
    root: str,
    relative_path: str,
    jobs: list[ReadJob],
    *,
    verify: bool,
    threads: int,
    load_bytes: Callable[[ReadItem, io.BytesIO], None],
) -> None:
    """Read every job of one file; tensors land in ``job.target``, objects go to ``load_bytes``."""
    path = os.path.join(root, relative_path)  # checked when the metadata was read
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{path}: data file is missing") from e
    try:
        size = os.fstat(fd).st_size
        for job in jobs:
            if job.start + job.length > size:
                raise CorruptCheckpointError(
                    f"{path}: file is truncated: key '{job.request.storage_index.fqn}' needs bytes "
                    f"{job.start}..{job.start + job.length}, file has {size}"
                )
        direct, staged = [], []
        for job in jobs:
            (direct if job.target is not None and _is_direct(job) else staged).append(job)

        def read_direct(job: ReadJob) -> None:
            view = _as_bytes(job.target)
            diskio.pread_into(fd, view, job.sidecar_item["data_start"], path)
            if verify:
                _verify(job, view, path)

        def read_run(run: list[ReadJob]) -> list[tuple[ReadJob, object]]:
            start = run[0].start
            region = memoryview(bytearray(run[-1].start + run[-1].length - start))
            diskio.pread_into(fd, region, start, path)
            out = []
            for job in run:
                if job.target is None:
                    data = region[job.start - start : job.start - start + job.length]
                    if verify and job.sidecar_item is not None:
                        _verify(job, data, path)
                    out.append((job, bytes(data)))
                else:
                    source = _narrow(_tensor_from_container(job, region, start, verify, path), job.request)
                    job.target.copy_(source)
                    out.append((job, None))
            return out

        diskio.run_parallel(read_direct, direct, threads)
        for results in diskio.run_parallel(read_run, _coalesce(staged), threads):
            for job, data in results:
                if data is not None:
                    load_bytes(job.request, io.BytesIO(data))
    finally:
        os.close(fd)


def is_bytes_request(request: ReadItem) -> bool:
    return request.type == LoadItemType.BYTE_IO
