"""One rank's sidecar ``__{rank}.asyncckpt.json``: where every item it wrote lies, and its checksum.

More: docs/MODULES.md, core/formats/sidecar.py.
"""
from __future__ import annotations

import base64
import json
import sys
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from itertools import chain
from typing import Any, Optional, Sequence

from asyncckpt.core.errors import CorruptCheckpointError
from asyncckpt.core.formats.checksum import FileChecksum
from asyncckpt.core.formats.layout import RankLayout

SIDECAR_FORMAT = "asyncckpt-rank"
SIDECAR_VERSION = 4
_UNSHARED_VERSION = 3  # what a share whose items all lie in its own files is written as (older readers read it)
_COMPACT = (",", ":")
_SHAPE_FIELDS = ("chunk_offsets", "chunk_sizes", "global_size")  # indices into the tensors' "shapes" table
_TENSOR_FIELDS = ("fqn",) + _SHAPE_FIELDS + ("dtype", "requires_grad", "start", "length", "data_start", "nbytes", "xxh3")
_OBJECT_FIELDS = ("fqn", "start", "length", "xxh3")
_INT_FIELDS = ("start", "length", "data_start", "nbytes")
_SHARING = ("xxh3_128", "files")  # optional columns: the items' content ids; version 4: the file of each item
_PACKED_FIELDS = _SHAPE_FIELDS + ("dtype",) + _INT_FIELDS  # version 3: base64 of little-endian int64s


def _packed(values: Sequence[int]) -> str:
    """Non-negative integers as version 3 stores a column: base64 of little-endian int64s."""
    column = array("q", values)
    if sys.byteorder == "big":
        column.byteswap()
    return base64.b64encode(column).decode("ascii")


def _unpacked(text: Any) -> Optional[array]:
    """A packed column back as an ``array('q')``; None if it is not one."""
    if not isinstance(text, str):
        return None
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:  # binascii.Error, and a str that is not ASCII
        return None
    if len(raw) % 8:
        return None
    column = array("q")
    column.frombytes(raw)
    if sys.byteorder == "big":
        column.byteswap()
    return column


# ------------------------------------------------------------------------------------- writing
@dataclass
class ShareItems:
    """What one rank wrote: its tensor file (layout + a checksum per slot) and its objects."""

    layout: Optional[RankLayout]  # None: the rank wrote no tensor
    tensor_digests: list[str]  # xxh3 of each layout slot's bytes, in layout order
    objects_file: Optional[str]
    objects: list[tuple[str, int, int, str]]  # (fqn, start, length, xxh3) in file order
    tensor_file: Optional[FileChecksum] = None  # the tensor file's size and xxh3, where asked for (``write_share``)
    tensor_ids: Optional[list[str]] = None  # xxh3-128 of each slot's bytes (``checksum.content_id``), layout order
    tensor_files: Optional[list[str]] = None  # the file each slot's bytes are in; None: all in ``layout.file_name``
    object_ids: Optional[list[str]] = None  # xxh3-128 of each object
    object_files: Optional[list[str]] = None  # the file each object is in; None: all in ``objects_file``
    written: int = 0  # bytes this save wrote (data files)
    shared: int = 0  # bytes of items it shares with the checkpoint before (``storage.sharing``)

    def locations(self) -> list[tuple[str, int, int]]:
        """``(file, start, length)`` of every item: tensors in layout order, then objects."""
        found = []
        if self.layout:
            files = self.tensor_files or [self.layout.file_name] * len(self.layout.slots)
            found = [(file, s.start, s.length) for file, s in zip(files, self.layout.slots)]
        files = self.object_files or [self.objects_file] * len(self.objects)
        return found + [(file, start, length) for file, (_fqn, start, length, _digest) in zip(files, self.objects)]

    def own_files(self) -> list[str]:
        """The data files this share wrote itself (the others are shared, linked from the checkpoint before)."""
        found = {file for file, _start, _length in self.locations()}
        return [name for name in (self.layout and self.layout.file_name, self.objects_file) if name and name in found]


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
_STATIC_CACHE_SIZE = 4  # a few layouts (one per snapshot buffer in flight, a structure change)


