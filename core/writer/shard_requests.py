"""Writing one rank's share of a sharded save, and committing it: the background writer's side.

``ShareRequest`` runs in the background writer (our own pipeline); ``write_share`` also runs
behind ``AsyncCkptStorageWriter``, which implements torch.distributed.checkpoint's StorageWriter
so that ``dcp.save`` can use it directly.

More: docs/MODULES.md, core/writer/shard_requests.py.
"""
from __future__ import annotations

import os
import queue
import subprocess
import tempfile
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from asyncckpt.core.storage import diskio
from asyncckpt.core.formats import names
from asyncckpt.core.writer.barrier import BarrierSpec
from asyncckpt.core.formats.checksum import (PIECE_BYTES, FileChecksum, checksum, checksum_stream, content_id,
                                             content_id_stream)
from asyncckpt.core.formats.dcp_pickle import DcpClasses, metadata_bytes
from asyncckpt.core.errors import CheckpointWriteError, SnapshotCopyFailed
from asyncckpt.core.writer.file_requests import fail_save
from asyncckpt.core.formats.layout import RankLayout
from asyncckpt.core.storage.backend import join
from asyncckpt.core.storage.sharing import Base, find_base, remember
from asyncckpt.core.storage.sidecar_io import read_sidecar, take_files_records
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
    # Items unchanged since the newest committed checkpoint beside this one are shared, not written (``sharing``).
    share_unchanged: bool = True

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
                                else None,  # a directory's commit spreads the files of its parts
                                sharing=self._sharing(place))
            context.report(written=items.written, shared=items.shared)
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
                remember(self.final_path, self.save_id, self.rank, items)
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
            remember(self.final_path, self.save_id, self.rank, items)
        except BaseException as e:
            barrier.fail(self.rank, f"{type(e).__name__}: {e}")
            fail_save(context, self.directory_barrier, self.rank, e)
            raise
        if replaced is not None:
            context.after_reply(lambda: place.delete(replaced, context.token()))

    def _sharing(self, place: Staging) -> Optional[Callable[[], Optional[Base]]]:
        """How this share shares what did not change (None: it writes everything, as a memory-tier save on several
        nodes, whose files go to the peers whole)."""
        if not self.share_unchanged or self.replicas is not None:
            return None
        outer = self.directory_barrier  # a DCP part of a directory checkpoint: its counterpart in the one before
        if outer is None:
            return lambda: find_base(self.final_path, self.staging_dir, self.rank)
        part = os.path.relpath(self.staging_dir, outer.staging_dir)
        return lambda: find_base(outer.final_path, outer.staging_dir, self.rank, part)

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
    sharing: Optional[Callable[[], Optional[Base]]] = None,
) -> ShareItems:
    """Durably write one rank's tensor image and pickled objects; return what the sidecar records.
    With ``wait_ready`` the image is still being copied (see ``diskio.write_image``); with ``whole_file``
    (a replicated save: its files go out with their checksums) the tensor file's checksum too. The image
    becomes the tensor file by ``link_image`` where it can (``RequestContext.link_image``: a memory-tier
    save's buffer, which is already the file's bytes), else it is written. ``on_placed(hashing)`` is called once
    the tensor file is there (linked, its bytes maybe still being copied; or written), with the future of
    ``slot_digests``. With ``sharing`` (it finds the base, ``storage.sharing``) every item's content id is recorded,
    and the items the base holds unchanged are shared rather than written."""
    items = ShareItems(layout if layout.slots else None, [], names.objects_file_name(rank) if byte_items else None, [])
    linked = bool(layout.slots) and not place.backend.remote and link_image(os.path.join(place.directory,
                                                                                        layout.file_name))
    if linked:  # a memory-tier buffer, already the file: nothing to write, nothing to share
        sharing = None
    base = sharing() if sharing is not None else None
    if layout.slots:
        if base is not None and place.backend.remote:
            _upload_changed(place, layout, image, base, wait_ready, items)
        elif base is not None:
            _write_changed(place, layout, image, base, wait_ready, items)
        else:
            # Checksums are computed on another thread while the image streams to disk (the writes
            # release the GIL), so verification costs no time on the save path. Tied tensors share bytes.
            def checksum_slots() -> tuple[list[str], Optional[list[str]], Optional[FileChecksum]]:
                _wait_for_copy(wait_ready)  # hashing alongside the copy would slow the copy down
                return slot_digests(image, layout, whole_file, with_ids=sharing is not None)

            pending = diskio.submit_background(checksum_slots)
            if not linked:
                place.write_image(layout.file_name, image, layout.size, wait_ready)
                items.written += layout.size
            if on_placed is not None:
                on_placed(pending)
            items.tensor_digests, items.tensor_ids, items.tensor_file = pending.result()
    if byte_items:
        _write_objects(place, items, byte_items, base, with_ids=sharing is not None)
    return items


