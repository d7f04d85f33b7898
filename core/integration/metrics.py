"""Each checkpoint's cost, for the framework's own logging: users watch their runs in TensorBoard, W&B or
MLflow, through the framework's loggers, not in log files.

An adapter measures how long its framework's save call blocked training and hands the checkpoint's handle
over (``SaveMetrics.saved``). The time to durable (from the save returning to the checkpoint committed on
every rank) is known only later, on the thread that reads the writer's replies; the adapter asks for what is
complete at its next chance on the training thread (``ready``: the next save, the end of the run), so that the
framework's logger is only ever called from the training process's own thread and nothing waits for a commit.
A failed save reports nothing here: its error is raised at the next sync point.

Each record: ``step``, ``stall_s`` (how long the framework's save call blocked training), ``waited_s`` (of it,
waiting for an earlier checkpoint's write: ``max_in_flight``), ``durable_s``, ``bytes``, ``bytes_written`` and
``bytes_shared`` (of this rank's, those its writer wrote, and those it shared with the checkpoint before instead:
``storage.sharing``; where the writer said), ``staged_wait_s`` (how
long the optimizer steps after it waited for what ``overlap_optimizer`` left to the staging thread: the rest of
its cost to training). The adapters name them in their framework's idiom (``checkpoint/stall_s`` for
Lightning's and Accelerate's loggers, ``checkpoint_stall_s`` for the Trainer's report_to integrations), and every
adapter hands the records to its user as ``metrics``, a list (``Records``).
"""
from __future__ import annotations

import threading
import time
import warnings
from collections import deque
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from asyncckpt.core.api.checkpointer import Checkpointer


class Records(list):
    """Every save's record, oldest first: an adapter's ``metrics``. ``.history`` is the old spelling (Lightning's and
    Accelerate's ``metrics.history``), kept for one release with a ``FutureWarning``."""

    @property
    def history(self) -> "Records":
        warnings.warn("asyncckpt: metrics.history is deprecated and will be removed in the next release: metrics is "
                      "the list of records itself (the same in every adapter)", FutureWarning, stacklevel=2)
        return self


class SaveMetrics:
    """The records of one adapter's saves, handed out in save order once complete."""

    def __init__(self, checkpointer: "Checkpointer") -> None:
        self.checkpointer = checkpointer
        self.enabled = checkpointer.options.log_metrics
        self.history = Records()  # every record, as they are filled in
        self._open: deque[tuple[Any, dict]] = deque()
        self._latest: Optional[dict] = None  # its staged_wait_s is known at the next save, or at the end
        self._staged_wait_mark = 0.0
        self._lock = threading.Lock()

    def saved(self, handle: Optional[Any], stall_s: float) -> None:
        """The framework's save call that made ``handle`` (a checkpoint's) returned after ``stall_s``: the stall the
        core's interval advice uses (a directory's files are snapshot by the framework's own code, which the core
        does not time)."""
        if handle is None:
            return
        handle.timings["stall_s"] = stall_s
        if not self.enabled:
            return
        returned = time.perf_counter()
        record = {"step": handle.step, "stall_s": stall_s, "waited_s": handle.timings.get("waited_s", 0.0),
                  "durable_s": None, "bytes": None, "staged_wait_s": 0.0}
        self._close_latest()
        with self._lock:
            self.history.append(record)
            self._open.append((handle, record))
            self._latest = record
        handle.when_done(lambda: record.update(durable_s=time.perf_counter() - returned))

    def ready(self, *, final: bool = False) -> list[dict]:
        """The records of committed saves not handed out yet, oldest first; never waits. The latest save's
        record waits for the next save (or ``final``: the end of the run), which tells how long the optimizer
        steps after it waited for its overlapped snapshot."""
        if not self.enabled:
            return []
        if final:
            self._close_latest()
        complete = []
        with self._lock:
            while self._open and self._open[0][0].done() and self._open[0][1] is not self._latest:
                handle, record = self._open.popleft()
                if handle.exception() is None:
                    record["bytes"] = handle.nbytes
                    if handle.written is not None:
                        record.update(bytes_written=handle.written, bytes_shared=handle.shared)
                    complete.append(record)
        return complete

    def _close_latest(self) -> None:
        waited = self.checkpointer.snapshot_thread.waited_s
        with self._lock:
            if self._latest is not None:
                self._latest["staged_wait_s"] = waited - self._staged_wait_mark
            self._staged_wait_mark, self._latest = waited, None
