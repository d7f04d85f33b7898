"""The snapshot buffers of one Checkpointer: allocated once per structure, reused by every save.

A save in flight holds one buffer until its writer is done with it; a new save takes a free
buffer of its structure (or of enough size, for single files), so memory is ``max_in_flight``
copies of the state. Buffers are kept across saves, and across a framework's runs: memory this
machine has handed back costs more to touch again than memory we hold (docs/DESIGN.md, "Measured").

More: docs/MODULES.md, core/snapshot/buffer_pool.py.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from asyncckpt.core.formats.layout import IO_ALIGNMENT, RankLayout, align_up
from asyncckpt.core.snapshot.shared_buffer import StagingBuffer

FILE_BUFFERS = "file"  # the key of buffers that hold single-file images, whatever their structure


class Slot:
    """A snapshot buffer and who uses it now (a handle, a speculative copy, or None: free)."""

    _ids = itertools.count()

    def __init__(self, key: Any, buffer: StagingBuffer) -> None:
        self.key, self.buffer = key, buffer
        self.buffer.id = next(self._ids)
        self.user: Any = None
        self.framing: Optional[list] = None  # the torch-file framing the buffer holds (``torch_file_images``)


@dataclass(frozen=True)
class FileBuffers:
    """A memory-tier save's snapshot buffers: files in ``folder`` (``StagingBuffer``), ``count`` of them per
    structure (the tier's ``keep`` + 1: its kept checkpoints hold theirs, the next save takes the last)."""

    folder: str
    count: int


class BufferPool:
    """``on_release(buffer_id)`` is told when a buffer is freed (the writer forgets it)."""

    def __init__(self, on_release: Callable[[int], None]) -> None:
        self._slots: list[Slot] = []
        self._on_release = on_release
        self.lock = threading.RLock()
        self._files: dict[Any, tuple[RankLayout, FileBuffers]] = {}  # structure -> its file buffers, where they are
        self._growing: Optional[threading.Thread] = None

    def slots(self) -> list[Slot]:
        with self.lock:
            return list(self._slots)

    def take(self, key: Any, layout: RankLayout, user: Any, *, files: Optional[FileBuffers] = None) -> Slot:
        """A free buffer of structure ``key`` for ``user``; buffers of other structures that are
        free are released first (the structure changed: their memory is not needed any more). With
        ``files`` (a memory-tier save's), a new one is a file there unless its image is empty (nothing to
        map), and the others ``files`` asks for are made in the background."""
        with self.lock:
            if files is not None and layout.size and self._files.get(key) != (layout, files):
                self._files[key] = (layout, files)
            slot = self.take_free_of(key, user)
            if slot is not None:
                return slot
            growing = self._growing
        if growing is not None:  # the buffer being made beside the saves is the one this save needs: not another
            growing.join()
        with self.lock:
            slot = self.take_free_of(key, user)
            if slot is not None:
                return slot
            for slot in [s for s in self._slots if s.key not in (key, FILE_BUFFERS) and s.user is None]:
                self._release(slot)
            found = self._files.get(key)
            slot = self._new(key, layout, user, found[1].folder if found is not None else None)
            self._grow(key)
            return slot

    def take_free_of(self, key: Any, user: Any) -> Optional[Slot]:
        """A free buffer of structure ``key`` if there is one (never allocates): neither in use nor held
        by a checkpoint."""
        with self.lock:
            for slot in [s for s in self._slots if s.key == key and s.user is None and s.buffer.unnamed()]:
                self._drop(slot)  # the structure's files stay where they are asked for: new ones are made there
            slot = next((s for s in self._slots if s.key == key and s.user is None and not s.buffer.in_checkpoint()),
                        None)
            if slot is not None:
                slot.user = user
                self._grow(key)
            return slot

    def _grow(self, key: Any) -> None:
        """Make the next file buffer of structure ``key`` on a thread, where it has fewer than its ``FileBuffers``
        ask for (one at a time)."""
        found = self._files.get(key)
        if found is None or (self._growing is not None and self._growing.is_alive()):
            return
        layout, files = found
        if sum(slot.key == key for slot in self._slots) >= files.count:
            return

        def make() -> None:
            try:
                buffer = StagingBuffer(layout, pin_for_cuda=torch.cuda.is_available(), file_in=files.folder)
            except Exception:  # noqa: BLE001 - no room now, say: the save that needs it makes it, and raises
                return
            with self.lock:
                if self._files.get(key) == found and sum(slot.key == key for slot in self._slots) < files.count:
                    self._slots.append(Slot(key, buffer))
                    return
            buffer.close()  # the structure changed, or the pool closed, meanwhile

        self._growing = threading.Thread(target=make, name="asyncckpt-buffers", daemon=True)
        self._growing.start()

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
        """Free ``slot``, and forget where its structure's files go once none of its buffers is left."""
        self._drop(slot)
        if not any(other.key == slot.key for other in self._slots):
            self._files.pop(slot.key, None)

    def _drop(self, slot: Slot) -> None:
        self._slots.remove(slot)
        self._on_release(slot.buffer.id)
        slot.buffer.close()

    def close(self) -> None:
        """Free every buffer (none may be in use), once the one being made is there."""
        with self.lock:
            self._files.clear()
            growing = self._growing
        if growing is not None:
            growing.join()
        with self.lock:
            for slot in list(self._slots):
                self._release(slot)
