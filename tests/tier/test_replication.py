"""Replicating memory-tier files between nodes (``tier.transport``): real receiver processes, real sockets.

Each simulated node is a receiver process of its own (``replication_node.py``) serving its own memory root
(``ASYNCCKPT_MEMORY_ROOT`` under ``tmp_path``) on a loopback address, or in a network namespace of its own
reached over a veth pair where this machine lets the test make one. The test process sends and fetches as
another node's writer would. Peers that fail are made to fail for real: SIGSTOP (a hung host), SIGKILL (a
dead one), a link taken down.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import pytest

from asyncckpt.core.errors import SnapshotCopyFailed
from asyncckpt.core.formats.checksum import FileChecksum, checksum
from asyncckpt.core.storage import spares
from asyncckpt.core.tier.transport import (
    ADDRESS_ENV,
    SECRET_ENV,
    PeerConnection,
    Receiver,
    ReplicationError,
    Streaming,
    fetch,
    job_secret,
    parse_address,
    peer_address,
    peers_for,
    publish_address,
    send,
)
from processes import Program

NODE_PROGRAM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", "replication_node.py")
CHECKPOINT = "run-abc/.checkpoint-20.asyncckpt-staging-s1"  # where a save's files lie in a memory root
MARGIN_S = 10.0  # beyond a peer's timeout, what a failing call may take on a loaded machine: bounded, not exact
JOB_SECRET = f"test-job-{os.getpid()}-{os.urandom(16).hex()}"  # the launcher's (``ASYNCCKPT_REPLICATION_SECRET``)
SECRET = JOB_SECRET.encode()


class Node:
    """A receiver process serving ``root``; ``address`` is where it listens."""

    def __init__(self, root: Path, logs: Path, argv_prefix: tuple[str, ...] = (), bind: str = "",
                 public: Optional[str] = "127.0.0.1", secret: str = JOB_SECRET) -> None:
        self.root = root
        env = {**os.environ, "ASYNCCKPT_MEMORY_ROOT": str(root), SECRET_ENV: secret}
        env.pop("ASYNCCKPT_REPLICATION_ADDRESS", None)
        if public is not None:
            env["ASYNCCKPT_REPLICATION_ADDRESS"] = public
        self.program = Program([*argv_prefix, sys.executable, NODE_PROGRAM, *([bind] if bind else [])], logs, env=env)
        host, port = self.program.next_line(60).split()
        self.address = (host, int(port))

    def signal(self, number: int) -> None:
        self.program.send_signal(number)

    def stop(self) -> None:
        if self.program.poll() is None:
            self.program.send_signal(signal.SIGKILL)
        self.program.wait(30)


@pytest.fixture
def start_node(tmp_path):
    """``start_node(name, **Node options)``: a node with its memory root ``tmp_path/name``; every one is killed
    at the end of the test."""
    started: list[Node] = []

    def start(name: str, **options) -> Node:
        node = Node(tmp_path / name, tmp_path / "logs", **options)
        started.append(node)
        return node
    yield start
    for node in started:
        node.stop()


def files_under(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (hidden ones too), by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()} if root.exists() else {}


def hidden_leftovers(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in root.rglob("*") if ".asyncckpt-tmp-" in p.name] if root.exists() else []


def a_checkpoint(root: Path) -> dict[str, bytes]:
    """A rank's share as a save leaves it in memory: a large file, small ones, an empty one, a nested one."""
    files = {f"{CHECKPOINT}/model.safetensors": os.urandom(64 << 20), f"{CHECKPOINT}/optimizer.bin": os.urandom(1 << 20),
             f"{CHECKPOINT}/config.json": b'{"step": 20}', f"{CHECKPOINT}/empty.txt": b"",
             f"{CHECKPOINT}/scheduler/state.json": os.urandom(3000)}
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    return files


def many_large_files(root: Path, count: int) -> list[str]:
    """``count`` names of one 64 MiB file (hard links: no more disk): a send of all of them outlasts any
    scheduling gap between the moment its first file lands and a signal to the receiver."""
    first = root / CHECKPOINT / "big-0.bin"
    first.parent.mkdir(parents=True, exist_ok=True)
    first.write_bytes(os.urandom(64 << 20))
    for n in range(1, count):
        os.link(first, first.with_name(f"big-{n}.bin"))
    return [f"{CHECKPOINT}/big-{n}.bin" for n in range(count)]


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.002)


class Background:
    """A call on a thread: ``result()`` its value, or the exception it raised, and when it ended."""

    def __init__(self, call) -> None:
        self.value, self.error, self.ended = None, None, None
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call) -> None:
        try:
            self.value = call()
        except BaseException as e:
            self.error = e
        self.ended = time.monotonic()

    def result(self, timeout: float):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the call did not end within {timeout} s"
        return self.error if self.error is not None else self.value


