"""Checksums of the native files the core writes, and checking a file against its checksum.

Every file the background writer writes (a Lightning ``.ckpt``, every file of an Accelerate or
Trainer checkpoint directory, a sharded checkpoint's extra files) gets an xxh3-64 of its bytes,
hashed by the writer from the staging buffer it writes from (no extra pass over the training
process's memory). Where it is recorded (docs/FORMAT.md §4):

* a file of a checkpoint directory: in the directory's commit record, ``"checksums"``;
* a single file: attached to the file itself by its backend (``Backend.write_file``): an
  extended attribute of a local file (``local``), the user metadata of an object
  (``object_backend``); the record itself is ``formats.checksum.record_body``.

Checking reads the file in pieces (``Backend.read_pieces``: locally into a reused buffer) and
hashes each piece while it is still in the core's cache, so verifying costs about one read of
the file.

Kept free of torch: the background writer imports it.
"""
from __future__ import annotations

from typing import Callable, Optional

from asyncckpt.core.formats.checksum import FileChecksum, checksum_stream
from asyncckpt.core.storage.backend import backend_for

PIECE_BYTES = 1 << 20


def read_record(path: str) -> Optional[FileChecksum]:
    """The checksum attached to the single file at ``path`` (locally following a symlink to the
    file it names), or None: none attached (written without asyncckpt, or copied without it)."""
    return backend_for(path).read_checksum_record(path)


def problem(path: str, expected: FileChecksum, progress: Optional[Callable[[int], None]] = None) -> Optional[str]:
    """What is wrong with the file at ``path`` against ``expected``, or None if it matches."""
    backend = backend_for(path)
    try:
        size = backend.stat(path).size
    except FileNotFoundError:
        return f"missing (recorded with {expected.size} B)"
    if size != expected.size:
        return f"{'truncated' if size < expected.size else 'grown'}: {size} B on disk, {expected.size} B when written"
    digest = checksum_stream()
    for piece in backend.read_pieces(path, PIECE_BYTES):
        digest.update(piece)
        if progress is not None:
            progress(len(piece))
    if digest.hexdigest() != expected.xxh3:
        return f"checksum mismatch: expected xxh3 {expected.xxh3}, found {digest.hexdigest()}"
    return None
