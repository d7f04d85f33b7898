"""Exceptions raised by asyncckpt.

Every error names what a user needs to act on: the checkpoint path, the key, the rank.
"""
from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class of every asyncckpt error."""


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
