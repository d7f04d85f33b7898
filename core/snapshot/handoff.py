"""Taking a snapshot and handing it to the writer; and the staging thread that overlaps snapshots.

``take_snapshot`` runs the copy into a staging buffer (the only part of a save the caller waits
for) and queues the request: at once for a streamed save (the writer writes each part the copy
has finished), otherwise once the copy is complete. A snapshot that fails before the writer has
the request fails its handle, and its save on every rank (the barrier), so that no rank waits
for a share that will never come.

The staging thread runs work the caller need not wait for (``run``): an overlapped save's whole
snapshot, or an adapter's optimizer files, while the next forward/backward runs. ``wait()`` joins
it; every optimizer step can be made to (``guard``, ``guard_every_optimizer``).
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
from asyncckpt.core.errors import CheckpointError, CheckpointTimeoutError, CheckpointWriteError
from asyncckpt.core.client.handles import SaveHandle
from asyncckpt.core.snapshot.shared_buffer import CopyInProgress

logger = logging.getLogger("asyncckpt.core")


class Stager:
    def __init__(self, ledger: Ledger, store: Callable[[], Any], timeout: float) -> None:
        self.ledger, self._store, self.timeout = ledger, store, timeout
        self._thread: Optional[threading.Thread] = None
        self.staged_wait_s = 0.0  # total time callers spent waiting for the staging thread

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
            handle.set_staged()
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
            handle.observed = True  # raised to the caller (the staging thread hands it back: ``report_later``)
            if not isinstance(e, Exception):
                raise  # Ctrl-C stays a KeyboardInterrupt: the save is abandoned, the user's interrupt goes on
            raise handle.exception() from e

    def fail_everywhere(self, request: Any, rank: int, error: BaseException) -> None:
        """A request that will never reach the writer: its save fails on the other ranks too."""
        spec = getattr(request, "barrier", None)
        if spec is not None:
            try:
                local_barrier(spec, self._store()).fail(rank, str(error))
            except (CheckpointError, OSError, RuntimeError):
                pass  # the others time out instead

    # ------------------------------------------------------------------ the staging thread
    def run(self, function: Callable[[], None]) -> None:
        """Run ``function`` on the staging thread, after what runs there now. It reports its own
        failures (through handles); one that escapes is logged."""
        self.wait()

        def staged() -> None:
            time.sleep(0)  # hand the GIL back at once: the caller returns now, not after a switch interval
            try:
                function()
            except BaseException:  # noqa: BLE001 - documented: delivered through handles
                logger.exception("asyncckpt: a snapshot on the staging thread failed")

        self._thread = threading.Thread(target=staged, name="asyncckpt-stager", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Work was started on the staging thread and nobody has waited for it yet."""
        return self._thread is not None

    def wait(self) -> None:
        """Block until what runs on the staging thread is done (call before changing its state)."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        started = time.perf_counter()
        thread.join(self.timeout)
        self.staged_wait_s += time.perf_counter() - started
        if thread.is_alive():
            raise CheckpointTimeoutError(f"asyncckpt: snapshot on the staging thread not finished after {self.timeout:.0f}s")
        self._thread = None

    def guard(self, *optimizers: torch.optim.Optimizer) -> list:
        """Make each optimizer's ``step()`` wait for the staging thread; returns hook handles."""
        return [opt.register_step_pre_hook(lambda *_: self.wait()) for opt in optimizers]

    def guard_every_optimizer(self):
        """Make every torch optimizer's ``step()`` in the process wait for the staging thread (for
        callers that do not know which optimizers change the state they snapshot). Held weakly:
        once this stager is gone the hook does nothing. Returns the hook's handle."""
        wait = weakref.WeakMethod(self.wait)

        def hook(*_: Any) -> None:
            bound = wait()
            if bound is not None:
                bound()

        return register_optimizer_step_pre_hook(hook)
