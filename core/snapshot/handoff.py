"""Taking a snapshot and handing it to the writer (``Handoff``); and the snapshot thread that overlaps snapshots.

``take_snapshot`` runs the copy into a snapshot buffer (the only part of a save the caller waits
for) and queues the request: at once for a streamed save (the writer writes each part the copy
has finished), otherwise once the copy is complete. A snapshot that fails before the writer has
the request fails its handle, and its save on every rank (the barrier), so that no rank waits
for a share that will never come.

More: docs/MODULES.md, core/snapshot/handoff.py.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from typing import Any, Callable, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from asyncckpt.core.writer.barrier import local_barrier
from asyncckpt.core.client.ledger import Ledger
from asyncckpt.core.errors import (CheckpointCancelledError, CheckpointError, CheckpointTimeoutError,
                                   CheckpointWriteError)
from asyncckpt.core.client.handles import SaveHandle
from asyncckpt.core.snapshot.shared_buffer import CopyInProgress

logger = logging.getLogger("asyncckpt.core")


class Handoff:
    """The copy of a snapshot and its hand-over to the writer, for one Checkpointer's saves."""

    def __init__(self, ledger: Ledger, store: Callable[[], Any]) -> None:
        self.ledger, self._store = ledger, store

    def take_snapshot(self, handle: SaveHandle, begin: Callable[[], CopyInProgress], request: Any,
                      hand_over: Callable[[], None], *, stream: bool = False) -> None:
        """Copy (``begin()`` starts it) and hand ``request`` over (``hand_over()``); return once
        the copy is complete. A failure is delivered through ``handle`` and raised to the caller."""
        copy: Optional[CopyInProgress] = None
        handed_over = False
        started = time.perf_counter()
        try:
            with torch.no_grad():
                copy = begin()
            if stream:
                request.copy_generation = copy.generation
                hand_over()
                handed_over = True
            copy.wait()
            handle.set_snapshot_taken()
            if not stream:
                hand_over()
            handle.timings["copy_s"] = time.perf_counter() - started
        except BaseException as e:
            if copy is not None:  # the buffer is freed with the handle: the copy threads must have left it
                with contextlib.suppress(BaseException):
                    copy.wait()
            error = e if isinstance(e, CheckpointError) else \
                CheckpointWriteError(f"rank {handle.rank}: snapshot failed: {type(e).__name__}: {e}")
            if not handed_over:  # otherwise the writer sees the copy fail and fails the save on every rank
                self.fail_everywhere(request, handle.rank, error)
            self.ledger.complete(handle, error)
            handle.observed = True  # raised to the caller (the snapshot thread hands it back: ``report_later``)
            if not isinstance(e, Exception):
                raise  # Ctrl-C stays a KeyboardInterrupt: the save is abandoned, the user's interrupt goes on
            raise handle.exception() from e

    def in_foreground(self, handle: SaveHandle, step: Callable[[], Any]) -> Any:
        """Run part of a save in the caller: what it raises is the caller's to see (not raised
        again); a save that did not get as far as its snapshot is cancelled."""
        try:
            return step()
        except BaseException as e:
            if not handle.done():
                self.ledger.complete(handle, CheckpointCancelledError(f"asyncckpt: {handle.describe()}: not saved: {e}"))
            handle.observed = True
            raise

    def in_background(self, handle: SaveHandle, snapshot: Callable[[], None]) -> None:
        """On the snapshot thread: a failure goes to the handle, raised at the next sync point."""
        try:
            snapshot()
        except BaseException as e:  # noqa: BLE001 - delivered through the handle
            if not handle.done():
                self.ledger.complete(handle, e)
            self.ledger.report_later(handle)

    def fail_everywhere(self, request: Any, rank: int, error: BaseException) -> None:
        """A request that will never reach the writer: its save fails on the other ranks too."""
        spec = getattr(request, "barrier", None)
        if spec is not None:
            try:
                local_barrier(spec, self._store()).fail(rank, str(error))
            except (CheckpointError, OSError, RuntimeError):
                pass  # the others time out instead

class SnapshotThread:
    """The one thread that runs a Checkpointer's snapshots in the background (``Checkpointer.snapshot_thread``).

    ``run(function)`` overlaps ``function`` (snapshots through the Checkpointer, for state the caller leaves
    untouched) with what the caller does next; ``wait()`` joins it, and ``guard`` makes optimizer steps do so.
    Failures are delivered through the handles ``function`` creates."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._thread: Optional[threading.Thread] = None
        self.waited_s = 0.0  # seconds callers (optimizer steps, sync points) spent in total waiting for it

    def run(self, function: Callable[[], None]) -> None:
        """Run ``function`` on the snapshot thread, after what runs there now. It reports its own
        failures (through handles); one that escapes is logged."""
        self.wait()

        def snapshot() -> None:
            time.sleep(0)  # hand the GIL back at once: the caller returns now, not after a switch interval
            try:
                function()
            except BaseException:  # noqa: BLE001 - documented: delivered through handles
                logger.exception("asyncckpt: a snapshot on the snapshot thread failed")

        self._thread = threading.Thread(target=snapshot, name="asyncckpt-snapshot", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Work was started on the snapshot thread and nobody has waited for it yet."""
        return self._thread is not None

    def wait(self) -> None:
        """Block until what runs on the snapshot thread is done (call before changing its state)."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        started = time.perf_counter()
        thread.join(self.timeout)
        self.waited_s += time.perf_counter() - started
        if thread.is_alive():
            raise CheckpointTimeoutError(f"asyncckpt: snapshot on the snapshot thread not finished after {self.timeout:.0f}s")
        self._thread = None

    def guard(self, *optimizers: torch.optim.Optimizer) -> list:
        """Make each optimizer's ``step()`` wait for the snapshot thread; returns hook handles."""
        return [opt.register_step_pre_hook(lambda *_: self.wait()) for opt in optimizers]

    def guard_every_optimizer(self):
        """Make every torch optimizer's ``step()`` in the process wait for the snapshot thread (for
        callers that do not know which optimizers change the state they snapshot). Held weakly:
        once this thread's owner is gone the hook does nothing. Returns the hook's handle."""
        wait = weakref.WeakMethod(self.wait)

        def hook(*_: Any) -> None:
            bound = wait()
            if bound is not None:
                bound()

        return register_optimizer_step_pre_hook(hook)
