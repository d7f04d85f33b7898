"""The floor a snapshot is compared with: copying the checkpointed tensors into held memory.

Shared by the adapter benchmarks, which measure it in the training process right before each save
(the machine's copy speed drifts within a minute, so each stall gets its own memcpy).
"""
from __future__ import annotations

import time
from typing import Optional

import torch


def checkpoint_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors a checkpoint of ``model`` and ``optimizer`` holds: weights and optimizer state."""
    sources = list(model.state_dict().values())
    return sources + [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


class HeldMemcpy:
    """Times copying tensors into one buffer allocated and touched at the first call, then kept
    (this machine's freshly faulted memory is ~10x slower to write than memory already held)."""

    def __init__(self) -> None:
        self.held: Optional[torch.Tensor] = None

    def __call__(self, sources: list[torch.Tensor]) -> tuple[float, int, int]:
        """(seconds, bytes, tensors) of one copy of ``sources`` into the held buffer."""
        nbytes = sum(t.numel() * t.element_size() for t in sources)
        if self.held is None or self.held.numel() < nbytes:
            self.held = torch.empty(nbytes, dtype=torch.uint8)
            self.held.zero_()
        t0, offset = time.perf_counter(), 0
        for t in sources:
            n = t.numel() * t.element_size()
            self.held[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
            offset += n
        return time.perf_counter() - t0, nbytes, len(sources)