# --------------------------------------------------------------------------------------- what arrives
def test_files_arrive_whole_under_their_names_on_several_peers_and_come_back(tmp_path, start_node):
    source = tmp_path / "source"
    files = a_checkpoint(source)
    small = [path for path, data in files.items() if len(data) < (1 << 20)]
    a, b = start_node("node-a"), start_node("node-b")
    with ThreadPoolExecutor(3) as pool:  # two peers at once, and one of them from two senders at once
        sends = [pool.submit(send, a.address, str(source), list(files), secret=SECRET, timeout=30),
                 pool.submit(send, b.address, str(source), list(files), secret=SECRET, timeout=30),
                 pool.submit(send, a.address, str(source), small, secret=SECRET, timeout=30)]
        outcomes = [s.result() for s in sends]
    assert [[(t.path, t.error) for t in o] for o in outcomes] == [[(p, None) for p in files]] * 2 + [[(p, None) for p in small]]
    assert files_under(a.root) == files and files_under(b.root) == files  # byte for byte, and nothing else

    restored = tmp_path / "replaced-node"  # a node that replaced a lost one fetches what it lacks
    record = {path: FileChecksum(len(data), checksum(data)) for path, data in files.items()}
    assert all(t.ok for t in fetch(a.address, str(restored), list(files)[:2], secret=SECRET, timeout=30))
    assert all(t.ok for t in fetch(b.address, str(restored), list(files)[2:], secret=SECRET, timeout=30, checksums=record))
    assert files_under(restored) == files

    missing = f"{CHECKPOINT}/not-there.bin"
    [outcome] = fetch(a.address, str(restored), [missing], secret=SECRET, timeout=30)
    assert not outcome.ok and missing in outcome.error and not (restored / missing).exists()


def test_a_file_still_being_written_arrives_whole_and_only_with_the_checksum_sent_after_it(tmp_path, start_node):
    """A file sent while it is written (``Streaming``: a snapshot being copied into a memory-tier file) goes part by
    part as each is there, its xxh3 after its bytes: the peer publishes it only if that xxh3 matches what arrived,
    and keeps nothing of one whose writing failed half-way (the copy failed: the sender raises that)."""
    payload, part = os.urandom(24 << 20), 4 << 20
    a = start_node("node-a")

    def streamed(name: str, checksum_of, fail_at: Optional[int] = None):
        path = tmp_path / "source" / CHECKPOINT / name
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:
            f.truncate(len(payload))
        there, changed = [0], threading.Condition()

        def write() -> None:
            with open(path, "r+b") as f:
                for start in range(0, len(payload), part):
                    if fail_at is not None and start >= fail_at:
                        there[0] = -1
                    else:
                        f.seek(start)
                        f.write(payload[start:start + part])
                        f.flush()
                        there[0] = start + part
                    with changed:
                        changed.notify_all()
                    if there[0] < 0:
                        return
                    time.sleep(0.02)

        def ready(done: float) -> float:
            with changed:
                assert changed.wait_for(lambda: there[0] > done or there[0] < 0, timeout=30)
            if there[0] < 0:
                raise SnapshotCopyFailed("the snapshot copy failed in the training process")
            return float("inf") if there[0] == len(payload) else there[0]

        writer = threading.Thread(target=write)
        writer.start()
        fd = os.open(path, os.O_RDONLY)
        try:
            with PeerConnection(a.address, secret=SECRET, timeout=30) as peer:
                return peer.put(f"{CHECKPOINT}/{name}", fd, Streaming(len(payload), ready, lambda: checksum_of(payload)))
        finally:
            os.close(fd)
            writer.join()

    assert streamed("whole.bin", checksum) is None
    assert (a.root / CHECKPOINT / "whole.bin").read_bytes() == payload
    refused = streamed("damaged.bin", lambda data: checksum(data + b"!"))
    assert "damaged.bin" in refused and "damaged" in refused and not (a.root / CHECKPOINT / "damaged.bin").exists()
    with pytest.raises(SnapshotCopyFailed):
        streamed("failed.bin", checksum, fail_at=12 << 20)
    wait_until(lambda: hidden_leftovers(a.root) == [], 30, "the peer kept what it had of the failed file")
    assert not (a.root / CHECKPOINT / "failed.bin").exists()


