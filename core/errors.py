"""Exceptions raised by asyncckpt.

Every error names what a user needs to act on: the checkpoint path, the key, the rank.
"""
from __future__ import annotations

from typing import Optional


class CheckpointError(RuntimeError):
    """Base class of every asyncckpt error. Errors about one checkpoint say which: ``path`` (the
    name the user asked for, never a hidden staging name), ``step`` and ``rank`` where known."""

    def __init__(self, message: str, *, path: Optional[str] = None, step: Optional[int] = None,
                 rank: Optional[int] = None) -> None:
        super().__init__(message)
        self.path, self.step, self.rank = path, step, rank


class IncompleteCheckpointError(CheckpointError):
    """The checkpoint directory exists but was never committed (crash or save in progress)."""


class CorruptCheckpointError(CheckpointError):
    """A data file is missing, truncated, or its bytes do not match the recorded checksum."""


class StateDictMismatchError(CheckpointError):
    """The state dict to load into does not match the checkpoint (missing keys, shape or dtype)."""


class UnsafeMetadataError(CheckpointError):
    """Checkpoint metadata tried to load something other than DCP metadata classes, or escape its directory."""


class CheckpointWriteError(CheckpointError):
    """A save failed on some rank; raised on every rank at the next sync point."""


class CheckpointTimeoutError(CheckpointError):
    """A wait on another rank or on the background writer exceeded its time limit."""


class CheckpointCancelledError(CheckpointError):
    """A removal, link or retention queued behind a save that did not commit: not run (the save's
    own error says so)."""


class UnsupportedVersionError(CheckpointError):
    """An adapter was asked to work with a framework version it does not support."""


class SnapshotCopyFailed(CheckpointWriteError):
    """The writer found that the snapshot copy it was streaming failed in the training process,
    which reports the copy's own error through the save's handle."""
