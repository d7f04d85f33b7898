"""The background writer's requests for single paths: write a file atomically, remove, link.

Plain data the writer unpickles; kept apart from ``file_images`` (which renders files' images
from tensors, with torch) so that the writer does not import torch. Where the path lives (a local
file system, an object store) is its backend's business (``storage.backend``): a request carries
the path and, for an object store, its options, and the same request serves both.

More: docs/MODULES.md, core/writer/file_requests.py.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Optional

from asyncckpt.core.storage import diskio
from asyncckpt.core.storage import leftovers
from asyncckpt.core.storage import owners
from asyncckpt.core.storage import removal
from asyncckpt.core.formats import names
from asyncckpt.core.writer.barrier import BarrierSpec
from asyncckpt.core.formats.checksum import (PIECE_BYTES, FileChecksum, checksum, checksum_stream, content_id,
                                             content_id_stream)
from asyncckpt.core.formats.layout import IO_ALIGNMENT
from asyncckpt.core.storage.backend import at_once, backend_for, join, normalize
from asyncckpt.core.storage.sharing import newest_committed, parent_of
from asyncckpt.core.storage.fsio import atomic_write_bytes, fsync_dir
from asyncckpt.core.writer.protocol import RequestContext


def fail_save(context: RequestContext, spec: Optional[BarrierSpec], rank: int, error: BaseException) -> None:
    """A file of a multi-file save failed: the save fails on this rank and on every other."""
    if spec is not None:
        reason = f"{type(error).__name__}: {error}"
        context.record_failure(spec.key, reason)
        context.barrier(spec).fail(rank, reason)


def settle_in(directory: str, context: RequestContext, spec: Optional[BarrierSpec], rank: int) -> None:
    """Make ``directory`` for a file of a multi-file save, first claiming the save's staging
    directory (so it is never taken for a leftover while this writer lives). Tidies leftovers of
    dead writers beside the staging directory once the reply is sent."""
    owners.claim(spec.staging_dir, rank, context.token())
    context.barrier(spec).begin(rank)
    context.tidy(os.path.dirname(spec.staging_dir))
    os.makedirs(directory, exist_ok=True)


@dataclass
class FileRequest:
    """Write a staged single file, whole or not at all (``Backend.write_file``), with its checksum:
    attached to the file, or, for a file of a directory checkpoint, kept for the directory's
    commit record."""

    path: str
    size: int
    rank: int = 0
    direct_io: bool = True
    io_threads: int = 2
    barrier: Optional[BarrierSpec] = None  # of the directory this file belongs to
    object_store: Any = None  # ObjectStoreOptions when ``path`` is a URL
    # A file of a directory checkpoint whose bytes equal the same file's in the one before is shared, not written.
    share_unchanged: bool = True

    def run(self, context: RequestContext) -> None:
        backend = backend_for(self.path, self.object_store)
        try:
            if self.barrier is not None:
                settle_in(os.path.dirname(self.path), context, self.barrier, self.rank)
            elif (parent := leftovers.tidy_parent(self.path, self.object_store)) is not None:
                context.tidy(parent)
            name = os.path.relpath(self.path, self.barrier.staging_dir) if self.barrier is not None else None
            base = base_file(self.barrier, name) if self.share_unchanged and name is not None else None
            hashing = _Hashing(context.image[:self.size], base,
                               with_id=self.share_unchanged and name is not None and base is None)
            try:
                backend.write_file(self.path, context.image, self.size, context.token(),
                                   checksum=hashing.result if self.barrier is None else None, direct_io=self.direct_io,
                                   io_threads=self.io_threads, wait_ready=hashing.wait_ready if base else None)
                context.report(written=self.size)
            except _Unchanged:
                if not backend.share_file(base[0], self.path):  # the base went meanwhile: written after all
                    backend.write_file(self.path, context.image, self.size, context.token(), checksum=None,
                                       direct_io=self.direct_io, io_threads=self.io_threads)
                    context.report(written=self.size)
                else:
                    context.report(shared=self.size)
            if self.barrier is not None:
                context.record_file(self.barrier.key, name, hashing.result())
        except BaseException as e:
            fail_save(context, self.barrier, self.rank, e)
            raise


class _Unchanged(Exception):
    """The file being written equals the base's: its write ends, and the base's is shared instead."""


class _Hashing:
    """A file's xxh3 (and, ``with_id`` or where it equals the ``base``'s, its content id) hashed piece by piece on a
    helper thread while the file is written. With a base (``base_file``: a file of the same size in the checkpoint
    before) the write follows behind the hashing (``wait_ready``: the hash runs several times faster than a write),
    and a file found equal to the base's ends its write (``_Unchanged``): little of it was written by then."""

    _AHEAD = 4 << 20  # how far the hashing gets before the write follows: whole pages

    def __init__(self, image: memoryview, base: Optional[tuple[str, FileChecksum]], *, with_id: bool) -> None:
        self.image, self.base, self.with_id = image, base[1] if base else None, with_id
        self.hashed, self.finished = 0, False
        self.changed = threading.Condition()
        self.future = diskio.submit_background(self._hash)

    def _hash(self) -> FileChecksum:
        try:
            digest, identity = checksum_stream(), content_id_stream() if self.with_id else None
            for start in range(0, len(self.image), PIECE_BYTES):
                piece = self.image[start:start + PIECE_BYTES]
                digest.update(piece)
                if identity is not None:
                    identity.update(piece)
                with self.changed:
                    self.hashed = start + len(piece)
                    self.changed.notify_all()
            found = FileChecksum(len(self.image), digest.hexdigest(), identity and identity.hexdigest())
            if found.content_id is None and self.base is not None and self.base.xxh3 == found.xxh3:  # a candidate
                found = FileChecksum(found.size, found.xxh3, content_id(self.image))
            return found
        finally:
            with self.changed:
                self.finished = True
                self.changed.notify_all()

    def result(self) -> FileChecksum:
        return self.future.result()

    def wait_ready(self, written: float) -> float:
        """How far the write may go (``diskio.write_image``); raises ``_Unchanged`` once the file equals the base's."""
        with self.changed:
            self.changed.wait_for(lambda: self.finished or self.hashed - written >= self._AHEAD)
            if not self.finished:
                return self.hashed - self.hashed % IO_ALIGNMENT
        found = self.result()
        if self.base is not None and self.base.content_id and self.base.content_id == found.content_id \
                and self.base.size == found.size:
            raise _Unchanged()
        return float("inf")


