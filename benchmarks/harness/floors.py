"""What a checkpointer is measured against: what the machine itself does with the same bytes.

- a memcpy into held memory: the floor of a snapshot's stall (``PairedMemcpy``, ``HeldMemcpy``);
- a durable O_DIRECT write from held memory: the floor of a save's time to durable (``write_file``,
  ``PairedODirect``);
- another process writing the same bytes durably while training runs (``RawWriter``): the floor of what
  background checkpointing costs training however well it is built;
- a read from the page cache into held memory: the floor of a load (``read_files``).

Memory this VM handed back to its host costs ~3 s/GiB to touch again, so every buffer here is allocated
and touched once, then reused. The machine's copy and disk speeds also drift within minutes: a
``Paired*`` floor is timed right before each rep it judges.
"""
from __future__ import annotations

import contextlib
import mmap
import multiprocessing
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from .util import gbps, now

CHUNK = 32 << 20  # the request size of every raw write and read
ALIGN = 4096


class AlignedBuffer:
    """Anonymous page-aligned memory, touched once and held (for O_DIRECT and for reads)."""

    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, max(-(-nbytes // ALIGN) * ALIGN, ALIGN))
        self.view = memoryview(self.map)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.tensor.fill_(1)

    def close(self) -> None:
        del self.tensor
        self.view.release()
        self.map.close()


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def write_file(path: str, buf: memoryview, *, direct: bool, threads: int) -> dict:
    """Write ``buf`` to ``path`` in 32 MiB requests on ``threads`` threads, then fsync. Returns seconds to
    durable (``s``), before the fsync (``write_returned_s``), and GB/s."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
    try:
        t0 = now()
        spans = [(start, min(start + CHUNK, len(buf))) for start in range(0, len(buf), CHUNK)]
        if threads <= 1:
            for start, end in spans:
                _pwrite_all(fd, buf[start:end], start)
        else:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda span: _pwrite_all(fd, buf[span[0]:span[1]], span[0]), spans))
        t1 = now()
        os.fsync(fd)
        t2 = now()
    finally:
        os.close(fd)
    return {"s": t2 - t0, "write_returned_s": t1 - t0, "gbps": gbps(len(buf), t2 - t0)}


def read_files(paths: list[str], buf: memoryview) -> dict:
    """Read the files one after another into ``buf``, 32 MiB per ``preadv`` (from the page cache: the
    limit a load is compared with). A buffer smaller than the files is filled again from its start."""
    total, cursor, t0 = 0, 0, now()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while True:
                cursor = 0 if cursor >= len(buf) else cursor
                n = os.preadv(fd, [buf[cursor:cursor + CHUNK]], offset)
                if n == 0:
                    break
                offset, cursor = offset + n, cursor + n
            total += offset
        finally:
            os.close(fd)
    seconds = now() - t0
    return {"s": seconds, "gbps": gbps(total, seconds), "bytes": total}


class PairedMemcpy:
    """A held memcpy of ``nbytes`` (one ``dst.copy_(src)``, torch's threads), timed right before each rep
    it judges: the stall's floor of that moment."""

    def __init__(self, nbytes: int) -> None:
        self.src = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
        self.dst = torch.zeros_like(self.src)
        self()

    def __call__(self) -> float:
        t0 = now()
        self.dst.copy_(self.src)
        return now() - t0


class PairedODirect:
    """A durable O_DIRECT write of ``nbytes`` from held memory into ``directory``, timed right before
    each rep it judges: the disk of that moment."""

    def __init__(self, nbytes: int, directory: str, threads: int = 2) -> None:
        self.buffer = AlignedBuffer(nbytes)
        self.buffer.tensor.view(torch.float32).uniform_()  # incompressible, like tensor data
        self.path, self.threads = os.path.join(directory, f"paired_odirect_{os.getpid()}.bin"), threads

    def __call__(self) -> float:
        seconds = write_file(self.path, self.buffer.view, direct=True, threads=self.threads)["s"]
        os.unlink(self.path)
        return seconds

    def close(self) -> None:
        self.buffer.close()


def checkpoint_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors a framework's checkpoint of ``model`` and ``optimizer`` holds: weights and optimizer state."""
    return list(model.state_dict().values()) + [
        v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


class HeldMemcpy:
    """Copies tensors one by one into a buffer allocated and touched at the first call, then kept: a
    training run's stall floor, timed in its process right before each save."""

    def __init__(self) -> None:
        self.held: Optional[torch.Tensor] = None

    def __call__(self, sources: list[torch.Tensor]) -> tuple[float, int, int]:
        """(seconds, bytes, tensors) of one copy of ``sources`` into the held buffer."""
        nbytes = sum(t.numel() * t.element_size() for t in sources)
        if self.held is None or self.held.numel() < nbytes:
            self.held = torch.empty(nbytes, dtype=torch.uint8)
            self.held.zero_()
        t0, offset = now(), 0
        for t in sources:
            n = t.numel() * t.element_size()
            self.held[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
            offset += n
        return now() - t0, nbytes, len(sources)


def _serve(conn, nbytes: int, directory: str, keep: int) -> None:
    held = AlignedBuffer(nbytes)
    pattern = os.urandom(1 << 20)  # incompressible, like tensor data
    for offset in range(0, len(held.map), len(pattern)):
        held.map[offset:offset + len(pattern)] = pattern[:len(held.map) - offset]
    written: list[str] = []
    conn.send("ready")
    while (message := conn.recv()) is not None:
        path = os.path.join(directory, f"raw_write_{os.getpid()}_{message}.bin")
        seconds = write_file(path, held.view, direct=True, threads=2)["s"]
        written.append(path)
        while len(written) > keep:
            os.unlink(written.pop(0))
        conn.send(seconds)
    for path in written:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    conn.send("stopped")


class RawWriter:
    """The floor of background checkpointing: a stand-in for a perfect asynchronous checkpointer.

    A separate process holds ``nbytes`` of its own (touched once); ``start()`` makes it write them
    durably (O_DIRECT, fsync, 2 threads of 32 MiB requests) after the previous write finished (one in
    flight), deleting the file of ``keep`` writes earlier, as rotation does. No snapshot, no checksums,
    no metadata, no commit: what training loses while it runs is what the disk I/O itself costs on
    these cores (the kernel's and the hypervisor's share of a virtio write)."""

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


def per_tensor_copy(state: dict, reps: int) -> list[float]:
    """Seconds of copying ``state``'s tensors one by one into held clones of them: the floor of a snapshot of
    many tensors, which one contiguous memcpy does not show."""
    from .workloads import flat_tensors

    sources = list(flat_tensors(state).values())
    held = [torch.zeros_like(t) for t in sources]

    def once() -> float:
        t0 = now()
        for dst, src in zip(held, sources):
            dst.copy_(src)
        return now() - t0

    once()  # warm
    return [once() for _ in range(reps)]
