"""The storage seam: the primitives every place a checkpoint can live provides, and
``backend_for``, the one place that tells an object-store URL from a local path.

More: docs/MODULES.md, core/storage/backend.py.
"""
from __future__ import annotations

import os
import posixpath
from typing import Callable, Iterator, Optional, Protocol, Union

from asyncckpt.core.formats.checksum import FileChecksum
from asyncckpt.core.storage.listing import IncompleteUpload, Listed
from asyncckpt.core.storage.local import LocalBackend
from asyncckpt.core.storage.object_backend import ObjectBackend
from asyncckpt.core.storage.object_store import ObjectStoreOptions

WaitReady = Optional[Callable[[float], float]]
Later = Callable[[Callable[[], None]], None]  # runs an action now, or once the writer has replied


def at_once(action: Callable[[], None]) -> None:
    """``Later`` for work nobody replies to first: run it now."""
    action()


class Backend(Protocol):
    """The primitives of a place checkpoints live (see the module docstring)."""

    remote: bool  # an object store: written in place (no rename), no shared directory, every request billed
    marker_poll_s: float  # the longest a barrier waits between two looks at its markers (a listing or a read)

    # ---------------------------------------------------------------- what is there
    def stat(self, path: str) -> Listed:
        """What ``path`` is (kind, size, time); FileNotFoundError if there is nothing."""

    def names(self, path: str) -> list[str]:
        """The names directly under ``path``, and nothing else of them (what a barrier polls);
        FileNotFoundError if there is nothing there."""

    def listing(self, path: str) -> list[Listed]:
        """The names directly under ``path`` with what a listing tells of each (kind, size, time);
        FileNotFoundError if there is nothing there."""

    # ---------------------------------------------------------------- reading
    def read_ranges(self, ranges: list[tuple[str, int, Optional[int]]],
                    consume: Callable[[int, Optional[bytes]], None]) -> None:
        """Read every ``(path, start, end)`` (``end`` None: the whole file, ``start`` 0) and hand
        each to ``consume(index, data)`` as it arrives (any order, one at a time), ``data`` None
        where there is no such file; a short range raises ``CorruptCheckpointError``."""

    def read_pieces(self, path: str, piece_bytes: int) -> Iterator[memoryview]:
        """The content of ``path`` in order, in pieces (each valid until the next is asked for)."""

    def download(self, path: str, local_path: str) -> None:
        """Copy the file or object ``path`` into the local file ``local_path``, durably."""

    def read_checksum_record(self, path: str) -> Optional[FileChecksum]:
        """The checksum record attached to the single file ``path`` (``write_file``), or None."""

    # ---------------------------------------------------------------- writing
    def write(self, path: str, data: Union[bytes, memoryview], size: Optional[int] = None, *, atomic: bool = False,
              wait_ready: WaitReady = None, direct_io: bool = True, io_threads: int = 2) -> None:
        """Durably write ``data`` (bytes) or ``data[:size]`` (a snapshot buffer's image, page-aligned;
        with ``wait_ready`` still being copied: see ``diskio.write_image``) as ``path``, whose
        directory exists. Written in place: what makes a save's files visible whole is its publish;
        ``atomic`` (bytes): readers of ``path`` see all of it or nothing even before that."""

    def write_marker(self, path: str, data: bytes, *, exclusive: bool = False, append: bool = False) -> None:
        """Leave a small coordination file, creating its directory (not fsynced: it says what
        happened, the data was made durable before); ``exclusive``: only if there is none yet (the
        first one stays); ``append``: added to what is there, where the store can append."""

    def write_file(self, path: str, image: memoryview, size: int, token: str, *,
                   checksum: Optional[Callable[[], Optional[FileChecksum]]], direct_io: bool = True,
                   io_threads: int = 2, wait_ready: WaitReady = None) -> None:
        """Durably publish ``image[:size]`` as the single file ``path``, whole or not at all, with
        the checksum record ``checksum()`` gives attached (``checksum`` None: none attached); with
        ``wait_ready``, each part once it says so (``diskio.write_image``; what it raises ends the
        write, and nothing is published)."""

    def share_file(self, source: str, path: str) -> bool:
        """Make ``path`` hold the bytes of the file ``source`` without moving them: a hard link (a
        file system), a copy the server makes (an object store; none of the bytes pass through
        this process). False where it cannot (another file system, the source gone)."""

    def publish(self, staging_dir: str, final_path: str, record: bytes) -> Optional[str]:
        """Make the checkpoint written in ``staging_dir`` visible under ``final_path`` at once, with
        the commit record ``record``; returns where a checkpoint it replaced now is (to
        ``remove_tree`` once the commit is reported). FileExistsError: another save committed
        ``final_path`` meanwhile."""

    # ---------------------------------------------------------------- removing
    def delete(self, paths: list[str], *, durable: bool = True) -> None:
        """Delete these files (absent ones are fine); ``durable``: the deletion survives a crash."""

    def remove_tree(self, path: str, token: str, *, later: Later, hidden_parent: Optional[str] = None) -> None:
        """Remove the directory or prefix ``path`` so that it is never seen half-removed: out of
        every listing at once (its commit record first, or with it); what is slow to delete may be
        left to ``later`` (``at_once``, or once the writer replied). ``hidden_parent``: where a
        file system moves it meanwhile (a directory whose every entry a framework counts)."""

    def uploads(self, path: str) -> list[IncompleteUpload]:
        """Writes begun under ``path``/ that no listing shows and nobody finished."""

    def abort_uploads(self, path: str) -> None:
        """Abort those of ``path`` itself and under it."""


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` names an object-store location (``scheme://...``) rather than a local path:
    the one place the core tells them apart."""
    return "://" in os.fspath(path)


_LOCAL = LocalBackend()


def backend_for(location: str | os.PathLike, options: Optional[ObjectStoreOptions] = None) -> Backend:
    """The backend serving ``location``: an object store for a URL (``s3://bucket/...``, any
    ``scheme://``; reached with ``options``, default ``object_store.options_for``), else the local
    file system."""
    return ObjectBackend(options) if is_url(location) else _LOCAL


# ------------------------------------------------------------------------------ names, the same for both
def normalize(path: str | os.PathLike) -> str:
    """The form the core keeps a path in: absolute; a URL without a trailing slash."""
    path = os.fspath(path)
    return path.rstrip("/") if is_url(path) else os.path.abspath(path)


def join(base: str, *parts: str) -> str:
    return posixpath.join(base, *parts)


def basename(path: str) -> str:
    return posixpath.basename(posixpath.normpath(path))


# ------------------------------------------------------------------------------ reads built of ``read_ranges``
def read_all(backend: Backend, paths: list[str]) -> list[Optional[bytes]]:
    """The whole content of each of ``paths`` (None where absent), read side by side where the store allows."""
    found: list[Optional[bytes]] = [None] * len(paths)

    def keep(index: int, data: Optional[bytes]) -> None:
        found[index] = data

    if paths:
        backend.read_ranges([(path, 0, None) for path in paths], keep)
    return found


def read_bytes(backend: Backend, path: str) -> bytes:
    """The whole content of a small file or object; FileNotFoundError if there is none."""
    body = read_all(backend, [path])[0]
    if body is None:
        raise FileNotFoundError(path)
    return body


def exists(backend: Backend, path: str) -> bool:
    try:
        backend.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return True


def is_file(backend: Backend, path: str) -> bool:
    """A single file (object), rather than a checkpoint directory (prefix) or nothing."""
    try:
        return not backend.stat(path).is_dir
    except (FileNotFoundError, NotADirectoryError):
        return False