def _static_json(layout: Optional[RankLayout], planner_data: dict) -> str:
    """``"planner_data":{…},"tensors":{…`` (left open for the checksums) for this layout, encoded
    once per layout object: the writer keeps one layout (with its planner_data) per snapshot buffer
    across saves."""
    cached = _static_cache.get(id(layout))
    if cached is not None and cached[0] is layout and cached[1] is planner_data:
        return cached[2]
    slots = layout.slots if layout is not None else ()
    shapes: dict[tuple, int] = {}
    dtypes: dict[str, int] = {}
    columns: dict[str, Any] = {"file": layout.file_name if layout is not None else None, "shapes": [], "dtypes": []}
    for field in _TENSOR_FIELDS[:-1]:
        values = [getattr(slot, field) for slot in slots]
        if field in _SHAPE_FIELDS:
            values = [shapes.setdefault(tuple(shape), len(shapes)) for shape in values]
        elif field == "dtype":
            values = [dtypes.setdefault(dtype, len(dtypes)) for dtype in values]
        columns[field] = _packed(values) if field in _PACKED_FIELDS else values
    columns["shapes"] = [list(shape) for shape in shapes]
    columns["dtypes"] = list(dtypes)
    explicit = {fqn: list(path) for fqn, path in planner_data.items() if list(path) != fqn.split(".")}
    text = ('"planner_data":' + json.dumps(explicit, separators=_COMPACT)
            + ',"tensors":' + json.dumps(columns, separators=_COMPACT)[:-1])
    if layout is not None:
        _static_cache[id(layout)] = (layout, planner_data, text)
        while len(_static_cache) > _STATIC_CACHE_SIZE:
            _static_cache.popitem(last=False)
    return text


def _per_save_columns(ids: Optional[list[str]], files: Optional[list[str]], own: Optional[str]) -> dict:
    """A section's columns that change from save to save besides its checksums: the content ids, and where some
    items lie outside ``own`` (shared), the file of each (a table and a packed index into it, ``own`` first)."""
    columns: dict[str, Any] = {}
    if ids is not None:
        columns["xxh3_128"] = ids
    if files is not None and any(file != own for file in files):
        table: dict[str, int] = {own: 0} if own is not None else {}
        index = _packed([table.setdefault(file, len(table)) for file in files])
        columns["files"], columns["file_index"] = list(table), index
    return columns


def encode_sidecar(record: ShareRecord) -> bytes:
    """The JSON document of ``record`` (field order as in docs/FORMAT.md)."""
    share = record.share
    tensors = _per_save_columns(share.tensor_ids, share.tensor_files, share.layout and share.layout.file_name)
    objects = {"file": share.objects_file, "fqn": [o[0] for o in share.objects],
               "start": _packed([o[1] for o in share.objects]), "length": _packed([o[2] for o in share.objects]),
               "xxh3": [o[3] for o in share.objects],
               **_per_save_columns(share.object_ids, share.object_files, share.objects_file)}
    version = SIDECAR_VERSION if "files" in tensors or "files" in objects else _UNSHARED_VERSION
    header = json.dumps({"format": SIDECAR_FORMAT, "version": version, "save_id": record.save_id,
                         "rank": record.rank, "world_size": record.world_size,
                         "structure_hash": record.structure_hash}, separators=_COMPACT)
    return "".join((
        header[:-1], ",", _static_json(share.layout, record.planner_data),
        ',"xxh3":', json.dumps(share.tensor_digests, separators=_COMPACT),
        "".join(f",{json.dumps(name)}:{json.dumps(value, separators=_COMPACT)}" for name, value in tensors.items()),
        "}", ',"objects":', json.dumps(objects, separators=_COMPACT), "}",
    )).encode()


