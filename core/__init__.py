"""asyncckpt.core: asynchronous, sharded, crash-safe checkpoints on torch.distributed.checkpoint.

SPMD API (every rank calls with its own state dict)::

    from asyncckpt import core
    core.save(state_dict, "ckpt/step_100")          # blocking, committed on return
    handle = core.async_save(state_dict, "ckpt/step_200")   # returns after the snapshot
    core.load(state_dict, core.latest_checkpoint("ckpt"))   # in place, resharding as needed

The module-level functions share one default ``Checkpointer`` (buffers, writer, plan cache).

What users may use is ``__all__`` below; what adapters may use besides is ``asyncckpt.core.integration``.
Every other sub-package (``api``, ``snapshot``, ``client``, ``writer``, ``tier``, ``export``, ``storage``, ``formats``,
``loading``, ``verify``, ``cli``) is private: its modules may change in any release (docs/DESIGN.md draws them).
"""
from __future__ import annotations

import importlib
import os
import threading
from typing import TYPE_CHECKING, Any, Optional

from asyncckpt.core.storage.commit import is_complete
from asyncckpt.core.tier import latest_checkpoint
from asyncckpt.core.errors import (
    CheckpointCancelledError,
    CheckpointError,
    CheckpointTimeoutError,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateDictMismatchError,
    UnsafeMetadataError,
    UnsupportedVersionError,
)

if TYPE_CHECKING:
    from asyncckpt.core.api.checkpointer import Checkpointer, SaveHandle
    from asyncckpt.core.api.options import CheckpointOptions, MemoryTier
    from asyncckpt.core.export.options import ExportOptions
    from asyncckpt.core.storage.object_store import ObjectStoreOptions
    from asyncckpt.core.api.dcp_writer import AsyncCkptStorageWriter
    from asyncckpt.core.loading.dcp_reader import AsyncCkptStorageReader
    from asyncckpt.core.api.manager import CheckpointManager
    from asyncckpt.core.snapshot.planner import AsyncCkptLoadPlanner, AsyncCkptSavePlanner

# Imported on first use: the background writer runs as ``python -m asyncckpt.core.writer.process``, which
# executes this file, and must load neither torch nor anything outside its own packages for it
# (tests/project/test_layout.py lists what it loads).
_LAZY = {
    "Checkpointer": "api.checkpointer", "CheckpointOptions": "api.options", "MemoryTier": "api.options", "SaveHandle": "client.handles",
    "CheckpointManager": "api.manager", "ExportOptions": "export.options", "ObjectStoreOptions": "storage.object_store",
    "AsyncCkptStorageReader": "loading.dcp_reader", "AsyncCkptStorageWriter": "api.dcp_writer",
    "AsyncCkptLoadPlanner": "snapshot.planner", "AsyncCkptSavePlanner": "snapshot.planner",
}

__all__ = [
    "save", "async_save", "load", "latest_checkpoint", "is_complete", "wait", "default_checkpointer",
    "configure_object_store", "Checkpointer", "CheckpointOptions", "MemoryTier", "SaveHandle", "CheckpointManager",
    "ExportOptions", "ObjectStoreOptions",
    "AsyncCkptStorageWriter", "AsyncCkptStorageReader", "AsyncCkptSavePlanner", "AsyncCkptLoadPlanner",
    "CheckpointError", "CheckpointCancelledError", "CheckpointTimeoutError", "CheckpointWriteError",
    "CorruptCheckpointError", "IncompleteCheckpointError", "StateDictMismatchError", "UnsafeMetadataError",
    "UnsupportedVersionError",
]

_default: Optional[Checkpointer] = None
_default_lock = threading.Lock()


def default_checkpointer() -> Checkpointer:
    """The process-wide Checkpointer behind the module-level functions."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            from asyncckpt.core.api.checkpointer import Checkpointer

            _default = Checkpointer()
        return _default


def save(state_dict: dict, path: str | os.PathLike, *, process_group=None, use_collectives: bool = True, **options: Any) -> None:
    """Save ``state_dict`` (SPMD) and return once the checkpoint is committed on every rank."""
    default_checkpointer().save(state_dict, path, process_group=process_group, use_collectives=use_collectives, **options)


def async_save(state_dict: dict, path: str | os.PathLike, *, process_group=None, use_collectives: bool = True,
               **options: Any) -> SaveHandle:
    """Snapshot ``state_dict`` and return a handle; the write and commit happen in the background."""
    return default_checkpointer().async_save(state_dict, path, process_group=process_group,
                                             use_collectives=use_collectives, **options)


def load(state_dict: dict, path: str | os.PathLike, *, process_group=None, strict: bool = True, **options: Any) -> None:
    """Load a committed checkpoint into ``state_dict`` in place (SPMD), resharding as needed."""
    default_checkpointer().load(state_dict, path, process_group=process_group, strict=strict, **options)


def configure_object_store(options: Optional[ObjectStoreOptions], prefix: str = "") -> None:
    """Reach object-store URLs starting with ``prefix`` (all by default) with ``options`` in this process, where no
    ``Checkpointer`` gives its own (``latest_checkpoint``, the module-level functions); None forgets them."""
    from asyncckpt.core.storage import object_store

    object_store.configure(options, prefix)


def wait(timeout: Optional[float] = None) -> None:
    """Wait for every save of the default checkpointer; raise the first failure."""
    default_checkpointer().wait(timeout)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
