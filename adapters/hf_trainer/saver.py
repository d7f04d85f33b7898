"""The asynchronous ``Trainer._save_checkpoint``: same files, same bookkeeping, written in the background.

Reads top to bottom as the Trainer's own ``_save_checkpoint`` (transformers 5.x) does, with these
differences, each marked ``# async:`` below:

* every file goes through one ``DirectoryTransaction``: the Trainer's save methods write into a
  scratch directory while their data files are snapshot and queued (see ``capture.py``); the
  folder appears as ``checkpoint-N`` only once every rank's files are durable;
* ``best_model_checkpoint`` counts a checkpoint being written as existing (native checks the disk);
* rotation (``save_total_limit``) is queued behind the commit, in the writer's FIFO, and only runs
  if the new checkpoint was committed; it never touches a checkpoint still being written or the best;
* at most ``max_pending`` checkpoints are uncommitted: a save beyond that first waits for the oldest;
  a failed background save raises at the next save (or at the end of training), naming its folder;
* before anything reads a checkpoint back (``_load_best_model``) and before training ends
  (``_finalize_training``), every pending save is waited for;
* with ``overlap_optimizer``, ``optimizer.pt`` is snapshot on a thread while the next forward and
  backward run, and every ``optimizer.step()`` first waits for that thread.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from asyncckpt.core import Checkpointer, CheckpointError, CheckpointWriteError
from asyncckpt.core.checkpointer import wait_before_every_step
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, sort_checkpoints
from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available

from .capture import capture_into

logger = logging.getLogger("asyncckpt.hf_trainer")

TRAINER_STATE_NAME = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
OPTIMIZER_NAME = "optimizer.pt"  # transformers.trainer.OPTIMIZER_NAME
_STALE_STAGING_RE = re.compile(rf"^\.{PREFIX_CHECKPOINT_DIR}-\d+\.asyncckpt-(staging|replaced)-")
_MARK = "_asyncckpt_saver"  # on the Trainer instance: the saver installed there


@dataclass
class PendingCheckpoint:
    """One checkpoint directory handed to the background writer and not yet known committed."""

    final_dir: str  # absolute
    step: int
    handles: list = field(default_factory=list)  # the files' handles, then the commit's (last)

    @property
    def commit(self):
        return self.handles[-1]

    def done(self) -> bool:
        return self.commit.done()

    def failure(self) -> Optional[BaseException]:
        """The first error of this checkpoint's files or commit (every handle marked as seen)."""
        first = None
        for handle in self.handles:
            if handle.done():
                try:
                    handle.result(0)
                except BaseException as e:  # noqa: BLE001 - reported below, with the folder
                    first = first or e
        return first


