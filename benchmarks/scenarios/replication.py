"""Replicating a rank's share to a peer node's memory, against moving the same bytes any other way.

A rank's share (``total_mib`` in ``files`` large files, in tmpfs as the memory tier holds it) goes to another
node's receiver over loopback with ``tier.transport.send`` (checksums known, as the writer has them from
writing the files; and hashed first, without them), and comes back with ``fetch`` (a restart from a peer,
checked against the record). Against: the same files written into tmpfs from held memory by one process (the
memcpy-class floor of putting these bytes into memory at all); and a raw socket transfer of the same bytes to
another process (``os.sendfile`` of the same files into one connection, no headers, one answer at the end)
whose reader discards them, or writes them into tmpfs (the floor of the same bytes landing in another
process's memory). Every arm writes fresh files each rep (its destination is emptied outside the timing);
reps in rotation in one process, the receiver and the raw reader each in a process of their own, idle while
the other arms run.
"""
from __future__ import annotations

import mmap
import os
import shutil
import socket
import struct
import tempfile
import time
from typing import Callable

from harness import Option, Scenario, report_now
from harness.report import bars, fmt, table
from harness.util import MiB, gbps, now, spread

RUN = "run-bench/.checkpoint-1.asyncckpt-staging-bench"  # where the share lies in each memory root
SECRET = b"the benchmark's job secret"  # every connection is proven with it, as a job's nodes prove theirs
PIECE = 1 << 20
ROWS = {  # row -> what it is, on the page
    "tmpfs write": "the files written into tmpfs from held memory (one process)",
    "raw → discard": "`os.sendfile` of the files into one connection; another process reads and discards",
    "raw → tmpfs": "the same; the reader writes them into tmpfs",
    "send": "`send`, checksums known (the writer's, as a save has them)",
    "send, hashed first": "`send` without checksums: each file hashed before it goes",
    "fetch": "`fetch` back into a fresh root, checked against the record (a restart from a peer)",
}


# ------------------------------------------------------------------------------------------ the servers
def receiver(root: str) -> None:
    """A node's receiver serving ``root`` until killed; reports its address once it listens."""
    from asyncckpt.core.tier.transport import Receiver

    with Receiver(root, secret=SECRET, bind="127.0.0.1") as serving:
        report_now({"address": list(serving.address)})
        while True:
            time.sleep(3600)


VERIFIED = 0x80  # in a raw transfer's mode byte: the reader hashes what arrived (xxh3, once, as it arrives)


def raw_reader(sink: str) -> None:
    """The raw floor's other process: per connection, an 8-byte length and a mode byte (0: discard, 1: into a
    fresh file under ``sink``, 2: into one of two files under ``sink`` in turn, the older replaced, as a tier's
    retention keeps memory bounded over many saves, 3: into the pages of one file under ``sink`` kept from the
    connection before, mapped at once, as the tier receives into the spares of what its retention dropped; fresh
    the first time; with ``VERIFIED``, each piece hashed once as it arrives, as a replica is verified on arrival),
    then that many bytes, read through one buffer; one byte back once all arrived."""
    from asyncckpt.core.formats.checksum import checksum_stream

    buffer = memoryview(bytearray(PIECE))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        report_now({"address": list(listener.getsockname()[:2])})
        for n in range(1 << 62):
            connection, _ = listener.accept()
            with connection:
                head = b""
                while len(head) < 9:
                    head += connection.recv(9 - len(head))
                left, mode = struct.unpack(">QB", head)
                digest, mode = (checksum_stream() if mode & VERIFIED else None), mode & ~VERIFIED
                path = os.path.join(sink, {1: f"raw-{n}", 2: f"raw-{n % 2}", 3: "raw-reused"}.get(mode, ""))
                if mode == 3 and os.path.exists(path) and os.path.getsize(path) == left > 0:
                    _receive_into_pages(connection, path, left, digest)
                    left = 0
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if mode and left else None
                while left:
                    received = connection.recv_into(buffer[:min(left, PIECE)])
                    if not received:
                        raise ConnectionError("the sender closed early")
                    if digest is not None:
                        digest.update(buffer[:received])
                    if fd is not None:
                        view = buffer[:received]
                        while view:
                            view = view[os.write(fd, view):]
                    left -= received
                if fd is not None:
                    os.close(fd)
                connection.sendall(b"k")


def _receive_into_pages(connection: socket.socket, path: str, size: int, digest=None) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE) as pages:
            view, offset = memoryview(pages), 0
            while offset < size:
                received = connection.recv_into(view[offset:min(offset + PIECE, size)])
                if not received:
                    raise ConnectionError("the sender closed early")
                if digest is not None:
                    digest.update(view[offset:offset + received])
                offset += received
            view.release()
    finally:
        os.close(fd)


def started(sitting, function: str, **kwargs):
    """A server child, once it listens: (the child, its address)."""
    child = sitting.spawn(function, **kwargs)
    deadline = time.monotonic() + 120
    while child.report() is None:
        if child.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{function} did not start: {child.log_tail()}")
        time.sleep(0.05)
    return child, tuple(child.report()["address"])


# ------------------------------------------------------------------------------------------ the measurement
def emptied(*directories: str) -> None:
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory)


