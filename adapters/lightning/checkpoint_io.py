"""``AsyncCkptIO``: a Lightning ``CheckpointIO`` whose saves return after a snapshot.

What Lightning calls → what we snapshot → which core call → when we wait:

* ``save_checkpoint(checkpoint, path)`` (global rank 0; single device, DDP, FSDP "full"): the
  whole checkpoint dict, as ``torch.save`` would write it → ``Checkpointer.async_save_file``.
  ``hpc_ckpt_*`` saves and saves made while an exception is being handled (on-exception
  checkpoints) wait for the write: the process is about to go.
* ``remove_checkpoint(path)`` → ``Checkpointer.remove``, after the save queued last and only if
  it committed (top-k rotation never costs a checkpoint for a save that failed).
* ``load_checkpoint(path)`` → waits for everything pending (on every rank), then loads exactly
  like ``TorchCheckpointIO``.
* ``teardown()`` (the end of fit/validate/test/predict) → waits on every rank, raises a failed
  save, and stops the background writer: nothing of ours runs after the run; the next run starts
  it again (at ``setup_environment``, see ``integration``). Fabric never calls it: its user does,
  at the end of the run (``fabric.save`` / ``fabric.load`` are ``save_checkpoint`` / ``load_checkpoint``).
* Sharded FSDP / ModelParallel saves, ``save_last="link"`` and the ``-v1`` version counter do not
  go through ``CheckpointIO``; ``integration`` routes them here.

A save that failed in the background raises at the next save, removal, load or teardown, as
``AsyncCkptSaveError`` naming the path, ``epoch`` and ``global_step``.
"""
from __future__ import annotations

import fnmatch
import io
import logging
import os
import sys
from typing import Any, Callable, Optional

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH

from asyncckpt.core import Checkpointer, CheckpointWriteError, ExportOptions
from asyncckpt.core.integration import resume, versions
from asyncckpt.core.integration import SaveHandle

from . import integration
from .support import SUPPORT

logger = logging.getLogger("asyncckpt")

#: A checkpoint save (or removal) that failed in the background; ``path`` and ``step`` say which.
AsyncCkptSaveError = CheckpointWriteError


