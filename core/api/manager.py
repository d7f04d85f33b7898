"""``CheckpointManager``: step-named checkpoints under one root, with retention.

Retention runs in the background writer, queued right after the save that triggers it and run
only if that save committed: old checkpoints are deleted only once the newer one is committed,
never one still in flight (it is not committed yet, so it is not a candidate), and never the
newest committed one. Deletion is atomic (renamed out of the way first). Only rank 0 deletes.
"""
from __future__ import annotations

import os
import re
from typing import Any, Optional

from asyncckpt.core.storage.backend import join, normalize
from asyncckpt.core.api.checkpointer import Checkpointer
from asyncckpt.core.snapshot.dist_env import rank_and_world
from asyncckpt.core.client.handles import SaveHandle
from asyncckpt.core.storage.object_store import using
from asyncckpt.core.writer.retention import committed_steps


class CheckpointManager:
    """Save, find and load checkpoints named by step (``step_000120``) under ``root``.

    Args:
        keep_last: how many of the newest committed checkpoints to keep (None: all).
        keep_every: additionally keep every checkpoint whose step is a multiple of this.
        checkpointer: the Checkpointer to use (default: a new one, built from ``options``).
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: Optional[int] = 3, keep_every: Optional[int] = None,
                 prefix: str = "step_", digits: int = 6, checkpointer: Optional[Checkpointer] = None,
                 **options: Any) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be >= 1 (the newest committed checkpoint is always kept)")
        self.root = normalize(root)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.prefix, self.digits = prefix, digits
        self._pattern = rf"^{re.escape(prefix)}(\d+)$"
        self.checkpointer = checkpointer or Checkpointer(**options)
        self.retention: Optional[SaveHandle] = None  # the latest save's retention

    def path_for(self, step: int) -> str:
        return join(self.root, f"{self.prefix}{step:0{self.digits}d}")

    def steps(self) -> list[int]:
        """Committed steps, oldest first."""
        with using(self.checkpointer.object_store):
            return sorted(committed_steps(self.root, re.compile(self._pattern)))

    def latest(self) -> Optional[int]:
        steps = self.steps()
        return steps[-1] if steps else None

    def async_save(self, step: int, state_dict: dict, **options: Any) -> SaveHandle:
        """Save ``step``; once it is committed, rank 0's writer applies the retention (whose
        handle is ``self.retention``)."""
        path = self.path_for(step)
        handle = self.checkpointer.async_save(state_dict, path, step=step, **options)
        if rank_and_world(self.checkpointer.process_group)[0] == 0:
            self.retention = self.checkpointer.apply_retention(self.root, self._pattern, keep_last=self.keep_last,
                                                               keep_every=self.keep_every, after=handle)
        return handle

    def save(self, step: int, state_dict: dict, **options: Any) -> None:
        """Save ``step`` and return once it is committed and the retention has run."""
        self.async_save(step, state_dict, stream=True, **options).result()
        if self.retention is not None:
            self.retention.result()

    def load(self, state_dict: dict, step: Optional[int] = None, **options: Any) -> int:
        """Load ``step`` (default: the newest committed) into ``state_dict``; returns the step."""
        if step is None:
            self.checkpointer.wait()  # a save in flight may be the newest
            step = self.latest()
            if step is None:
                raise FileNotFoundError(f"no committed checkpoint under {self.root}")
        self.checkpointer.load(state_dict, self.path_for(step), **options)
        return step

    def wait(self) -> None:
        self.checkpointer.wait()

    def close(self) -> None:
        self.checkpointer.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
