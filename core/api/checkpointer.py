"""``Checkpointer``: the one object every save goes through, from users and from every adapter.

More: docs/MODULES.md, core/api/checkpointer.py.
"""
from __future__ import annotations

import itertools
import os
import time
from typing import Any, Callable, Iterable, Optional, TypeVar

import torch.distributed as dist

from asyncckpt.core.api import interval, lifecycle
from asyncckpt.core.api.commit_hooks import OnCommit
from asyncckpt.core.api.directory import DirectoryContext, DirectoryTransaction, directory_id
from asyncckpt.core.api.follow_ups import FollowUps
from asyncckpt.core.api.options import CheckpointOptions, resolve, taking_options
from asyncckpt.core.api.parts import Parts
from asyncckpt.core.client.handles import SaveHandle
from asyncckpt.core.errors import CheckpointError, CheckpointWriteError
from asyncckpt.core.export.options import ExportOptions
from asyncckpt.core.formats import names
from asyncckpt.core.loading.state_dict import load_checkpoint
from asyncckpt.core.snapshot.collectives import any_rank, release
from asyncckpt.core.snapshot.dist_env import dist_ready, rank_and_world
from asyncckpt.core.snapshot.file_snapshots import tensor_bytes
from asyncckpt.core.snapshot.handoff import SnapshotThread
from asyncckpt.core.storage import file_checksums, orphans
from asyncckpt.core.storage import object_store as object_store_module
from asyncckpt.core.storage.backend import backend_for, normalize
from asyncckpt.core.verify import checking, integrity
from asyncckpt.core.writer.barrier import BarrierSpec
from asyncckpt.core.writer.file_requests import FileRequest

STATE_DICT = dict[str, Any]
T = TypeVar("T")


