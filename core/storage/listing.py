"""``Listed``: one name directly under a directory or an object-store prefix, as both backends
list it (``Backend.listing``), so that what lists checkpoints (``verify.checkpoint_kinds``, the
CLI) reads one shape whatever the store."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Listed:
    name: str
    path: str  # the full path or URL
    is_dir: bool  # a directory (symlinks followed), or a prefix
    size: int  # bytes of a file; 0 for a directory
    modified: float  # seconds since the epoch (0 for a prefix: it has no time of its own)
