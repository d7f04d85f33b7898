"""Snapshot buffers: shared host memory laid out as a rank's data file, allocated once, reused.

A ``StagingBuffer`` is a memfd mapping: the training process copies tensors into it and the
background worker maps the same pages (the fd is passed over a Unix socket), so the worker
writes the snapshot to disk without another copy, and the memory is freed by the kernel as soon
as both processes drop it, however they exit. Buffers are kept across saves because memory this
machine has handed back costs ~10x more to touch again than memory we hold (see docs/DESIGN.md).
"""
from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from .layout import RankLayout

_pinned_lock = threading.Lock()
_copy_helpers: ThreadPoolExecutor | None = None
_copy_helpers_lock = threading.Lock()


class StagingBuffer:
    """One rank's file image in shared memory, with tensor views onto every slot."""

    def __init__(self, layout: RankLayout, *, pin_for_cuda: bool = False) -> None:
        self.layout = layout
        self.fd = os.memfd_create(f"asyncckpt-{os.getpid()}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, layout.buffer_size)
        self.mmap = mmap.mmap(self.fd, layout.buffer_size)
        self.bytes = torch.frombuffer(self.mmap, dtype=torch.uint8)
        self.bytes.zero_()  # fault every page in now, not during the first snapshot's copy
        for offset, piece in layout.template_fill():
            self.mmap[offset : offset + len(piece)] = piece
        self.slot_views = [
            self.bytes[s.data_start : s.data_start + s.nbytes].view(getattr(torch, s.dtype)).view(s.chunk_sizes)
            for s in layout.slots
        ]
        self.unique_views = [self.slot_views[i] for i in layout.unique_slots()]
        self.copy_halves = [half for half in _balanced_halves([v.numel() * v.element_size() for v in self.unique_views]) if half]
        self.copy_half_views = [[self.unique_views[i] for i in half] for half in self.copy_halves]
        self.pinned = False
        if pin_for_cuda:
            self._pin()

    def _pin(self) -> None:
        """Page-lock the mapping so device-to-host copies run at full PCIe speed and asynchronously."""
        with _pinned_lock:
            result = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.layout.buffer_size, 0)
            if int(result) != 0:
                raise RuntimeError(f"cudaHostRegister failed with {result}")
        self.pinned = True

    def close(self) -> None:
        self.slot_views = self.unique_views = self.copy_half_views = []
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False
        del self.bytes
        self.mmap.close()
        os.close(self.fd)


def _balanced_halves(sizes: list[int]) -> tuple[list[int], list[int]]:
    """Positions split into two groups of about equal bytes (largest first, to the lighter group),
    each kept in buffer order."""
    halves: tuple[list[int], list[int]] = ([], [])
    loads = [0, 0]
    for position in sorted(range(len(sizes)), key=sizes.__getitem__, reverse=True):
        lighter = 0 if loads[0] <= loads[1] else 1
        halves[lighter].append(position)
        loads[lighter] += sizes[position]
    return sorted(halves[0]), sorted(halves[1])


def _helpers() -> ThreadPoolExecutor:
    global _copy_helpers
    with _copy_helpers_lock:
        if _copy_helpers is None:
            _copy_helpers = ThreadPoolExecutor(2, thread_name_prefix="asyncckpt-copy")
        return _copy_helpers


def _copy_group(views: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    with torch.no_grad():  # grad mode is per thread; the buffer must never join a graph
        torch._foreach_copy_(views, sources)


class CopyInProgress:
    """A snapshot copy running on the two copy threads; ``wait()`` returns once it is complete."""

    def __init__(self, futures: list[Future]) -> None:
        self._futures = futures

    def wait(self) -> None:
        """Wait for every part (never return while a thread may still write into the buffer);
        then raise the first failure, if any."""
        errors = [f.exception() for f in self._futures]
        for error in errors:
            if error is not None:
                raise error


def start_copy(buffer: StagingBuffer, sources: Sequence[torch.Tensor]) -> CopyInProgress:
    """Start copying CPU ``sources`` into their slots on two threads, each taking half of the
    bytes, and return at once: the caller's thread stays free for other work meanwhile. (Torch's
    copy kernels release the GIL, and one ``_foreach_copy_`` per thread has no per-tensor Python
    cost, so thousands of small tensors copy nearly as fast as one large one.)"""
    views = buffer.unique_views
    if len(views) != len(sources):
        raise AssertionError(f"staging {len(sources)} tensors into a layout of {len(views)} slots")
    pool = _helpers()
    return CopyInProgress([
        pool.submit(_copy_group, half_views, [sources[i] for i in half])
        for half, half_views in zip(buffer.copy_halves, buffer.copy_half_views)
    ])


def copy_into(buffer: StagingBuffer, sources: Sequence[torch.Tensor], *, cuda_stream=None) -> None:
    """Copy each source tensor into its slot (``sources`` follow ``buffer.layout.unique_slots()``)
    and return once the buffer is complete.

    CPU tensors are copied as ``start_copy`` does. CUDA tensors are copied non-blocking on
    ``cuda_stream`` (a side stream that first waits for the producer stream, so it sees the
    finished optimizer step) into pinned memory, from the calling thread (the producer stream is
    the calling thread's current stream); the call returns once the stream has drained.
    """
    views = buffer.unique_views
    if len(views) != len(sources):
        raise AssertionError(f"staging {len(sources)} tensors into a layout of {len(views)} slots")
    if not any(source.is_cuda for source in sources):
        start_copy(buffer, sources).wait()
        return
    on_cuda = [source.is_cuda for source in sources]
    _copy_group([v for v, cuda in zip(views, on_cuda) if not cuda], [s for s, cuda in zip(sources, on_cuda) if not cuda])
    _copy_from_cuda([(v, s) for v, s, cuda in zip(views, sources, on_cuda) if cuda], cuda_stream)


def _copy_from_cuda(pairs, stream) -> None:
    if stream is None:
        stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for view, source in pairs:
            view.copy_(source, non_blocking=True)
            source.record_stream(stream)  # the caller may free it; keep it alive until the copy ran
    stream.synchronize()
