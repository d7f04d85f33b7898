"""Writing one rank's share of a sharded save, and committing it: the background writer's side.

``ShareRequest`` runs in the background writer (our own pipeline); ``write_share`` also runs
behind ``AsyncCkptStorageWriter``, which implements torch.distributed.checkpoint's StorageWriter
so that ``dcp.save`` can use it directly.

Where the files go is a ``staging.Staging``: a local staging directory renamed into place at the
commit, or an object-store prefix made visible by a create-only commit object (for URLs). The
steps of a save are the same.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from asyncckpt.core.storage import diskio
from asyncckpt.core.formats import names
from asyncckpt.core.writer.barrier import BarrierSpec
from asyncckpt.core.formats.checksum import FileChecksum, checksum, checksum_stream
from asyncckpt.core.formats.dcp_pickle import DcpClasses, metadata_bytes
from asyncckpt.core.errors import CheckpointWriteError, SnapshotCopyFailed
from asyncckpt.core.writer.file_requests import fail_save
from asyncckpt.core.formats.layout import RankLayout
from asyncckpt.core.storage.sidecars import read_sidecar, take_files_records
from asyncckpt.core.storage.staging import Staging, remove_coordination_files
from asyncckpt.core.tier.requests import save_beside
from asyncckpt.core.writer.protocol import RequestContext
from asyncckpt.core.formats.sidecar import ShareItems, ShareRecord, encode_sidecar
from asyncckpt.core.tier.nodes import Replicas, TierSave, commit_entries, publish_copy, spread, stream_file, to_coordinator
from asyncckpt.core.tier.transport import Streaming, file_checksum


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
    barrier: BarrierSpec
    direct_io: bool = True
    io_threads: int = 2
    step: Optional[int] = None
    extra_files: dict = field(default_factory=dict)  # name -> bytes, written by the coordinator before commit
    copy_generation: Optional[int] = None  # the snapshot copy may still run: stream it (see CopyProgress)
    dcp_classes: Optional[DcpClasses] = None  # the coordinator's: how to write DCP's .metadata without torch
    # Without them: the command of a process that pickles torch's own metadata objects
    # (``snapshot.dcp_metadata.metadata_command``): the writer runs it rather than import torch.
    metadata_command: Optional[list[str]] = None
    object_store: Any = None  # ObjectStoreOptions when ``final_path`` is a URL
    # Set for a DCP directory inside a directory checkpoint: the directory's barrier, which this
    # share's failure fails; the directory's own commit publishes it (no commit of its own).
    directory_barrier: Optional[BarrierSpec] = None
    tier: Optional[TierSave] = None  # a memory-tier save (``replicas``: on several nodes)

    @property
    def replicas(self) -> Optional[Replicas]:
        return self.tier.replicas if self.tier is not None else None

    def destination(self) -> Staging:
        return Staging(self.staging_dir, self.final_path, self.object_store, self.coordinator, self.direct_io,
                       self.io_threads)

    def run(self, context: RequestContext) -> None:
        """The whole background part of a save for one rank: write the share and its sidecar,
        arrive at the barrier; then commit (rank 0) or wait for the commit. Inside a directory
        checkpoint: rank 0 writes ``.metadata`` once every share is durable, and the directory's
        commit, queued behind, publishes it all."""
        image = context.image
        wait_ready = None if self.copy_generation is None else context.progress.waiter(
            self.copy_generation, self.barrier.timeout, context.trainer_gone)
        barrier = context.barrier(self.barrier, self.replicas)
        place = self.destination()
        sending: list[Future] = []  # the data file to the replica peers, as it is copied and hashed (``replicas``)

        def stream(hashing: Future) -> None:  # the data file is in place; its hash is on its way
            path = os.path.join(self.staging_dir, context.layout.file_name)
            sending.append(stream_file(self.replicas, path, Streaming(
                context.layout.size, wait_ready, lambda: (hashing.result()[1] or file_checksum(path)).xxh3)))

        try:
            if self.tier is not None and self.tier.persist_to is not None and self.directory_barrier is None:
                save_beside(self, context)  # its durable copy is due: saved there from the same snapshot meanwhile
            if self.directory_barrier is None:
                if place.tidy_parent() is not None:
                    context.tidy(place.tidy_parent())
                place.claim(self.rank, context.token())
            else:
                os.makedirs(self.staging_dir, exist_ok=True)
            barrier.begin(self.rank)
            items = write_share(place, self.rank, context.layout, image, self.byte_items, wait_ready=wait_ready,
                                whole_file=self.replicas is not None,
                                link_image=context.link_image if self.tier is not None else lambda _path: False,
                                on_placed=stream if self.replicas is not None and self.directory_barrier is None
                                else None)  # a directory's commit spreads the files of its parts
            place.write_bytes(names.sidecar_name(self.rank), encode_sidecar(ShareRecord(
                self.save_id, self.rank, self.world_size, self.structure_hash, context.layout.planner_data, items)),
                atomic=True)
            if self.replicas is not None:
                self._spread(context, items, {items.layout.file_name: sending[0].result()} if sending else {})
            barrier.arrive(self.rank)
        except BaseException as e:
            for future in sending:
                future.exception()  # ended (the copy it follows failed, say) before the save fails
            reason = f"{type(e).__name__}: {e}"
            barrier.fail(self.rank, reason)
            fail_save(context, self.directory_barrier, self.rank, e)
            if isinstance(e, SnapshotCopyFailed):
                raise
            raise CheckpointWriteError(f"rank {self.rank}: {reason}") from e
        if not self.coordinator:
            if self.directory_barrier is None:
                barrier.wait_commit()
                if self.replicas is not None and self.replicas.publishes:
                    publish_copy(self.replicas, self.staging_dir, self.final_path, context.token())
            return
        try:
            barrier.wait_all()
            if self.directory_barrier is not None:
                write_metadata(self, place)
                remove_coordination_files(self.staging_dir)
                if self.replicas is not None:  # the directory's commit spreads it
                    self._record(context, {names.DCP_METADATA_FILE: file_checksum(
                        os.path.join(self.staging_dir, names.DCP_METADATA_FILE))})
                return
            replaced = commit_share(self, place)
            barrier.committed()
        except BaseException as e:
            barrier.fail(self.rank, f"{type(e).__name__}: {e}")
            fail_save(context, self.directory_barrier, self.rank, e)
            raise
        if replaced is not None:
            context.after_reply(lambda: place.delete(replaced, context.token()))

    def _spread(self, context: RequestContext, items: ShareItems, sent: dict[str, list[str]]) -> None:
        """On several nodes (``replicas``): this rank's files to its node's peers (``sent``: those sent already, with
        the peers that hold them), and its sidecar to rank 0's node (``.metadata`` is made from every sidecar); in a
        directory checkpoint the directory's commit spreads its files with the others', and only the sidecar goes
        now."""
        sidecar = names.sidecar_name(self.rank)
        written = {name: file_checksum(os.path.join(self.staging_dir, name))
                   for name in (items.layout and items.layout.file_name, items.objects_file, sidecar)
                   if name and not (items.tensor_file is not None and name == items.layout.file_name)}
        if items.tensor_file is not None:  # hashed with its items as it was written: no second pass over it
            written[items.layout.file_name] = items.tensor_file
        if self.directory_barrier is None:
            spread(self.replicas, self.staging_dir, self.rank, written, coordinator_needs=[sidecar], sent=sent)
            return
        self._record(context, written)
        to_coordinator(self.replicas, self.staging_dir, self.rank, {sidecar: written[sidecar]})

    def _record(self, context: RequestContext, files: dict) -> None:
        """Files of this DCP part, for its directory's commit (named relative to the directory)."""
        for name, recorded in files.items():
            context.record_file(self.directory_barrier.key, os.path.relpath(
                os.path.join(self.staging_dir, name), self.directory_barrier.staging_dir), recorded)


