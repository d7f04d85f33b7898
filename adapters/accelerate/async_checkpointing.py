"""``enable_async_checkpointing(accelerator)``: the whole ``Accelerator.save_state()`` becomes asynchronous.

More: docs/MODULES.md, adapters/accelerate/async_checkpointing.py.
"""
from __future__ import annotations

import logging
import os
import re
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

from accelerate import Accelerator
from accelerate.utils import DistributedType

from asyncckpt.core import Checkpointer, CheckpointOptions, is_complete
from asyncckpt.core.integration import (SaveMetrics, capture, dist_env, normalize_path, patching, resolve_options,
                                        resume, saving, taking_options, versions)

from .capture import OPTIMIZER_FILE, Capture
from .support import FSDP, SUPPORT

logger = logging.getLogger("asyncckpt.accelerate")

_ATTRIBUTE = "_asyncckpt"  # on an Accelerator instance: its AsyncCheckpointing
_CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d+)$")
_accelerate_number = resume.numbered(re.compile(r"([0-9]+)(?=[^/]*$)"))  # Accelerate's own sort key for checkpoints/


@taking_options
def enable_async_checkpointing(accelerator: Accelerator, options: Optional[CheckpointOptions] = None, *,
                               spread_writes: bool = True, inline_bytes: int = 1 << 20, fix_iteration: bool = True,
                               **kwargs: Any) -> "AsyncCheckpointing":
    """Make ``accelerator.save_state()`` asynchronous (see the module docstring); returns the handle
    (``.wait()``, ``.remove()``). Call it once, on every process, after creating the Accelerator.

    Takes every option of ``asyncckpt.core.CheckpointOptions`` (the same names, defaults and meanings as the
    core's and the other adapters': docs/options.md) as keyword arguments, or the object as ``options``
    (``export`` goes to ``project_dir/exports/checkpoint_N`` by default: Accelerate counts every entry of
    ``checkpoints/``), and these of its own, which only Accelerate's layout needs:

    Args:
        spread_writes: under DDP (every process holds a replica), write the large files (``model*.safetensors``,
            ``optimizer*.bin``) from different processes instead of all from the main process: Accelerate
            alone decides per file which process writes it.
        inline_bytes: files holding fewer tensor bytes than this are serialised at call time (no staging
            buffer): Accelerate writes many small files (RNG, scheduler, sampler state) besides the large ones.
        fix_iteration: ``load_state`` restores ``project_configuration.iteration`` (accelerate #3306), which
            Accelerate alone forgets.
    """
    if _ATTRIBUTE in vars(accelerator):
        raise RuntimeError("asyncckpt: async checkpointing is already enabled on this Accelerator "
                           "(use the handle it returned; handle.remove() undoes it)")
    options, _ = resolve_options("enable_async_checkpointing", options, kwargs)
    return AsyncCheckpointing(accelerator, options, spread_writes=spread_writes, inline_bytes=inline_bytes,
                              fix_iteration=fix_iteration)


