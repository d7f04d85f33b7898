"""Copy many CPU tensors into place at memory speed, with as little per-tensor overhead as possible.

More: docs/MODULES.md, core/snapshot/tensor_copy.py.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import torch

LARGE_COPY_BYTES = 1 << 20
PARALLEL_SMALL_BYTES = 16 << 20  # below this, a second thread costs more than it saves

class CopyThreads:
    """A pair of copy threads, started on first use and kept until ``stop()``: no threads per
    save, and none left once the Checkpointer owning them stops (a framework's run ended)."""

    def __init__(self) -> None:
        self._executor: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    def executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(2, thread_name_prefix="asyncckpt-copy")
            return self._executor

    def stop(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


def copy_tensors(targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], threads: CopyThreads) -> None:
    """``targets[i].copy_(sources[i])`` for every i (same shapes, CPU); returns when all are done."""
    if len(targets) != len(sources):
        raise ValueError(f"{len(targets)} targets for {len(sources)} sources")
    large: tuple[list, list] = ([], [])
    small: tuple[list, list] = ([], [])
    small_bytes = 0
    for target, source in zip(targets, sources):
        nbytes = target.numel() * target.element_size()
        group = large if nbytes >= LARGE_COPY_BYTES else small
        group[0].append(target)
        group[1].append(source)
        if group is small:
            small_bytes += nbytes
    if large[0]:
        torch._foreach_copy_(large[0], large[1])
    if not small[0]:
        return
    if small_bytes < PARALLEL_SMALL_BYTES:
        torch._foreach_copy_(small[0], small[1])
        return
    mine, theirs = _halves(small[0], small[1], small_bytes)
    if not theirs[0]:
        torch._foreach_copy_(*mine)
        return
    other = threads.executor().submit(torch._foreach_copy_, *theirs)
    try:
        torch._foreach_copy_(*mine)
    finally:
        other.result()


def _halves(targets: list, sources: list, total: int) -> tuple[tuple[list, list], tuple[list, list]]:
    """Consecutive pairs split where the first half reaches half the bytes (each tensor is small,
    so the halves differ by less than ``LARGE_COPY_BYTES``)."""
    running = 0
    for index, target in enumerate(targets):
        running += target.numel() * target.element_size()
        if 2 * running >= total:
            cut = index + 1
            break
    else:
        cut = len(targets)
    return (targets[:cut], sources[:cut]), (targets[cut:], sources[cut:])
