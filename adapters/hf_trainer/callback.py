"""``AsyncCheckpointCallback``: the one line a Transformers user adds.

More: docs/MODULES.md, adapters/hf_trainer/callback.py.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import transformers.models.auto.modeling_auto  # noqa: F401  (defines the auto model classes)
from transformers import (AutoConfig, AutoProcessor, AutoTokenizer, PreTrainedConfig, PreTrainedModel, Trainer,
                          TrainerCallback)
from transformers.models.auto.auto_factory import _BaseAutoModelClass
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from asyncckpt.core import Checkpointer, CheckpointOptions
from asyncckpt.core.integration import (Records, dist_env, lifecycle, patching, resolve_options, taking_options,
                                        versions)

from .saver import AsyncCheckpointSaver
from .support import FROM_PRETRAINED, SUPPORT


class AsyncCheckpointCallback(TrainerCallback):
    """Write every checkpoint the Trainer saves asynchronously, in the Trainer's own layout.

    Takes every option of ``asyncckpt.core.CheckpointOptions`` (the same names, defaults and meanings as the
    core's and the other adapters': docs/options.md) as keyword arguments, or the object as ``options``; with
    ``verify`` (default), ``train(resume_from_checkpoint=...)`` and ``load_best_model_at_end`` check the
    checkpoint before anything is loaded from it (the callback must be given to the Trainer's constructor for
    this); ``export`` writes the model with its ``config.json`` and ``generation_config.json`` (a PEFT model's:
    its adapter), by default to ``output_dir/exports/checkpoint-N``; ``log_metrics`` reports each save's cost to
    the ``report_to`` integrations (not into ``state.log_history``). ``wait()``, ``pending()``, ``metrics`` and
    ``close()`` are the words every adapter shares. And these of its own:

    Args:
        checkpointer: an ``asyncckpt.core.Checkpointer`` to use, with its own options (you close it): a Trainer
            may share one with other code; by default the callback makes its own, whose writer runs only while
            the Trainer trains.
        on_save_after_commit: the other callbacks' ``on_save`` run once the checkpoint committed (so they find
            ``checkpoint-N`` complete), on a thread of its own while training goes on; what they raise fails
            like a save. What they set on ``control`` there is not applied. With ``push_to_hub=True`` each
            checkpoint is uploaded after its commit in the same way, whatever this option says. (The Trainer
            alone calls other callbacks after a save.)
    """

    @taking_options
    def __init__(self, options: Optional[CheckpointOptions] = None, *, checkpointer: Optional[Checkpointer] = None,
                 on_save_after_commit: bool = False, **kwargs: Any) -> None:
        release = versions.require(SUPPORT)
        if checkpointer is not None and (options is not None or kwargs):
            raise TypeError(f"{type(self).__name__}(checkpointer=...) takes its options from that Checkpointer: "
                            f"give it {', '.join(kwargs) or 'options'} instead")
        options, _ = resolve_options(type(self).__name__, options, kwargs)
        if release.allows(FROM_PRETRAINED):  # from_pretrained of a checkpoint-N being written waits for it
            patching.install_on_subclasses(
                (PreTrainedModel, PreTrainedConfig, PreTrainedTokenizerBase, _BaseAutoModelClass, AutoConfig,
                 AutoTokenizer, AutoProcessor), "from_pretrained", functools.partial(lifecycle.waiting_reader, path_at=1))
        self.owns_checkpointer = checkpointer is None
        self.on_save_after_commit = on_save_after_commit
        self.checkpointer = checkpointer or Checkpointer(options)
        self.saver: Optional[AsyncCheckpointSaver] = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "saver": None}  # the Checkpointer pickles as its options

    @property
    def options(self) -> CheckpointOptions:
        return self.checkpointer.options

    @property
    def metrics(self) -> list[dict]:
        """Per save: ``step``, ``stall_s`` (seconds the training loop spent in it), ``waited_s`` (of it, for an earlier
        checkpoint), ``durable_s`` (from its return to committed on every rank), ``bytes`` and ``snapshot_wait_s`` (how
        long the next optimizer steps waited for the overlapped ``optimizer.pt`` snapshot), as reported."""
        return self.saver.metrics.history if self.saver is not None else Records()

    def wait(self) -> None:
        """Block until every checkpoint saved so far is committed (and rotated); raise the first failure."""
        self.checkpointer.wait()

    def pending(self) -> list[str]:
        """Paths with a save, removal or upload not done yet, oldest first."""
        return [handle.path for handle in self.checkpointer.pending()]

    def close(self) -> None:
        """After the last ``train()``: wait for every save, stop the writer and free the snapshot buffers (pinned host
        memory, up to ``max_in_flight`` copies of the checkpoint, which the end of ``train()`` keeps for the next one;
        a later save allocates them again). A ``checkpointer`` you gave is yours to close: it is only waited for."""
        if self.owns_checkpointer:
            self.checkpointer.teardown(free_buffers=True)
        else:
            self.checkpointer.wait()

    # ------------------------------------------------------------------ Trainer events
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._attach()
        if self.saver is not None:
            self.saver.install()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._attach()  # added with trainer.add_callback(...) after __init__: attach now
        dist_env.warn_if_launched_as_many(args.world_size, "the Trainer", "Without GPUs, give the training script "
                                          "--use_cpu (TrainingArguments(use_cpu=True)) so that they train together.")
        if self.saver is not None:
            self.saver.install()
            if args.save_strategy != "no":
                self.checkpointer.start(at_first_step=True)  # its start-up overlaps the first steps

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.saver is None:
            return
        self.saver.uninstall()
        if self.owns_checkpointer:
            self.checkpointer.teardown()  # every checkpoint committed; no thread or process of ours left
        else:
            self.checkpointer.wait()

    def _attach(self) -> None:
        """To the Trainer (any subclass) whose callback handler is calling us right now."""
        trainer = patching.caller(Trainer, lambda candidate: self in candidate.callback_handler.callbacks)
        if trainer is not None and (self.saver is None or self.saver.trainer is not trainer):
            self.saver = AsyncCheckpointSaver(trainer, self.checkpointer, on_save_after_commit=self.on_save_after_commit)

