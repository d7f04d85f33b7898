"""Snapshot buffers: shared host memory laid out as a rank's data file, allocated once, reused.

A ``StagingBuffer`` is a memfd mapping: the training process copies tensors into it and the
background writer maps the same pages (the fd is passed over a Unix socket), so the writer
writes the snapshot to disk without another copy, and the memory is freed by the kernel as soon
as both processes drop it, however they exit. Buffers are kept across saves because memory this
machine has handed back costs much more to touch again than memory we hold (measured: docs/DESIGN.md).

More: docs/MODULES.md, core/snapshot/shared_buffer.py.
"""
from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from asyncckpt.core.snapshot.container import container_template
from asyncckpt.core.storage.owners import owner_token
from asyncckpt.core.writer.copy_progress import PROGRESS_BYTES, CopyProgress
from asyncckpt.core.formats.layout import IO_ALIGNMENT, RankLayout
from asyncckpt.core.snapshot.tensor_copy import CopyThreads

SEGMENTS_PER_COPY = 8  # the copy publishes progress this often, so the writer starts after 1/8 of it
MIN_SEGMENT_BYTES = 4 << 20
UNIT_BYTES = 4 << 20  # consecutive slots a copy thread takes at a time (a larger tensor is a unit of its own)
_LANES = 2  # copy threads per copy

_pinned_lock = threading.Lock()
_owners: dict[int, str] = {}  # pid -> the owner token naming its file buffers (a forked child is not its parent)


def _owner() -> str:
    """This process's owner token for its file buffers: the files of a dead process are found by it (``tier``)."""
    return _owners.setdefault(os.getpid(), owner_token())


class StagingBuffer:
    """One rank's file image in shared memory, with tensor views onto every slot: a memfd, or with ``file_in`` a file
    there (see the module docstring); ``fd`` either way, ``path`` the file's (None: a memfd)."""

    _numbers = itertools.count()

    def __init__(self, layout: RankLayout, *, pin_for_cuda: bool = False, file_in: Optional[str] = None) -> None:
        self.layout = layout
        self.path: Optional[str] = None
        if file_in is None:
            self.fd = os.memfd_create(f"asyncckpt-{os.getpid()}", os.MFD_CLOEXEC)
            size = max(layout.buffer_size, IO_ALIGNMENT)  # padded for direct writes (never empty: mapped)
        else:
            os.makedirs(file_in, exist_ok=True)
            self.path = os.path.join(file_in, f"{_owner()}.{next(self._numbers)}")
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            size = layout.size  # the data file it becomes
        try:
            os.ftruncate(self.fd, size)
            self.mmap = mmap.mmap(self.fd, size)
        except BaseException:
            self._forget_file()
            raise
        self.progress_fd = os.memfd_create(f"asyncckpt-progress-{os.getpid()}", os.MFD_CLOEXEC)
        os.ftruncate(self.progress_fd, PROGRESS_BYTES)
        self._progress_map = mmap.mmap(self.progress_fd, PROGRESS_BYTES)
        self.bytes = torch.frombuffer(self.mmap, dtype=torch.uint8)
        self.progress = CopyProgress(self._progress_map)
        self.generation = 0  # of the latest copy into this buffer, as published in ``progress``
        self.bytes.zero_()  # fault every page in now, not during the first snapshot's copy
        for offset, piece in _container_framing(layout):
            self.mmap[offset : offset + len(piece)] = piece
        self.slot_views = [
            self.bytes[s.data_start : s.data_start + s.nbytes].view(getattr(torch, s.dtype)).view(s.chunk_sizes)
            for s in layout.slots
        ]
        self.unique_views = [self.slot_views[i] for i in layout.unique_slots()]
        self.copy_segments = _segments(layout, self.unique_views)
        self.pinned = False
        if pin_for_cuda:
            self._pin()

    def in_checkpoint(self) -> bool:
        """Whether a checkpoint holds this buffer's pages (a file buffer the writer linked, not dropped since): a
        snapshot must not be copied into it."""
        return self.path is not None and os.fstat(self.fd).st_nlink > 1

    def unnamed(self) -> bool:
        """Whether a file buffer lost its name (its run directory was removed: the end of a run): no checkpoint can be
        linked to it any more (a file without a name cannot be given one), and nothing but this buffer holds its
        pages."""
        return self.path is not None and os.fstat(self.fd).st_nlink == 0

    def _pin(self) -> None:
        """Page-lock the mapping so device-to-host copies run at full PCIe speed and asynchronously."""
        with _pinned_lock:
            result = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.bytes.numel(), 0)
            if int(result) != 0:
                raise RuntimeError(f"cudaHostRegister failed with {result}")
        self.pinned = True

    def close(self) -> None:
        self.slot_views = self.unique_views = self.copy_segments = []
        del self.progress
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False
        del self.bytes
        self.mmap.close()
        self._progress_map.close()
        os.close(self.progress_fd)
        self._forget_file()

    def _forget_file(self) -> None:
        """Close the buffer's descriptor and remove its file's name (a checkpoint linked to it keeps its pages)."""
        os.close(self.fd)
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):  # the run directory went first (the end of a run)
                os.unlink(self.path)


