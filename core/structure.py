"""The shape of a state dict: flattening, and a cheap description used to recognise it again.

``flatten_state_dict`` produces exactly the keys torch.distributed.checkpoint's own flattening
does (the load side uses torch's; tests pin the equivalence) in one pass with less overhead: it
runs on every save, before the snapshot, so each microsecond per tensor counts.
``describe`` returns a tuple that is equal for two state dicts exactly when they can share a plan
(keys, kinds, dtypes, shapes, devices, placements, tied tensors); comparing it is a local dict
lookup, and the stable digest sent to other ranks is computed only for a structure never seen.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

_Tensor = torch.Tensor


def _is_terminal(value: Any) -> bool:
    """torch's rule: mappings are traversed; lists only if they hold tensors or containers."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (Mapping, list)) and not _is_terminal(entry):
            return False
        if isinstance(entry, _Tensor):
            return False
    return True


def flatten_state_dict(state_dict: Mapping) -> tuple[dict[str, Any], dict[str, tuple]]:
    """Nested dicts/lists -> {"a.b.0": value}, plus each key's path (DCP's ``planner_data``)."""
    flat: dict[str, Any] = {}
    paths: dict[str, tuple] = {}

    def visit(key: str, path: tuple, value: Any) -> None:
        if isinstance(value, _Tensor) or not (isinstance(value, (Mapping, list))):
            leaf = True
        else:
            leaf = _is_terminal(value)
        if leaf:
            if key in flat:
                raise ValueError(f"duplicated flatten key {key}")
            flat[key] = value
            paths[key] = path
        elif isinstance(value, Mapping):
            for k, v in value.items():
                visit(f"{key}.{k}", path + (str(k),), v)
        else:
            for i, v in enumerate(value):
                visit(f"{key}.{i}", path + (i,), v)

    for key, value in state_dict.items():
        visit(str(key), (str(key),), value)
    return flat, paths


def _describe_dtensor(value: DTensor) -> tuple:
    mesh = value.device_mesh
    return ("D", value.dtype, value.shape, value.to_local().shape, mesh.device_type, tuple(mesh.mesh.flatten().tolist()),
            tuple(mesh.mesh.shape), tuple(value.placements), mesh.get_coordinate() and tuple(mesh.get_coordinate()))


def describe(flat: dict[str, Any]) -> tuple:
    """A hashable description: equal descriptions <=> the same plan and layout apply."""
    parts: list = []
    append = parts.append
    by_address: dict[int, tuple[str, torch.Tensor]] = {}
    for fqn, value in flat.items():
        if not isinstance(value, _Tensor):
            append((fqn,))
            continue
        if isinstance(value, DTensor):
            append((fqn, _describe_dtensor(value)))
            continue
        tied = None
        address = value.data_ptr()
        if address:
            first = by_address.setdefault(address, (fqn, value))
            if first[0] != fqn and _same_view(first[1], value):
                tied = first[0]
        append((fqn, value.dtype, value.shape, value.is_cuda, tied))
    return tuple(parts)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and a.device == b.device


def digest(description: tuple) -> str:
    """A digest of a description that is the same in every process (unlike ``hash``)."""
    return hashlib.blake2b(repr(description).encode(), digest_size=16).hexdigest()


def tied_keys(description: tuple) -> dict[str, str]:
    """key -> the earlier key holding the very same tensor (tied weights), from ``describe``."""
    return {part[0]: part[4] for part in description if len(part) == 5 and part[4] is not None}
