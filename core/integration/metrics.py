"""Each checkpoint's cost, for the framework's own logging: users watch their runs in TensorBoard, W&B or
MLflow, through the framework's loggers, not in log files.

More: docs/MODULES.md, core/integration/metrics.py.
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
        self._latest: Optional[dict] = None  # its snapshot_wait_s is known at the next save, or at the end
        self._snapshot_wait_mark = 0.0
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
                  "durable_s": None, "bytes": None, "snapshot_wait_s": 0.0}
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
                self._latest["snapshot_wait_s"] = waited - self._snapshot_wait_mark
            self._snapshot_wait_mark, self._latest = waited, None
