"""The persistent background writer: one process per rank, started once, fed plain data.

It is launched as ``python -m asyncckpt.core.writer.process`` (not multiprocessing's spawn, which would
re-import the user's ``__main__`` and re-run an unguarded training script), talks over a Unix
socket (``protocol``), receives staging buffers as memfd file descriptors, and runs each request
outside the training process's GIL. It dies with its parent (PR_SET_PDEATHSIG), so a killed
trainer never leaves an orphan writer behind, and it runs in a session of its own with SIGINT
ignored: a Ctrl-C in the terminal reaches the training process, which then drains what it handed
over (the exit drain), instead of killing the save in flight.

It does not import torch (~190 MiB of private memory per process) unless it coordinates a sharded
save with a torch whose DCP metadata it cannot write by itself (``storage.commit_share``).
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any, Callable, Optional

from asyncckpt.core.storage import leftovers
from asyncckpt.core.writer import protocol
from asyncckpt.core.writer.barrier import BarrierSpec, local_barrier
from asyncckpt.core.writer.copy_progress import PROGRESS_BYTES
from asyncckpt.core.errors import CheckpointTimeoutError, CheckpointWriteError

_PR_SET_PDEATHSIG = 1
_REMEMBERED_FAILURES = 256  # saves whose failure (or files) on this rank a later request of theirs may ask about


class Channel:
    """The writer's end of the socket. Messages are taken in order, except the answer to a
    barrier call, which the request waiting for it takes out of turn (the training process may
    have queued more work meanwhile)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._queued: list[tuple[tuple, Optional[int]]] = []

    def _receive(self) -> tuple[tuple, Optional[int]]:
        message = self.conn.recv()
        fd = recv_handle(self.conn) if message[0] == protocol.BUFFER else None
        return message, fd

    def next_message(self) -> tuple[tuple, Optional[int]]:
        """The next message (and the file descriptor a BUFFER message brings)."""
        return self._queued.pop(0) if self._queued else self._receive()

    def send(self, *message: Any) -> None:
        self.conn.send(message)

    def call_barrier(self, spec: BarrierSpec, method: str, args: tuple) -> None:
        self.send(protocol.BARRIER_CALL, spec, method, args)
        while True:
            message, fd = self._receive()
            if message[0] != protocol.BARRIER_RESULT:
                self._queued.append((message, fd))
                continue
            _, error = message
            if error is None:
                return
            kind, text = error
            raise (CheckpointTimeoutError if kind == CheckpointTimeoutError.__name__ else CheckpointWriteError)(text)


class RemoteBarrier:
    """A ``StoreBarrier`` run by the training process, which holds the Store (see ``barrier``)."""

    def __init__(self, spec: BarrierSpec, channel: Channel) -> None:
        self.spec, self.channel = spec, channel

    def __getattr__(self, method: str) -> Callable[..., None]:
        if method not in ("arrive", "fail", "wait_all", "committed", "wait_commit"):
            raise AttributeError(method)
        return lambda *args: self.channel.call_barrier(self.spec, method, args)


