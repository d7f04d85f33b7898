"""The image of ``torch.save(obj)`` without materialising its data: a drop-in for the core's
``native_files.torch_file_image`` (temporary; proposed for the core, see docs/accelerate.md).

The core renders ``torch.save(obj)`` with ``skip_data`` into an ``io.BytesIO``. torch's buffer writer
*seeks over* each storage's bytes, and a BytesIO fills every such hole with zeros: the whole file
(336 MB for a 42 M-parameter AdamW state) is allocated, zeroed and copied again by ``getvalue()`` on
every save, ~0.25 s here, as long as the snapshot's memcpy itself. Here torch writes into a sparse
file object that only keeps what is written (zip headers, the pickle, the central directory, a few KB)
and remembers the holes; the zip central directory then says where each storage's bytes go.
The result is the same ``FileImage`` (same size, same bytes once staged) as the core's function.
"""
from __future__ import annotations

import bisect
import io
import struct
import types
import zipfile
from typing import Any

import torch
from torch.utils.serialization import config as _serialization_config

from asyncckpt.core.container import _template_lock  # the core's guard around torch.save's global options
from asyncckpt.core.native_files import FileImage, _recording_pickle_module

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_HEADER_SIGNATURE = 0x04034B50


class _SparseFile(io.RawIOBase):
    """A seekable file that stores written bytes as (offset, bytes) pieces; holes read as zeros."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[tuple[int, bytes]] = []  # never overlapping: torch writes forward only
        self.position = self.size = 0
        self._starts = None

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, data) -> int:
        data = bytes(data)
        if data:
            self.pieces.append((self.position, data))
            self.position += len(data)
            self.size = max(self.size, self.position)
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def read_at(self, offset: int, length: int) -> bytes:
        if self._starts is None or len(self._starts) != len(self.pieces):
            self.pieces.sort()
            self._starts = [start for start, _ in self.pieces]
        out = bytearray(length)
        index = max(0, bisect.bisect_right(self._starts, offset) - 1)
        while index < len(self.pieces) and self.pieces[index][0] < offset + length:
            start, data = self.pieces[index]
            lo, hi = max(start, offset), min(start + len(data), offset + length)
            if lo < hi:
                out[lo - offset:hi - offset] = data[lo - start:hi - start]
            index += 1
        return bytes(out)

    def readinto(self, target) -> int:
        length = max(0, min(len(target), self.size - self.position))
        target[:length] = self.read_at(self.position, length)
        self.position += length
        return length

    def merged_pieces(self) -> list[tuple[int, bytes]]:
        merged: list[tuple[int, bytearray]] = []
        for start, data in sorted(self.pieces):
            if merged and merged[-1][0] + len(merged[-1][1]) == start:
                merged[-1][1].extend(data)
            else:
                merged.append((start, bytearray(data)))
        return [(start, bytes(data)) for start, data in merged]


def torch_file_image(obj: Any) -> FileImage:
    """Like ``asyncckpt.core.native_files.torch_file_image``: the image of ``torch.save(obj)``, with the
    structure pickled now and each storage's bytes to be copied into its hole when staged."""
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
                header = _LOCAL_HEADER.unpack(sparse.read_at(info.header_offset, _LOCAL_HEADER.size))
                if header[0] != _LOCAL_HEADER_SIGNATURE:
                    raise ValueError(f"torch.save record {info.filename}: no local header at {info.header_offset}")
                start = info.header_offset + _LOCAL_HEADER.size + header[9] + header[10]
                storage = storages[parts[2]]
                copies.append((start, torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)))
    return FileImage(sparse.size, sparse.merged_pieces(), copies)


def swap_into_core() -> types.SimpleNamespace:
    """Where the core's ``_save_file`` looks the builder up (``asyncckpt.core.checkpointer``), if it does."""
    from asyncckpt.core import checkpointer

    return checkpointer if hasattr(checkpointer, "torch_file_image") else None