def test_a_file_damaged_since_its_checksum_was_recorded_is_refused_by_the_peer(tmp_path, start_node):
    source = tmp_path / "source"
    files = a_checkpoint(source)
    record = {path: FileChecksum(len(data), checksum(data)) for path, data in files.items()}
    damaged = f"{CHECKPOINT}/model.safetensors"
    with open(source / damaged, "r+b") as f:  # one bit flipped in memory after the writer recorded the checksum
        f.seek(12345)
        byte = f.read(1)[0]
        f.seek(12345)
        f.write(bytes([byte ^ 1]))
    a = start_node("node-a")
    outcomes = send(a.address, str(source), list(files), secret=SECRET, timeout=30, checksums=record)
    assert {t.path: t.ok for t in outcomes} == {path: path != damaged for path in files}  # the others still went
    [refused] = [t for t in outcomes if not t.ok]
    assert damaged in refused.error and "damaged" in refused.error
    assert not (a.root / damaged).exists() and hidden_leftovers(a.root) == []

    grown = f"{CHECKPOINT}/config.json"  # a file whose size no longer matches its record is not even sent
    [outcome] = send(a.address, str(source), [grown], secret=SECRET, timeout=30,
                     checksums={grown: FileChecksum(record[grown].size + 1, record[grown].xxh3)})
    assert not outcome.ok and grown in outcome.error


def test_a_file_arrives_in_the_pages_of_a_spare_its_node_kept_and_a_damaged_one_is_not_kept(tmp_path, start_node):
    """A node whose run directory holds spares (what its retention dropped) receives a file of their size into the
    smallest one large enough (cut to the file's size), byte for byte; a damaged transfer received into a spare is
    refused like any other, and leaves nothing."""
    source = tmp_path / "source"
    files = a_checkpoint(source)
    big = f"{CHECKPOINT}/model.safetensors"
    record = {path: FileChecksum(len(data), checksum(data)) for path, data in files.items()}
    a = start_node("node-a")
    run = a.root / os.path.dirname(CHECKPOINT)
    dropped = run / "checkpoint-10"
    dropped.mkdir(parents=True)
    for name, size in (("larger.bin", 80 << 20), ("fits.bin", (64 << 20) + 4096), ("small.bin", 1 << 20)):
        (dropped / name).write_bytes(os.urandom(size))
    fits = os.stat(dropped / "fits.bin").st_ino
    spares.recycle([str(dropped)], str(run), "test")
    assert len(os.listdir(run / spares.SPARES_DIR)) == 2 and not dropped.exists()  # the small file freed

    assert all(t.ok for t in send(a.address, str(source), list(files), secret=SECRET, timeout=30, checksums=record))
    assert files_under(a.root / CHECKPOINT) == {os.path.relpath(p, CHECKPOINT): d for p, d in files.items()}
    assert os.stat(a.root / big).st_ino == fits  # the smallest spare large enough, cut to size
    assert len(os.listdir(run / spares.SPARES_DIR)) == 1

    damaged = dict(record, **{big: FileChecksum(record[big].size, "0" * 16)})
    (a.root / big).unlink()
    [outcome] = send(a.address, str(source), [big], secret=SECRET, timeout=30, checksums=damaged)
    assert not outcome.ok and "damaged" in outcome.error
    assert not (a.root / big).exists() and hidden_leftovers(a.root) == []
    assert os.listdir(run / spares.SPARES_DIR) == []  # the spare it went into went with it


def test_a_replica_damaged_at_rest_is_never_kept_by_the_node_that_fetches_it(tmp_path, start_node):
    source = tmp_path / "source"
    files = a_checkpoint(source)
    record = {path: FileChecksum(len(data), checksum(data)) for path, data in files.items()}
    a = start_node("node-a")
    assert all(t.ok for t in send(a.address, str(source), list(files), secret=SECRET, timeout=30))
    replica = a.root / f"{CHECKPOINT}/optimizer.bin"
    replica.write_bytes(b"\0" + replica.read_bytes()[1:])

    restored = tmp_path / "replaced-node"
    outcomes = fetch(a.address, str(restored), list(files), secret=SECRET, timeout=30, checksums=record)
    assert {t.path: t.ok for t in outcomes} == {path: not path.endswith("optimizer.bin") for path in files}
    [refused] = [t for t in outcomes if not t.ok]
    assert "optimizer.bin" in refused.error and "damaged" in refused.error
    assert not (restored / f"{CHECKPOINT}/optimizer.bin").exists() and hidden_leftovers(restored) == []


