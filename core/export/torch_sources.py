"""The tensors of checkpoints only torch reads, as export pieces (``sources`` has the rest).

``read`` is the reader of an export in a process that has torch (``asyncckpt export``, and the child
process the background writer runs such an export in: ``__main__``). The writer never imports this.

More: docs/MODULES.md, core/export/torch_sources.py.
"""
from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

from asyncckpt.core.export import peft_merge, sources
from asyncckpt.core.export.options import ExportOptions
from asyncckpt.core.export.sources import FSDP_MODEL_DIRS, Piece, Source, SourceTensor, model_prefix
from asyncckpt.core.export.writing import merges_adapter
from asyncckpt.core.formats.names import DCP_METADATA_FILE
from asyncckpt.core.loading.metadata_io import check_relative_path, load_dcp_metadata


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _container_loader(path: str, offset: int, length: int):
    def load() -> memoryview:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
        return _bytes_of(torch.load(io.BytesIO(data), weights_only=True, map_location="cpu"))

    return load


def from_dcp(directory: str) -> dict[str, SourceTensor]:
    metadata = load_dcp_metadata(directory)
    tensors: dict[str, SourceTensor] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        dtype = entry.properties.dtype
        pieces = []
        for chunk in entry.chunks:
            info = metadata.storage_data[MetadataIndex(key, chunk.offsets)]
            numel = 1
            for size in chunk.sizes:
                numel *= size
            pieces.append(Piece(tuple(chunk.offsets), tuple(chunk.sizes), numel * dtype.itemsize,
                                load=_container_loader(check_relative_path(directory, info.relative_path),
                                                       info.offset, info.length)))
        tensors[key] = SourceTensor(key, _dtype_name(dtype), tuple(entry.size), pieces)
    return tensors


def _flatten(value: Any, prefix: str, into: dict[str, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        into[prefix.rstrip(".")] = value
    elif isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{prefix}{key}.", into)


def from_torch_file(path: str) -> dict[str, SourceTensor]:
    loaded = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else loaded  # Lightning: its state_dict
    flat: dict[str, torch.Tensor] = {}
    _flatten(state, "", flat)
    return {key: SourceTensor(key, _dtype_name(t.dtype), tuple(t.shape),
                              [Piece((0,) * t.dim(), tuple(t.shape), t.numel() * t.element_size(),
                                     load=lambda t=t: _bytes_of(t))])
            for key, t in flat.items()}


def find(path: str) -> Source:
    """The tensors of the checkpoint at ``path``; ValueError if it is no kind an export reads."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        return Source(path, from_torch_file(path), "", files_dir=os.path.dirname(path))
    for directory in (path, *(os.path.join(path, name) for name in FSDP_MODEL_DIRS)):
        if os.path.isfile(os.path.join(directory, DCP_METADATA_FILE)):
            tensors = from_dcp(directory)
            return Source(path, tensors, model_prefix(tensors), files_dir=path)
    for name in ("pytorch_model.bin", "model.pt"):
        if os.path.isfile(os.path.join(path, name)):
            return Source(path, from_torch_file(os.path.join(path, name)), "", files_dir=path)
    raise ValueError(f"{path}: not a checkpoint an export can read (a sharded checkpoint, safetensors files, "
                     "a torch.save file)")


def read(checkpoint: str, options: ExportOptions) -> Source:
    """The tensors of any checkpoint an export reads: as ``sources`` reads them where it can, else with
    torch (``find``); a PEFT adapter merged into its base model where ``options.peft`` asks for it."""
    source = sources.find(checkpoint)
    if source is None:
        return find(checkpoint)
    return peft_merge.merged(source, options.base_model) if merges_adapter(source, options) else source
