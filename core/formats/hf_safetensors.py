"""The Hugging Face safetensors layout an export writes: shard files of a bounded size, and their index.

More: docs/MODULES.md, core/formats/hf_safetensors.py.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass

# torch.dtype attribute name (as the sidecars and DCP metadata say) -> safetensors dtype, and its item size
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8), "float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2),
    "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2), "int8": ("I8", 1), "uint8": ("U8", 1),
    "uint16": ("U16", 2), "uint32": ("U32", 4), "uint64": ("U64", 8), "bool": ("BOOL", 1),
    "float8_e4m3fn": ("F8_E4M3", 1), "float8_e5m2": ("F8_E5M2", 1),
}
FROM_SAFETENSORS = {code: name for name, (code, _size) in DTYPES.items()}
FLOATING = ("float64", "float32", "float16", "bfloat16")
_DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "fp16": "float16", "f16": "float16", "half": "float16",
                  "bf16": "bfloat16", "fp64": "float64", "double": "float64", "float": "float32"}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.I)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
HEADER_ALIGNMENT = 8


def parse_size(size: int | str) -> int:
    """``5GB`` (10^9, as ``save_pretrained(max_shard_size=...)`` reads it), ``500MiB``, or bytes."""
    if isinstance(size, int):
        return size
    match = _SIZE.match(size)
    unit = match and (match[2].upper() if match[2].upper().endswith("B") or not match[2] else match[2].upper() + "B")
    if not match or unit not in _UNITS:
        raise ValueError(f"not a size: {size!r} (e.g. 5GB, 500MB, 2GiB or a number of bytes)")
    return int(float(match[1]) * _UNITS[unit])


def dtype_name(name: str) -> str:
    """The torch dtype attribute name of ``name`` (``bf16`` -> ``bfloat16``); ValueError if unknown."""
    name = _DTYPE_ALIASES.get(name.lower().removeprefix("torch."), name.lower().removeprefix("torch."))
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: one of {', '.join(DTYPES)}")
    return name


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the export: its name in the model, dtype (torch attribute name) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * DTYPES[self.dtype][1]


@dataclass
class Shard:
    """One output file: its name, its tensors in file order, and its header (the data follows it)."""

    file_name: str
    tensors: list[OutputTensor]
    header: bytes

    @property
    def size(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)


def header_bytes(tensors: list[OutputTensor], metadata: dict[str, str]) -> bytes:
    """Length prefix + JSON header (padded with spaces to 8 bytes, as safetensors writes it)."""
    body: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for tensor in tensors:
        body[tensor.name] = {"dtype": DTYPES[tensor.dtype][0], "shape": list(tensor.shape),
                             "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    text = json.dumps(body, separators=(",", ":")).encode()
    text += b" " * (-len(text) % HEADER_ALIGNMENT)
    return struct.pack("<Q", len(text)) + text


def plan_shards(tensors: list[OutputTensor], max_shard_size: int, stem: str = "model",
                metadata: dict[str, str] | None = None) -> list[Shard]:
    """Tensors in order, into files of at most ``max_shard_size`` bytes of data each (a tensor larger
    than that gets a file of its own), named as ``save_pretrained`` names them."""
    metadata = {"format": "pt"} if metadata is None else metadata
    groups: list[list[OutputTensor]] = [[]]
    size = 0
    for tensor in tensors:
        if groups[-1] and size + tensor.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(tensor)
        size += tensor.nbytes
    count = len(groups)
    return [Shard(f"{stem}.safetensors" if count == 1 else f"{stem}-{i + 1:05d}-of-{count:05d}.safetensors",
                  group, header_bytes(group, metadata)) for i, group in enumerate(groups)]


def index_bytes(shards: list[Shard], stem: str = "model") -> tuple[str, bytes] | None:
    """``(name, content)`` of the index of a model in several files; None for one file."""
    if len(shards) < 2:
        return None
    weight_map = {tensor.name: shard.file_name for shard in shards for tensor in shard.tensors}
    total = sum(tensor.nbytes for shard in shards for tensor in shard.tensors)
    document = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return f"{stem}.safetensors.index.json", (json.dumps(document, indent=2) + "\n").encode()


def read_header(path: str) -> tuple[dict, int]:
    """The JSON header of the safetensors file at ``path`` and where its data section starts."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", prefix)
        if length > 100 * 2**20:
            raise ValueError(f"{path}: not a safetensors file (header length {length})")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (its header is not a JSON object)")
    return header, 8 + length
