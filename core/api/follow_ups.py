"""What follows a commit: removals, links, retention, mirror and export, the user's ``on_commit`` code, and the
writer jobs handed over with a checkpoint (its memory tier's durable copy, its mirror copy).

The Checkpointer's verbs for them (``remove``, ``link``, ``apply_retention``, ``mirror``, ``restore_mirrored``,
``export``, ``after_commit``) land here. Each queues its work behind everything queued before (``after``: only if
that save succeeded); with the memory tier, code acting on a checkpoint runs once it is where it was asked for
(docs/DESIGN.md, "After a commit").
"""
from __future__ import annotations

import os
import posixpath
import shutil
from typing import Any, Callable, Iterable, Optional

from asyncckpt.core.api.commit_hooks import OnCommit
from asyncckpt.core.api.parts import Parts
from asyncckpt.core.client.handles import SaveHandle
from asyncckpt.core.errors import CheckpointWriteError
from asyncckpt.core.export.options import ExportOptions, as_options
from asyncckpt.core.export.request import ExportRequest
from asyncckpt.core.loading import cooperative
from asyncckpt.core.snapshot.collectives import any_rank, over
from asyncckpt.core.snapshot.dist_env import dist_ready, rank_and_world
from asyncckpt.core.storage import object_store as object_store_module
from asyncckpt.core.storage.backend import backend_for, normalize
from asyncckpt.core.writer import mirror
from asyncckpt.core.writer.barrier import BarrierSpec
from asyncckpt.core.writer.file_requests import LinkRequest, RemoveRequest
from asyncckpt.core.writer.mirror import CopyRequest
from asyncckpt.core.writer.retention import RetentionRequest

Admit = Callable[..., SaveHandle]  # ``Checkpointer._admit``: a handle for new work, counted and timed


