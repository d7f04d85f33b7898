"""Save and load planners on torch.distributed.checkpoint's planner protocol.

Saving: the state dict is flattened, every value becomes DCP write items (DTensor chunking is
torch's), and items present on several ranks (replicated tensors) are written by one rank each,
chosen greedily by torch's dedup so that the replicated bytes are spread over the ranks. Loading: DCP's resharding maths, plus strict checks that report every
missing key and every shape/dtype mismatch at once, naming key and both sides.
"""
from __future__ import annotations

import dataclasses
import functools
import io
import logging

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_save_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.utils import find_state_dict_object

from asyncckpt.core.errors import StateDictMismatchError
from asyncckpt.core.formats import names
from asyncckpt.core.snapshot.container import container_template
from asyncckpt.core.formats.layout import IO_ALIGNMENT, ITEM_ALIGNMENT, RankLayout, Slot, align_up
from asyncckpt.core.snapshot.structure import flatten_state_dict, flatten_values

logger = logging.getLogger("asyncckpt")

try:  # torch's byte-balanced dedup of replicated items: private, so a torch that moves it gets a fallback
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
except ImportError:  # no torch the matrix ran; tests/core/test_sharded.py forces this path
    dedup_save_plans = None


class AsyncCkptSavePlanner(SavePlanner):
    """Flattening + DCP write items + byte-balanced deduplication of replicated items."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self._nested = state_dict
        self.state_dict = flatten_values(state_dict)  # the same keys as torch's flattening
        self.is_coordinator = is_coordinator

    @property
    def mappings(self) -> dict[str, tuple]:
        """Each key's path in the nested state dict: needed only when a structure is planned."""
        return flatten_state_dict(self._nested)[1]

    def create_local_plan(self) -> SavePlan:
        self.plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        if dedup_save_plans is None:
            plans, metadata = _public_global_plan(all_plans)
        else:
            plans, metadata = create_default_global_save_plan(dedup_save_plans(all_plans))
        return plans, dataclasses.replace(metadata, planner_data=self.mappings)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self.plan = new_plan
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        value = find_state_dict_object(self.state_dict, write_item.index)
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save(value, buffer)
            return buffer
        return value.detach()


def _public_global_plan(all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    """DCP's own global plan (its dedup included), where torch no longer has ``dedup_save_plans``
    where this module looks for it: the same files, replicated bytes perhaps less evenly spread."""
    _warn_no_dedup()
    return DefaultSavePlanner(flatten_state_dict=False).create_global_plan(all_plans)


@functools.lru_cache(maxsize=None)
def _warn_no_dedup() -> None:
    logger.warning("asyncckpt: torch %s has no torch.distributed.checkpoint._dedup_save_plans; sharded saves use "
                   "DefaultSavePlanner's global plan (same files)", torch.__version__)


def tensor_items(plan: SavePlan) -> list[WriteItem]:
    return [item for item in plan.items if item.type != WriteItemType.BYTE_IO]


def byte_items(plan: SavePlan) -> list[WriteItem]:
    return [item for item in plan.items if item.type == WriteItemType.BYTE_IO]


def layout_for_plan(plan: SavePlan, rank: int, tied_to: dict[str, str] | None = None) -> RankLayout:
    """The data-file layout of a rank's final plan (tensor items only, in plan order); a key in
    ``tied_to`` (the very same tensor as another key: tied weights) shares that key's bytes."""
    tied_to = tied_to or {}
    chunks, alias_of, position_of = [], {}, {}
    for position, item in enumerate(tensor_items(plan)):
        fqn = item.index.fqn
        position_of[fqn] = position
        if fqn in tied_to and tied_to[fqn] in position_of:
            alias_of[position] = position_of[tied_to[fqn]]
        data = item.tensor_data
        chunks.append(
            (item.index.fqn, tuple(data.chunk.offsets), tuple(data.chunk.sizes), tuple(data.size),
             data.properties.dtype, bool(data.properties.requires_grad))
        )
    return build_layout(names.data_file_name(rank), chunks, alias_of)


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
                dtype=str(dtype).removeprefix("torch."),
                requires_grad=requires_grad,
                start=cursor,
                length=template.length,
                data_start=cursor + template.data_offset,
                nbytes=template.nbytes,
            )
        )
        cursor += template.length
    return RankLayout(file_name, tuple(slots), cursor, max(align_up(cursor, IO_ALIGNMENT), IO_ALIGNMENT))


def planner_data_paths(mappings: dict) -> dict:
    """Flatten mappings as JSON-friendly lists (keys may be str or int path elements)."""
    return {fqn: list(path) for fqn, path in mappings.items()}


class AsyncCkptLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner (resharding) with complete, named mismatch reports."""

    def __init__(self, strict: bool = True) -> None:
        super().__init__(allow_partial_load=not strict)
        self.strict = strict

    def create_local_plan(self):
        self._check_against(self.metadata)
        return super().create_local_plan()

    def resolve_tensor(self, read_item):
        """The destination of a read; a read covering the whole tensor needs no narrowing
        (torch narrows every item: most of a many-tensor load's planning)."""
        tensor = self.lookup_tensor(read_item.dest_index)
        if not any(read_item.dest_offsets) and tuple(read_item.lengths) == tuple(tensor.shape):
            return tensor
        return super().resolve_tensor(read_item)

    def _check_against(self, metadata: Metadata) -> None:
        saved = metadata.state_dict_metadata
        missing, mismatched = [], []
        for fqn, value in self.state_dict.items():
            if fqn not in saved:
                missing.append(fqn)
                continue
            entry = saved[fqn]
            if not isinstance(value, torch.Tensor):
                continue
            if not isinstance(entry, TensorStorageMetadata):
                mismatched.append(f"'{fqn}': checkpoint holds an object, state dict expects a tensor {tuple(value.shape)}")
                continue
            if tuple(entry.size) != tuple(value.shape):
                mismatched.append(f"'{fqn}': checkpoint shape {tuple(entry.size)} vs state dict shape {tuple(value.shape)}")
            if entry.properties.dtype != value.dtype:
                mismatched.append(f"'{fqn}': checkpoint dtype {entry.properties.dtype} vs state dict dtype {value.dtype}")
        problems = []
        if missing and self.strict:
            problems.append(f"{len(missing)} key(s) missing from the checkpoint: {missing}")
        if mismatched:
            problems.append("mismatched: " + "; ".join(mismatched))
        if problems:
            where = getattr(metadata.storage_meta, "checkpoint_id", None) or "checkpoint"
            raise StateDictMismatchError(f"cannot load {where}: " + " | ".join(problems))
