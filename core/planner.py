"""Save and load planners on torch.distributed.checkpoint's planner protocol.

Saving: the state dict is flattened, every value becomes DCP write items (DTensor chunking is
torch's), and items present on several ranks (replicated tensors) are written by one rank each,
chosen greedily by torch's dedup so that the replicated bytes are spread over the ranks. Loading: DCP's resharding maths, plus strict checks that report every
missing key and every shape/dtype mismatch at once, naming key and both sides.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
from typing import Any

import torch
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_global_save_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.utils import find_state_dict_object
from torch.distributed.tensor import DTensor

from .errors import StateDictMismatchError
from .layout import RankLayout, build_layout


def alias_key(value: Any):
    """Identity of a plain tensor's exact bytes: two keys equal means the same tensor (tied weights)."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.numel():
        return (value.device, value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
    return None


def _describe(fqn: str, value: Any) -> str:
    if isinstance(value, DTensor):
        mesh = value.device_mesh
        return (
            f"{fqn}|D|{value.dtype}|{tuple(value.shape)}|{tuple(value.to_local().shape)}|{mesh.device_type}"
            f"|{mesh.mesh.tolist()}|{value.placements}|{mesh.get_coordinate()}"
        )
    if isinstance(value, torch.Tensor):
        return f"{fqn}|T|{value.dtype}|{tuple(value.shape)}|{value.device.type}"
    return f"{fqn}|O"


def structure_hash(flat_state_dict: dict[str, Any]) -> str:
    """A digest of keys, kinds, dtypes, shapes, devices and placements: equal digest, equal plan."""
    digest = hashlib.blake2b(digest_size=16)
    first_holder: dict = {}
    for fqn, value in flat_state_dict.items():
        digest.update(_describe(fqn, value).encode())
        key = alias_key(value)
        if key is not None:
            holder = first_holder.setdefault(key, fqn)
            if holder != fqn:  # tied weights are part of the structure: they share one slot
                digest.update(f"={holder}".encode())
        digest.update(b"\0")
    return digest.hexdigest()


class AsyncCkptSavePlanner(SavePlanner):
    """Flattening + DCP write items + byte-balanced deduplication of replicated items."""

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.mappings = flatten_state_dict(state_dict)
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = create_default_local_save_plan(self.state_dict, self.is_coordinator)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
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


def tensor_items(plan: SavePlan) -> list[WriteItem]:
    return [item for item in plan.items if item.type != WriteItemType.BYTE_IO]


def byte_items(plan: SavePlan) -> list[WriteItem]:
    return [item for item in plan.items if item.type == WriteItemType.BYTE_IO]


def layout_for_plan(plan: SavePlan, rank: int, flat_state_dict: dict | None = None) -> RankLayout:
    """The data-file layout of a rank's final plan (tensor items only, in plan order); tensors
    of ``flat_state_dict`` that are the very same tensor (tied weights) share their bytes."""
    chunks, alias_of, first_position = [], {}, {}
    for position, item in enumerate(tensor_items(plan)):
        key = alias_key(flat_state_dict.get(item.index.fqn)) if flat_state_dict is not None else None
        if key is not None:
            if key in first_position:
                alias_of[position] = first_position[key]
            else:
                first_position[key] = position
        data = item.tensor_data
        chunks.append(
            (item.index.fqn, tuple(data.chunk.offsets), tuple(data.chunk.sizes), tuple(data.size),
             data.properties.dtype, bool(data.properties.requires_grad))
        )
    return build_layout(f"__{rank}_0.distcp", chunks, alias_of)


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