class Checkpointer:
    """Owns the snapshot buffers, the background writer and the plan cache across saves.

    Takes every option of ``CheckpointOptions`` (the same names, defaults and meanings as every adapter's) as
    keyword arguments, or the object as ``options``, and these of its own (an adapter decides them from its
    framework):

    Args:
        process_group: group for the (tiny) structure agreement and cold planning; default: world.
        use_collectives: False saves and loads with no cross-rank communication (ranks meet
            only through the filesystem); replicated tensors are then written by every rank.
        overlap_snapshot: take the whole snapshot on the snapshot thread; the caller must not mutate
            the state until ``handle.wait_snapshot()`` (``snapshot_thread.guard(optimizer)`` does that for you).

    ``snapshot_thread`` (``handoff.SnapshotThread``) runs snapshots that overlap what the caller does next.
    """

    @taking_options
    def __init__(self, options: Optional[CheckpointOptions] = None, *,
                 process_group: Optional[dist.ProcessGroup] = None, use_collectives: bool = True,
                 overlap_snapshot: bool = False, **kwargs: Any) -> None:
        self.options, own = resolve("Checkpointer", options, kwargs, own=("overlap_snapshot",))
        overlap_snapshot = own.get("overlap_snapshot", overlap_snapshot)
        self.process_group, self.use_collectives, self.overlap_snapshot = process_group, use_collectives, overlap_snapshot
        self.timeout, self.object_store = self.options.timeout, self.options.object_store
        self._parts = parts = Parts.build(self.options, process_group, use_collectives)
        self._ledger, self._tier = parts.ledger, parts.tier
        self.snapshot_thread: SnapshotThread = parts.snapshot_thread
        self._follow = FollowUps(parts, self._admit)
        self._cadence = interval.Cadence(self.timeout, self.options.failures_per_day, parts.tier.placement)
        self._directories = itertools.count(1)  # directories begun, for their ids without a Store (``directory_id``)
        self._first_step: Any = None  # ``start(at_first_step=True)``'s optimizer hook, until ``teardown``
        lifecycle.track(self)

    def __getstate__(self) -> dict:
        return {"options": self.options, "use_collectives": self.use_collectives, "overlap_snapshot": self.overlap_snapshot}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state.pop("options"), **state)

    def __repr__(self) -> str:
        pid = self.writer_pid()
        return (f"Checkpointer(max_in_flight={self.options.max_in_flight}, pending={len(self.pending())}, "
                f"writer={'stopped' if pid is None else f'running (pid {pid})'})")

    @property
    def stats(self):
        """Requests by kind, and removals/links queued behind a pending save (a ``Counter``)."""
        return self._parts.stats

    @property
    def closed(self) -> bool:
        return self._parts.closed

    def writer_pid(self) -> Optional[int]:
        """The background writer's process id while it runs, else None (for a job's own supervision and logs)."""
        return self._ledger.queue.writer_pid

    # ------------------------------------------------------------------ sharded (SPMD) saves
    def save(self, state_dict: STATE_DICT, path: str | os.PathLike, **options: Any) -> None:
        """Save and return once the checkpoint is committed on every rank (streamed: the caller
        waits for the disk anyway)."""
        self.async_save(state_dict, path, stream=True, **options).result()

    def async_save(self, state_dict: STATE_DICT, path: str | os.PathLike, *,
                   process_group: Optional[dist.ProcessGroup] = None, use_collectives: Optional[bool] = None,
                   step: Optional[int] = None, label: Optional[str] = None,
                   extra_files: Optional[dict[str, bytes]] = None, overlap_snapshot: Optional[bool] = None,
                   stream: bool = False, durable: Optional[bool] = None) -> SaveHandle:
        """Snapshot ``state_dict`` and return; the write and commit happen in the background.

        ``extra_files`` (name -> bytes) are written by rank 0 into the checkpoint before its commit. ``step`` and
        ``label`` name the save in its errors (``step`` orders ``latest_checkpoint``). ``stream``: the writer writes
        each part as soon as it is copied (durable sooner, a slower copy: only ``save`` streams; docs/DESIGN.md)."""
        self._check_open()
        group = process_group if process_group is not None else self.process_group
        collectives = (self.use_collectives if use_collectives is None else use_collectives) and dist_ready()
        path = self._parts.placed(normalize(path), durable, lambda: tensor_bytes(state_dict), step,
                            agree_over=group if collectives else None)
        overlap = self.overlap_snapshot if overlap_snapshot is None else overlap_snapshot
        self.snapshot_thread.wait()  # one snapshot at a time: saves agree on their structures in call order
        target = self._parts.sharded.target(path, group, collectives, self._parts.store, step=step, extra_files=extra_files,
                                     object_store=self.object_store, tier=self._tier.save_tier(path, group),
                                     file_buffers=self._tier.file_buffers(path))
        world, agreement = target.world, target.agreement
        handle = self._admit("save", path, rank=target.rank, step=step, label=label)
        started = time.perf_counter()

        def prepare(speculate: bool):
            prepared = self._parts.sharded.prepare(state_dict, target, handle, speculate=speculate,
                                            failed_here=self._ledger.has_unobserved,
                                            raise_failures=self._ledger.raise_unobserved, timings=handle.timings)
            handle.when_done(lambda: self._parts.buffers.give_back(prepared.slot))
            handle.add_bytes(prepared.slot.buffer.layout.size)
            handle.timings["prepare_s"] = time.perf_counter() - started
            return prepared

        def snapshot(prepared) -> None:
            submit = lambda: self._ledger.queue.submit([(handle, prepared.request, prepared.slot.buffer),  # noqa: E731
                                                       *self._follow.handed_with(handle, prepared.request.barrier)])
            self._parts.handoff.take_snapshot(handle, prepared.begin, prepared.request, submit, stream=stream)

        if overlap and (world == 1 or not collectives or agreement.own):
            # the whole snapshot (flatten, describe, agree on a group of our own, copy) runs in the
            # background: the caller waits for nothing but a thread start
            self.snapshot_thread.run(lambda: self._parts.handoff.in_background(handle, lambda: snapshot(prepare(False))))
            return handle
        prepared = self._parts.handoff.in_foreground(handle, lambda: prepare(not overlap))
        if overlap:  # the caller's own group must not be used from another thread: only the copy is overlapped
            self.snapshot_thread.run(lambda: self._parts.handoff.in_background(handle, lambda: snapshot(prepared)))
            return handle
        self._parts.handoff.in_foreground(handle, lambda: snapshot(prepared))
        self._ledger.raise_unobserved()  # an older save's failure that completed meanwhile
        return handle

    def load(self, state_dict: STATE_DICT, path: str | os.PathLike, *, process_group: Optional[dist.ProcessGroup] = None,
             strict: bool = True, verify: Optional[bool] = None, use_collectives: Optional[bool] = None) -> None:
        """Load a committed checkpoint into ``state_dict`` in place, resharding as needed (``loading``), once a save
        of ``path`` in flight is done. With the memory tier, this node's writer then serves its memory (``Tier.serve``)."""
        path = normalize(path)
        self.wait_for(path)
        try:
            with object_store_module.using(self.object_store):
                load_checkpoint(state_dict, path,
                                group=process_group if process_group is not None else self.process_group,
                                collectives=self.use_collectives if use_collectives is None else use_collectives,
                                strict=strict, verify=self.options.verify if verify is None else verify,
                                io_threads=self.options.io_threads, timeout=self.options.timeout,
                                readers=self.options.cooperative_load)
        finally:
            self._tier.serve()

    # ------------------------------------------------------------------ native files and directories
    def async_save_file(self, obj: Any, path: str | os.PathLike, *, format: str = "torch",
                        metadata: Optional[dict[str, str]] = None, step: Optional[int] = None,
                        label: Optional[str] = None, durable: Optional[bool] = None) -> SaveHandle:
        """Write one native file in the background: ``format="torch"`` is what ``torch.save(obj)`` writes;
        ``"safetensors"`` what ``safetensors.torch.save_file(obj, metadata=...)`` writes. Rank-local; the snapshot is
        taken before returning; the file appears only complete and fsynced; saves to one path keep their order."""
        self._check_open()
        self._ledger.raise_unobserved()
        image = self._parts.files.image(obj, format, metadata)
        path = self._parts.placed(normalize(path), durable, lambda: image.size, step)
        handle = self._admit("file", path, rank=rank_and_world(self.process_group)[0], step=step, label=label)
        slot = self._parts.buffers.take_for_file(image.size, handle)
        handle.add_bytes(image.size)
        handle.when_done(lambda: self._parts.buffers.give_back(slot))
        request = FileRequest(path, image.size, handle.rank, self.options.direct_io, self.options.io_threads,
                              object_store=self.object_store)
        self._parts.handoff.take_snapshot(handle, lambda: self._parts.files.stage(image, slot), request,
                                  lambda: self._ledger.queue.submit([(handle, request, slot.buffer),
                                                                    *self._follow.handed_with(handle)]))
        return handle

    def save_file(self, obj: Any, path: str | os.PathLike, **options: Any) -> None:
        self.async_save_file(obj, path, **options).result()

    def begin_directory(self, final_dir: str | os.PathLike, *, step: Optional[int] = None, label: Optional[str] = None,
                        staging_parent: Optional[str | os.PathLike] = None,
                        durable: Optional[bool] = None) -> DirectoryTransaction:
        """Start a checkpoint directory of native files (SPMD: every rank calls it for the same directories in the
        same order): ``tx.save_file`` / ``tx.write_bytes``, then ``tx.commit()``; ``with`` aborts it on an exception.
        Its staging directory is a hidden sibling of ``final_dir``, or in ``staging_parent`` (same filesystem)."""
        self._check_open()
        if backend_for(final_dir).remote:
            raise ValueError(f"begin_directory({os.fspath(final_dir)!r}): a directory of native files is written to a local "
                             "path; to keep it in an object store, mirror it there once committed (Checkpointer.mirror, "
                             "or the adapters' mirror option)")
        self.snapshot_thread.wait()  # the previous directory may still be committed from the snapshot thread
        self._ledger.raise_unobserved()
        final_dir = asked = os.path.abspath(os.fspath(final_dir))
        placed = self._parts.placed(final_dir, durable, lambda: 0, step,
                              agree_over=self.process_group if self.use_collectives and dist_ready() else None)
        if placed != final_dir:  # in memory, where nothing counts the entries beside it
            final_dir, staging_parent = placed, None
        rank, world = rank_and_world(self.process_group)
        handle = self._admit("directory", final_dir, rank=rank, step=step, label=label)  # one checkpoint in flight
        store = self._parts.store() if self.use_collectives and world > 1 else None
        save_id = directory_id(asked, rank, world, store, lambda: next(self._directories))  # the path asked for: a memory path differs by node
        staging_dir = names.staging_dir_for(final_dir, save_id, os.fspath(staging_parent) if staging_parent else None)
        barrier = BarrierSpec("store" if store is not None else "files", save_id, world, staging_dir, final_dir, self.timeout)
        collectives = self.use_collectives and dist_ready()
        save_tier, file_buffers = self._tier.save_tier(final_dir, self.process_group), self._tier.file_buffers(final_dir)

        def sharded_target(path: str, group: Optional[dist.ProcessGroup], **details: Any):
            return self._parts.sharded.target(path, group if group is not None else self.process_group, collectives,
                                              self._parts.store, tier=save_tier, file_buffers=file_buffers, **details)

        context = DirectoryContext(self._parts, sharded_target, self._follow.handed_with)
        return DirectoryTransaction(context, handle, save_id=save_id, staging_dir=staging_dir, barrier=barrier,
                                    tier=save_tier)

    # ------------------------------------------------------------------ after a commit (``follow_ups``)
    def remove(self, paths: Iterable[str | os.PathLike], *, after: Optional[SaveHandle] = None,
               hidden_parent: Optional[str | os.PathLike] = None) -> SaveHandle:
        """Remove files or checkpoint directories in the background (``FollowUps.remove``)."""
        return self._follow.remove(paths, after=after, hidden_parent=hidden_parent)

    def link(self, target: str | os.PathLike, linkpath: str | os.PathLike, *,
             after: Optional[SaveHandle] = None) -> SaveHandle:
        """Point ``linkpath`` at ``target`` in the background (``FollowUps.link``)."""
        return self._follow.link(target, linkpath, after=after)

    def apply_retention(self, root: str | os.PathLike, pattern: str, *, keep_last: Optional[int],
                        keep_every: Optional[int], after: Optional[SaveHandle] = None) -> SaveHandle:
        """Delete the checkpoints under ``root`` that retention does not keep (``FollowUps.apply_retention``)."""
        return self._follow.apply_retention(root, pattern, keep_last=keep_last, keep_every=keep_every, after=after)

    def mirror(self, path: str | os.PathLike, url: str, *, after: Optional[SaveHandle] = None) -> SaveHandle:
        """Copy the committed checkpoint ``path`` to the object-store ``url`` (``FollowUps.mirror``)."""
        return self._follow.mirror(path, url, after=after)

    def restore_mirrored(self, url_root: str, local_root: str, name: Optional[str] = None) -> Optional[str]:
        """Before a resume: the newest mirrored checkpoint restored here (``FollowUps.restore_mirrored``)."""
        return self._follow.restore_mirrored(url_root, local_root, name)

    def export(self, path: str | os.PathLike, options: Optional[ExportOptions | str] = None, *,
               after: Optional[SaveHandle] = None) -> SaveHandle:
        """Export the committed checkpoint ``path``'s weights as safetensors (``FollowUps.export``)."""
        return self._follow.export(path, options, after=after)

    def after_commit(self, checkpoint: SaveHandle, action: OnCommit) -> SaveHandle:
        """Run ``action(path)`` once ``checkpoint`` committed (``FollowUps.after_commit``)."""
        return self._follow.after_commit(checkpoint, action)

    # ------------------------------------------------------------------ waiting and questions
    def wait(self, timeout: Optional[float] = None, *, everywhere: bool = False) -> None:
        """Wait until everything accepted so far is done (checkpoints committed, what they replaced
        or removed deleted); raise the first failure nobody has seen. With ``everywhere`` (a
        collective: every rank calls it), a failure on any rank raises on every rank."""
        self.snapshot_thread.wait()
        error: Optional[BaseException] = None
        try:
            self._ledger.wait(timeout)
        except CheckpointError as e:
            error = e
        if everywhere and any_rank(error is not None, self.process_group) and error is None:
            error = CheckpointWriteError("asyncckpt: a checkpoint save failed on another rank (its error is raised there)")
        if error is not None:
            raise error

    def latest_checkpoint(self, root: str | os.PathLike) -> Optional[str]:
        """The newest committed checkpoint of ``root`` to resume from, in any tier of this node (as
        ``asyncckpt.core.latest_checkpoint``); with the memory tier on several nodes a collective, in which the nodes
        agree on it and complete their copies (``Tier.latest_checkpoint``, ``Tier.assemble``)."""
        root = normalize(root)
        self.wait()
        return self._tier.latest_checkpoint(root, self.process_group, self.timeout)

    def wait_for(self, path: str | os.PathLike) -> None:
        """Wait for pending work on ``path`` (a read must never see a checkpoint being written);
        raise its failure if nobody has seen it. With the memory tier: its memory copy's too."""
        path = normalize(path)
        self._ledger.wait_for(path)
        memory = self._tier.memory_path(path)
        if memory is not None:
            self._ledger.wait_for(memory)

    def raise_failures(self) -> None:
        """Raise (once) a failure of earlier work that nobody has seen; never waits."""
        self._ledger.raise_unobserved()

    def will_exist(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` will exist once the queued work has run: what the last queued work on it
        does (a save or link creates it, a removal deletes it), else whether it exists now. With the memory tier,
        a checkpoint exists in either tier (its memory copy: what a resume would load)."""
        path = normalize(path)
        memory = self._tier.memory_path(path)
        return (memory is not None and self._parts.will_exist(memory)) or self._parts.will_exist(path)

    def pending(self) -> list[SaveHandle]:
        """Checkpoints, removals and links not done yet, oldest first."""
        return self._ledger.pending()

    def checkpoints_in(self, root: str | os.PathLike, list_on_disk: Callable[[], Iterable[str | os.PathLike]]) -> list[str]:
        """The checkpoints directly under ``root`` once the queued work has run, as a framework's
        rotation must count them: those ``list_on_disk()`` finds (in the framework's own order) less those
        queued for removal, then the directories being saved there, in the order they were saved. The
        saves in flight are taken before the listing: one committing in between is then found in both
        (counted once), never in neither."""
        root = os.path.abspath(os.fspath(root))
        in_flight = [h.path for h in self.pending() if h.kind == "directory" and os.path.dirname(h.path) == root]
        found = [p for p in map(os.path.abspath, map(os.fspath, list_on_disk())) if p not in in_flight]
        return [p for p in found + in_flight if self.will_exist(p)]

    # ------------------------------------------------------------------ before a framework loads (``verify.checking``)
    def require_intact(self, path: str | os.PathLike, *, everywhere: bool = False,
                       check_file: integrity.FileCheck = file_checksums.problem) -> integrity.Report:
        """Check ``path`` against its checksums before anything is loaded from it; raise ``CorruptCheckpointError``
        naming what is damaged (``verify.checking``; ``everywhere``: a collective, any rank's problem raises on all)."""
        return checking.require_intact(normalize(path), group=self.process_group, object_store=self.object_store,
                                       everywhere=everywhere, check_file=check_file)

    def load_while_checking(self, path: str | os.PathLike, load: Callable[[], T], *, everywhere: bool = False) -> T:
        """``load()`` (a framework's own load of ``path``, in place) while a thread checks ``path`` over the pages the
        load reads: the disk is read once (``verify.checking``). Its result, or ``CorruptCheckpointError``."""
        return checking.load_while_checking(normalize(path), load, group=self.process_group,
                                            object_store=self.object_store, everywhere=everywhere,
                                            after_load=self._tier.serve)  # as ``load``: a restart serves its memory

    # ------------------------------------------------------------------ the memory tier's verbs for the adapter kit
    @property
    def memory_tier_active(self) -> bool:
        return self._tier.active

    def memory_places(self, durable_root: str) -> list[str]:
        """Where the checkpoints of ``durable_root`` may be on this node: it, then its memory run directory."""
        return self._tier.places(durable_root)

    def assemble_from_memory(self, durable_root: str, *, single_files: Optional[Callable[[str], bool]] = None) -> Any:
        """A collective on several nodes: agree on the newest checkpoint held in memory, complete this node's copy."""
        return self._tier.assemble(durable_root, self.process_group, single_files=single_files)

    def usable_in_memory(self, run_directory: str) -> set[str]:
        """The names in a memory run directory a resume may pick (on several nodes: what every node holds)."""
        return self._tier.usable(run_directory)

    def expect_replicas(self, durable_root: str) -> None:
        """From now on, accept other nodes' replicas of the checkpoints of ``durable_root``."""
        self._tier.expect(durable_root)

    # ------------------------------------------------------------------ lifecycle
    def start(self, *, at_first_step: bool = False) -> None:
        """Start the background writer now, in the background, and keep it until ``teardown()`` (its saves never
        wait for a writer stopped when idle). With ``at_first_step`` (the adapters'), at the first optimizer step
        or save instead: a resume's load comes first, and the writer's start-up would take its cores (docs/DESIGN.md,
        Measured). With the memory tier, this rank finds the job's nodes now either way."""
        self._check_open()
        if at_first_step and not self._ledger.queue.running:
            self._tier.connect(serve=False)  # the writer serves the node's memory once it starts
            if self._first_step is None:
                self._first_step = lifecycle.start_at_first_step(self)
            return
        self._ledger.queue.start(hold=True)
        self._tier.connect()

    def teardown(self, *, free_buffers: bool = False) -> None:
        """Drain, then stop the writer process and every thread of ours (a framework's run ended). The snapshot
        buffers and plans are kept for the next run, unless ``free_buffers``. Raises a failure nobody has seen. A
        directory begun and never committed is aborted first: nothing of it is left beside the checkpoints."""
        try:
            self.snapshot_thread.wait()  # a commit left to the snapshot thread lands first
            for handle in self._ledger.uncommitted():
                handle.transaction.abandon()
            self.wait()
            self._follow.finish_memory_tier(lambda: self.wait(everywhere=True))
            self._cadence.log_advice()  # if no save came after the first durable one
        finally:
            self._stop_threads()
            if free_buffers:
                self._parts.buffers.close()

    def close(self) -> None:
        """``teardown()``, and free the snapshot buffers; the Checkpointer cannot be used again."""
        if self.closed:
            return
        try:
            self.teardown()
        finally:
            self._ledger.abandon_uncommitted()
            self._parts.closed = True
            self._parts.buffers.close()
            self._tier.close()
            lifecycle.forget(self)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _stop_threads(self) -> None:
        try:
            self.snapshot_thread.wait()
        finally:
            if self._first_step is not None:
                self._first_step.remove()
                self._first_step = None
            self._parts.hooks.stop()
            self._ledger.queue.stop()
            self._parts.copy_threads.stop()
            self._parts.sharded.close()
            release()  # the groups of the caller's collectives (made again where needed)

    # ------------------------------------------------------------------ internals
    def _check_open(self) -> None:
        self._parts.check_open()

    def _admit(self, kind: str, path: str, **details: Any) -> SaveHandle:
        if kind in ("save", "file", "directory") and not backend_for(path).remote:
            orphans.wait_for_orphans(os.path.dirname(path), self.timeout)  # never save over what one commits
        self._parts.stats[kind] += 1
        if kind in ("save", "file", "directory"):
            self._cadence.saving(details.get("step"))
        admitted = time.perf_counter()
        handle = self._ledger.admit(kind, path, **details)
        if handle.is_checkpoint or kind == "persist":  # seconds from the save call (or the persist's queueing) to commit
            handle.when_done(lambda: self._cadence.committed(handle, time.perf_counter() - admitted))
        if handle.is_checkpoint:
            self._follow.queue_commit_work(handle)
        for path in handle.paths:  # the writer changed it: what this process's fsspec cached of it is stale
            if backend_for(path).remote:
                handle.when_done(lambda path=path: object_store_module.forget_listings(path, self.object_store))
        return handle
