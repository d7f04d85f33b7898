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


def set_at(root: Any, path: tuple, value: Any) -> None:
    """Put ``value`` where ``path`` (a key's path from ``flatten_state_dict``) leads in ``root``."""
    for step in path[:-1]:
        root = root[step]
    root[path[-1]] = value


# Types that are leaves whatever they hold, checked by exact type first: most values of a state dict
# are tensors, and a set lookup costs far less than isinstance checks against ``Mapping``.
_LEAF_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, int, float, str, bool, bytes, type(None)})


def _is_leaf(value: Any) -> bool:
    return isinstance(value, _Tensor) or not isinstance(value, (Mapping, list)) or _is_terminal(value)


def _flatten(state_dict: Mapping, paths: dict[str, tuple] | None) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    leaf_types = _LEAF_TYPES

    def visit(prefix: str | None, path: tuple, items, in_list: bool) -> None:
        """The ``(name, value)`` children of the container at ``prefix``. Leaves are stored here
        rather than in a call of their own: a Python call per tensor was most of the cost."""
        for name, value in items:
            key = str(name) if prefix is None else f"{prefix}.{name}"
            child_path = None if paths is None else path + ((name,) if in_list else (str(name),))
            if type(value) is dict:  # most containers (an optimizer's state has one per parameter): no ABC checks
                visit(key, child_path, value.items(), False)
            elif type(value) in leaf_types or _is_leaf(value):
                if key in flat:
                    raise ValueError(f"duplicated flatten key {key}")
                flat[key] = value
                if paths is not None:
                    paths[key] = child_path
            elif isinstance(value, Mapping):
                visit(key, child_path, value.items(), False)
            else:
                visit(key, child_path, enumerate(value), True)

    visit(None, (), state_dict.items(), False)
    return flat


def _describe_dtensor(value: DTensor) -> tuple:
    mesh = value.device_mesh
    return ("D", value.dtype, value.shape, value.to_local().shape, mesh.device_type, tuple(mesh.mesh.flatten().tolist()),
            tuple(mesh.mesh.shape), tuple(value.placements), mesh.get_coordinate() and tuple(mesh.get_coordinate()))


def describe(flat: dict[str, Any]) -> tuple:
    """A hashable description: equal descriptions <=> the same plan and layout apply.

    ``(keys, tensor flags, dtypes, shapes, ties, DTensor descriptions)``: a few
    tuples built by C-level passes over the values (one attribute per pass), since a Python loop
    body per tensor made a large share of the stall with thousands of tensors (docs/DESIGN.md, Measured).
    It is also few objects: a save keeps it alive, and thousands of small containers per save soon cost
    the training process a full garbage collection inside the stall. Ties are
    looked for only when two tensors share an address.
    """
    keys = tuple(flat)
    values = list(flat.values())
    is_tensor = [isinstance(value, _Tensor) for value in values]
    tensors = [value for value, tensor in zip(values, is_tensor) if tensor]
    distributed = [isinstance(tensor, DTensor) for tensor in tensors]
    dtensors: tuple = ()
    local = tensors
    if any(distributed):
        dtensors = tuple((i, _describe_dtensor(t)) for i, (t, d) in enumerate(zip(tensors, distributed)) if d)
        local = [t for t, d in zip(tensors, distributed) if not d]
    # (The device is not part of it: the plan and layout are the same, and each copy looks at it.)
    return (keys, bytes(is_tensor), tuple([t.dtype for t in local]), tuple([t.shape for t in local]),
            _ties(flat, local), dtensors)


def _ties(flat: dict[str, Any], local: list[torch.Tensor]) -> tuple:
    """``((key, earlier key), ...)`` for tensors that are the very same view of the same memory
    as an earlier key's (tied weights); empty tensors (address 0) share nothing."""
    addresses = [t.data_ptr() for t in local]
    if len(set(addresses)) == len(addresses):
        return ()
    ties, first_at = [], {}
    for key, value in flat.items():
        if not isinstance(value, _Tensor) or isinstance(value, DTensor) or not value.data_ptr():
            continue
        first_key, first = first_at.setdefault(value.data_ptr(), (key, value))
        if first_key != key and _same_view(first, value):
            ties.append((key, first_key))
    return tuple(ties)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and a.device == b.device


def digest(description: tuple) -> str:
    """A digest of a description that is the same in every process (unlike ``hash``)."""
    return hashlib.blake2b(repr(description).encode(), digest_size=16).hexdigest()


def tied_keys(description: tuple) -> dict[str, str]:
    """key -> the earlier key holding the very same tensor (tied weights), from ``describe``."""
    return dict(description[4])
