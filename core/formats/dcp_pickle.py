"""DCP's ``.metadata`` pickle, written by the background writer without importing torch.

More: docs/MODULES.md, core/formats/dcp_pickle.py.
"""
from __future__ import annotations

import pickle
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from asyncckpt.core.formats.sidecar import Sidecar

DCP_METADATA_FILE = ".metadata"
_DCP = "torch.distributed.checkpoint.metadata"


@dataclass(frozen=True)
class DcpClasses:
    """What the installed torch's ``Metadata``, ``StorageMeta`` and ``_StorageInfo`` pickle as their
    state: ``(field, default)`` pairs in order (the default is written where we have no value of
    our own); and ``CURRENT_DCP_VERSION``."""

    metadata_state: tuple[tuple[str, Any], ...]
    storage_meta_state: tuple[tuple[str, Any], ...]
    storage_info_state: tuple[tuple[str, Any], ...]
    version: Optional[str]


def _state(fields: tuple[tuple[str, Any], ...], given: dict) -> dict:
    unknown = set(given) - {name for name, _ in fields}
    if unknown:
        raise ValueError(f"torch's DCP metadata has no fields {sorted(unknown)}")
    return {name: given.get(name, default) for name, default in fields}


# ------------------------------------------------------------------------------------ emitting
@dataclass(frozen=True)
class _Global:
    """A module attribute, pickled by name (``GLOBAL``): never imported here."""

    module: str
    name: str


@dataclass(frozen=True)
class _New:
    """``cls.__new__(cls)`` then ``BUILD`` with ``state`` (None: no state), as pickle writes a dataclass."""

    cls: _Global
    state: Any = None


@dataclass(frozen=True)
class _Call:
    """``func(*args)`` (``REDUCE``), as pickle writes ``torch.Size`` or an enum member."""

    func: _Global
    args: tuple


@dataclass(frozen=True)
class _Dict:
    """A dict given as already emitted key/value opcodes followed by ``pairs`` (keys need not be hashable here)."""

    emitted: bytes
    pairs: list


@dataclass(frozen=True)
class _Emitted:
    """A value already emitted."""

    data: bytes


_U32 = struct.Struct("<I")
_TUPLE_OPS = {0: b")", 1: b"\x85", 2: b"\x86", 3: b"\x87"}


def _emit_int(value: int, out: bytearray) -> None:
    if 0 <= value < 256:
        out += b"K" + bytes((value,))
    elif 0 <= value < 65536:
        out += b"M" + struct.pack("<H", value)
    elif -(1 << 31) <= value < 1 << 31:
        out += b"J" + struct.pack("<i", value)
    else:
        encoded = pickle.encode_long(value)
        out += b"\x8a" + bytes((len(encoded),)) + encoded


def _emit(value: Any, out: bytearray) -> None:
    kind = type(value)
    if kind is str:
        data = value.encode("utf-8", "surrogatepass")
        out += b"X" + _U32.pack(len(data)) + data
    elif kind is bool:
        out += b"\x88" if value else b"\x89"
    elif kind is int:
        _emit_int(value, out)
    elif value is None:
        out += b"N"
    elif kind is float:
        out += b"G" + struct.pack(">d", value)
    elif kind is tuple:
        if len(value) > 3:
            out += b"("
        for item in value:
            _emit(item, out)
        out += _TUPLE_OPS.get(len(value), b"t")
    elif kind is list:
        out += b"]"
        if value:
            out += b"("
            for item in value:
                _emit(item, out)
            out += b"e"
    elif kind is dict:
        _emit(_Dict(b"", list(value.items())), out)
    elif kind is _Dict:
        out += b"}(" + value.emitted
        for key, item in value.pairs:
            _emit(key, out)
            _emit(item, out)
        out += b"u"
    elif kind is _Global:
        out += b"c" + f"{value.module}\n{value.name}\n".encode()
    elif kind is _New:
        _emit(value.cls, out)
        out += b")\x81"
        if value.state is not None:
            _emit(value.state, out)
            out += b"b"
    elif kind is _Call:
        _emit(value.func, out)
        _emit(value.args, out)
        out += b"R"
    elif kind is _Emitted:
        out += value.data
    else:
        raise TypeError(f"cannot write a {kind.__name__} into DCP metadata")


def _emitted(value: Any) -> bytes:
    out = bytearray()
    _emit(value, out)
    return bytes(out)


def dumps(value: Any) -> bytes:
    """A whole pickle (protocol 2) of ``value``."""
    return b"\x80\x02" + _emitted(value) + b"."


# ------------------------------------------------------------------------------------ DCP's objects
_SIZE = _Global("torch", "Size")
_STRIDED = _Call(_Global("torch.serialization", "_get_layout"), ("torch.strided",))
_CONTIGUOUS = _Call(_Global(_DCP, "_MEM_FORMAT_ENCODING"), (0,))
_BYTES_ENTRY = _New(_Global(_DCP, "BytesStorageMetadata"))


def entries(pairs: list) -> _Dict:
    """A dict whose keys are emitted objects (a ``MetadataIndex`` cannot be a key of a dict here)."""
    return _Dict(b"", list(pairs))


def size(shape) -> _Call:
    """``torch.Size(shape)``."""
    return _Call(_SIZE, (tuple(shape),))


