"""``torch.save`` files whose framing is rendered once per structure, not once per save.

``torch.save`` writes ``data.pkl`` (the pickled structure) first and every storage after it. A
checkpoint's pickle holds values that change from save to save (step counters, loop progress,
metrics) and so changes length, which shifts every storage record and the whole zip framing.
Rendering that framing per save (``torch.save`` under ``skip_data``, then finding the records) was
most of a single-file snapshot's cost beyond the copy itself.

More: docs/MODULES.md, core/snapshot/torch_file_images.py.
"""
from __future__ import annotations

import bisect
import functools
import io
import logging
import pickle
import struct
import threading
import types
import zipfile
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from asyncckpt.core.snapshot.container import LOCAL_HEADER
from asyncckpt.core.formats.layout import ITEM_ALIGNMENT, align_up
from asyncckpt.core.snapshot.file_images import FileImage, stage_image
from asyncckpt.core.snapshot.tensor_copy import CopyThreads

logger = logging.getLogger("asyncckpt.core")

_PICKLE_RECORD = "data.pkl"
_DESCRIPTOR = struct.Struct("<IIII")  # signature, CRC-32, compressed size, size (32-bit form)
_DESCRIPTOR_SIGNATURE = 0x08074B50
_CENTRAL_ENTRY_SIGNATURE = 0x02014B50
_CENTRAL_ENTRY_SIZE = 46
_CENTRAL_SIZES = struct.Struct("<III")  # CRC-32, compressed size, size: at +16 of a central entry
_STORAGE_TYPES = (torch.storage.TypedStorage, torch.UntypedStorage)  # every storage class derives from one
_REBUILD_TENSOR = torch._utils._rebuild_tensor_v2
_UNTYPED_DTYPES = frozenset(torch.storage._new_dtypes())  # torch reduces these with _rebuild_tensor_v3
_MIN_SLACK = 1024  # spare pickle bytes in a fresh template at least: a growing step counter never re-renders


@dataclass(frozen=True)
class _Record:
    """One record ``torch.save`` writes: small bytes, or (``payload is None``) a storage of ``nbytes``."""

    name: str
    payload: Any
    nbytes: int


class _RecordCollector:
    """Stands in for torch's zip writer in ``torch.serialization._save``: notes the records, writes nothing."""

    def __init__(self) -> None:
        self.records: list[_Record] = []

    def write_record(self, name: str, data: Any, nbytes: int) -> None:
        self.records.append(_Record(name, data, nbytes))

    def write_record_metadata(self, name: str, nbytes: int) -> None:  # a storage, under skip_data
        self.records.append(_Record(name, None, nbytes))


def _plain_tensor_reduce(tensor: torch.Tensor):
    """What ``Tensor.__reduce_ex__`` returns for a plain dense tensor (exact type, strided, no Python
    state, hooks, conj/neg bits or new-style dtype), built directly; None for any other tensor.

    torch's own method runs ~15 generic checks in Python per tensor, a third of the pickling of a
    checkpoint. Every new structure is pickled both ways once and this path is only used if both
    give the same bytes (``TorchFileTemplates``), so a torch that reduces tensors differently costs
    speed, never correctness."""
    if (type(tensor) is not torch.Tensor or tensor.layout is not torch.strided or tensor.is_nested
            or tensor.is_quantized or tensor.device.type not in ("cpu", "cuda") or tensor.dtype in _UNTYPED_DTYPES
            or tensor.is_conj() or tensor.is_neg() or tensor._backward_hooks or tensor.__dict__):
        return None
    storage = torch.storage.TypedStorage(wrap_storage=tensor.untyped_storage(), dtype=tensor.dtype, _internal=True)
    return _REBUILD_TENSOR, (storage, tensor.storage_offset(), tuple(tensor.size()), tensor.stride(),
                             tensor.requires_grad, OrderedDict())


