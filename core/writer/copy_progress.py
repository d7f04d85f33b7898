"""How far a snapshot copy into a snapshot buffer has got: the word the training process writes and
the background writer reads, so the writer streams each finished part to disk during the copy.

The writer imports this module (not ``snapshot.shared_buffer``, whose buffers are torch tensors), so
it stays free of torch.
"""
from __future__ import annotations

import ctypes
import time
from typing import Callable

from asyncckpt.core.errors import CheckpointTimeoutError, CheckpointWriteError, SnapshotCopyFailed
from asyncckpt.core.formats.layout import IO_ALIGNMENT

PROGRESS_BYTES = IO_ALIGNMENT  # a snapshot buffer's progress: a page of shared memory of its own (``CopyProgress``)


class CopyProgress:
    """How far the latest copy into a buffer has got, shared with the background writer so it
    streams each finished part to disk while the rest is still being copied.

    One aligned 64-bit word in a page of its own (not in the image: a file buffer becomes a
    checkpoint's data file, ``snapshot.shared_buffer``), written and read whole (a single
    machine store or load): ``generation << 40 | finished 4 KiB pages``, or one of two markers
    in place of the page count. The generation names the copy a write request belongs to, so the
    writer never takes bytes of a later copy for its own. The copy threads publish after the
    copy's locks and futures (memory barriers), so finished bytes are visible before the word."""

    _PAGES_BITS = 40
    _FAILED = (1 << 40) - 1
    _COMPLETE = (1 << 40) - 2
    _GENERATIONS = 1 << 22

    def __init__(self, mapping) -> None:
        self._word = ctypes.c_int64.from_buffer(mapping)

    @classmethod
    def next_generation(cls, generation: int) -> int:
        return (generation + 1) % cls._GENERATIONS

    def publish(self, generation: int, finished_bytes: int) -> None:
        """Bytes ``[0, finished_bytes)`` of the image hold this copy's data (rounded down to pages)."""
        self._word.value = (generation << self._PAGES_BITS) | (finished_bytes // IO_ALIGNMENT)

    def complete(self, generation: int) -> None:
        self._word.value = (generation << self._PAGES_BITS) | self._COMPLETE

    def fail(self, generation: int) -> None:
        self._word.value = (generation << self._PAGES_BITS) | self._FAILED

    def finished_bytes(self, generation: int) -> float:
        """Writer: how much of copy ``generation`` is in the image (``inf`` once complete)."""
        word = self._word.value
        found, pages = word >> self._PAGES_BITS, word & ((1 << self._PAGES_BITS) - 1)
        if found != generation:
            raise CheckpointWriteError(f"the snapshot in the snapshot buffer was replaced (copy {found}, not {generation})")
        if pages == self._FAILED:
            raise SnapshotCopyFailed("the snapshot copy failed in the training process")
        return float("inf") if pages == self._COMPLETE else pages * IO_ALIGNMENT

    def waiter(self, generation: int, timeout: float, abandoned: Callable[[], bool]) -> Callable[[float], float]:
        """``wait(done)``: block (bounded) until more than ``done`` bytes of copy ``generation``
        are in the image; return how many. Polls with short sleeps: a copy takes tens of ms.
        ``abandoned()`` true means the copying process is gone: what is not copied never will be."""

        def wait(done: float) -> float:
            deadline = time.monotonic() + timeout
            delay = 0.0002
            while True:
                finished = self.finished_bytes(generation)
                if finished > done:
                    return finished
                if abandoned():
                    raise CheckpointWriteError("the training process died before the snapshot was complete (not committed)")
                if time.monotonic() > deadline:
                    raise CheckpointTimeoutError(f"the snapshot copy did not progress for {timeout:.0f}s")
                time.sleep(delay)
                delay = min(2 * delay, 0.002)

        return wait
