"""The staging buffers of one Checkpointer: allocated once per structure, reused by every save.

A save in flight holds one buffer until its writer is done with it; a new save takes a free
buffer of its structure (or of enough size, for single files), so memory is ``max_in_flight``
copies of the state. Buffers are kept across saves, and across a framework's runs: memory this
machine has handed back costs ~10x more to touch again than memory we hold (docs/DESIGN.md).

A memory-tier save's buffer is a file of its run directory that the save's checkpoint keeps
(``StagingBuffer.in_checkpoint``): it is free once the save is done and the tier's retention dropped
that checkpoint, so a run keeps ``keep + 1`` of them per structure, the tier's own memory.
"""
from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Optional

import torch

from asyncckpt.core.formats.layout import IO_ALIGNMENT, RankLayout, align_up
from asyncckpt.core.snapshot.shared_buffer import StagingBuffer

FILE_BUFFERS = "file"  # the key of buffers that hold single-file images, whatever their structure


class Slot:
    """A staging buffer and who uses it now (a handle, a speculative copy, or None: free)."""

    _ids = itertools.count()

    def __init__(self, key: Any, buffer: StagingBuffer) -> None:
        self.key, self.buffer = key, buffer
        self.buffer.id = next(self._ids)
        self.user: Any = None
        self.framing: Optional[list] = None  # the torch-file framing the buffer holds (``torch_file``)


class BufferPool:
    """``on_release(buffer_id)`` is told when a buffer is freed (the writer forgets it)."""

    def __init__(self, on_release: Callable[[int], None]) -> None:
        self._slots: list[Slot] = []
        self._on_release = on_release
        self.lock = threading.RLock()

    def slots(self) -> list[Slot]:
        with self.lock:
            return list(self._slots)

    def take(self, key: Any, layout: RankLayout, user: Any, *, file_in: Optional[str] = None) -> Slot:
        """A free buffer of structure ``key`` for ``user``; buffers of other structures that are
        free are released first (the structure changed: their memory is not needed any more). A new
        one is a file in ``file_in`` (a memory-tier save's: ``StagingBuffer``) unless its image is
        empty (nothing to map)."""
        with self.lock:
            slot = self.take_free_of(key, user)
            if slot is not None:
                return slot
            for slot in [s for s in self._slots if s.key not in (key, FILE_BUFFERS) and s.user is None]:
                self._release(slot)
            return self._new(key, layout, user, file_in if layout.size else None)

    def take_free_of(self, key: Any, user: Any) -> Optional[Slot]:
        """A free buffer of structure ``key`` if there is one (never allocates): neither in use nor held
        by a checkpoint."""
        with self.lock:
            slot = next((s for s in self._slots if s.key == key and s.user is None and not s.buffer.in_checkpoint()),
                        None)
            if slot is not None:
                slot.user = user
            return slot

    def take_for_file(self, size: int, user: Any) -> Slot:
        """A free single-file buffer of at least ``size`` bytes (grown with headroom, not per save)."""
        with self.lock:
            free = [s for s in self._slots if s.key == FILE_BUFFERS and s.user is None]
            fitting = [s for s in free if s.buffer.layout.buffer_size >= size]
            if fitting:
                slot = min(fitting, key=lambda s: s.buffer.layout.buffer_size)
                slot.user = user
                return slot
            for slot in free:
                self._release(slot)
            capacity = max(align_up(size + size // 8, IO_ALIGNMENT), IO_ALIGNMENT)
            return self._new(FILE_BUFFERS, RankLayout("", (), capacity, capacity), user)

    def give_back(self, slot: Slot) -> None:
        with self.lock:
            slot.user = None

    def _new(self, key: Any, layout: RankLayout, user: Any, file_in: Optional[str] = None) -> Slot:
        slot = Slot(key, StagingBuffer(layout, pin_for_cuda=torch.cuda.is_available(), file_in=file_in))
        slot.user = user
        self._slots.append(slot)
        return slot

    def _release(self, slot: Slot) -> None:
        self._slots.remove(slot)
        self._on_release(slot.buffer.id)
        slot.buffer.close()

    def close(self) -> None:
        """Free every buffer (none may be in use)."""
        with self.lock:
            for slot in list(self._slots):
                self._release(slot)
