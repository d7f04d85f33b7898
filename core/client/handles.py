"""``SaveHandle``: one piece of work handed to the background writer, and what it is about.

A handle carries what it saves (the path the user asked for, the step, a label such as
Lightning's "epoch=1, global_step=15"), so that a failure raised much later, at another sync
point, names its checkpoint. Its outcome is delivered once, through the handle: ``result()``
raises it, and whoever raises it marks it observed, so the checkpointer raises at its next sync
point only failures nobody has seen (``ledger``).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional

from asyncckpt.core.errors import CheckpointTimeoutError

_VERBS = {
    "save": "saving checkpoint", "file": "saving checkpoint", "directory": "saving checkpoint",
    "member": "writing", "remove": "removing", "link": "linking", "retention": "applying retention in",
    "mirror": "mirroring to", "persist": "writing durably", "replicate": "replicating", "hook": "running the on_commit code of", "export": "exporting",
    "idle": "waiting for",
}
CHECKPOINT_KINDS = ("save", "file", "directory")


class SaveHandle:
    """A request in flight. ``result()`` returns once it is done (a save: committed on every
    rank) and raises what went wrong.

    ``kind``: ``save`` (a sharded checkpoint), ``file`` (a native file), ``directory`` (a
    directory of native files: the handle of its commit), ``member`` (one file of a directory,
    whose failure is reported through the directory's handle), ``remove``, ``link``,
    ``retention``, ``hook`` (user code run once a checkpoint committed), ``export``, ``idle``.
    """

    def __init__(self, kind: str, path: str, *, rank: int, timeout: float, step: Optional[int] = None,
                 label: Optional[str] = None, paths: Optional[tuple[str, ...]] = None,
                 after: Optional["SaveHandle"] = None, member_of: Optional["SaveHandle"] = None) -> None:
        if kind not in _VERBS:
            raise ValueError(f"unknown kind {kind!r}")
        self.kind, self.path, self.rank, self.step, self.label = kind, path, rank, step, label
        self.paths = paths if paths is not None else (path,)  # everything it touches
        self.after = after  # runs only if this one succeeded
        self.member_of = member_of
        self.dependents: list[SaveHandle] = []
        self.job_id: Optional[int] = None
        self.request: Any = None
        self.observed = False  # its outcome reached someone (raised, or returned by result())
        self.held_by: Any = None  # a DirectoryTransaction holding the request back until its commit
        self.transaction: Any = None  # a directory's DirectoryTransaction (``Ledger.uncommitted``)
        # seconds the caller spent per phase: waited_s (back-pressure), prepare_s, plan_s, buffer_s
        # (sharded saves), copy_s (the snapshot copy and the hand-over to the writer)
        self.timings: dict[str, float] = {}
        self.nbytes = 0  # the bytes of data it writes (a directory's: its files')
        self.written: Optional[int] = None  # of them, the bytes its writer wrote, where it said (this rank's)
        self.shared = 0  # and those it shared with the checkpoint before instead (``storage.sharing``)
        self._future: Future = Future()
        self._snapshot_taken = threading.Event()
        self.default_timeout = timeout
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self.exception() else "done")
        return f"<SaveHandle {self.describe()} {state}>"

    @property
    def is_checkpoint(self) -> bool:
        """Counts toward ``max_in_flight`` (holds a snapshot buffer, or a directory's files do)."""
        return self.kind in CHECKPOINT_KINDS

    def describe(self) -> str:
        what = ", ".join(self.paths)
        if self.label:
            what += f" ({self.label})"
        elif self.step is not None:
            what += f" (step {self.step})"
        return f"{_VERBS[self.kind]} {what}"

    def cancelled_message(self) -> str:
        return f"asyncckpt: {self.describe()} was not done: {self.after.describe() if self.after else 'its save'} did not commit"

    def add_bytes(self, nbytes: int) -> None:
        """It writes ``nbytes`` more (a file of a directory also counts for its directory)."""
        self.nbytes += nbytes
        if self.member_of is not None:
            self.member_of.add_bytes(nbytes)

    def add_written(self, written: int = 0, shared: int = 0) -> None:
        """What this rank's writer wrote and shared for it (a file of a directory also counts for its directory)."""
        self.written = (self.written or 0) + written
        self.shared += shared
        if self.member_of is not None:
            self.member_of.add_written(written, shared)

    # ------------------------------------------------------------------ waiting
    def release_held(self) -> None:
        """Whoever waits for a request a directory transaction holds back releases it (never a hang)."""
        if self.held_by is not None:
            self.held_by.release()

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> None:
        """Wait until done; raise what went wrong. Never unbounded: ``None`` means the
        checkpointer's timeout plus a margin for the commit."""
        limit = self.default_timeout if timeout is None else timeout
        self.release_held()
        try:
            self._future.exception(limit)
        except FutureTimeout:
            raise self.timeout_error(limit) from None
        self.observed = True
        return self._future.result(0)

    def timeout_error(self, limit: float) -> CheckpointTimeoutError:
        """What a wait of ``limit`` seconds for this work raises: what it waited for, and how to size ``timeout``."""
        size = f"; {self.nbytes / (1 << 30):.2f} GiB from this rank" if self.nbytes else ""
        return CheckpointTimeoutError(
            f"asyncckpt: {self.describe()}: not done after {limit:.0f}s{size}. The timeout option bounds each wait for "
            "a checkpoint: set it to at least 3x the time your checkpoints take to be committed on this storage "
            "(docs/troubleshooting.md)", path=self.path, step=self.step, rank=self.rank)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait (bounded) without taking the outcome; False if still not done."""
        self.release_held()
        try:
            self._future.exception(self.default_timeout if timeout is None else timeout)
            return True
        except FutureTimeout:
            return False

    def exception(self) -> Optional[BaseException]:
        """The failure, if done and failed (does not count as observing it)."""
        return self._future.exception() if self._future.done() else None

    def snapshot_taken(self) -> bool:
        """True once the snapshot is complete and the caller may change the state again."""
        return self._snapshot_taken.is_set()

    def wait_snapshot(self, timeout: Optional[float] = None) -> None:
        if not self._snapshot_taken.wait(self.default_timeout if timeout is None else timeout):
            raise CheckpointTimeoutError(f"asyncckpt: {self.describe()}: snapshot not finished",
                                         path=self.path, step=self.step, rank=self.rank)

    # ------------------------------------------------------------------ completing (the coordinator)
    def set_snapshot_taken(self) -> None:
        self._snapshot_taken.set()

    def when_done(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the handle completes (at once if it has)."""
        with self._lock:
            if not self._future.done():
                self._callbacks.append(callback)
                return
        callback()

    def finish(self, error: Optional[BaseException]) -> bool:
        """Complete the handle once; False if it was already complete."""
        self._snapshot_taken.set()
        with self._lock:
            if self._future.done():
                return False
            if error is None:
                self._future.set_result(None)
            else:
                self._future.set_exception(error)
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()
        return True
