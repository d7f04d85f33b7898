"""One rank's sidecar ``__{rank}.asyncckpt.json``: where every item it wrote lies, and its checksum.

Format version 2 (docs/FORMAT.md §3) stores the items column by column, one JSON array per field
(index ``i`` of every array is item ``i``), where version 1 had one JSON object per item: a rank
with 8,000 tensors parses in well under half the time, and a load wants columns anyway. Every
tensor column except the checksums depends only on the rank's layout, which is the same for every
save of one state-dict structure, so the writer encodes that part once per layout and a save
encodes only its checksums and objects. Version 1 sidecars are still read.

The sidecar is also the rank's "my share is durable" signal: it is published atomically, after
the rank's data files are fsynced.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from itertools import chain
from typing import Any, Optional

from .errors import CorruptCheckpointError
from .fsio import atomic_write_bytes
from .layout import RankLayout

SIDECAR_FORMAT = "asyncckpt-rank"
SIDECAR_VERSION = 2
_COMPACT = (",", ":")
_TENSOR_STATIC_FIELDS = ("fqn", "chunk_offsets", "chunk_sizes", "global_size", "dtype", "requires_grad",
                         "start", "length", "data_start", "nbytes")
_INT_FIELDS = ("start", "length", "data_start", "nbytes")
_SHAPE_FIELDS = ("chunk_offsets", "chunk_sizes", "global_size")


def sidecar_name(rank: int) -> str:
    return f"__{rank}.asyncckpt.json"


# ------------------------------------------------------------------------------------- writing
@dataclass
class ShareItems:
    """What one rank wrote: its tensor file (layout + a checksum per slot) and its objects."""

    layout: Optional[RankLayout]  # None: the rank wrote no tensor
    tensor_digests: list[str]  # xxh3 of each layout slot's bytes, in layout order
    objects_file: Optional[str]
    objects: list[tuple[str, int, int, str]]  # (fqn, start, length, xxh3) in file order

    def locations(self) -> list[tuple[str, int, int]]:
        """``(file, start, length)`` of every item: tensors in layout order, then objects."""
        found = [(self.layout.file_name, s.start, s.length) for s in self.layout.slots] if self.layout else []
        return found + [(self.objects_file, start, length) for _fqn, start, length, _digest in self.objects]


@dataclass
class ShareRecord:
    """A rank's sidecar before encoding: which save, which rank, and everything it wrote."""

    save_id: str
    rank: int
    world_size: int
    structure_hash: str
    planner_data: dict
    share: ShareItems


_static_cache: "OrderedDict[int, tuple[Optional[RankLayout], dict, str]]" = OrderedDict()
_STATIC_CACHE_SIZE = 4  # a few layouts (one per staging buffer in flight, a structure change)


def _static_json(layout: Optional[RankLayout], planner_data: dict) -> str:
    """``"planner_data":{…},"tensors":{…`` (left open for the checksums) for this layout, encoded
    once per layout object: the writer keeps one layout per staging buffer across saves."""
    cached = _static_cache.get(id(layout))
    if cached is not None and cached[0] is layout and cached[1] == planner_data:
        return cached[2]
    slots = layout.slots if layout is not None else ()
    columns: dict[str, Any] = {"file": layout.file_name if layout is not None else None}
    for field in _TENSOR_STATIC_FIELDS:
        columns[field] = [getattr(slot, field) for slot in slots]
    text = ('"planner_data":' + json.dumps(planner_data, separators=_COMPACT)
            + ',"tensors":' + json.dumps(columns, separators=_COMPACT)[:-1])
    if layout is not None:
        _static_cache[id(layout)] = (layout, planner_data, text)
        while len(_static_cache) > _STATIC_CACHE_SIZE:
            _static_cache.popitem(last=False)
    return text