def tensor_entry(dtype: str, requires_grad: bool, global_size, chunks: list) -> _New:
    """``TensorStorageMetadata`` of a tensor of ``dtype`` (its name in ``torch``), its chunks
    given as ``(offsets, sizes)``. ``TensorProperties`` pickles its state as a tuple (dtype,
    layout, requires_grad, memory format as an enum, pin_memory)."""
    properties = _New(_Global(_DCP, "TensorProperties"), (_Global("torch", dtype), _STRIDED, requires_grad, _CONTIGUOUS, False))
    return _New(_Global(_DCP, "TensorStorageMetadata"), {
        "properties": properties, "size": size(global_size),
        "chunks": [_New(_Global(_DCP, "ChunkStorageMetadata"), {"offsets": size(offsets), "sizes": size(sizes)})
                   for offsets, sizes in chunks],
    })


def storage_index(fqn: str, offset=None, index: Optional[int] = None) -> _New:
    """``MetadataIndex(fqn, offset, index)`` (its ``__init__`` sets ``offset`` only when given)."""
    state = {"fqn": fqn, "index": index}
    if offset is not None:
        state["offset"] = size(offset)
    return _New(_Global(_DCP, "MetadataIndex"), state)


def storage_info(classes: DcpClasses, relative_path: str, offset: int, length: int) -> _New:
    return _New(_Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                _state(classes.storage_info_state, {"relative_path": relative_path, "offset": offset, "length": length}))


def bytes_entry() -> _New:
    return _BYTES_ENTRY


def storage_meta(classes: DcpClasses, checkpoint_id: str, save_id: str) -> _New:
    return _New(_Global(_DCP, "StorageMeta"),
                _state(classes.storage_meta_state, {"checkpoint_id": checkpoint_id, "save_id": save_id}))


def metadata(classes: DcpClasses, **given: Any) -> _New:
    """``Metadata`` with the fields in ``given`` (``state_dict_metadata``, ``planner_data``,
    ``storage_data``, ``storage_meta``), the DCP version, and defaults for the rest."""
    if classes.version is not None:
        given.setdefault("version", classes.version)
    return _New(_Global(_DCP, "Metadata"), _state(classes.metadata_state, given))


# ------------------------------------------------------------------------------------ from sidecars
@dataclass(frozen=True)
class _StructurePart:
    """The emitted parts of ``.metadata`` that only depend on the structure."""

    tensor_entries: bytes  # key/value opcodes of state_dict_metadata's tensor entries
    tensor_storage: bytes  # key/value opcodes of storage_data's tensor chunks
    planner_data: bytes
    tensor_fqns: frozenset


_structure_parts: dict = {}


def _structure_part(sidecars: list["Sidecar"], classes: DcpClasses) -> _StructurePart:
    """Built once per structure (identified by every rank's structure hash) and reused; saves
    without structure hashes build it every time."""
    key = (tuple(sidecar.structure_hash for sidecar in sidecars), len(sidecars),
           tuple(tuple(sidecar.tensors.files) if sidecar.tensors.files is not None else None for sidecar in sidecars))
    part = _structure_parts.get(key)
    if part is not None:
        return part
    entries: dict[str, tuple] = {}  # fqn -> (dtype, requires_grad, global size, chunks)
    storage: list = []
    seen: set = set()
    for sidecar in sidecars:
        t = sidecar.tensors
        shapes = [tuple(shape) for shape in t.shapes]
        for fqn, offsets, sizes, global_size, dtype, requires_grad, file, start, length in zip(
            t.fqn, t.chunk_offsets, t.chunk_sizes, t.global_size, t.dtype, t.requires_grad, t.item_files(), t.start,
            t.length
        ):
            chunk = (fqn, shapes[offsets])  # replicated chunks (written by one rank) are recorded once
            if chunk in seen:
                continue
            seen.add(chunk)
            entry = entries.setdefault(fqn, (dtype, requires_grad, shapes[global_size], []))
            storage.append((storage_index(fqn, shapes[offsets], len(entry[3])), storage_info(classes, file, start, length)))
            entry[3].append((shapes[offsets], shapes[sizes]))
    planner_data: dict[str, Any] = {}
    for sidecar in sidecars:
        for fqn, path in sidecar.planner_data().items():
            planner_data.setdefault(fqn, tuple(path))
    tensor_entries = bytearray()
    for fqn, (dtype, requires_grad, global_size, chunks) in entries.items():
        _emit(fqn, tensor_entries)
        _emit(tensor_entry(dtype, requires_grad, global_size, chunks), tensor_entries)
    tensor_storage = bytearray()
    for key_, value in storage:
        _emit(key_, tensor_storage)
        _emit(value, tensor_storage)
    part = _StructurePart(bytes(tensor_entries), bytes(tensor_storage), _emitted(planner_data), frozenset(entries))
    if all(key[0]):
        _structure_parts.clear()  # one structure at a time is plenty for a writer
        _structure_parts[key] = part
    return part


def metadata_bytes(sidecars: list["Sidecar"], classes: DcpClasses, checkpoint_id: str, save_id: str) -> bytes:
    """The ``.metadata`` of a checkpoint, merged from every rank's sidecar."""
    part = _structure_part(sidecars, classes)
    entries, storage, seen = [], [], set()
    for sidecar in sidecars:  # this save's non-tensor entries; ones several ranks wrote are recorded once
        o = sidecar.objects
        for fqn, file, start, length in zip(o.fqn, o.item_files(), o.start, o.length):
            if fqn not in part.tensor_fqns and fqn not in seen:
                seen.add(fqn)
                entries.append((fqn, bytes_entry()))
                storage.append((storage_index(fqn), storage_info(classes, file, start, length)))
    return dumps(metadata(
        classes,
        state_dict_metadata=_Dict(part.tensor_entries, entries),
        planner_data=_Emitted(part.planner_data),
        storage_data=_Dict(part.tensor_storage, storage),
        storage_meta=storage_meta(classes, str(checkpoint_id), save_id),
    ))
