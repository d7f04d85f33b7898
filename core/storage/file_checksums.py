"""Checksums of the native files the core writes, and checking a file against its checksum.

More: docs/MODULES.md, core/storage/file_checksums.py.
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
