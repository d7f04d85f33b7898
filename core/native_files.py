"""Single-file checkpoints in the frameworks' native formats, written by the background writer.

``torch``: exactly what ``torch.save`` writes. We run ``torch.save`` with ``skip_data`` (the
pickled structure and zip records are produced, the storage bytes are left as holes; CRC32s are
not computed, and ``torch.load`` does not check them), note which storage went to which data
record, and copy each storage's bytes into its hole of a staging buffer. Shared storages (tied
weights, views) are saved once, as torch.save does. The pickled structure is the snapshot of
every non-tensor object.

``safetensors``: the 8-byte header length, the JSON header, then the tensors back to back, as
the safetensors specification lays them out.

The writer then writes the image to a temporary name, fsyncs and renames it into place.
"""
from __future__ import annotations

import bisect
import io
import json
import os
import pickle
import struct
import types
import uuid
import zipfile
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils.serialization import config as _serialization_config

from . import diskio
from .container import _LOCAL_HEADER, _template_lock
from .fsio import fsync_dir
from .layout import RankLayout

_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


@dataclass
class FileImage:
    """A native file's bytes: ``header`` pieces at offsets, and tensor bytes to copy at offsets."""

    size: int
    pieces: list[tuple[int, bytes]]
    copies: list[tuple[int, torch.Tensor]]  # (offset, uint8 view of the source storage/tensor)


def _recording_pickle_module(storages: dict) -> types.SimpleNamespace:
    """A stand-in for ``pickle`` in ``torch.save(pickle_module=...)`` that notes, in ``storages``,
    which storage torch.save assigned to which data record key.

    torch.save subclasses ``pickle_module.Pickler`` and defines ``persistent_id`` on the subclass;
    the C pickler reads that hook when it is constructed, so we put a recording wrapper on the
    instance just before construction.
    """

    class Pickler(pickle.Pickler):
        def __init__(self, *args, **kwargs):
            assign_key = type(self).persistent_id.__get__(self)

            def recording(obj):
                pid = assign_key(obj)
                if pid is not None and pid[0] == "storage":
                    storage = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
                    storages.setdefault(pid[2], storage)
                return pid

            self.persistent_id = recording
            super().__init__(*args, **kwargs)

    return types.SimpleNamespace(__name__="asyncckpt_recording_pickle", Pickler=Pickler, dump=pickle.dump)


class _SparseFile(io.RawIOBase):
    """A seekable file keeping only what is written; holes read as zeros and cost nothing.

    ``torch.save`` under ``skip_data`` seeks over each storage's bytes. Into a ``BytesIO`` that
    would allocate, zero and copy a buffer as large as the whole checkpoint on every save; here
    only the zip framing and the pickle (a few KB to MB) are kept, with their offsets.
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
            if self.starts and self.position < self.starts[-1]:
                raise io.UnsupportedOperation("torch.save wrote backwards")
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
        """Reads (used by zipfile on the framing only) assemble the overlapping pieces."""
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

    def merged_pieces(self) -> list[tuple[int, bytes]]:
        merged: list[list] = []
        for start, data in self.pieces:
            if merged and merged[-1][0] + len(merged[-1][1]) == start:
                merged[-1][1] += data
            else:
                merged.append([start, bytearray(data)])
        return [(start, bytes(data)) for start, data in merged]


def torch_file_image(obj: Any) -> FileImage:
    """The image of ``torch.save(obj)``; call-time snapshot of the structure, live storages to copy."""
    storages: dict = {}
    sparse = _SparseFile()
    with _template_lock:
        previous = _serialization_config.save.compute_crc32
        _serialization_config.save.compute_crc32 = False
        try:
            with torch.serialization.skip_data():
                torch.save(obj, sparse, pickle_module=_recording_pickle_module(storages))
        finally:
            _serialization_config.save.compute_crc32 = previous
    copies = []
    sparse.seek(0)
    with zipfile.ZipFile(sparse) as archive:
        for info in archive.infolist():
            parts = info.filename.split("/")
            if len(parts) == 3 and parts[1] == "data" and parts[2] in storages:
                sparse.seek(info.header_offset)
                header = _LOCAL_HEADER.unpack(sparse.read(_LOCAL_HEADER.size))
                start = info.header_offset + _LOCAL_HEADER.size + header[9] + header[10]
                storage = storages[parts[2]]
                copies.append((start, torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)))
    return FileImage(sparse.size, sparse.merged_pieces(), copies)


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
        copies.append((cursor, tensor))
        cursor += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    prefix = struct.pack("<Q", len(encoded)) + encoded
    return FileImage(len(prefix) + cursor, [(0, prefix)],
                     [(len(prefix) + offset, tensor) for offset, tensor in copies])


def stage_image(image: FileImage, target: torch.Tensor) -> None:
    """Fill ``target`` (uint8 staging bytes) with the file image: framing, then tensor bytes."""
    mapped = target.numpy()
    for offset, piece in image.pieces:
        mapped[offset : offset + len(piece)] = memoryview(piece)
    for offset, source in image.copies:
        flat = source.contiguous().reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        if nbytes:
            target[offset : offset + nbytes].copy_(flat.view(torch.uint8), non_blocking=source.is_cuda)
    if any(source.is_cuda for _, source in image.copies):
        torch.cuda.current_stream().synchronize()


@dataclass
class FileRequest:
    """Write a staged single file atomically: temporary name, fsync, rename, fsync the directory."""

    path: str
    size: int
    direct_io: bool = True
    io_threads: int = 2
    on_failure: Any = None  # a directory transaction's commit request, told about a failure

    def run(self, layout: RankLayout, image: memoryview) -> None:
        directory, name = os.path.split(os.path.abspath(self.path))
        temporary = os.path.join(directory, f".{name}.asyncckpt-tmp-{uuid.uuid4().hex[:8]}")
        try:
            os.makedirs(directory, exist_ok=True)
            diskio.write_image(temporary, image, self.size, direct=self.direct_io, threads=self.io_threads)
            os.replace(temporary, self.path)
            fsync_dir(directory)
        except BaseException as e:
            if os.path.exists(temporary):
                os.unlink(temporary)
            if self.on_failure is not None:
                from .storage import report_failure

                report_failure(self.on_failure, e)
            raise


@dataclass
class RemoveRequest:
    """Delete files / checkpoint directories, in queue order (after the saves queued before it)."""

    paths: list
    only_if_complete: Optional[str] = None

    def run(self, layout: Optional[RankLayout], image: Optional[memoryview]) -> None:
        from .commit import is_complete, remove_checkpoint

        if self.only_if_complete is not None:
            newer = self.only_if_complete  # a directory needs its commit record; a file only exists complete
            if not (is_complete(newer) if os.path.isdir(newer) else os.path.isfile(newer)):
                return
        for path in self.paths:
            if os.path.isdir(path) and not os.path.islink(path):
                remove_checkpoint(path)
            elif os.path.lexists(path):
                os.unlink(path)
