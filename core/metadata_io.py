"""Reading and writing checkpoint metadata: DCP's ``.metadata``, built from our JSON sidecars.

``.metadata`` stays the pickled ``torch.distributed.checkpoint.metadata.Metadata`` that torch's
own reader expects (so frameworks' DCP loaders read our checkpoints), but we never unpickle it
freely: ``load_dcp_metadata`` admits only DCP's metadata classes, dtypes and paths. Everything
we add (checksums, where tensor bytes start, the structure hash) lives in one JSON sidecar per
rank, ``__{rank}.asyncckpt.json`` (``sidecar.py``; its reader and writer are also importable from
here, where the commit code has always found them).
"""
from __future__ import annotations

import io
import os
import pickle
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo

from .errors import CorruptCheckpointError, UnsafeMetadataError
from .fsio import atomic_write_bytes
from .metadata_pickle import MetadataPickleTemplate
from .sidecar import Sidecar

DCP_METADATA_FILE = ".metadata"


_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickler that resolves only DCP metadata classes, dtypes and paths (CWE-502)."""

    def __init__(self, file, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeMetadataError(
            f"{self._source}: refusing to load '{module}.{name}': checkpoint metadata may only contain "
            "torch.distributed.checkpoint metadata classes"
        )


def check_relative_path(root: str, relative_path: str) -> str:
    """Absolute path of ``relative_path`` inside ``root``; refuses anything that escapes it."""
    if os.path.isabs(relative_path) or not relative_path:
        raise UnsafeMetadataError(f"{root}: storage path {relative_path!r} is not relative to the checkpoint")
    full = os.path.normpath(os.path.join(root, relative_path))
    if os.path.commonpath([full, os.path.normpath(root)]) != os.path.normpath(root):
        raise UnsafeMetadataError(f"{root}: storage path {relative_path!r} points outside the checkpoint directory")
    return full


def load_dcp_metadata(checkpoint_dir: str, file_name: str = DCP_METADATA_FILE) -> dcp_metadata.Metadata:
    path = os.path.join(checkpoint_dir, file_name)
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except FileNotFoundError:
        raise
    except UnsafeMetadataError:
        raise
    except Exception as e:  # truncated or garbage pickle
        raise CorruptCheckpointError(f"{path}: cannot read checkpoint metadata: {e}") from e
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeMetadataError(f"{path}: expected DCP Metadata, found {type(metadata).__name__}")
    for relative_path in {info.relative_path for info in (metadata.storage_data or {}).values()}:
        check_relative_path(checkpoint_dir, relative_path)
    return metadata


_structure_part_cache: dict = {}


def _tensor_metadata(sidecars: list[Sidecar]) -> tuple[dict, dict]:
    """state_dict_metadata and storage_data of the tensor items; replicated chunks recorded once."""
    state_dict_metadata: dict[str, Any] = {}
    storage_data: dict[dcp_metadata.MetadataIndex, _StorageInfo] = {}
    seen: set = set()
    for sidecar in sidecars:
        t = sidecar.tensors
        shapes = [torch.Size(shape) for shape in t.shapes]
        for fqn, offsets, sizes, global_size, dtype, requires_grad, start, length in zip(
            t.fqn, t.chunk_offsets, t.chunk_sizes, t.global_size, t.dtype, t.requires_grad, t.start, t.length
        ):
            chunk = (fqn, shapes[offsets])  # shape indices are per sidecar; compare the shapes
            if chunk in seen:
                continue
            seen.add(chunk)
            tensor_md = state_dict_metadata.get(fqn)
            if tensor_md is None:
                tensor_md = state_dict_metadata[fqn] = dcp_metadata.TensorStorageMetadata(
                    properties=dcp_metadata.TensorProperties(dtype=getattr(torch, dtype), requires_grad=requires_grad),
                    size=shapes[global_size],
                    chunks=[],
                )
            index = dcp_metadata.MetadataIndex(fqn, shapes[offsets], len(tensor_md.chunks))
            tensor_md.chunks.append(dcp_metadata.ChunkStorageMetadata(shapes[offsets], shapes[sizes]))
            storage_data[index] = _StorageInfo(t.file, start, length)
    return state_dict_metadata, storage_data


def _planner_data(sidecars: list[Sidecar]) -> dict:
    """DCP's flatten mapping (key -> path tuple) over every rank's keys."""
    planner_data: dict[str, Any] = {}
    for sidecar in sidecars:
        for fqn, path in sidecar.planner_data().items():
            planner_data.setdefault(fqn, tuple(path))
    return planner_data


def _structure_part(sidecars: list[Sidecar]) -> tuple[dict, dict, dict, Optional[MetadataPickleTemplate]]:
    """What depends only on the structure every rank agreed on, built once per structure and
    reused: the tensor entries (and their pickle template) and the planner_data (the keys and
    their paths). Without structure hashes (saves through DCP's own API) nothing is cached and
    there is no template."""
    key = (tuple(sidecar.structure_hash for sidecar in sidecars), len(sidecars))
    cacheable = all(key[0])
    if cacheable and key in _structure_part_cache:
        return _structure_part_cache[key]
    tensors, tensor_storage = _tensor_metadata(sidecars)
    planner_data = _planner_data(sidecars)
    if not cacheable:
        return tensors, tensor_storage, planner_data, None
    _structure_part_cache.clear()  # one structure at a time is plenty for a writer
    part = _structure_part_cache[key] = (tensors, tensor_storage, planner_data, MetadataPickleTemplate(tensors, tensor_storage))
    return part


def _object_part(sidecars: list[Sidecar], tensors: dict) -> tuple[dict, dict]:
    """This save's non-tensor entries (their sizes change from save to save). Objects that
    several ranks wrote (only with ``use_collectives=False``) are recorded once."""
    entries: dict[str, Any] = {}
    storage: dict[dcp_metadata.MetadataIndex, _StorageInfo] = {}
    for sidecar in sidecars:
        o = sidecar.objects
        for fqn, start, length in zip(o.fqn, o.start, o.length):
            if fqn not in tensors and fqn not in entries:
                entries[fqn] = dcp_metadata.BytesStorageMetadata()
                storage[dcp_metadata.MetadataIndex(fqn)] = _StorageInfo(o.file, start, length)
    return entries, storage


def build_dcp_metadata(sidecars: list[Sidecar], checkpoint_id: str, save_id: str) -> dcp_metadata.Metadata:
    """Merge every rank's sidecar into the one global ``Metadata`` torch's loader reads."""
    tensors, tensor_storage, planner_data, _template = _structure_part(sidecars)
    entries, storage = _object_part(sidecars, tensors)
    return dcp_metadata.Metadata(
        version=CURRENT_DCP_VERSION,
        state_dict_metadata={**tensors, **entries},
        planner_data=dict(planner_data),
        storage_data={**tensor_storage, **storage},
        storage_meta=dcp_metadata.StorageMeta(checkpoint_id=str(checkpoint_id), save_id=save_id),
    )


def dcp_metadata_bytes(sidecars: list[Sidecar], checkpoint_id: str, save_id: str) -> bytes:
    """``pickle.dumps(build_dcp_metadata(...))``, equal after loading, but the tensor entries are
    spliced in from the structure's template instead of being pickled again on every save."""
    tensors, _tensor_storage, planner_data, template = _structure_part(sidecars)
    if template is None:
        return pickle.dumps(build_dcp_metadata(sidecars, checkpoint_id, save_id))
    entries, storage = _object_part(sidecars, tensors)
    return template.render(
        object_entries=entries, planner_data=planner_data, object_storage=storage,
        storage_meta=dcp_metadata.StorageMeta(checkpoint_id=str(checkpoint_id), save_id=save_id),
        version=CURRENT_DCP_VERSION,
    )


def write_dcp_metadata(directory: str, metadata: dcp_metadata.Metadata, file_name: str = DCP_METADATA_FILE) -> None:
    buffer = io.BytesIO()
    pickle.dump(metadata, buffer)
    atomic_write_bytes(os.path.join(directory, file_name), buffer.getvalue())
