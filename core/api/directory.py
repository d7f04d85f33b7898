"""A checkpoint directory of native files (a framework's own layout), committed atomically.

More: docs/MODULES.md, core/api/directory.py.
"""
from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from asyncckpt.core.errors import CheckpointCancelledError, CheckpointError
from asyncckpt.core.snapshot.file_snapshots import tensor_bytes
from asyncckpt.core.storage import owners
from asyncckpt.core.storage.commit import job_token
from asyncckpt.core.writer.barrier import BarrierSpec
from asyncckpt.core.writer.directory_requests import CommitDirRequest
from asyncckpt.core.writer.file_requests import BytesRequest, FileRequest

if TYPE_CHECKING:
    from asyncckpt.core.api.parts import Parts
    from asyncckpt.core.client.handles import SaveHandle
    from asyncckpt.core.snapshot.sharded_save import SaveTarget
    from asyncckpt.core.tier.nodes import TierSave


@dataclass(frozen=True)
class DirectoryContext:
    """What a directory transaction needs of its Checkpointer: its parts (ledger, hand-over, file snapshots, sharded
    saves, options), where a sharded member is saved (``target(path, group, **details)``), and the writer jobs handed
    over with the commit (``handed_with(handle, barrier)``: ``FollowUps.handed_with``)."""

    parts: "Parts"
    target: Callable[..., "SaveTarget"]
    handed_with: Callable[["SaveHandle", BarrierSpec], list]


