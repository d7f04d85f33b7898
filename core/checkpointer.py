"""``Checkpointer``: the one save path (sync and async) and the load path.

A save, on every rank: agree on the structure (one tiny all-gather) → plan (cached) → take the
snapshot into a reused shared buffer laid out as the data file (the only part the caller waits
for) → hand the background writer plain data → the writers write, rank 0's writer commits. A
synchronous ``save`` is ``async_save(...).result()``.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import functools
import io
import itertools
import logging
import os
import pickle
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.utils import _DistWrapper, find_state_dict_object, find_tensor_shard
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import commit
from .dcp_storage import AsyncCkptStorageReader
from .direct_load import paused_gc, plan_direct_load
from .metadata_io import dcp_classes, load_dcp_metadata
from .directory import CommitDirRequest, DirectoryTransaction, transaction_id
from .errors import CheckpointError, CheckpointTimeoutError, CheckpointWriteError
from .plan_cache import CachedPlan, PlanCache, agree_on_structure
from .planner import (
    AsyncCkptLoadPlanner,
    AsyncCkptSavePlanner,
    byte_items,
    layout_for_plan,
    planner_data_paths,
    tensor_items,
)
from .structure import describe, tied_keys
from .layout import IO_ALIGNMENT, RankLayout, align_up
from .file_requests import FileRequest, RemoveRequest
from .native_files import safetensors_image, stage_image
from .staging import CopyInProgress, StagingBuffer, begin_copy, start_copy
from .storage import ShareRequest, report_failure
from .torch_file import TorchFileTemplates
from .worker import Idle
from .worker_client import WorkerClient

logger = logging.getLogger("asyncckpt.core")

STATE_DICT = dict[str, Any]


class SaveHandle:
    """A save in flight. ``result()`` returns once the checkpoint is committed on every rank."""

    def __init__(self, path: str, rank: int, default_timeout: float) -> None:
        self.path = path
        self.rank = rank
        self._future: Future = Future()
        self._staged = threading.Event()
        self._default_timeout = default_timeout
        self.buffer_slot: Optional["_BufferSlot"] = None
        self.reported = False  # the caller saw the outcome through result()
        self.group: object = self  # saves of one checkpoint (a directory transaction) share a group
        self.held_by: Optional[DirectoryTransaction] = None  # the transaction holding this request back

    def _release_held(self) -> None:
        """Whoever waits for a request a transaction holds back releases it (never a hang)."""
        if self.held_by is not None:
            self.held_by.release()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> None:
        """Wait until committed; raise what went wrong. Never unbounded: ``None`` means the
        checkpointer's timeout (plus a margin for the commit)."""
        limit = self._default_timeout if timeout is None else timeout
        self._release_held()
        try:
            self.reported = True
            return self._future.result(limit)
        except FutureTimeout:
            raise CheckpointTimeoutError(f"rank {self.rank}: save of {self.path} not committed after {limit:.0f}s") from None

    def exception(self) -> Optional[BaseException]:
        return self._future.exception() if self._future.done() else None

    def staged(self) -> bool:
        """True once the snapshot is complete and the caller may mutate the state again."""
        return self._staged.is_set()

    def wait_staged(self, timeout: Optional[float] = None) -> None:
        if not self._staged.wait(self._default_timeout if timeout is None else timeout):
            raise CheckpointTimeoutError(f"rank {self.rank}: snapshot for {self.path} not finished")

    def _set_staged(self) -> None:
        self._staged.set()

    def _finish(self, error: Optional[BaseException]) -> None:
        self._staged.set()
        if not self._future.done():
            if error is None:
                self._future.set_result(None)
            else:
                self._future.set_exception(error)


class _BufferSlot:
    """A staging buffer and the save currently using it (one buffer per save in flight)."""

    _ids = itertools.count()

    def __init__(self, key, buffer: StagingBuffer) -> None:
        self.id = next(self._ids)
        self.key = key
        self.buffer = buffer
        self.user: Optional[SaveHandle] = None
        self.framing: Optional[list] = None  # the torch-file framing the buffer holds (see _stage_file)


