"""Where each tensor item of one rank lives in that rank's data file.

The layout is computed once per state-dict structure (it is part of the plan cache). The stager
copies tensors straight into their slots of a buffer that *is* the file image, so the writer
only streams one contiguous buffer to disk: no per-item serialization or copy on the write path.
Plain data without torch: the background writer unpickles it (``planner.build_layout`` makes it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

ITEM_ALIGNMENT = 64  # item starts; keeps tensor data aligned for any dtype view
IO_ALIGNMENT = 4096  # buffer size granularity, so O_DIRECT can write the whole image


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class Slot:
    """One tensor chunk in a rank's data file (plain data, sent to the background writer)."""

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
    """The file image of one rank's tensor data: ``file_name`` holds ``size`` bytes.

    ``planner_data`` is DCP's flatten mapping (key -> path) of every key the rank saves, tensors
    and objects alike: the rest of what its sidecar holds per structure. It travels with the layout
    because the layout reaches the writer once per snapshot buffer, while a save's request would
    carry it every time (and it grows with the tensors; the writer must receive and unpickle it
    while the snapshot copy runs: docs/DESIGN.md, "Measured"). Not part of equality: two layouts place the same bytes alike.
    """

    file_name: str
    slots: tuple[Slot, ...]
    size: int
    buffer_size: int
    planner_data: dict = field(default_factory=dict, compare=False)

    def unique_slots(self) -> list[int]:
        """Positions of slots that own their bytes (aliases of tied tensors excluded)."""
        seen, unique = set(), []
        for position, slot in enumerate(self.slots):
            if slot.start not in seen:
                seen.add(slot.start)
                unique.append(position)
        return unique
