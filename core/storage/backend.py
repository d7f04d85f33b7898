"""The storage seam: one protocol for every place a checkpoint can live, and ``backend_for``, the
one place that tells an object-store URL from a local path.

Everything above ``storage`` (the writer's requests, loads, checks, the CLI) does its I/O through
a ``Backend`` and never asks which one it has; what differs between a file system and an object
store is said once, here and in the two implementations:

=========================  ========================================  ===========================================
operation                  ``local.LocalBackend``                    ``object_backend.ObjectBackend``
=========================  ========================================  ===========================================
a save's files             hidden staging directory (``Destination``) the checkpoint's own prefix
atomic publish             rename of the staging directory           the commit object, created last (create-only)
commit records             read from each directory                  one delimited listing, bodies fetched together
a single file              temporary name, rename                    one object (an upload is atomic)
its checksum record        an extended attribute                     the object's user metadata
removal                    rename to a hidden name, delete later     marker, commit object first, then the rest
leftovers                  hidden names, owner tokens                uncommitted prefixes, markers, uploads
=========================  ========================================  ===========================================

The commit record is encoded and parsed in one place (``formats.commit_record``) whatever the
store; a backend only moves its bytes.

A backend is cheap to build and to pickle (the object store's holds its options; the store
client itself is cached per process), so requests carry a path and options, and each side calls
``backend_for``.

Kept free of torch: the background writer imports it.
"""
from __future__ import annotations

import os
from typing import Callable, ContextManager, Iterator, Optional, Protocol

from asyncckpt.core.formats.checksum import FileChecksum
from asyncckpt.core.storage.leftovers import Leftover
from asyncckpt.core.storage.listing import Listed
from asyncckpt.core.storage.local import LocalBackend
from asyncckpt.core.storage.object_backend import ObjectBackend
from asyncckpt.core.storage.object_store import ObjectStoreOptions

WaitReady = Optional[Callable[[float], float]]


class Destination(Protocol):
    """Where the files of one sharded save go, and how the save becomes visible."""

    directory: str  # where its files are written (read back at the commit)

    def claim(self, rank: int, token: str) -> None:
        """This rank's writer uses it now (an owner marker: no cleaner takes it for a leftover)."""

    def tidy_parent(self) -> Optional[str]:
        """The local directory whose dead writers' leftovers go after the reply (None: left to ``clean``)."""

    def write_image(self, name: str, image: memoryview, size: int, wait_ready: WaitReady) -> None:
        """Durably write ``image[:size]`` as ``name`` (see ``diskio.write_image``)."""

    def write_small(self, name: str, data: bytes) -> None:
        """Durably write small bytes as ``name``."""

    def write_atomic(self, name: str, data: bytes) -> None:
        """Durably write ``name`` so that readers see all of it or nothing."""

    def publish(self, record: dict) -> Optional[str]:
        """Coordinator: make the checkpoint visible with its commit record (listing its files and
        sizes); returns what an overwrite replaced, to ``delete`` once the commit is reported."""

    def delete(self, replaced: str, token: str) -> None: ...


