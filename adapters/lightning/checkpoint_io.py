"""``AsyncCkptIO``: a Lightning ``CheckpointIO`` whose saves return after a snapshot.

More: docs/MODULES.md, adapters/lightning/checkpoint_io.py.
"""
from __future__ import annotations

import fnmatch
import io
import logging
import os
import sys
import time
from typing import Any, Callable, Optional

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH

from asyncckpt.core import Checkpointer, CheckpointOptions, CheckpointWriteError
from asyncckpt.core.integration import (SaveHandle, SaveMetrics, is_url, normalize_path, resolve_options, resume,
                                        taking_options, versions)

from . import integration
from .support import SUPPORT

logger = logging.getLogger("asyncckpt")

#: A checkpoint save (or removal) that failed in the background; ``path`` and ``step`` say which.
AsyncCkptSaveError = CheckpointWriteError


class AsyncCkptIO(CheckpointIO):
    """Asynchronous, crash-safe checkpoints for Lightning: ``Trainer(plugins=[AsyncCkptIO()])``, or
    ``Fabric(plugins=[io])`` with ``io.teardown()`` at the end of the run.

    Takes every option of ``asyncckpt.core.CheckpointOptions`` (the same names, defaults and meanings as the
    core's and the other adapters': docs/options.md) as keyword arguments, or the object as ``options``.
    Here, ``max_in_flight=2`` (the default) lets ``ModelCheckpoint(save_last=True)``'s two back-to-back saves
    (top-k file + ``last.ckpt``) both return after their snapshot; ``export`` writes the ``LightningModule``'s
    state dict, by default to ``exports/<checkpoint name>`` beside it; ``mirror_to`` copies each ``.ckpt`` there
    and ``ckpt_path="last"`` restores ``last.ckpt`` from there when it is not here; ``resume_from_intact`` applies
    where Lightning picked the checkpoint itself (``"last"``, ``"best"``, ``"hpc"``); ``overlap_optimizer`` has no
    effect: Lightning writes the optimizer state into the one ``.ckpt`` file. And these of its own:

    Args:
        sync_patterns: file-name patterns (``fnmatch``) saved synchronously; default none. The
            SLURM requeue checkpoint ``hpc_ckpt_*`` is asynchronous too: the job is requeued right
            after that save returns, and its background writer finishes it even when the training
            process is killed (within ``timeout``); the requeued run waits for that writer before
            it picks the checkpoint to resume from. (Lightning alone names its saves by pattern.)
        sync_on_exception: save synchronously while an exception is being handled (Lightning alone saves
            from its exception handlers: on-exception checkpoints, the process is about to go).
    """

    @taking_options
    def __init__(self, options: Optional[CheckpointOptions] = None, *, sync_patterns: tuple[str, ...] = (),
                 sync_on_exception: bool = True, **kwargs: Any) -> None:
        release = versions.require(SUPPORT)
        super().__init__()
        self.sync_patterns, self.sync_on_exception = tuple(sync_patterns), sync_on_exception
        self.checkpointer = Checkpointer(resolve_options(type(self).__name__, options, kwargs)[0])
        self._metrics = SaveMetrics(self.checkpointer)
        self.picked_by_lightning: Optional[str] = None  # the path Lightning resolved "last"/"best"/"hpc" to
        self.trainer: Optional[Any] = None  # the Trainer whose strategy holds it (its loggers get the metrics)
        self._last_save: Optional[SaveHandle] = None  # removals wait for it
        integration.install(AsyncCkptIO, release)

    def __getstate__(self) -> dict:  # the Checkpointer pickles as its options
        return {**self.__dict__, "_last_save": None, "picked_by_lightning": None, "trainer": None,
                "_metrics": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._metrics = SaveMetrics(self.checkpointer)
        integration.install(AsyncCkptIO, versions.require(SUPPORT))

    @property
    def options(self) -> CheckpointOptions:
        return self.checkpointer.options

    @property
    def metrics(self) -> list[dict]:
        """Every save's record (``step``, ``stall_s``, ``waited_s``, ``durable_s``, ``bytes``, ``snapshot_wait_s``), as the
        Trainer's loggers get them (docs/options.md); Fabric's user logs them from here."""
        return self._metrics.history

    def __repr__(self) -> str:
        return f"AsyncCkptIO({self.options}, pending={len(self.pending())})"

    # ------------------------------------------------------------------ CheckpointIO
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        """Snapshot ``checkpoint`` and return; the file appears at ``path`` complete, or not at all."""
        _refuse_storage_options(storage_options, type(self).__name__)
        started = time.perf_counter()
        path = normalize_path(path)
        if not is_url(path) and os.path.isdir(path) and not os.path.islink(path):
            raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
        step, label = _step_and_label(checkpoint)
        best = self.trainer is not None and any(  # a monitored best (without a monitor, the best is the last)
            getattr(callback, "monitor", None) and normalize_path(callback.best_model_path or ".") == path
            for callback in self.trainer.checkpoint_callbacks)
        handle = self.checkpointer.async_save_file(checkpoint, path, step=step, label=label,
                                                   durable=True if best else None)  # "best" loads it after the run
        self._saved(handle, path, started)

    def load_checkpoint(self, path: _PATH, map_location: Optional[Callable] = lambda storage, loc: storage,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The kit's resume sequence (``resume.resume``), then ``TorchCheckpointIO``'s load, the file's checksum
        computed beside it, over the pages it reads (a URL's object is fetched once, then loaded and hashed).
        Where Lightning picked the file itself, with ``resume_from_intact``, older ones may stand in."""
        def load(file: Optional[str]) -> dict[str, Any]:
            return TorchCheckpointIO().load_checkpoint(file, map_location=map_location, weights_only=weights_only)

        path = normalize_path(path)
        picked = path == self.picked_by_lightning and not is_url(path)
        return resume.resume(self.checkpointer, load, reads="file", path=path,
                             root=os.path.dirname(path) if picked else None, key=_checkpoint_file_mtime)

    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove ``path`` after the save queued last, and only if that save committed."""
        self.checkpointer.remove([path], after=self._last_save)

    def teardown(self) -> None:
        """The run ended: wait for every save (on every rank), raise a failed one, log the saves' metrics, stop
        the writer. The Trainer calls it; with Fabric, call it on every process at the end of the run. When the
        run is ending with an error already (the Trainer tears down inside its ``except``, a failed save's
        included), another failed save is logged, not raised: raised, it would replace the error the run
        ended with (under load a second failed save could surface here before the first's error did)."""
        ending_with = sys.exc_info()[1]
        try:
            self.checkpointer.wait(everywhere=True)
            self._log_metrics(final=True)
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

    def close(self) -> None:
        """After the last run: ``teardown()``, and free the snapshot buffers (pinned host memory, up to
        ``max_in_flight`` copies of the checkpoint, which ``teardown`` keeps for the next run; a later save allocates
        them again). On every process, as ``teardown``."""
        try:
            self.teardown()
        finally:
            self.checkpointer.teardown(free_buffers=True)

    def link(self, target: str, linkpath: str) -> None:
        """``save_last="link"``: point ``linkpath`` at ``target`` once the save of ``target``
        (queued last) committed."""
        self.checkpointer.link(target, linkpath, after=self._last_save)

    def save_sharded(self, strategy: Any, checkpoint: dict[str, Any], filepath: _PATH, model_key: str) -> None:
        """The sharded branch of ``FSDPStrategy`` / ``ModelParallelStrategy.save_checkpoint``: every
        rank's shards → ``Checkpointer.async_save``, with Lightning's ``meta.pt`` (the rest of the
        checkpoint) written by rank 0 into the directory before it is committed."""
        started = time.perf_counter()
        path = normalize_path(strategy.broadcast(filepath))
        converted = {model_key: checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
        meta = None
        if strategy.global_rank == 0:
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)  # what Lightning writes to meta.pt, taken now (a snapshot)
            meta = {"meta.pt": buffer.getvalue()}
        step, label = _step_and_label(checkpoint)
        self._saved(self.checkpointer.async_save(converted, path, step=step, label=label, extra_files=meta), path,
                    started)

    def _saved(self, handle: SaveHandle, path: str, started: float) -> None:
        self._last_save = handle
        name = os.path.basename(path)
        if any(fnmatch.fnmatch(name, pattern) for pattern in self.sync_patterns) or (
                self.sync_on_exception and sys.exc_info()[1] is not None):
            handle.result()
        self._metrics.saved(handle, time.perf_counter() - started)
        self._log_metrics()

    def _log_metrics(self, *, final: bool = False) -> None:
        """The records of committed saves, to the Trainer's loggers (rank 0's, as Lightning logs)."""
        records = self._metrics.ready(final=final)
        if self.trainer is None:  # Fabric: its user logs them (``io.metrics``)
            return
        for record in records:
            metrics = {f"checkpoint/{name}": float(value) for name, value in record.items()
                       if value is not None and name != "step"}
            for trainer_logger in self.trainer.loggers:
                trainer_logger.log_metrics(metrics, step=self.trainer.global_step)


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
    """Lightning's order of its candidates: a ``.ckpt`` file's mtime."""
    return os.path.getmtime(path) if path.endswith(".ckpt") and os.path.isfile(path) else None