# ------------------------------------------------------------------------------------- reading
@dataclass
class TensorColumns:
    """A rank's tensor items, one sequence per field, in file order. Tied tensors share bytes."""

    file: Optional[str]
    shapes: list[list[int]]  # every distinct shape once; the three shape columns index it
    fqn: list[str]
    chunk_offsets: Sequence[int]  # this chunk's offset in the global tensor
    chunk_sizes: Sequence[int]  # this chunk's size
    global_size: Sequence[int]  # the global tensor's size
    dtype: list[str]
    requires_grad: list[bool]
    start: Sequence[int]  # the torch.save container in ``file``
    length: Sequence[int]
    data_start: Sequence[int]  # the raw tensor bytes in ``file``
    nbytes: Sequence[int]
    xxh3: list[str]
    xxh3_128: Optional[list[str]] = None  # content ids (``checksum.content_id``), where the writer recorded them
    files: Optional[list[str]] = None  # version 4: the file of each item; None: every item is in ``file``

    def chunk_shape(self, index: int) -> tuple:
        return tuple(self.shapes[self.chunk_sizes[index]])

    def item_files(self) -> Sequence[Optional[str]]:
        """The file of each item, in item order."""
        return self.files if self.files is not None else [self.file] * len(self.fqn)


@dataclass
class ObjectColumns:
    """A rank's pickled objects, one sequence per field, in file order (each item is its whole blob)."""

    file: Optional[str]
    fqn: list[str]
    start: Sequence[int]
    length: Sequence[int]
    xxh3: list[str]
    xxh3_128: Optional[list[str]] = None
    files: Optional[list[str]] = None

    def item_files(self) -> Sequence[Optional[str]]:
        return self.files if self.files is not None else [self.file] * len(self.fqn)


@dataclass
class Sidecar:
    """A parsed sidecar (any version), checked for shape and types."""

    path: str
    version: int
    save_id: Any
    rank: Any
    world_size: Any
    structure_hash: Any
    explicit_paths: dict  # planner_data entries whose path is not the key split at its dots
    tensors: TensorColumns
    objects: ObjectColumns

    def planner_data(self) -> dict:
        """DCP's flatten mapping (key -> path) of every key this rank wrote. (Its entries are
        checked here, on use: a load needs none of them.)"""
        if not all(map(_is_path, self.explicit_paths.values())):
            raise _malformed(self.path, "'planner_data' holds something other than key paths")
        paths = {fqn: fqn.split(".") for fqn in self.tensors.fqn}
        paths.update((fqn, fqn.split(".")) for fqn in self.objects.fqn)
        paths.update(self.explicit_paths)
        return paths

    def as_v1(self) -> dict:
        """The version-1 document (one dict per item), for code that reads items one by one."""
        t, o = self.tensors, self.objects
        shapes = t.shapes
        items = [
            {"kind": "tensor", "fqn": fqn, "chunk_offsets": shapes[offsets], "chunk_sizes": shapes[sizes],
             "global_size": shapes[global_size], "dtype": dtype, "requires_grad": requires_grad, "file": file,
             "start": start, "length": length, "data_start": data_start, "nbytes": nbytes, "xxh3": digest}
            for fqn, offsets, sizes, global_size, dtype, requires_grad, file, start, length, data_start, nbytes, digest
            in zip(t.fqn, t.chunk_offsets, t.chunk_sizes, t.global_size, t.dtype, t.requires_grad, t.item_files(),
                   t.start, t.length, t.data_start, t.nbytes, t.xxh3)
        ]
        items += [
            {"kind": "bytes", "fqn": fqn, "file": file, "start": start, "length": length, "data_start": start,
             "nbytes": length, "xxh3": digest}
            for fqn, file, start, length, digest in zip(o.fqn, o.item_files(), o.start, o.length, o.xxh3)
        ]
        return {"format": SIDECAR_FORMAT, "version": self.version, "save_id": self.save_id, "rank": self.rank,
                "world_size": self.world_size, "structure_hash": self.structure_hash,
                "planner_data": self.planner_data(), "items": items}


