"""Single-file checkpoints in the frameworks' native formats, written by the background writer.

``torch``: what ``torch.save`` writes, with the framing rendered once per structure
(``torch_file_images.py``): per save the object is pickled by torch's own pickler (the snapshot of every
non-tensor object) and each storage's bytes are copied into their record. Shared storages (tied
weights, views) are saved once, as torch.save does.

More: docs/MODULES.md, core/snapshot/file_images.py.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Optional

import torch

from asyncckpt.core.snapshot.tensor_copy import CopyThreads, copy_tensors

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@dataclass
class FileImage:
    """A native file's bytes: pieces of bytes at offsets, and tensor bytes to copy at offsets."""

    size: int
    pieces: list[tuple[int, bytes]]  # written at every save
    copies: list[tuple[int, torch.Tensor]]  # (offset, source): flat uint8 if contiguous, else the strided tensor
    framing: Optional[list[tuple[int, bytes]]] = None  # pieces shared by every image of one structure

    def all_pieces(self) -> list[tuple[int, bytes]]:
        return self.pieces if self.framing is None else self.framing + self.pieces


def _as_source(tensor: torch.Tensor) -> torch.Tensor:
    """What ``stage_image`` copies from: the bytes of a contiguous tensor, or the strided tensor itself."""
    return tensor.reshape(-1).view(torch.uint8) if tensor.is_contiguous() else tensor


def safetensors_image(tensors: dict[str, torch.Tensor], metadata: Optional[dict[str, str]] = None) -> FileImage:
    """The image of ``safetensors.torch.save_file(tensors, metadata=metadata)`` (same layout rules)."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    copies, cursor = [], 0
    for name in sorted(tensors, key=lambda n: (-tensors[n].element_size(), n)):
        tensor = tensors[name].detach()
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise TypeError(f"safetensors cannot store '{name}' of dtype {tensor.dtype}")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [cursor, cursor + nbytes]}
        copies.append((cursor, _as_source(tensor)))
        cursor += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    prefix = struct.pack("<Q", len(encoded)) + encoded
    return FileImage(len(prefix) + cursor, [(0, prefix)],
                     [(len(prefix) + offset, source) for offset, source in copies])


def stage_image(image: FileImage, target: torch.Tensor, threads: CopyThreads, *, framing_in_place: bool = False) -> None:
    """Fill ``target`` (uint8 staging bytes) with the file image: pieces, then tensor bytes.

    ``framing_in_place``: ``target`` already holds ``image.framing`` (its last image had the same
    structure), which is then not written again. Strided sources are copied straight into a view
    of their place with their shape (no temporary contiguous copy); the CPU copies go through
    ``copy_tensors`` in one batch."""
    mapped = target.numpy()
    for offset, piece in image.pieces if framing_in_place else image.all_pieces():
        mapped[offset : offset + len(piece)] = memoryview(piece)
    cpu_targets, cpu_sources, cuda_pairs = [], [], []
    for offset, source in image.copies:
        nbytes = source.nbytes
        if not nbytes:
            continue
        place = target[offset : offset + nbytes]
        if source.dtype != torch.uint8 or source.dim() != 1:
            place = place.view(source.dtype).view(source.shape)
        if source.is_cuda:
            cuda_pairs.append((place, source))
        else:
            cpu_targets.append(place)
            cpu_sources.append(source)
    copy_tensors(cpu_targets, cpu_sources, threads)
    for place, source in cuda_pairs:
        place.copy_(source, non_blocking=True)
    if cuda_pairs:
        torch.cuda.current_stream().synchronize()
