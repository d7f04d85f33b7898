"""Reading item bytes from an object store straight into their destinations, verified.

The object-store counterpart of ``reader.read_spans`` (which ``reader`` hands URLs to): the same
``FileSpans`` (what a load wants from each data file), fetched with ranged GETs, ``concurrency``
of them in flight (``ObjectStoreOptions``):

- neighbouring small items (gaps of container framing up to ``reader.GAP_BYTES``) share one
  range, up to ``part_bytes``; each item's bytes are copied from the response into its target and
  hashed at once;
- a large item is fetched in ranges of ``part_bytes``, each copied into its place in the target
  as it arrives (in any order), and hashed once the last of its ranges has landed (xxh3 needs its
  bytes in order; the ranges arrive out of order).

Each response arrives as a ``bytes`` object (aiohttp reads into its own buffers), so every byte is
copied once on its way into the target; nothing else is staged.
"""
from __future__ import annotations

import posixpath
from typing import Callable

from asyncckpt.core.formats.checksum import checksum
from asyncckpt.core.errors import CorruptCheckpointError
from asyncckpt.core.storage.object_store import store_for
from asyncckpt.core.loading.reader import GAP_BYTES, FileSpans, Span, writable_bytes


def _mismatch(url: str, span: Span, found: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{url}: checksum mismatch for key '{span.key}' (bytes {span.offset}..{span.offset + span.nbytes}): "
        f"expected xxh3 {span.xxh3}, found {found}")


def read_object_spans(root: str, files: list[FileSpans]) -> None:
    """Read every span of every data file under ``root`` into its target, verifying checksums where
    given; a missing or short object or a mismatch raises ``CorruptCheckpointError``."""
    store = store_for(root)
    part = store.options.part_bytes
    ranges: list[tuple[str, int, int]] = []
    handlers: list[Callable[[bytes], None]] = []
    for entry in files:
        url = posixpath.join(root, entry.relative_path)
        try:
            size = store.size(url)
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
    store.read_ranges(ranges, lambda index, data: handlers[index](data))


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