def _wait_for_copy(wait_ready: Optional[Callable[[float], float]]) -> None:
    finished = float("inf") if wait_ready is None else 0.0
    while finished < float("inf"):
        finished = wait_ready(finished)


def _write_changed(place: Staging, layout: RankLayout, image: memoryview, base: Base,
                   wait_ready: Optional[Callable[[float], float]], items: ShareItems) -> None:
    """The tensor items that the base does not hold unchanged written to this rank's data file, at their places in
    the layout (the rest a hole), each as soon as it is hashed; the others shared (the base's files that hold them
    linked). Fills ``items``'s tensor columns and counts."""
    hashed: "queue.SimpleQueue" = queue.SimpleQueue()

    def hash_slots() -> None:  # after the copy, in file order, one slot at a time, handed to the writes below
        try:
            _wait_for_copy(wait_ready)
            for position in layout.unique_slots():
                slot = layout.slots[position]
                data = image[slot.data_start:slot.data_start + slot.nbytes]
                digest = checksum(data)
                held = base.tensor(slot, digest)
                hashed.put((slot, digest, held, content_id(data) if held is not None else ""))
            hashed.put(None)
        except BaseException as e:  # noqa: BLE001 - raised by the writes' side
            hashed.put(e)

    by_start: dict[int, tuple[str, str, str]] = {}  # container start -> (xxh3, content id, file)

    def changed() -> Iterator[tuple[int, int]]:
        while (got := hashed.get()) is not None:
            if isinstance(got, BaseException):
                raise got
            slot, digest, held, identity = got
            file = base.link_unchanged(held, identity, place.directory)
            if file is None:
                file = layout.file_name
                yield slot.start, slot.start + slot.length
            else:
                items.shared += slot.length
            by_start[slot.start] = (digest, identity, file)

    hashing = diskio.submit_background(hash_slots)
    try:
        _size, items.written = diskio.write_ranges(os.path.join(place.directory, layout.file_name), image, changed(),
                                                   layout.size, direct=place.direct_io, threads=place.io_threads)
    finally:
        hashing.exception()  # never leave the hashing thread behind on the image
    found = [by_start[slot.start] for slot in layout.slots]
    items.tensor_digests = [digest for digest, _id, _file in found]
    items.tensor_ids = [content_id for _digest, content_id, _file in found]
    items.tensor_files = [file for _digest, _id, file in found]


def _upload_changed(place: Staging, layout: RankLayout, image: memoryview, base: Base,
                    wait_ready: Optional[Callable[[float], float]], items: ShareItems) -> None:
    """An object store's data file (whole: an object store has no links), the containers of the tensor items the
    base's data file holds unchanged at the same places copied by the store from it, the rest uploaded. Fills
    ``items``'s tensor columns and counts."""
    _wait_for_copy(wait_ready)
    by_start: dict[int, tuple[str, str]] = {}
    copied: list[tuple[int, int]] = []
    joined = False  # the slot before was copied: the zeros between the two containers are the same in both files
    for position in layout.unique_slots():
        slot = layout.slots[position]
        data = image[slot.data_start:slot.data_start + slot.nbytes]
        digest = checksum(data)
        held = base.tensor(slot, digest)
        identity = content_id(data) if held is not None else ""
        by_start[slot.start] = (digest, identity)
        if held is None or held.content_id != identity or held.file != layout.file_name:
            joined = False
            continue
        if joined:
            copied[-1] = (copied[-1][0], slot.start + slot.length)
        else:
            copied.append((slot.start, slot.start + slot.length))
        joined = True
    uploaded = place.backend.compose(join(place.directory, layout.file_name), image, layout.size, copied,
                                     join(base.directory, layout.file_name))
    items.written += uploaded
    items.shared += layout.size - uploaded
    found = [by_start[slot.start] for slot in layout.slots]
    items.tensor_digests = [digest for digest, _id in found]
    items.tensor_ids = [identity for _digest, identity in found]


