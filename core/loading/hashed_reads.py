"""Checking a file while a framework's loader reads it: verifying costs no second read and no time of its own.

More: docs/MODULES.md, core/loading/hashed_reads.py.
"""
from __future__ import annotations

import mmap
import os
import threading
from typing import Optional

from asyncckpt.core.formats.checksum import checksum_stream
from asyncckpt.core.storage.file_checksums import FileChecksum

PIECE_BYTES = 16 << 20  # xxhash releases the GIL only for large pieces (docs/DESIGN.md, Measured)


class BackgroundCheck:
    """``mapped_problem(path, expected)`` on a thread of its own, started at once; ``problem()`` waits for it."""

    def __init__(self, path: str, expected: FileChecksum) -> None:
        self._outcome: tuple[Optional[str], Optional[BaseException]] = (None, None)
        self._thread = threading.Thread(target=self._run, args=(path, expected), name="asyncckpt-checksum", daemon=True)
        self._thread.start()

    def _run(self, path: str, expected: FileChecksum) -> None:
        try:
            self._outcome = (mapped_problem(path, expected), None)
        except BaseException as error:  # noqa: BLE001 - an I/O error reading the file: raised by problem()
            self._outcome = (None, error)

    def problem(self) -> Optional[str]:
        """What is wrong with the file (None: it is what was written); an error reading it is raised."""
        self._thread.join()
        found, error = self._outcome
        if error is not None:
            raise error
        return found


def mapped_problem(path: str, expected: FileChecksum) -> Optional[str]:
    """What is wrong with the file at ``path`` against ``expected`` (None: nothing), hashed through a
    read-only mapping (see the module's docstring)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != expected.size:
                return _size_problem(size, expected)
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    except FileNotFoundError:
        return f"missing (recorded with {expected.size} B)"
    digest = checksum_stream()
    if mapping is not None:
        try:
            mapping.madvise(mmap.MADV_SEQUENTIAL)  # read ahead as far as the kernel will
            with memoryview(mapping) as view:
                for start in range(0, size, PIECE_BYTES):
                    digest.update(view[start:start + PIECE_BYTES])
        finally:
            mapping.close()
    return _checksum_problem(digest.hexdigest(), expected)


def _size_problem(size: int, expected: FileChecksum) -> str:
    return f"{'truncated' if size < expected.size else 'grown'}: {size} B on disk, {expected.size} B when written"


def _checksum_problem(found: str, expected: FileChecksum) -> Optional[str]:
    return None if found == expected.xxh3 else f"checksum mismatch: expected xxh3 {expected.xxh3}, found {found}"
