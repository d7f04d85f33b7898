"""The training process's side of the background writer: start it, feed it, hear back from it."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import send_handle
from typing import Callable, Optional

from .staging import StagingBuffer


class WorkerClient:
    """One background writer process. ``on_reply(kind, job_id, error, traceback)`` is called from
    a reader thread for each finished job, and ``on_exit(returncode)`` once if the process dies."""

    def __init__(self, on_reply: Callable, on_exit: Callable[[int | None], None]) -> None:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
        env["OMP_NUM_THREADS"] = "1"  # the writer does I/O, not compute: keep torch's pools small
        self.process = subprocess.Popen(
            [sys.executable, "-m", "asyncckpt.core.worker", str(child_sock.fileno()), str(os.getpid())],
            pass_fds=[child_sock.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self._send_lock = threading.Lock()
        self._registered: set[int] = set()
        self._on_reply, self._on_exit = on_reply, on_exit
        self._stopping = False
        self._reader = threading.Thread(target=self._read_replies, name="asyncckpt-worker-replies", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self.process.poll() is None and self._reader.is_alive()

    def _read_replies(self) -> None:
        while True:
            try:
                kind, job_id, *rest = self.conn.recv()
            except (EOFError, OSError):
                break
            if kind == "stopped":
                break
            self._on_reply(kind, job_id, *rest)
        try:
            returncode = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            returncode = None
        if not self._stopping:
            self._on_exit(returncode)

    def submit(self, jobs: list[tuple[int, object, Optional[int], Optional[StagingBuffer]]]) -> None:
        """Queue ``(job_id, request, buffer_id, buffer)`` jobs: each runs ``request.run(layout, image)``;
        requests run one at a time, in submission order. One message for all of them (each message
        wakes the writer, which then competes with the caller for the CPU)."""
        with self._send_lock:
            for _job_id, _request, buffer_id, buffer in jobs:
                if buffer is not None and buffer_id not in self._registered:
                    self.conn.send(("buffer", buffer_id, buffer.layout))
                    send_handle(self.conn, buffer.fd, self.process.pid)
                    self._registered.add(buffer_id)
            self.conn.send(("run", [(job_id, buffer_id, request) for job_id, request, buffer_id, _buffer in jobs]))

    def drop_buffer(self, buffer_id: int) -> None:
        with self._send_lock:
            if buffer_id in self._registered:
                self._registered.discard(buffer_id)
                try:
                    self.conn.send(("drop", buffer_id))
                except OSError:
                    pass

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the writer to exit after its current job; kill it if it does not."""
        self._stopping = True
        try:
            with self._send_lock:
                self.conn.send(("stop",))
            self.process.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        self.conn.close()

    def kill(self) -> None:
        self._stopping = True
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