class Writer:
    """The state a writer keeps across requests: mapped buffers, which jobs failed, which saves
    failed on this rank, and the work left for after the replies (deletions, tidying)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.buffers: dict[int, tuple[Any, mmap.mmap]] = {}
        self.failed_jobs: set[int] = set()
        self.failures: dict[str, str] = {}
        self.files: dict[str, dict[str, Any]] = {}  # save key -> name -> FileChecksum, until its commit
        self.tidying: set[str] = set()  # directories to tidy after the current batch's replies
        self.after_replies: list[Callable[[], None]] = []

    def run_jobs(self, jobs: list[protocol.Job]) -> None:
        for job in jobs:
            if job.after is not None and job.after in self.failed_jobs:
                self.failed_jobs.add(job.job_id)
                self.channel.send(protocol.CANCELLED, job.job_id)
                continue
            layout, mapping = self.buffers[job.buffer_id] if job.buffer_id is not None else (None, None)
            context = _Context(self, layout, memoryview(mapping) if mapping is not None else None)
            try:
                job.request.run(context)
                self.channel.send(protocol.DONE, job.job_id)
            except BaseException as e:  # report everything; the training process decides what to raise
                self.failed_jobs.add(job.job_id)
                self.channel.send(protocol.FAILED, job.job_id, *protocol.error_text(e), traceback.format_exc())
        self._after_replies()

    def _after_replies(self) -> None:
        """Work nobody waits for, done once the replies are sent: deleting what commits replaced
        or removals renamed away, tidying leftovers; then collecting garbage. Automatic collection
        is off in the writer: a save parses and builds tens of thousands of small objects, and a
        full collection in the middle of one (~0.15 s with the cached metadata of a large
        structure) delayed its commit. Freezing what survives keeps caches out of later ones."""
        actions, self.after_replies = self.after_replies, []
        self.tidying.clear()
        for action in actions:
            try:
                action()
            except OSError:
                pass  # a leftover stays a leftover: the next tidy or ``asyncckpt clean`` takes it
        gc.collect()
        gc.freeze()


class _Context:
    """``protocol.RequestContext`` for one request."""

    def __init__(self, writer: Writer, layout: Any, image: Optional[memoryview]) -> None:
        self.writer, self.layout, self.image = writer, layout, image

    def token(self) -> str:
        return leftovers.owner_token()

    def tidy(self, parent: str) -> None:
        parent = os.path.abspath(parent)
        if parent not in self.writer.tidying:
            self.writer.tidying.add(parent)
            self.after_reply(lambda: leftovers.clean(parent))

    def barrier(self, spec: BarrierSpec):
        return RemoteBarrier(spec, self.writer.channel) if spec.kind == "store" else local_barrier(spec)

    def after_reply(self, action: Callable[[], None]) -> None:
        self.writer.after_replies.append(action)

    def record_failure(self, save_key: str, reason: str) -> None:
        failures = self.writer.failures
        failures.setdefault(save_key, reason)
        while len(failures) > _REMEMBERED_FAILURES:
            failures.pop(next(iter(failures)))

    def failure(self, save_key: str) -> Optional[str]:
        return self.writer.failures.get(save_key)

    def record_file(self, save_key: str, name: str, checksum: Any) -> None:
        files = self.writer.files
        files.setdefault(save_key, {})[name] = checksum
        while len(files) > _REMEMBERED_FAILURES:  # saves begun and never committed
            files.pop(next(iter(files)))

    def files(self, save_key: str) -> dict[str, Any]:
        return self.writer.files.pop(save_key, {})


def serve(channel: Channel, profile_to: Optional[str] = None) -> None:
    """Run requests until told to stop. With ``profile_to``, everything the writer runs is profiled
    (cProfile) and the statistics are written there when it stops (``benchmarks/profile_core.py``)."""
    profiler = None
    if profile_to:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    writer = Writer(channel)
    while True:
        try:
            message, fd = channel.next_message()
        except EOFError:
            message, fd = (protocol.STOP,), None
        kind = message[0]
        if kind == protocol.BUFFER:
            _, buffer_id, layout = message
            writer.buffers[buffer_id] = (layout, mmap.mmap(fd, layout.buffer_size + PROGRESS_BYTES))  # image, then CopyProgress
            os.close(fd)
        elif kind == protocol.DROP:
            # Only drop our reference: views of the mapping may outlive a failed request (its
            # traceback), and the mapping unmaps itself once the last of them is gone.
            writer.buffers.pop(message[1], None)
        elif kind == protocol.RUN:
            writer.run_jobs(message[1])
        elif kind == protocol.STOP:
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(profile_to)
            with contextlib.suppress(OSError):
                channel.send(protocol.STOPPED)
                channel.conn.close()
            os._exit(0)  # everything is durable already; skip the interpreter's teardown


def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() != parent_pid:  # parent died before prctl took effect
        os._exit(1)


def _apply_test_limits() -> None:
    """``ASYNCCKPT_WORKER_FSIZE_LIMIT`` (bytes): a real RLIMIT_FSIZE, so writes fail with EFBIG.

    Used by the test suite to produce a genuine I/O error (as on a full disk) in one rank's writer.
    """
    limit = os.environ.get("ASYNCCKPT_WORKER_FSIZE_LIMIT")
    if limit:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))


def main() -> None:
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    _apply_test_limits()
    gc.disable()
    serve(Channel(Connection(fd)), os.environ.get("ASYNCCKPT_WRITER_PROFILE"))


if __name__ == "__main__":
    main()
