"""``AsyncCheckpointCallback``: the one line a Transformers user adds.

    trainer = Trainer(..., callbacks=[AsyncCheckpointCallback()])   # or trainer.add_callback(...) before train()

A callback is handed the model, optimizer and scheduler, but not the Trainer, and it cannot take
over a save: clearing ``control.should_save`` in ``on_step_end`` misses ``save_strategy="best"``
(decided after the evaluation) and would snapshot before that step's evaluation is recorded. So
the callback finds its Trainer (the caller of ``on_init_end``, or of ``on_train_begin`` when added
later) and, until its ``train()`` ends, replaces that instance's ``_save_checkpoint`` with the
asynchronous one in ``saver.py`` (a subclass's own ``_save_checkpoint``, such as TRL's, still runs, with
the asynchronous save as its parent's: ``subclass.py``); the Trainer still decides when to save, evaluates
first, and resumes exactly as usual. When training ends, every checkpoint is committed and the background
writer stops; the next ``train()`` starts it again.

The callback is deliberately not an ``ExportableState``: the Trainer re-creates those from the
checkpoint on resume. It pickles (with its options; a copy attaches to the Trainer it is used with).
"""
from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Optional

import transformers.models.auto.modeling_auto  # noqa: F401  (defines the auto model classes: _auto_model_classes)
from transformers import (AutoConfig, AutoProcessor, AutoTokenizer, PreTrainedConfig, PreTrainedModel, Trainer,
                          TrainerCallback)
from transformers.models.auto.auto_factory import _BaseAutoModelClass
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from asyncckpt.core import Checkpointer, ExportOptions
from asyncckpt.core.integration import dist_env
from asyncckpt.core.integration import lifecycle
from asyncckpt.core.integration import patching
from asyncckpt.core.integration import versions

from .saver import AsyncCheckpointSaver
from .support import SUPPORT


