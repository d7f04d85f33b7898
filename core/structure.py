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
    paths: dict[str, tuple] = {}
    return _flatten(state_dict, paths), paths


def flatten_values(state_dict: Mapping) -> dict[str, Any]:
    """``flatten_state_dict`` without the paths: what every save needs (the paths only matter when
    a structure is planned), and without the one tuple per key they would keep alive."""
    return _flatten(state_dict, None)


def _flatten(state_dict: Mapping, paths: dict[str, tuple] | None) -> dict[str, Any]:
    flat: dict[str, Any] = {}

    def visit(key: str, path: tuple | None, value: Any) -> None:
        if isinstance(value, _Tensor) or not (isinstance(value, (Mapping, list))):
            leaf = True
        else:
            leaf = _is_terminal(value)
        if leaf:
            if key in flat:
                raise ValueError(f"duplicated flatten key {key}")
            flat[key] = value
            if paths is not None:
                paths[key] = path
        elif isinstance(value, Mapping):
            for k, v in value.items():
                visit(f"{key}.{k}", None if paths is None else path + (str(k),), v)
        else:
            for i, v in enumerate(value):
                visit(f"{key}.{i}", None if paths is None else path + (i,), v)

    for key, value in state_dict.items():
        visit(str(key), None if paths is None else (str(key),), value)
    return flat


def _describe_dtensor(value: DTensor) -> tuple:
    mesh = value.device_mesh
    return ("D", value.dtype, value.shape, value.to_local().shape, mesh.device_type, tuple(mesh.mesh.flatten().tolist()),
            tuple(mesh.mesh.shape), tuple(value.placements), mesh.get_coordinate() and tuple(mesh.get_coordinate()))


_OBJECT = "object"  # describe's marker for a non-tensor value


def describe(flat: dict[str, Any]) -> tuple:
    """A hashable description: equal descriptions <=> the same plan and layout apply.

    One flat tuple of atoms (keys, dtypes, flags, dimensions), not a tuple per tensor: a save
    keeps it alive, and thousands of small container objects per save would soon cost the
    training process a full garbage collection (~0.2 s with a few 100k objects) inside the stall.
    Per key: ``key, "object"`` | ``key, (DTensor description)`` | ``key, dtype, is_cuda,
    tied_to_key_or_None, ndim, *shape``; the token after the key tells which, so it is unambiguous.
    """
    parts: list = []
    extend = parts.extend
    first_key_at: dict[int, str] = {}
    for fqn, value in flat.items():
        if not isinstance(value, _Tensor):
            extend((fqn, _OBJECT))
            continue
        if isinstance(value, DTensor):
            extend((fqn, _describe_dtensor(value)))
            continue
        tied = None
        address = value.data_ptr()
        if address:
            first = first_key_at.setdefault(address, fqn)
            if first != fqn and _same_view(flat[first], value):
                tied = first
        extend((fqn, value.dtype, value.is_cuda, tied, value.dim()))
        extend(value.shape)
    return tuple(parts)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and a.device == b.device


def digest(description: tuple) -> str:
    """A digest of a description that is the same in every process (unlike ``hash``)."""
    return hashlib.blake2b(repr(description).encode(), digest_size=16).hexdigest()


def tied_keys(description: tuple) -> dict[str, str]:
    """key -> the earlier key holding the very same tensor (tied weights), from ``describe``."""
    tied, position = {}, 0
    while position < len(description):
        fqn, kind = description[position], description[position + 1]
        if isinstance(kind, torch.dtype):
            if description[position + 3] is not None:
                tied[fqn] = description[position + 3]
            position += 5 + description[position + 4]
        else:
            position += 2
    return tied
