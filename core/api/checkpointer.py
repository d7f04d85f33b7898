"""``Checkpointer``: the one object every save goes through, from users and from every adapter.

A short facade over the parts that do the work:

* ``ledger.Ledger``: all pending work (handles), back-pressure per checkpoint, the one
  error rule, what is pending per path, and the ``WriterQueue`` into the background writer;
* ``sharded_save.ShardedSaves``: the caller's part of an SPMD save (flatten, agree, plan, buffer);
* ``file_snapshots.FileSnapshots``: native files (``torch.save``, safetensors) for the adapters;
* ``directory.DirectoryTransaction``: a framework's checkpoint directory, published at once;
* ``handoff.Stager``: the snapshot copy and hand-over, and the staging thread;
* ``buffer_pool.BufferPool``: staging buffers, allocated once and reused;
* ``loading``: loads.

Lifecycle: the background writer starts on first use (or ``start()``) and stops at
``teardown()`` (a framework's run ended: nothing of ours keeps running) or ``close()`` (which
also frees the buffers); a save after ``teardown()`` starts it again. Every live Checkpointer is
drained at interpreter exit (``lifecycle``). A Checkpointer pickles as its options: the copy is a
fresh one, with nothing in flight.
"""
from __future__ import annotations

import hashlib
import logging
import os
import posixpath
import shutil
import threading
import time
import weakref
from collections import Counter
from typing import Any, Callable, Iterable, Optional, TypeVar

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from asyncckpt.core.verify import integrity
from asyncckpt.core.storage import file_checksums
from asyncckpt.core.storage import orphans, owners
from asyncckpt.core.api import lifecycle
from asyncckpt.core.formats import names
from asyncckpt.core.storage import object_store as object_store_module
from asyncckpt.core.writer.barrier import BarrierSpec
from asyncckpt.core.snapshot.buffer_pool import BufferPool
from asyncckpt.core.client.ledger import Ledger
from asyncckpt.core.api.commit_hooks import CommitHooks, OnCommit
from asyncckpt.core.api.options import CheckpointOptions, resolve, taking_options
from asyncckpt.core.api import interval
from asyncckpt.core.tier.job import tier_of
from asyncckpt.core.api.directory import DirectoryTransaction
from asyncckpt.core.snapshot.collectives import any_rank, over, release
from asyncckpt.core.snapshot.dist_env import default_store, dist_ready, rank_and_world
from asyncckpt.core.storage.commit import job_token
from asyncckpt.core.errors import (
    CheckpointCancelledError,
    CheckpointError,
    CheckpointWriteError,
    CorruptCheckpointError,
)
from asyncckpt.core.writer.file_requests import FileRequest, LinkRequest, RemoveRequest
from asyncckpt.core.storage.backend import backend_for, exists, normalize
from asyncckpt.core.snapshot.file_snapshots import FileSnapshots, tensor_bytes
from asyncckpt.core.client.handles import SaveHandle
from asyncckpt.core.loading import cooperative
from asyncckpt.core.loading.state_dict import load_checkpoint
from asyncckpt.core.writer import mirror
from asyncckpt.core.writer.mirror import CopyRequest
from asyncckpt.core.writer.retention import RetentionRequest
from asyncckpt.core.export.options import ExportOptions, as_options
from asyncckpt.core.export.request import ExportRequest
from asyncckpt.core.snapshot.sharded_save import ShardedSaves
from asyncckpt.core.snapshot.handoff import Stager
from asyncckpt.core.snapshot.tensor_copy import CopyThreads


