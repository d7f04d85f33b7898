"""What a framework's directory save does around the framework's own save code, for every adapter.

More: docs/MODULES.md, core/integration/saving.py.
"""
from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

import torch

if TYPE_CHECKING:
    from asyncckpt.core.api.checkpointer import Checkpointer
    from asyncckpt.core.api.directory import DirectoryTransaction


def overlaps_optimizer(checkpointer: "Checkpointer", optimizers: Iterable[Any]) -> bool:
    """``overlap_optimizer`` asked for, and every one of ``optimizers`` (unwrapped from a framework's wrapper
    holding it as ``.optimizer``) a torch optimizer, whose ``step()`` waits for an overlapped snapshot; a
    warning names one that is not."""
    if not checkpointer.options.overlap_optimizer:
        return False
    for optimizer in optimizers:
        inner = getattr(optimizer, "optimizer", optimizer)
        if not isinstance(inner, torch.optim.Optimizer):
            warnings.warn(f"asyncckpt: {type(inner).__name__} is not a torch.optim.Optimizer, so its steps cannot be "
                          "made to wait for an overlapped snapshot: its state is snapshot before each save returns",
                          RuntimeWarning, stacklevel=3)
            return False
    return True


def rotation(checkpointer: "Checkpointer", root: str, list_on_disk: Callable[[], list[str]], *, keep: Optional[int],
             protected: Iterable[str] = (), adding: int = 0) -> list[str]:
    """What a framework's rotation (keep the newest ``keep`` checkpoints in ``root``) deletes once the queued work
    has run, oldest first: ``list_on_disk()`` in the framework's own order (oldest first), less those queued for
    removal, then those being saved there in save order, plus ``adding`` about to be saved; never a
    ``protected`` one (the newest, the best). Counting checkpoints in flight as present is what keeps an
    asynchronous save's rotation the framework's own."""
    if keep is None or keep <= 0:
        return []
    checkpoints = checkpointer.checkpoints_in(root, list_on_disk)
    protected = set(protected) & set(checkpoints)
    excess = len(checkpoints) + adding - max(keep, len(protected))
    return [path for path in checkpoints if path not in protected][:max(0, excess)]


def atomic_rmtree(checkpointer: "Checkpointer", rmtree: Callable[..., Any], is_checkpoint: Callable[[str], bool]) -> Callable:
    """``rmtree`` (``shutil.rmtree``, as a framework deletes an old checkpoint itself) for which a checkpoint is
    removed as the core removes one (renamed out of the framework's names first, then deleted: never seen
    half-deleted), once the work queued before it is done; any other path as ``rmtree`` would."""
    def remove(path: Any, *args: Any, **kwargs: Any) -> None:
        path = os.path.abspath(os.fspath(path))
        if not is_checkpoint(path):
            return rmtree(path, *args, **kwargs)
        checkpointer.remove([path]).result()

    return remove


def finish(checkpointer: "Checkpointer", tx: "DirectoryTransaction", *, stage_later: Optional[Callable[[], None]] = None,
           removals: Optional[list[str]] = None, hidden_parent: Optional[str] = None) -> None:
    """Commit ``tx`` and queue ``removals`` behind it (run only if it committed). With ``stage_later`` (the
    snapshots left for after the call), all of it runs on the snapshot thread, after them, while the caller goes
    on; a snapshot failing there aborts the checkpoint on every rank and is raised at the next sync point."""
    def complete() -> None:
        if stage_later is not None:
            try:
                stage_later()
            except BaseException as error:  # noqa: BLE001 - on the snapshot thread: raised at the next sync point
                tx.abort(error, raised=False)
                return
        handle = tx.commit()
        if removals:
            checkpointer.remove(removals, after=handle, hidden_parent=hidden_parent)

    if stage_later is None:
        complete()
    else:
        checkpointer.snapshot_thread.run(complete)
