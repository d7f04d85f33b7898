"""Large parallel reads and writes, with O_DIRECT where the filesystem allows it.

O_DIRECT matters on hosts that reclaim freed memory: a buffered write has to allocate page
cache, which after idle time runs at a fraction of the disk's speed. Direct I/O streams from our
(held, page-aligned) snapshot buffer instead. Filesystems without O_DIRECT (tmpfs, some FUSE
and network mounts) fall back to buffered writes transparently. In a memory tier's run directory
an image that could not be linked (``snapshot.shared_buffer``) is copied into a spare file's pages
(``spares``): existing tmpfs pages, mapped, cost less than new ones written.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Optional

from asyncckpt.core.formats.layout import IO_ALIGNMENT, align_up
from asyncckpt.core.storage import spares

CHUNK_BYTES = 32 << 20
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(threads: int) -> ThreadPoolExecutor:
    """A process-wide pool per size, so repeated saves do not spawn threads (the background writer's)."""
    with _pools_lock:
        if threads not in _pools:
            _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="asyncckpt-io")
        return _pools[threads]


def _open_for_write(path: str, direct: bool) -> tuple[int, bool]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644), True
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
    return os.open(path, flags, 0o644), False


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _chunk_size(total: int, threads: int) -> int:
    """Aligned writes of at most ``CHUNK_BYTES``, at least one per thread."""
    return max(IO_ALIGNMENT, min(CHUNK_BYTES, align_up(-(-total // max(threads, 1)), IO_ALIGNMENT)))


def write_image(path: str, image: memoryview, size: int, *, direct: bool = True, threads: int = 2,
                wait_ready: Optional[Callable[[float], float]] = None) -> bool:
    """Durably write ``image[:size]`` to ``path`` (fsync'd). Returns whether O_DIRECT was used.

    ``image`` must be page-aligned (a ``StagingBuffer``, a memory-mapped file). Direct writes cover
    whole blocks: where the image extends past ``size`` to a whole block (a snapshot buffer), the
    file is written to that block and truncated to ``size``; where it ends at ``size`` (a mapped
    file), its last partial block is written through the page cache. With ``wait_ready`` (see
    ``CopyProgress.waiter``) the image is still being copied: each part is written as soon as it
    is ready, so the write overlaps the copy.
    """
    recycled = None if image.readonly else spares.take(path, size)
    if recycled is not None:
        _copy_over(recycled, image, size, threads, wait_ready or _all_ready)
        return False
    fd, used_direct = _open_for_write(path, direct)
    try:
        direct_end = size
        if used_direct:
            padded = align_up(size, IO_ALIGNMENT)
            direct_end = padded if len(image) >= padded else size - size % IO_ALIGNMENT
        if direct_end:
            try:
                os.posix_fallocate(fd, 0, max(direct_end, size))
            except OSError:
                pass  # not supported everywhere; only an allocation hint
            _write_parts(direct_end, _chunk_size(direct_end, threads), threads, wait_ready or _all_ready,
                         lambda start, end: _pwrite_all(fd, image[start:end], start))
        if direct_end < size:  # the partial last block of an image that ends at ``size``
            _write_buffered(path, image[direct_end:size], direct_end)
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
    return used_direct


def write_ranges(path: str, image: memoryview, ranges: Iterable[tuple[int, int]], most: int, *, direct: bool = True,
                 threads: int = 2) -> tuple[int, int]:
    """Durably write ``image[start:end]`` at the same offsets of the file ``path`` for each of ``ranges`` (ascending,
    disjoint; an iterator that may still be deciding them), and nothing else: the rest of the file is a hole (a data
    file whose other items another file holds, ``storage.sharing``). The file ends at the last range's end; none is
    made where ``ranges`` is empty. Each range is widened to whole pages (O_DIRECT), within ``image``, allocated
    and written as soon as it is known, into a file already ``most`` bytes long (the most it can be): direct writes
    that neither extend the file nor allocate as they go run side by side, as ``write_image``'s do. Returns the
    file's size and the bytes written."""
    fd, used_direct, pending, size, written = None, False, None, 0, 0
    futures: list = []
    tail: Optional[tuple[int, int]] = None  # past the image's last whole page (a mapped file): written buffered

    def flush(begin: int, end: int) -> None:
        nonlocal written, tail
        if used_direct and end % IO_ALIGNMENT:
            tail, end = (end - end % IO_ALIGNMENT, end), end - end % IO_ALIGNMENT
        try:
            os.posix_fallocate(fd, begin, max(end, tail[1] if tail else end) - begin)
        except OSError:
            pass  # not supported everywhere; only an allocation hint
        for start in range(begin, end, CHUNK_BYTES):
            stop = min(start + CHUNK_BYTES, end)
            futures.append(_pool(max(threads, 1)).submit(_pwrite_all, fd, image[start:stop], start))
            written += stop - start

    try:
        try:
            for start, end in ranges:
                if fd is None:
                    fd, used_direct = _open_for_write(path, direct)
                    os.ftruncate(fd, most)
                size = max(size, end)
                begin, end = start - start % IO_ALIGNMENT, min(align_up(end, IO_ALIGNMENT), len(image))
                if pending is not None and begin <= pending[1]:
                    pending[1] = max(pending[1], end)
                else:
                    if pending is not None:
                        flush(*pending)
                    pending = [begin, end]
                while pending[1] - pending[0] > CHUNK_BYTES:  # under way while the rest is decided
                    flush(pending[0], pending[0] + CHUNK_BYTES)
                    pending[0] += CHUNK_BYTES
            if pending is not None:
                flush(*pending)
        finally:
            errors = [future.exception() for future in futures]  # never leave a write running on a closed fd
        for error in errors:
            if error is not None:
                raise error
        if fd is None:
            return 0, 0
        if tail is not None:
            _write_buffered(path, image[tail[0]:tail[1]], tail[0])
            written += tail[1] - tail[0]
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        if fd is not None:
            os.close(fd)
    return size, written


def _write_buffered(path: str, data: memoryview, offset: int) -> None:
    """``data`` at ``offset`` of the file ``path`` (open with O_DIRECT elsewhere) through the page cache."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        _pwrite_all(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def _all_ready(_written: float) -> float:
    return float("inf")


def _copy_over(fd: int, image: memoryview, size: int, threads: int, wait_ready: Callable[[float], float]) -> None:
    """``image[:size]`` into the file ``fd`` (a spare of ``size`` bytes: ``spares.take``), then closed: copied into
    a mapping of its pages, every page mapped at once (about half the CPU of writing over them: ``spares``), in
    parallel parts (``ctypes.memmove`` lets go of the GIL)."""
    try:
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) as pages:
            target, source = _address(pages), _address(image)
            _write_parts(size, _chunk_size(size, threads), threads, wait_ready,
                         lambda start, end: ctypes.memmove(target + start, source + start, end - start))
        os.fsync(fd)
    finally:
        os.close(fd)


def _address(buffer: Any) -> int:
    """Where a writable buffer's bytes begin (valid while the buffer is)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _write_parts(padded: int, chunk: int, threads: int, wait_ready: Callable[[float], float],
                 write: Callable[[int, int], Any]) -> None:
    """``write(start, end)`` for the parts of ``[0, padded)``, in chunks on the I/O pool, each as soon as
    ``wait_ready`` says it is in the image (at once, when nothing is still copying into it). Progress
    comes in whole pages, so direct writes stay aligned."""
    futures, written = [], 0
    try:
        while written < padded:
            ready = int(min(padded, wait_ready(written)))
            futures += [_pool(max(threads, 1)).submit(write, start, min(start + chunk, ready))
                        for start in range(written, ready, chunk)]
            written = ready
    finally:
        errors = [future.exception() for future in futures]  # never leave a write running on a closed fd
    for error in errors:
        if error is not None:
            raise error


def write_small_file(path: str, data: bytes) -> None:
    """Write and fsync a small file (pickled objects)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        _pwrite_all(fd, memoryview(data), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def submit_background(function):
    """Run ``function`` on a dedicated helper thread (not the I/O pool, which it must not starve)."""
    return _pool(1).submit(function)


def run_parallel(function, jobs: list, threads: int) -> list:
    """Run ``function(job)`` for each job on threads of its own and return results in order. Used by
    loads in the training process, which keep no thread of ours once they return (starting them is
    small next to a load: docs/DESIGN.md)."""
    if threads <= 1 or len(jobs) <= 1:
        return [function(job) for job in jobs]
    with ThreadPoolExecutor(min(threads, len(jobs)), thread_name_prefix="asyncckpt-read") as pool:
        return list(pool.map(function, jobs))