def test_a_single_file_checkpoint_moves_with_its_checksum_and_time_and_its_copies_follow_it(tmp_path, start_node,
                                                                                              caplog):
    """A single-file checkpoint (Lightning's ``.ckpt``: no commit record) is the file, whichever node holds it: its
    copies carry its checksum and modification time (a framework picks its newest file by that time), into a run
    directory the peer's ranks made (never one nothing there would remove); a copy damaged at rest is named and the
    next holder's used; the original's retention removes the peers' copies."""
    from asyncckpt.core.storage.file_checksums import read_record
    from asyncckpt.core.storage.local import attach_checksum
    from asyncckpt.core.tier.nodes import NodeMap, fetch_file

    source, name = tmp_path / "source", "run-abc/last.ckpt"
    (source / "run-abc").mkdir(parents=True)
    data = os.urandom(3 << 20)
    (source / name).write_bytes(data)
    recorded = FileChecksum(len(data), checksum(data))
    attach_checksum(str(source / name), recorded)
    os.utime(source / name, ns=(1_700_000_000_123_456_789,) * 2)
    a, b = start_node("node-a"), start_node("node-b")
    with PeerConnection(a.address, secret=SECRET, timeout=30) as peer, open(source / name, "rb") as f:  # no run directory there
        assert "run-abc/last.ckpt: cannot be written here" in peer.put(name, f.fileno(), recorded, as_file=True)
    assert files_under(a.root) == {}
    for node in (a, b):
        (node.root / "run-abc").mkdir(parents=True)  # its ranks expect the run's files
        with PeerConnection(node.address, secret=SECRET, timeout=30) as peer, open(source / name, "rb") as f:
            assert peer.put(name, f.fileno(), recorded, as_file=True) is None
        assert (node.root / name).read_bytes() == data and read_record(str(node.root / name)) == recorded
        assert os.stat(node.root / name).st_mtime_ns == 1_700_000_000_123_456_789
    (a.root / name).write_bytes(b"\0" + data[1:])  # node a's copy damaged at rest

    replaced = tmp_path / "replaced-node"
    (replaced / "run-abc").mkdir(parents=True)  # its restart opened the run (tiers.assemble)
    nodes = NodeMap(str(replaced), "node-c", (("node-a", f"{a.address[0]}:{a.address[1]}"),
                                              ("node-b", f"{b.address[0]}:{b.address[1]}")), 30.0, SECRET)
    with caplog.at_level("WARNING", logger="asyncckpt"):
        assert fetch_file(nodes, str(replaced / name), recorded, ["node-a", "node-b"])
    assert "run-abc/last.ckpt on node node-a" in caplog.text and "damaged" in caplog.text
    assert (replaced / name).read_bytes() == data and read_record(str(replaced / name)) == recorded
    assert os.stat(replaced / name).st_mtime_ns == 1_700_000_000_123_456_789
    assert hidden_leftovers(replaced) == []

    with PeerConnection(b.address, secret=SECRET, timeout=30) as peer:
        assert peer.remove(name) is None and peer.remove(name) is None  # gone already: done
        assert "not a file" in peer.remove("run-abc")
    assert not (b.root / name).exists() and (b.root / "run-abc").is_dir()