def _write_objects(place: Staging, items: ShareItems, byte_items: list, base: Optional[Base], *, with_ids: bool) -> None:
    """The pickled objects that the base does not hold unchanged, concatenated into this rank's objects file; the
    others shared."""
    blob, files, ids = bytearray(), [], []
    for fqn, data in byte_items:
        digest = checksum(data)
        held = base.object(fqn, data, digest) if base is not None and not place.backend.remote else None
        identity = content_id(data) if with_ids and (held is not None or base is None) else ""
        file = base.link_unchanged(held, identity, place.directory) if held is not None else None
        if file is None:
            items.objects.append((fqn, len(blob), len(data), digest))
            files.append(items.objects_file)
            blob += data
        else:
            items.objects.append((fqn, held.start, held.length, digest))
            files.append(file)
            items.shared += len(data)
        ids.append(identity)
    if blob:
        place.write_bytes(items.objects_file, bytes(blob))
        items.written += len(blob)
    items.object_ids = ids if with_ids else None
    items.object_files = files if base is not None else None




def _digests(data: memoryview, with_id: bool) -> tuple[str, Optional[str]]:
    """An item's xxh3-64 and, ``with_id``, its content id, each piece hashed for both while in the core's cache."""
    if not with_id:
        return checksum(data), None
    if len(data) <= PIECE_BYTES:
        return checksum(data), content_id(data)
    digest, identity = checksum_stream(), content_id_stream()
    for start in range(0, len(data), PIECE_BYTES):
        piece = data[start:start + PIECE_BYTES]
        digest.update(piece)
        identity.update(piece)
    return digest.hexdigest(), identity.hexdigest()


def slot_digests(image: memoryview, layout: RankLayout, whole_file: bool, *, with_ids: bool = False,
                 ) -> tuple[list[str], Optional[list[str]], Optional[FileChecksum]]:
    """The xxh3 of every slot's bytes in ``image`` (tied tensors share theirs), ``with_ids`` their content ids too,
    and with ``whole_file`` the xxh3 of the tensor file (``image[:layout.size]``) from the same pass: each piece is
    hashed for its slot and for the file while in the core's cache, so the file's checksum costs no second pass over
    memory (docs/DESIGN.md, "Measured"). Slots out of file order leave the file's checksum to the caller
    (None)."""
    by_start: dict[int, tuple[str, Optional[str]]] = {}
    whole, cursor = (checksum_stream() if whole_file else None), 0
    for slot in layout.slots:
        if slot.start in by_start:
            continue
        begin, end = slot.data_start, slot.data_start + slot.nbytes
        if whole is None or begin < cursor:
            whole = None
            by_start[slot.start] = _digests(image[begin:end], with_ids)
            continue
        whole.update(image[cursor:begin])  # the container framing before it
        if end - begin <= PIECE_BYTES:
            by_start[slot.start] = _digests(image[begin:end], with_ids)
            whole.update(image[begin:end])
        else:
            digest, identity = checksum_stream(), content_id_stream() if with_ids else None
            for start in range(begin, end, PIECE_BYTES):
                piece = image[start:min(start + PIECE_BYTES, end)]
                digest.update(piece)
                if identity is not None:
                    identity.update(piece)
                whole.update(piece)
            by_start[slot.start] = (digest.hexdigest(), identity and identity.hexdigest())
        cursor = end
    tensor_file = None
    if whole is not None:
        whole.update(image[cursor:layout.size])
        tensor_file = FileChecksum(layout.size, whole.hexdigest())
    found = [by_start[slot.start] for slot in layout.slots]
    return [digest for digest, _id in found], [i for _digest, i in found] if with_ids else None, tensor_file


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