class AsyncCheckpointing:
    """Returned by ``enable_async_checkpointing``: ``wait()`` drains pending saves (raising the first failure),
    ``pending()`` names them, ``metrics`` holds each save's record, ``close()`` frees the snapshot buffers, ``remove()``
    drains and restores Accelerate's native behaviour for this accelerator (the same words in every adapter)."""

    def __init__(self, accelerator: Accelerator, options: CheckpointOptions, *, spread_writes: bool = True,
                 inline_bytes: int = 1 << 20, fix_iteration: bool = True) -> None:
        self.release = versions.require(SUPPORT)
        self.accelerator = accelerator
        self.spread_writes, self.inline_bytes, self.fix_iteration = spread_writes, inline_bytes, fix_iteration
        if options.export is not None and options.export.directory is None and accelerator.project_dir:
            options = options.replace(export=replace(options.export, directory=os.path.join(
                os.path.abspath(accelerator.project_dir), "exports")))  # beside checkpoints/, never in it
        self.checkpointer = Checkpointer(options)
        self._metrics = SaveMetrics(self.checkpointer)
        self.last_written: list[str] = []  # files this process staged in its latest save_state()
        self._attach()
        dist_env.warn_if_launched_as_many(accelerator.num_processes, "Accelerate", "Launch with `accelerate launch` "
                                          "(or torchrun with the process group set up) so that they train together.")
        self.checkpointer.start(at_first_step=True)  # after a load_state() that comes first, not at the first save

    def _attach(self) -> None:
        vars(self.accelerator)[_ATTRIBUTE] = self
        self._step_hook = self.checkpointer.snapshot_thread.guard_every_optimizer() if self.options.overlap_optimizer else None
        for name in ("save_state", "load_state", "end_training"):
            patching.install(Accelerator, name, _dispatching(name))

    def __getstate__(self) -> dict:
        return {"accelerator": self.accelerator, "checkpointer": self.checkpointer, "spread_writes": self.spread_writes,
                "inline_bytes": self.inline_bytes, "fix_iteration": self.fix_iteration}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.release = versions.require(SUPPORT)
        self._metrics = SaveMetrics(self.checkpointer)
        self.last_written = []
        self._attach()

    @property
    def options(self) -> CheckpointOptions:
        return self.checkpointer.options

    @property
    def pending(self) -> "_Pending":
        """``handle.pending()``: final directories of the saves not committed yet (and of their pending deletions),
        oldest first. (Read without the call, the old spelling of a property, it is that list, with a warning.)"""
        return _Pending(handle.path for handle in self.checkpointer.pending())

    @property
    def metrics(self) -> list[dict]:
        """Every save's record (``step``, ``stall_s``, ``waited_s``, ``durable_s``, ``bytes``, ``snapshot_wait_s``), as
        ``accelerator.log`` gets them (docs/options.md)."""
        return self._metrics.history

    def wait(self) -> None:
        """Wait for every pending save (and its total_limit deletions); raise the first failure."""
        self.checkpointer.wait()

    def close(self) -> None:
        """After the last save: wait for every save, stop the writer and free the snapshot buffers (pinned host
        memory, up to ``max_in_flight`` copies of the checkpoint; ``end_training()`` keeps them for a next run). The
        accelerator still saves asynchronously: a later save allocates them again."""
        self.checkpointer.teardown(free_buffers=True)

    def remove(self) -> None:
        """Drain, then undo everything for this accelerator: its saves are native again."""
        try:
            self.wait()
        finally:
            vars(self.accelerator).pop(_ATTRIBUTE, None)
            if self._step_hook is not None:
                self._step_hook.remove()
            self.checkpointer.close()

    # ------------------------------------------------------------------ save_state
    def save_state(self, original: Callable, output_dir: Optional[str] = None, safe_serialization: bool = True,
                   **kwargs: Any) -> Any:
        acc, config = self.accelerator, self.accelerator.project_configuration
        if acc.distributed_type in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
            warnings.warn(f"asyncckpt: {acc.distributed_type.value} writes its model and optimizer files itself, "
                          "synchronously; the checkpoint is still published only complete", RuntimeWarning, stacklevel=3)
        if not self._asynchronous():
            self.wait()
            return original(acc, output_dir, safe_serialization=safe_serialization, **kwargs)
        started = time.perf_counter()
        self.checkpointer.snapshot_thread.wait()  # the last save's overlapped snapshot first
        self.checkpointer.raise_failures()
        automatic = config.automatic_checkpoint_naming
        if automatic:
            final_dir, removals, hidden_parent = self._automatic_target()
        elif output_dir is None:  # Accelerate raises its own error for this
            return original(acc, output_dir, safe_serialization=safe_serialization, **kwargs)
        else:
            final_dir, removals, hidden_parent = normalize_path(os.path.expanduser(os.fspath(output_dir))), [], None
            self.checkpointer.wait_for(final_dir)
            if not _replaceable(final_dir):
                return self._native_save(original, output_dir, safe_serialization, kwargs)
        with self.checkpointer.begin_directory(final_dir, step=config.iteration if automatic else None,
                                               staging_parent=hidden_parent) as tx:
            overlap = saving.overlaps_optimizer(self.checkpointer, acc._optimizers)
            files = capture.FileCapture(tx, tx.claim(), inline_bytes=self.inline_bytes,
                                        defer=(lambda name: OPTIMIZER_FILE.match(name) is not None) if overlap else None)
            writes = Capture(tx, files, save_on_each_node=config.save_on_each_node, spread_writes=self.spread_writes)
            with writes.installed(), patching.patched(config, "automatic_checkpoint_naming", False):
                original(acc, tx.claim(), safe_serialization=safe_serialization, **kwargs)
            writes.stage_spread()
        self.last_written = sorted(files.written)
        # the optimizer snapshot, then the commit, while the next forward/backward runs
        saving.finish(self.checkpointer, tx, stage_later=files.stage_deferred if files.deferred else None,
                      removals=removals, hidden_parent=hidden_parent)
        self._metrics.saved(tx.handle, time.perf_counter() - started)
        self._log_metrics()
        return Path(final_dir)

    def _asynchronous(self) -> bool:
        """False where the installed Accelerate changed what this adapter relies on for the accelerator's
        kind (``versions.require`` said so once): its own save_state and load_state then run."""
        return self.accelerator.distributed_type != DistributedType.FSDP or self.release.allows(FSDP)

    def _log_metrics(self, *, final: bool = False) -> None:
        """The records of committed saves, to Accelerate's trackers (``accelerator.log``: the main process's)."""
        for record in self._metrics.ready(final=final):
            self.accelerator.log({f"checkpoint/{name}": value for name, value in record.items() if value is not None})

    def _automatic_target(self) -> tuple[str, list[str], Optional[str]]:
        """What Accelerate's save_state does with automatic naming, with checkpoints in flight counted as
        present and queued deletions as gone: the ``total_limit`` victims (main process) and the name."""
        acc, config = self.accelerator, self.accelerator.project_configuration
        root = os.path.abspath(os.path.join(acc.project_dir, "checkpoints"))
        os.makedirs(root, exist_ok=True)
        def on_disk() -> list[str]:
            return sorted((p for p in (os.path.join(root, name) for name in os.listdir(root))
                           if _accelerate_number(p) is not None), key=_accelerate_number)

        entries = self.checkpointer.checkpoints_in(root, on_disk)
        removals = saving.rotation(self.checkpointer, root, on_disk, keep=config.total_limit, adding=1) \
            if acc.is_main_process else []
        if removals:
            logger.info("asyncckpt: deleting %s once checkpoint_%d is committed (total_limit=%d)",
                        [os.path.basename(p) for p in removals], config.iteration, config.total_limit)
        final_dir = os.path.join(root, f"checkpoint_{config.iteration}")
        if final_dir in entries:
            raise ValueError(f"Checkpoint directory {final_dir} ({config.iteration}) already exists. Please manually "
                             "override `self.save_iteration` with what iteration to start with.")
        acc.wait_for_everyone()
        parent = os.path.dirname(root)  # staged and removed beside checkpoints/, where nothing counts entries
        return final_dir, removals, parent if os.stat(parent).st_dev == os.stat(root).st_dev else None

    def _native_save(self, original: Callable, output_dir: str, safe_serialization: bool, kwargs: dict) -> Any:
        """``output_dir`` holds something that is not an asyncckpt checkpoint (the user's own files):
        replacing it as a whole could lose them, so this save is Accelerate's own, synchronous."""
        logger.warning("asyncckpt: %s already exists and is not an asyncckpt checkpoint; saving into it "
                       "synchronously (Accelerate's own save_state)", output_dir)
        self.wait()
        return original(self.accelerator, output_dir, safe_serialization=safe_serialization, **kwargs)

    # ------------------------------------------------------------------ load_state, end_training
    def load_state(self, original: Callable, input_dir: Optional[str] = None, *args: Any, **kwargs: Any) -> Any:
        """Resumes through ``resume.resume``: saves in flight committed first, the checkpoint checked as it is
        read (with ``input_dir=None``, the newest ``checkpoint_N``: the one Accelerate picks, or with
        ``resume_from_intact`` the newest that checks out; with ``mirror_to`` and none here, the newest
        mirrored); afterwards, ``iteration`` fixed (accelerate #3306)."""
        acc = self.accelerator
        root = os.path.join(acc.project_dir, "checkpoints") if acc.project_dir else None
        if not self._asynchronous():
            return original(acc, input_dir, *args, **kwargs)

        def load(path: Optional[str]) -> Any:
            return original(acc, input_dir if input_dir is not None else path, *args, **kwargs)

        if input_dir is not None:  # the user's choice: never replaced by another
            result = resume.resume(self.checkpointer, load, reads="files", path=os.fspath(input_dir))
        elif root is not None and acc.project_configuration.automatic_checkpoint_naming:
            result = resume.resume(self.checkpointer, load, reads="files", root=root, key=_accelerate_number)
        else:
            result = load(None)  # Accelerate raises its own error for this
        self._fix_iteration()
        return result

    def end_training(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        """The run ended: wait for every save, log its metrics (before the trackers end), stop the background
        writer (it starts again if needed)."""
        try:
            self.checkpointer.teardown()
            self._log_metrics(final=True)
        finally:
            result = original(self.accelerator, *args, **kwargs)
        return result

    def _fix_iteration(self) -> None:
        """``load_state`` does not restore ``project_configuration.iteration``, so a resumed run would count
        from 0 again, delete newer checkpoints under total_limit and then fail with "already exists". Set it
        past every existing ``checkpoint_N`` (in memory too); a higher value the user set by hand is kept."""
        acc, config = self.accelerator, self.accelerator.project_configuration
        if not (self.fix_iteration and config.automatic_checkpoint_naming and acc.project_dir):
            return
        numbers = [int(m[1]) for folder in resume.places(self.checkpointer, os.path.join(acc.project_dir, "checkpoints"))
                   for m in map(_CHECKPOINT_NAME.match, os.listdir(folder) if os.path.isdir(folder) else []) if m]
        if numbers and config.iteration <= max(numbers):
            config.iteration = max(numbers) + 1


def _dispatching(name: str) -> Callable[[Callable], Callable]:
    """``Accelerator.<name>`` → the accelerator's ``AsyncCheckpointing.<name>``, or the original."""
    def make(original: Callable) -> Callable:
        def method(accelerator: Accelerator, *args: Any, **kwargs: Any) -> Any:
            handle = vars(accelerator).get(_ATTRIBUTE)
            if handle is None:
                return original(accelerator, *args, **kwargs)
            return getattr(handle, name)(original, *args, **kwargs)

        method.__name__, method.__doc__ = name, original.__doc__
        return method

    return make


def _replaceable(final_dir: str) -> bool:
    """Can a save to an explicit ``output_dir`` publish by replacing what is there? Yes if nothing is
    there, an empty directory, or one of our committed checkpoints."""
    if not os.path.lexists(final_dir):
        return True
    if os.path.isdir(final_dir) and not os.path.islink(final_dir):
        return not os.listdir(final_dir) or is_complete(final_dir)
    return False


class _Pending(list):
    """What ``handle.pending`` returns: called (``handle.pending()``, the one spelling every adapter shares), the list
    of paths; used as a list itself (the property it was before), the same list with a ``FutureWarning``."""

    def __call__(self) -> list[str]:
        return list.copy(self)

    def _old_spelling(self) -> None:
        warnings.warn("asyncckpt: AsyncCheckpointing.pending is a method now (handle.pending(), as in every adapter); "
                      "reading it as a list is deprecated and will be removed in the next release", FutureWarning,
                      stacklevel=3)

    def __iter__(self):
        self._old_spelling()
        return list.__iter__(self)

    def __len__(self) -> int:
        self._old_spelling()
        return list.__len__(self)

    def __bool__(self) -> bool:
        self._old_spelling()
        return list.__len__(self) > 0

    def __getitem__(self, index: Any) -> Any:
        self._old_spelling()
        return list.__getitem__(self, index)

    def __contains__(self, item: Any) -> bool:
        self._old_spelling()
        return list.__contains__(self, item)

    def __eq__(self, other: Any) -> bool:
        self._old_spelling()
        return list.__eq__(self, other)

    __hash__ = None  # type: ignore[assignment]  # a list