def write_share(
    place: Staging, rank: int, layout: RankLayout, image: memoryview, byte_items: list, *,
    wait_ready: Optional[Callable[[float], float]] = None, whole_file: bool = False,
    link_image: Callable[[str], bool] = lambda _path: False, on_placed: Optional[Callable[[Future], None]] = None,
) -> ShareItems:
    """Durably write one rank's tensor image and pickled objects; return what the sidecar records.
    With ``wait_ready`` the image is still being copied (see ``diskio.write_image``); with ``whole_file``
    (a replicated save: its files go out with their checksums) the tensor file's checksum too. The image
    becomes the tensor file by ``link_image`` where it can (``RequestContext.link_image``: a memory-tier
    save's buffer, which is already the file's bytes), else it is written. ``on_placed(hashing)`` is called once
    the tensor file is there (linked, its bytes maybe still being copied; or written), with the future of
    ``slot_digests``."""
    digests: list[str] = []
    tensor_file: Optional[FileChecksum] = None
    if layout.slots:
        # Checksums are computed on another thread while the image streams to disk (the writes
        # release the GIL), so verification costs no time on the save path. Tied tensors share bytes.
        def checksum_slots() -> tuple[list[str], Optional[FileChecksum]]:
            finished = float("inf") if wait_ready is None else 0.0
            while finished < float("inf"):  # after the copy: hashing alongside it would slow the copy down
                finished = wait_ready(finished)
            return slot_digests(image, layout, whole_file)

        pending = diskio.submit_background(checksum_slots)
        if place.backend.remote or not link_image(os.path.join(place.directory, layout.file_name)):
            place.write_image(layout.file_name, image, layout.size, wait_ready)
        if on_placed is not None:
            on_placed(pending)
        digests, tensor_file = pending.result()
    objects: list[tuple[str, int, int, str]] = []
    if byte_items:
        name = names.objects_file_name(rank)
        blob, cursor = bytearray(), 0
        for fqn, data in byte_items:
            objects.append((fqn, cursor, len(data), checksum(data)))
            blob += data
            cursor += len(data)
        place.write_bytes(name, bytes(blob))
    return ShareItems(layout if layout.slots else None, digests, names.objects_file_name(rank) if byte_items else None, objects,
                      tensor_file)


