"""``AsyncCheckpointCallback``: the one line a Transformers user adds.

    trainer = Trainer(..., callbacks=[AsyncCheckpointCallback()])   # or trainer.add_callback(...) before train()

A callback is handed the model, optimizer and scheduler, but not the Trainer, and it cannot take
over a save: clearing ``control.should_save`` in ``on_step_end`` misses ``save_strategy="best"``
(decided after the evaluation) and would snapshot before that step's evaluation is recorded. So
the callback finds its Trainer (the caller of ``on_init_end``, or of ``on_train_begin`` when added
later) and shadows that instance's ``_save_checkpoint`` with the asynchronous one in ``saver.py``;
the Trainer still decides when to save, evaluates first, and resumes exactly as usual.

The callback is deliberately not an ``ExportableState``: the Trainer re-creates those from the
checkpoint on resume.
"""
from __future__ import annotations

import inspect
from typing import Optional

from transformers import Trainer, TrainerCallback

from asyncckpt.core import Checkpointer

from .saver import AsyncCheckpointSaver


class AsyncCheckpointCallback(TrainerCallback):
    """Write every checkpoint the Trainer saves asynchronously, in the Trainer's own layout.

    Args:
        max_pending: checkpoints that may be uncommitted at once; a save beyond it first waits for
            the oldest. Memory: the staging buffers hold one copy of a checkpoint's data per pending
            checkpoint (kept across saves).
        timeout: seconds any wait on the background writer or on another rank may take.
        direct_io: write with O_DIRECT where the filesystem supports it.
        checkpointer: an ``asyncckpt.core.Checkpointer`` to use (you close it); by default the
            callback creates one when training starts and closes it when training ends.
        overlap_optimizer: (default on) snapshot ``optimizer.pt`` (two thirds of an Adam checkpoint) in
            a background thread while the next step's forward and backward run; the next
            ``optimizer.step()`` waits for it. Safe because a torch optimizer's state tensors change
            only in ``step()`` (the parameter groups are captured at the save), and the weights, RNG
            and everything else are still snapshot before the save returns. Turn it off if your code
            changes the optimizer's state tensors in place between a save and the next step; with
            an optimizer that is not a ``torch.optim.Optimizer`` (no step hooks) it is off.
    """

    def __init__(self, max_pending: int = 1, timeout: float = 600.0, direct_io: bool = True,
                 checkpointer: Optional[Checkpointer] = None, overlap_optimizer: bool = True) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self.max_pending = max_pending
        self.overlap_optimizer = overlap_optimizer
        self.timeout = timeout
        self.direct_io = direct_io
        self.checkpointer = checkpointer
        self.saver: Optional[AsyncCheckpointSaver] = None

    @property
    def stalls(self) -> list[tuple[int, float]]:
        """(global step, seconds the training loop spent in each checkpoint save)."""
        return self.saver.stalls if self.saver is not None else []

    @property
    def timings(self) -> list[dict]:
        """Per save: ``step``, ``stall_s`` and ``waited_s`` (the part spent waiting for an earlier
        checkpoint's commit because ``max_pending`` were in flight)."""
        return self.saver.timings if self.saver is not None else []

    # ------------------------------------------------------------------ Trainer events
    def on_init_end(self, args, state, control, **kwargs):
        self._attach(_calling_trainer(self))

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = _calling_trainer(self)
        self._attach(trainer)  # added with trainer.add_callback(...) after __init__: attach now
        if self.saver is not None and args.save_strategy != "no":
            self.saver.begin_training(args.output_dir, remove_stale=args.should_save)

    def on_train_end(self, args, state, control, **kwargs):
        if self.saver is not None:
            self.saver.close()  # drain (the Trainer already waited in _finalize_training), free buffers

    # ------------------------------------------------------------------ wiring
    def _attach(self, trainer: Optional[Trainer]) -> None:
        if trainer is None:
            return
        existing = AsyncCheckpointSaver.installed_on(trainer)
        if existing is not None:  # already ours (e.g. on_init_end, then on_train_begin)
            if self.saver is None:
                self.saver = existing
            return
        self.saver = AsyncCheckpointSaver(trainer, max_pending=self.max_pending, timeout=self.timeout,
                                          direct_io=self.direct_io, checkpointer=self.checkpointer,
                                          overlap_optimizer=self.overlap_optimizer)
        self.saver.install()


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
