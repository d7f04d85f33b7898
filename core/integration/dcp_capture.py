"""A framework's own ``torch.distributed.checkpoint.save`` calls, made asynchronous inside a directory checkpoint.

More: docs/MODULES.md, core/integration/dcp_capture.py.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, Optional

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter, SerializationFormat

import asyncckpt.core.integration.patching as patching
from asyncckpt.core.api.directory import DirectoryTransaction


def _reproducible(storage_writer: Any, planner: Any, no_dist: bool, use_collectives: bool) -> bool:
    """Whether the call's files are what our own planner and writer produce."""
    plain_planner = planner is None or (type(planner) is DefaultSavePlanner and planner.flatten_state_dict
                                        and planner.flatten_sharded_tensors)
    plain_writer = storage_writer is None or (
        type(storage_writer) is FileSystemWriter
        and getattr(storage_writer, "serialization_format", SerializationFormat.TORCH_SAVE) == SerializationFormat.TORCH_SAVE
        and not getattr(getattr(storage_writer, "transforms", None), "extensions", None))
    return plain_planner and plain_writer and not no_dist and use_collectives


def _target(checkpoint_id: Any, storage_writer: Any) -> Optional[str]:
    if storage_writer is not None:
        path = getattr(storage_writer, "path", None)
    else:
        path = checkpoint_id
    return os.path.realpath(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else None


def _saving_into(tx: DirectoryTransaction, root: str) -> Callable[[Callable], Callable]:
    root = os.path.realpath(root)

    def wrap(original: Callable) -> Callable:
        def save(state_dict: dict, *, checkpoint_id: Any = None, storage_writer: Any = None, planner: Any = None,
                 process_group: Any = None, no_dist: bool = False, use_collectives: bool = True) -> Any:
            target = _target(checkpoint_id, storage_writer)
            inside = target is not None and target.startswith(root + os.sep)
            if not inside or not _reproducible(storage_writer, planner, no_dist, use_collectives):
                return original(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
                                process_group=process_group, no_dist=no_dist, use_collectives=use_collectives)
            tx.save_sharded(state_dict, os.path.relpath(target, root), process_group=process_group)
            return None  # DCP's Metadata exists once the shards are written; no framework we serve reads it

        return save

    return wrap


@contextlib.contextmanager
def capturing_dcp_saves(tx: DirectoryTransaction, root: Optional[str] = None) -> Iterator[None]:
    """While active, ``dcp.save`` into a directory under ``root`` (default: ``tx``'s staging
    directory) is ``tx.save_sharded`` into the same relative path."""
    with patching.patched(dcp, "save", _saving_into(tx, root or tx.staging_dir)(dcp.save)):
        yield