def encode_sidecar(record: ShareRecord) -> bytes:
    """The version-2 JSON document of ``record`` (field order as in docs/FORMAT.md)."""
    share = record.share
    header = json.dumps({"format": SIDECAR_FORMAT, "version": SIDECAR_VERSION, "save_id": record.save_id,
                         "rank": record.rank, "world_size": record.world_size,
                         "structure_hash": record.structure_hash}, separators=_COMPACT)
    objects = {"file": share.objects_file, "fqn": [o[0] for o in share.objects], "start": [o[1] for o in share.objects],
               "length": [o[2] for o in share.objects], "xxh3": [o[3] for o in share.objects]}
    return "".join((
        header[:-1], ",", _static_json(share.layout, record.planner_data),
        ',"xxh3":', json.dumps(share.tensor_digests, separators=_COMPACT), "}",
        ',"objects":', json.dumps(objects, separators=_COMPACT), "}",
    )).encode()


def write_rank_sidecar(directory: str, record: ShareRecord) -> None:
    """Durably publish one rank's sidecar (tmp + fsync + rename): the rank's share is complete."""
    atomic_write_bytes(os.path.join(directory, sidecar_name(record.rank)), encode_sidecar(record))


# ------------------------------------------------------------------------------------- reading
@dataclass
class TensorColumns:
    """A rank's tensor items, one list per field, in file order. Tied tensors share bytes."""

    file: Optional[str]
    fqn: list[str]
    chunk_offsets: list[list[int]]
    chunk_sizes: list[list[int]]
    global_size: list[list[int]]
    dtype: list[str]
    requires_grad: list[bool]
    start: list[int]  # the torch.save container in ``file``
    length: list[int]
    data_start: list[int]  # the raw tensor bytes in ``file``
    nbytes: list[int]
    xxh3: list[str]


@dataclass
class ObjectColumns:
    """A rank's pickled objects, one list per field, in file order (each item is its whole blob)."""

    file: Optional[str]
    fqn: list[str]
    start: list[int]
    length: list[int]
    xxh3: list[str]


@dataclass
class Sidecar:
    """A parsed sidecar (any version), checked for shape and types."""

    path: str
    version: int
    save_id: Any
    rank: Any
    world_size: Any
    structure_hash: Any
    planner_data: dict
    tensors: TensorColumns
    objects: ObjectColumns

    def as_v1(self) -> dict:
        """The version-1 document (one dict per item), for code that reads items one by one."""
        t, o = self.tensors, self.objects
        items = [
            {"kind": "tensor", "fqn": fqn, "chunk_offsets": offsets, "chunk_sizes": sizes, "global_size": global_size,
             "dtype": dtype, "requires_grad": requires_grad, "file": t.file, "start": start, "length": length,
             "data_start": data_start, "nbytes": nbytes, "xxh3": digest}
            for fqn, offsets, sizes, global_size, dtype, requires_grad, start, length, data_start, nbytes, digest
            in zip(t.fqn, t.chunk_offsets, t.chunk_sizes, t.global_size, t.dtype, t.requires_grad, t.start,
                   t.length, t.data_start, t.nbytes, t.xxh3)
        ]
        items += [
            {"kind": "bytes", "fqn": fqn, "file": o.file, "start": start, "length": length, "data_start": start,
             "nbytes": length, "xxh3": digest}
            for fqn, start, length, digest in zip(o.fqn, o.start, o.length, o.xxh3)
        ]
        return {"format": SIDECAR_FORMAT, "version": self.version, "save_id": self.save_id, "rank": self.rank,
                "world_size": self.world_size, "structure_hash": self.structure_hash,
                "planner_data": self.planner_data, "items": items}


def _only(types: tuple, values: list) -> bool:
    return set(map(type, values)) <= set(types)


