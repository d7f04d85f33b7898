"""The ledger: everything of one ``Checkpointer`` that is not settled yet, in one place.

More: docs/MODULES.md, core/client/ledger.py.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from asyncckpt.core.client.handles import SaveHandle
from asyncckpt.core.client.writer_queue import WriterQueue
from asyncckpt.core.errors import (
    CheckpointCancelledError,
    CheckpointError,
    CheckpointTimeoutError,
    CheckpointWriteError,
)
from asyncckpt.core.formats import names
from asyncckpt.core.writer.protocol import Idle

logger = logging.getLogger("asyncckpt.core")
_CREATES = ("save", "file", "directory", "link", "hook", "export", "persist")  # a hook or export leaves its checkpoint there
_ON_RANK = re.compile(r"^rank (\S+): (.*)$", re.S)


class Ledger:
    """One ``Checkpointer``'s unsettled work (see the module docstring); its ``queue`` is the way into its writer."""

    def __init__(self, *, max_in_flight: int, timeout: float, store: Callable[[], Any],
                 writer_idle_timeout: Optional[float]) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight, self.timeout = max_in_flight, timeout
        self.queue = WriterQueue(self.complete, store, timeout=timeout, idle_timeout=writer_idle_timeout)
        self._in_flight: deque[SaveHandle] = deque()
        self._unobserved: list[SaveHandle] = []
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ admission
    def admit(self, kind: str, path: str, *, rank: int, step: Optional[int] = None, label: Optional[str] = None,
              paths: Optional[tuple[str, ...]] = None, after: Optional[SaveHandle] = None,
              member_of: Optional[SaveHandle] = None) -> SaveHandle:
        """A new handle, in flight from now on; a checkpoint first waits while ``max_in_flight``
        checkpoints are pending (and raises a failure of theirs nobody has seen)."""
        handle = SaveHandle(kind, path, rank=rank, timeout=self.timeout + 60, step=step, label=label, paths=paths,
                            after=after, member_of=member_of)
        if handle.is_checkpoint:
            started = time.perf_counter()
            self.apply_back_pressure()
            handle.timings["waited_s"] = time.perf_counter() - started
        with self._lock:
            self._in_flight.append(handle)
            if after is not None:
                after.dependents.append(handle)
        return handle

    def apply_back_pressure(self) -> None:
        while True:
            with self._lock:
                pending = [h for h in self._in_flight if h.is_checkpoint and not h.done()]
            if len(pending) < self.max_in_flight:
                self.raise_unobserved()  # one that failed since the caller last looked (the next save is where it is seen)
                return
            if not _handed_over(pending[0]):
                raise RuntimeError(f"asyncckpt: {pending[0].describe()} was never committed (call commit() on its "
                                   f"transaction first): max_in_flight={self.max_in_flight} checkpoints are pending")
            self.settle(pending[0])
            self.raise_unobserved()

    # ------------------------------------------------------------------ outcomes
    def complete(self, handle: SaveHandle, error: Optional[BaseException]) -> None:
        """Settle ``handle`` with its outcome (once; later outcomes are ignored)."""
        if error is not None and not isinstance(error, CheckpointCancelledError):
            error = self._labelled(handle, error)
        if not handle.finish(error):
            return
        if error is None:
            if handle.is_checkpoint:
                logger.info("asyncckpt: committed %s", handle.describe().removeprefix("saving checkpoint "))
            return
        if self._reportable(handle, error):
            with self._lock:
                self._unobserved.append(handle)
        elif handle.kind == "export" and not isinstance(error, CheckpointCancelledError):
            logger.error("%s", error)  # training goes on: the checkpoint is committed, only its copy failed
        for dependent in handle.dependents:  # the writer cancels them too; nobody need wait for it to say so
            self.complete(dependent, CheckpointCancelledError(dependent.cancelled_message()))

    def report_later(self, handle: SaveHandle) -> None:
        """A failure raised where nobody sees it (the snapshot thread): raise it at a sync point."""
        with self._lock:
            handle.observed = False
            if handle not in self._unobserved:
                self._unobserved.append(handle)

    @staticmethod
    def _reportable(handle: SaveHandle, error: BaseException) -> bool:
        return handle.kind not in ("member", "export") and not isinstance(error, CheckpointCancelledError)

    @staticmethod
    def _labelled(handle: SaveHandle, error: BaseException) -> CheckpointError:
        kind = CheckpointTimeoutError if isinstance(error, CheckpointTimeoutError) else CheckpointWriteError
        where, rank, cause = "", handle.rank, str(error)
        on_rank = _ON_RANK.match(cause)
        if on_rank:  # the writers' errors start with the rank they happened on
            where, cause = f" on rank {on_rank[1]}", on_rank[2]
            rank = int(on_rank[1]) if on_rank[1].isdigit() else rank
        message = names.unhide(f"asyncckpt: {handle.describe()} failed{where}: {cause}")
        if handle.is_checkpoint:
            message += "; nothing was published under its name (what was there before is kept)"
        undone = [d.describe() for d in handle.dependents]
        if undone:
            message += f"; not done either, since they waited for it: {'; '.join(undone)}"
        return kind(message, path=handle.path, step=handle.step, rank=rank)

    # ------------------------------------------------------------------ waiting
    def settle(self, handle: SaveHandle, timeout: Optional[float] = None) -> None:
        """Wait (bounded) for ``handle``; one still not done is reported as a timeout."""
        if not handle.wait(timeout):
            error = handle.timeout_error(handle.default_timeout if timeout is None else timeout)
            timed_out = SaveHandle(handle.kind, handle.path, rank=handle.rank, timeout=0)
            timed_out.finish(error)
            with self._lock:
                self._unobserved.append(timed_out)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Wait for everything handed over so far (a directory not committed yet is not), and the
        work the writer does after its replies (deleting replaced and removed checkpoints); raise
        what nobody has observed."""
        with self._lock:
            pending = [h for h in self._in_flight if not h.done() and _handed_over(h)]
        for handle in pending:
            handle.release_held()  # held files and commits first: the Idle request must follow them
        if self.queue.running:
            idle = self.admit("idle", "the background writer's queue", rank=pending[0].rank if pending else 0)
            self.queue.submit([(idle, Idle(), None)])
            pending.append(idle)
        for handle in pending:
            self.settle(handle, timeout)
        self.raise_unobserved()

    def wait_for(self, path: str) -> None:
        """Wait for everything pending that touches ``path``; raise a failure of it nobody has observed."""
        touching = self.touching(path)
        for handle in touching:
            self.settle(handle)
        failed = [h for h in touching if h.exception() is not None and not h.observed and self._reportable(h, h.exception())]
        if failed:
            failed[0].observed = True
            raise failed[0].exception()

    def raise_unobserved(self) -> None:
        """Raise the first failure nobody has observed (naming any others), and forget what is done."""
        with self._lock:
            while self._in_flight and self._in_flight[0].done():
                self._in_flight.popleft()
            failed = [h for h in self._unobserved if not h.observed]
            self._unobserved = []
            for handle in failed:
                handle.observed = True
        if failed:
            first = failed[0].exception()
            if len(failed) > 1:
                others = "; ".join(h.describe() for h in failed[1:])
                first = type(first)(f"{first} [also failed: {others}]", path=first.path, step=first.step, rank=first.rank)
            raise first

    def has_unobserved(self) -> bool:
        with self._lock:
            return any(not h.observed for h in self._unobserved)

    # ------------------------------------------------------------------ what is pending
    def touching(self, path: str) -> list[SaveHandle]:
        with self._lock:
            return [h for h in self._in_flight if path in h.paths and not h.done()]

    def will_exist(self, path: str) -> Optional[bool]:
        """Whether ``path`` will exist once the queue has run: True if its latest pending work
        creates it, False if that removes it, None if nothing pending touches it."""
        pending = self.touching(path)
        return pending[-1].kind in _CREATES if pending else None

    def uncommitted(self) -> list[SaveHandle]:
        """Directories begun and never committed."""
        with self._lock:
            return [h for h in self._in_flight if not h.done() and not _handed_over(h)]

    def abandon_uncommitted(self) -> None:
        """Cancel directories that were begun and never committed (the Checkpointer is closing, its writer gone)."""
        for handle in self.uncommitted():
            self.complete(handle, CheckpointCancelledError(f"asyncckpt: {handle.describe()}: never committed"))

    def pending(self) -> list[SaveHandle]:
        """Checkpoints, removals and links not done yet, in submission order."""
        with self._lock:
            return [h for h in self._in_flight if not h.done() and h.kind not in ("member", "idle")]


def _handed_over(handle: SaveHandle) -> bool:
    """Whether the writer has (or will be given, once released) the handle's work: everything but
    a directory whose ``commit()`` has not been called."""
    return handle.kind != "directory" or handle.job_id is not None
