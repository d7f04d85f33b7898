"""What the storage primitives say of a name, the same for a file system and an object store:
``Listed`` (one name directly under a directory or prefix, as ``Backend.listing`` and
``Backend.stat`` describe it) and ``IncompleteUpload`` (a write an object store began and nobody
finished, ``Backend.uploads``). Everything that lists checkpoints or leftovers reads these shapes
whatever the store.

Kept free of torch: the background writer imports it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Listed:
    name: str
    path: str  # the full path or URL
    is_dir: bool  # a directory (symlinks followed), or a prefix
    size: int  # bytes of a file (a symlink's target); 0 for a directory
    modified: float  # seconds since the epoch (0 for a prefix: it has no time of its own)
    link: bool = False  # a symbolic link (only a file system has them)


@dataclass(frozen=True)
class IncompleteUpload:
    """A multipart upload begun and neither completed nor aborted: its parts are stored, and billed,
    but no listing shows them."""

    url: str
    upload_id: str
    initiated: float  # seconds since the epoch