logger = logging.getLogger("asyncckpt.core")
STATE_DICT = dict[str, Any]
T = TypeVar("T")
class Checkpointer:
    """Owns the staging buffers, the background writer and the plan cache across saves.

    Takes every option of ``CheckpointOptions`` (``asyncckpt.core.CheckpointOptions``: the same names, defaults
    and meanings as every adapter's) as keyword arguments, or the object as ``options``, and these of its own,
    which say how the core's own SPMD calls run (an adapter decides them from its framework):

    Args:
        process_group: group for the (tiny) structure agreement and cold planning; default: world.
        use_collectives: False saves and loads with no cross-rank communication (ranks meet
            only through the filesystem); replicated tensors are then written by every rank.
        overlap_staging: take the whole snapshot in a background thread; the caller must not mutate
            the state until ``handle.wait_staged()`` (``guard(optimizer)`` does that for you).
    """

    @taking_options
    def __init__(self, options: Optional[CheckpointOptions] = None, *,
                 process_group: Optional[dist.ProcessGroup] = None, use_collectives: bool = True,
                 overlap_staging: bool = False, **kwargs: Any) -> None:
        self.options, _ = resolve("Checkpointer", options, kwargs)
        self.process_group, self.use_collectives, self.overlap_staging = process_group, use_collectives, overlap_staging
        options = self.options
        self.timeout, self.object_store = options.timeout, options.object_store
        self.ledger = Ledger(max_in_flight=options.max_in_flight, timeout=options.timeout, store=self._store,
                                  writer_idle_timeout=options.writer_idle_timeout)
        self.hooks = CommitHooks(self.ledger)
        self.buffers = BufferPool(self.ledger.queue.drop_buffer)
        self.copy_threads = CopyThreads()
        self.stager = Stager(self.ledger, self._store, options.timeout)
        self.files = FileSnapshots(self.buffers, self.copy_threads)
        self.sharded = ShardedSaves(self.buffers, self.copy_threads, direct_io=options.direct_io,
                                    io_threads=options.io_threads, timeout=options.timeout,
                                    share_unchanged=options.share_unchanged)
        self.tier = tier_of(options, store=self._store, queue=self.ledger.queue, process_group=process_group)
        self._advice: Optional[interval.Advice] = None  # from the first durable save's costs (``_committed``)
        self._advice_logged = False  # once, at the save after it (``_saving``)
        self._saves: tuple[Optional[float], Optional[tuple[Optional[int], float]], int] = (None, None, 0)  # when the
        # first checkpoint was saved, (step, when) of the latest, and how many (of different steps): ``_saving``
        self._warned_slow = False  # a checkpoint took more than half the timeout (``_committed``), said once
        self._deferred_hooks: dict[str, list[Callable[[SaveHandle], Any]]] = {}  # memory path -> its hooks (``_when_durable``)
        self.stats: Counter = Counter()  # requests by kind, and removals/links queued behind a pending save
        self.closed = False
        self._directories = 0
        self._first_step: Any = None  # ``start(at_first_step=True)``'s optimizer hook, until ``teardown``
        lifecycle.track(self)

    def __getstate__(self) -> dict:
        return {"options": self.options, "use_collectives": self.use_collectives, "overlap_staging": self.overlap_staging}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state.pop("options"), **state)

    def __repr__(self) -> str:
        return (f"Checkpointer(max_in_flight={self.options.max_in_flight}, pending={len(self.pending())}, "
                f"writer={'running' if self.ledger.queue.running else 'stopped'})")

    # ------------------------------------------------------------------ sharded (SPMD) saves
    def save(self, state_dict: STATE_DICT, path: str | os.PathLike, **options: Any) -> None:
        """Save and return once the checkpoint is committed on every rank (streamed: the caller
        waits for the disk anyway)."""
        self.async_save(state_dict, path, stream=True, **options).result()

    def async_save(self, state_dict: STATE_DICT, path: str | os.PathLike, *,
                   process_group: Optional[dist.ProcessGroup] = None, use_collectives: Optional[bool] = None,
                   step: Optional[int] = None, label: Optional[str] = None,
                   extra_files: Optional[dict[str, bytes]] = None, overlap_staging: Optional[bool] = None,
                   stream: bool = False, durable: Optional[bool] = None) -> SaveHandle:
        """Snapshot ``state_dict`` and return; the write and commit happen in the background.

        ``extra_files`` (name -> bytes) are written by rank 0 into the checkpoint directory
        before it is committed (e.g. a framework's own metadata file). ``step`` and ``label``
        name the save in its errors (and ``step`` orders ``latest_checkpoint``).

        ``stream``: the writer writes each part of the snapshot as soon as it is copied, rather
        than once the copy is complete: the checkpoint is durable sooner, but the writer's I/O
        slows the copy the caller waits for, so only ``save``, whose caller waits for the disk
        anyway, streams by default (figures in docs/DESIGN.md).
        """
        self._check_open()
        group = process_group if process_group is not None else self.process_group
        collectives = (self.use_collectives if use_collectives is None else use_collectives) and dist_ready()
        path = self._placed(_normalize(path), durable, lambda: tensor_bytes(state_dict), step,
                            agree_over=group if collectives else None)
        overlap = self.overlap_staging if overlap_staging is None else overlap_staging
        self.stager.wait()  # one snapshot at a time: saves agree on their structures in call order
        target = self.sharded.target(path, group, collectives, self._store, step=step, extra_files=extra_files,
                                     object_store=self.object_store, tier=self.tier.save_tier(path, group),
                                     file_buffers=self.tier.file_buffers(path))
        world, agreement = target.world, target.agreement
        handle = self._admit("save", path, rank=target.rank, step=step, label=label)
        started = time.perf_counter()

        def prepare(speculate: bool):
            prepared = self.sharded.prepare(state_dict, target, handle, speculate=speculate,
                                            failed_here=self.ledger.has_unobserved,
                                            raise_failures=self.ledger.raise_unobserved, timings=handle.timings)
            handle.when_done(lambda: self.buffers.give_back(prepared.slot))
            handle.add_bytes(prepared.slot.buffer.layout.size)
            handle.timings["prepare_s"] = time.perf_counter() - started
            return prepared

        def snapshot(prepared) -> None:
            submit = lambda: self.ledger.queue.submit([(handle, prepared.request, prepared.slot.buffer),  # noqa: E731
                                                       *self._follow_ups(handle, prepared.request.barrier)])
            self.stager.take_snapshot(handle, prepared.begin, prepared.request, submit, stream=stream)

        if overlap and (world == 1 or not collectives or agreement.own):
            # the whole snapshot (flatten, describe, agree on a group of our own, copy) runs in the
            # background: the caller waits for nothing but a thread start
            self.stager.run(lambda: self._in_background(handle, lambda: snapshot(prepare(False))))
            return handle
        prepared = self._foreground(handle, lambda: prepare(not overlap))
        if overlap:  # the caller's own group must not be used from another thread: only the copy is overlapped
            self.stager.run(lambda: self._in_background(handle, lambda: snapshot(prepared)))
            return handle
        self._foreground(handle, lambda: snapshot(prepared))
        self.ledger.raise_unobserved()  # an older save's failure that completed meanwhile
        return handle

    def load(self, state_dict: STATE_DICT, path: str | os.PathLike, *, process_group: Optional[dist.ProcessGroup] = None,
             strict: bool = True, verify: Optional[bool] = None, use_collectives: Optional[bool] = None) -> None:
        """Load a committed checkpoint into ``state_dict`` in place, resharding as needed (``loading``).
        Waits for a save of ``path`` still in flight first. With the memory tier on several nodes, this node's
        writer serves its memory to the others from then on, if a restart left that until its load
        (``Tier.assemble``)."""
        path = _normalize(path)
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
            self.tier.serve()

    # ------------------------------------------------------------------ native files and directories
    def async_save_file(self, obj: Any, path: str | os.PathLike, *, format: str = "torch",
                        metadata: Optional[dict[str, str]] = None, step: Optional[int] = None,
                        label: Optional[str] = None, durable: Optional[bool] = None) -> SaveHandle:
        """Write one native file in the background: ``format="torch"`` is what ``torch.save(obj)``
        writes; ``"safetensors"`` what ``safetensors.torch.save_file(obj, metadata=...)`` writes.

        Rank-local (no collectives). The snapshot (structure and tensor bytes) is taken before
        returning; the file appears under ``path`` only complete and fsynced. Requests run in
        submission order, so repeated saves to one path keep their order.
        """
        self._check_open()
        self.ledger.raise_unobserved()
        image = self.files.image(obj, format, metadata)
        path = self._placed(_normalize(path), durable, lambda: image.size, step)
        handle = self._admit("file", path, rank=rank_and_world(self.process_group)[0], step=step, label=label)
        slot = self.buffers.take_for_file(image.size, handle)
        handle.add_bytes(image.size)
        handle.when_done(lambda: self.buffers.give_back(slot))
        request = FileRequest(path, image.size, handle.rank, self.options.direct_io, self.options.io_threads,
                              object_store=self.object_store)
        self.stager.take_snapshot(handle, lambda: self.files.stage(image, slot), request,
                                  lambda: self.ledger.queue.submit([(handle, request, slot.buffer),
                                                                    *self._follow_ups(handle)]))
        return handle

    def save_file(self, obj: Any, path: str | os.PathLike, **options: Any) -> None:
        self.async_save_file(obj, path, **options).result()

    def begin_directory(self, final_dir: str | os.PathLike, *, step: Optional[int] = None, label: Optional[str] = None,
                        staging_parent: Optional[str | os.PathLike] = None,
                        durable: Optional[bool] = None) -> DirectoryTransaction:
        """Start a checkpoint directory of native files (SPMD: every rank of the group calls it for
        the same directories in the same order). Stage files with ``tx.save_file`` /
        ``tx.write_bytes``, then ``tx.commit()``; ``with`` aborts it on an exception.

        The directory is staged as a hidden sibling of ``final_dir``, or in ``staging_parent`` (same
        filesystem) when a framework counts or lists every entry of the final directory's parent."""
        self._check_open()
        if backend_for(final_dir).remote:
            raise ValueError(f"begin_directory({os.fspath(final_dir)!r}): a directory of native files is written to a local "
                             "path; to keep it in an object store, mirror it there once committed (Checkpointer.mirror, "
                             "or the adapters' mirror option)")
        self.stager.wait()  # the previous directory may still be committed from the staging thread
        self.ledger.raise_unobserved()
        final_dir = asked = os.path.abspath(os.fspath(final_dir))
        placed = self._placed(final_dir, durable, lambda: 0, step,
                              agree_over=self.process_group if self.use_collectives and dist_ready() else None)
        if placed != final_dir:  # in memory, where nothing counts the entries beside it
            final_dir, staging_parent = placed, None
        rank, world = rank_and_world(self.process_group)
        handle = self._admit("directory", final_dir, rank=rank, step=step, label=label)  # one checkpoint in flight
        store = self._store() if self.use_collectives and world > 1 else None
        save_id = self._directory_id(asked, rank, world, store)  # the path asked for: a memory path differs by node
        staging_dir = names.staging_dir_for(final_dir, save_id, os.fspath(staging_parent) if staging_parent else None)
        barrier = BarrierSpec("store" if store is not None else "files", save_id, world, staging_dir, final_dir, self.timeout)
        collectives = self.use_collectives and dist_ready()
        save_tier, file_buffers = self.tier.save_tier(final_dir, self.process_group), self.tier.file_buffers(final_dir)

        def sharded_target(path: str, group: Optional[dist.ProcessGroup], **details: Any):
            return self.sharded.target(path, group if group is not None else self.process_group, collectives,
                                       self._store, tier=save_tier, file_buffers=file_buffers, **details)

        return DirectoryTransaction(handle=handle, save_id=save_id, staging_dir=staging_dir, barrier=barrier,
                                    ledger=self.ledger, stager=self.stager, files=self.files,
                                    sharded=self.sharded, sharded_target=sharded_target, follow_ups=self._follow_ups,
                                    direct_io=self.options.direct_io, io_threads=self.options.io_threads,
                                    share_unchanged=self.options.share_unchanged, tier=save_tier)

    def _directory_id(self, final_dir: str, rank: int, world: int, store: Any) -> str:
        """The same id on every rank without a collective: on one rank, an owner token (random, and
        it says whose the staging directory is, ``owners``); else each rank's count of
        directories it began at this path, kept in the Store (unique for the job, across
        Checkpointers) or, without one, in this Checkpointer with the job's run id."""
        if world == 1:
            return owners.owner_token()
        if store is not None:
            place = hashlib.blake2b(final_dir.encode(), digest_size=6).hexdigest()
            return f"d{place}-{store.add(f'asyncckpt/seq/{place}/{rank}', 1)}"
        self._directories += 1
        return f"d{self._directories}-{job_token()}"

    # ------------------------------------------------------------------ after a commit
    def remove(self, paths: Iterable[str | os.PathLike], *, after: Optional[SaveHandle] = None,
               hidden_parent: Optional[str | os.PathLike] = None) -> SaveHandle:
        """Remove files or checkpoint directories in the background, after everything queued
        before; with ``after``, only if that save succeeded. A directory is renamed out of every
        name a framework looks at first (into ``hidden_parent`` if given, on the same filesystem),
        then deleted once the writer has replied. With ``mirror_to``, their copies there go too (after the same
        save): the mirror keeps what the framework's retention keeps."""
        paths = tuple(_normalize(p) for p in paths)
        if len({backend_for(p).remote for p in paths}) > 1:
            raise ValueError(f"remove() takes local paths or URLs, not both at once: {paths}")
        mirror_root = self.options.mirror_to
        if mirror_root and not backend_for(paths[0]).remote:  # the mirror follows the framework's retention
            self.remove([posixpath.join(mirror_root, os.path.basename(path)) for path in paths], after=after)
        copies = [copy for copy in map(self.tier.memory_path, paths) if copy is not None and self._will_exist(copy)]
        if copies and backend_for(paths[0]).remote:  # the memory copies of checkpoints in an object store
            self.remove(copies, after=after)
        elif copies:
            paths += tuple(copies)
        request = RemoveRequest(list(paths), os.path.abspath(os.fspath(hidden_parent)) if hidden_parent else None,
                                object_store=self.object_store)
        if after is None and not self.ledger.queue.running and not self.pending():
            return self._remove_here(request, paths)
        return self._queue_after("remove", ", ".join(paths), request, after, paths=paths)

    def _remove_here(self, request: RemoveRequest, paths: tuple[str, ...]) -> SaveHandle:
        """A removal with nothing pending and no writer running (a process that saves nothing, such
        as Lightning's main process after ``ddp_spawn``) is done at once: no writer is started for it."""
        self._check_open()
        handle = self._admit("remove", ", ".join(paths), rank=rank_and_world(self.process_group)[0], paths=paths)
        handle.set_staged()
        try:
            request.run_here()
        except OSError as e:
            self.ledger.complete(handle, CheckpointWriteError(f"asyncckpt: {handle.describe()}: {type(e).__name__}: {e}"))
            self.ledger.raise_unobserved()
        else:
            self.ledger.complete(handle, None)
        return handle

    def link(self, target: str | os.PathLike, linkpath: str | os.PathLike, *,
             after: Optional[SaveHandle] = None) -> SaveHandle:
        """Point ``linkpath`` at ``target`` (relative symlink, replaced atomically) in the
        background, after everything queued before; with ``after``, only if that save succeeded."""
        if backend_for(target).remote or backend_for(linkpath).remote:
            raise ValueError(f"link({os.fspath(target)!r}, {os.fspath(linkpath)!r}): a symbolic link lives on a local "
                             "file system, not in an object store")
        target, linkpath = os.path.abspath(os.fspath(target)), os.path.abspath(os.fspath(linkpath))
        return self._queue_after("link", linkpath, LinkRequest(target, linkpath), after, label=f"-> {os.path.basename(target)}")

    def apply_retention(self, root: str | os.PathLike, pattern: str, *, keep_last: Optional[int],
                        keep_every: Optional[int], after: Optional[SaveHandle] = None) -> SaveHandle:
        """Delete the committed checkpoints under ``root`` (names matching ``pattern``, group 1 the
        step) that ``retention.select_deletions`` does not keep; with ``after``, only if that save succeeded."""
        root = _normalize(root)
        return self._queue_after("retention", root, RetentionRequest(root, pattern, keep_last, keep_every, self.object_store),
                                 after)

    def mirror(self, path: str | os.PathLike, url: str, *, after: Optional[SaveHandle] = None) -> SaveHandle:
        """Copy the committed checkpoint ``path`` (a directory, or a single file) to the object-store
        ``url`` and commit it there, in the background, after everything queued before; with ``after``,
        only if that save succeeded (``mirror``; ``mirror.restore`` brings one back)."""
        path, url = _normalize(path), _normalize(url)
        if not backend_for(url).remote:
            raise ValueError(f"mirror() copies to an object-store URL, not to {url}")
        return self._queue_after("mirror", url, CopyRequest(path, url, self.object_store), after)

    def restore_mirrored(self, url_root: str, local_root: str, name: Optional[str] = None) -> Optional[str]:
        """Before a resume: the newest committed checkpoint under ``url_root`` (``mirror``; with ``name``, the
        one of that name) restored under ``local_root`` unless a copy is there. A collective when
        torch.distributed runs: rank 0 picks the checkpoint; its bytes are downloaded once per job (the ranks'
        ``cooperative_load``: each its part, shared over the process group), and since no shared filesystem is
        assumed, one process per node (``LOCAL_RANK`` 0) writes the node's copy while the others wait for it.
        Returns the local path, or None if the mirror holds none."""
        collective = dist_ready() and rank_and_world(self.process_group)[1] > 1
        with object_store_module.using(self.object_store):
            latest = mirror.mirrored(url_root, name) if rank_and_world(self.process_group)[0] == 0 else None
            if collective:
                latest = over(self.process_group).broadcast(latest)
            if latest is None:
                return None
            local = os.path.join(local_root, posixpath.basename(latest))
            writes = int(os.environ.get("LOCAL_RANK", "0")) == 0 and not os.path.exists(local)
            if collective and not any_rank(writes, self.process_group):
                return local
            with cooperative.shared_copy(mirror.files_of(latest), self.process_group, timeout=self.options.timeout,
                                         readers=self.options.cooperative_load) as copies:
                if writes:
                    mirror.restore(latest, local, (lambda url, file: shutil.copyfile(copies[url], file))
                                   if copies is not None else None)
        if collective:
            over(self.process_group).barrier()
        return local

    def export(self, path: str | os.PathLike, options: Optional[ExportOptions | str] = None, *,
               after: Optional[SaveHandle] = None) -> SaveHandle:
        """Write the model weights of the committed checkpoint ``path`` as Hugging Face safetensors
        (``options.target_for(path)``, committed like a checkpoint) in the background writer, after
        everything queued before; with ``after``, only if that save succeeded (``export``). A
        failed export is logged and fails its handle, never the checkpoint or later saves."""
        path = _normalize(path)
        options = as_options(options or "safetensors")
        target = options.target_for(path)
        return self._queue_after("export", path, ExportRequest(path, target, options), after, label=f"to {target}")

    def after_commit(self, checkpoint: SaveHandle, action: OnCommit) -> SaveHandle:
        """Run ``action(path)`` once the checkpoint of ``checkpoint`` committed, on the commit-hooks
        thread (in commit order, off the training loop); returns its handle, which fails, like a
        save, with what ``action`` raises, and is cancelled if the checkpoint does not commit. With the memory
        tier, ``path`` is where the checkpoint was asked for, once it is there (``_when_durable``)."""
        path = self._asked_for(checkpoint)
        return self._when_durable(checkpoint, "hook", lambda _handle: action(path))

    def _asked_for(self, checkpoint: SaveHandle) -> str:
        """Where ``checkpoint`` was asked for: its path, or, saved in the memory tier, its durable one."""
        placed = self.tier.placement(checkpoint.path)
        return placed.durable if placed is not None else checkpoint.path

    def _when_durable(self, checkpoint: SaveHandle, kind: str, action: Callable[[SaveHandle], None], *,
                      label: Optional[str] = None, done_by_action: bool = False) -> SaveHandle:
        """``hooks.after(checkpoint, kind, action)``, once the checkpoint is where it was asked for: code acting on a
        committed checkpoint (exporting it, uploading it, reading its files) finds it there. With the memory tier,
        that is after its durable copy, of which every rank writes its own files (a checkpoint that stays in memory
        only runs nothing); a checkpoint in memory only whose copy the end of the run writes runs it then
        (``_finish_memory_tier``)."""
        placed = self.tier.placement(checkpoint.path)
        if placed is None:  # saved where it was asked for
            return self.hooks.after(checkpoint, kind, action, label=label, done_by_action=done_by_action)

        def run(handle: SaveHandle) -> None:
            persist = next((d for d in checkpoint.dependents if d.kind == "persist"), None)
            if persist is not None and persist.wait() and persist.exception() is None:
                return action(handle)
            if persist is None:  # in memory only, for now: if the end of the run writes it, then
                self._deferred_hooks.setdefault(placed.memory, []).append(
                    lambda durable: self.hooks.after(durable, kind, action, label=label, done_by_action=done_by_action))
            if done_by_action:  # nothing to act on here (a failed copy raises through its own handle)
                self.ledger.complete(handle, None)

        return self.hooks.after(checkpoint, kind, run, label=label, done_by_action=done_by_action)

    def _queue_commit_work(self, checkpoint: SaveHandle) -> None:
        """What runs once a checkpoint being saved committed, off the training loop: the ``on_commit`` code, and
        (rank 0's) its export; with the memory tier, where it was asked for, after its durable copy."""
        options = self.options
        if options.on_commit is not None:
            self.after_commit(checkpoint, options.on_commit)
        if options.export is not None and checkpoint.rank == 0:
            source = self._asked_for(checkpoint)
            target = options.export.target_for(source)
            request = ExportRequest(source, target, options.export)
            self._when_durable(checkpoint, "export", lambda handle: self.ledger.queue.submit([(handle, request, None)]),
                               label=f"to {target}", done_by_action=True)

    def _follow_ups(self, checkpoint: SaveHandle, save: Optional[BarrierSpec] = None) -> list[tuple]:
        """Writer jobs handed over together with a checkpoint's own request, so that they run right behind it and
        before anything queued later (a rotation's removal of that very checkpoint), and only if it committed:
        with the memory tier, its durable copy when due, a single file's replicas and the tier's retention (``tier``;
        ``save``: the meeting point of the save's ranks, None for a single file); rank 0's copy of it to
        ``mirror_to``."""
        jobs = []
        jobs = self.tier.follow_ups(checkpoint.path, checkpoint.nbytes, rank=checkpoint.rank, save=save)
        root = self.options.mirror_to
        if root and checkpoint.rank == 0 and not backend_for(checkpoint.path).remote:
            url = posixpath.join(root, os.path.basename(checkpoint.path))
            jobs.append(("mirror", url, CopyRequest(checkpoint.path, url, self.object_store)))
        handed = []
        for kind, path, request in jobs:
            handle = self._admit(kind, path, rank=checkpoint.rank, step=checkpoint.step, label=checkpoint.label,
                                 after=checkpoint)
            handle.set_staged()
            handed.append((handle, request, None))
        return handed

    def _queue_after(self, kind: str, path: str, request: Any, after: Optional[SaveHandle], **details: Any) -> SaveHandle:
        self._check_open()
        if after is not None:
            if after.job_id is None:  # still being snapshot on the staging thread: let it hand over first
                self.stager.wait()
            if not after.done():
                self.stats[f"{kind}_behind_pending"] += 1
        handle = self._admit(kind, path, rank=rank_and_world(self.process_group)[0], after=after, **details)
        handle.set_staged()
        self.ledger.queue.submit([(handle, request, None)])
        self.ledger.raise_unobserved()
        return handle

    # ------------------------------------------------------------------ waiting and questions
    def wait(self, timeout: Optional[float] = None, *, everywhere: bool = False) -> None:
        """Wait until everything accepted so far is done (checkpoints committed, what they replaced
        or removed deleted); raise the first failure nobody has seen. With ``everywhere`` (a
        collective: every rank calls it), a failure on any rank raises on every rank."""
        self.stager.wait()
        error: Optional[BaseException] = None
        try:
            self.ledger.wait(timeout)
        except CheckpointError as e:
            error = e
        if everywhere and any_rank(error is not None, self.process_group) and error is None:
            error = CheckpointWriteError("asyncckpt: a checkpoint save failed on another rank (its error is raised there)")
        if error is not None:
            raise error

    def latest_checkpoint(self, root: str | os.PathLike) -> Optional[str]:
        """The newest committed checkpoint of ``root`` to resume from, in any tier of this node (as
        ``asyncckpt.core.latest_checkpoint``). With the memory tier on several nodes, a collective (every rank
        calls it): the nodes agree on the newest checkpoint some of them hold in memory whole between them, and
        each completes its copy from the others (``Tier.assemble``); else the newest on storage. A memory
        checkpoint that a job of another shape saved (world size, ranks per node) is not resumed from, with one
        warning (``Tier.latest_checkpoint``)."""
        root = _normalize(root)
        self.wait()
        return self.tier.latest_checkpoint(root, self.process_group, self.timeout)

    def wait_for(self, path: str | os.PathLike) -> None:
        """Wait for pending work on ``path`` (a read must never see a checkpoint being written);
        raise its failure if nobody has seen it. With the memory tier: its memory copy's too."""
        path = _normalize(path)
        self.ledger.wait_for(path)
        memory = self.tier.memory_path(path)
        if memory is not None:
            self.ledger.wait_for(memory)

    def raise_failures(self) -> None:
        """Raise (once) a failure of earlier work that nobody has seen; never waits."""
        self.ledger.raise_unobserved()

    def will_exist(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` will exist once the queued work has run: what the last queued work on it
        does (a save or link creates it, a removal deletes it), else whether it exists now. With the memory tier,
        a checkpoint exists in either tier (its memory copy: what a resume would load)."""
        path = _normalize(path)
        memory = self.tier.memory_path(path)
        return (memory is not None and self._will_exist(memory)) or self._will_exist(path)

    def _will_exist(self, path: str) -> bool:
        queued = self.ledger.will_exist(path)
        if queued is not None:
            return queued
        with object_store_module.using(self.object_store):
            return exists(backend_for(path), path)

    def pending(self) -> list[SaveHandle]:
        """Checkpoints, removals and links not done yet, oldest first."""
        return self.ledger.pending()

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

    # ------------------------------------------------------------------ before a framework loads a checkpoint
    def require_intact(self, path: str | os.PathLike, *, everywhere: bool = False,
                       check_file: integrity.FileCheck = file_checksums.problem) -> integrity.Report:
        """Check a checkpoint against its checksums (``integrity``) before anything is loaded from
        it; raise ``CorruptCheckpointError`` naming the files (and keys) that are damaged. With
        ``everywhere`` (a collective: every rank calls it), the ranks check the data files of a
        sharded checkpoint side by side, and a problem found on any rank raises on every rank.
        ``check_file`` checks each file that has a checksum (a resume's loads the file for the
        framework while hashing it: ``asyncckpt.core.integration.resume``)."""
        path = _normalize(path)
        report, error = self._check(path, everywhere, check_file)
        self._raise_if_damaged(path, error, everywhere)
        return report

    def load_while_checking(self, path: str | os.PathLike, load: Callable[[], T], *, everywhere: bool = False) -> T:
        """``load()`` (a framework's own load of the checkpoint ``path`` into its objects, in place) while a
        thread checks ``path`` as ``require_intact`` does, over the pages the load reads: the disk is read
        once and the two overlap. Its result, or ``CorruptCheckpointError`` once the load is over (what it
        loaded in place is then not to be trained on: the error ends the resume). With ``everywhere``, the
        ranks' outcomes are agreed after the load, on the calling thread, after the framework's collectives."""
        path = _normalize(path)
        outcome: list[Optional[BaseException]] = []

        def check() -> None:
            try:
                outcome.append(self._check(path, everywhere, file_checksums.problem)[1])
            except BaseException as e:  # noqa: BLE001 - raised on the calling thread, as require_intact would
                outcome.append(e)

        thread = threading.Thread(target=check, name="asyncckpt-resume-check", daemon=True)
        thread.start()
        try:
            result = load()
        except Exception:
            thread.join()
            if isinstance(outcome[0], CheckpointError):  # the load failed on damaged bytes: say which
                raise outcome[0] from None
            raise
        finally:
            thread.join()
            self.tier.serve()  # as ``load``: a restart's writer serves its node's memory from here
        self._raise_if_damaged(path, outcome[0], everywhere)
        return result

    def _check(self, path: str, everywhere: bool, check_file: integrity.FileCheck
               ) -> tuple[Optional[integrity.Report], Optional[CheckpointError]]:
        """This rank's share of the check of ``path``: (its report, or the error naming what is damaged)."""
        rank, world = rank_and_world(self.process_group) if everywhere else (0, 1)
        try:
            with object_store_module.using(self.object_store):
                return integrity.require_intact(path, share=(rank, world), check_file=check_file), None
        except CheckpointError as e:
            return None, e

    def _raise_if_damaged(self, path: str, error: Optional[BaseException], everywhere: bool) -> None:
        """Raise ``error``; with ``everywhere`` (a collective), on every rank if any rank has one."""
        if everywhere and any_rank(error is not None, self.process_group) and error is None:
            error = CorruptCheckpointError(f"checkpoint {path} is damaged (found on another rank: its error names "
                                           "the files)", path=path)
        if error is not None:
            raise error

    # ------------------------------------------------------------------ overlapping snapshots with training
    def run_staged(self, function: Callable[[], None]) -> None:
        """Run ``function`` on the staging thread, where it overlaps what the caller does next: more
        snapshots through this checkpointer (``tx.save_file``, then ``tx.commit()``), for state the
        caller leaves untouched until ``wait_staged()`` (``guard`` makes optimizer steps wait).
        Failures are delivered through the handles ``function`` creates."""
        self.stager.run(function)

    def wait_staged(self) -> None:
        """Block until the staging thread is done (call before mutating what it snapshots)."""
        self.stager.wait()

    @property
    def staged_wait_s(self) -> float:
        """Seconds callers (optimizer steps, sync points) have spent in total waiting for the staging thread:
        the part of an overlapped snapshot that training waited for after all."""
        return self.stager.staged_wait_s

    @property
    def staging_busy(self) -> bool:
        """Work was left to the staging thread (``run_staged``, overlapped saves) and not waited for yet."""
        return self.stager.busy

    def guard(self, *optimizers: torch.optim.Optimizer) -> list:
        """Make each optimizer's ``step()`` wait for the staging thread; returns hook handles."""
        return self.stager.guard(*optimizers)

    def guard_every_optimizer(self):
        """Make every torch optimizer's ``step()`` wait for the staging thread; returns the hook's handle."""
        return self.stager.guard_every_optimizer()

    # ------------------------------------------------------------------ lifecycle
    def start(self, *, at_first_step: bool = False) -> None:
        """Start the background writer now, in the background (it starts at the first save
        otherwise, which then waits for it), and keep it until ``teardown()``: a framework's run
        starts it, and its saves never wait for a writer stopped when idle (``writer_idle_timeout``).

        With ``at_first_step`` (the adapters'), at this process's first optimizer step instead (or its first save, if
        that comes sooner): a run that resumes loads its checkpoint between its start and its first
        step, and the writer's start-up (a process and its imports) would take the node's cores from that load
        (docs/DESIGN.md, Measured). With the memory tier, this rank finds the job's nodes now either way."""
        self._check_open()
        if at_first_step and not self.ledger.queue.running:
            self.tier.connect(serve=False)  # the writer serves the node's memory once it starts
            if self._first_step is None:
                self._first_step = register_optimizer_step_pre_hook(_starting_once(weakref.ref(self)))
            return
        self.ledger.queue.start(hold=True)
        self.tier.connect()

    def teardown(self, *, free_buffers: bool = False) -> None:
        """Drain, then stop the writer process and every thread of ours (a framework's run ended);
        the staging buffers and plans are kept for the next run, unless ``free_buffers``: then the buffers (shared,
        pinned host memory, up to ``max_in_flight`` copies of the checkpoint) are freed, and a later save allocates
        them again. Raises a failure nobody has seen. A directory begun and never committed (an interrupt between
        its files and its commit) is aborted first: the writer discards what it staged, and nothing of it is left
        beside the framework's checkpoints."""
        try:
            self.stager.wait()  # a commit left to the staging thread lands first
            for handle in self.ledger.uncommitted():
                handle.transaction.abandon()
            self.wait()
            self._finish_memory_tier()
            self._log_advice()  # if no save came after the first durable one
        finally:
            self._stop_threads()
            if free_buffers:
                self.buffers.close()

    def _finish_memory_tier(self) -> None:
        """The end of a run: the checkpoints only in memory are written durably (each rank's files by its own
        writer; a single file by the rank that saved it), then, once every rank is there, this node's memory copies
        go: the tier holds nothing after a run that ended normally (a killed run leaves it for its restart)."""
        if not self.tier.active:
            return
        rank = rank_and_world(self.process_group)[0]
        for placed in self.tier.unpersisted():
            here = os.path.lexists(placed.memory)
            if here if placed.save is None else not any_rank(not here, self.process_group):  # (a save of every rank:
                persist = self._queue_after("persist", placed.durable,  # written where every node still holds its copy)
                                            self.tier.persist_request(placed.memory, placed.durable, placed.save, rank),
                                            None)
                for schedule in self._deferred_hooks.pop(placed.memory, []):  # its on_commit code and export, now
                    schedule(persist)
        self._deferred_hooks.clear()
        self.wait(everywhere=True)
        self.tier.clear(remove=int(os.environ.get("LOCAL_RANK", rank)) == 0)

    def close(self) -> None:
        """``teardown()``, and free the staging buffers; the Checkpointer cannot be used again."""
        if self.closed:
            return
        try:
            self.teardown()
        finally:
            self.ledger.abandon_uncommitted()
            self.closed = True
            self.buffers.close()
            self.tier.close()
            lifecycle.forget(self)

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _stop_threads(self) -> None:
        try:
            self.stager.wait()
        finally:
            if self._first_step is not None:
                self._first_step.remove()
                self._first_step = None
            self.hooks.stop()
            self.ledger.queue.stop()
            self.copy_threads.stop()
            self.sharded.close()
            release()  # the groups of the caller's collectives (made again where needed)

    # ------------------------------------------------------------------ internals
    def _placed(self, path: str, durable: Optional[bool], nbytes: Callable[[], int], step: Optional[int],
                agree_over: Any = False) -> str:
        """Where a checkpoint asked for at ``path`` (of ``nbytes()`` on this rank) is saved: with the memory tier,
        in memory (``Tier.place``; ``durable``: also written durably now, whatever the cadence), else at ``path``.
        ``agree_over``: the process group of a save every rank of it makes (None: the default group), whose ranks
        must all place it alike; False: a save of this rank alone."""
        if not self.tier.active:
            return path  # (``nbytes`` not taken: it costs a walk of the state)
        self.tier.connect()
        return self.tier.place(path, nbytes(), step, durable_too=durable, agree_over=agree_over)

    def _committed(self, handle: SaveHandle, seconds: float) -> None:
        """A checkpoint (or its durable copy) is done: one warning if it took more than half the ``timeout`` (a
        larger checkpoint, or slower storage, would make the waits for it give up); at the first that is durable,
        the checkpoint interval this run's measured costs make the least lossy (``interval``), logged at the next
        save, which tells how often this run saves."""
        handle.timings["committed_s"] = seconds
        if handle.exception() is not None:
            return
        if seconds > self.timeout / 2 and not self._warned_slow:
            self._warned_slow = True
            logger.warning("asyncckpt: %s took %.0f s to be committed, more than half of timeout=%.0f s, which bounds "
                           "each wait for it and a writer that finishes it after a crash: set timeout to at least 3x "
                           "that (%.0f s) for checkpoints this size on this storage (docs/troubleshooting.md)",
                           handle.describe().removeprefix("saving "), seconds, self.timeout, 3 * seconds)
        if self._advice is not None:
            return
        memory = handle.after if handle.kind == "persist" else None
        if memory is None and self.tier.placement(handle.path) is not None:
            return  # in memory: its durable copy, if any, says it
        saved = memory or handle
        if "stall_s" in saved.timings:  # an adapter's framework call, timed whole (``SaveMetrics.saved``)
            stall = saved.timings["stall_s"]
        elif saved.kind == "directory":  # the framework's own code snapshots its files: its adapter times it
            return
        else:
            stall = sum(saved.timings.get(part, 0.0) for part in ("waited_s", "prepare_s", "copy_s"))
        memory_commit = saved.timings.get("committed_s", seconds) - stall if memory is not None else None
        self._advice = interval.advice(stall, seconds - (0.0 if memory is not None else stall),
                                       self.options.failures_per_day, memory_commit)

    def _saving(self, step: Optional[int]) -> None:
        """A checkpoint of ``step`` is being saved: the run's saves (of different steps) so far tell its interval;
        once the interval advice is known, it is logged at the next save (``_log_advice``)."""
        now = time.monotonic()
        first, last, count = self._saves
        if last is not None and step is not None and step == last[0]:
            return  # another file of the same step (Lightning's last.ckpt beside its top-k file)
        self._saves = (first if first is not None else now, (step, now), count + 1)
        if self._advice is not None and count >= 1:
            self._log_advice()

    def _log_advice(self) -> None:
        """The interval advice, once, with the interval this run saves at (from its saves so far): a warning where the
        run saves more than twice or less than half as often as the least-loss interval (where users see it), else
        at INFO (``logging.getLogger("asyncckpt")``)."""
        if self._advice is None or self._advice_logged:
            return
        self._advice_logged = True
        first, last, count = self._saves
        if count < 2:
            logger.info("%s", self._advice.line)
            return
        every = (last[1] - first) / (count - 1)
        far = not self._advice.seconds / 2 <= every <= 2 * self._advice.seconds
        logger.log(logging.WARNING if far else logging.INFO, "%s; this run saves every %s", self._advice.line,
                   interval.human(every))

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("Checkpointer is closed")

    def _store(self) -> Any:
        return default_store() if self.use_collectives else None

    def _admit(self, kind: str, path: str, **details: Any) -> SaveHandle:
        if kind in ("save", "file", "directory") and not backend_for(path).remote:
            orphans.wait_for_orphans(os.path.dirname(path), self.timeout)  # never save over what one commits
        self.stats[kind] += 1
        if kind in ("save", "file", "directory"):
            self._saving(details.get("step"))
        admitted = time.perf_counter()
        handle = self.ledger.admit(kind, path, **details)
        if handle.is_checkpoint or kind == "persist":  # seconds from the save call (or the persist's queueing) to commit
            handle.when_done(lambda: self._committed(handle, time.perf_counter() - admitted))
        if handle.is_checkpoint:
            self._queue_commit_work(handle)
        for path in handle.paths:  # the writer changed it: what this process's fsspec cached of it is stale
            if backend_for(path).remote:
                handle.when_done(lambda path=path: object_store_module.forget_listings(path, self.object_store))
        return handle

    def _foreground(self, handle: SaveHandle, step: Callable[[], Any]) -> Any:
        """Run part of a save in the caller: what it raises is the caller's to see (not raised
        again); a save that did not get as far as its snapshot is cancelled."""
        try:
            return step()
        except BaseException as e:
            if not handle.done():
                self.ledger.complete(handle, CheckpointCancelledError(f"asyncckpt: {handle.describe()}: not saved: {e}"))
            handle.observed = True
            raise

    def _in_background(self, handle: SaveHandle, snapshot: Callable[[], None]) -> None:
        """On the staging thread: a failure goes to the handle, raised at the next sync point."""
        try:
            snapshot()
        except BaseException as e:  # noqa: BLE001 - delivered through the handle
            if not handle.done():
                self.ledger.complete(handle, e)
            self.ledger.report_later(handle)


def _normalize(path: str | os.PathLike) -> str:
    """The form the core keeps a path in (``backend.normalize``): the pending work is keyed by it."""
    return normalize(path)


def _starting_once(checkpointer: "weakref.ref[Checkpointer]") -> Callable[..., None]:
    """An optimizer step pre-hook that starts the Checkpointer's writer at the first step (``start(at_first_step=
    True)``) and does nothing after: torch runs the global hooks from its dict, which a hook may not change, so
    ``teardown`` removes it. Held weakly: a Checkpointer that is gone starts nothing."""
    started = False

    def hook(*_: Any) -> None:
        nonlocal started
        target = checkpointer()
        if not started and target is not None and not target.closed:
            started = True
            target.start()

    return hook
