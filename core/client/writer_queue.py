"""The one way into the background writer: start it, hand it jobs, hear back, serve its barrier calls.

``Checkpointer`` and ``DirectoryTransaction`` both submit through ``WriterQueue.submit``: a list
of ``(handle, request, buffer)`` in order, sent as one message (each message wakes the writer,
which then competes with the caller for the CPU). A handle whose ``after`` is set becomes a job
that the writer runs only if that earlier job succeeded.

More: docs/MODULES.md, core/client/writer_queue.py.
"""
from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Any, Callable, Optional

from asyncckpt.core.client.handles import SaveHandle
from asyncckpt.core.errors import (
    CheckpointCancelledError,
    CheckpointError,
    CheckpointTimeoutError,
    CheckpointWriteError,
    SnapshotCopyFailed,
)
from asyncckpt.core.writer import protocol
from asyncckpt.core.writer.barrier import local_barrier

Outcome = Callable[[SaveHandle, Optional[BaseException]], None]


class _Writer:
    """One writer process, its socket and its reader thread."""

    def __init__(self, reader: Callable[["_Writer"], None], timeout: float) -> None:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
        env["OMP_NUM_THREADS"] = "1"  # the writer does I/O, not compute
        # The signals that would end it are blocked in the writer until it has set its own action for each
        # (``protocol.WRITER_SIGNALS``, ``process.main``): one that comes while it starts (a preemption right after
        # the save that started it) must not kill it. The child inherits this thread's mask; signals for the
        # training process meanwhile stay pending (or reach its other threads) until the mask is restored, once
        # the child runs. The training process's own actions are left as they are.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, protocol.WRITER_SIGNALS)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "asyncckpt.core.writer.process", str(child_sock.fileno()), str(os.getpid()),
                 str(timeout)],
                pass_fds=[child_sock.fileno()], env=env, stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C in the terminal is the training process's to handle
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.registered: set[int] = set()
        self.outbox: list[Any] = []  # what ``send`` has still to send
        self.sending = False
        self.serving = False  # it was handed the memory tier's listening socket (``WriterQueue.serve_replicas``)
        self.stopping = False
        self.thread = threading.Thread(target=reader, args=(self,), name="asyncckpt-writer-replies", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None and self.thread.is_alive()

    def send(self, *items: Any) -> None:
        """Send ``items`` in order: messages (tuples) and the descriptors (ints) that follow one. Called under the
        queue's lock, so only this thread can call in while they go out: a signal handler that saves (Lightning's
        SLURM requeue handler does, wherever the signal lands). Its items then go after these, never between a
        message and its descriptors. Raises what sending raises; what was not sent yet goes with the next call."""
        self.outbox += items
        if self.sending:
            return
        self.sending = True
        try:
            while self.outbox:
                item = self.outbox.pop(0)
                if isinstance(item, int):
                    send_handle(self.conn, item, self.process.pid)
                else:
                    self.conn.send(item)
        finally:
            self.sending = False

    def retire(self, timeout: float) -> None:
        """Wait until the process and the reader thread are gone (killing the process after ``timeout``)."""
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout)
        self.conn.close()