def test_a_path_leaving_the_memory_root_is_refused_on_both_sides(tmp_path, start_node):
    source = tmp_path / "source"
    files = a_checkpoint(source)
    a = start_node("node-a")
    for escaping in ("../outside.bin", "/etc/passwd", f"{CHECKPOINT}/../../../outside.bin"):
        with pytest.raises(ValueError, match="refused"):
            send(a.address, str(source), [escaping], secret=SECRET, timeout=30)
        with pytest.raises(ValueError, match="refused"):
            fetch(a.address, str(tmp_path / "fetched"), [escaping], secret=SECRET, timeout=30)

    (tmp_path / "elsewhere").mkdir()
    (a.root / "run-abc").mkdir(parents=True)
    os.symlink(tmp_path / "elsewhere", a.root / "run-abc" / "link")  # a directory in the root that leads out of it
    path = f"{CHECKPOINT}/config.json"
    data = files[path]
    fd = os.open(source / path, os.O_RDONLY)
    try:  # a peer that does not check its paths, as the receiver sees it: the lower-level connection
        with PeerConnection(a.address, secret=SECRET, timeout=30) as peer:
            for escaping in ("../outside.bin", "/tmp/outside.bin", "run-abc/link/inside.bin"):
                error = peer.put(escaping, fd, FileChecksum(len(data), checksum(data)))
                assert error is not None and repr(escaping) in error
            error = peer.get("../node-a/../source/" + path, str(tmp_path / "fetched"))
            assert error is not None and "refused" in error
            assert peer.put(path, fd, FileChecksum(len(data), checksum(data))) is None  # the connection goes on
    finally:
        os.close(fd)
    assert os.listdir(tmp_path / "elsewhere") == [] and not (tmp_path / "outside.bin").exists()
    assert files_under(a.root) == {path: data}


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs (a node whose memory is nearly full), unmounted at the end; skipped where mounting is refused."""
    directory = tmp_path / "small-node"
    directory.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(directory)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"this machine refuses to mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=True)


def test_a_file_the_peer_has_no_room_for_is_refused_named_and_leaves_nothing(tmp_path, small_tmpfs, start_node):
    source = tmp_path / "source"
    files = a_checkpoint(source)
    a = start_node("small-node/root")
    outcomes = send(a.address, str(source), list(files), secret=SECRET, timeout=30)
    too_large = {path for path, data in files.items() if len(data) > (4 << 20)}
    assert {t.path for t in outcomes if not t.ok} == too_large
    assert all("No space left" in t.error and t.path in t.error for t in outcomes if not t.ok)
    assert files_under(a.root) == {path: data for path, data in files.items() if path not in too_large}


# --------------------------------------------------------------------------------------- failing peers
def test_a_stopped_peer_fails_the_send_within_its_timeout(tmp_path, start_node):
    source = tmp_path / "source"
    a_checkpoint(source)
    large = many_large_files(source, 16)
    a = start_node("node-a")

    a.signal(signal.SIGSTOP)  # hung before the send: it never answers
    started = time.monotonic()
    with pytest.raises(ReplicationError) as stopped:
        send(a.address, str(source), [f"{CHECKPOINT}/config.json"], secret=SECRET, timeout=2)
    assert time.monotonic() - started < 2 + MARGIN_S
    assert f"{a.address[0]}:{a.address[1]}" in str(stopped.value) and stopped.value.file == f"{CHECKPOINT}/config.json"
    a.signal(signal.SIGCONT)

    sending = Background(lambda: send(a.address, str(source), large, secret=SECRET, timeout=2))
    wait_until(lambda: (a.root / large[0]).exists(), 60, "the first file never arrived")
    a.signal(signal.SIGSTOP)  # hung in the middle of the send
    stopped_at = time.monotonic()
    error = sending.result(2 + MARGIN_S + 5)
    assert isinstance(error, ReplicationError), error
    assert sending.ended - stopped_at < 2 + MARGIN_S
    assert error.file in large and f"{a.address[0]}:{a.address[1]}" in str(error) and error.file in str(error)
    assert all(t.ok for t in error.finished)

    a.signal(signal.SIGCONT)  # it wakes, finds the sender gone, and drops what it was receiving
    wait_until(lambda: hidden_leftovers(a.root) == [], 30, f"left {hidden_leftovers(a.root)}")
    for path, data in files_under(a.root).items():
        assert data == (source / path).read_bytes(), f"{path} is under its name but not whole"
    assert all(t.ok for t in send(a.address, str(source), [f"{CHECKPOINT}/config.json"], secret=SECRET, timeout=30))  # still serving


def test_a_dead_peer_fails_the_send_at_once(tmp_path, start_node):
    source = tmp_path / "source"
    large = many_large_files(source, 16)
    a = start_node("node-a")
    sending = Background(lambda: send(a.address, str(source), large, secret=SECRET, timeout=60))
    wait_until(lambda: (a.root / large[0]).exists(), 60, "the first file never arrived")
    a.signal(signal.SIGKILL)  # killed in the middle of the send: far sooner than the timeout
    error = sending.result(MARGIN_S)
    assert isinstance(error, ReplicationError) and error.file in large, error
    for path, data in files_under(a.root).items():  # nothing under its name is partial (a hidden leftover may be)
        assert ".asyncckpt-tmp-" in path or data == (source / path).read_bytes(), f"{path} is under its name but not whole"

    a.stop()
    started = time.monotonic()
    with pytest.raises(ReplicationError, match="refused") as refused:  # nobody listening any more
        send(a.address, str(source), large[:1], secret=SECRET, timeout=60)
    assert time.monotonic() - started < MARGIN_S and refused.value.file is None


def test_a_sender_that_stops_is_dropped_by_the_receiver_with_what_it_was_sending(tmp_path, start_node):
    source = tmp_path / "source"
    large = many_large_files(source, 16)
    a = start_node("node-a")
    sender = Program([sys.executable, "-c", "import sys; from asyncckpt.core.tier.transport import job_secret, send; "
                      "send((sys.argv[1], int(sys.argv[2])), sys.argv[3], sys.argv[4:], secret=job_secret(None), timeout=600)",
                      a.address[0], str(a.address[1]), str(source), *large], tmp_path / "logs",
                     env={**os.environ, SECRET_ENV: JOB_SECRET})
    try:
        wait_until(lambda: (a.root / large[0]).exists(), 60, "the first file never arrived")
        sender.send_signal(signal.SIGSTOP)
        wait_until(lambda: hidden_leftovers(a.root) == [], 30, "the receiver kept what a silent sender was sending")
        assert all(t.ok for t in send(a.address, str(source), large[:1], secret=SECRET, timeout=30))  # still serving
    finally:
        sender.kill()
        sender.wait(30)
    for path, data in files_under(a.root).items():
        assert data == (source / path).read_bytes(), f"{path} is under its name but not whole"


def test_closing_a_receiver_ends_its_connections(tmp_path):
    source = tmp_path / "source"
    files = a_checkpoint(source)
    receiver = Receiver(str(tmp_path / "node-a"), secret=SECRET, bind="127.0.0.1", idle_timeout=600)
    path = f"{CHECKPOINT}/config.json"
    with PeerConnection(receiver.address, secret=SECRET, timeout=30) as peer:
        fd = os.open(source / path, os.O_RDONLY)
        try:
            assert peer.put(path, fd, FileChecksum(len(files[path]), checksum(files[path]))) is None
            closing = Background(receiver.close)
            assert closing.result(MARGIN_S) is None  # it did not wait for the idle connection's 600 s
            with pytest.raises(ReplicationError):
                peer.put(path, fd, FileChecksum(len(files[path]), checksum(files[path])))
        finally:
            os.close(fd)
    with pytest.raises(ReplicationError, match="refused"):
        send(receiver.address, str(source), [path], secret=SECRET, timeout=30)


def test_a_receiver_at_its_connection_limit_holds_the_next_sender_until_one_ends(tmp_path):
    source = tmp_path / "source"
    files = a_checkpoint(source)
    path = f"{CHECKPOINT}/config.json"
    with Receiver(str(tmp_path / "node-a"), secret=SECRET, bind="127.0.0.1", max_connections=1) as receiver:
        first = PeerConnection(receiver.address, secret=SECRET, timeout=30)
        fd = os.open(source / path, os.O_RDONLY)
        try:
            assert first.put(path, fd, FileChecksum(len(files[path]), checksum(files[path]))) is None
        finally:
            os.close(fd)
        with pytest.raises(ReplicationError, match="no answer"):  # held, and its wait bounded by its timeout
            send(receiver.address, str(source), [path], secret=SECRET, timeout=1)
        waiting = Background(lambda: send(receiver.address, str(source), list(files), secret=SECRET, timeout=60))
        first.close()  # a connection ends: the one waiting is served
        assert [t.error for t in waiting.result(60)] == [None] * len(files)
    assert files_under(tmp_path / "node-a") == files


# --------------------------------------------------------------------------------------- who gets in
STRANGER = r"""
import json, os, socket, struct, sys
address, path = (sys.argv[1], int(sys.argv[2])), sys.argv[3]

