"""What runs once a checkpoint committed: the user's ``on_commit`` code, and the queueing of its export.

More: docs/MODULES.md, core/api/commit_hooks.py.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Optional

from asyncckpt.core.errors import CheckpointCancelledError, CheckpointWriteError

if TYPE_CHECKING:
    from asyncckpt.core.client.handles import SaveHandle
    from asyncckpt.core.client.ledger import Ledger

OnCommit = Callable[[str], Any]  # called with the committed checkpoint's path


class CommitHooks:
    def __init__(self, ledger: "Ledger") -> None:
        self.ledger = ledger
        self._executor: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    def after(self, checkpoint: "SaveHandle", kind: str, action: Callable[["SaveHandle"], None], *,
              path: Optional[str] = None, label: Optional[str] = None, done_by_action: bool = False) -> "SaveHandle":
        """A handle for ``action``, run on the hooks thread once ``checkpoint`` committed. The handle
        completes when ``action`` returns (or raises), unless ``done_by_action``: then ``action``
        hands it on (to the writer) and whoever runs it completes it."""
        handle = self.ledger.admit(kind, path or checkpoint.path, rank=checkpoint.rank, step=checkpoint.step,
                                   label=label or checkpoint.label, after=checkpoint)
        handle.set_snapshot_taken()

        def run() -> None:
            try:
                action(handle)
            except BaseException as error:  # noqa: BLE001 - delivered through the handle, like a failed save's
                failure = CheckpointWriteError(f"{type(error).__name__}: {error}")
                failure.__cause__ = error
                self.ledger.complete(handle, failure)
                return
            if not done_by_action:
                self.ledger.complete(handle, None)

        def committed() -> None:
            if checkpoint.exception() is not None:  # the ledger cancels dependents it knew of; this one too
                self.ledger.complete(handle, CheckpointCancelledError(handle.cancelled_message()))
            else:
                self._submit(run)

        checkpoint.when_done(committed)
        return handle

    def _submit(self, run: Callable[[], None]) -> None:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-on-commit")
            self._executor.submit(run)

    def stop(self) -> None:
        """After everything was waited for: end the thread (a later commit starts another)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
