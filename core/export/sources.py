"""Where every tensor of a checkpoint lies on disk, piece by piece, read from its JSON alone.

An export (``writing``) writes each tensor once, from its pieces: the chunks the
ranks of a sharded save wrote (each rank's sidecar gives the chunk's place in the global tensor,
its raw bytes' file and offset, and their checksum), or whole tensors in safetensors files (the
header gives dtype, shape and byte range). Nothing here reads tensor data or imports torch, so
the background writer can plan an export of any size without loading the model.

More: docs/MODULES.md, core/export/sources.py.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from asyncckpt.core.formats import names
from asyncckpt.core.formats.hf_safetensors import FROM_SAFETENSORS, read_header
from asyncckpt.core.storage.sidecar_io import read_sidecar

FSDP_MODEL_DIRS = ("pytorch_model_fsdp_0",)  # Accelerate's and the Trainer's sharded model (FSDP_MODEL_NAME + "_0")
MODEL_FILE_STEMS = ("model", "adapter_model")  # save_pretrained's and PEFT's


@dataclass(frozen=True)
class Piece:
    """A contiguous, row-major block of one tensor: its place in the tensor and where its bytes are.
    ``file``/``data_start`` locate them on disk, or ``load`` returns them (a reader that needs torch)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    file: Optional[str] = None
    data_start: int = 0
    xxh3: Optional[str] = None  # of the bytes, checked while they are read
    load: Optional[Callable[[], Any]] = field(default=None, compare=False)  # -> a bytes-like object


@dataclass
class SourceTensor:
    key: str
    dtype: str  # torch dtype attribute name
    shape: tuple[int, ...]
    pieces: list[Piece]


@dataclass
class Source:
    """A checkpoint's tensors, and what an export takes from it by default."""

    path: str
    tensors: dict[str, SourceTensor]  # key -> tensor, in the checkpoint's order
    model_prefix: str  # the keys of the model's weights start with it ("model." in a DCP state dict)
    stem: str = "model"  # output file names: model.safetensors, adapter_model.safetensors
    files_dir: Optional[str] = None  # where config.json and friends are, if anywhere


def _sidecar_ranks(directory: str) -> list[int]:
    ranks = []
    for entry in os.listdir(directory):
        match = names.SIDECAR_PATTERN.match(entry)
        if match:
            ranks.append(int(match.group(1)))
    return sorted(ranks)


def from_sidecars(directory: str) -> dict[str, SourceTensor]:
    """Every tensor of a sharded checkpoint of ours. A chunk several ranks wrote (replicated, saved
    without collectives) is read from the lowest rank, as ``.metadata`` records it."""
    tensors: dict[str, SourceTensor] = {}
    seen: set[tuple] = set()
    for rank in _sidecar_ranks(directory):
        sidecar = read_sidecar(directory, rank)
        columns = sidecar.tensors
        files = [os.path.join(directory, file) if file else None for file in columns.item_files()]
        for i, key in enumerate(columns.fqn):
            offsets = tuple(columns.shapes[columns.chunk_offsets[i]])
            if (key, offsets) in seen:
                continue
            seen.add((key, offsets))
            shape = tuple(columns.shapes[columns.global_size[i]])
            tensor = tensors.setdefault(key, SourceTensor(key, columns.dtype[i], shape, []))
            tensor.pieces.append(Piece(offsets, columns.chunk_shape(i), columns.nbytes[i], files[i],
                                       columns.data_start[i], columns.xxh3[i]))
    return tensors


def from_safetensors(paths: list[str]) -> dict[str, SourceTensor]:
    """Every tensor of these safetensors files, each one piece."""
    tensors: dict[str, SourceTensor] = {}
    for path in paths:
        header, data_start = read_header(path)
        entries = [(key, entry) for key, entry in header.items() if key != "__metadata__"]
        for key, entry in sorted(entries, key=lambda item: item[1]["data_offsets"][0]):
            begin, end = entry["data_offsets"]
            if entry["dtype"] not in FROM_SAFETENSORS:
                raise ValueError(f"{path}: tensor {key!r} has dtype {entry['dtype']}, which an export does not write")
            shape = tuple(entry["shape"])
            tensors[key] = SourceTensor(key, FROM_SAFETENSORS[entry["dtype"]], shape,
                                        [Piece((0,) * len(shape), shape, end - begin, path, data_start + begin)])
    return tensors


MODEL_KEYS = ("model.", "state_dict.")  # ours and Accelerate's ({"model": ..., "optim": ...}), Lightning's


def model_prefix(tensors: dict[str, SourceTensor]) -> str:
    """A DCP state dict holds the model under one key (``{"model": ..., "optim": ...}`` in ours and
    Accelerate's, ``state_dict`` in Lightning's sharded checkpoints): its keys. Else every tensor."""
    return next((prefix for prefix in MODEL_KEYS if any(key.startswith(prefix) for key in tensors)), "")


def _safetensors_files(directory: str, entries: set[str]) -> Optional[tuple[str, list[str]]]:
    for stem in MODEL_FILE_STEMS:
        index = f"{stem}.safetensors.index.json"
        if index in entries:
            with open(os.path.join(directory, index)) as f:
                weight_map = json.load(f)["weight_map"]
            return stem, [os.path.join(directory, name) for name in sorted(set(weight_map.values()))]
        if f"{stem}.safetensors" in entries:
            return stem, [os.path.join(directory, f"{stem}.safetensors")]
    return None


def find(path: str) -> Optional[Source]:
    """The tensors of the checkpoint at ``path`` if it is a kind read without torch, else None."""
    path = os.path.abspath(path)
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            return Source(path, from_safetensors([path]), "", files_dir=os.path.dirname(path))
        return None
    entries = set(os.listdir(path))
    if any(map(names.SIDECAR_PATTERN.match, entries)):
        tensors = from_sidecars(path)
        return Source(path, tensors, model_prefix(tensors), files_dir=path)
    found = _safetensors_files(path, entries)
    if found is not None:
        stem, files = found
        return Source(path, from_safetensors(files), "", stem=stem, files_dir=path)
    for name in FSDP_MODEL_DIRS:
        sub = os.path.join(path, name)
        if name in entries and any(map(names.SIDECAR_PATTERN.match, os.listdir(sub))):
            tensors = from_sidecars(sub)
            return Source(path, tensors, model_prefix(tensors), files_dir=path)
    return None
