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
from typing import Sequence

import torch

from .layout import RankLayout

_pinned_lock = threading.Lock()
LARGE_COPY_BYTES = 1 << 20


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
        self.slot_views = self.unique_views = []
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False
        del self.bytes
        self.mmap.close()
        os.close(self.fd)


def copy_into(buffer: StagingBuffer, sources: Sequence[torch.Tensor], *, cuda_stream=None) -> None:
    """Copy each source tensor into its slot (``sources`` follow ``buffer.layout.unique_slots()``).

    CPU tensors are copied on this thread (large copies use torch's intra-op threads). CUDA
    tensors are copied non-blocking on ``cuda_stream`` (a side stream that first waits for the
    producer stream, so it sees the finished optimizer step) into pinned memory; the call returns
    once the stream has drained, so the buffer is complete when this function returns.
    """
    views = buffer.unique_views
    if len(views) != len(sources):
        raise AssertionError(f"staging {len(sources)} tensors into a layout of {len(views)} slots")
    small_views, small_sources, cuda_pairs = [], [], []
    for view, source in zip(views, sources):
        if source.is_cuda:
            cuda_pairs.append((view, source))
        elif view.numel() * view.element_size() >= LARGE_COPY_BYTES:
            view.copy_(source)  # large: torch splits it over its intra-op threads
        else:
            small_views.append(view)
            small_sources.append(source)
    if small_views:
        torch._foreach_copy_(small_views, small_sources)  # many small: one call, no per-tensor overhead
    if cuda_pairs:
        _copy_from_cuda(cuda_pairs, cuda_stream)


def _copy_from_cuda(pairs, stream) -> None:
    if stream is None:
        stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for view, source in pairs:
            view.copy_(source, non_blocking=True)
            source.record_stream(stream)  # the caller may free it; keep it alive until the copy ran
    stream.synchronize()
