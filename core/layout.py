"""Where each tensor item of one rank lives in that rank's data file.

The layout is computed once per state-dict structure (it is part of the plan cache). The stager
copies tensors straight into their slots of a buffer that *is* the file image, so the writer
only streams one contiguous buffer to disk: no per-item serialization or copy on the write path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .container import container_template

ITEM_ALIGNMENT = 64  # item starts; keeps tensor data aligned for any dtype view
IO_ALIGNMENT = 4096  # buffer size granularity, so O_DIRECT can write the whole image


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Slot:
    """One tensor chunk in a rank's data file (plain data, sent to the background worker)."""

    fqn: str
    chunk_offsets: tuple[int, ...]
    chunk_sizes: tuple[int, ...]
    global_size: tuple[int, ...]
    dtype: str  # e.g. "float32", the torch.dtype attribute name
    requires_grad: bool
    start: int  # first byte of the torch.save container in the file
    length: int  # container length
    data_start: int  # first byte of the tensor data in the file
    nbytes: int


@dataclass(frozen=True)
class RankLayout:
    """The file image of one rank's tensor data: ``file_name`` holds ``size`` bytes."""

    file_name: str
    slots: tuple[Slot, ...]
    size: int
    buffer_size: int

    def unique_slots(self) -> list[int]:
        """Positions of slots that own their bytes (aliases of tied tensors excluded)."""
        seen, unique = set(), []
        for position, slot in enumerate(self.slots):
            if slot.start not in seen:
                seen.add(slot.start)
                unique.append(position)
        return unique

    def template_fill(self) -> list[tuple[int, bytes]]:
        """(offset, bytes) pieces of container framing to write into a fresh buffer once."""
        pieces = []
        for slot in (self.slots[i] for i in self.unique_slots()):
            template = container_template(getattr(torch, slot.dtype), slot.chunk_sizes)
            pieces.append((slot.start, template.prefix))
            pieces.append((slot.data_start + slot.nbytes, template.suffix))
        return pieces


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def build_layout(
    file_name: str, chunks: list[tuple[str, tuple, tuple, tuple, torch.dtype, bool]], alias_of: dict[int, int] | None = None
) -> RankLayout:
    """Lay out ``(fqn, chunk_offsets, chunk_sizes, global_size, dtype, requires_grad)`` chunks.

    ``alias_of`` maps a chunk's position to an earlier chunk holding the very same tensor (tied
    weights): the alias gets the same bytes in the file, so shared data is written once.
    """
    alias_of = alias_of or {}
    slots = []
    cursor = 0
    for position, (fqn, offsets, sizes, global_size, dtype, requires_grad) in enumerate(chunks):
        if position in alias_of:
            original = slots[alias_of[position]]
            slots.append(Slot(fqn, tuple(offsets), tuple(sizes), tuple(global_size), original.dtype, requires_grad,
                              original.start, original.length, original.data_start, original.nbytes))
            continue
        template = container_template(dtype, tuple(sizes))
        cursor = align_up(cursor, ITEM_ALIGNMENT)
        slots.append(
            Slot(
                fqn=fqn,
                chunk_offsets=tuple(offsets),
                chunk_sizes=tuple(sizes),
                global_size=tuple(global_size),
                dtype=dtype_name(dtype),
                requires_grad=requires_grad,
                start=cursor,
                length=template.length,
                data_start=cursor + template.data_offset,
                nbytes=template.nbytes,
            )
        )
        cursor += template.length
    return RankLayout(file_name, tuple(slots), cursor, max(align_up(cursor, IO_ALIGNMENT), IO_ALIGNMENT))
