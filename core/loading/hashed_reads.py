"""Checking a file while a framework's loader reads it: verifying costs no second read and no time of its own.

A resume used to check a checkpoint file (one pass over its bytes) and then let the framework load it
(a second pass). With a cold page cache the check read the file from the disk and the load read it
again from the cache, one after the other, so a cold resume cost the framework's own load plus a disk
read (docs/benchmarks/resume.md). Then the load read through a file object that hashed what it handed
out: one read, but the hash ran on the loader's thread, inside its reads, and the loader no longer read
the path its own way.

``BackgroundCheck`` hashes the file on a thread of its own while the framework loads the path exactly as
it would without asyncckpt: both read the same pages, so the disk is read once (whichever touches a page
first brings it into the page cache for the other), and the hash, which releases the GIL for pieces of
``PIECE_BYTES`` (xxhash does for large inputs), runs on the other core while the loader builds tensors.
The hash reads through a read-only mapping (``mapped_problem``): its pages enter the page cache without
being copied anywhere. A file its loader maps (safetensors) finds its pages there too.

Kept free of torch.
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