def transfers(receiver_address: list, reader_address: list, memory_dir: str, sink: str, received: str,
              total_mib: int, files: int, reps: int) -> dict:
    """Every row's seconds, ``reps`` times in rotation (rep 0 warms, dropped)."""
    from asyncckpt.core.formats.checksum import FileChecksum, checksum
    from asyncckpt.core.tier.transport import fetch, send

    total = total_mib * MiB
    sizes = [total // files + (1 if i < total % files else 0) for i in range(files)]
    paths = [f"{RUN}/share-{i}.bin" for i in range(files)]
    source, fetched, floor = (tempfile.mkdtemp(prefix=prefix, dir=memory_dir) for prefix in ("source_", "fetched_", "floor_"))
    held = [os.urandom(size) for size in sizes]  # incompressible, like tensor data
    for path, data in zip(paths, held):
        os.makedirs(os.path.dirname(os.path.join(source, path)), exist_ok=True)
        with open(os.path.join(source, path), "wb") as f:
            f.write(data)
    record = {path: FileChecksum(len(data), checksum(data)) for path, data in zip(paths, held)}
    peer, reader = tuple(receiver_address), tuple(reader_address)

    def tmpfs_write() -> None:
        for i, data in enumerate(held):
            fd = os.open(os.path.join(floor, f"share-{i}.bin"), os.O_WRONLY | os.O_CREAT, 0o644)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.close(fd)

    def raw(into_tmpfs: bool) -> None:
        with socket.create_connection(reader) as connection:
            connection.sendall(struct.pack(">QB", total, into_tmpfs))
            for path in paths:
                with open(os.path.join(source, path), "rb") as f:
                    connection.sendfile(f)
            if connection.recv(1) != b"k":
                raise ConnectionError("the raw reader did not take every byte")

    def replicated(outcomes) -> None:
        if not all(t.ok for t in outcomes):
            raise RuntimeError(f"a transfer failed: {outcomes}")

    rows: dict[str, tuple[Callable[[], None], tuple[str, ...]]] = {  # what runs, what is emptied before
        "tmpfs write": (tmpfs_write, (floor,)),
        "raw → discard": (lambda: raw(False), ()),
        "raw → tmpfs": (lambda: raw(True), (sink,)),
        "send": (lambda: replicated(send(peer, source, paths, secret=SECRET, timeout=60, checksums=record)), (received,)),
        "send, hashed first": (lambda: replicated(send(peer, source, paths, secret=SECRET, timeout=60)), (received,)),
        "fetch": (lambda: replicated(fetch(peer, fetched, paths, secret=SECRET, timeout=60, checksums=record)), (fetched,)),
    }
    times: dict[str, list[float]] = {row: [] for row in rows}
    try:
        for rep in range(reps + 1):
            for row, (call, destinations) in rows.items():
                emptied(*destinations)
                if row == "fetch":  # the peer holds the share: the last send's
                    replicated(send(peer, source, paths, secret=SECRET, timeout=60, checksums=record))
                t0 = now()
                call()
                seconds = now() - t0
                if rep:
                    times[row].append(seconds)
    finally:
        for directory in (source, fetched, floor):
            shutil.rmtree(directory, ignore_errors=True)
    return {"bytes": total, "files": files, "rows": {row: spread(values) for row, values in times.items()}}


def measure(sitting) -> dict:
    o = sitting.o
    memory_dir = tempfile.mkdtemp(prefix="bench_replication_", dir=o.memory_dir)
    received, sink = os.path.join(memory_dir, "node-b"), os.path.join(memory_dir, "raw")
    emptied(received, sink)
    servers = []
    try:
        serving, receiver_address = started(sitting, "receiver", root=received)
        servers.append(serving)
        reading, reader_address = started(sitting, "raw_reader", sink=sink)
        servers.append(reading)
        with sitting.phase("transfers"):
            return sitting.child("transfers", receiver_address=receiver_address, reader_address=reader_address,
                                 memory_dir=memory_dir, sink=sink, received=os.path.join(received, "run-bench"),
                                 total_mib=o.total_mib, files=o.files, reps=o.reps)
    finally:
        for server in servers:
            server.process.kill()
            server.process.wait(60)
        shutil.rmtree(memory_dir, ignore_errors=True)


def render(result: dict) -> str:
    f = result["figures"]
    rows = f["rows"]
    floor = rows["raw → tmpfs"]["median"]
    lines = [f"{f['bytes'] / MiB:.0f} MiB in {f['files']} files, tmpfs to tmpfs over loopback; {result['options']['reps']} "
             "reps of every row in rotation in one process, milliseconds, median (min–max); `x raw` = the row's median / "
             "the raw transfer into tmpfs.", ""]
    lines += table(["row", "what", "ms", "GB/s", "x raw"],
                   [[row, ROWS[row], f"{1e3 * r['median']:.1f} ({1e3 * r['min']:.1f}–{1e3 * r['max']:.1f})",
                     fmt(gbps(f["bytes"], r["median"]), ".2f"), fmt(r["median"] / floor, ".2f")] for row, r in rows.items()])
    return "\n".join(lines)


def plot(result: dict, figure) -> None:
    rows = result["figures"]["rows"]
    bars(figure.subplots(), list(rows), [1e3 * r["median"] for r in rows.values()], "ms (median)",
         reference=1e3 * rows["raw → tmpfs"]["median"], reference_label="raw → tmpfs")


SCENARIO = Scenario(
    title="Replication: a rank's share to a peer's memory, against a raw socket transfer",
    question=__doc__.split("\n\n", 1)[1].strip().replace("\n", " "),
    measure=measure, render=render, plot=plot,
    options={"total_mib": Option(1024, 32, "the share's size"), "files": Option(4, 4, "how many files it is in"),
             "memory_dir": Option("/dev/shm", None, "the tmpfs the memory roots are made in")},
    reps=(7, 1),
)
