"""Reading item bytes from data files straight into their destinations, verified while in cache.

More: docs/MODULES.md, core/loading/reader.py.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Union

import numpy as np
import torch

from asyncckpt.core.storage import diskio
from asyncckpt.core.storage.backend import Backend, backend_for, join
from asyncckpt.core.storage.object_store import options_for
from asyncckpt.core.formats.checksum import checksum, checksum_stream
from asyncckpt.core.errors import CorruptCheckpointError

PIECE_BYTES = 512 << 10  # half of a core's L2 here: a piece is still cached when it is hashed
PART_BYTES = 16 << 20  # unverified large items are read in parts this size, shared by the lanes
GAP_BYTES = 64 << 10  # framing between two items read by one preadv (larger gaps start a new read)
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024)
_SCRATCH = memoryview(bytearray(GAP_BYTES))  # receives skipped framing; nobody reads it

# dtype attribute name -> dtype, for the dtypes whose saved bytes are read raw into tensors
RAW_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex128, torch.complex64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)}
# dtypes whose tensors ``Tensor.numpy()`` can expose as they are (others are viewed as bytes)
_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128})


class Span(NamedTuple):
    """``nbytes`` bytes at ``offset`` of a data file, for ``target``; named ``key`` in errors."""

    offset: int
    nbytes: int
    target: Union[torch.Tensor, bytearray]
    xxh3: Optional[str]  # expected checksum; None: not verified
    key: str


@dataclass
class FileSpans:
    """Everything a load reads from one data file, sorted by offset, and how long the file must
    be for it: the end of the last ``torch.save`` container read from it, and that item's key."""

    relative_path: str
    spans: list[Span]
    needed_size: int
    needed_by: str


def group_by_file(reads: list[tuple[str, Span, int]]) -> list[FileSpans]:
    """``(relative path, span, end of the item's container)`` reads as per-file, sorted FileSpans."""
    by_file: dict[str, FileSpans] = {}
    for relative_path, span, container_end in reads:
        entry = by_file.get(relative_path)
        if entry is None:
            entry = by_file[relative_path] = FileSpans(relative_path, [], 0, "")
        entry.spans.append(span)
        if container_end > entry.needed_size:
            entry.needed_size, entry.needed_by = container_end, span.key
    for entry in by_file.values():
        entry.spans.sort(key=lambda span: span.offset)
    return list(by_file.values())


def can_read_into(target: torch.Tensor, dtype: Optional[torch.dtype], shape: tuple, nbytes: int) -> bool:
    """Whether a saved chunk's raw bytes (``dtype``, ``shape``, ``nbytes``) can be read straight into
    ``target``'s memory: a plain strided contiguous CPU tensor of that dtype and shape, without a
    conjugate or negative view bit (whose memory holds other values than the tensor shows)."""
    return (target.dtype is dtype and target.shape == shape and target.is_cpu and target.layout is torch.strided
            and target.is_contiguous() and not target.is_neg() and not target.is_conj() and target.nbytes == nbytes)


def overlapping(reads: list[tuple[str, Span]]) -> tuple[set[int], set[int]]:
    """Targets that share memory, as ``id``s of ``(relative path, span)`` reads: (repeats: the same
    bytes of the same file again, e.g. tied weights, which need not be read twice; clashes: different
    bytes into the same memory, which parallel reads would race on and checksums would then reject).
    """
    tensors = [(relative_path, span) for relative_path, span in reads
               if span.nbytes and type(span.target) is not bytearray]
    if len(tensors) < 2:
        return set(), set()
    starts = np.array([span.target.data_ptr() for _, span in tensors], dtype=np.int64)
    ends = starts + np.array([span.nbytes for _, span in tensors], dtype=np.int64)
    order = np.argsort(starts, kind="stable")
    repeats: set[int] = set()
    clashes: set[int] = set()
    for position in np.nonzero(starts[order][1:] < ends[order][:-1])[0].tolist():
        first, second = order[position], order[position + 1]
        (file_a, a), (file_b, b) = tensors[first], tensors[second]
        if (starts[first], a.nbytes, file_a, a.offset) == (starts[second], b.nbytes, file_b, b.offset):
            repeats.add(id(b))
        else:
            clashes.update((id(a), id(b)))
    return repeats, clashes


def writable_bytes(target: Union[torch.Tensor, bytearray]):
    """A zero-copy writable buffer over a contiguous CPU tensor's bytes (or the bytearray itself)."""
    if not isinstance(target, torch.Tensor):
        return target
    if target.dtype in _NUMPY_DTYPES and not target.requires_grad:
        return target.numpy()
    return target.detach().reshape(-1).view(torch.uint8).numpy()