_bases: dict[str, Optional[tuple[str, dict]]] = {}  # directory save -> the checkpoint before it and its record


def base_file(barrier: BarrierSpec, name: str) -> Optional[tuple[str, FileChecksum]]:
    """The file ``name`` of the newest committed checkpoint beside the directory checkpoint ``barrier`` saves, and
    its recorded checksum (with its content id, where recorded), if it has one: what the file may share."""
    if barrier.key not in _bases:
        while len(_bases) >= 4:  # a save's files come one after the other: the last few saves are plenty
            _bases.pop(next(iter(_bases)))
        _bases[barrier.key] = newest_committed(parent_of(barrier.final_path), normalize(barrier.staging_dir))
    found = _bases[barrier.key]
    recorded = found and (found[1].get("checksums") or {}).get(name)
    if not isinstance(recorded, dict) or not isinstance(recorded.get("size"), int):
        return None
    return join(found[0], name), FileChecksum(recorded["size"], str(recorded.get("xxh3")), recorded.get("xxh3_128"))


@dataclass
class BytesRequest:
    """Write small bytes of a directory checkpoint (a snapshot already taken: JSON, a pickle)
    atomically and durably."""

    path: str
    data: bytes
    rank: int
    barrier: BarrierSpec  # of the directory this file belongs to

    def run(self, context: RequestContext) -> None:
        try:
            settle_in(os.path.dirname(self.path), context, self.barrier, self.rank)
            context.record_file(self.barrier.key, os.path.relpath(self.path, self.barrier.staging_dir),
                                FileChecksum(len(self.data), checksum(self.data)))
            atomic_write_bytes(self.path, self.data)
            context.report(written=len(self.data))
        except BaseException as e:
            fail_save(context, self.barrier, self.rank, e)
            raise


@dataclass
class RemoveRequest:
    """Remove files or checkpoints, in queue order (usually after the save that made them
    redundant, and only if it succeeded: ``protocol.Job.after``); all of one backend."""

    paths: list
    hidden_parent: Optional[str] = None
    object_store: Any = None  # ObjectStoreOptions when the paths are URLs

    def run(self, context: RequestContext) -> None:
        removal.remove(self.paths, context.token(), context.after_reply, hidden_parent=self.hidden_parent,
                       options=self.object_store)

    def run_here(self) -> None:
        """Remove at once, in the calling process: with nothing else pending, starting a writer
        process for a removal costs more than the removal."""
        removal.remove(self.paths, owners.owner_token(), at_once, hidden_parent=self.hidden_parent,
                       options=self.object_store)


@dataclass
class LinkRequest:
    """Point ``linkpath`` at ``target`` with a relative symlink, replacing what is there atomically."""

    target: str
    linkpath: str

    def run(self, context: RequestContext) -> None:
        directory = os.path.dirname(self.linkpath)
        os.makedirs(directory, exist_ok=True)
        if os.path.isdir(self.linkpath) and not os.path.islink(self.linkpath):
            backend_for(self.linkpath).remove_tree(self.linkpath, context.token(), later=context.after_reply)
        temporary = names.hidden_path(self.linkpath, "link", context.token())
        os.symlink(os.path.relpath(self.target, directory), temporary)
        try:
            os.replace(temporary, self.linkpath)
        except BaseException:
            os.unlink(temporary)
            raise
        fsync_dir(directory)