def message(obj):
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body

hello, payload = {"protocol": "asyncckpt-replication", "version": 3}, os.urandom(1 << 20)
attempts = {  # each at once, without waiting for an answer: the protocol as version 2 spoke it, a guessed proof, none
    "fetch": [message({"protocol": "asyncckpt-replication", "version": 2}), message({"get": path, "hash": True})],
    "push": [message({**hello, "nonce": "00" * 16, "proof": "11" * 32}),
             message({"put": "run-abc/planted.bin", "size": len(payload), "xxh3": None}), payload, message({"xxh3": "0" * 16})],
    "remove": [message({**hello, "nonce": "00" * 16}), message({"remove": path})],
}
for what, parts in attempts.items():
    with socket.create_connection(address, timeout=30) as sock:
        answers = b""
        try:
            sock.sendall(b"".join(parts))
        except OSError:
            pass  # refused before it took all of it
        try:
            while chunk := sock.recv(1 << 16):
                answers += chunk
        except ConnectionResetError:
            pass
        print(what, "%s:%d" % sock.getsockname()[:2], answers.hex() or "-", flush=True)
"""


def messages_in(raw: bytes) -> list[dict]:
    """The messages (4-byte length, JSON) in what a receiver sent."""
    found = []
    while len(raw) >= 4:
        length = int.from_bytes(raw[:4], "big")
        found.append(json.loads(raw[4:4 + length]))
        raw = raw[4 + length:]
    return found


def test_a_stranger_cannot_fetch_push_or_remove_and_is_named_in_the_log(tmp_path, start_node):
    """A process that reaches the port without the job's secret is refused at its first message, whatever it asks
    (a fetch, a push, a remove sent at once behind it): nothing answered, nothing written or removed, one warning
    naming its address per connection."""
    source = tmp_path / "source"
    files = a_checkpoint(source)
    a = start_node("node-a")
    assert all(t.ok for t in send(a.address, str(source), list(files), secret=SECRET, timeout=30))
    held = files_under(a.root)
    wanted = f"{CHECKPOINT}/optimizer.bin"
    stranger = Program([sys.executable, "-c", STRANGER, a.address[0], str(a.address[1]), wanted], tmp_path / "logs")
    assert stranger.wait(60) == 0, stranger.error_output()
    tried = {what: (peer, messages_in(bytes.fromhex(answers.strip("-"))))
             for what, peer, answers in map(str.split, stranger.lines())}
    assert set(tried) == {"fetch", "push", "remove"}
    for what, (peer, answers) in tried.items():
        assert all(set(m) <= {"protocol", "version", "nonce", "refused"} for m in answers), (what, answers)
        wait_until(lambda: f"from {peer}:" in a.program.error_output(), 30, f"the {what} attempt of {peer} not logged")
    assert files_under(a.root) == held and hidden_leftovers(a.root) == []
    refusals = [line for line in a.program.error_output().splitlines() if "refused a connection" in line]
    assert len(refusals) == 3 and all("nothing read or written" in line for line in refusals)


def test_a_node_of_another_job_on_the_same_host_is_refused_both_ways(tmp_path, start_node):
    """Two jobs' nodes on one host, each with its own secret: neither side's fetch, push or remove reaches the
    other's memory; and a listener that answers the handshake without the secret gets no byte of a file."""
    source = tmp_path / "source"
    files = a_checkpoint(source)
    other_secret = f"another-job-{os.urandom(16).hex()}"
    ours, theirs = start_node("node-a"), start_node("other-job-node", secret=other_secret)
    assert all(t.ok for t in send(ours.address, str(source), list(files), secret=SECRET, timeout=30))
    held, path = files_under(ours.root), f"{CHECKPOINT}/config.json"
    for node, secret in ((ours, other_secret.encode()), (theirs, SECRET)):
        with pytest.raises(ReplicationError, match="did not prove it belongs to this job"):
            fetch(node.address, str(tmp_path / "fetched"), [path], secret=secret, timeout=30)
        with pytest.raises(ReplicationError, match="did not prove it belongs to this job"):
            send(node.address, str(source), [path], secret=secret, timeout=30)
        with pytest.raises(ReplicationError, match="did not prove it belongs to this job"):
            with PeerConnection(node.address, secret=secret, timeout=30) as peer:
                peer.remove(path)
    assert files_under(ours.root) == held and files_under(theirs.root) == {} and files_under(tmp_path / "fetched") == {}
    assert ours.program.error_output().count("refused a connection") == 3

    with socket.create_server(("127.0.0.1", 0)) as listener:  # a stranger that took a node's port
        def pretend() -> bytes:
            connection, _ = listener.accept()
            with connection:
                body = json.dumps({"protocol": "asyncckpt-replication", "version": 3, "nonce": "22" * 16}).encode()
                connection.sendall(len(body).to_bytes(4, "big") + body)
                body = json.dumps({"proof": "33" * 32}).encode()
                connection.sendall(len(body).to_bytes(4, "big") + body)
                received = b""
                while chunk := connection.recv(1 << 16):
                    received += chunk
                return received
        listening = Background(pretend)
        with pytest.raises(ReplicationError, match="did not prove it belongs to this job"):
            send(listener.getsockname(), str(source), [f"{CHECKPOINT}/model.safetensors"], secret=SECRET, timeout=30)
        [hello] = messages_in(listening.result(30))  # only the sender's nonce and proof
        assert set(hello) == {"protocol", "version", "nonce", "proof"}


