"""Checksums of the native files the core writes, and checking a file against its checksum.

Every file the background writer writes (a Lightning ``.ckpt``, every file of an Accelerate or
Trainer checkpoint directory, a sharded checkpoint's extra files) gets an xxh3-64 of its bytes,
hashed by the writer from the staging buffer it writes from (no extra pass over the training
process's memory). Where it is recorded (docs/FORMAT.md §4):

* a file of a checkpoint directory: in the directory's commit record, ``"checksums"``;
* a single file: in an extended attribute of the file itself (``user.asyncckpt.checksum``), set
  on the temporary file before it is renamed into place. The checksum is then published with the
  file by the same rename, disappears with it, and adds no entry to any directory listing (a
  framework's tests compare listings; a record file beside each ``.ckpt`` would break them). A copy
  that drops extended attributes (``cp`` without ``-a``) leaves the file unverified, not damaged.
  On a file system without user extended attributes single files are saved without a checksum,
  with a warning once per process.

Checking reads the file in pieces into a reused buffer and hashes each piece while it is still in
the core's cache, so verifying costs about one read of the file.

Kept free of torch: the background writer imports it.
"""
from __future__ import annotations

import errno
import json
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

from asyncckpt.core.storage import locations
from asyncckpt.core.formats.checksum import checksum_stream

ATTRIBUTE = "user.asyncckpt.checksum"
RECORD_FORMAT = "asyncckpt-file"
RECORD_VERSION = 1
PIECE_BYTES = 1 << 20
_UNSUPPORTED = {errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.ENOSYS}
_warned_unsupported = False


@dataclass(frozen=True)
class FileChecksum:
    size: int
    xxh3: str


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


def write_record(temporary: str, checksum: FileChecksum) -> None:
    """Attach ``checksum`` to the written (not yet renamed) file ``temporary``, durably."""
    global _warned_unsupported
    try:
        os.setxattr(temporary, ATTRIBUTE, record_body(checksum).encode())
    except OSError as e:
        if e.errno not in _UNSUPPORTED:
            raise
        if not _warned_unsupported:
            _warned_unsupported = True
            warnings.warn(f"asyncckpt: the file system of {os.path.dirname(temporary)} does not support extended "
                          f"attributes ({e.strerror}); single-file checkpoints saved there carry no checksum and "
                          "load unverified", RuntimeWarning, stacklevel=2)
        return
    fd = os.open(temporary, os.O_RDONLY)
    try:
        os.fsync(fd)  # the attribute is inode metadata: durable before the rename publishes it
    finally:
        os.close(fd)


def read_record(path: str) -> Optional[FileChecksum]:
    """The checksum attached to the file at ``path`` (following a symlink to the file it names), or
    None: none attached (written without asyncckpt, or copied without extended attributes)."""
    if locations.is_url(path):
        from asyncckpt.core.storage.object_checkpoints import read_file_checksum

        return read_file_checksum(path)
    try:
        body = os.getxattr(path, ATTRIBUTE)
    except OSError as e:
        if e.errno in _UNSUPPORTED or e.errno in (errno.ENODATA, errno.ENOENT):
            return None
        raise
    return parse_record(body)


def problem(path: str, expected: FileChecksum, progress: Optional[Callable[[int], None]] = None) -> Optional[str]:
    """What is wrong with the file at ``path`` against ``expected``, or None if it matches."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return f"missing (recorded with {expected.size} B)"
    if size != expected.size:
        return f"{'truncated' if size < expected.size else 'grown'}: {size} B on disk, {expected.size} B when written"
    digest = checksum_stream()
    buffer = bytearray(PIECE_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            read = f.readinto(buffer)
            if not read:
                break
            digest.update(view[:read])
            if progress is not None:
                progress(read)
    if digest.hexdigest() != expected.xxh3:
        return f"checksum mismatch: expected xxh3 {expected.xxh3}, found {digest.hexdigest()}"
    return None