def _malformed(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: malformed sidecar: {what}")


def _check_columns(path: str, section: str, columns: dict, fields: tuple) -> None:
    """Sidecars are input like any other: check every column we index with before trusting it."""
    lengths = set()
    for field in fields:
        values = columns.get(field)
        if not isinstance(values, list):
            raise _malformed(path, f"'{section}.{field}' is not a list")
        lengths.add(len(values))
    if len(lengths) > 1:
        raise _malformed(path, f"the '{section}' columns have different lengths {sorted(lengths)}")
    for field in ("fqn", "xxh3", "dtype"):
        if field in fields and not _only((str,), columns[field]):
            raise _malformed(path, f"'{section}.{field}' holds a non-string")
    for field in _INT_FIELDS:
        if field in fields and (not _only((int,), columns[field]) or min(columns[field], default=0) < 0):
            raise _malformed(path, f"'{section}.{field}' holds something other than a byte count")
    for field in _SHAPE_FIELDS:
        if field in fields and not (_only((list,), columns[field]) and _only((int,), list(chain.from_iterable(columns[field])))):
            raise _malformed(path, f"'{section}.{field}' holds something other than a list of integers")
    if lengths != {0} and not isinstance(columns.get("file"), str):
        raise _malformed(path, f"'{section}.file' is not a file name")


def _columns_from_v1(path: str, items: Any) -> tuple[dict, dict]:
    """Version-1 item objects regrouped as version-2 columns (one file per kind, as we always wrote)."""
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise _malformed(path, "'items' is not a list of objects")
    tensors: dict[str, Any] = {field: [] for field in _TENSOR_STATIC_FIELDS + ("xxh3",)}
    objects: dict[str, Any] = {field: [] for field in ("fqn", "start", "length", "xxh3")}
    files: dict[str, set] = {"tensor": set(), "bytes": set()}
    for item in items:
        kind = item.get("kind")
        if kind not in files:
            raise _malformed(path, f"unknown item kind {kind!r}")
        files[kind].add(item.get("file"))
        target = tensors if kind == "tensor" else objects
        for field, values in target.items():
            values.append(item.get(field, False if field == "requires_grad" else None))
    for kind, names in files.items():
        if len(names) > 1:
            raise _malformed(path, f"{kind} items spread over several files {sorted(map(str, names))}")
    tensors["file"] = next(iter(files["tensor"]), None)
    objects["file"] = next(iter(files["bytes"]), None)
    return tensors, objects


def read_sidecar(directory: str, rank: int) -> Sidecar:
    """Parse and check the sidecar of ``rank`` (version 1 or 2). FileNotFoundError if absent."""
    path = os.path.join(directory, sidecar_name(rank))
    with open(path, "rb") as f:
        data = f.read()
    try:
        record = json.loads(data)
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: unreadable sidecar: {e}") from e
    if not isinstance(record, dict) or record.get("format") != SIDECAR_FORMAT or not isinstance(record.get("version"), int) \
            or record["version"] > SIDECAR_VERSION:
        found = record if not isinstance(record, dict) else f"{record.get('format')} v{record.get('version')}"
        raise CorruptCheckpointError(f"{path}: unsupported sidecar format {found}")
    if record["version"] >= 2:
        tensors, objects = record.get("tensors"), record.get("objects")
        if not isinstance(tensors, dict) or not isinstance(objects, dict):
            raise _malformed(path, "'tensors' or 'objects' is missing")
    else:
        tensors, objects = _columns_from_v1(path, record.get("items"))
    _check_columns(path, "tensors", tensors, _TENSOR_STATIC_FIELDS + ("xxh3",))
    _check_columns(path, "objects", objects, ("fqn", "start", "length", "xxh3"))
    planner_data = record.get("planner_data", {})
    if not isinstance(planner_data, dict):
        raise _malformed(path, "'planner_data' is not an object")
    return Sidecar(
        path=path, version=record["version"], save_id=record.get("save_id"), rank=record.get("rank"),
        world_size=record.get("world_size"), structure_hash=record.get("structure_hash"), planner_data=planner_data,
        tensors=TensorColumns(**{field: tensors[field] for field in ("file",) + _TENSOR_STATIC_FIELDS + ("xxh3",)}),
        objects=ObjectColumns(**{field: objects[field] for field in ("file", "fqn", "start", "length", "xxh3")}),
    )


def read_rank_sidecar(directory: str, rank: int) -> dict:
    """The sidecar of ``rank`` as a version-1 document (a dict per item), whatever its version."""
    return read_sidecar(directory, rank).as_v1()