def _recording_pickle_module(storages: dict, plain_tensors_directly: bool) -> types.SimpleNamespace:
    """A stand-in for ``pickle`` in ``torch.save``'s pickling that notes, in ``storages``, which
    storage torch assigned to which data record key.

    torch subclasses ``pickle_module.Pickler`` and defines ``persistent_id`` on the subclass; the C
    pickler reads that hook when it is constructed, so we put a recording wrapper on the instance
    just before construction. The pickler calls the hook for every object (~25 per tensor), and
    torch's hook returns None for anything but a storage: other objects skip it (same result, and
    pickling a checkpoint takes half the time). With ``plain_tensors_directly``, plain tensors are
    reduced by ``_plain_tensor_reduce``.
    """

    class Pickler(pickle.Pickler):
        def __init__(self, *args, **kwargs):
            assign_key = type(self).persistent_id.__get__(self)

            def recording(obj):
                if not isinstance(obj, _STORAGE_TYPES):
                    return None
                pid = assign_key(obj)
                if pid is not None and pid[0] == "storage":
                    storage = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
                    storages.setdefault(pid[2], storage)
                return pid

            self.persistent_id = recording
            super().__init__(*args, **kwargs)

        if plain_tensors_directly:
            def reducer_override(self, obj):
                reduced = _plain_tensor_reduce(obj) if isinstance(obj, torch.Tensor) else None
                return NotImplemented if reduced is None else reduced

    return types.SimpleNamespace(__name__="asyncckpt_recording_pickle", Pickler=Pickler, dump=pickle.dump)


def pickle_records(obj: Any, plain_tensors_directly: bool = False) -> tuple[list[_Record], dict]:
    """What ``torch.save(obj)`` would write, without writing: its records (``data.pkl`` with the
    pickled structure, the small metadata records, one metadata-only record per storage) and the
    live storages by key. Storages stay where they are (no device-to-host copy here)."""
    collector, storages = _RecordCollector(), {}
    with torch.serialization.skip_data():
        torch.serialization._save(obj, collector, _recording_pickle_module(storages, plain_tensors_directly),
                                  torch.serialization.DEFAULT_PROTOCOL, False)
    return collector.records, storages