def _truncated(path: str, offset: int, wanted: int, reached: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path}: file is truncated (wanted bytes {offset}..{offset + wanted}, file ends at {reached})")


def preadv_exact(fd: int, buffers: list, offset: int, total: int, path: str) -> None:
    """Fill ``buffers`` (``total`` bytes together) from ``fd`` at ``offset``; a short file is an error."""
    got = os.preadv(fd, buffers, offset)
    while got < total:  # a short read: continue into the rest
        if got == 0:
            raise _truncated(path, offset, total, offset)
        offset, total, buffers = offset + got, total - got, _after(buffers, got)
        got = os.preadv(fd, buffers, offset)


def _after(buffers: list, skip: int) -> list:
    """The buffers with their first ``skip`` bytes (together) dropped."""
    rest = []
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        if skip >= len(view):
            skip -= len(view)
        else:
            rest.append(view[skip:])
            skip = 0
    return rest


def _mismatch(path: str, span: Span, found: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path}: checksum mismatch for key '{span.key}' (bytes {span.offset}..{span.offset + span.nbytes}): "
        f"expected xxh3 {span.xxh3}, found {found}")


def _read_part(fd: int, path: str, span: Span, begin: int, end: int) -> None:
    """Bytes ``[begin, end)`` of an unverified item (parts of one item can go to different lanes)."""
    view = memoryview(writable_bytes(span.target)).cast("B")[begin:end]
    preadv_exact(fd, [view], span.offset + begin, end - begin, path)


def _read_large(fd: int, path: str, span: Span) -> None:
    """One verified item, piece by piece, each piece hashed just after it lands."""
    view = memoryview(writable_bytes(span.target)).cast("B")
    digest = checksum_stream()
    for position in range(0, span.nbytes, PIECE_BYTES):
        piece = view[position : position + PIECE_BYTES]
        preadv_exact(fd, [piece], span.offset + position, len(piece), path)
        digest.update(piece)
    if digest.hexdigest() != span.xxh3:
        raise _mismatch(path, span, digest.hexdigest())


def _read_batch(fd: int, path: str, batch: list[Span]) -> None:
    """Neighbouring small items with one preadv: their bytes into their targets, framing dropped."""
    buffers: list = []  # the iovec list: targets, and scratch for the framing between them
    own: list = []  # each span's target buffer, for the checksums
    cursor = batch[0].offset
    for span in batch:
        if span.offset > cursor:
            buffers.append(_SCRATCH[: span.offset - cursor])
        try:
            buffer = span.target.numpy()  # the common case, without writable_bytes' checks (per span)
        except (AttributeError, TypeError, RuntimeError):  # a buffer, or a dtype/tensor numpy refuses
            buffer = writable_bytes(span.target)
        buffers.append(buffer)
        own.append(buffer)
        cursor = span.offset + span.nbytes
    preadv_exact(fd, buffers, batch[0].offset, cursor - batch[0].offset, path)
    for span, buffer in zip(batch, own):
        if span.xxh3 is not None and checksum(buffer) != span.xxh3:
            raise _mismatch(path, span, checksum(buffer))


def _work(fd: int, path: str, spans: list[Span], large: list, batches: list) -> None:
    """Add the file's reads as units of work: one per large item, one per batch of small ones."""
    batch: list[Span] = []
    batch_end = batch_bytes = 0
    for span in spans:
        if not span.nbytes:
            continue
        if span.nbytes > PIECE_BYTES:
            if span.xxh3 is not None:  # hashed in order: one lane reads it all
                large.append((_read_large, (fd, path, span)))
            else:
                large.extend((_read_part, (fd, path, span, begin, min(begin + PART_BYTES, span.nbytes)))
                             for begin in range(0, span.nbytes, PART_BYTES))
            continue
        if batch and (span.offset - batch_end > GAP_BYTES or span.offset < batch_end
                      or batch_bytes + span.nbytes > PIECE_BYTES or len(batch) * 2 + 2 > _IOV_MAX):
            batches.append((_read_batch, (fd, path, batch)))
            batch, batch_bytes = [], 0
        batch.append(span)
        batch_end = span.offset + span.nbytes
        batch_bytes += span.nbytes
    if batch:
        batches.append((_read_batch, (fd, path, batch)))


