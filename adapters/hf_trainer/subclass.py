"""A Trainer subclass's own ``_save_checkpoint`` runs; its ``super()._save_checkpoint`` is the asynchronous save.

TRL's trainers (``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, ``KTOTrainer``, ``RewardTrainer``, ...) override
``_save_checkpoint`` to write the model card (``output_dir/README.md``) and then call the parent's; users'
subclasses add files of their own (EMA weights, extra state) before or after that call. Replacing the
instance's ``_save_checkpoint`` would skip all of it, silently. So the override is called as it is, and for
the length of the call the parent, ``transformers.trainer.Trainer._save_checkpoint`` called on this Trainer,
is the asynchronous save instead (``standing_in``); ``saver.py`` captures what the override writes into
``checkpoint-N`` into the same checkpoint.

When ``super()._save_checkpoint`` returns, the checkpoint is still being written and ``checkpoint-N`` does
not exist yet: an override that then reads files there, or writes into the folder without creating it,
gets a ``FileNotFoundError`` naming a path in it (``names_checkpoint``). Such an override cannot run
against an asynchronous save; the saver then saves that Trainer's checkpoints synchronously.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

from transformers.trainer import Trainer

from asyncckpt.core.integration import patching


def overrides_save_checkpoint(trainer: Trainer) -> bool:
    """Whether ``trainer``'s class (or one between it and ``Trainer``) has its own ``_save_checkpoint``."""
    return type(trainer)._save_checkpoint is not Trainer._save_checkpoint


@contextlib.contextmanager
def standing_in(trainer: Trainer, parent: Callable[[Any, Any], None]) -> Iterator[list]:
    """While active, the first ``Trainer._save_checkpoint(trainer, model, trial)`` (the override's
    ``super()`` call, however deep the subclassing) is ``parent(model, trial)``; calls on other Trainers
    and any later call are the Trainer's own. Yields the trials ``parent`` was called with (empty: never)."""
    native = Trainer._save_checkpoint
    calls: list = []

    def _save_checkpoint(self: Trainer, model: Any, trial: Any) -> None:
        if self is not trainer or calls:
            return native(self, model, trial)
        calls.append(trial)
        return parent(model, trial)

    with patching.patched(Trainer, "_save_checkpoint", _save_checkpoint):
        yield calls


def names_checkpoint(error: OSError, folder: str) -> bool:
    """Whether ``error`` is about ``folder`` or a path in it."""
    folder = os.path.realpath(folder)
    for path in (error.filename, error.filename2):
        if isinstance(path, (str, os.PathLike)):
            path = os.path.realpath(path)
            if path == folder or path.startswith(folder + os.sep):
                return True
    return False
