"""Filesystem storage: writing one rank's share, committing, and reading with checksums.

The functions here are the whole storage engine; they run in the background worker (our own
pipeline) and behind ``AsyncCkptStorageWriter`` / ``AsyncCkptStorageReader``, which implement
torch.distributed.checkpoint's StorageWriter / StorageReader so that ``dcp.save`` / ``dcp.load``
can use them directly.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from . import commit, diskio
from .checksum import checksum
from .dcp_pickle import DCP_METADATA_FILE, DcpClasses, metadata_bytes
from .errors import CheckpointTimeoutError, CheckpointWriteError
from .copy_progress import split_image
from .fsio import atomic_write_bytes
from .layout import RankLayout
from .sidecar import ShareItems, ShareRecord, read_sidecar, sidecar_name, write_rank_sidecar


def objects_file_name(rank: int) -> str:
    return f"__{rank}_1.distcp"


def error_marker_name(rank: int) -> str:
    return f"__{rank}.error.json"


@dataclass
class ShareRequest:
    """Everything the background writer needs for one rank's part of one save (plain data)."""

    save_id: str
    final_path: str
    staging_dir: str
    rank: int
    world_size: int
    coordinator: bool
    structure_hash: str
    byte_items: list  # [(fqn, bytes)]
    direct_io: bool = True
    io_threads: int = 2
    timeout: float = 600.0
    step: Optional[int] = None
    extra_files: dict = field(default_factory=dict)  # name -> bytes, written by the coordinator before commit
    copy_generation: Optional[int] = None  # the snapshot copy may still run: stream it (see CopyProgress)
    dcp_classes: Optional[DcpClasses] = None  # the coordinator's: how to write DCP's .metadata without torch

    def run(self, layout: RankLayout, mapping: memoryview) -> None:
        image, progress = split_image(layout, mapping)
        wait_ready = None if self.copy_generation is None else progress.waiter(self.copy_generation, self.timeout)
        run_share(self, layout, image, wait_ready)


def write_share(
    directory: str, rank: int, layout: RankLayout, image: memoryview, byte_items: list, *, direct_io: bool, io_threads: int,
    wait_ready: Optional[Callable[[float], float]] = None,
) -> ShareItems:
    """Durably write one rank's tensor image and pickled objects; return what the sidecar records.
    With ``wait_ready`` the image is still being copied (see ``diskio.write_image``)."""
    digests: list[str] = []
    if layout.slots:
        # Checksums are computed on another thread while the image streams to disk (the writes
        # release the GIL), so verification costs no time on the save path. Tied tensors share bytes.
        def checksum_slots() -> list[str]:
            by_start: dict[int, str] = {}
            finished = float("inf") if wait_ready is None else 0.0
            while finished < float("inf"):  # after the copy: hashing alongside it would slow the copy down
                finished = wait_ready(finished)
            for slot in layout.slots:
                if slot.start not in by_start:
                    by_start[slot.start] = checksum(image[slot.data_start : slot.data_start + slot.nbytes])
            return [by_start[slot.start] for slot in layout.slots]

        pending = diskio.submit_background(checksum_slots)
        diskio.write_image(os.path.join(directory, layout.file_name), image, layout.size, direct=direct_io,
                           threads=io_threads, wait_ready=wait_ready)
        digests = pending.result()
    objects: list[tuple[str, int, int, str]] = []
    if byte_items:
        name = objects_file_name(rank)
        blob, cursor = bytearray(), 0
        for fqn, data in byte_items:
            objects.append((fqn, cursor, len(data), checksum(data)))
            blob += data
            cursor += len(data)
        diskio.write_small_file(os.path.join(directory, name), bytes(blob))
    return ShareItems(layout if layout.slots else None, digests, objects_file_name(rank) if byte_items else None, objects)


def sidecar_record(req: ShareRequest, layout: RankLayout, items: ShareItems) -> ShareRecord:
    return ShareRecord(req.save_id, req.rank, req.world_size, req.structure_hash, layout.planner_data, items)


POLL_MAX_DELAY = 0.005