class _SparseFile(io.RawIOBase):
    """A seekable file keeping only what is written; holes read as zeros and cost nothing.

    torch's zip writer seeks over each storage's bytes when it writes metadata only. Into a
    ``BytesIO`` that would allocate and zero a buffer as large as the checkpoint; here only the
    zip framing and the pickle are kept, with their offsets.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[tuple[int, bytes]] = []  # torch writes forward only: sorted by offset
        self.starts: list[int] = []
        self.position = self.size = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        data = bytes(data)
        if data:
            if self.pieces and self.position < self.pieces[-1][0] + len(self.pieces[-1][1]):
                raise io.UnsupportedOperation("torch's zip writer wrote backwards")
            self.pieces.append((self.position, data))
            self.starts.append(self.position)
            self.position += len(data)
            self.size = max(self.size, self.position)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.position = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence] + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def readinto(self, target) -> int:
        """Reads (zipfile on the framing, once per template) assemble the overlapping pieces."""
        end = min(self.position + len(target), self.size)
        length = max(0, end - self.position)
        view = memoryview(target)[:length]
        view[:] = bytes(length)
        index = max(0, bisect.bisect_right(self.starts, self.position) - 1)
        while index < len(self.pieces) and self.pieces[index][0] < end:
            start, data = self.pieces[index]
            lo, hi = max(start, self.position), min(start + len(data), end)
            if lo < hi:
                view[lo - self.position : hi - self.position] = data[lo - start : hi - start]
            index += 1
        self.position = end
        return length

    def merged_pieces(self, exclude: tuple[int, int]) -> list[tuple[int, bytes]]:
        """The written bytes as few (offset, bytes) pieces, leaving out ``exclude`` = [start, end)."""
        merged: list[list] = []
        for start, data in self.pieces:
            end = start + len(data)
            for lo, hi in ((start, min(end, exclude[0])), (max(start, exclude[1]), end)):
                if lo >= hi:
                    continue
                chunk = data[lo - start : hi - start]
                if merged and merged[-1][0] + len(merged[-1][1]) == lo:
                    merged[-1][1] += chunk
                else:
                    merged.append([lo, bytearray(chunk)])
        return [(start, bytes(data)) for start, data in merged]


@dataclass(frozen=True)
class TorchFileTemplate:
    """A torch.save file's bytes apart from the pickle and the storages' data."""

    size: int
    framing: list[tuple[int, bytes]]  # (offset, bytes): zip headers, small records, central directory
    pickle_offset: int
    capacity: int  # bytes reserved for the pickle; its descriptor follows the pickle
    pickle_sizes_offset: int  # where data.pkl's central-directory CRC-32 and sizes are
    storage_offsets: tuple[int, ...]  # data start of each storage record, in record order

    def image(self, pickled: bytes, storages: list) -> FileImage:
        """This file with ``pickled`` as data.pkl and ``storages`` (in record order) as the data."""
        crc = zlib.crc32(pickled)
        region = b"".join((pickled, _DESCRIPTOR.pack(_DESCRIPTOR_SIGNATURE, crc, len(pickled), len(pickled)),
                           bytes(self.capacity - len(pickled))))
        pieces = [(self.pickle_offset, region),
                  (self.pickle_sizes_offset, _CENTRAL_SIZES.pack(crc, len(pickled), len(pickled)))]
        copies = [(offset, _bytes_of(storage)) for offset, storage in zip(self.storage_offsets, storages)]
        return FileImage(self.size, pieces, copies, framing=self.framing)


def _bytes_of(storage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (what torch.save writes for it), on its device."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def render_template(records: list[_Record], capacity: int) -> TorchFileTemplate:
    """Write ``records`` (torch's, in torch's order) with torch's zip writer, the pickle record as
    ``capacity`` placeholder bytes and storages as holes, and find where everything went."""
    sparse = _SparseFile()
    alignment = next((int(r.payload) for r in records if r.name == ".storage_alignment"), ITEM_ALIGNMENT)
    writer = torch._C.PyTorchFileWriter(sparse, True, alignment)  # CRC-32s of the small records; holes get 0
    for record in records:
        if record.name == _PICKLE_RECORD:
            writer.write_record(record.name, bytes(capacity), capacity)
        elif record.payload is None:
            writer.write_record_metadata(record.name, record.nbytes)
        else:
            writer.write_record(record.name, record.payload, record.nbytes)
    writer.write_end_of_file()

    sparse.seek(0)
    with zipfile.ZipFile(sparse) as archive:
        starts = {}
        for info in archive.infolist():
            sparse.seek(info.header_offset)
            header = LOCAL_HEADER.unpack(sparse.read(LOCAL_HEADER.size))
            starts[info.filename.split("/", 1)[1]] = info.header_offset + LOCAL_HEADER.size + header[9] + header[10]
        central_start = archive.start_dir
    pickle_offset = starts[_PICKLE_RECORD]
    sparse.seek(pickle_offset + capacity)
    expected = (_DESCRIPTOR_SIGNATURE, zlib.crc32(bytes(capacity)), capacity, capacity)
    if _DESCRIPTOR.unpack(sparse.read(_DESCRIPTOR.size)) != expected:
        raise AssertionError("torch's zip writer laid out data.pkl's record in an unexpected way")
    sizes_offset = _central_sizes_offset(sparse, central_start, _PICKLE_RECORD)
    framing = sparse.merged_pieces(exclude=(pickle_offset, pickle_offset + capacity + _DESCRIPTOR.size))
    storage_offsets = tuple(starts[r.name] for r in records if r.payload is None)
    return TorchFileTemplate(sparse.size, framing, pickle_offset, capacity, sizes_offset, storage_offsets)


def _central_sizes_offset(sparse: _SparseFile, central_start: int, record: str) -> int:
    """Offset of ``record``'s CRC-32 and sizes in its central-directory entry."""
    position = central_start
    while True:
        sparse.seek(position)
        entry = sparse.read(_CENTRAL_ENTRY_SIZE)
        signature, = struct.unpack_from("<I", entry)
        if signature != _CENTRAL_ENTRY_SIGNATURE:
            raise AssertionError(f"no central-directory entry for {record}")
        name_length, extra_length, comment_length = struct.unpack_from("<HHH", entry, 28)
        if sparse.read(name_length).decode().split("/", 1)[1] == record:  # torch prefixes a folder name
            return position + 16
        position += _CENTRAL_ENTRY_SIZE + name_length + extra_length + comment_length


