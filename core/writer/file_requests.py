"""The background writer's requests for single paths: write a file atomically, remove, link.

Plain data the writer unpickles; kept apart from ``native_files`` (which renders files' images
from tensors, with torch) so that the writer does not import torch. Where the path lives (a local
file system, an object store) is its backend's business (``storage.backend``): a request carries
the path and, for an object store, its options, and the same request serves both.

A file that belongs to a directory transaction carries that save's barrier: if it fails, the
whole directory fails on every rank (and the directory's commit on this rank knows why).

Every file written gets a checksum (``file_checksums``), hashed from the staging buffer while the
file is written.

Removal is atomic (``removal``): no framework, ``latest_checkpoint`` or ``asyncckpt ls``
ever sees a checkpoint half-deleted; a crash in between leaves only a leftover whose owner is
gone, which the next save into that directory or ``asyncckpt clean`` removes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from asyncckpt.core.storage import diskio
from asyncckpt.core.storage import leftovers
from asyncckpt.core.storage import owners
from asyncckpt.core.storage import removal
from asyncckpt.core.formats import names
from asyncckpt.core.writer.barrier import BarrierSpec
from asyncckpt.core.formats.checksum import FileChecksum, checksum
from asyncckpt.core.storage.backend import at_once, backend_for
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

    def run(self, context: RequestContext) -> None:
        backend = backend_for(self.path, self.object_store)
        try:
            if self.barrier is not None:
                settle_in(os.path.dirname(self.path), context, self.barrier, self.rank)
            elif (parent := leftovers.tidy_parent(self.path, self.object_store)) is not None:
                context.tidy(parent)
            image = context.image[:self.size]
            hashing = diskio.submit_background(lambda: checksum(image))  # while the file is written
            digest = lambda: FileChecksum(self.size, hashing.result())  # noqa: E731
            backend.write_file(self.path, context.image, self.size, context.token(),
                               checksum=digest if self.barrier is None else None,
                               direct_io=self.direct_io, io_threads=self.io_threads)
            if self.barrier is not None:
                context.record_file(self.barrier.key, os.path.relpath(self.path, self.barrier.staging_dir), digest())
        except BaseException as e:
            fail_save(context, self.barrier, self.rank, e)
            raise


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
