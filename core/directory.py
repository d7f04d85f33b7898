"""A checkpoint directory of native files (a framework's own layout), committed atomically.

Accelerate's ``checkpoint_N`` and the Transformers Trainer's ``checkpoint-N`` are directories of
ordinary files (safetensors, torch.save pickles, JSON) written by one or several ranks. A
``DirectoryTransaction`` stages each file through the background writer into a hidden
directory next to the final one; ``commit()`` (called by every rank) makes each rank's writer
publish a done marker after its files, and rank 0's writer, once all markers are there, writes
the commit record and renames the directory into place. Until then nothing matching the
framework's name patterns exists, so its resume logic and rotation never see a partial checkpoint.
"""
from __future__ import annotations

import json
import os
import secrets
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from . import commit
from .fsio import atomic_write_bytes
from .layout import RankLayout
from .errors import CheckpointWriteError
from .storage import await_commit, error_marker_name, publish_with_record, report_failure, wait_for_ranks

if TYPE_CHECKING:
    from .checkpointer import Checkpointer, SaveHandle


def done_marker_name(rank: int) -> str:
    return f"__{rank}.done"


@dataclass
class BytesRequest:
    """Write small bytes (JSON, a pickle already taken) into the staging directory, durably."""

    path: str
    data: bytes
    on_failure: Any = None  # the transaction's CommitDirRequest: failures are reported to its ranks

    def run(self, layout: Optional[RankLayout], image: Optional[memoryview]) -> None:
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            atomic_write_bytes(self.path, self.data)
        except BaseException as e:
            report_failure(self.on_failure, e)
            raise


@dataclass
class CommitDirRequest:
    """Runs after this rank's files (queue order): mark done; rank 0 waits for all, publishes."""

    save_id: str
    final_path: str
    staging_dir: str
    rank: int
    world_size: int
    coordinator: bool
    step: Optional[int]
    timeout: float

    def run(self, layout: Optional[RankLayout], image: Optional[memoryview]) -> None:
        own_failure = commit.read_abort(self.staging_dir) or _read_json(os.path.join(self.staging_dir, error_marker_name(self.rank)))
        if own_failure is not None:  # one of this rank's files failed (already reported to the others)
            raise CheckpointWriteError(f"checkpoint {self.final_path} failed on rank {own_failure['rank']}: {own_failure['error']}")
        try:
            os.makedirs(self.staging_dir, exist_ok=True)
            atomic_write_bytes(os.path.join(self.staging_dir, done_marker_name(self.rank)), self.save_id.encode())
            if self.coordinator:
                wait_for_ranks(self, done_marker_name)
                for rank in range(self.world_size):
                    os.unlink(os.path.join(self.staging_dir, done_marker_name(rank)))
                publish_with_record(self)
        except BaseException as e:
            report_failure(self, e)
            raise
        if not self.coordinator:
            await_commit(self)


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


class DirectoryTransaction:
    """Files for one checkpoint directory, written in the background, published all at once.

    The files' write requests are held back until ``commit()``: a framework's save call stages
    several files one after the other, and a writer already streaming the first to disk would
    compete with the copies of the next ones for the CPU and memory bandwidth, lengthening the
    very stall it exists to shorten. Waiting for a held file (its handle's ``result()``, the
    checkpointer's ``wait``/back-pressure) releases everything held, so nothing can hang on it.
    """

    def __init__(self, checkpointer: "Checkpointer", final_dir: str, rank: int, world_size: int,
                 step: Optional[int], save_id: str, staging_parent: Optional[str] = None) -> None:
        self._checkpointer = checkpointer
        self.final_dir = os.path.abspath(final_dir)
        self.rank, self.world_size, self.step, self.save_id = rank, world_size, step, save_id
        self.staging_dir = commit.staging_dir_for(self.final_dir, save_id, staging_parent)
        self._commit_request = CommitDirRequest(save_id, self.final_dir, self.staging_dir, rank, world_size,
                                                rank == 0, step, checkpointer.timeout)
        self._held: list[tuple["SaveHandle", Any, Any]] = []
        self._committing = False
        self._lock = threading.Lock()

    def path(self, name: str) -> str:
        """Where ``name`` is staged (for code that must write a file itself, synchronously)."""
        os.makedirs(self.staging_dir, exist_ok=True)
        return os.path.join(self.staging_dir, name)

    def save_file(self, obj: Any, name: str, *, format: str = "torch", metadata: Optional[dict] = None) -> "SaveHandle":
        """Snapshot ``obj`` now; write it as ``name`` (torch.save or safetensors layout) later."""
        return self._checkpointer._save_file(obj, os.path.join(self.staging_dir, name), format, metadata,
                                             on_failure=self._commit_request, group=self)

    def write_bytes(self, name: str, data: bytes) -> "SaveHandle":
        """Write small bytes (already a snapshot) as ``name``, in queue order."""
        path = os.path.join(self.staging_dir, name)
        return self._checkpointer._submit_unbuffered(path, BytesRequest(path, bytes(data), self._commit_request), group=self)

    def commit(self) -> "SaveHandle":
        """Every rank calls this once, after its files; the handle resolves when the directory is
        published under its final name (or raises what failed on any rank)."""
        handle = self._checkpointer._unbuffered_handle(self.final_dir, group=self)
        with self._lock:  # the held files and the commit reach the writer in one message
            self._committing = True
            self._flush([(handle, self._commit_request, None)])
        return handle

    def hold(self, handle: "SaveHandle", request: Any, slot: Any) -> bool:
        """Keep a staged file's write request until ``commit()``/``release()``; False once committing."""
        with self._lock:
            if self._committing:
                return False
            handle.held_by = self
            self._held.append((handle, request, slot))
            return True

    def release(self) -> None:
        """Hand every held request to the writer, in the order they were made."""
        with self._lock:  # held while submitting: two releasing threads cannot reorder the queue
            self._flush([])

    def _flush(self, after: list) -> None:
        held, self._held = self._held, []
        for handle, _request, _slot in held:
            handle.held_by = None
        if held or after:
            self._checkpointer._submit_held(held + after)


def transaction_id(world_size: int, counter: int) -> str:
    """Same on every rank without communication (one process: random)."""
    return secrets.token_hex(8) if world_size == 1 else f"d{counter}-{commit.job_token()}"