PIECE_BYTES = 512 << 10  # half of a core's L2 here: a piece hashed twice is still cached the second time


def slot_digests(image: memoryview, layout: RankLayout, whole_file: bool) -> tuple[list[str], Optional[FileChecksum]]:
    """The xxh3 of every slot's bytes in ``image`` (tied tensors share theirs), and with ``whole_file`` that of the
    tensor file (``image[:layout.size]``) from the same pass: each piece is hashed for its slot and for the file
    while in the core's cache, so the file's checksum costs no second pass over memory (a GiB is ~0.3 s of a core
    here). Slots out of file order leave the file's checksum to the caller (None)."""
    by_start: dict[int, str] = {}
    whole, cursor = (checksum_stream() if whole_file else None), 0
    for slot in layout.slots:
        if slot.start in by_start:
            continue
        begin, end = slot.data_start, slot.data_start + slot.nbytes
        if whole is None or begin < cursor:
            whole = None
            by_start[slot.start] = checksum(image[begin:end])
            continue
        whole.update(image[cursor:begin])  # the container framing before it
        if end - begin <= PIECE_BYTES:
            by_start[slot.start] = checksum(image[begin:end])
            whole.update(image[begin:end])
        else:
            digest = checksum_stream()
            for start in range(begin, end, PIECE_BYTES):
                piece = image[start:min(start + PIECE_BYTES, end)]
                digest.update(piece)
                whole.update(piece)
            by_start[slot.start] = digest.hexdigest()
        cursor = end
    tensor_file = None
    if whole is not None:
        whole.update(image[cursor:layout.size])
        tensor_file = FileChecksum(layout.size, whole.hexdigest())
    return [by_start[slot.start] for slot in layout.slots], tensor_file


def commit_share(req: ShareRequest, place: Staging) -> Optional[str]:
    """Coordinator, once every rank's share is durable: DCP's ``.metadata`` from the sidecars,
    the commit record, publish. Returns where a checkpoint it replaced now is."""
    write_metadata(req, place)
    record = {"save_id": req.save_id, "world_size": req.world_size, "step": req.step,
              "structure_hash": req.structure_hash,
              "checksums": {name: {"size": len(data), "xxh3": checksum(data)} for name, data in req.extra_files.items()}}
    if req.tier is not None:
        records = take_files_records(place.directory, req.world_size) if req.replicas is not None else {}
        record.update(commit_entries(req.tier, place.directory, records, record["checksums"],
                                     [names.DCP_METADATA_FILE, *req.extra_files]))
    return place.publish(record)


def write_metadata(req: ShareRequest, place: Staging) -> None:
    """Coordinator, once every rank's share is durable: the extra files and DCP's ``.metadata``,
    built from the sidecars."""
    sidecars = [read_sidecar(place.directory, rank) for rank in range(req.world_size)]
    stale = [s.rank for s in sidecars if s.save_id != req.save_id]
    if stale:
        raise CheckpointWriteError(f"ranks {stale} left sidecars of another save")
    for name, data in req.extra_files.items():
        place.write_bytes(name, data, atomic=True)
    if req.dcp_classes is not None:
        metadata = metadata_bytes(sidecars, req.dcp_classes, req.final_path, req.save_id)
    else:  # this torch's metadata classes are not the ones dcp_pickle writes: torch's own objects, pickled
        metadata = _metadata_by_torch(req, place)
    place.write_bytes(names.DCP_METADATA_FILE, metadata, atomic=True)


def _metadata_by_torch(req: ShareRequest, place: Staging) -> bytes:
    """DCP's ``.metadata`` pickled by torch, in the process ``req.metadata_command`` starts."""
    with tempfile.NamedTemporaryFile(prefix="asyncckpt-metadata-") as out:
        done = subprocess.run(req.metadata_command + [place.directory, str(req.world_size), req.final_path, req.save_id,
                                                      out.name],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise CheckpointWriteError(f"pickling DCP's .metadata with torch failed: {done.stderr.strip()[-2000:]}")
        return out.read()