def read_spans(root: str, files: list[FileSpans], *, threads: int) -> None:
    """Read every span of every file into its target, verifying checksums where given.

    Raises ``CorruptCheckpointError`` naming the file (and key) for a missing or truncated data
    file or a checksum mismatch; targets read before the failure keep their new bytes. A root in
    an object store is read by ranged requests (see the module docstring).
    """
    backend = backend_for(root)
    if backend.remote:
        return _read_ranged(backend, root, files)
    opened: list[int] = []
    try:
        large: list = []
        batches: list = []
        for entry in files:
            path = os.path.join(root, entry.relative_path)  # callers checked it stays inside root
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError as e:
                raise CorruptCheckpointError(f"{path}: data file is missing") from e
            opened.append(fd)
            size = os.fstat(fd).st_size
            if size < entry.needed_size:
                raise CorruptCheckpointError(f"{path}: file is truncated: key '{entry.needed_by}' needs bytes up to "
                                             f"{entry.needed_size}, file has {size}")
            _work(fd, path, entry.spans, large, batches)
        _run_units([large, batches], threads)
    finally:
        for fd in opened:
            os.close(fd)


def _run_units(queues: list[list], threads: int) -> None:
    """Run every unit of ``queues`` on ``threads`` lanes. Lane i takes units from queue i first,
    then from the others: large reads (GIL released while the kernel copies) and batches (mostly
    Python, under the GIL) then run side by side, which is where two threads gain over one."""
    pending = [iter(queue) for queue in queues]
    failed: list[BaseException] = []

    def lane(index: int) -> None:
        for queue in pending[index % len(pending):] + pending[:index % len(pending)]:
            for function, args in queue:  # list iterators hand out each unit once, across threads
                if failed:
                    return
                try:
                    function(*args)
                except BaseException as e:
                    failed.append(e)
                    return

    lanes = max(1, min(threads, sum(map(len, queues))))
    diskio.run_parallel(lane, list(range(lanes)), threads)
    if failed:
        raise failed[0]


# ------------------------------------------------------------------------------- ranged requests
def _read_ranged(backend: Backend, root: str, files: list[FileSpans]) -> None:
    """``read_spans`` for a remote backend: every span by ranged requests (module docstring)."""
    part = options_for(root).part_bytes
    ranges: list[tuple[str, int, Optional[int]]] = []
    handlers: list[Callable[[bytes], None]] = []
    for entry in files:
        url = join(root, entry.relative_path)
        try:
            size = backend.stat(url).size
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"{url}: data object is missing") from e
        if size < entry.needed_size:
            raise CorruptCheckpointError(f"{url}: object is truncated: key '{entry.needed_by}' needs bytes up to "
                                         f"{entry.needed_size}, it has {size}")
        batch: list[Span] = []
        for span in entry.spans:
            if not span.nbytes:
                continue
            if span.nbytes > part:
                item = _LargeItem(url, span, -(-span.nbytes // part))
                for begin in range(0, span.nbytes, part):
                    ranges.append((url, span.offset + begin, span.offset + min(begin + part, span.nbytes)))
                    handlers.append(item.handler(begin))
                continue
            if batch and (span.offset - (batch[-1].offset + batch[-1].nbytes) > GAP_BYTES
                          or span.offset < batch[-1].offset + batch[-1].nbytes
                          or span.offset + span.nbytes - batch[0].offset > part):
                ranges.append((url, batch[0].offset, batch[-1].offset + batch[-1].nbytes))
                handlers.append(_batch_handler(url, batch))
                batch = []
            batch.append(span)
        if batch:
            ranges.append((url, batch[0].offset, batch[-1].offset + batch[-1].nbytes))
            handlers.append(_batch_handler(url, batch))

    def land(index: int, data: Optional[bytes]) -> None:
        if data is None:
            raise CorruptCheckpointError(f"{ranges[index][0]}: data object is missing")
        handlers[index](data)

    backend.read_ranges(ranges, land)


def _batch_handler(url: str, batch: list[Span]) -> Callable[[bytes], None]:
    def land(data: bytes) -> None:
        view, origin = memoryview(data), batch[0].offset
        for span in batch:
            piece = view[span.offset - origin:span.offset - origin + span.nbytes]
            memoryview(writable_bytes(span.target)).cast("B")[:] = piece
            if span.xxh3 is not None:
                found = checksum(piece)
                if found != span.xxh3:
                    raise _mismatch(url, span, found)

    return land


class _LargeItem:
    """A large item's ranges: each lands in its place; the item is verified after the last."""

    def __init__(self, url: str, span: Span, pieces: int) -> None:
        self.url, self.span, self.missing = url, span, pieces
        self.view = memoryview(writable_bytes(span.target)).cast("B")

    def handler(self, begin: int) -> Callable[[bytes], None]:
        def land(data: bytes) -> None:  # on the event loop's one thread: no lock needed
            self.view[begin:begin + len(data)] = data
            self.missing -= 1
            if self.missing == 0 and self.span.xxh3 is not None:
                found = checksum(self.view)
                if found != self.span.xxh3:
                    raise _mismatch(self.url, self.span, found)

        return land