def _only(types: tuple, values: list) -> bool:
    return set(map(type, values)) <= set(types)


def _strings(values: list) -> bool:
    try:
        "".join(values)  # C speed; raises on anything but str
    except TypeError:
        return False
    return True


def _counts(values: Sequence[int], below: Optional[int] = None) -> bool:
    """Non-negative integers (less than ``below``)."""
    try:
        packed = values if isinstance(values, array) else array("q", values)  # C speed; raises on anything but int
    except (TypeError, OverflowError):
        return False
    return not packed or (min(packed) >= 0 and (below is None or max(packed) < below))


def _malformed(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: malformed sidecar: {what}")


def _check_columns(path: str, section: str, columns: dict, fields: tuple) -> None:
    """Sidecars are input like any other: check every column we index with before trusting it."""
    lengths = set()
    for field in fields:
        values = columns.get(field)
        if not isinstance(values, (list, array)):
            raise _malformed(path, f"'{section}.{field}' is not a list")
        lengths.add(len(values))
    if len(lengths) > 1:
        raise _malformed(path, f"the '{section}' columns have different lengths {sorted(lengths)}")
    for field in ("fqn", "xxh3", "dtype"):
        if field in fields and not _strings(columns[field]):
            raise _malformed(path, f"'{section}.{field}' holds a non-string")
    if "requires_grad" in fields and not _only((bool,), columns["requires_grad"]):
        raise _malformed(path, f"'{section}.requires_grad' holds a non-boolean")
    for field in _INT_FIELDS:
        if field in fields and not _counts(columns[field]):
            raise _malformed(path, f"'{section}.{field}' holds something other than a byte count")
    if _SHAPE_FIELDS[0] in fields:
        shapes = columns.get("shapes")
        if not isinstance(shapes, list) or not _only((list,), shapes) or not _only((int,), list(chain.from_iterable(shapes))):
            raise _malformed(path, f"'{section}.shapes' is not a list of lists of integers")
        for field in _SHAPE_FIELDS:
            if not _counts(columns[field], below=len(shapes)):
                raise _malformed(path, f"'{section}.{field}' holds something other than an index into 'shapes'")
    if lengths != {0} and not isinstance(columns.get("file"), str):
        raise _malformed(path, f"'{section}.file' is not a file name")
    count = lengths.pop() if lengths else 0
    ids = columns.get("xxh3_128")
    if ids is not None and (not isinstance(ids, list) or len(ids) != count or not _strings(ids)):
        raise _malformed(path, f"'{section}.xxh3_128' is not one string per item")
    if "file_index" in columns:
        files, index = columns.get("files"), _unpacked(columns["file_index"])
        if not isinstance(files, list) or not files or not _strings(files):
            raise _malformed(path, f"'{section}.files' is not a list of file names")
        if index is None or len(index) != count or not _counts(index, below=len(files)):
            raise _malformed(path, f"'{section}.file_index' holds something other than an index into 'files'")
        columns["files"] = [files[i] for i in index]
    else:
        columns["files"] = None


def _columns_from_v1(path: str, record: dict) -> tuple[dict, dict, dict]:
    """A version-1 document regrouped as version-2 columns (one file per kind, as we always wrote)."""
    items = record.get("items")
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise _malformed(path, "'items' is not a list of objects")
    tensors: dict[str, Any] = {field: [] for field in _TENSOR_FIELDS}
    objects: dict[str, Any] = {field: [] for field in _OBJECT_FIELDS}
    files: dict[str, set] = {"tensor": set(), "bytes": set()}
    table: dict[tuple, int] = {}
    for item in items:
        kind = item.get("kind")
        if kind not in files:
            raise _malformed(path, f"unknown item kind {kind!r}")
        files[kind].add(item.get("file"))
        for field, values in (tensors if kind == "tensor" else objects).items():
            value = item.get(field, False if field == "requires_grad" else None)
            if field in _SHAPE_FIELDS:
                if not isinstance(value, list):
                    raise _malformed(path, f"item '{item.get('fqn')}': '{field}' is not a list")
                value = table.setdefault(tuple(value), len(table))
            values.append(value)
    for kind, names in files.items():
        if len(names) > 1:
            raise _malformed(path, f"{kind} items spread over several files {sorted(map(str, names))}")
    tensors["file"] = next(iter(files["tensor"]), None)
    tensors["shapes"] = [list(shape) for shape in table]
    objects["file"] = next(iter(files["bytes"]), None)
    planner_data = record.get("planner_data", {})
    explicit = {fqn: p for fqn, p in planner_data.items() if p != fqn.split(".")} if isinstance(planner_data, dict) else None
    return tensors, objects, explicit


def _unpack_columns(path: str, section: str, columns: dict) -> None:
    """A version-3 section's packed columns as arrays, and its dtype indices as the ``dtypes`` table's names (the
    same string objects: a parse makes no string per tensor for them)."""
    for field in _PACKED_FIELDS:
        if field in columns:
            column = _unpacked(columns[field])
            if column is None:
                raise _malformed(path, f"'{section}.{field}' is not a packed column of integers")
            columns[field] = column
    if "dtype" in columns:
        dtypes = columns.get("dtypes")
        if not isinstance(dtypes, list) or not _strings(dtypes) or not _counts(columns["dtype"], below=len(dtypes)):
            raise _malformed(path, f"'{section}.dtype' holds something other than an index into 'dtypes'")
        columns["dtype"] = [dtypes[index] for index in columns["dtype"]]


def parse_sidecar(path: str, data: bytes) -> Sidecar:
    """Parse and check a sidecar (version 1 to 4) read from ``path`` (named in errors)."""
    try:
        record = json.loads(data)
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: unreadable sidecar: {e}") from e
    if not isinstance(record, dict) or record.get("format") != SIDECAR_FORMAT or not isinstance(record.get("version"), int) \
            or record["version"] > SIDECAR_VERSION:
        found = record if not isinstance(record, dict) else f"{record.get('format')} v{record.get('version')}"
        raise CorruptCheckpointError(f"{path}: unsupported sidecar format {found}")
    if record["version"] >= 2:
        tensors, objects, explicit = record.get("tensors"), record.get("objects"), record.get("planner_data", {})
        if not isinstance(tensors, dict) or not isinstance(objects, dict):
            raise _malformed(path, "'tensors' or 'objects' is missing")
        if record["version"] >= 3:
            _unpack_columns(path, "tensors", tensors)
            _unpack_columns(path, "objects", objects)
    else:
        tensors, objects, explicit = _columns_from_v1(path, record)
    _check_columns(path, "tensors", tensors, _TENSOR_FIELDS)
    _check_columns(path, "objects", objects, _OBJECT_FIELDS)
    if not isinstance(explicit, dict):
        raise _malformed(path, "'planner_data' is not an object")
    return Sidecar(
        path=path, version=record["version"], save_id=record.get("save_id"), rank=record.get("rank"),
        world_size=record.get("world_size"), structure_hash=record.get("structure_hash"), explicit_paths=explicit,
        tensors=TensorColumns(**{field: tensors.get(field) for field in ("file", "shapes") + _TENSOR_FIELDS + _SHARING}),
        objects=ObjectColumns(**{field: objects.get(field) for field in ("file",) + _OBJECT_FIELDS + _SHARING}),
    )


def _is_path(value: Any) -> bool:
    return isinstance(value, list) and _only((str, int), value)
