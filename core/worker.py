"""The persistent background writer: one process per rank, started once, fed plain data.

It is launched as ``python -m asyncckpt.core.worker`` (not multiprocessing's spawn, which would
re-import the user's ``__main__`` and re-run an unguarded training script), talks over a Unix
socket, receives staging buffers as memfd file descriptors, and runs the storage engine
(each request's ``run``: a rank's share of a sharded save, a single file, a removal) outside the training process's GIL. It dies with its parent
(PR_SET_PDEATHSIG), so a killed trainer never leaves an orphan writer behind.

It does not import torch (~190 MiB of private memory per process) unless it coordinates a sharded
save, whose DCP ``.metadata`` is made of torch's classes: the modules it runs (and the package's
``__init__``) import torch only where they need it.
"""
from __future__ import annotations

import ctypes
import gc
import mmap
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

from . import commit
from .copy_progress import PROGRESS_BYTES

_PR_SET_PDEATHSIG = 1


class Idle:
    """A request that does nothing: its reply means every earlier request, and the cleanup
    after it, is finished (``Checkpointer.wait`` ends with one)."""

    def run(self, layout, image) -> None:
        pass


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


def _after_request() -> None:
    """Work the trainer need not wait for, done once a request's outcome is reported: delete the
    checkpoints it replaced, and collect garbage. Automatic collection is off in the writer: a
    save parses and builds tens of thousands of small objects, and a full collection triggered in
    the middle of one (~0.15 s with the cached metadata of a large structure) delayed its commit.
    Freezing what survives keeps the caches out of every later collection."""
    commit.remove_replaced()
    gc.collect()
    gc.freeze()


def serve(conn: Connection) -> None:
    buffers: dict[int, tuple[object, mmap.mmap]] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        kind = message[0]
        if kind == "buffer":
            _, buffer_id, layout = message
            fd = recv_handle(conn)
            buffers[buffer_id] = (layout, mmap.mmap(fd, layout.buffer_size + PROGRESS_BYTES))  # image, then CopyProgress
            os.close(fd)
        elif kind == "drop":
            # Only drop our reference: views of the mapping may outlive a failed request (its
            # traceback), and the mapping unmaps itself once the last of them is gone.
            buffers.pop(message[1], None)
        elif kind == "run":
            for job_id, buffer_id, request in message[1]:
                layout, mapping = buffers[buffer_id] if buffer_id is not None else (None, None)
                try:
                    request.run(layout, memoryview(mapping) if mapping is not None else None)
                    conn.send(("done", job_id, None))
                except BaseException as e:  # report everything; the trainer decides what to raise
                    conn.send(("failed", job_id, f"{type(e).__name__}: {e}", traceback.format_exc()))
            _after_request()
        elif kind == "stop":
            conn.send(("stopped", None, None))
            conn.close()
            os._exit(0)  # everything is durable already; skip torch's slow interpreter teardown


def main() -> None:
    fd, parent_pid = int(sys.argv[1]), int(sys.argv[2])
    _die_with_parent(parent_pid)
    _apply_test_limits()
    gc.disable()
    serve(Connection(fd))


if __name__ == "__main__":
    main()