class Checkpointer:
    """Owns the staging buffers, the background writer and the plan cache across saves.

    Args:
        process_group: group for the (tiny) structure agreement and cold planning; default: world.
        use_collectives: False saves and loads with no cross-rank communication (ranks meet
            only through the filesystem); replicated tensors are then written by every rank.
        max_in_flight: saves whose write may be pending at once; each holds one staging buffer
            (memory = max_in_flight x the rank's state). A save beyond it first waits for the
            oldest to finish (back-pressure).
        overlap_staging: take the snapshot in a background thread; the caller must not mutate
            the state until ``handle.wait_staged()`` (``guard(optimizer)`` does that for you).
        direct_io: write with O_DIRECT where the filesystem supports it.
        io_threads: parallel writer/reader threads per rank.
        timeout: bound on every wait (peers, commit, back-pressure), in seconds.
        verify: check checksums on load.
    """

    def __init__(
        self,
        *,
        process_group: Optional[dist.ProcessGroup] = None,
        use_collectives: bool = True,
        max_in_flight: int = 1,
        overlap_staging: bool = False,
        direct_io: bool = True,
        io_threads: int = 2,
        timeout: float = 600.0,
        verify: bool = True,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.process_group = process_group
        self.use_collectives = use_collectives
        self.max_in_flight = max_in_flight
        self.overlap_staging = overlap_staging
        self.direct_io = direct_io
        self.io_threads = io_threads
        self.timeout = timeout
        self.verify = verify
        self.plan_cache = PlanCache()
        self.torch_files = TorchFileTemplates()  # single torch.save files: framing cached per structure
        self._slots: list[_BufferSlot] = []
        self._in_flight: deque[SaveHandle] = deque()
        self._unreported: list[tuple[Optional[SaveHandle], BaseException]] = []
        self._jobs: dict[int, tuple[SaveHandle, ShareRequest]] = {}
        self._job_ids = itertools.count()
        self._worker: Optional[WorkerClient] = None
        self._lock = threading.RLock()
        self._save_counter = 0
        self._directory_counter = 0
        self._closed = False
        self._staging_thread: Optional[threading.Thread] = None
        self._last_key = None  # plan-cache key of the last save
        self._side_group: Optional[dist.ProcessGroup] = None
        self._object_snapshots = _ObjectSnapshots()
        _live_checkpointers.add(self)

    # ------------------------------------------------------------------ public API
    def save(self, state_dict: STATE_DICT, path: str | os.PathLike, **options: Any) -> None:
        """Save and return once the checkpoint is committed on every rank (streamed: the caller
        waits for the disk anyway)."""
        self.async_save(state_dict, path, stream=True, **options).result()

    def async_save(
        self,
        state_dict: STATE_DICT,
        path: str | os.PathLike,
        *,
        process_group: Optional[dist.ProcessGroup] = None,
        use_collectives: Optional[bool] = None,
        step: Optional[int] = None,
        extra_files: Optional[dict[str, bytes]] = None,
        overlap_staging: Optional[bool] = None,
        stream: bool = False,
    ) -> SaveHandle:
        """Snapshot ``state_dict`` and return; the write and commit happen in the background.

        ``extra_files`` (name -> bytes) are written by rank 0 into the checkpoint directory
        before it is committed (e.g. a framework's own metadata file).

        ``stream``: the writer writes each part of the snapshot as soon as it is copied, rather
        than once the copy is complete. The checkpoint is durable sooner (for 1 GiB, 22-29 ms
        sooner, 8-9%), but the writer's I/O slows the copy the caller waits for by 5-11 ms (8-28%
        of the stall), so only ``save``, whose caller waits for the disk anyway, streams by default.
        """
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        path = os.path.abspath(os.fspath(path))
        group = process_group if process_group is not None else self.process_group
        collectives = (self.use_collectives if use_collectives is None else use_collectives) and _dist_ready()
        rank, world = _rank_and_world(group)
        overlap = self.overlap_staging if overlap_staging is None else overlap_staging
        self.wait_staged()  # one snapshot at a time: saves agree on their structures in call order
        agreement_group = self._agreement_group(group, world, collectives)
        prepare = functools.partial(self._prepare, state_dict, path, agreement_group, collectives, rank, world, step,
                                    extra_files, speculate=not overlap)
        submit = functools.partial(self._stage_and_submit, stream=stream)
        if overlap and (agreement_group is not group or world == 1 or not collectives):
            # The whole snapshot (flatten, describe, agree on a group of our own, copy) runs in the
            # background: the caller waits for nothing but a thread start.
            handle = SaveHandle(path, rank, self.timeout + 60)
            with self._lock:
                self._in_flight.append(handle)
            self._start_staging_thread(self._prepare_and_stage, handle, prepare, submit)
            return handle
        handle, slot, begin, request = prepare()
        with self._lock:
            self._in_flight.append(handle)
        if overlap:  # the caller's own group must not be used from another thread: only the copy is overlapped
            self._start_staging_thread(submit, handle, slot, begin, request)
        else:
            submit(handle, slot, begin, request)
            self._raise_unreported()  # this snapshot's failure, or an older one that completed meanwhile
        return handle

    def _prepare(self, state_dict: STATE_DICT, path: str, group, collectives: bool, rank: int, world: int,
                 step: Optional[int], extra_files: Optional[dict[str, bytes]], *, speculate: bool,
                 handle: Optional[SaveHandle] = None) -> tuple[SaveHandle, "_BufferSlot", Any, ShareRequest]:
        """Everything before the copy: flatten, agree on the structure, plan (cached), pickle the
        non-tensor values, pick a buffer. Returns the handle, the buffer, the copy to run, and the
        request for the writer. With ``speculate``, the copy already runs meanwhile."""
        planner = AsyncCkptSavePlanner()
        planner.set_up_planner(_resolve_stateful(state_dict), is_coordinator=rank == 0)
        flat = planner.state_dict
        self._apply_back_pressure()
        speculation = self._speculate(flat) if speculate else None
        try:
            description = describe(flat)
            key, save_id, failed_ranks = agree_on_structure(self.plan_cache.digest(description), group, world,
                                                            collectives, self._save_counter,
                                                            failed=self._has_unreported())
            self._save_counter += 1
            self._raise_unreported()
            if failed_ranks:  # another rank's earlier save failed: every rank stops here together
                raise CheckpointWriteError(f"rank {rank}: not saving {path}: an earlier save failed on ranks {failed_ranks}")
            cached = self.plan_cache.get(key)
            if cached is None:
                cached = self._plan(planner, group, rank, world, collectives, tied_keys(description))
                self.plan_cache.put(key, cached)
            self._last_key = key
            objects = [(item.index.fqn, self._object_snapshots.serialize(item.index.fqn, find_state_dict_object(flat, item.index)))
                       for item in cached.byte_items]
            if speculation is not None and speculation.key == key:
                slot, copy = speculation.slot, speculation.copy
                begin = lambda: copy  # noqa: E731
            else:
                if speculation is not None:
                    speculation.abandon()
                    speculation = None
                slot = self._free_slot(key, cached)
                sources = _sources(flat, cached)
                begin = lambda: begin_copy(slot.buffer, sources)  # noqa: E731
        except BaseException:
            if speculation is not None:
                speculation.abandon()
            raise
        handle = handle or SaveHandle(path, rank, self.timeout + 60)
        slot.user = handle
        handle.buffer_slot = slot
        request = ShareRequest(
            save_id=save_id, final_path=path, staging_dir=commit.staging_dir_for(path, save_id), rank=rank,
            world_size=world, coordinator=rank == 0, structure_hash=str(key[0]), byte_items=objects,
            direct_io=self.direct_io, io_threads=self.io_threads, timeout=self.timeout, step=step,
            extra_files=dict(extra_files or {}) if rank == 0 else {}, dcp_classes=dcp_classes() if rank == 0 else None,
        )
        return handle, slot, begin, request

    def _prepare_and_stage(self, handle: SaveHandle, prepare, submit) -> None:
        """Background thread of an overlapped save: the whole snapshot, then the hand-off."""
        time.sleep(0)  # hand the GIL back at once: the caller returns now, not after a 5 ms switch interval
        try:
            _, slot, begin, request = prepare(handle=handle)
        except BaseException as e:
            self._complete(handle, e if isinstance(e, CheckpointError) else
                           CheckpointWriteError(f"rank {handle.rank}: snapshot of {handle.path} failed: {type(e).__name__}: {e}"))
            return
        submit(handle, slot, begin, request)

    def _start_staging_thread(self, target, *args) -> None:
        self._staging_thread = threading.Thread(target=target, args=args, name="asyncckpt-stager", daemon=True)
        self._staging_thread.start()

    def _agreement_group(self, group, world: int, collectives: bool):
        """The group a save's structure agreement (and cold planning) runs on: a gloo group of our
        own when saving on the whole world, created collectively at the first such save, so that
        it can run on a background thread without interleaving with the training's collectives on
        the default group (and never needs a CUDA tensor); the caller's group otherwise."""
        if group is not None or world == 1 or not collectives:
            return group
        if self._side_group is None:
            self._side_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
        return self._side_group

    def async_save_file(
        self, obj: Any, path: str | os.PathLike, *, format: str = "torch", metadata: Optional[dict[str, str]] = None
    ) -> SaveHandle:
        """Write one native file in the background: ``format="torch"`` is what ``torch.save(obj)``
        writes; ``"safetensors"`` what ``safetensors.torch.save_file(obj, metadata=...)`` writes.

        Rank-local (no collectives). The snapshot (structure and tensor bytes) is taken before
        returning; the file appears under ``path`` only complete and fsynced. Requests run in
        submission order, so repeated saves to one path keep their order.
        """
        return self._save_file(obj, path, format, metadata)

    def _save_file(self, obj: Any, path, format: str, metadata, on_failure=None, group=None) -> SaveHandle:
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        self._raise_unreported()
        path = os.path.abspath(os.fspath(path))
        if format == "torch":
            image = self.torch_files.image(obj)
        elif format == "safetensors":
            image = safetensors_image(obj, metadata)
        else:
            raise ValueError(f"unknown file format {format!r} (expected 'torch' or 'safetensors')")
        if group is None:  # files of a directory transaction were admitted with the transaction
            self._apply_back_pressure()
        slot = self._free_file_slot(image.size)
        handle = SaveHandle(path, _rank_and_world(self.process_group)[0], self.timeout + 60)
        if group is not None:
            handle.group = group
        slot.user, handle.buffer_slot = handle, slot
        with self._lock:
            self._in_flight.append(handle)
        request = FileRequest(path, image.size, self.direct_io, self.io_threads, on_failure)
        self._stage_and_submit(handle, slot, lambda: self._stage_file(image, slot), request)
        self._raise_unreported()  # this snapshot's failure, or an older one that completed meanwhile
        return handle

    @staticmethod
    def _stage_file(image, slot: "_BufferSlot") -> CopyInProgress:
        """Stage a file image (complete on return); the framing of a torch file is written only
        when the buffer's last file had another structure."""
        in_place = image.framing is not None and slot.framing is image.framing
        slot.framing = None  # until this staging is complete
        stage_image(image, slot.buffer.bytes, framing_in_place=in_place)
        slot.framing = image.framing
        return CopyInProgress(None, [])

    def save_file(self, obj: Any, path: str | os.PathLike, **options: Any) -> None:
        self.async_save_file(obj, path, **options).result()

    def async_remove(self, paths: Iterable[str | os.PathLike], *, only_if_complete: Optional[str] = None) -> SaveHandle:
        """Delete files or checkpoint directories in the background, after every save queued
        before this call. With ``only_if_complete``, nothing is deleted unless that checkpoint
        (usually the newer one being saved) was committed: retention never trades an old
        checkpoint for a failed new one."""
        paths = [os.path.abspath(os.fspath(p)) for p in paths]
        return self._submit_unbuffered(", ".join(paths), RemoveRequest(paths, only_if_complete))

    def begin_directory(self, final_dir: str | os.PathLike, *, step: Optional[int] = None,
                        staging_parent: Optional[str | os.PathLike] = None) -> DirectoryTransaction:
        """Start a checkpoint directory of native files (SPMD: every rank of the group calls it in
        the same order). Stage files with ``tx.save_file`` / ``tx.write_bytes``, then ``tx.commit()``.

        The directory is staged as a hidden sibling of ``final_dir``, or in ``staging_parent`` (same
        filesystem) when a framework counts or lists every entry of the final directory's parent."""
        self._apply_back_pressure()  # the whole directory counts as one save in flight
        rank, world = _rank_and_world(self.process_group)
        self._directory_counter += 1
        return DirectoryTransaction(self, os.fspath(final_dir), rank, world, step,
                                    transaction_id(world, self._directory_counter),
                                    os.fspath(staging_parent) if staging_parent is not None else None)

    def _submit_unbuffered(self, what: str, request, group=None) -> SaveHandle:
        """Queue a request that needs no staging buffer (counted toward max_in_flight only as part
        of ``group``, a directory transaction)."""
        handle = self._unbuffered_handle(what, group)
        self._dispatch(handle, request)
        return handle

    def _unbuffered_handle(self, what: str, group=None) -> SaveHandle:
        """The handle of a request without a staging buffer, in flight from now on."""
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        handle = SaveHandle(what, _rank_and_world(self.process_group)[0], self.timeout + 60)
        if group is not None:
            handle.group = group
        with self._lock:
            self._in_flight.append(handle)
        handle._set_staged()
        return handle

    def load(
        self,
        state_dict: STATE_DICT,
        path: str | os.PathLike,
        *,
        process_group: Optional[dist.ProcessGroup] = None,
        strict: bool = True,
        verify: Optional[bool] = None,
        use_collectives: Optional[bool] = None,
    ) -> None:
        """Load a committed checkpoint into ``state_dict`` in place, resharding as needed.

        Checkpoints written by asyncckpt whose tensors need no resharding (plain CPU tensors, each
        saved whole) are read straight from the sidecars (``direct_load``); anything else goes
        through ``dcp.load`` with torch's resharding. With collectives, every rank takes the same
        path, and a failure on any rank is raised on every rank (as dcp.load does).
        """
        path = os.path.abspath(os.fspath(path))
        self.wait_for(path)
        group = process_group if process_group is not None else self.process_group
        collectives = self.use_collectives if use_collectives is None else use_collectives
        verify = self.verify if verify is None else verify
        record = commit.require_complete(path)  # DCP would hide these errors behind a generic one: check first
        use_dist = collectives and _dist_ready()
        ranks = _DistWrapper(group, use_dist, 0)
        planned: list = []

        def plan() -> bool:
            planned.append(plan_direct_load(state_dict, path, record, strict=strict, verify=verify))
            return planned[0] is not None

        try:
            with paused_gc():
                if all(ranks.all_gather("plan", plan)):
                    ranks.all_gather("read", lambda: planned[0].run(self.io_threads))
                    planned.clear()  # its ~10 objects per key go before the GC is back on
                    return
                reader = AsyncCkptStorageReader(path, verify=verify, io_threads=self.io_threads,
                                                metadata=load_dcp_metadata(path))
                with warnings.catch_warnings():  # DCP warns that a no-collectives load is "single process"
                    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                    dcp.load(state_dict, storage_reader=reader, planner=AsyncCkptLoadPlanner(strict=strict),
                             process_group=group, no_dist=not use_dist)
        except CheckpointException as e:
            raise _unwrap(e) from None

    def wait(self, timeout: Optional[float] = None) -> None:
        """Wait until every accepted save is committed, and the checkpoints they replaced are
        deleted; raise the first failure."""
        with self._lock:
            pending = list(self._in_flight)
        for handle in pending:
            handle._release_held()  # held files and commits first: the cleanup request must follow them
        with self._lock:
            worker_running = self._worker is not None and self._worker.alive
        if worker_running:
            pending.append(self._submit_unbuffered("the background writer's cleanup", Idle()))
        for handle in pending:
            self._settle(handle, timeout)
        self._raise_unreported()

    def wait_for(self, path: str) -> None:
        """Wait for pending saves to ``path`` (a load must never read a checkpoint being written)."""
        with self._lock:
            pending = [h for h in self._in_flight if h.path == path]
        for handle in pending:
            self._settle(handle, None)
        self._raise_unreported()

    def start(self) -> None:
        """Start the background writer now (it starts lazily otherwise: ~2-3 s at the first save)."""
        with self._lock:
            self._ensure_worker()

    def wait_staged(self) -> None:
        """Block until the snapshot of the last overlapped save is taken (call before mutating)."""
        thread = self._staging_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.timeout)
            if thread.is_alive():
                raise CheckpointTimeoutError(f"snapshot not finished after {self.timeout:.0f}s")

    def run_staged(self, function: Callable[[], None]) -> None:
        """Run ``function`` on the staging thread, where it overlaps what the caller does next: more
        snapshots through this checkpointer (``tx.save_file``, then ``tx.commit()``), for state the
        caller leaves untouched until ``wait_staged()`` (``guard`` makes optimizer steps wait). The
        caller must not use this checkpointer before that wait either. ``function`` reports its own
        failures (through the handles it creates); one that escapes is logged, never raised here."""
        self.wait_staged()

        def staged() -> None:
            try:
                function()
            except BaseException:  # noqa: BLE001 - documented: function reports its own failures
                logger.exception("asyncckpt: a staged snapshot failed")

        self._start_staging_thread(staged)

    def guard(self, *optimizers: torch.optim.Optimizer) -> list:
        """Make each optimizer's ``step()`` wait for an overlapped snapshot; returns hook handles."""
        return [opt.register_step_pre_hook(lambda *_: self.wait_staged()) for opt in optimizers]

    def close(self) -> None:
        """Drain every pending save, stop the writer, free the buffers; raise any failure."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._worker is not None:
                self._worker.stop()
                self._worker = None
            for slot in self._slots:
                slot.buffer.close()
            self._slots.clear()
            if self._side_group is not None and _dist_ready():
                dist.destroy_process_group(self._side_group)
            self._side_group = None
            _live_checkpointers.discard(self)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ planning
    def _plan(self, planner: AsyncCkptSavePlanner, group, rank: int, world: int, collectives: bool,
              tied_to: dict[str, str]) -> CachedPlan:
        if collectives and world > 1 and _dist_ready():
            wrapper = _DistWrapper(group, True, 0)
            final = wrapper.reduce_scatter(
                "plan", planner.create_local_plan, lambda plans: planner.create_global_plan(plans)[0]
            )
        else:
            final = planner.create_global_plan([planner.create_local_plan()])[0][0]
        planner.finish_plan(final)
        layout = dataclasses.replace(layout_for_plan(final, rank, tied_to), planner_data=planner_data_paths(planner.mappings))
        items = tensor_items(final)
        sources = []
        for position in layout.unique_slots():
            item = items[position]
            plain = type(planner.state_dict[item.index.fqn]) in (torch.Tensor, torch.nn.Parameter)
            sources.append((item.index.fqn, None if plain else item))  # DTensors: look up the local shard
        return CachedPlan(final, layout, sources, byte_items(final))

    def _speculate(self, flat: dict) -> Optional["_SpeculativeCopy"]:
        """Start the snapshot copy with the last save's plan before the structure is confirmed:
        training saves the same structure over and over, so the copy (most of the stall) runs on
        the copy threads while this thread describes the structure, agrees on it with the other
        ranks and looks up the plan. If the structure turns out to differ, the copy is discarded
        (it only ever writes into a free buffer) and taken again."""
        last = self._last_key
        cached = self.plan_cache.peek(last) if last is not None else None
        if cached is None:
            return None
        with self._lock:
            slot = next((s for s in self._slots if s.key == last and s.user is None), None)
            if slot is None:
                return None
            slot.user = _SpeculativeCopy
        try:
            sources = _sources(flat, cached)
            if any(source.is_cuda for source in sources):  # CUDA copies are issued from the caller's stream
                raise LookupError("no speculative copies from CUDA")
            return _SpeculativeCopy(self, last, slot, start_copy(slot.buffer, sources))
        except Exception:  # a key gone, or now holding a non-tensor: the confirmed structure differs
            slot.user = None
            return None

    # ------------------------------------------------------------------ buffers & back-pressure
    def _apply_back_pressure(self) -> None:
        """While ``max_in_flight`` saves hold staging buffers, wait for the oldest one (all of its
        files, for a directory transaction)."""
        while True:
            with self._lock:
                groups: dict = {}
                for h in self._in_flight:
                    if (h.buffer_slot is not None or h.group is not h) and not h.done():
                        groups.setdefault(id(h.group), []).append(h)
                if len(groups) < self.max_in_flight:
                    return
                oldest = next(iter(groups.values()))
            for handle in oldest:
                self._settle(handle, None)

    def _free_slot(self, key, cached: CachedPlan) -> _BufferSlot:
        with self._lock:
            for slot in self._slots:
                if slot.key == key and slot.user is None:
                    return slot
            for slot in [s for s in self._slots if s.key not in (key, "file") and s.user is None]:
                self._release(slot)  # structure changed: free the old buffer now
            return self._new_slot(key, cached.layout)

    def _free_file_slot(self, size: int) -> _BufferSlot:
        """A free buffer of at least ``size`` bytes for single files (grown, never per-save)."""
        with self._lock:
            free = [s for s in self._slots if s.key == "file" and s.user is None]
            fitting = [s for s in free if s.buffer.layout.buffer_size >= size]
            if fitting:
                return min(fitting, key=lambda s: s.buffer.layout.buffer_size)
            for slot in free:
                self._release(slot)
            capacity = max(align_up(size + size // 8, IO_ALIGNMENT), IO_ALIGNMENT)  # headroom for growth
            return self._new_slot("file", RankLayout("", (), capacity, capacity))

    def _new_slot(self, key, layout: RankLayout) -> _BufferSlot:
        slot = _BufferSlot(key, StagingBuffer(layout, pin_for_cuda=torch.cuda.is_available()))
        self._slots.append(slot)
        return slot

    def _release(self, slot: _BufferSlot) -> None:
        self._slots.remove(slot)
        if self._worker is not None:
            self._worker.drop_buffer(slot.id)
        slot.buffer.close()

    # ------------------------------------------------------------------ staging & the worker
    def _stage_and_submit(self, handle: SaveHandle, slot: _BufferSlot, begin, request, stream: bool = False) -> None:
        """Start the snapshot copy (``begin()`` returns its ``CopyInProgress``), queue ``request``
        on the background writer, and return once the copy is complete. With ``stream``, a rank's
        share goes to the writer while its copy still runs, and the writer writes each finished part
        (see ``CopyProgress``); anything else is queued once its copy is complete."""
        streamed = stream and isinstance(request, ShareRequest)
        copy: Optional[CopyInProgress] = None
        dispatched = False
        try:
            with torch.no_grad():
                copy = begin()
            if streamed:
                request.copy_generation = copy.generation
                self._dispatch(handle, request, slot)
                dispatched = True
            copy.wait()
            handle._set_staged()
            if not streamed:
                self._dispatch(handle, request, slot)
        except BaseException as e:
            if copy is not None:  # the buffer is freed below: the copy threads must have left it
                with contextlib.suppress(BaseException):
                    copy.wait()
            error = CheckpointWriteError(f"rank {handle.rank}: snapshot of {handle.path} failed: {e}")
            if dispatched:  # the writer sees the copy fail in the buffer and fails the save on every rank
                self._complete(handle, error)
            else:
                self._fail_before_writer(handle, request, error)

    def _fail_before_writer(self, handle: SaveHandle, request, error: CheckpointWriteError) -> None:
        """A request that never reached the writer: fail its handle, and its save on every rank (a
        directory's commit must not publish without this file)."""
        peers = _peers_of(request)
        if peers is not None:
            report_failure(peers, error)
        self._complete(handle, error)

    def _dispatch(self, handle: SaveHandle, request, slot: Optional[_BufferSlot] = None) -> None:
        """Queue on the writer, except a directory transaction's files: they wait in the
        transaction until its commit (see ``DirectoryTransaction.hold``)."""
        if isinstance(handle.group, DirectoryTransaction) and handle.group.hold(handle, request, slot):
            return
        self._submit(handle, request, slot)

    def _submit_held(self, jobs: list) -> None:
        """Queue requests a transaction held back, in one message; a failure to do so fails them."""
        try:
            self._submit_many(jobs)
        except BaseException as e:
            for handle, request, _slot in jobs:
                self._fail_before_writer(handle, request, CheckpointWriteError(f"rank {handle.rank}: queueing {handle.path} failed: {e}"))

    def _submit(self, handle: SaveHandle, request, slot: Optional[_BufferSlot] = None) -> None:
        self._submit_many([(handle, request, slot)])

    def _submit_many(self, jobs: list) -> None:
        """Queue ``(handle, request, slot)`` jobs on the writer, in order, with one message."""
        with self._lock:
            numbered = []
            for handle, request, slot in jobs:
                job_id = next(self._job_ids)
                self._jobs[job_id] = (handle, request)
                numbered.append((job_id, request, slot.id if slot else None, slot.buffer if slot else None))
            worker = self._ensure_worker()
        worker.submit(numbered)

    def _ensure_worker(self) -> WorkerClient:
        if self._worker is None or not self._worker.alive:
            self._worker = WorkerClient(self._on_worker_reply, self._on_worker_exit)
        return self._worker

    def _on_worker_reply(self, kind: str, job_id: int, error: Optional[str], tb: Optional[str] = None) -> None:
        with self._lock:
            handle, request = self._jobs.pop(job_id)
        self._complete(handle, _worker_error(request, error) if kind == "failed" else None)

    def _on_worker_exit(self, returncode: Optional[int]) -> None:
        """The writer died: fail its saves on this rank, and tell the other ranks' writers."""
        with self._lock:
            jobs, self._jobs = self._jobs, {}
            self._worker = None
        for handle, request in jobs.values():
            cause = CheckpointWriteError(f"rank {handle.rank}: background writer for {handle.path} died (exit code {returncode})")
            peers = _peers_of(request)
            if peers is not None:
                report_failure(peers, cause)
            self._complete(handle, cause)

    def _complete(self, handle: SaveHandle, error: Optional[BaseException]) -> None:
        """Settle ``handle`` once: a save whose copy failed after it reached the writer is failed
        here with the copy's error, before the writer's reply, which is then ignored."""
        with self._lock:
            if handle.done():
                return
            if handle.buffer_slot is not None:
                handle.buffer_slot.user = None
            if error is not None:
                self._unreported.append((handle, error))
        handle._finish(error)

    def _settle(self, handle: SaveHandle, timeout: Optional[float]) -> None:
        """Wait (bounded) for ``handle``; a failure the caller has not seen yet is raised here."""
        limit = handle._default_timeout if timeout is None else timeout
        handle._release_held()
        try:
            handle._future.exception(limit)  # waits without consuming the outcome
        except FutureTimeout:
            with self._lock:
                self._unreported.append(
                    (None, CheckpointTimeoutError(f"rank {handle.rank}: save of {handle.path} not committed after {limit:.0f}s"))
                )
        self._raise_unreported()

    def _has_unreported(self) -> bool:
        with self._lock:
            return any(h is None or not h.reported for h, _ in self._unreported) or any(
                h.done() and h.exception() is not None and not h.reported for h in self._in_flight
            )

    def _raise_unreported(self) -> None:
        with self._lock:
            done = [h for h in self._in_flight if h.done()]
            for handle in done:
                self._in_flight.remove(handle)
            errors = [e for h, e in self._unreported if h is None or not h.reported]
            self._unreported = []
        if errors:
            raise errors[0]


def _peers_of(request):
    """Where a request's failure must be reported so that every rank's save fails with it: the
    request itself (a rank's share, a directory commit), or the directory it belongs to."""
    if isinstance(request, (ShareRequest, CommitDirRequest)):
        return request
    return getattr(request, "on_failure", None)


class _SpeculativeCopy:
    """A snapshot copy started before the structure agreement (see ``Checkpointer._speculate``)."""

    def __init__(self, checkpointer: Checkpointer, key, slot: _BufferSlot, copy: CopyInProgress) -> None:
        self.checkpointer, self.key, self.slot, self.copy = checkpointer, key, slot, copy

    def abandon(self) -> None:
        """Wait for the copy threads to leave the buffer, then free it for other saves."""
        with contextlib.suppress(Exception):  # a copy for a structure that changed may fail; it is discarded
            self.copy.wait()
        with self.checkpointer._lock:
            self.slot.user = None


def wait_before_every_step(wait: Callable[[], None]):
    """Call the bound method ``wait`` before every torch optimizer's ``step()`` in the process (a
    global step pre-hook), for callers that do not know which optimizers will change the state
    they snapshot. ``wait``'s owner is held weakly: once it is collected (say, never closed) the
    hook does nothing. The hook returns None, as torch requires. Returns the hook's handle."""
    method = weakref.WeakMethod(wait)

    def hook(*_: Any) -> None:
        bound = method()
        if bound is not None:
            bound()

    return register_optimizer_step_pre_hook(hook)


def _sources(flat: dict, cached: CachedPlan) -> list[torch.Tensor]:
    """The tensors to copy, in the order of the plan's unique slots (DTensors: the local shard)."""
    return [flat[key] if item is None else find_tensor_shard(flat[key], item.index) for key, item in cached.sources]


def _resolve_stateful(state_dict: STATE_DICT) -> STATE_DICT:
    """Top-level values with ``state_dict()``/``load_state_dict()`` (DCP's Stateful protocol) are
    replaced by their state dict. (torch's own helper logs every element: ~70 us per key.)"""
    def is_stateful(value) -> bool:
        if isinstance(value, torch.Tensor):
            return False
        kind = type(value)
        return callable(getattr(kind, "state_dict", None)) and callable(getattr(kind, "load_state_dict", None))

    return {key: value.state_dict() if is_stateful(value) else value for key, value in state_dict.items()}


class _ObjectSnapshots:
    """Non-tensor values are snapshotted by pickling them at call time, in ``torch.save``'s format
    (what DCP's reader ``torch.load``s). ``torch.save`` costs ~0.5 ms per value even for an int
    (zip framing), a plain pickle a few microseconds, and the container is a function of the
    pickle: so a value that pickles to the same bytes as at the last save reuses its container."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[bytes, bytes]] = {}

    def serialize(self, fqn: str, value: Any) -> bytes:
        try:
            pickled = pickle.dumps(value, protocol=2)
        except Exception:  # torch.save may still manage (it pickles storages its own way)
            pickled = None
        last = self._last.get(fqn)
        if pickled is not None and last is not None and last[0] == pickled:
            return last[1]
        buffer = io.BytesIO()
        torch.save(value, buffer)
        data = buffer.getvalue()
        if pickled is not None:
            self._last[fqn] = (pickled, data)
        return data


def _worker_error(request, error: str) -> CheckpointError:
    """Rebuild a writer's failure in the training process; ours already name path and rank."""
    for kind in (CheckpointTimeoutError, CheckpointWriteError):
        prefix = f"{kind.__name__}: "
        if error.startswith(prefix):
            return kind(error[len(prefix):])
    where = getattr(request, "final_path", None) or getattr(request, "path", None) or "checkpoint"
    return CheckpointWriteError(f"rank {getattr(request, 'rank', '?')}: {where} failed: {error}")


def _unwrap(error: CheckpointException) -> BaseException:
    """DCP wraps per-rank failures; surface ours (they already name path, key and rank)."""
    for rank, (exception, _traceback) in sorted(error.failures.items()):
        if isinstance(exception, CheckpointError):
            return exception
    return error


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank_and_world(group) -> tuple[int, int]:
    """This rank and the world size: from the process group, else from the launcher's env vars
    (so ``use_collectives=False`` works in jobs that never initialise torch.distributed)."""
    if _dist_ready():
        return dist.get_rank(group), dist.get_world_size(group)
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


_live_checkpointers: "weakref.WeakSet[Checkpointer]" = weakref.WeakSet()


@atexit.register
def _drain_at_exit() -> None:
    """A process that exits normally never loses a save that async_save accepted."""
    for checkpointer in list(_live_checkpointers):
        try:
            checkpointer.close()
        except BaseException as e:  # nothing to raise to at exit: report it
            print(f"asyncckpt: a checkpoint save failed during exit: {e}", file=sys.stderr)