class TorchFileTemplates:
    """Templates by structure (the records torch writes, storage sizes included), most recent kept.

    A template is re-rendered with more room when a pickle outgrows it (rare: it starts with spare
    room). Thread-safe: files may be saved from several threads.
    """

    def __init__(self, max_templates: int = 64) -> None:
        self._templates: OrderedDict[tuple, TorchFileTemplate] = OrderedDict()
        self._direct_pickle_ok: dict[tuple, bool] = {}  # per structure: plain tensors reduced directly, same bytes
        self._max = max_templates
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._templates)

    def image(self, obj: Any) -> FileImage:
        """The image of ``torch.save(obj)`` (loadable as such): the pickle is taken now (the
        snapshot of every non-tensor value), the live storages are to be copied into it.

        Built from torch's internals (its zip writer, its pickler's records): where they do not
        behave as this module expects (checked once per process on a sample, and on every
        structure as it is rendered), the file is what a plain ``torch.save`` writes, with one
        warning: slower (the whole file serialised in the caller), never wrong."""
        if _templates_work():
            try:
                return self._templated(obj)
            except Exception as e:  # noqa: BLE001 - the plain path below raises what is the object's fault
                image = plain_image(obj)
                _warn_once(f"a {type(obj).__name__} structure could not be framed once per structure ({e})")
                return image
        return plain_image(obj)

    def _templated(self, obj: Any) -> FileImage:
        records, storages = pickle_records(obj, plain_tensors_directly=True)
        key = tuple((r.name, r.nbytes if r.payload is None else r.payload) for r in records if r.name != _PICKLE_RECORD)
        direct_ok = self._direct_pickle_ok.get(key)
        if not direct_ok:  # a new structure (checked once), or one the direct reduction got wrong
            checked, checked_storages = pickle_records(obj)  # torch's own reduction: the reference
            if direct_ok is None:
                self._direct_pickle_ok[key] = checked == records
            records, storages = checked, checked_storages
        pickled = next(r.payload for r in records if r.name == _PICKLE_RECORD)
        with self._lock:
            template = self._templates.get(key)
            if template is None or template.capacity < len(pickled):
                capacity = align_up(len(pickled) + max(_MIN_SLACK, len(pickled) // 4), ITEM_ALIGNMENT)
                template = render_template(records, capacity)
                self._templates[key] = template
            self._templates.move_to_end(key)
            while len(self._templates) > self._max:
                self._direct_pickle_ok.pop(self._templates.popitem(last=False)[0], None)
        keys = [r.name.split("/", 1)[1] for r in records if r.payload is None]
        return template.image(pickled, [storages[k] for k in keys])


def plain_image(obj: Any) -> FileImage:
    """The file exactly as ``torch.save`` writes it (every byte serialised now)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    return FileImage(len(data), [(0, data)], [])


_warned = False


def _warn_once(why: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning("asyncckpt: %s with torch %s; such files are written as plain torch.save output (slower "
                       "snapshots, same files)", why, torch.__version__)


@functools.lru_cache(maxsize=None)
def _templates_work() -> bool:
    """Whether a sample file framed by this module loads (``torch.load``, weights_only and not) as
    exactly the object it was made from, with this torch: checked once per process."""
    sample = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "h": torch.ones(3, dtype=torch.bfloat16),
              "strided": torch.arange(8)[::2], "tied": None, "values": [1, "x", None, 2.5], "step": 7}
    sample["tied"] = sample["w"]
    try:
        image = TorchFileTemplates()._templated(sample)
        target = torch.zeros(image.size, dtype=torch.uint8)
        stage_image(image, target, CopyThreads())
        for weights_only in (True, False):
            loaded = torch.load(io.BytesIO(target.numpy().tobytes()), weights_only=weights_only)
            same = loaded.keys() == sample.keys() and all(
                torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype if isinstance(v, torch.Tensor) else loaded[k] == v
                for k, v in sample.items())
            if not same or loaded["tied"].data_ptr() != loaded["w"].data_ptr():
                raise ValueError(f"a sample loads as {loaded!r}")
    except Exception as e:  # noqa: BLE001 - any difference means: do not use this path
        _warn_once(f"torch.save files cannot be framed once per structure ({type(e).__name__}: {e})")
        return False
    return True