class Backend(Protocol):
    """What the core needs from a place checkpoints live (see the module docstring)."""

    remote: bool  # an object store: no shared directory for the ranks to meet in, nothing to rename

    # ---------------------------------------------------------------- names
    def normalize(self, path: str) -> str:
        """The form the core keeps a path in (absolute; a URL without a trailing slash)."""

    def join(self, base: str, *parts: str) -> str: ...

    def basename(self, path: str) -> str: ...

    # ---------------------------------------------------------------- reading
    def read_bytes(self, path: str) -> bytes:
        """The whole content of a small file or object; FileNotFoundError if there is none."""

    def size_of(self, path: str) -> int:
        """Its size in bytes; FileNotFoundError if absent."""

    def exists(self, path: str) -> bool: ...

    def is_file(self, path: str) -> bool:
        """A single file (object), rather than a checkpoint directory (prefix) or nothing."""

    def list_names(self, path: str) -> list[str]:
        """The names directly under ``path``; FileNotFoundError if there is nothing there."""

    def listing(self, path: str) -> list[Listed]:
        """What ``list_names`` names, with what one listing tells of each (kind, size, time)."""

    def read_pieces(self, path: str, piece_bytes: int) -> Iterator[memoryview]:
        """The content of ``path`` in order, in pieces (each valid until the next is asked for)."""

    # Remote backends only (``remote``): a local file is read in place, by file descriptor, into
    # its targets (``loading.reader``); a remote one by ranged requests, whose bytes arrive in the
    # client's buffers.
    def read_ranges(self, ranges: list[tuple[str, int, int]], consume: Callable[[int, bytes], None]) -> None:
        """Fetch every ``(path, start, end)`` range and hand each to ``consume(index, data)`` as it
        arrives (any order, one at a time); a short range raises ``CorruptCheckpointError``."""

    def range_bytes(self, path: str) -> int:
        """How large one ranged request under ``path`` should be at most (a part of a large item)."""

    def commit_bodies_under(self, root: str) -> list[tuple[str, Optional[bytes]]]:
        """``(path, commit record bytes or None)`` of every non-hidden name directly under ``root``
        (nothing if ``root`` does not exist); parsed by ``formats.commit_record``."""

    def used_bytes(self, path: str) -> int:
        """The bytes stored under ``path`` (a file, or everything below a directory or prefix)."""

    def local_copy(self, path: str, names: list[str]) -> ContextManager[str]:
        """A local directory holding ``names`` of the checkpoint at ``path`` (those that exist):
        the checkpoint itself where it is local, else a temporary copy."""

    # ---------------------------------------------------------------- writing
    def destination(self, final_path: str, staging_dir: str, *, coordinator: bool, direct_io: bool = True,
                    io_threads: int = 2) -> Destination: ...

    def tidy_parent(self, path: str) -> Optional[str]:
        """The local directory beside ``path`` whose dead writers' leftovers a writer removes after
        its reply (None: leftovers there are left to ``asyncckpt clean``: listing a bucket per save
        is not free)."""

    def staging_dir_for(self, final_path: str, save_id: str) -> str:
        """Where a sharded save of ``final_path`` writes its files until it is published."""

    def write_file(self, path: str, image: memoryview, size: int, token: str, *,
                   checksum: Optional[Callable[[], Optional[FileChecksum]]], direct_io: bool = True,
                   io_threads: int = 2) -> None:
        """Durably publish ``image[:size]`` as the single file ``path``, whole or not at all, with
        the checksum record ``checksum()`` gives attached (``checksum`` None: none attached)."""

    def read_checksum_record(self, path: str) -> Optional[FileChecksum]:
        """The checksum record attached to the single file ``path``, or None."""

    def download(self, path: str, local_path: str) -> None:
        """Copy the file or object ``path`` into the local file ``local_path``, durably."""

    # ---------------------------------------------------------------- where ranks meet (``writer.barrier``)
    marker_poll_s: float  # the longest a barrier waits between two looks at its markers (a listing or a read)

    def barrier_place(self, staging_dir: str, key: str) -> str:
        """Where the ranks of the save ``key`` leave their markers: its staging directory, or a hidden
        place of the save's own under it where saves share one (an object store writes in place)."""

    def write_marker(self, path: str, data: bytes, *, exclusive: bool = False) -> None:
        """Leave a small coordination file (not fsynced: it says what happened, the data was made
        durable before); ``exclusive``: only if there is none yet (the first one stays)."""

    def delete_markers(self, paths: list[str]) -> None:
        """Remove coordination files (absent ones are fine)."""

    # ---------------------------------------------------------------- removing
    def uncommit(self, path: str) -> None:
        """Durably remove the commit record, so ``path`` no longer counts as complete."""

    def remove(self, paths: list[str], token: str, after_reply: Callable[[Callable[[], None]], None],
               hidden_parent: Optional[str] = None) -> None:
        """Remove checkpoints and files so that none is ever seen half-removed (the commit record
        goes first); what is slow to delete may be left to ``after_reply``."""

    def find_leftovers(self, root: str) -> list[Leftover]:
        """What crashed or killed writers left directly under ``root``, judged by owner (locally,
        NotADirectoryError if ``root`` is no directory)."""

    def delete_leftover(self, leftover: Leftover) -> None: ...

    def forget_cached(self, path: str) -> None:
        """What this process cached about ``path`` is out of date (another process changed it)."""


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` names an object-store location (``scheme://...``) rather than a local path."""
    return "://" in os.fspath(path)


_LOCAL = LocalBackend()


def backend_for(location: str | os.PathLike, options: Optional[ObjectStoreOptions] = None) -> Backend:
    """The backend serving ``location``: an object store for a URL (``s3://bucket/...``, any
    ``scheme://``; reached with ``options``, default ``object_store.options_for``), else the local
    file system."""
    return ObjectBackend(options) if is_url(location) else _LOCAL