class AsyncCheckpointSaver:
    """Installed on one Trainer instance; replaces its ``_save_checkpoint`` and waits where needed."""

    def __init__(self, trainer, *, max_pending: int, timeout: float, direct_io: bool,
                 checkpointer: Optional[Checkpointer], overlap_optimizer: bool = True) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self._trainer = weakref.ref(trainer)
        self.max_pending = max_pending
        self.overlap_optimizer = overlap_optimizer
        self._tail_running = False  # snapshots deferred to the next optimizer step, then the commit, are running
        self._tail_error: Optional[tuple[PendingCheckpoint, BaseException]] = None
        self._step_hook = None
        self.timeout = timeout
        self.direct_io = direct_io
        self._own_checkpointer = checkpointer is None
        self._checkpointer = checkpointer
        self._pending: deque[PendingCheckpoint] = deque()
        self._written: list[str] = []  # our checkpoint dirs (absolute), in save order
        self._removed: set[str] = set()  # queued for deletion by our rotation
        self._fallback_warned = False
        self._overlap_warned = False
        self.stalls: list[tuple[int, float]] = []  # (global step, seconds the training loop was blocked)
        self.timings: list[dict] = []  # per save: stall_s, and waited_s of it for an earlier checkpoint's commit
        self._originals: dict[str, Callable] = {}

    # ------------------------------------------------------------------ installation
    @staticmethod
    def installed_on(trainer) -> Optional["AsyncCheckpointSaver"]:
        return trainer.__dict__.get(_MARK)

    def install(self) -> None:
        """Shadow three methods on this Trainer instance (not its class): the same signatures.

        Code that wraps them again afterwards (a profiler, another callback) keeps working: the
        Trainer calls the outermost attribute, which ends in ours."""
        trainer = self._trainer()
        for name, replacement in (("_save_checkpoint", self.save_checkpoint),
                                  ("_load_best_model", self._wait_then("_load_best_model")),
                                  ("_finalize_training", self._wait_then("_finalize_training"))):
            self._originals[name] = getattr(trainer, name)
            setattr(trainer, name, replacement)
        trainer.__dict__[_MARK] = self
        if self.overlap_optimizer:
            # Any optimizer step (ours is the only one that changes the state we snapshot) first
            # waits for a deferred optimizer.pt snapshot: a torch optimizer's state changes only in step().
            self._step_hook = wait_before_every_step(self._join_tail_before_step)

    def _wait_then(self, name: str) -> Callable:
        def call(*args, **kwargs):
            self.drain()  # async: a load (best model) or the end of training needs every write committed
            return self._originals[name](*args, **kwargs)

        return call

    # ------------------------------------------------------------------ the save
    def save_checkpoint(self, model, trial) -> None:
        trainer = self._trainer()
        if not self._supported(trainer):
            self.drain()
            return self._originals["_save_checkpoint"](model, trial)
        started = time.perf_counter()
        args, state = trainer.args, trainer.state
        waited = 0.0
        try:
            self._raise_tail_error()
            self._raise_failures()
            self._apply_back_pressure()  # async: at most max_pending checkpoints uncommitted
            waited = time.perf_counter() - started

            checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
            if trainer.hp_search_backend is None and trial is None:
                trainer.store_flos()
            run_dir = trainer._get_output_dir(trial=trial)
            output_dir = os.path.join(run_dir, checkpoint_folder)
            final_dir = os.path.abspath(output_dir)

            tx = self.checkpointer().begin_directory(final_dir, step=state.global_step)
            defer = (lambda name: name == OPTIMIZER_NAME) if self._may_defer_optimizer(trainer) else None
            with capture_into(tx, defer=defer) as cap:  # async: the Trainer's own save code, files snapshot + queued
                trainer.save_model(cap.scratch, _internal_call=True)

                if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) \
                        and state.best_global_step:
                    # async: native sets it only if the folder exists on disk; ours may still be in flight
                    best_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
                    if self._exists_or_pending(best_dir, final_dir):
                        state.best_model_checkpoint = best_dir

                if not args.save_only_model:
                    trainer._save_optimizer_and_scheduler(cap.scratch)
                    trainer._save_scaler(cap.scratch)
                    trainer._save_rng_state(cap.scratch)

                if args.should_save:
                    for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control]
                               if isinstance(c, ExportableState)]:
                        cb_name, cb_state = cb.__class__.__name__, cb.state()
                        if isinstance(state.stateful_callbacks[cb_name], list):
                            state.stateful_callbacks[cb_name].append(cb_state)
                        else:
                            state.stateful_callbacks[cb_name] = cb_state
                    state.save_to_json(os.path.join(cap.scratch, TRAINER_STATE_NAME))
            pending = PendingCheckpoint(final_dir, state.global_step, list(cap.handles))
            self._pending.append(pending)
            if final_dir in self._written:
                self._written.remove(final_dir)
            self._written.append(final_dir)
            self._removed.discard(final_dir)
            doomed = self._rotation(run_dir, args.save_total_limit, state.best_model_checkpoint) \
                if args.should_save else []
            tail = (tx, cap.deferred, pending, doomed)
            if cap.deferred:  # async: the optimizer state is copied while the next forward/backward runs
                self._tail_running = True
                self.checkpointer().run_staged(functools.partial(self._run_tail, *tail))
            else:
                self._finish(*tail)

            if args.push_to_hub:  # async: the upload needs the files: wait for this commit first
                self._join_tail()
                self._wait(pending)
                trainer._push_from_checkpoint(output_dir)
        except CheckpointError as e:
            self._raise_failures(cause=e)  # name the folder whose save failed, if it was an earlier one
            raise
        finally:
            stall = time.perf_counter() - started
            self.stalls.append((state.global_step, stall))
            self.timings.append({"step": state.global_step, "stall_s": stall, "waited_s": waited})

    # ------------------------------------------------------------------ bookkeeping
    def _exists_or_pending(self, path: str, current: str) -> bool:
        path = os.path.abspath(path)
        if path == current or (path in self._written and path not in self._removed):
            return True
        return os.path.exists(path) and path not in self._removed

    def _finish(self, tx, deferred: list, pending: PendingCheckpoint, doomed: list[str]) -> None:
        """The deferred snapshots, then the commit, then the rotation's deletions (in the writer's FIFO,
        behind the commit, and only if it succeeded)."""
        for obj, name, format, metadata in deferred:
            pending.handles.append(tx.save_file(obj, name, format=format, metadata=metadata))
        pending.handles.append(tx.commit())
        if doomed:
            self.checkpointer().async_remove(doomed, only_if_complete=pending.final_dir)

    def _run_tail(self, tx, deferred: list, pending: PendingCheckpoint, doomed: list[str]) -> None:
        try:
            self._finish(tx, deferred, pending, doomed)
        except BaseException as e:  # noqa: BLE001 - raised on the training thread at the next save
            self._tail_error = (pending, e)

    def _join_tail(self, timing: bool = False) -> None:
        """Wait for a deferred snapshot (the training thread must not touch the checkpointer meanwhile)."""
        if not self._tail_running:
            return
        started = time.perf_counter()
        self.checkpointer().wait_staged()
        self._tail_running = False
        if timing and self.timings:
            self.timings[-1]["optimizer_step_waited_s"] = time.perf_counter() - started

    def _join_tail_before_step(self) -> None:
        self._join_tail(timing=True)

    def _raise_tail_error(self) -> None:
        self._join_tail()
        if self._tail_error is not None:
            pending, error = self._tail_error
            self._tail_error = None
            if pending in self._pending:
                self._pending.remove(pending)
            self._written = [d for d in self._written if d != pending.final_dir]
            raise CheckpointWriteError(
                f"asyncckpt: the checkpoint {pending.final_dir} (global step {pending.step}) was not saved: its "
                f"optimizer snapshot failed; nothing was published under that name. Cause: {error}") from error

    def _rotation(self, run_dir: str, save_total_limit: Optional[int], best: Optional[str]) -> list[str]:
        """``rotate_checkpoints`` over what will exist once the writer is done: the folders to delete.

        Order: checkpoints found on disk that this run did not write (the Trainer's own order, by
        mtime or else by step), then ours in the order we saved them; so the newest is the one
        just saved, as with native ``use_mtime=True``.
        """
        if save_total_limit is None or save_total_limit <= 0:
            return []
        ours = [d for d in self._written if d not in self._removed and os.path.dirname(d) == os.path.abspath(run_dir)]
        found = [os.path.abspath(p) for p in sort_checkpoints(run_dir, use_mtime=True)]
        checkpoints = [p for p in found if p not in ours and p not in self._removed] + ours
        if len(checkpoints) <= save_total_limit:
            return []
        protected = {checkpoints[-1]}
        if best is not None:
            protected.add(os.path.abspath(best))
        num_to_keep = max(save_total_limit, len(protected))
        remaining, doomed = len(checkpoints), []
        for checkpoint in checkpoints:
            if remaining <= num_to_keep:
                break
            if checkpoint not in protected:
                doomed.append(checkpoint)
                remaining -= 1
        self._removed.update(doomed)  # async: deleted by the writer after the commit (see _finish)
        return doomed

    def _may_defer_optimizer(self, trainer) -> bool:
        """Overlap the optimizer snapshot only if every step passes our step pre-hook: a torch
        optimizer (the Trainer's is Accelerate's wrapper, whose ``step`` calls the wrapped one's)."""
        if not self.overlap_optimizer:
            return False
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        if isinstance(optimizer, torch.optim.Optimizer):
            return True
        if not self._overlap_warned:
            logger.warning("asyncckpt: %s is not a torch.optim.Optimizer, so its steps cannot be made to wait for "
                           "an overlapped snapshot: optimizer.pt is snapshot before each save returns.",
                           type(optimizer).__name__)
            self._overlap_warned = True
        return False

    def _supported(self, trainer) -> bool:
        unsupported = [name for name, on in (
            ("DeepSpeed", trainer.is_deepspeed_enabled),
            ("FSDP", trainer.is_fsdp_enabled or getattr(trainer, "is_fsdp_xla_enabled", False)),
            ("XLA", is_torch_xla_available()),
            ("SageMaker MP", is_sagemaker_mp_enabled()),
        ) if on]
        if unsupported and not self._fallback_warned:
            logger.warning("asyncckpt: %s checkpoints are saved synchronously by the Trainer itself "
                           "(asynchronous saving covers single-process and DDP training).", unsupported[0])
            self._fallback_warned = True
        return not unsupported

    # ------------------------------------------------------------------ waiting and errors
    def checkpointer(self) -> Checkpointer:
        if self._checkpointer is None or self._checkpointer._closed:
            # Files of one checkpoint must not wait for each other: back-pressure is per checkpoint
            # (max_pending, below), so the core's per-file limit is set out of the way.
            self._checkpointer = Checkpointer(max_in_flight=1 << 20, timeout=self.timeout, direct_io=self.direct_io)
            self._own_checkpointer = True
        return self._checkpointer

    def begin_training(self, run_dir: str, remove_stale: bool) -> None:
        """At ``on_train_begin``: nothing of ours is pending (the last ``train()`` drained), so the
        disk is the truth again; start the background writer now rather than at the first save."""
        self.drain()
        self._written, self._removed = [], set()
        if remove_stale:
            self.remove_stale_staging(run_dir)  # no save of this run has started yet
        self.checkpointer().async_remove([])  # an empty request: spawns the writer, its start-up overlaps training

    def _apply_back_pressure(self) -> None:
        while self._pending and sum(not p.done() for p in self._pending) >= self.max_pending:
            self._wait(next(p for p in self._pending if not p.done()))
        self._raise_failures()

    def _wait(self, pending: PendingCheckpoint) -> None:
        try:
            pending.commit.result()
        except BaseException:  # noqa: BLE001 - raised with the folder's name just below
            pass
        self._raise_failures()

    def _raise_failures(self, cause: Optional[BaseException] = None) -> None:
        """Forget committed checkpoints; raise for the first that failed, naming its folder."""
        while self._pending and self._pending[0].done():
            pending = self._pending.popleft()
            error = pending.failure()
            if error is not None:
                self._written = [d for d in self._written if d != pending.final_dir]
                raise CheckpointWriteError(
                    f"asyncckpt: the checkpoint {pending.final_dir} (global step {pending.step}) was not saved; "
                    f"nothing was published under that name and older checkpoints were kept. Cause: {error}"
                ) from (cause or error)

    def drain(self) -> None:
        """Wait until every checkpoint (and deletion) handed to the writer is done; raise failures."""
        self._raise_tail_error()
        while self._pending:
            self._wait(self._pending[0])
        if self._checkpointer is not None and not self._checkpointer._closed:
            self._checkpointer.wait()

    def close(self) -> None:
        """Drain, then (if we created it) stop the writer process and free the staging buffers."""
        try:
            self.drain()
        finally:
            self._join_tail()
            if self._step_hook is not None:
                self._step_hook.remove()
                self._step_hook = None
            if self._own_checkpointer and self._checkpointer is not None:
                self._checkpointer.close()
                self._checkpointer = None

    def remove_stale_staging(self, run_dir: str) -> None:
        """Hidden staging folders left by a killed run (never visible to the Trainer; they hold disk)."""
        try:
            names = os.listdir(run_dir)
        except FileNotFoundError:
            return
        for name in names:
            if _STALE_STAGING_RE.match(name):
                shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)