# --------------------------------------------------------------------------------------- a node's network gone
def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def namespace():
    """A network namespace with a veth pair to this one: (its name, its end's interface, its address, ours).
    Skipped where the kernel or permissions refuse one; removed with its veth pair, whatever the test did."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command here: network namespaces cannot be made")
    name, subnet = f"acr{os.getpid()}", f"10.231.{os.getpid() % 250}"
    ours, theirs = f"acr{os.getpid()}h", f"acr{os.getpid()}n"
    made = _ip("netns", "add", name)
    if made.returncode != 0:
        pytest.skip(f"this machine refuses a network namespace (`ip netns add`): {made.stderr.strip()}")
    try:
        for args in (("link", "add", ours, "type", "veth", "peer", "name", theirs), ("link", "set", theirs, "netns", name),
                     ("addr", "add", f"{subnet}.1/30", "dev", ours), ("link", "set", ours, "up"),
                     ("-n", name, "addr", "add", f"{subnet}.2/30", "dev", theirs), ("-n", name, "link", "set", theirs, "up"),
                     ("-n", name, "link", "set", "lo", "up")):
            done = _ip(*args)
            assert done.returncode == 0, f"ip {' '.join(args)}: {done.stderr}"
        yield name, theirs, f"{subnet}.2"
    finally:
        _ip("netns", "del", name)  # takes its end of the pair, and with it ours
        _ip("link", "del", ours)
        assert name not in _ip("netns", "list").stdout and ours not in _ip("link", "show").stdout


def test_a_node_whose_link_goes_down_fails_the_send_within_its_timeout(tmp_path, namespace, start_node):
    name, interface, address = namespace
    source = tmp_path / "source"
    files = a_checkpoint(source)
    large = many_large_files(source, 16)
    a = start_node("node-a", argv_prefix=("ip", "netns", "exec", name), bind=address, public=None)
    assert a.address[0] == address  # its public address is the one it is bound to: reached over the veth pair
    assert all(t.ok for t in send(a.address, str(source), list(files), secret=SECRET, timeout=30))
    assert {p: files_under(a.root)[p] for p in files} == files

    sending = Background(lambda: send(a.address, str(source), large, secret=SECRET, timeout=2))
    wait_until(lambda: (a.root / large[0]).exists(), 60, "the first file never arrived")
    assert _ip("-n", name, "link", "set", interface, "down").returncode == 0
    down_at = time.monotonic()
    error = sending.result(2 + MARGIN_S + 5)
    assert isinstance(error, ReplicationError) and error.file in large, error
    assert sending.ended - down_at < 2 + MARGIN_S and address in str(error)

    started = time.monotonic()  # and a new send to it fails as soon, the connection never made
    with pytest.raises(ReplicationError) as unreachable:
        send(a.address, str(source), large[:1], secret=SECRET, timeout=2)
    assert time.monotonic() - started < 2 + MARGIN_S and unreachable.value.file is None


# --------------------------------------------------------------------------------------- which peers, where
@pytest.mark.parametrize("nodes", range(1, 8))
def test_every_share_survives_the_loss_of_any_one_node(nodes):
    for replicas in range(0, nodes + 2):
        holders = {i: peers_for(i, nodes, replicas) for i in range(nodes)}
        for i, peers in holders.items():
            assert i not in peers and len(set(peers)) == len(peers) == min(replicas, nodes - 1)
            assert peers == [(i + k) % nodes for k in range(1, len(peers) + 1)]
        if replicas >= 1 and nodes >= 2:
            for lost in range(nodes):
                assert all({i, *peers} - {lost} for i, peers in holders.items())
    with pytest.raises(ValueError):
        peers_for(nodes, nodes, 1)


def test_a_receiver_listens_on_the_address_the_job_uses_only(tmp_path, monkeypatch):
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # the rendezvous host, reached over loopback here
    with Receiver(str(tmp_path / "node-a"), secret=SECRET) as receiver:
        assert receiver.address[0] == "127.0.0.1"
    monkeypatch.setenv(ADDRESS_ENV, "127.0.0.3")
    with Receiver(str(tmp_path / "node-a"), secret=SECRET) as receiver:
        assert receiver.address[0] == "127.0.0.3"
        with pytest.raises(ConnectionRefusedError):  # another address of this host: nobody listens there
            socket.create_connection(("127.0.0.1", receiver.address[1]), timeout=30).close()
    monkeypatch.setenv(ADDRESS_ENV, "192.0.2.1")  # not an address of this host
    with pytest.raises(ValueError, match=ADDRESS_ENV):
        Receiver(str(tmp_path / "node-a"), secret=SECRET)


def test_a_receiver_and_the_jobs_secret_are_found_through_the_store(tmp_path, start_node, monkeypatch):
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    source = tmp_path / "source"
    files = a_checkpoint(source)
    a = start_node("node-a")
    publish_address(store, "node-a", a.address)  # as node-a's training process will, for its writer
    client = TCPStore("127.0.0.1", store.port, is_master=False)  # another node's
    found = peer_address(client, "node-a")
    assert found == a.address
    drawn = job_secret(client)  # the first to ask draws it; every other rank of the job reads the same
    assert drawn == job_secret(store) and len(drawn) == 64
    monkeypatch.setenv(SECRET_ENV, JOB_SECRET)  # the launcher's, where it gives one
    assert job_secret(store) == SECRET
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match=SECRET_ENV):
        job_secret(store)
    assert all(t.ok for t in send(found, str(source), list(files), secret=SECRET, timeout=30))
    with pytest.raises(ValueError):
        parse_address("no-port")
