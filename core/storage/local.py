"""The local file system's storage primitives (``backend.Backend``): checkpoints as directories,
published by rename.

More: docs/MODULES.md, core/storage/local.py.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
import warnings
from typing import Callable, Iterator, Optional, Union

from asyncckpt.core.errors import CorruptCheckpointError
from asyncckpt.core.formats import names
from asyncckpt.core.formats.checksum import FileChecksum, parse_record, record_body
from asyncckpt.core.storage import diskio
from asyncckpt.core.storage.fsio import atomic_write_bytes, exchange_paths, fsync_dir, fsync_file
from asyncckpt.core.storage.listing import IncompleteUpload, Listed

_UNSUPPORTED = {errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.ENOSYS}
_warned_unsupported = False


def attach_checksum(temporary: str, checksum: FileChecksum) -> None:
    """Attach ``checksum`` to the written (not yet renamed) file ``temporary``, durably."""
    global _warned_unsupported
    try:
        os.setxattr(temporary, names.CHECKSUM_ATTRIBUTE, record_body(checksum).encode())
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


def rename_into_place(staging_dir: str, final_path: str) -> Optional[str]:
    """Rename the fully written, fsynced ``staging_dir`` to ``final_path``, replacing an older one;
    returns where the replaced checkpoint now is (a hidden name), to be deleted once the commit is
    reported (deleting a large tree is not part of making the new checkpoint durable).

    An existing checkpoint at ``final_path`` is swapped out atomically (renameat2 EXCHANGE), so
    there is no moment with neither checkpoint at the final name. Without renameat2 it is first
    renamed aside, never deleted before the new one is in place.
    """
    fsync_dir(staging_dir)
    parent = os.path.dirname(os.path.abspath(final_path))
    replaced = None
    if os.path.lexists(final_path):
        hidden = names.parse_hidden(os.path.basename(staging_dir))
        aside = names.hidden_path(final_path, "replaced", hidden.token, os.path.dirname(staging_dir))
        if not exchange_paths(staging_dir, final_path):
            os.rename(final_path, aside)
            os.rename(staging_dir, final_path)
        else:  # the staging name now holds the old checkpoint: give it the name that says so
            os.rename(staging_dir, aside)
        replaced = aside
    else:
        os.rename(staging_dir, final_path)
    fsync_dir(parent)
    return replaced


class LocalBackend:
    """``backend.Backend`` for local paths: the plain ``os`` calls, fsio and diskio."""

    remote = False
    marker_poll_s = 0.005

    # ---------------------------------------------------------------- what is there
    def stat(self, path: str) -> Listed:
        own = os.lstat(path)
        link = stat.S_ISLNK(own.st_mode)
        target = os.stat(path) if link else own  # FileNotFoundError for a dangling link, as os.stat
        is_dir = stat.S_ISDIR(target.st_mode)
        return Listed(os.path.basename(path), path, is_dir, 0 if is_dir else target.st_size, own.st_mtime, link)

    def names(self, path: str) -> list[str]:
        return os.listdir(path)

    def listing(self, path: str) -> list[Listed]:
        """A symlink as what it points to; a dangling one as an empty file."""
        found = []
        with os.scandir(path) as entries:
            for entry in entries:
                try:
                    own = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # removed meanwhile
                    continue
                link = entry.is_symlink()
                try:
                    target = entry.stat() if link else own
                except FileNotFoundError:  # a dangling link
                    target = None
                is_dir = target is not None and stat.S_ISDIR(target.st_mode)
                size = 0 if is_dir or target is None else target.st_size
                found.append(Listed(entry.name, entry.path, is_dir, size, own.st_mtime, link))
        return found

    # ---------------------------------------------------------------- reading
    def read_ranges(self, ranges: list[tuple[str, int, Optional[int]]],
                    consume: Callable[[int, Optional[bytes]], None]) -> None:
        for index, (path, start, end) in enumerate(ranges):
            try:
                with open(path, "rb") as f:
                    if end is None:
                        data = f.read()
                    else:
                        f.seek(start)
                        data = f.read(end - start)
            except (FileNotFoundError, NotADirectoryError):
                consume(index, None)
                continue
            if end is not None and len(data) != end - start:
                raise CorruptCheckpointError(f"{path}: file is truncated (wanted bytes {start}..{end}, got {len(data)})")
            consume(index, data)

    def read_pieces(self, path: str, piece_bytes: int) -> Iterator[memoryview]:
        buffer = bytearray(piece_bytes)  # reused: each piece is hashed while still in the core's cache
        view = memoryview(buffer)
        with open(path, "rb", buffering=0) as f:
            while True:
                read = f.readinto(buffer)
                if not read:
                    return
                yield view[:read]

    def download(self, path: str, local_path: str) -> None:
        shutil.copyfile(path, local_path)
        fsync_file(local_path)

    def read_checksum_record(self, path: str) -> Optional[FileChecksum]:
        """Following a symlink to the file it names; None where none is attached (written without
        asyncckpt, or copied without extended attributes)."""
        try:
            body = os.getxattr(path, names.CHECKSUM_ATTRIBUTE)
        except OSError as e:
            if e.errno in _UNSUPPORTED or e.errno in (errno.ENODATA, errno.ENOENT):
                return None
            raise
        return parse_record(body)

    # ---------------------------------------------------------------- writing
    def write(self, path: str, data: Union[bytes, memoryview], size: Optional[int] = None, *, atomic: bool = False,
              wait_ready: Optional[Callable[[float], float]] = None, direct_io: bool = True, io_threads: int = 2) -> None:
        if isinstance(data, memoryview):  # a snapshot buffer's image: O_DIRECT, parallel writes
            diskio.write_image(path, data, len(data) if size is None else size, direct=direct_io, threads=io_threads,
                               wait_ready=wait_ready)
        elif atomic:
            atomic_write_bytes(path, data)
        else:
            diskio.write_small_file(path, data)

    def write_marker(self, path: str, data: bytes, *, exclusive: bool = False, append: bool = False) -> None:
        """A marker appears whole (written under a hidden name, then linked or renamed into place: a reader
        that lists it reads all of it); ``append`` adds one line in one write."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if append:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, data)  # one write: two writers appending never interleave a line
            finally:
                os.close(fd)
            return
        temporary = names.hidden_path(path, "tmp", uuid.uuid4().hex[:12])
        with open(temporary, "wb") as f:
            f.write(data)
        try:
            if exclusive:
                os.link(temporary, path)  # fails where the marker exists: the first one stays
            else:
                os.replace(temporary, path)
        except FileExistsError:
            pass
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)

    def write_file(self, path: str, image: memoryview, size: int, token: str, *,
                   checksum: Optional[Callable[[], Optional[FileChecksum]]], direct_io: bool = True,
                   io_threads: int = 2, wait_ready: Optional[Callable[[float], float]] = None) -> None:
        """Hidden temporary name, fsync (with the checksum attribute), rename, fsync the directory."""
        directory = os.path.dirname(os.path.abspath(path))
        temporary = names.hidden_path(path, "tmp", token)
        try:
            os.makedirs(directory, exist_ok=True)
            diskio.write_image(temporary, image, size, direct=direct_io, threads=io_threads, wait_ready=wait_ready)
            found = checksum() if checksum is not None else None
            if found is not None:
                attach_checksum(temporary, found)
            os.replace(temporary, path)
            fsync_dir(directory)
        except BaseException:
            if os.path.lexists(temporary):
                os.unlink(temporary)
            raise

    def share_file(self, source: str, path: str) -> bool:
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            os.link(source, path)
        except OSError:
            return False
        return True

    def publish(self, staging_dir: str, final_path: str, record: bytes) -> Optional[str]:
        """The entries of files written into subdirectories made durable, the commit record written
        into the staging directory, which is renamed into place (``rename_into_place``)."""
        for directory, _subdirectories, _files in os.walk(staging_dir):
            if directory != staging_dir:
                fsync_dir(directory)
        atomic_write_bytes(os.path.join(staging_dir, names.COMMIT_RECORD), record)
        return rename_into_place(staging_dir, final_path)

    # ---------------------------------------------------------------- removing
    def delete(self, paths: list[str], *, durable: bool = True) -> None:
        touched = set()
        for path in paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            touched.add(os.path.dirname(path))
        if durable:
            for directory in touched:
                fsync_dir(directory)

    def remove_tree(self, path: str, token: str, *, later: Callable[[Callable[[], None]], None],
                    hidden_parent: Optional[str] = None) -> None:
        """Renamed to a hidden ``removing`` name owned by ``token`` (unless it has one: a leftover
        being deleted again), so that two cleaners never delete into each other; then deleted."""
        hidden = names.parse_hidden(os.path.basename(path))
        aside = path
        if hidden is None or hidden.kind != "removing":
            aside = names.hidden_path(path, "removing", token, hidden_parent)
            try:
                os.rename(path, aside)
            except FileNotFoundError:  # another cleaner took it
                return
            for directory in {os.path.dirname(os.path.abspath(path)), os.path.dirname(aside)}:
                fsync_dir(directory)
        later(lambda: shutil.rmtree(aside, ignore_errors=True))

    def uploads(self, path: str) -> list[IncompleteUpload]:
        return []  # a write in flight is a file under a hidden name, which a listing shows

    def abort_uploads(self, path: str) -> None:
        pass