class AsyncCheckpointCallback(TrainerCallback):
    """Write every checkpoint the Trainer saves asynchronously, in the Trainer's own layout.

    Args:
        max_in_flight: checkpoints that may be uncommitted at once; a save beyond it first waits for
            the oldest. Memory: the staging buffers hold one copy of a checkpoint's data per pending
            checkpoint (kept across saves and across ``train()`` calls).
        timeout: seconds any wait on the background writer or on another rank may take.
        direct_io: write with O_DIRECT where the filesystem supports it.
        checkpointer: an ``asyncckpt.core.Checkpointer`` to use (you close it); by default the
            callback makes its own, whose writer runs only while the Trainer trains.
        overlap_optimizer: (default on) snapshot ``optimizer.pt`` (two thirds of an Adam checkpoint) in
            a background thread while the next step's forward and backward run; the next
            ``optimizer.step()`` waits for it. Safe because a torch optimizer's state tensors change
            only in ``step()``; the weights, RNG and everything else are snapshot before the save
            returns. Turn it off if your code changes the optimizer's state tensors in place between a
            save and the next step; with an optimizer that is not a ``torch.optim.Optimizer`` it is off.
        verify_on_resume: ``train(resume_from_checkpoint=...)`` and ``load_best_model_at_end`` check the
            checkpoint against its checksums before loading anything (``asyncckpt.core.verify.integrity``); a
            damaged one raises ``CorruptCheckpointError`` naming the file. Checkpoints written without
            asyncckpt load unchecked. (The callback must be given to the Trainer's constructor for this.)
        resume_from_intact: with ``resume_from_checkpoint=True``, a damaged newest checkpoint gives way
            to the newest that checks out, with a warning naming the one skipped.
        mirror_to: an object-store URL (``s3://bucket/run``): each committed ``checkpoint-N`` is copied there in
            the background (``Checkpointer.mirror``), and ``train(resume_from_checkpoint=True)`` with no local
            checkpoint restores the newest from there first (docs/object_store.md).
        export: ``"safetensors"`` or an ``asyncckpt.core.ExportOptions``: after each ``checkpoint-N`` commits, the
            main process's background writer writes the model as Hugging Face safetensors with its
            ``config.json`` and ``generation_config.json`` (``AutoModel*.from_pretrained`` loads it), by default to
            ``output_dir/exports/checkpoint-N``; a PEFT model's export is its adapter (``adapter_config.json`` and
            ``adapter_model.safetensors``, for ``PeftModel.from_pretrained``). Ignored with a ``checkpointer`` of
            your own: give it ``Checkpointer(export=...)``.
        on_save_after_commit: the other callbacks' ``on_save`` run once the checkpoint committed (so they find
            ``checkpoint-N`` complete), on a thread of their own while training goes on; what they raise fails
            like a save. What they set on ``control`` there is not applied. With ``push_to_hub=True`` each
            checkpoint is uploaded after its commit in the same way, whatever this option says.
    """

    def __init__(self, max_in_flight: int = 1, timeout: float = 600.0, direct_io: bool = True,
                 checkpointer: Optional[Checkpointer] = None, overlap_optimizer: bool = True,
                 verify_on_resume: bool = True, resume_from_intact: bool = False, mirror_to: Optional[str] = None,
                 max_pending: Optional[int] = None, export: Optional[ExportOptions | str] = None,
                 on_save_after_commit: bool = False) -> None:
        versions.require(SUPPORT)
        if max_pending is not None:  # its name until 0.1 (every other adapter and the core say max_in_flight)
            warnings.warn("AsyncCheckpointCallback(max_pending=...) is deprecated and will be removed in the next "
                          "release: use max_in_flight=...", FutureWarning, stacklevel=2)
            max_in_flight = max_pending
        for reader in (PreTrainedModel, PreTrainedConfig, PreTrainedTokenizerBase, *_auto_model_classes(), AutoConfig,
                       AutoTokenizer, AutoProcessor):  # from_pretrained of a checkpoint-N being written waits for it
            patching.install(reader, "from_pretrained", functools.partial(lifecycle.waiting_reader, path_at=1))
        self.max_in_flight, self.timeout, self.direct_io = max_in_flight, timeout, direct_io
        self.overlap_optimizer = overlap_optimizer
        self.verify_on_resume, self.resume_from_intact, self.mirror_to = verify_on_resume, resume_from_intact, mirror_to
        self.owns_checkpointer = checkpointer is None
        self.on_save_after_commit = on_save_after_commit
        self.checkpointer = checkpointer or Checkpointer(max_in_flight=max_in_flight, timeout=timeout, direct_io=direct_io,
                                                         export=export)
        self.saver: Optional[AsyncCheckpointSaver] = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "saver": None}  # the Checkpointer pickles as its options

    @property
    def timings(self) -> list[dict]:
        """Per save: ``step``, ``stall_s`` (seconds the training loop spent in it), ``waited_s`` (of
        it, for an earlier checkpoint's commit: ``max_in_flight``) and ``optimizer_step_waited_s`` (how
        long the next optimizer step waited for the overlapped ``optimizer.pt`` snapshot)."""
        return self.saver.timings if self.saver is not None else []

    # ------------------------------------------------------------------ Trainer events
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._attach(_calling_trainer(self))
        if self.saver is not None:
            self.saver.install()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._attach(_calling_trainer(self))  # added with trainer.add_callback(...) after __init__: attach now
        dist_env.warn_if_launched_as_many(args.world_size, "the Trainer", "Without GPUs, give the training script "
                                          "--use_cpu (TrainingArguments(use_cpu=True)) so that they train together.")
        if self.saver is not None:
            self.saver.install()
            if args.save_strategy != "no":
                self.checkpointer.start()  # its start-up overlaps the first steps

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.saver is None:
            return
        self.saver.uninstall()
        if self.owns_checkpointer:
            self.checkpointer.teardown()  # every checkpoint committed; no thread or process of ours left
        else:
            self.checkpointer.wait()

    def _attach(self, trainer: Optional[Trainer]) -> None:
        if trainer is not None and (self.saver is None or self.saver.trainer is not trainer):
            self.saver = AsyncCheckpointSaver(trainer, self.checkpointer, overlap_optimizer=self.overlap_optimizer,
                                              verify_on_resume=self.verify_on_resume, resume_from_intact=self.resume_from_intact,
                                              mirror_to=self.mirror_to, on_save_after_commit=self.on_save_after_commit)


def _auto_model_classes() -> list[type]:
    """``_BaseAutoModelClass`` and the auto classes (``AutoModelForCausalLM``, ...) with a ``from_pretrained`` of their
    own: transformers gives each a copy of the base's when it defines it, so a patch of the base's alone does not
    reach them. (With PEFT installed, theirs looks for an adapter config before the model's own reader waits.)"""
    classes, found = [_BaseAutoModelClass], []
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        if "from_pretrained" in vars(cls):
            found.append(cls)
    return found


def _calling_trainer(callback: TrainerCallback) -> Optional[Trainer]:
    """The Trainer (any subclass) whose callback handler is calling ``callback`` right now."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer) and callback in candidate.callback_handler.callbacks:
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame
