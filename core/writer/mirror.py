"""Copying a committed checkpoint to another place, and bringing a mirrored one back.

More: docs/MODULES.md, core/writer/mirror.py.
"""
from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from asyncckpt.core.storage import commit

from asyncckpt.core import tier
from asyncckpt.core.storage import file_checksums
from asyncckpt.core.storage import owners
from asyncckpt.core.formats import names
from asyncckpt.core.errors import CheckpointWriteError, IncompleteCheckpointError
from asyncckpt.core.storage.backend import backend_for, exists, is_file, join, read_bytes
from asyncckpt.core.storage.fsio import fsync_dir
from asyncckpt.core.storage.local import attach_checksum
from asyncckpt.core.storage.object_store import ObjectStoreOptions
from asyncckpt.core.storage.staging import Staging, staging_dir_for
from asyncckpt.core.writer.protocol import RequestContext
from asyncckpt.core.tier.nodes import NodeMap, fetch_missing


@contextlib.contextmanager
def mapped(path: str) -> Iterator[tuple[memoryview, int]]:
    """The bytes of a local file, memory-mapped (an empty file cannot be mapped), and its size; the view is
    released before the mapping is closed."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    try:
        with memoryview(mapping if mapping is not None else b"") as view:
            yield view, size
    finally:
        if mapping is not None:
            with contextlib.suppress(BufferError):  # a failed write's traceback still holds a slice of it: the
                mapping.close()                     # mapping goes with it, and the write's own error is raised


@dataclass
class CopyRequest:
    """Copy the committed local checkpoint ``source`` to ``target`` (a local path or a URL) and commit it there."""

    source: str
    target: str
    options: Optional[ObjectStoreOptions] = None
    nodes: Optional[NodeMap] = None  # a memory checkpoint saved on several nodes: where the files it lacks are

    def run(self, context: RequestContext) -> None:
        copy(self.source, self.target, context.token(), self.options, self.nodes)


def copy(source: str, target: str, token: str, options: Optional[ObjectStoreOptions] = None,
         nodes: Optional[NodeMap] = None) -> None:
    """Copy the committed local checkpoint (or single file) ``source`` to ``target`` and commit it there; what it
    replaces there is deleted once the copy is committed. A memory copy saved on several nodes (``nodes``) that
    lacks files of the checkpoint gets them from the nodes that hold them first (``nodes.fetch_missing``); the
    copy's record is the checkpoint's, without what only the memory tier needs (``tier.TIER_ENTRY``)."""
    backend = backend_for(target, options)
    if os.path.isfile(source):
        checksum = file_checksums.read_record(source)
        with mapped(source) as (view, size):
            backend.write_file(target, view, size, token, checksum=lambda: checksum)
        return
    record = commit.read_commit_record(source)
    if record is None:
        raise CheckpointWriteError(f"cannot copy {source}: it is not a committed checkpoint")
    if nodes is not None and tier.TIER_ENTRY in record:
        unavailable = fetch_missing(nodes, source, record, tier.holders(record))
        if unavailable:
            raise CheckpointWriteError(f"cannot copy {source}: {', '.join(unavailable)} not on this node, and no node "
                                       "that holds a copy gave an intact one")
        record = {key: value for key, value in record.items() if key != tier.TIER_ENTRY}
    place = Staging(staging_dir_for(target, token), target, options, coordinator=True)
    place.claim(0, token)
    for name in sorted(record.get("files", {})):
        with mapped(os.path.join(source, name)) as (view, size):
            place.write_image(name, view, size, None)
    replaced = place.publish(record)  # the source's record as it is: files, sizes, checksums, step, commit time
    if replaced is not None:
        place.delete(replaced, token)


def restore(url: str, path: str, download: Optional[Callable[[str, str], None]] = None) -> str:
    """Download the committed checkpoint at ``url`` to the local ``path`` (which must not exist),
    published there atomically; returns ``path``. ``IncompleteCheckpointError`` if ``url`` holds no
    committed checkpoint. ``download(url, local_file)`` fetches each file (default: from the store; a resume
    under DDP hands over the copies its ranks read together, ``Checkpointer.restore_mirrored``)."""
    path = os.path.abspath(path)
    source = backend_for(url)
    download = download or source.download
    if is_file(source, url):
        checksum = source.read_checksum_record(url)
        temporary = names.hidden_path(path, "tmp", owners.owner_token())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        download(url, temporary)
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
        os.makedirs(os.path.dirname(os.path.join(staging, name)), exist_ok=True)
        download(join(url, name), os.path.join(staging, name))
    backend_for(path).publish(staging, path, read_bytes(source, join(url, names.COMMIT_RECORD)))
    return path


def files_of(url: str) -> list[str]:
    """What ``restore`` downloads of the committed checkpoint (or single file) ``url``: its files' URLs."""
    record = None if is_file(backend_for(url), url) else commit.read_commit_record(url)
    return [url] if record is None else [join(url, name) for name in sorted(record.get("files", {}))]


def mirrored(url_root: str, name: Optional[str] = None) -> Optional[str]:
    """The newest committed checkpoint under ``url_root`` (with ``name``: the checkpoint or single file of that
    name, if the mirror has it); None if the mirror holds none."""
    if name is None:
        return commit.latest_checkpoint(url_root)
    latest = join(url_root, name)
    return latest if exists(backend_for(latest), latest) else None