class WriterQueue:
    """Jobs for one background writer process (see the module docstring).

    ``on_outcome(handle, error)`` is called once per submitted handle, from the reader thread
    (or from ``submit`` when the writer cannot be reached). ``store()`` returns the
    torch.distributed Store the writer's barrier calls use (None without a process group).
    ``timeout`` bounds what a writer does once its training process is gone (``writer.process``)."""

    def __init__(self, on_outcome: Outcome, store: Callable[[], Any], *, timeout: float,
                 idle_timeout: Optional[float] = 30.0) -> None:
        self._on_outcome, self._store = on_outcome, store
        self.timeout, self.idle_timeout = timeout, idle_timeout
        self._writer: Optional[_Writer] = None
        self._held = False  # a run holds the writer: no idle stop until ``stop()``
        self._retiring: list[_Writer] = []  # stopped when idle, still exiting
        self._jobs: dict[int, SaveHandle] = {}
        self._job_ids = itertools.count()
        self._receiver: Optional[tuple[socket.socket, str, bytes]] = None  # ``serve_replicas``: listener, root, secret
        self._lock = threading.RLock()  # held while sending: two senders cannot reorder or interleave messages

    @property
    def running(self) -> bool:
        return self._writer is not None and self._writer.alive and not self._writer.stopping

    @property
    def writer_pid(self) -> Optional[int]:
        return self._writer.process.pid if self.running else None

    def start(self, hold: bool = False) -> None:
        """Start the writer process now if it is not running (it starts in the background: the
        first request queues behind its start-up); with ``hold``, keep it until ``stop()``."""
        with self._lock:
            self._held = self._held or hold
            if not self.running:
                self._writer = _Writer(self._read_replies, self.timeout)
            if self._receiver is not None and not self._writer.serving:
                listener, root, secret = self._receiver
                self._writer.send((protocol.RECEIVER, root, secret), listener.fileno())
                self._writer.serving = True

    def serve_replicas(self, listener: socket.socket, root: str, secret: bytes, *, now: bool = True) -> None:
        """Have the writer serve this node's memory root ``root`` to the other nodes that prove they hold the job's
        ``secret`` (over the writer's socket, as plain data) on ``listener`` (a listening TCP socket whose address
        the caller published: ``tier.transport``): this writer (started now if none
        runs; with ``now=False`` at its next ``start``, the peers' connections waiting in the listener's backlog
        meanwhile) and every one started later, none of which stops when idle (the other nodes' saves need it)."""
        with self._lock:
            self._receiver = (listener, root, secret)
            if now or self.running:
                self.start()

    def submit(self, items: list[tuple[SaveHandle, protocol.Request, Any]]) -> None:
        """Queue ``(handle, request, snapshot buffer or None)`` in order. A handle depending on a
        handle that already failed is cancelled here, without reaching the writer."""
        with self._lock:
            jobs, buffers = [], []
            for handle, request, buffer in items:
                after = handle.after
                if after is not None and after.done() and after.exception() is not None:
                    self._on_outcome(handle, CheckpointCancelledError(handle.cancelled_message()))
                    continue
                depends_on = None
                if after is not None and not after.done():
                    if after.job_id is None:
                        raise RuntimeError(f"asyncckpt: {handle.describe()} was queued before {after.describe()}")
                    depends_on = after.job_id
                handle.job_id = next(self._job_ids)
                self._jobs[handle.job_id] = handle
                handle.request = request
                jobs.append(protocol.Job(handle.job_id, request, buffer.id if buffer is not None else None, depends_on))
                buffers.append(buffer)
            if not jobs:
                return
            try:
                self.start()
                writer = self._writer
                messages: list[Any] = []
                for buffer in buffers:
                    if buffer is not None and buffer.id not in writer.registered:
                        messages += [(protocol.BUFFER, buffer.id, buffer.layout), buffer.fd, buffer.progress_fd]
                        writer.registered.add(buffer.id)
                writer.send(*messages, (protocol.RUN, jobs))
            except (OSError, ValueError) as e:
                self._fail_jobs([job.job_id for job in jobs], f"could not reach the background writer: {e}")

    def drop_buffer(self, buffer_id: int) -> None:
        with self._lock:
            writer = self._writer
            if writer is not None and buffer_id in writer.registered:
                writer.registered.discard(buffer_id)
                try:
                    writer.send((protocol.DROP, buffer_id))
                except OSError:
                    pass

    def stop(self, timeout: float = 10.0) -> None:
        """Let the writer finish its queue and exit; kill it if it does not in ``timeout`` s.
        Returns once its process and the reader thread are gone."""
        with self._lock:
            writer, self._writer = self._writer, None
            retiring, self._retiring = self._retiring, []
            self._held = False
            if writer is not None and not writer.stopping:
                writer.stopping = True
                try:
                    writer.send((protocol.STOP,))
                except OSError:
                    pass
        for old in retiring + ([writer] if writer is not None else []):
            old.retire(timeout)

    def _stop_if_idle(self, writer: _Writer) -> None:
        """The reader thread heard nothing for ``idle_timeout`` s: with no job in flight, stop the
        writer (under the lock, so no job can be sent to it meanwhile: the next one starts a new one)."""
        with self._lock:
            if self._writer is not writer or self._jobs or writer.stopping or self._held or writer.serving:
                return
            writer.stopping = True
            self._writer = None
            self._retiring.append(writer)
            try:
                writer.send((protocol.STOP,))
            except OSError:
                pass

    # ------------------------------------------------------------------ the reader thread
    def _read_replies(self, writer: _Writer) -> None:
        while True:
            try:
                if self.idle_timeout is not None and not writer.conn.poll(self.idle_timeout):
                    self._stop_if_idle(writer)
                    continue
                message = writer.conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == protocol.STOPPED:
                break
            if kind == protocol.BARRIER_CALL:
                self._serve_barrier_call(writer, *message[1:])
                continue
            with self._lock:
                handle = self._jobs.pop(message[1])
            if kind == protocol.FAILED and message[2] == SnapshotCopyFailed.__name__:
                continue  # the training process fails the handle with the copy's own error
            if kind == protocol.DONE:
                if len(message) > 2 and message[2]:
                    handle.add_written(**message[2])
                self._on_outcome(handle, None)
            elif kind == protocol.CANCELLED:
                self._on_outcome(handle, CheckpointCancelledError(handle.cancelled_message()))
            else:
                _, _, error_type, text, _traceback = message
                self._on_outcome(handle, _rebuilt(error_type, text))
        try:
            returncode = writer.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            returncode = None
        with self._lock:
            if writer in self._retiring:  # stopped when idle: nobody joins this thread
                self._retiring.remove(writer)
                writer.conn.close()
                return
        if not writer.stopping:
            with self._lock:
                if self._writer is writer:
                    self._writer = None
                lost = list(self._jobs)
            self._fail_jobs(lost, f"the background writer died (exit code {returncode})")

    def _serve_barrier_call(self, writer: _Writer, spec, method: str, args: tuple) -> None:
        try:
            getattr(local_barrier(spec, self._store()), method)(*args)
            error = None
        except BaseException as e:  # sent back: the writer's request raises it
            error = protocol.error_text(e)
        try:
            with self._lock:  # never between a BUFFER message and its file descriptor (``submit``)
                writer.send((protocol.BARRIER_RESULT, error))
        except OSError:
            pass  # the writer is gone; the loop sees EOF next

    def _fail_jobs(self, job_ids: list[int], cause: str) -> None:
        """Jobs the writer will never answer: fail their handles, and their saves on every rank."""
        for job_id in job_ids:
            with self._lock:
                handle = self._jobs.pop(job_id, None)
            if handle is None:
                continue
            error = CheckpointWriteError(f"rank {handle.rank}: {cause}")
            spec = getattr(handle.request, "barrier", None)
            if spec is not None:
                try:
                    local_barrier(spec, self._store()).fail(handle.rank, str(error))
                except (CheckpointError, OSError, RuntimeError):
                    pass  # the others time out instead
            self._on_outcome(handle, error)


def _rebuilt(error_type: str, text: str) -> CheckpointError:
    """A writer's failure as raised in the training process (ours name the rank already)."""
    if error_type == CheckpointTimeoutError.__name__:
        return CheckpointTimeoutError(text)
    if error_type in (CheckpointWriteError.__name__, CheckpointCancelledError.__name__):
        return CheckpointWriteError(text)
    return CheckpointWriteError(f"{error_type}: {text}")
