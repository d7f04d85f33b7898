"""A file a framework's loader reads through while its checksum is computed: verifying costs no second read.

A resume used to check a checkpoint file (one pass over its bytes) and then let the framework load it
(a second pass). With a cold page cache the check read the file from the disk and the load read it
again from the cache, but the two ran one after the other: the load's own reads overlap the disk with
its deserialisation (the kernel reads ahead while ``torch.load`` builds tensors), the check's could not,
so a cold resume cost the framework's own load plus a disk read (docs/benchmarks_resume.md). ``HashedFile`` is
what the loader reads instead of the file: every byte it hands out is hashed right after it lands
(in pieces of ``PIECE_BYTES``, still in the CPU's cache), so the load *is* the check and the disk is
read once.

The hash is of the file in order (xxh3-64 of the whole file, as recorded when it was written), while a
loader reads where it likes: a zip reader (``torch.load``) reads the directory at the end first, each
record's fixed header, skips the name, then the record's data. So the bytes hashed so far are a
prefix of the file: a read that continues it extends it; a read a little ahead (up to
``GAP_BYTES``: a record's name and alignment padding) first hashes the gap, read here from the page
cache the loader's read just filled; a read further ahead or behind is handed out unhashed, and
``problem()`` hashes whatever the loader left out once it is done (bytes it read are then in the
page cache; only what it never read comes from the disk).

A file its loader maps instead of reading (safetensors) is checked by ``mapped_problem``, which hashes
it through a mapping of its own: its pages enter the page cache without being copied anywhere, and the
loader's mapping then finds them there. Hashing it with ``read()`` into a buffer first cost several times
the hash itself in CPU (a copy out of the page cache the loader never needed).

Kept free of torch (``torch.load`` takes any file object with ``readinto``/``seek``/``tell``).
"""
from __future__ import annotations

import io
import mmap
import os
from typing import Optional

from asyncckpt.core.formats.checksum import checksum_stream
from asyncckpt.core.storage.file_checksums import FileChecksum

PIECE_BYTES = 1 << 20
GAP_BYTES = 1 << 20


class HashedFile(io.RawIOBase):
    """``open(path, "rb")`` for a loader, checking the bytes against ``expected`` as they are read;
    ``problem()`` at the end says what is wrong (None: the file is what was written)."""

    def __init__(self, path: str, expected: FileChecksum) -> None:
        super().__init__()
        self.name, self.expected = path, expected
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._size = os.fstat(self._fd).st_size
        self._position = 0
        self._hashed = 0  # bytes [0, _hashed) are in the digest
        self._digest = checksum_stream()
        self._scratch: Optional[bytearray] = None

    # ------------------------------------------------------------------ io.RawIOBase
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = 0 if whence == io.SEEK_SET else self._position if whence == io.SEEK_CUR else self._size
        if base + offset < 0:
            raise ValueError(f"{self.name}: negative seek position {base + offset}")
        self._position = base + offset
        return self._position

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        wanted = max(0, min(len(view), self._size - self._position))
        done = 0
        while done < wanted:
            piece = view[done:done + min(PIECE_BYTES, wanted - done)]
            got = os.preadv(self._fd, [piece], self._position + done)
            if not got:
                break  # the file shrank under us: the size check in problem() says so
            self._hash(self._position + done, piece[:got])
            done += got
        self._position += done
        return done

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()

    # ------------------------------------------------------------------ the check
    def problem(self) -> Optional[str]:
        """Hash what the loader did not read, then compare: what is wrong, or None."""
        size = os.fstat(self._fd).st_size
        if size != self.expected.size:
            return _size_problem(size, self.expected)
        self._hash_up_to(size)
        if self._hashed != size:
            return _size_problem(self._hashed, self.expected)
        return _checksum_problem(self._digest.hexdigest(), self.expected)

    def _hash(self, start: int, data: memoryview) -> None:
        if start > self._hashed:
            if start - self._hashed > GAP_BYTES:
                return  # far ahead of the prefix: hashed when the prefix gets there, or by problem()
            self._hash_up_to(start)
        end = start + len(data)
        if end > self._hashed:
            self._digest.update(data[self._hashed - start:])
            self._hashed = end

    def _hash_up_to(self, end: int) -> None:
        """Extend the hashed prefix to ``end`` with reads of our own."""
        if self._scratch is None:
            self._scratch = bytearray(PIECE_BYTES)
        scratch = memoryview(self._scratch)
        while self._hashed < end:
            got = os.preadv(self._fd, [scratch[:min(PIECE_BYTES, end - self._hashed)]], self._hashed)
            if not got:
                return
            self._digest.update(scratch[:got])
            self._hashed += got


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
