"""The background writer's requests for single paths: write a file atomically, remove, link.

Plain data the writer unpickles; kept apart from ``native_files`` (which renders files' images
from tensors, with torch) so that the writer does not import torch.

A file that belongs to a directory transaction carries that save's barrier: if it fails, the
whole directory fails on every rank (and the directory's commit on this rank knows why).

Every file written gets a checksum (``file_checksums``), hashed from the staging buffer while the
file is written.

Removal is atomic: a directory is first renamed to a hidden ``removing`` name (``names``), so no
framework, ``latest_checkpoint`` or ``asyncckpt ls`` ever sees it half-deleted, and deleted once
the request's reply is sent; a crash in between leaves only a hidden leftover whose owner is
gone, which the next save into that directory or ``asyncckpt clean`` removes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

from asyncckpt.core.storage import diskio
from asyncckpt.core.storage import file_checksums
from asyncckpt.core.storage import leftovers
from asyncckpt.core.formats import names
from asyncckpt.core.writer.barrier import BarrierSpec
from asyncckpt.core.formats.checksum import checksum
from asyncckpt.core.storage.file_checksums import FileChecksum
from asyncckpt.core.storage.fsio import atomic_write_bytes, fsync_dir
from asyncckpt.core.writer.protocol import RequestContext


def fail_save(context: RequestContext, spec: Optional[BarrierSpec], rank: int, error: BaseException) -> None:
    """A file of a multi-file save failed: the save fails on this rank and on every other."""
    if spec is not None:
        reason = f"{type(error).__name__}: {error}"
        context.record_failure(spec.key, reason)
        context.barrier(spec).fail(rank, reason)


def settle_in(directory: str, context: RequestContext, spec: Optional[BarrierSpec], rank: int) -> None:
    """Make ``directory`` for a file; a file of a multi-file save first claims the save's staging
    directory (so it is never taken for a leftover while this writer lives). Tidies leftovers of
    dead writers beside the file (or beside the staging directory) once the reply is sent."""
    if spec is not None:
        leftovers.claim(spec.staging_dir, rank, context.token())
        context.tidy(os.path.dirname(spec.staging_dir))
    else:
        context.tidy(directory)
    os.makedirs(directory, exist_ok=True)


def record(context: RequestContext, path: str, spec: Optional[BarrierSpec], digest: FileChecksum,
           temporary: str) -> None:
    """Where a file's checksum goes: a file of a directory checkpoint to the writer's list for the
    directory's commit record; a single file to an attribute of the file itself (``file_checksums``)."""
    if spec is not None:
        context.record_file(spec.key, os.path.relpath(path, spec.staging_dir), digest)
    else:
        file_checksums.write_record(temporary, digest)


@dataclass
class FileRequest:
    """Write a staged single file atomically: hidden temporary name, fsync, rename, fsync the directory."""

    path: str
    size: int
    rank: int = 0
    direct_io: bool = True
    io_threads: int = 2
    barrier: Optional[BarrierSpec] = None  # of the directory this file belongs to

    def run(self, context: RequestContext) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        temporary = names.hidden_path(self.path, "tmp", context.token())
        try:
            settle_in(directory, context, self.barrier, self.rank)
            image = context.image[:self.size]
            hashing = diskio.submit_background(lambda: checksum(image))  # while the file is written
            diskio.write_image(temporary, context.image, self.size, direct=self.direct_io, threads=self.io_threads)
            record(context, self.path, self.barrier, FileChecksum(self.size, hashing.result()), temporary)
            os.replace(temporary, self.path)
            fsync_dir(directory)
        except BaseException as e:
            if os.path.lexists(temporary):
                os.unlink(temporary)
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
            record(context, self.path, self.barrier, FileChecksum(len(self.data), checksum(self.data)), "")
            atomic_write_bytes(self.path, self.data)
        except BaseException as e:
            fail_save(context, self.barrier, self.rank, e)
            raise


def remove_paths(paths: list[str], token: Callable[[], str], later: Callable[[Callable[[], None]], None],
                 hidden_parent: Optional[str] = None) -> None:
    """Remove each path atomically: a file by unlinking it, a directory by renaming it to a hidden
    ``removing`` name (in ``hidden_parent`` if given: a directory whose every entry a framework
    counts) and deleting it ``later`` (in the writer: after the reply)."""
    touched = set()
    for path in paths:
        parent = os.path.dirname(path)
        if os.path.isdir(path) and not os.path.islink(path):
            aside = names.hidden_path(path, "removing", token(), hidden_parent)
            os.rename(path, aside)
            touched.add(os.path.dirname(aside))
            later(lambda aside=aside: leftovers.delete(aside))
        elif os.path.lexists(path):
            os.unlink(path)
        else:
            continue
        touched.add(parent)
    for directory in touched:
        fsync_dir(directory)


@dataclass
class RemoveRequest:
    """Remove files or checkpoint directories, in queue order (usually after the save that made
    them redundant, and only if it succeeded: ``protocol.Job.after``)."""

    paths: list
    hidden_parent: Optional[str] = None

    def run(self, context: RequestContext) -> None:
        remove_paths(self.paths, context.token, context.after_reply, self.hidden_parent)

    def run_here(self) -> None:
        """Remove at once, in the calling process: with nothing else pending, starting a writer
        process for a removal costs more than the removal."""
        remove_paths(self.paths, leftovers.owner_token, lambda action: action(), self.hidden_parent)


@dataclass
class LinkRequest:
    """Point ``linkpath`` at ``target`` with a relative symlink, replacing what is there atomically."""

    target: str
    linkpath: str

    def run(self, context: RequestContext) -> None:
        directory = os.path.dirname(self.linkpath)
        os.makedirs(directory, exist_ok=True)
        if os.path.isdir(self.linkpath) and not os.path.islink(self.linkpath):
            remove_paths([self.linkpath], context.token, context.after_reply)
        temporary = names.hidden_path(self.linkpath, "link", context.token())
        os.symlink(os.path.relpath(self.target, directory), temporary)
        try:
            os.replace(temporary, self.linkpath)
        except BaseException:
            os.unlink(temporary)
            raise
        fsync_dir(directory)
