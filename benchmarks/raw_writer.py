"""The floor of background checkpointing on this machine: another process writes the same bytes.

A stand-in for a perfect asynchronous checkpointer, to measure what a background checkpoint costs
training however well it is built: the training process only sends a message, and a separate process
writes ``nbytes`` from memory it holds (touched once, then reused) durably, with O_DIRECT and fsync,
2 threads of 32 MiB requests (core_bench's section-1 method), then deletes the file it wrote ``keep``
writes earlier, as checkpoint rotation does. Nothing else: no snapshot, no checksums, no metadata, no
commit. What training loses while it runs is what the disk I/O itself costs on 2 shared cores (the
kernel's and the hypervisor's share of a virtio write); a checkpointer cannot go below it.
"""
from __future__ import annotations

import mmap
import multiprocessing
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

CHUNK = 32 << 20
ALIGN = 4096


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def write_file(path: str, buf: memoryview, *, direct: bool, threads: int) -> dict:
    """Write ``buf`` to ``path`` in ``CHUNK`` requests on ``threads`` threads, then fsync: the machine's
    write limit in core_bench (section 1 and each paired rep) and each write of ``RawWriter``.
    Returns seconds (``s``, to durable; ``write_returned_s``, before the fsync) and GB/s."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        t0 = time.perf_counter()
        spans = [(start, min(start + CHUNK, len(buf))) for start in range(0, len(buf), CHUNK)]
        if threads <= 1:
            for start, end in spans:
                _pwrite_all(fd, buf[start:end], start)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda span: _pwrite_all(fd, buf[span[0]:span[1]], span[0]), spans))
        t1 = time.perf_counter()
        os.fsync(fd)
        t2 = time.perf_counter()
    finally:
        os.close(fd)
    return {"s": t2 - t0, "write_returned_s": t1 - t0, "gbps": len(buf) / (t2 - t0) / 1e9}


def _serve(conn, nbytes: int, directory: str, keep: int) -> None:
    size = -(-nbytes // ALIGN) * ALIGN
    held = mmap.mmap(-1, size)
    pattern = os.urandom(1 << 20)  # incompressible, like tensor data
    for offset in range(0, size, len(pattern)):
        held[offset:offset + len(pattern)] = pattern[:size - offset]
    view = memoryview(held)
    written: list[str] = []
    conn.send("ready")
    while (message := conn.recv()) is not None:
        path = os.path.join(directory, f"raw_write_{message}.bin")
        seconds = write_file(path, view, direct=True, threads=2)["s"]
        written.append(path)
        while len(written) > keep:
            os.unlink(written.pop(0))
        conn.send(seconds)
    for path in written:
        os.unlink(path)
    conn.send("stopped")


class RawWriter:
    """A writer process holding ``nbytes`` of its own; ``start()`` begins a durable write of them
    (after the previous one finished: one in flight, as ``max_in_flight=1``), ``wait()`` returns its
    seconds."""

    def __init__(self, nbytes: int, directory: str, keep: int = 2) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self._process = context.Process(target=_serve, args=(child_end, nbytes, directory, keep), daemon=True)
        self._process.start()
        child_end.close()
        assert self._conn.recv() == "ready"
        self._count = 0
        self._pending = False
        self.seconds: list[float] = []

    def start(self) -> None:
        self.wait()
        self._count += 1
        self._conn.send(self._count)
        self._pending = True

    def done(self) -> bool:
        """Whether the last write finished (without waiting)."""
        return not self._pending or self._conn.poll()

    def wait(self) -> Optional[float]:
        if not self._pending:
            return None
        self._pending = False
        self.seconds.append(self._conn.recv())
        return self.seconds[-1]

    def close(self) -> None:
        self.wait()
        self._conn.send(None)
        self._conn.recv()
        self._process.join(10)