def _poll(condition, timeout: float, what: str, max_delay: float = POLL_MAX_DELAY):
    """Wait (bounded) until ``condition()`` returns something truthy; sleeps grow from 1 ms to
    ``max_delay``. A writer waits for the other ranks only once its own share is durable, when
    they are usually a few tens of ms behind: sleeps that had grown to 50 ms left each wait ~25 ms
    late, twice per multi-rank commit (the coordinator for the shares, the others for the commit),
    10-15% of a 2-rank 1 GiB save. A poll costs a directory listing or two failed opens."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise CheckpointTimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 1.5, max_delay)


def report_failure(req, error: BaseException) -> None:
    """Record this rank's failure where every other rank's writer looks for it."""
    reason = {"rank": req.rank, "error": f"{type(error).__name__}: {error}"}
    try:
        os.makedirs(req.staging_dir, exist_ok=True)
        atomic_write_bytes(os.path.join(req.staging_dir, error_marker_name(req.rank)), json.dumps(reason).encode())
        if req.coordinator:
            commit.mark_aborted(req.staging_dir, reason)
    except OSError:
        pass  # the disk itself may be what failed; peers then time out instead


def _failure_message(req, reason: dict) -> str:
    return f"checkpoint {req.final_path} (save {req.save_id}) failed on rank {reason['rank']}: {reason['error']}"


def wait_for_ranks(req, done_marker) -> None:
    """Coordinator: wait (bounded) until every rank published ``done_marker(rank)`` in the
    staging directory; if any rank reported a failure instead, abort the save for everyone.
    Each poll lists the directory once, so it checks every rank's markers at the cost of one
    system call (a job with many ranks lists more entries, and polls less often)."""
    errors = {error_marker_name(rank): rank for rank in range(req.world_size)}
    done = [done_marker(rank) for rank in range(req.world_size)]

    def all_ranks_done():
        try:
            present = set(os.listdir(req.staging_dir))
        except FileNotFoundError:
            return False
        failed = sorted(errors[name] for name in present.intersection(errors))
        if failed:
            with open(os.path.join(req.staging_dir, error_marker_name(failed[0]))) as f:
                reason = json.load(f)
            commit.mark_aborted(req.staging_dir, reason)
            raise CheckpointWriteError(_failure_message(req, reason))
        return present.issuperset(done)

    _poll(all_ranks_done, req.timeout, f"all {req.world_size} ranks to finish writing {req.final_path}",
          max_delay=POLL_MAX_DELAY * max(1.0, req.world_size / 64))


def publish_with_record(req, **record) -> None:
    """Coordinator: write the commit record (listing the files) and rename into place."""
    files = {
        name: os.path.getsize(os.path.join(req.staging_dir, name))
        for name in sorted(os.listdir(req.staging_dir))
        if not name.startswith(".") or name == ".metadata"
    }
    commit.write_commit_record(
        req.staging_dir, {"save_id": req.save_id, "world_size": req.world_size, "step": req.step, "files": files, **record}
    )
    commit.publish(req.staging_dir, req.final_path)


def commit_share(req: ShareRequest) -> None:
    """Coordinator: wait for every rank's sidecar, then write metadata + commit record, publish."""
    wait_for_ranks(req, sidecar_name)
    sidecars = [read_sidecar(req.staging_dir, rank) for rank in range(req.world_size)]
    stale = [s.rank for s in sidecars if s.save_id != req.save_id]
    if stale:
        raise CheckpointWriteError(f"checkpoint {req.final_path}: ranks {stale} left sidecars of another save")
    for name, data in req.extra_files.items():
        atomic_write_bytes(os.path.join(req.staging_dir, name), data)
    if req.dcp_classes is None:
        raise CheckpointWriteError(f"checkpoint {req.final_path}: the coordinator's request carries no DCP metadata format")
    metadata = metadata_bytes(sidecars, req.dcp_classes, req.final_path, req.save_id)
    atomic_write_bytes(os.path.join(req.staging_dir, DCP_METADATA_FILE), metadata)
    publish_with_record(req, structure_hash=req.structure_hash)


def await_commit(req) -> None:
    """Non-coordinator: wait (bounded) until the coordinator committed this save or gave up on it."""

    def committed_or_aborted():
        record = commit.read_commit_record(req.final_path)
        if record is not None and record.get("save_id") == req.save_id:
            return True
        reason = commit.read_abort(req.staging_dir)
        if reason is not None:
            raise CheckpointWriteError(_failure_message(req, reason))
        return False

    _poll(committed_or_aborted, req.timeout, f"rank 0 to commit {req.final_path}")


def run_share(req: ShareRequest, layout: RankLayout, image: memoryview,
              wait_ready: Optional[Callable[[float], float]] = None) -> None:
    """The whole background part of a save for one rank: write, publish sidecar, commit or await."""
    try:
        os.makedirs(req.staging_dir, exist_ok=True)
        items = write_share(req.staging_dir, req.rank, layout, image, req.byte_items,
                            direct_io=req.direct_io, io_threads=req.io_threads, wait_ready=wait_ready)
        write_rank_sidecar(req.staging_dir, sidecar_record(req, layout, items))
    except BaseException as e:
        report_failure(req, e)
        raise CheckpointWriteError(_failure_message(req, {"rank": req.rank, "error": f"{type(e).__name__}: {e}"})) from e
    if req.coordinator:
        try:
            commit_share(req)
        except BaseException as e:
            report_failure(req, e)
            raise
    else:
        await_commit(req)