class FollowUps:
    """What follows a commit, for one Checkpointer (its ``Parts``; ``admit`` makes each handle)."""

    def __init__(self, parts: Parts, admit: Admit) -> None:
        self._parts, self._admit = parts, admit
        self._deferred_hooks: dict[str, list[Callable[[SaveHandle], Any]]] = {}  # memory path -> its hooks (``_when_durable``)

    def remove(self, paths: Iterable[str | os.PathLike], *, after: Optional[SaveHandle] = None,
               hidden_parent: Optional[str | os.PathLike] = None) -> SaveHandle:
        """Remove files or checkpoint directories in the background, after everything queued
        before; with ``after``, only if that save succeeded. A directory is renamed out of every
        name a framework looks at first (into ``hidden_parent`` if given, on the same filesystem),
        then deleted once the writer has replied. With ``mirror_to``, their copies there go too (after the same
        save): the mirror keeps what the framework's retention keeps."""
        parts = self._parts
        paths = tuple(normalize(p) for p in paths)
        if len({backend_for(p).remote for p in paths}) > 1:
            raise ValueError(f"remove() takes local paths or URLs, not both at once: {paths}")
        mirror_root = parts.options.mirror_to
        if mirror_root and not backend_for(paths[0]).remote:  # the mirror follows the framework's retention
            self.remove([posixpath.join(mirror_root, os.path.basename(path)) for path in paths], after=after)
        copies = [copy for copy in map(parts.tier.memory_path, paths) if copy is not None and parts.will_exist(copy)]
        if copies and backend_for(paths[0]).remote:  # the memory copies of checkpoints in an object store
            self.remove(copies, after=after)
        elif copies:
            paths += tuple(copies)
        request = RemoveRequest(list(paths), os.path.abspath(os.fspath(hidden_parent)) if hidden_parent else None,
                                object_store=parts.options.object_store)
        if after is None and not parts.ledger.queue.running and not parts.ledger.pending():
            return self._remove_here(request, paths)
        return self.queue_after("remove", ", ".join(paths), request, after, paths=paths)

    def _remove_here(self, request: RemoveRequest, paths: tuple[str, ...]) -> SaveHandle:
        """A removal with nothing pending and no writer running (a process that saves nothing, such
        as Lightning's main process after ``ddp_spawn``) is done at once: no writer is started for it."""
        parts = self._parts
        parts.check_open()
        handle = self._admit("remove", ", ".join(paths), rank=parts.rank(), paths=paths)
        handle.set_snapshot_taken()
        try:
            request.run_here()
        except OSError as e:
            parts.ledger.complete(handle, CheckpointWriteError(f"asyncckpt: {handle.describe()}: {type(e).__name__}: {e}"))
            parts.ledger.raise_unobserved()
        else:
            parts.ledger.complete(handle, None)
        return handle

    def link(self, target: str | os.PathLike, linkpath: str | os.PathLike, *,
             after: Optional[SaveHandle] = None) -> SaveHandle:
        """Point ``linkpath`` at ``target`` (relative symlink, replaced atomically) in the
        background, after everything queued before; with ``after``, only if that save succeeded."""
        if backend_for(target).remote or backend_for(linkpath).remote:
            raise ValueError(f"link({os.fspath(target)!r}, {os.fspath(linkpath)!r}): a symbolic link lives on a local "
                             "file system, not in an object store")
        target, linkpath = os.path.abspath(os.fspath(target)), os.path.abspath(os.fspath(linkpath))
        return self.queue_after("link", linkpath, LinkRequest(target, linkpath), after, label=f"-> {os.path.basename(target)}")

    def apply_retention(self, root: str | os.PathLike, pattern: str, *, keep_last: Optional[int],
                        keep_every: Optional[int], after: Optional[SaveHandle] = None) -> SaveHandle:
        """Delete the committed checkpoints under ``root`` (names matching ``pattern``, group 1 the
        step) that ``retention.select_deletions`` does not keep; with ``after``, only if that save succeeded."""
        root = normalize(root)
        request = RetentionRequest(root, pattern, keep_last, keep_every, self._parts.options.object_store)
        return self.queue_after("retention", root, request, after)

    def mirror(self, path: str | os.PathLike, url: str, *, after: Optional[SaveHandle] = None) -> SaveHandle:
        """Copy the committed checkpoint ``path`` (a directory, or a single file) to the object-store
        ``url`` and commit it there, in the background, after everything queued before; with ``after``,
        only if that save succeeded (``mirror``; ``mirror.restore`` brings one back)."""
        path, url = normalize(path), normalize(url)
        if not backend_for(url).remote:
            raise ValueError(f"mirror() copies to an object-store URL, not to {url}")
        return self.queue_after("mirror", url, CopyRequest(path, url, self._parts.options.object_store), after)

    def restore_mirrored(self, url_root: str, local_root: str, name: Optional[str] = None) -> Optional[str]:
        """Before a resume: the newest committed checkpoint under ``url_root`` (``mirror``; with ``name``, the
        one of that name) restored under ``local_root`` unless a copy is there. A collective when
        torch.distributed runs: rank 0 picks it, its bytes are downloaded once per job (``cooperative_load``) and
        one process per node (``LOCAL_RANK`` 0) writes the node's copy. Returns the local path, or None."""
        parts = self._parts
        group, options = parts.process_group, parts.options
        collective = dist_ready() and rank_and_world(group)[1] > 1
        with object_store_module.using(options.object_store):
            latest = mirror.mirrored(url_root, name) if rank_and_world(group)[0] == 0 else None
            if collective:
                latest = over(group).broadcast(latest)
            if latest is None:
                return None
            local = os.path.join(local_root, posixpath.basename(latest))
            writes = int(os.environ.get("LOCAL_RANK", "0")) == 0 and not os.path.exists(local)
            if collective and not any_rank(writes, group):
                return local
            with cooperative.shared_copy(mirror.files_of(latest), group, timeout=options.timeout,
                                         readers=options.cooperative_load) as copies:
                if writes:
                    mirror.restore(latest, local, (lambda url, file: shutil.copyfile(copies[url], file))
                                   if copies is not None else None)
        if collective:
            over(group).barrier()
        return local

    def export(self, path: str | os.PathLike, options: Optional[ExportOptions | str] = None, *,
               after: Optional[SaveHandle] = None) -> SaveHandle:
        """Write the model weights of the committed checkpoint ``path`` as Hugging Face safetensors
        (``options.target_for(path)``, committed like a checkpoint) in the background writer, after
        everything queued before; with ``after``, only if that save succeeded (``export``). A
        failed export is logged and fails its handle, never the checkpoint or later saves."""
        path = normalize(path)
        options = as_options(options or "safetensors")
        target = options.target_for(path)
        return self.queue_after("export", path, ExportRequest(path, target, options), after, label=f"to {target}")

    def after_commit(self, checkpoint: SaveHandle, action: OnCommit) -> SaveHandle:
        """Run ``action(path)`` once the checkpoint of ``checkpoint`` committed, on the commit-hooks
        thread (in commit order, off the training loop); returns its handle, which fails, like a
        save, with what ``action`` raises, and is cancelled if the checkpoint does not commit. With the memory
        tier, ``path`` is where the checkpoint was asked for, once it is there."""
        path = self._asked_for(checkpoint)
        return self._when_durable(checkpoint, "hook", lambda _handle: action(path))

    def _asked_for(self, checkpoint: SaveHandle) -> str:
        """Where ``checkpoint`` was asked for: its path, or, saved in the memory tier, its durable one."""
        placed = self._parts.tier.placement(checkpoint.path)
        return placed.durable if placed is not None else checkpoint.path

    def _when_durable(self, checkpoint: SaveHandle, kind: str, action: Callable[[SaveHandle], None], *,
                      label: Optional[str] = None, done_by_action: bool = False) -> SaveHandle:
        """``hooks.after(checkpoint, kind, action)``, once the checkpoint is where it was asked for: code acting on a
        committed checkpoint (exporting it, uploading it, reading its files) finds it there. With the memory tier,
        that is after its durable copy, of which every rank writes its own files (a checkpoint that stays in memory
        only runs nothing); a checkpoint in memory only whose copy the end of the run writes runs it then
        (``finish_memory_tier``)."""
        parts = self._parts
        placed = parts.tier.placement(checkpoint.path)
        if placed is None:  # saved where it was asked for
            return parts.hooks.after(checkpoint, kind, action, label=label, done_by_action=done_by_action)

        def run(handle: SaveHandle) -> None:
            persist = next((d for d in checkpoint.dependents if d.kind == "persist"), None)
            if persist is not None and persist.wait() and persist.exception() is None:
                return action(handle)
            if persist is None:  # in memory only, for now: if the end of the run writes it, then
                self._deferred_hooks.setdefault(placed.memory, []).append(
                    lambda durable: parts.hooks.after(durable, kind, action, label=label, done_by_action=done_by_action))
            if done_by_action:  # nothing to act on here (a failed copy raises through its own handle)
                parts.ledger.complete(handle, None)

        return parts.hooks.after(checkpoint, kind, run, label=label, done_by_action=done_by_action)

    def queue_commit_work(self, checkpoint: SaveHandle) -> None:
        """What runs once a checkpoint being saved committed, off the training loop: the ``on_commit`` code, and
        (rank 0's) its export; with the memory tier, where it was asked for, after its durable copy."""
        parts = self._parts
        options = parts.options
        if options.on_commit is not None:
            self.after_commit(checkpoint, options.on_commit)
        if options.export is not None and checkpoint.rank == 0:
            source = self._asked_for(checkpoint)
            target = options.export.target_for(source)
            request = ExportRequest(source, target, options.export)
            self._when_durable(checkpoint, "export", lambda handle: parts.ledger.queue.submit([(handle, request, None)]),
                               label=f"to {target}", done_by_action=True)

    def handed_with(self, checkpoint: SaveHandle, save: Optional[BarrierSpec] = None) -> list[tuple]:
        """Writer jobs handed over together with a checkpoint's own request, so that they run right behind it and
        before anything queued later (a rotation's removal of that very checkpoint), and only if it committed:
        with the memory tier, its durable copy when due, a single file's replicas and the tier's retention (``tier``;
        ``save``: the meeting point of the save's ranks, None for a single file); rank 0's copy of it to
        ``mirror_to``."""
        parts = self._parts
        jobs = parts.tier.follow_ups(checkpoint.path, checkpoint.nbytes, rank=checkpoint.rank, save=save)
        root = parts.options.mirror_to
        if root and checkpoint.rank == 0 and not backend_for(checkpoint.path).remote:
            url = posixpath.join(root, os.path.basename(checkpoint.path))
            jobs.append(("mirror", url, CopyRequest(checkpoint.path, url, parts.options.object_store)))
        handed = []
        for kind, path, request in jobs:
            handle = self._admit(kind, path, rank=checkpoint.rank, step=checkpoint.step, label=checkpoint.label,
                                 after=checkpoint)
            handle.set_snapshot_taken()
            handed.append((handle, request, None))
        return handed

    def queue_after(self, kind: str, path: str, request: Any, after: Optional[SaveHandle], **details: Any) -> SaveHandle:
        """Hand ``request`` to the writer behind everything queued before (``after``: only if that save succeeded)."""
        parts = self._parts
        parts.check_open()
        if after is not None:
            if after.job_id is None:  # still being snapshot on the snapshot thread: let it hand over first
                parts.snapshot_thread.wait()
            if not after.done():
                parts.stats[f"{kind}_behind_pending"] += 1
        handle = self._admit(kind, path, rank=parts.rank(), after=after, **details)
        handle.set_snapshot_taken()
        parts.ledger.queue.submit([(handle, request, None)])
        parts.ledger.raise_unobserved()
        return handle

    def finish_memory_tier(self, wait_everywhere: Callable[[], None]) -> None:
        """The end of a run: the checkpoints only in memory are written durably (each rank's files by its own
        writer; a single file by the rank that saved it), then, once every rank is there (``wait_everywhere``), this
        node's memory copies go: the tier holds nothing after a run that ended normally (a killed run leaves it for
        its restart)."""
        parts = self._parts
        if not parts.tier.active:
            return
        rank = parts.rank()
        for placed in parts.tier.unpersisted():
            here = os.path.lexists(placed.memory)
            if here if placed.save is None else not any_rank(not here, parts.process_group):  # (a save of every rank:
                persist = self.queue_after("persist", placed.durable,  # written where every node still holds its copy)
                                           parts.tier.persist_request(placed.memory, placed.durable, placed.save, rank),
                                           None)
                for schedule in self._deferred_hooks.pop(placed.memory, []):  # its on_commit code and export, now
                    schedule(persist)
        self._deferred_hooks.clear()
        wait_everywhere()
        parts.tier.clear(remove=int(os.environ.get("LOCAL_RANK", rank)) == 0)
