"""Writing one tensor from its pieces, in a buffer of fixed size, checking every piece's checksum.

More: docs/MODULES.md, core/export/assembly.py.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import numpy as np

from asyncckpt.core.errors import CorruptCheckpointError
from asyncckpt.core.formats.checksum import checksum_stream
from asyncckpt.core.formats.dtype_cast import cast
from asyncckpt.core.formats.hf_safetensors import DTYPES
from asyncckpt.core.export.sources import Piece, SourceTensor


class PieceReader:
    """Reads pieces' bytes front to back into a caller's buffer, hashing them as it goes."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._digests: dict[int, object] = {}
        self._loaded: dict[int, memoryview] = {}

    def read(self, piece: Piece, start: int, into: memoryview) -> None:
        """``into`` ← bytes ``[start, start + len(into))`` of ``piece``; reads must come in order."""
        if piece.load is not None:
            data = self._loaded.get(id(piece))
            if data is None:
                data = self._loaded[id(piece)] = memoryview(piece.load()).cast("B")
            into[:] = data[start:start + len(into)]
        else:
            fd = self._fds.get(piece.file)
            if fd is None:
                fd = self._fds[piece.file] = os.open(piece.file, os.O_RDONLY)
            done = 0
            while done < len(into):
                count = os.preadv(fd, [into[done:]], piece.data_start + start + done)
                if count == 0:
                    raise CorruptCheckpointError(f"{piece.file}: ends before the tensor data at offset "
                                                 f"{piece.data_start + start + done} (truncated)", path=piece.file)
                done += count
        if piece.xxh3 is not None:
            digest = self._digests.setdefault(id(piece), checksum_stream())
            digest.update(into)

    def finish(self, piece: Piece, key: str) -> None:
        """The piece was read to its end: check its checksum, forget its state."""
        self._loaded.pop(id(piece), None)
        digest = self._digests.pop(id(piece), None)
        if digest is not None and digest.hexdigest() != piece.xxh3:
            raise CorruptCheckpointError(f"{piece.file}: tensor {key!r} (chunk at {list(piece.offsets)}): checksum "
                                         f"mismatch, expected xxh3 {piece.xxh3}, found {digest.hexdigest()}",
                                         path=piece.file)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _row_count(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape[1:]:
        count *= dim
    return count


def _check_tiling(tensor: SourceTensor, pieces: list[Piece]) -> None:
    """Whole-row pieces must cover the rows exactly once."""
    expected = 0
    for piece in pieces:
        if piece.offsets[0] != expected:
            raise CorruptCheckpointError(f"tensor {tensor.key!r}: its chunks do not cover rows {expected}.."
                                         f"{piece.offsets[0]} of {list(tensor.shape)}")
        expected += piece.sizes[0]
    if expected != tensor.shape[0]:
        raise CorruptCheckpointError(f"tensor {tensor.key!r}: its chunks cover {expected} of its {tensor.shape[0]} rows")


def write_tensor(tensor: SourceTensor, out_dtype: str, reader: PieceReader, buffer: memoryview,
                 write: Callable[[memoryview], None], progress: Optional[Callable[[int], None]] = None) -> None:
    """Write ``tensor`` (cast to ``out_dtype``) through ``write``, using ``buffer`` for every read."""
    itemsize = DTYPES[tensor.dtype][1]
    shape = tensor.shape
    pieces = sorted(tensor.pieces, key=lambda p: p.offsets)
    if not shape or all(p.sizes[1:] == shape[1:] and not any(p.offsets[1:]) for p in pieces):
        if shape:
            _check_tiling(tensor, pieces)
        block = len(buffer) // itemsize * itemsize
        for piece in pieces:
            for start in range(0, piece.nbytes, block):
                view = buffer[:min(block, piece.nbytes - start)]
                reader.read(piece, start, view)
                write(cast(view, tensor.dtype, out_dtype))
                if progress is not None:
                    progress(len(view))
            reader.finish(piece, tensor.key)
        return
    _write_in_windows(tensor, pieces, out_dtype, reader, buffer, write, progress)


def _write_in_windows(tensor: SourceTensor, pieces: list[Piece], out_dtype: str, reader: PieceReader,
                      buffer: memoryview, write: Callable[[memoryview], None],
                      progress: Optional[Callable[[int], None]]) -> None:
    itemsize = DTYPES[tensor.dtype][1]
    element = np.dtype(f"V{itemsize}")
    shape = tensor.shape
    row_bytes = _row_count(shape) * itemsize
    if row_bytes == 0:
        return
    rows = max(1, len(buffer) // 2 // row_bytes)  # half for the window, half for what is read into it
    window_memory = np.empty(rows * row_bytes, dtype=np.uint8)
    scratch = np.empty(max(len(buffer) // 2, row_bytes), dtype=np.uint8)
    for first in range(0, shape[0], rows):
        last = min(shape[0], first + rows)
        window = window_memory[:(last - first) * row_bytes].view(element).reshape((last - first,) + shape[1:])
        placed = 0
        for piece in pieces:
            lo, hi = max(first, piece.offsets[0]), min(last, piece.offsets[0] + piece.sizes[0])
            if lo >= hi:
                continue
            piece_row = _row_count(piece.sizes) * itemsize
            part = memoryview(scratch)[:(hi - lo) * piece_row]
            reader.read(piece, (lo - piece.offsets[0]) * piece_row, part)
            target = (slice(lo - first, hi - first),) + tuple(
                slice(offset, offset + size) for offset, size in zip(piece.offsets[1:], piece.sizes[1:]))
            window[target] = np.frombuffer(part, dtype=element).reshape((hi - lo,) + tuple(piece.sizes[1:]))
            placed += len(part)
            if hi == piece.offsets[0] + piece.sizes[0]:
                reader.finish(piece, tensor.key)
        if placed != (last - first) * row_bytes:
            raise CorruptCheckpointError(f"tensor {tensor.key!r}: its chunks do not cover rows {first}..{last} of "
                                         f"{list(shape)} exactly once")
        write(cast(memoryview(window_memory[:(last - first) * row_bytes]), tensor.dtype, out_dtype))
        if progress is not None:
            progress((last - first) * row_bytes)
