"""Mirroring committed local checkpoints to an object store, and bringing one back.

For frameworks that write local directories (Accelerate's ``checkpoint_N``, the Trainer's
``checkpoint-N``): ``Checkpointer.mirror(path, url, after=handle)`` queues a ``MirrorRequest``
behind the save of ``path`` that runs only if it committed, in the background writer. It uploads
the files the local commit record lists (memory-mapped, as multipart uploads) under ``url``/ and
then creates the commit object there with the same record (files, sizes, checksums, step), so the
mirror is a checkpoint of its own (``object_backend``): ``latest_checkpoint(url_root)`` finds
it, ``asyncckpt verify`` checks it. A single file is uploaded as one object with its checksum.

``restore(url, path)`` (training process, at resume, when the local copy is missing) downloads a
committed mirror into a hidden staging directory beside ``path``, writes the commit record last
and renames it into place: locally it is then what the save had written, checksums included.

Kept free of torch: the background writer imports it.
"""
from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Optional

from asyncckpt.core.storage import commit
from asyncckpt.core.storage import file_checksums
from asyncckpt.core.storage import owners
from asyncckpt.core.formats import names
from asyncckpt.core.errors import CheckpointWriteError, IncompleteCheckpointError
from asyncckpt.core.storage.backend import backend_for, basename, exists, is_file, join, read_bytes
from asyncckpt.core.storage.fsio import fsync_dir
from asyncckpt.core.storage.local import attach_checksum
from asyncckpt.core.storage.object_store import ObjectStoreOptions
from asyncckpt.core.storage.staging import Staging
from asyncckpt.core.writer.protocol import RequestContext


def _mapped(path: str):
    """``(mapping or None, size)`` of a local file (an empty file cannot be mapped)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None), size


@dataclass
class MirrorRequest:
    """Upload the committed local checkpoint ``source`` to ``url`` and commit it there."""

    source: str
    url: str
    options: Optional[ObjectStoreOptions] = None

    def run(self, context: RequestContext) -> None:
        upload(self.source, self.url, context.token(), self.options)


def upload(source: str, url: str, token: str, options: Optional[ObjectStoreOptions] = None) -> None:
    """Upload the committed local checkpoint (or single file) ``source`` to ``url`` and commit it there."""
    target = backend_for(url, options)
    if os.path.isfile(source):
        checksum = file_checksums.read_record(source)
        mapping, size = _mapped(source)
        try:
            target.write_file(url, memoryview(mapping) if mapping is not None else memoryview(b""), size, token,
                              checksum=lambda: checksum)
        finally:
            if mapping is not None:
                mapping.close()
        return
    record = commit.read_commit_record(source)
    if record is None:
        raise CheckpointWriteError(f"cannot mirror {source}: it is not a committed checkpoint")
    place = Staging(url, url, options, coordinator=True)
    place.claim(0, token)
    for name in sorted(record.get("files", {})):
        mapping, size = _mapped(os.path.join(source, name))
        try:
            place.write_image(name, memoryview(mapping) if mapping is not None else memoryview(b""), size, None)
        finally:
            if mapping is not None:
                mapping.close()
    place.publish(record)  # the local record as it is: files, sizes, checksums, step, commit time


def restore(url: str, path: str) -> str:
    """Download the committed checkpoint at ``url`` to the local ``path`` (which must not exist),
    published there atomically; returns ``path``. ``IncompleteCheckpointError`` if ``url`` holds no
    committed checkpoint."""
    path = os.path.abspath(path)
    source = backend_for(url)
    if is_file(source, url):
        checksum = source.read_checksum_record(url)
        temporary = names.hidden_path(path, "tmp", owners.owner_token())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        source.download(url, temporary)
        if checksum is not None:
            attach_checksum(temporary, checksum)
        os.replace(temporary, path)
        fsync_dir(os.path.dirname(path))
        return path
    record = commit.read_commit_record(url)
    if record is None:
        raise IncompleteCheckpointError(f"{url} holds no committed checkpoint to restore", path=url)
    staging = names.staging_dir_for(path, owners.owner_token())
    os.makedirs(staging)
    for name in sorted(record.get("files", {})):
        source.download(join(url, name), os.path.join(staging, name))
    backend_for(path).publish(staging, path, read_bytes(source, join(url, names.COMMIT_RECORD)))
    return path


def restore_latest(url_root: str, local_root: str, name: Optional[str] = None) -> Optional[str]:
    """The newest committed checkpoint under ``url_root`` (with ``name``: the checkpoint or single file of
    that name, if the mirror has it), restored under ``local_root`` with its name (unless a copy is there
    already); None if the mirror holds none."""
    if name is None:
        latest = commit.latest_checkpoint(url_root)
    else:
        latest = join(url_root, name)
        latest = latest if exists(backend_for(latest), latest) else None
    if latest is None:
        return None
    local = os.path.join(local_root, basename(latest))
    return local if os.path.exists(local) else restore(latest, local)
