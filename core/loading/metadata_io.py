"""Reading DCP's ``.metadata`` safely (``snapshot.dcp_metadata`` writes it).

``.metadata`` stays the pickled ``torch.distributed.checkpoint.metadata.Metadata`` that torch's
own reader expects (so frameworks' DCP loaders read our checkpoints), but we never unpickle it
freely: ``load_dcp_metadata`` admits only DCP's metadata classes, dtypes and paths.
"""
from __future__ import annotations

import io
import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

from asyncckpt.core.storage.backend import backend_for, join, read_bytes
from asyncckpt.core.formats.dcp_pickle import DCP_METADATA_FILE
from asyncckpt.core.errors import CorruptCheckpointError, UnsafeMetadataError


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
    path = join(checkpoint_dir, file_name)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(read_bytes(backend_for(checkpoint_dir), path)), path).load()
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