class AsyncCkptIO(CheckpointIO):
    """Asynchronous, crash-safe checkpoints for Lightning: ``Trainer(plugins=[AsyncCkptIO()])``, or
    ``Fabric(plugins=[io])`` with ``io.teardown()`` at the end of the run.

    Args:
        max_in_flight: checkpoints whose write may be pending at once. Each holds a staging buffer
            the size of its file (allocated on first need, then reused). The default 2 lets
            ``ModelCheckpoint(save_last=True)``'s two back-to-back saves (top-k file + ``last.ckpt``)
            both return after their snapshot.
        timeout: bound, in seconds, on every wait for the background writer.
        direct_io: write with O_DIRECT where the filesystem supports it.
        io_threads: parallel write threads in the background writer.
        sync_patterns: file-name patterns (``fnmatch``) saved synchronously; default none. The
            SLURM requeue checkpoint ``hpc_ckpt_*`` is asynchronous too: the job is requeued right
            after that save returns, and its background writer finishes it even when the training
            process is killed (within ``timeout``); the requeued run waits for that writer before
            it picks the checkpoint to resume from.
        sync_on_exception: save synchronously while an exception is being handled.
        verify_on_resume: check a checkpoint against its checksums before Lightning loads it
            (``asyncckpt.core.verify.integrity``); a damaged one raises ``CorruptCheckpointError`` naming the
            file (and, in a sharded checkpoint, the key). Files written without asyncckpt load unchecked.
        resume_from_intact: when Lightning picked the checkpoint itself (``ckpt_path="last"``,
            ``"best"``, ``"hpc"``) and it is damaged, resume from the newest other checkpoint in its
            directory that checks out, with a warning naming the one skipped.
        export: ``"safetensors"`` or an ``asyncckpt.core.ExportOptions``: after each checkpoint commits, rank 0's
            writer exports the ``LightningModule``'s state dict as Hugging Face safetensors, by default to
            ``exports/<checkpoint name>`` beside it (``ExportOptions(keys=..., add_prefix=...)`` choose the names).
        on_commit: called with each checkpoint's path once it committed, off the training loop
            (``Checkpointer(on_commit=...)``); what it raises fails like a save, at the next save or teardown.
    """

    def __init__(self, *, max_in_flight: int = 2, timeout: float = 600.0, direct_io: bool = True,
                 io_threads: int = 2, sync_patterns: tuple[str, ...] = (),
                 sync_on_exception: bool = True, verify_on_resume: bool = True, resume_from_intact: bool = False,
                 export: Optional[ExportOptions | str] = None, on_commit: Optional[Callable[[str], Any]] = None) -> None:
        versions.require(SUPPORT)
        super().__init__()
        self.max_in_flight, self.timeout, self.direct_io, self.io_threads = max_in_flight, timeout, direct_io, io_threads
        self.sync_patterns, self.sync_on_exception = tuple(sync_patterns), sync_on_exception
        self.verify_on_resume, self.resume_from_intact = verify_on_resume, resume_from_intact
        self.picked_by_lightning: Optional[str] = None  # the path Lightning resolved "last"/"best"/"hpc" to
        self.checkpointer = Checkpointer(max_in_flight=max_in_flight, timeout=timeout, direct_io=direct_io,
                                         io_threads=io_threads, export=export, on_commit=on_commit)
        self._last_save: Optional[SaveHandle] = None  # removals wait for it
        integration.install(AsyncCkptIO)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_last_save": None, "picked_by_lightning": None}  # the Checkpointer: its options

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        integration.install(AsyncCkptIO)

    def __repr__(self) -> str:
        return (f"AsyncCkptIO(max_in_flight={self.max_in_flight}, direct_io={self.direct_io}, "
                f"io_threads={self.io_threads}, pending={len(self.pending())})")

    # ------------------------------------------------------------------ CheckpointIO
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        """Snapshot ``checkpoint`` and return; the file appears at ``path`` complete, or not at all."""
        _refuse_storage_options(storage_options, type(self).__name__)
        path = os.fspath(path) if not _is_local(path) else os.path.abspath(os.fspath(path))  # URLs: object storage
        if _is_local(path) and os.path.isdir(path) and not os.path.islink(path):
            raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
        step, label = _step_and_label(checkpoint)
        self._saved(self.checkpointer.async_save_file(checkpoint, path, step=step, label=label), path)

    def load_checkpoint(self, path: _PATH, map_location: Optional[Callable] = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Wait for pending writes (on every rank under DDP), then load with ``TorchCheckpointIO``, the
        file's checksum computed beside the load, over the pages it reads (``resume.load_file``; a URL's
        object is fetched once, then loaded and hashed)."""
        self.checkpointer.wait(everywhere=True)
        if _is_local(path):  # saved by another Trainer's plugin in this process, or a writer still finishing it
            resume.wait_for_saves(os.path.abspath(os.fspath(path)))

        def load(file: _PATH) -> dict[str, Any]:
            return TorchCheckpointIO().load_checkpoint(file, map_location=map_location, weights_only=weights_only)

        if not self.verify_on_resume:
            return load(path)
        path = os.path.abspath(os.fspath(path)) if _is_local(path) else os.fspath(path)
        paths = [path]
        if self.resume_from_intact and path == self.picked_by_lightning and _is_local(path):  # older ones may stand in
            paths += [p for p in resume.candidates(os.path.dirname(path), _checkpoint_file_mtime)
                      if os.path.realpath(p) != os.path.realpath(path)]
        return resume.first_intact(paths, lambda candidate: resume.load_file(candidate, load))

    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove ``path`` after the save queued last, and only if that save committed."""
        self.checkpointer.remove([path], after=self._last_save)

    def teardown(self) -> None:
        """The run ended: wait for every save (on every rank), raise a failed one, stop the writer.
        The Trainer calls it; with Fabric, call it on every process at the end of the run. When the run
        is ending with an error already (the Trainer tears down inside its ``except``, a failed save's
        included), another failed save is logged, not raised: raised, it would replace the error the run
        ended with (under load a second failed save could surface here before the first's error did)."""
        ending_with = sys.exc_info()[1]
        try:
            self.checkpointer.wait(everywhere=True)
        except CheckpointWriteError as error:
            if ending_with is None:
                raise
            logger.error("asyncckpt: %s (the run was already ending with %s: %s)", error, type(ending_with).__name__,
                         ending_with)
        finally:
            self.checkpointer.teardown()

    # ------------------------------------------------------------------ for users and ``integration``
    def wait(self) -> None:
        """Block until every queued save, removal and link is done; raise the first failure."""
        self.checkpointer.wait()

    def pending(self) -> list[str]:
        """Paths with a save, removal or link not done yet, oldest first."""
        return [handle.path for handle in self.checkpointer.pending()]

    def link(self, target: str, linkpath: str) -> None:
        """``save_last="link"``: point ``linkpath`` at ``target`` once the save of ``target``
        (queued last) committed."""
        self.checkpointer.link(target, linkpath, after=self._last_save)

    def save_sharded(self, strategy: Any, checkpoint: dict[str, Any], filepath: _PATH, model_key: str) -> None:
        """The sharded branch of ``FSDPStrategy`` / ``ModelParallelStrategy.save_checkpoint``: every
        rank's shards → ``Checkpointer.async_save``, with Lightning's ``meta.pt`` (the rest of the
        checkpoint) written by rank 0 into the directory before it is committed."""
        path = os.path.abspath(os.fspath(strategy.broadcast(filepath)))
        converted = {model_key: checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
        meta = None
        if strategy.global_rank == 0:
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)  # what Lightning writes to meta.pt, taken now (a snapshot)
            meta = {"meta.pt": buffer.getvalue()}
        step, label = _step_and_label(checkpoint)
        self._saved(self.checkpointer.async_save(converted, path, step=step, label=label, extra_files=meta), path)

    def _saved(self, handle: SaveHandle, path: str) -> None:
        self._last_save = handle
        name = os.path.basename(path)
        if any(fnmatch.fnmatch(name, pattern) for pattern in self.sync_patterns) or (
                self.sync_on_exception and sys.exc_info()[1] is not None):
            handle.result()


def _refuse_storage_options(storage_options: Optional[Any], owner: str) -> None:
    if storage_options is not None:
        raise TypeError(
            "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
            f" is not supported for `{owner}`. Please implement your custom `CheckpointIO`"
            " to define how you'd like to use `storage_options`.")


def _step_and_label(checkpoint: Any) -> tuple[Optional[int], Optional[str]]:
    if not isinstance(checkpoint, dict) or "global_step" not in checkpoint:
        return None, None
    step = checkpoint["global_step"]
    return step, f"epoch={checkpoint.get('epoch')}, global_step={step}"


def _checkpoint_file_mtime(path: str) -> Optional[float]:
    return os.path.getmtime(path) if path.endswith(".ckpt") and os.path.isfile(path) else None


def _is_local(path: _PATH) -> bool:
    return "://" not in str(os.fspath(path))