class DirectoryTransaction:
    """Files for one checkpoint directory, written in the background, published all at once
    (``Checkpointer.begin_directory`` makes one). ``handle`` is the checkpoint's: it completes
    when the directory is published on every rank, or fails with the first failure of any file
    on any rank. Used as a context manager, an exception inside aborts the directory."""

    def __init__(self, context: DirectoryContext, handle: "SaveHandle", *, save_id: str, staging_dir: str,
                 barrier: BarrierSpec, tier: Optional["TierSave"] = None) -> None:
        self.handle = handle
        self.final_dir, self.rank, self.step, self.save_id = handle.path, handle.rank, handle.step, save_id
        self.staging_dir = staging_dir
        self._barrier = barrier
        self._context, self._parts = context, context.parts
        self._ledger = context.parts.ledger
        self._tier = tier  # a memory-tier save (``tier.nodes.TierSave``)
        self._held: list[tuple["SaveHandle", Any, Any]] = []
        self._committing = False
        self._failed: Optional[str] = None
        self._lock = threading.Lock()
        handle.transaction = self

    def __enter__(self) -> "DirectoryTransaction":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is not None:
            self.abort(error)

    def claim(self) -> str:
        """Create the staging directory now, owned by this process, and return it: for a framework
        that writes into it itself (synchronously), so that a crash meanwhile leaves a leftover
        known to be dead."""
        owners.claim(self.staging_dir, self.rank, owners.owner_token())
        return self.staging_dir

    def path(self, name: str) -> str:
        """Where ``name`` is staged, for code that must write a file there itself (synchronously)."""
        return os.path.join(self.claim(), name)

    def save_file(self, obj: Any, name: str, *, format: str = "torch", metadata: Optional[dict] = None,
                  inline_below: int = 0) -> "SaveHandle":
        """Snapshot ``obj`` now; write it as ``name`` (``torch.save`` or safetensors layout) later.
        An object with fewer tensor bytes than ``inline_below`` is rendered at once instead of
        through a snapshot buffer."""
        if inline_below and tensor_bytes(obj, stop_at=inline_below) < inline_below:
            return self.write_bytes(name, self._parts.files.render(obj, format, metadata))
        member = self._member(name)
        try:
            image = self._parts.files.image(obj, format, metadata)
        except BaseException as e:
            self._member_failed(member, e)
            raise
        slot = self._parts.buffers.take_for_file(image.size, member)
        member.add_bytes(image.size)
        member.when_done(lambda: self._parts.buffers.give_back(slot))
        options = self._parts.options
        request = FileRequest(os.path.join(self.staging_dir, name), image.size, self.rank, options.direct_io,
                              options.io_threads, self._barrier, share_unchanged=options.share_unchanged)
        try:
            self._parts.handoff.take_snapshot(member, lambda: self._parts.files.stage(image, slot), request,
                                       lambda: self._hold(member, request, slot.buffer))
        except CheckpointError:
            self._member_failed(member, member.exception())
            raise
        return member

    def save_sharded(self, state_dict: dict, name: str, *, process_group: Any = None) -> "SaveHandle":
        """Snapshot ``state_dict`` now, as ``torch.distributed.checkpoint.save`` would save it into
        the subdirectory ``name`` (a collective over ``process_group``: every rank calls it, in the
        same order); each rank writes its shard in the background, rank 0 DCP's ``.metadata``, and
        the directory's commit publishes it with the rest. ``dcp.load`` reads it as DCP's own."""
        member = self._member(name)
        try:
            target = self._context.target(os.path.join(self.final_dir, name), process_group, step=self.step,
                                          staging_dir=os.path.join(self.staging_dir, name),
                                          directory_barrier=self._barrier)
            prepared = self._parts.sharded.prepare(state_dict, target, member, speculate=False,
                                             failed_here=self._ledger.has_unobserved,
                                             raise_failures=self._ledger.raise_unobserved, timings=member.timings)
        except BaseException as e:
            self._member_failed(member, e)
            raise
        member.when_done(lambda: self._parts.buffers.give_back(prepared.slot))
        member.add_bytes(prepared.slot.buffer.layout.size)
        try:
            self._parts.handoff.take_snapshot(member, prepared.begin, prepared.request,
                                       lambda: self._hold(member, prepared.request, prepared.slot.buffer))
        except CheckpointError:
            self._member_failed(member, member.exception())
            raise
        return member

    def write_bytes(self, name: str, data: bytes) -> "SaveHandle":
        """Write small bytes (already a snapshot) as ``name``, in queue order."""
        member = self._member(name)
        member.set_snapshot_taken()
        member.add_bytes(len(data))
        request = BytesRequest(os.path.join(self.staging_dir, name), bytes(data), self.rank, self._barrier)
        self._hold(member, request, None)
        return member

    def commit(self) -> "SaveHandle":
        """Every rank calls this once, after its files; returns the checkpoint's handle, which
        completes when the directory is published (or fails with what failed on any rank)."""
        with self._lock:  # the held files and the commit reach the writer in one message
            if self._committing:
                return self.handle
            self._committing = True
            request = CommitDirRequest(self.save_id, self.final_dir, self.staging_dir, self.rank, self.step,
                                       self._barrier, self._failed, self._tier)
            self.handle.set_snapshot_taken()
            self._flush([(self.handle, request, None), *self._context.handed_with(self.handle, self._barrier)])
        return self.handle

    def abort(self, error: BaseException, *, raised: bool = True) -> None:
        """The framework's save failed half-way: nothing is published, on any rank. ``raised``: the
        caller raises ``error`` itself, so the checkpoint's failure is not raised again; otherwise
        (a snapshot on the snapshot thread) it is raised at the next sync point."""
        if self._failed is None:
            self._failed = f"{type(error).__name__}: {error}"
        with self._lock:
            held, self._held = self._held, []
        for member, _request, _buffer in held:  # not worth writing any more
            member.held_by = None
            self._ledger.complete(member, CheckpointCancelledError(f"asyncckpt: {member.describe()}: aborted"))
        self.commit()
        self.handle.observed = raised

    def abandon(self) -> None:
        """The Checkpointer is shutting down with this directory never committed (the process interrupted between
        its files and its commit): abort it, so that the writer discards what it staged, as for a failed save."""
        with self._lock:
            if self._committing:
                return
        self.abort(CheckpointCancelledError(f"asyncckpt: {self.handle.describe()}: never committed"))

    def release(self) -> None:
        """Hand every held request to the writer, in the order they were made."""
        with self._lock:  # held while submitting: two releasing threads cannot reorder the queue
            self._flush([])

    # ------------------------------------------------------------------ internals
    def _member(self, name: str) -> "SaveHandle":
        return self._ledger.admit("member", os.path.join(self.final_dir, name), rank=self.rank,
                                       step=self.step, label=self.handle.label, member_of=self.handle)

    def _member_failed(self, member: "SaveHandle", error: BaseException) -> None:
        if self._failed is None:
            self._failed = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
        self._ledger.complete(member, error)

    def _hold(self, member: "SaveHandle", request: Any, buffer: Any) -> None:
        with self._lock:
            if self._committing:
                self._ledger.queue.submit([(member, request, buffer)])
                return
            member.held_by = self
            self._held.append((member, request, buffer))

    def _flush(self, after: list) -> None:
        held, self._held = self._held, []
        for member, _request, _buffer in held:
            member.held_by = None
        if held or after:
            self._ledger.queue.submit(held + after)


def directory_id(final_dir: str, rank: int, world: int, store: Any, count: Callable[[], int]) -> str:
    """The same id on every rank without a collective: on one rank, an owner token (random, and
    it says whose the staging directory is, ``owners``); else each rank's count of
    directories it began at this path, kept in the Store (unique for the job, across
    Checkpointers) or, without one, in its Checkpointer (``count()``) with the job's run id."""
    if world == 1:
        return owners.owner_token()
    if store is not None:
        place = hashlib.blake2b(final_dir.encode(), digest_size=6).hexdigest()
        return f"d{place}-{store.add(f'asyncckpt/seq/{place}/{rank}', 1)}"
    return f"d{count()}-{job_token()}"