@dataclass
class _Segment:
    """A run of consecutive slots whose progress is published once all of it is copied, cut into
    units (unique-slot positions and their buffer views) that the copy threads take in turn."""

    end: int  # where the segment's last data ends in the image
    units: list[tuple[list[int], list[torch.Tensor]]]


def _container_framing(layout: RankLayout) -> list[tuple[int, bytes]]:
    """(offset, bytes) pieces of container framing to write into a fresh buffer once."""
    pieces = []
    for slot in (layout.slots[i] for i in layout.unique_slots()):
        template = container_template(getattr(torch, slot.dtype), slot.chunk_sizes)
        pieces.append((slot.start, template.prefix))
        pieces.append((slot.data_start + slot.nbytes, template.suffix))
    return pieces


def _segments(layout: RankLayout, views: list[torch.Tensor]) -> list[_Segment]:
    """Unique slots in image order, cut into ~``SEGMENTS_PER_COPY`` segments of consecutive
    bytes, each cut into units of about ``UNIT_BYTES``."""
    slots = [layout.slots[i] for i in layout.unique_slots()]
    order = sorted(range(len(views)), key=lambda i: slots[i].data_start)
    total = sum(slot.nbytes for slot in slots)
    target = max(MIN_SEGMENT_BYTES, -(-total // SEGMENTS_PER_COPY))
    segments, current, size = [], [], 0
    for position in order:
        current.append(position)
        size += slots[position].nbytes
        if size >= target or position == order[-1]:
            units = [(unit, [views[i] for i in unit]) for unit in _runs(current, [slots[i].nbytes for i in current])]
            segments.append(_Segment(max(slots[i].data_start + slots[i].nbytes for i in current), units))
            current, size = [], 0
    return segments


def _runs(positions: list[int], sizes: list[int]) -> list[list[int]]:
    """``positions`` cut, in order, into runs of at least ``UNIT_BYTES`` (the last may be less)."""
    runs, run, size = [], [], 0
    for position, nbytes in zip(positions, sizes):
        run.append(position)
        size += nbytes
        if size >= UNIT_BYTES:
            runs.append(run)
            run, size = [], 0
    return runs + [run] if run else runs


def _copy_group(views: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    if not views:  # every source on the GPU: ``_foreach_copy_`` refuses an empty list
        return
    with torch.no_grad():  # grad mode is per thread; the buffer must never join a graph
        torch._foreach_copy_(views, sources)


class _SegmentTracker:
    """Publishes the copy's progress: a segment counts once all its units are copied, and progress
    only ever covers a prefix of finished segments."""

    def __init__(self, buffer: StagingBuffer, generation: int) -> None:
        self.buffer, self.generation = buffer, generation
        self.lock = threading.Lock()
        self.finished_units = [0] * len(buffer.copy_segments)
        self.next = 0
        self.failed = False

    def unit_finished(self, index: int) -> None:
        with self.lock:
            self.finished_units[index] += 1
            segments = self.buffer.copy_segments
            while self.next < len(segments) and self.finished_units[self.next] == len(segments[self.next].units):
                self.next += 1
            if self.failed:
                return
            if self.next == len(segments):
                self.buffer.progress.complete(self.generation)
            elif self.next:
                self.buffer.progress.publish(self.generation, segments[self.next - 1].end)

    def fail(self) -> None:
        with self.lock:
            self.failed = True
            self.buffer.progress.fail(self.generation)


def _copy_lane(tracker: _SegmentTracker, units: Iterator, sources: Sequence[torch.Tensor]) -> None:
    """One copy thread: the next unit not yet taken by the other, until none is left. Taking units
    in turn, rather than half of each segment's bytes, lets a thread that copies faster (large
    tensors copy at several times the speed of small ones, and a thread sharing its core with the
    caller's Python runs slower) do more: with fixed halves, one thread was left copying alone for the
    end of the copy (docs/DESIGN.md, "The stall is the copy")."""
    try:
        for index, (positions, views) in units:  # a list iterator hands out each unit once, across threads
            if tracker.failed:
                return
            _copy_group(views, [sources[i] for i in positions])
            tracker.unit_finished(index)
    except BaseException:
        tracker.fail()
        raise


class CopyInProgress:
    """A snapshot copy running on the copy threads; ``wait()`` returns once it is complete.
    ``generation`` is what the writer looks for in the buffer's ``CopyProgress`` (None for a
    copy that publishes no progress: a single file's image, staged before it is written)."""

    def __init__(self, generation: Optional[int], futures: list[Future]) -> None:
        self.generation = generation
        self._futures = futures

    def wait(self) -> None:
        """Wait for every part (never return while a thread may still write into the buffer);
        then raise the first failure, if any."""
        errors = [f.exception() for f in self._futures]
        for error in errors:
            if error is not None:
                raise error


def _check_sources(buffer: StagingBuffer, sources: Sequence[torch.Tensor]) -> None:
    if len(buffer.unique_views) != len(sources):
        raise AssertionError(f"staging {len(sources)} tensors into a layout of {len(buffer.unique_views)} slots")


def _next_copy(buffer: StagingBuffer) -> int:
    buffer.generation = CopyProgress.next_generation(buffer.generation)
    buffer.progress.publish(buffer.generation, 0)
    return buffer.generation


def start_copy(buffer: StagingBuffer, sources: Sequence[torch.Tensor], threads: CopyThreads) -> CopyInProgress:
    """Start copying CPU ``sources`` into their slots and return at once: the caller's thread
    stays free for other work meanwhile, and the writer may start on finished segments. Two
    threads take units of ~``UNIT_BYTES`` in turn (torch's copy kernels release the GIL, and
    one ``_foreach_copy_`` per unit has no per-tensor Python cost, so thousands of small tensors
    copy nearly as fast as one large one)."""
    _check_sources(buffer, sources)
    generation = _next_copy(buffer)
    if not buffer.copy_segments:
        buffer.progress.complete(generation)
        return CopyInProgress(generation, [])
    tracker = _SegmentTracker(buffer, generation)
    units = iter([(index, unit) for index, segment in enumerate(buffer.copy_segments) for unit in segment.units])
    pool = threads.executor()
    return CopyInProgress(generation, [pool.submit(_copy_lane, tracker, units, sources) for _ in range(_LANES)])


def begin_copy(buffer: StagingBuffer, sources: Sequence[torch.Tensor], threads: CopyThreads, *,
               cuda_stream=None) -> CopyInProgress:
    """Start copying each source tensor into its slot (``sources`` follow
    ``buffer.layout.unique_slots()``).

    CPU tensors are copied as ``start_copy`` does. CUDA tensors are copied non-blocking on
    ``cuda_stream`` (a side stream that first waits for the producer stream, so it sees the
    finished optimizer step) into pinned memory, from the calling thread (the producer stream is
    the calling thread's current stream); that copy is complete when this returns.
    """
    if not any(source.is_cuda for source in sources):
        return start_copy(buffer, sources, threads)
    _check_sources(buffer, sources)
    views = buffer.unique_views
    generation = _next_copy(buffer)
    try:
        on_cuda = [source.is_cuda for source in sources]
        _copy_group([v for v, cuda in zip(views, on_cuda) if not cuda], [s for s, cuda in zip(sources, on_cuda) if not cuda])
        _copy_from_cuda([(v, s) for v, s, cuda in zip(views, sources, on_cuda) if cuda], cuda_stream)
    except BaseException:
        buffer.progress.fail(generation)
        raise
    buffer.progress.complete(generation)
    return CopyInProgress(generation, [])


def copy_into(buffer: StagingBuffer, sources: Sequence[torch.Tensor], threads: CopyThreads, *, cuda_stream=None) -> None:
    """``begin_copy`` and wait: the buffer is complete when this returns."""
    begin_copy(buffer, sources, threads, cuda_stream=cuda_stream).wait()


def _copy_from_cuda(pairs, stream) -> None:
    if stream is None:
        stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for view, source in pairs:
            view.copy_(source, non_blocking=True)
            source.record_stream(stream)  # the caller may free it; keep it alive until the copy ran
    stream.synchronize()
