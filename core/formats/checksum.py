"""Per-item checksums (xxh3-64: several times faster than CRC32, so verification is cheap; docs/DESIGN.md,
Measured), and the
checksum record of a native file (its size and xxh3, as a small JSON document).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

import xxhash

RECORD_FORMAT = "asyncckpt-file"
RECORD_VERSION = 1


PIECE_BYTES = 512 << 10  # what is hashed at once, in pieces: half of a core's L2 here, still cached the second time

# checksum(data) -> str: hex xxh3-64 of a bytes-like object (no copy for memoryviews / numpy
# arrays). xxhash's own function, not a wrapper: a load calls it once per item.
checksum = xxhash.xxh3_64_hexdigest


# content_id(data) -> str: hex xxh3-128, what a save compares to tell an item unchanged since the previous checkpoint
# (``storage.sharing``). The xxh3-64 above checks integrity, where a collision costs a missed detection of damage
# that is already unlikely; an unchanged item is decided by equality alone, across every item of every save of
# every job: 2^-64 per comparison is too close for that, 2^-128 is not. Hashed from the same pieces while they are
# in the core's cache (docs/DESIGN.md, Measured).
content_id = xxhash.xxh3_128_hexdigest


def content_id_stream():
    """An incremental xxh3-128: the same value as ``content_id`` of the pieces joined."""
    return xxhash.xxh3_128()


def checksum_stream():
    """An incremental xxh3-64 (``update(piece)`` …, then ``hexdigest()``): the same value as
    ``checksum`` of all the pieces joined, for items hashed piece by piece as they are read."""
    return xxhash.xxh3_64()


# ------------------------------------------------------------------ the checksum record of a file
@dataclass(frozen=True)
class FileChecksum:
    """A native file's size and xxh3-64, as recorded when it was written (``storage.file_checksums``), and where
    recorded its content id (xxh3-128: ``content_id``), which a later save compares (``storage.sharing``)."""

    size: int
    xxh3: str
    content_id: Optional[str] = field(default=None, compare=False)


def record_body(checksum: FileChecksum) -> str:
    """The checksum record as stored (an extended attribute; an object's user metadata)."""
    return json.dumps({"format": RECORD_FORMAT, "version": RECORD_VERSION, "size": checksum.size, "xxh3": checksum.xxh3})


def parse_record(body: bytes) -> Optional[FileChecksum]:
    """A stored checksum record, or None if it is not one."""
    try:
        record = json.loads(body)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT or not isinstance(record.get("size"), int):
        return None
    return FileChecksum(record["size"], str(record.get("xxh3")))
