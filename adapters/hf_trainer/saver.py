"""The asynchronous ``Trainer._save_checkpoint``: same files, same bookkeeping, written in the background.

More: docs/MODULES.md, adapters/hf_trainer/saver.py.
"""
from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import sys
import time
import warnings
from typing import Any, Callable, Optional

import safetensors.torch
import transformers.modeling_utils as modeling_utils
from transformers.integrations import INTEGRATION_TO_CALLBACK
from transformers.trainer import OPTIMIZER_NAME, TRAINER_STATE_NAME, Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, sort_checkpoints
from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available
from transformers.utils import logging as transformers_logging

from asyncckpt.core import Checkpointer
from asyncckpt.core.integration import SaveMetrics, capture, collectives, patching, resume, saving

_trainer_logger = transformers_logging.get_logger("transformers.trainer")  # where the Trainer logs its own failures
_INTEGRATIONS = tuple(INTEGRATION_TO_CALLBACK.values())  # the report_to callbacks: TensorBoard, W&B, MLflow, ...
_CHECKPOINT_STEP = resume.numbered(re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$"), directories=True)
# Transformers' JIT checkpoint (``enable_jit_checkpoint``) makes ``checkpoint-N`` with this file in it before it saves,
# and removes the file once the save returned (``trainer_jit_checkpoint``).
_JIT_SENTINEL = "checkpoint-is-incomplete.txt"


def checkpoints_on_disk(run_dir: str) -> list[str]:
    """``sort_checkpoints(run_dir, use_mtime=True)``, as the Trainer's rotation orders them. The writer removes the
    checkpoints a rotation dropped while training goes on: one listed by ``sort_checkpoints`` can be gone before it
    reads that one's mtime (``FileNotFoundError``); then it lists again, without it."""
    for _ in range(8):
        with contextlib.suppress(FileNotFoundError):
            return sort_checkpoints(run_dir, use_mtime=True)
    return sort_checkpoints(run_dir, use_mtime=True)


class AsyncCheckpointSaver:
    """Installed on one Trainer for its ``train()`` calls: replaces ``_save_checkpoint`` and
    ``_finalize_training`` on that instance (not its class; a subclass's override of ``_save_checkpoint``
    still runs, around the asynchronous save)."""

    def __init__(self, trainer: Any, checkpointer: Checkpointer, *, on_save_after_commit: bool = False) -> None:
        self.trainer, self.checkpointer = trainer, checkpointer
        self.on_save_after_commit = on_save_after_commit
        self.last_checkpoint: Optional[Any] = None  # the handle of the checkpoint the latest save began
        self.metrics = SaveMetrics(checkpointer)
        patching.install(trainer, "train", self._resuming)  # for the trainer's lifetime: every train() may resume
        self._undo: list[Callable[[], None]] = []  # what install() did, undone by uninstall()
        self._synchronous_subclass = False  # its _save_checkpoint reads the checkpoint back (warned once)
        self._warned_existing = False  # a subclass's save into an existing checkpoint-N was synchronous

    def install(self) -> None:
        """Idempotent: the callback installs at the Trainer's construction and again at each train()."""
        if self._undo:
            return
        self._undo = [patching.install(self.trainer, "_save_checkpoint", lambda original: self.save_checkpoint).restore,
                      patching.install(self.trainer, "_finalize_training", self._finalize).restore]
        if self.checkpointer.options.overlap_optimizer:  # an optimizer step first waits for an overlapped snapshot
            self._undo.append(self.checkpointer.snapshot_thread.guard_every_optimizer().remove)
        if self.on_save_after_commit:
            self._undo.append(patching.install(self.trainer.callback_handler, "on_save", self._on_save_after_commit).restore)

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    # ------------------------------------------------------------------ the save
    def save_checkpoint(self, model: Any, trial: Any) -> None:
        if not self._supported(self.trainer) or self._synchronous_subclass:
            return self._save_synchronously(model, trial, None)
        started = time.perf_counter()
        self.last_checkpoint = None
        if patching.overridden(self.trainer, Trainer, "_save_checkpoint"):
            self._save_with_subclass(model, trial)
        else:
            self._save(trial)
        self.metrics.saved(self.last_checkpoint, time.perf_counter() - started)
        self._log_metrics()

    def _log_metrics(self, *, final: bool = False) -> None:
        """The records of committed saves, to the Trainer's ``report_to`` integrations (TensorBoard, W&B, MLflow, ...):
        their ``on_log``, called as ``Trainer.log`` calls it. Not through ``Trainer.log`` itself: that would add them
        to ``state.log_history``, which every ``trainer_state.json`` keeps and a resumed run must reproduce, with
        values that differ from run to run, and to what the other callbacks (printers, the user's) see."""
        records = self.metrics.ready(final=final)
        handler = self.trainer.callback_handler
        integrations = [callback for callback in handler.callbacks if isinstance(callback, _INTEGRATIONS)]
        if not (records and integrations):
            return
        reporting = copy.copy(handler)
        reporting.callbacks = integrations
        for record in records:
            reporting.on_log(self.trainer.args, self.trainer.state, copy.copy(self.trainer.control),
                             {f"checkpoint_{name}": value for name, value in record.items() if value is not None})

    def _save(self, trial: Any) -> None:
        run_dir = self.trainer._get_output_dir(trial=trial)
        with self._begin(run_dir) as tx:
            files = self._save_trainer_files(tx, trial)
        self._complete(tx, files, run_dir)

    def _save_with_subclass(self, model: Any, trial: Any) -> None:
        """The subclass's own ``_save_checkpoint`` runs; its call of ``Trainer._save_checkpoint`` writes the
        Trainer's files into the transaction (``patching.standing_in``), and what it writes into
        ``checkpoint-N`` itself, before or after that call, goes into the same transaction: data files through
        the capture, other files from the folder, which it had to create (removed again before the commit
        publishes the whole checkpoint under that name)."""
        trainer, args = self.trainer, self.trainer.args
        run_dir = trainer._get_output_dir(trial=trial)
        final_dir = self._checkpoint_dir(run_dir)
        with contextlib.suppress(FileNotFoundError):  # what it stands for, the commit does: the checkpoint is whole
            os.remove(os.path.join(final_dir, _JIT_SENTINEL))
        begun = os.path.lexists(final_dir) and not (os.path.isdir(final_dir) and not os.listdir(final_dir))
        if _on_any_rank(begun):  # the override may write into it, and must find it as it is
            warned, self._warned_existing = self._warned_existing, True
            return self._save_synchronously(model, trial, None if warned else (
                f"{os.path.basename(final_dir)} exists already and it may write into it; in a fresh output_dir its "
                "saves are asynchronous"))
        callbacks_state = copy.deepcopy(trainer.state.stateful_callbacks)  # the parent's bookkeeping, undone below
        files: list[capture.FileCapture] = []  # the Trainer's own, once the override calls its parent
        calls: list = []
        needs_disk: Optional[OSError] = None
        try:
            with self._begin(run_dir) as tx, capture.capturing(tx, root=final_dir, collect=args.should_save,
                                                               safetensors_savers=_safetensors_savers()) as own_files:
                def parent(_model: Any, parent_trial: Any) -> None:
                    own_files.hand_over()  # what it wrote there so far comes before the Trainer's files
                    files.append(self._save_trainer_files(tx, parent_trial))

                with patching.standing_in(Trainer, "_save_checkpoint", trainer, parent) as calls:
                    type(trainer)._save_checkpoint(trainer, model, trial)
        except FileNotFoundError as error:  # the with aborted the transaction
            if not (calls and own_files.about(error)):
                raise
            needs_disk = error
        finally:
            if args.should_save and os.path.isdir(final_dir):
                shutil.rmtree(final_dir)
        if _on_any_rank(needs_disk is not None):  # from now on, on every process: its own save, synchronous
            if needs_disk is None:
                tx.abort(RuntimeError("another process's save needs the checkpoint on disk"))
            trainer.state.stateful_callbacks = callbacks_state
            self._synchronous_subclass = True
            return self._save_synchronously(model, trial, "it reads the checkpoint when super()._save_checkpoint "
                                            f"returns, before asyncckpt has written it: {needs_disk}")
        if calls:
            self._complete(tx, files[0], run_dir)
        elif _on_any_rank(bool(own_files.written)):  # it saved by itself, not through the Trainer: what it wrote
            saving.finish(self.checkpointer, tx)
        else:
            tx.abort(RuntimeError(f"{type(trainer).__name__}._save_checkpoint saved nothing"))

    def _save_synchronously(self, model: Any, trial: Any, why: Optional[str]) -> None:
        """The subclass's save as it is, after every pending one; with ``why``, a warning saying so."""
        if why:
            warnings.warn(f"asyncckpt: {type(self.trainer).__name__}._save_checkpoint runs as it is, synchronously "
                          f"({why})", RuntimeWarning, stacklevel=2)
        self.checkpointer.wait()
        type(self.trainer)._save_checkpoint(self.trainer, model, trial)

    def _checkpoint_dir(self, run_dir: str) -> str:
        return os.path.abspath(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.trainer.state.global_step}"))

    def _begin(self, run_dir: str) -> Any:
        step = self.trainer.state.global_step
        best = self.trainer.args.load_best_model_at_end and self.trainer.state.best_global_step == step
        tx = self.checkpointer.begin_directory(self._checkpoint_dir(run_dir), step=step, label=f"global step {step}",
                                               durable=True if best else None)  # the end of training loads it
        self.last_checkpoint = tx.handle
        return tx

    def _save_trainer_files(self, tx: Any, trial: Any) -> capture.FileCapture:
        """``Trainer._save_checkpoint`` up to its push and rotation, every file into ``tx``; returns the capture
        (holding the snapshots left for the snapshot thread)."""
        trainer = self.trainer
        args, state = trainer.args, trainer.state
        if trainer.hp_search_backend is None and trial is None:
            trainer.store_flos()
        run_dir = trainer._get_output_dir(trial=trial)
        defer = (lambda name: name == OPTIMIZER_NAME) if saving.overlaps_optimizer(self.checkpointer,
                                                                                   [trainer.optimizer]) else None
        with capture.capturing(tx, defer=defer, safetensors_savers=_safetensors_savers()) as cap:
            trainer.save_model(cap.root, _internal_call=True)  # async: the Trainer's own save code, files snapshot
            if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) \
                    and state.best_global_step:
                best_dir = os.path.abspath(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}"))
                if best_dir == tx.final_dir or self.checkpointer.will_exist(best_dir):  # async: in flight counts as existing
                    state.best_model_checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.best_global_step}")
            if not args.save_only_model:
                trainer._save_optimizer_and_scheduler(cap.root)
                trainer._save_scaler(cap.root)
                trainer._save_rng_state(cap.root)
            if args.should_save:
                for cb in [c for c in trainer.callback_handler.callbacks + [trainer.control]
                           if isinstance(c, ExportableState)]:
                    cb_name, cb_state = cb.__class__.__name__, cb.state()
                    if isinstance(state.stateful_callbacks[cb_name], list):
                        state.stateful_callbacks[cb_name].append(cb_state)
                    else:
                        state.stateful_callbacks[cb_name] = cb_state
                state.save_to_json(os.path.join(cap.root, TRAINER_STATE_NAME))
        return cap

    def _complete(self, tx: Any, files: capture.FileCapture, run_dir: str) -> None:
        """The rest of ``Trainer._save_checkpoint``: the commit (and the deferred snapshots before it, while the
        next forward/backward runs), rotation behind it, the push after it."""
        args, state = self.trainer.args, self.trainer.state
        best = state.best_model_checkpoint
        doomed = saving.rotation(self.checkpointer, run_dir, lambda: checkpoints_on_disk(run_dir),
                                 keep=args.save_total_limit, protected={tx.final_dir, os.path.abspath(best or tx.final_dir)}
                                 ) if args.should_save else []
        saving.finish(self.checkpointer, tx, stage_later=files.stage_deferred if files.deferred else None, removals=doomed)
        if args.push_to_hub:  # async: the upload needs the files: it runs once this checkpoint committed, in order
            self.checkpointer.after_commit(tx.handle, self._push)

    def _push(self, checkpoint_folder: str) -> None:
        """The Trainer's push of a committed checkpoint. A failure (the network, the token, the repository) is logged
        by the Trainer's logger and training goes on, as when the Trainer's own upload (a future) fails: the
        checkpoint is committed, only its upload is lost; the next save's push uploads the newest again."""
        try:
            self.trainer._push_from_checkpoint(checkpoint_folder)
        except Exception as error:  # noqa: BLE001 - an upload never stops training
            _trainer_logger.error("asyncckpt: uploading %s to the Hub failed (training goes on; the checkpoint is "
                                  "saved locally): %s: %s", checkpoint_folder, type(error).__name__, error)

    def _on_save_after_commit(self, original: Callable) -> Callable:
        """The callbacks' ``on_save`` for a checkpoint saved asynchronously runs once it committed (on the
        commit-hooks thread, with the Trainer's state as it was at the save), so that they find ``checkpoint-N``
        complete; what they return to the Trainer's control is not applied (the Trainer moved on)."""
        def on_save(args: Any, state: Any, control: Any) -> Any:
            checkpoint = self.last_checkpoint
            if checkpoint is None:  # saved synchronously: on disk already
                return original(args, state, control)
            state_then = copy.deepcopy(state)
            self.checkpointer.after_commit(checkpoint, lambda _path: original(args, state_then, copy.copy(control)))
            return control

        return on_save

    # ------------------------------------------------------------------ the end of training
    def _resuming(self, original: Callable) -> Callable:
        """``train(resume_from_checkpoint=...)`` resumes through ``resume.resume``: saves in flight committed
        first, the checkpoint checked as it is read; with ``True``, the newest ``checkpoint-N`` (with
        ``resume_from_intact``, the newest that checks out; with ``mirror_to`` and none here, the newest mirrored)."""
        def train(resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
            def load(path: Optional[str]) -> Any:
                return original(path if path is not None else resume_from_checkpoint, *args, **kwargs)

            if resume_from_checkpoint is True:
                return resume.resume(self.checkpointer, load, reads="files", root=self.trainer.args.output_dir,
                                     key=_CHECKPOINT_STEP)
            if resume_from_checkpoint and os.path.exists(resume_from_checkpoint):  # else the Trainer's own error
                return resume.resume(self.checkpointer, load, reads="files", path=os.fspath(resume_from_checkpoint))
            return load(None)

        return train

    def _finalize(self, original: Callable) -> Callable:
        """Every save committed (and its metrics logged) before the best model is loaded back (checked, with
        ``verify``, and read as a resume reads: once per job, ``resume.verify``); the Trainer's own deletions of checkpoint folders there (``save_total_limit=1``)
        are atomic."""
        def finalize_training(*args: Any, **kwargs: Any) -> Any:
            self.checkpointer.wait()
            self._log_metrics(final=True)
            best = self.trainer.state.best_model_checkpoint
            checked = resume.verify(self.checkpointer, best) if self.checkpointer.options.verify and \
                self.trainer.args.load_best_model_at_end and best else None  # its files read once per job
            run_dir = os.path.abspath(self.trainer.args.output_dir)
            rmtree = saving.atomic_rmtree(self.checkpointer, shutil.rmtree, lambda path: os.path.dirname(path) == run_dir
                                          and _CHECKPOINT_STEP(path) is not None)
            with patching.patched(shutil, "rmtree", rmtree), checked.serving() if checked else contextlib.nullcontext():
                return original(*args, **kwargs)

        return finalize_training

    # ------------------------------------------------------------------ what is supported
    def _supported(self, trainer: Any) -> bool:
        unsupported = [name for name, on in (("DeepSpeed", trainer.is_deepspeed_enabled), ("XLA", is_torch_xla_available()),
                                             ("XLA FSDP", getattr(trainer, "is_fsdp_xla_enabled", False)),
                                             ("SageMaker MP", is_sagemaker_mp_enabled())) if on]
        if unsupported:
            warnings.warn(f"asyncckpt: {unsupported[0]} checkpoints are saved synchronously by the Trainer itself "
                          "(asynchronous saving covers single-process, DDP and FSDP training).", RuntimeWarning, stacklevel=2)
        return not unsupported


def _safetensors_savers() -> list[tuple[Any, str]]:
    """The names the Trainer's safetensors files are written through: (module, attribute); PEFT's once loaded."""
    savers = [(safetensors.torch, "save_file"), (modeling_utils, "safe_save_file")]
    peft_model = sys.modules.get("peft.peft_model")
    if peft_model is not None:
        savers.append((peft_model, "safe_save_file"))
    return savers


def _on_any_rank(flag: bool) -> bool:
    """``flag`` on this process or any other of the job (a collective: every process asks, at the same point)."""
    return collectives.any_rank(flag) or flag
