"""Moving memory-tier files between nodes: a receiver per node, and ``send`` / ``fetch`` to and from a peer's.

With the memory tier (``tier``), each node's shares of a checkpoint are copied into the memory of
``replicas`` other nodes (``peers_for``), so that the loss of a node loses no checkpoint, and a node that
replaced a lost one fetches back what it lacks. Both directions move whole files between two memory roots
under the same relative path (``run-abc/.checkpoint-20.asyncckpt-staging-<id>/model.safetensors``): which
files, and when, is the caller's business; this module only moves bytes and vouches for them.

More: docs/MODULES.md, core/tier/transport.py.
"""
from __future__ import annotations

import contextlib
import hmac
import json
import logging
import math
import mmap
import os
import secrets
import select
import socket
import stat
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Union

from asyncckpt.core.errors import CheckpointError
from asyncckpt.core.formats import names
from asyncckpt.core.formats.checksum import FileChecksum, checksum, checksum_stream
from asyncckpt.core.storage import owners, spares
from asyncckpt.core.storage.local import attach_checksum

Address = tuple[str, int]

ADDRESS_ENV = "ASYNCCKPT_REPLICATION_ADDRESS"  # this host's address (or name) the receiver listens on, others reach
SECRET_ENV = "ASYNCCKPT_REPLICATION_SECRET"  # the job's secret from the launcher (else one is drawn through the Store)
MIN_SECRET_CHARS = 16
PEER_KEY = "asyncckpt/tier/peer/{node}"  # in the Store: a node's receiver address, "host:port"
SECRET_KEY = "asyncckpt/tier/secret"  # in the Store: the secret drawn for the job, where the launcher gives none
PIECE_BYTES = 1 << 20  # received bytes are hashed and written in pieces of this size (hashed while in cache)
MAX_MESSAGE_BYTES = 64 << 10  # the largest header a peer may send: a path and a few numbers
HELLO = {"protocol": "asyncckpt-replication", "version": 3}  # both sides' first message (3: the job's secret proven)
NONCE_BYTES = 16
TAG_BYTES = 32  # an HMAC-SHA256, after every message once a connection is proven

logger = logging.getLogger("asyncckpt")


class ReplicationError(CheckpointError):
    """A peer could not be reached, stopped answering, or broke off a transfer. ``peer`` is its address
    ("host:port"), ``file`` the relative path in flight (None: before the first), ``finished`` what became
    of the files handled before it."""

    def __init__(self, peer: str, file: Optional[str], reason: str, finished: Optional[list["Transfer"]] = None) -> None:
        super().__init__(f"replication peer {peer}: {reason}" + (f" ({file})" if file is not None else ""))
        self.peer, self.file, self.reason = peer, file, reason
        self.finished = list(finished or [])

    def __reduce__(self):  # pickled with what it was made of (its message alone would not rebuild it)
        return type(self), (self.peer, self.file, self.reason, self.finished)


@dataclass(frozen=True)
class Streaming:
    """A file being written while it is sent (a memory-tier save's data file while its snapshot is copied): its
    ``size``, ``ready(done)`` that blocks until more than ``done`` bytes are there and returns how many
    (``CopyProgress.waiter``: ``inf`` once all are; None: all are there already), and ``checksum()`` that
    returns its xxh3 once it is hashed (both raise if the copy failed: the peer then keeps nothing)."""

    size: int
    ready: Optional[Callable[[float], float]]
    checksum: Callable[[], str]


@dataclass(frozen=True)
class Transfer:
    """What became of one file of a ``send`` or a ``fetch``: ``error`` is None if it arrived whole and
    verified and is now under its name on the other side, else why not (naming the file)."""

    path: str
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None


# ------------------------------------------------------------------------------------- which nodes
def peers_for(node_index: int, nodes: int, replicas: int) -> list[int]:
    """The nodes that hold node ``node_index``'s replicas, of ``nodes`` numbered 0..nodes-1: the next
    ``replicas`` after it, ``i+1, ..., i+replicas`` (mod ``nodes``), never itself (all the others when
    ``replicas >= nodes - 1``). Each replica of a share is on a different node, and none on the share's
    own: losing any one node takes at most one copy of each share, so with ``replicas >= 1`` every
    share survives the loss of a node."""
    if nodes < 1 or not 0 <= node_index < nodes or replicas < 0:
        raise ValueError(f"no peers for node {node_index} of {nodes} with {replicas} replicas")
    return [(node_index + step) % nodes for step in range(1, min(replicas, nodes - 1) + 1)]


# ------------------------------------------------------------------------------------- addresses
def format_address(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


def parse_address(text: str) -> Address:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not a replication address (host:port): {text!r}")
    return host, int(port)


def publish_address(store: Any, node: str, address: Address) -> None:
    """Make ``node``'s receiver address known to the others: ``store`` is anything with ``set(key, value)``
    (the torch.distributed Store)."""
    store.set(PEER_KEY.format(node=node), format_address(address))


def peer_address(store: Any, node: str) -> Address:
    """``node``'s receiver address from ``store`` (``get(key)``, returning bytes or str). The Store's ``get``
    waits until the key is set, up to the Store's own timeout."""
    value = store.get(PEER_KEY.format(node=node))
    return parse_address(value.decode() if isinstance(value, bytes) else value)


def job_host() -> str:
    """The address of this host that the job's nodes reach one another at, where its receiver listens:
    ``ASYNCCKPT_REPLICATION_ADDRESS``; else this host's address on the route to the job's rendezvous host
    (``MASTER_ADDR``, which every node reaches: torchrun, and the launchers of Lightning, Accelerate and the
    Trainer, set it); else the address of the host's name."""
    if os.environ.get(ADDRESS_ENV):
        return os.environ[ADDRESS_ENV]
    rendezvous = os.environ.get("MASTER_ADDR")
    if rendezvous:
        with contextlib.suppress(OSError):
            family, kind, _, _, destination = socket.getaddrinfo(rendezvous, 1, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, kind) as probe:
                probe.connect(destination)  # a datagram socket's connect sends nothing: it only picks the route
                return probe.getsockname()[0]
    return socket.gethostbyname(socket.gethostname())


# ------------------------------------------------------------------------------------- the job's secret
def job_secret(store: Any) -> bytes:
    """The secret a node proves it belongs to the job with: ``ASYNCCKPT_REPLICATION_SECRET`` from the launcher's
    environment (the same for every incarnation of the job: a restart, a requeue, and the orphaned writers of the
    one before), else one drawn for the job through ``store`` (the torch.distributed Store, ``compare_set``: the
    first rank to ask draws it, every other reads it; as private as the Store, and one per Store)."""
    given = os.environ.get(SECRET_ENV)
    if given:
        if len(given) < MIN_SECRET_CHARS:
            raise ValueError(f"{SECRET_ENV} has {len(given)} characters: give the job a random secret of at least "
                             f"{MIN_SECRET_CHARS} (`openssl rand -hex 32`, say)")
        return given.encode()
    if store is None:
        raise ValueError(f"no secret for the memory tier's replication: {SECRET_ENV} is not set and there is no "
                         "Store to draw one through")
    drawn = store.compare_set(SECRET_KEY, "", secrets.token_hex(32))
    return drawn if isinstance(drawn, bytes) else drawn.encode()


def _keyed(secret: bytes, label: bytes, nonces: bytes) -> bytes:
    """What a connection's two nonces give under the job's secret, for one use (``label``)."""
    return hmac.digest(secret, label + nonces, "sha256")


def _greeting(message: dict) -> Optional[bytes]:
    """The nonce of a first message that is the protocol's, else None."""
    nonce = message.get("nonce")
    if any(message.get(key) != value for key, value in HELLO.items()) or not isinstance(nonce, str):
        return None
    try:
        nonce_bytes = bytes.fromhex(nonce)
    except ValueError:
        return None
    return nonce_bytes if len(nonce_bytes) == NONCE_BYTES else None


def _proves(proof: Any, expected: bytes) -> bool:
    return isinstance(proof, str) and hmac.compare_digest(proof.encode(), expected.hex().encode())


# ------------------------------------------------------------------------------------- paths
def checked_path(relative_path: str) -> str:
    """``relative_path`` if it names a place inside a memory root, else ValueError naming it: not empty,
    not absolute, no ``..``, ``.`` or empty component (the form a caller builds; nothing to normalise)."""
    if (not isinstance(relative_path, str) or not relative_path or "\0" in relative_path
            or os.path.isabs(relative_path) or os.path.normpath(relative_path) != relative_path
            or relative_path.split("/")[0] in (".", "..")):
        raise ValueError(f"refused {relative_path!r}: not a relative path inside the memory root")
    return relative_path


def _target(root: str, relative_path: str) -> str:
    """Where ``relative_path`` lives under ``root``; ValueError naming it if it is not a path inside the root,
    or if a directory on its way is a symlink that leads out of it."""
    target = os.path.join(root, checked_path(relative_path))
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(os.path.dirname(target))]) != real_root:
        raise ValueError(f"refused {relative_path!r}: it leads out of the memory root")
    return target


def file_checksum(path: str) -> FileChecksum:
    """The checksum of the file at ``path``, hashed from its pages (a memory root's file: no read through user
    space)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _file_checksum(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _file_checksum(fd: int, size: int) -> FileChecksum:
    """The checksum of the first ``size`` bytes of ``fd``, hashed from its pages (no copy)."""
    if size == 0:
        return FileChecksum(0, checksum(b""))
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as pages:
        return FileChecksum(size, checksum(pages))


# ------------------------------------------------------------------------------------- the wire
class _Stalled(Exception):
    """The peer made no progress within the wait allowed."""


class _Broken(Exception):
    """The peer closed the connection, or sent something that is not the protocol."""


class _Stream:
    """One connection, every wait bounded: each wait for the peer lasts at most ``timeout`` s, and none
    ends after ``deadline`` (``time.monotonic``). A message is a 4-byte length and a JSON object; a file's
    bytes follow its message raw; once the connection is proven (``authenticated``), each message is followed by
    its HMAC. Its one buffer (``PIECE_BYTES``) carries every file it receives."""

    def __init__(self, sock: socket.socket, timeout: float, deadline: Optional[float] = None) -> None:
        sock.setblocking(False)
        self.sock, self.timeout, self.deadline = sock, timeout, deadline
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self.buffer = memoryview(bytearray(PIECE_BYTES))
        self._keys: Optional[tuple[bytes, bytes]] = None  # sending, receiving
        self._counts = [0, 0]  # messages sent, received under them

    def authenticated(self, sending: bytes, receiving: bytes) -> None:
        """From now on every message carries an HMAC under this connection's key for its direction, over its number
        and its body: a message that does not (spliced in, replayed, reordered) breaks the connection."""
        self._keys = (sending, receiving)

    def _tag(self, direction: int, body: bytes) -> bytes:
        number = self._counts[direction]
        self._counts[direction] += 1
        return hmac.digest(self._keys[direction], number.to_bytes(8, "big") + body, "sha256")

    def _wait(self, event: int) -> None:
        wait, what = self.timeout, f"no answer for {self.timeout:g} s"
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left < wait:
                wait, what = max(left, 0.0), "not done within its time limit"
        self._poll.modify(self.sock, event)
        if not self._poll.poll(math.ceil(wait * 1000)):
            raise _Stalled(what)

    def send_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view):]
            except BlockingIOError:
                self._wait(select.POLLOUT)

    def send_message(self, message: dict) -> None:
        body = json.dumps(message).encode()
        self.send_all(struct.pack(">I", len(body)) + body + (self._tag(0, body) if self._keys else b""))

    def send_file(self, fd: int, size: int, ready: Optional[Callable[[float], float]] = None) -> None:
        """``size`` bytes of ``fd`` from its start, kernel to kernel (``os.sendfile``); with ``ready``
        (``Streaming``), each part once it is there."""
        offset, there = 0, size if ready is None else 0
        while offset < size:
            if offset == there:
                there = int(min(size, ready(offset)))
            try:
                sent = os.sendfile(self.sock.fileno(), fd, offset, there - offset)
            except BlockingIOError:
                self._wait(select.POLLOUT)
                continue
            if sent == 0:
                raise _Broken(f"the file ended after {offset} of its {size} B while it was sent")
            offset += sent

    def recv_into(self, view: memoryview) -> int:
        while True:
            try:
                received = self.sock.recv_into(view)
            except BlockingIOError:
                self._wait(select.POLLIN)
                continue
            if received == 0:
                raise _Broken("it closed the connection")
            return received

    def _recv_exact(self, size: int) -> bytes:
        data = bytearray(size)
        view, filled = memoryview(data), 0
        while filled < size:
            filled += self.recv_into(view[filled:])
        return bytes(data)

    def read_message(self, end_allowed: bool = False) -> Optional[dict]:
        """The next message; None if the peer closed the connection before it (only where ``end_allowed``)."""
        try:
            length = struct.unpack(">I", self._recv_exact(4))[0]
        except _Broken:
            if end_allowed:
                return None
            raise
        if length > MAX_MESSAGE_BYTES:
            raise _Broken(f"it sent a message of {length} B (at most {MAX_MESSAGE_BYTES} B)")
        body = self._recv_exact(length)
        if self._keys is not None and not hmac.compare_digest(self._recv_exact(TAG_BYTES), self._tag(1, body)):
            raise _Broken("it sent a message without this connection's key (not from the node that proved itself)")
        try:
            message = json.loads(body)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            raise _Broken("it sent something other than the replication protocol")
        return message

    def receive_file(self, root: str, relative_path: str, expected: FileChecksum,
                     file_mtime_ns: Optional[int] = None) -> Optional[str]:
        """Receive ``expected.size`` bytes into ``relative_path`` under ``root``: written to a hidden temporary
        name, hashed as they arrive, renamed to their name only if whole and matching ``expected`` (whose xxh3
        None: the one the peer sends after the bytes, ``Streaming``). Returns None, or why the file was not
        kept (the bytes are read to their end either way, so that the connection goes on with the next file).
        A connection that fails meanwhile raises, and leaves nothing.
        With ``file_mtime_ns`` (a single-file checkpoint), the file gets its checksum attached and that
        modification time before it takes its name, in a directory that must be there (a run directory some
        process here owns: none is made that nothing would remove)."""
        target = _target(root, relative_path)
        temporary, fd, problem, recycled = None, None, None, None
        try:
            if file_mtime_ns is None:
                os.makedirs(os.path.dirname(target), exist_ok=True)
            temporary = names.hidden_path(target, "tmp", owners.owner_token())
            recycled = fd = spares.take(temporary, expected.size)
            if fd is None:
                fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except OSError as e:
            problem = f"{relative_path}: cannot be written here ({e.strerror})"
        try:
            digest = checksum_stream()
            if recycled is not None:
                self._receive_over(recycled, expected.size, digest)
            else:
                left = expected.size
                while left:
                    piece = self.buffer[:self.recv_into(self.buffer[:min(left, PIECE_BYTES)])]
                    left -= len(piece)
                    if problem is None:
                        digest.update(piece)
                        try:
                            _write_all(fd, piece)
                        except OSError as e:
                            problem = f"{relative_path}: cannot be written here ({e.strerror})"
            if expected.xxh3 is None:
                expected = FileChecksum(expected.size, self.read_trailer(relative_path))
            if problem is not None:
                return problem
            if digest.hexdigest() != expected.xxh3:
                return (f"{relative_path}: damaged in transfer (xxh3 {digest.hexdigest()} arrived, {expected.xxh3} "
                        "expected); not kept")
            os.close(fd)
            fd = None
            try:
                if file_mtime_ns is not None:
                    attach_checksum(temporary, expected)
                    os.utime(temporary, ns=(file_mtime_ns, file_mtime_ns))
                os.replace(temporary, target)
            except OSError as e:
                return f"{relative_path}: cannot be written here ({e.strerror})"
            temporary = None
            return None
        finally:
            if fd is not None:
                os.close(fd)
            if temporary is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temporary)

    def _receive_over(self, fd: int, size: int, digest: Any) -> None:
        """``size`` bytes received straight into the pages of ``fd`` (a spare of that size: every page there, so
        none is allocated while mapped), each piece hashed into ``digest`` while in cache."""
        with mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)) as pages:
            view, offset = memoryview(pages), 0
            try:
                while offset < size:
                    received = self.recv_into(view[offset:min(offset + PIECE_BYTES, size)])
                    digest.update(view[offset:offset + received])
                    offset += received
            finally:
                view.release()

    def discard(self, size: int) -> None:
        while size:
            size -= self.recv_into(self.buffer[:min(size, PIECE_BYTES)])

    def read_trailer(self, relative_path: str) -> str:
        """The xxh3 a ``Streaming`` file's sender sends after its bytes."""
        xxh3 = self.read_message().get("xxh3")
        if not isinstance(xxh3, str):
            raise _Broken(f"it sent {relative_path} without its checksum")
        return xxh3


def _announced(message: dict, path_key: str) -> tuple[str, int, Optional[str]]:
    """The path, size and xxh3 (None where absent) a message announces a file with; ``_Broken`` if they are
    not a path, a size and a hex digest."""
    path, size, xxh3 = message.get(path_key), message.get("size"), message.get("xxh3")
    if (not isinstance(path, str) or not isinstance(size, int) or isinstance(size, bool) or size < 0
            or not (xxh3 is None or isinstance(xxh3, str))):
        raise _Broken("it announced a file without a path, a size or a checksum")
    return path, size, xxh3


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


def _reason(error: BaseException) -> str:
    """What a failed connection to a peer tells the person reading the log."""
    if isinstance(error, (_Stalled, _Broken)):
        return str(error)
    if isinstance(error, ConnectionRefusedError):
        return "connection refused (no receiver listening there)"
    if isinstance(error, (ConnectionResetError, BrokenPipeError)):
        return "it closed the connection"
    if isinstance(error, TimeoutError):
        return "no answer"
    return f"{type(error).__name__}: {error}"


# ------------------------------------------------------------------------------------- sending side
class PeerConnection:
    """One connection to a peer's ``Receiver``, for a sequence of ``put`` and ``get`` (``send`` and ``fetch``
    are these, over a list of files), proven with the job's ``secret`` (``job_secret``) before the first. A file
    the peer refuses or that fails its check is an answer (the reason, naming it); a connection that fails, or
    whose receiver cannot prove it belongs to the job, raises ``ReplicationError``, and is then closed."""

    def __init__(self, address: Address, *, secret: bytes, timeout: float, time_limit: Optional[float] = None) -> None:
        self.peer, self._secret, self._proven = format_address(address), secret, False
        deadline = None if time_limit is None else time.monotonic() + time_limit
        try:
            sock = socket.create_connection(address, timeout=timeout if time_limit is None else min(timeout, time_limit))
        except OSError as e:
            raise ReplicationError(self.peer, None, _reason(e)) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._stream: Optional[_Stream] = _Stream(sock, timeout, deadline)

    @contextlib.contextmanager
    def _failing(self, file: Optional[str]) -> Iterator[_Stream]:
        """The connection, proven (at its first use: a failure then names the file that would have gone first)."""
        if self._stream is None:
            raise ReplicationError(self.peer, file, "the connection failed before")
        try:
            if not self._proven:
                self._prove(self._stream)
            yield self._stream
        except (OSError, _Stalled, _Broken) as e:
            self.close()
            raise ReplicationError(self.peer, file, _reason(e)) from None

    def _prove(self, stream: _Stream) -> None:
        """The handshake, as the side that connects: the receiver's nonce, ours and our proof, then its proof."""
        theirs = _greeting(self._answer(stream))
        if theirs is None:
            raise _Broken(f"not a {HELLO['protocol']} version {HELLO['version']} receiver")
        nonces = theirs + secrets.token_bytes(NONCE_BYTES)
        stream.send_message({**HELLO, "nonce": nonces[NONCE_BYTES:].hex(),
                             "proof": _keyed(self._secret, b"proof:peer", nonces).hex()})
        if not _proves(self._answer(stream).get("proof"), _keyed(self._secret, b"proof:receiver", nonces)):
            raise _Broken("it did not prove it belongs to this job (a process of another job, or a stranger, "
                          "listens there); nothing sent")
        stream.authenticated(_keyed(self._secret, b"key:to-receiver", nonces),
                             _keyed(self._secret, b"key:to-peer", nonces))
        self._proven = True

    @staticmethod
    def _answer(stream: _Stream) -> dict:
        answer = stream.read_message()
        if "refused" in answer:
            raise _Broken(f"it refused the connection: {answer['refused']}")
        return answer

    def _reply(self, stream: _Stream, relative_path: str) -> dict:
        reply = self._answer(stream)
        if reply.get("path") != relative_path:
            raise _Broken(f"it answered for {reply.get('path')!r}")
        return reply

    def put(self, relative_path: str, fd: int, expected: Union[FileChecksum, Streaming], *,
            as_file: bool = False) -> Optional[str]:
        """Send the first ``expected.size`` bytes of ``fd`` to ``relative_path`` under the peer's root, announced
        with ``expected.xxh3`` (a ``Streaming`` file: each part once it is there, its xxh3 after them; ``as_file``:
        a single-file checkpoint, with its modification time): None once the peer has it under its name, else why
        not. What a ``Streaming`` file's ``ready`` or ``checksum`` raises ends the connection (the peer keeps
        nothing) and is raised."""
        streaming = isinstance(expected, Streaming)
        try:
            with self._failing(relative_path) as stream:
                message = {"put": relative_path, "size": expected.size, "xxh3": None if streaming else expected.xxh3}
                if as_file:
                    message["mtime_ns"] = os.fstat(fd).st_mtime_ns
                stream.send_message(message)
                stream.send_file(fd, expected.size, expected.ready if streaming else None)
                if streaming:
                    stream.send_message({"xxh3": expected.checksum()})
                return self._reply(stream, relative_path).get("error")
        except ReplicationError:
            raise
        except BaseException:
            self.close()  # mid-file: the peer discards what it received
            raise

    def remove(self, relative_path: str) -> Optional[str]:
        """Delete the single file ``relative_path`` under the peer's root (gone already counts as done): None
        once it is not there, else why not."""
        with self._failing(relative_path) as stream:
            stream.send_message({"remove": relative_path})
            return self._reply(stream, relative_path).get("error")

    def get(self, relative_path: str, root: str, expected: Optional[FileChecksum] = None,
            local_path: Optional[str] = None, *, as_file: bool = False) -> Optional[str]:
        """Fetch the peer's ``relative_path`` into the same path under ``root`` (or ``local_path`` there),
        checked against ``expected`` (else against the checksum the peer computes before sending it): None
        once it is here under its name, else why not (missing there, damaged: never kept under its name).
        ``as_file``: a single-file checkpoint, its checksum attached and its modification time kept."""
        local_path = relative_path if local_path is None else checked_path(local_path)
        with self._failing(relative_path) as stream:
            stream.send_message({"get": relative_path, "hash": expected is None})
            reply = self._reply(stream, relative_path)
            if reply.get("error") is not None:
                return reply["error"]
            _, size, xxh3 = _announced(reply, "path")
            if expected is None:
                if xxh3 is None:
                    raise _Broken(f"it sent {relative_path} without its checksum")
                expected = FileChecksum(size, xxh3)
            if size != expected.size:
                stream.discard(size)
                return f"{relative_path}: {size} B at {self.peer}, {expected.size} B recorded; not kept"
            mtime_ns = reply.get("mtime_ns") if as_file else None
            if as_file and not isinstance(mtime_ns, int):
                raise _Broken(f"it sent {relative_path} without its modification time")
            problem = stream.receive_file(root, local_path, expected, mtime_ns)
            return None if problem is None else problem.replace(local_path, relative_path)

    def read(self, relative_path: str) -> Optional[bytes]:
        """The bytes of the peer's small file ``relative_path`` (a marker, a commit record: at most
        ``MAX_MESSAGE_BYTES``), checked against the checksum the peer computes; None where it has none."""
        with self._failing(relative_path) as stream:
            stream.send_message({"get": relative_path, "hash": True})
            reply = self._reply(stream, relative_path)
            if reply.get("error") is not None:
                return None
            _, size, xxh3 = _announced(reply, "path")
            if size > MAX_MESSAGE_BYTES:
                raise _Broken(f"it sent {size} B for {relative_path}, a small file")
            data = stream._recv_exact(size)
            if xxh3 is None or checksum(data) != xxh3:
                raise _Broken(f"{relative_path} arrived damaged")
            return data

    def close(self) -> None:
        if self._stream is not None:
            self._stream.sock.close()
            self._stream = None

    def __enter__(self) -> "PeerConnection":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def send(address: Address, root: str, relative_paths: Iterable[str], *, secret: bytes, timeout: float,
         time_limit: Optional[float] = None, checksums: Optional[Mapping[str, FileChecksum]] = None) -> list[Transfer]:
    """Copy the files ``relative_paths`` under ``root`` into the same paths under the memory root of the
    receiver at ``address``; what became of each, in order. A file's checksum is the one in ``checksums``
    (recorded when it was written: the peer then also refuses a file damaged since), else it is hashed here
    first. Raises ValueError for a path outside the root (before anything is sent), and
    ``ReplicationError`` when the peer cannot be reached, fails, or does not prove it holds the job's ``secret``
    (``timeout``: the longest wait for it; ``time_limit``: for the whole call)."""
    paths, checksums = [checked_path(path) for path in relative_paths], checksums or {}
    outcomes: list[Transfer] = []
    try:
        with PeerConnection(address, secret=secret, timeout=timeout, time_limit=time_limit) as peer:
            for path in paths:
                try:
                    fd = os.open(os.path.join(root, path), os.O_RDONLY | os.O_CLOEXEC)
                except OSError as e:
                    outcomes.append(Transfer(path, f"{path}: cannot be read here ({e.strerror})"))
                    continue
                try:
                    size = os.fstat(fd).st_size
                    expected = checksums.get(path) or _file_checksum(fd, size)
                    if expected.size != size:
                        outcomes.append(Transfer(path, f"{path}: {size} B here, {expected.size} B recorded; not sent"))
                        continue
                    outcomes.append(Transfer(path, peer.put(path, fd, expected)))
                finally:
                    os.close(fd)
    except ReplicationError as e:
        raise ReplicationError(e.peer, e.file, e.reason, outcomes) from None
    return outcomes


def fetch(address: Address, root: str, relative_paths: Iterable[str], *, secret: bytes, timeout: float,
          time_limit: Optional[float] = None, checksums: Optional[Mapping[str, FileChecksum]] = None,
          local_paths: Optional[Mapping[str, str]] = None, as_files: bool = False) -> list[Transfer]:
    """Copy the files ``relative_paths`` from the memory root of the receiver at ``address`` into the same
    paths under ``root`` (replacing what is there), or where ``local_paths`` puts one (a relative path under
    ``root`` too: a hidden staging directory, say); what became of each, in order. Each is checked as it
    arrives against ``checksums`` (the checkpoint's record: a replica damaged at rest is refused too), else
    against the checksum the peer computes before sending it; one that fails is never kept under its name.
    ``as_files``: single-file checkpoints (``PeerConnection.get``). Raises as ``send`` does."""
    paths, checksums, local_paths = [checked_path(path) for path in relative_paths], checksums or {}, local_paths or {}
    outcomes: list[Transfer] = []
    try:
        with PeerConnection(address, secret=secret, timeout=timeout, time_limit=time_limit) as peer:
            for path in paths:
                outcomes.append(Transfer(path, peer.get(path, root, checksums.get(path), local_paths.get(path),
                                                    as_file=as_files)))
    except ReplicationError as e:
        raise ReplicationError(e.peer, e.file, e.reason, outcomes) from None
    return outcomes


# ------------------------------------------------------------------------------------- receiving side
def listening_socket(bind: Optional[str] = None, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``bind`` (an address of this host; None: ``job_host``, the one the job's nodes
    reach one another at) and ``port`` (0: any free one), as a ``Receiver`` serves: made by whoever publishes its
    address (a training process, which hands it to its writer: ``client.writer_queue``), so that the address is
    known before the receiver runs."""
    host = job_host() if bind is None else bind
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        return socket.create_server(address[:2], family=family, backlog=128)
    except OSError as e:
        raise ValueError(f"the memory tier's receiver cannot listen on {host!r} ({e.strerror or e}): set {ADDRESS_ENV} "
                         "to this host's address that the job's other nodes reach") from None


class Receiver:
    """Serves one node's memory root ``root`` to the peers that prove they hold the job's ``secret`` on TCP
    (``bind``, ``port``, as ``listening_socket``; or the ``listener`` given), from construction until ``close``.
    ``address`` is where the other nodes reach it.

    Each connection gets a thread, up to ``max_connections`` at once; one more waits in the listening
    socket's backlog until one ends (its sender's ``timeout`` bounds that wait). A connection whose peer
    sends nothing for ``idle_timeout`` seconds is dropped, with the file it was receiving. A connection that does
    not prove it belongs to the job is refused before anything is read, with one warning naming its address; every
    later failure is reported to the peer that caused it, which reports it."""

    def __init__(self, root: str, *, secret: bytes, bind: Optional[str] = None, port: int = 0,
                 idle_timeout: float = 60.0, max_connections: int = 64, listener: Optional[socket.socket] = None) -> None:
        self.root, self.idle_timeout, self.max_connections = os.path.abspath(root), idle_timeout, max_connections
        self._secret = secret
        os.makedirs(self.root, exist_ok=True)
        if listener is None:
            listener = listening_socket(bind, port)
        self._listener = listener
        self.address: Address = tuple(listener.getsockname()[:2])
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)  # a connection ended, or the receiver is closing
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._last_connected = time.monotonic()  # when a connection last began or ended (``wait_quiet``)
        self._closing = False
        self._acceptor = threading.Thread(target=self._accept, name="asyncckpt-replication-accept", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            with self._lock:
                while len(self._connections) >= self.max_connections and not self._closing:
                    self._ended.wait()
                if self._closing:
                    return
            try:
                sock, peer = self._listener.accept()
            except OSError:
                if self._closing:
                    return
                time.sleep(0.1)  # out of file descriptors, say: try again once some are free
                continue
            with self._lock:
                if self._closing:
                    sock.close()
                    return
                thread = threading.Thread(target=self._serve, args=(sock, format_address(peer[:2])),
                                          name="asyncckpt-replication-serve", daemon=True)
                self._connections[sock] = thread
                self._last_connected = time.monotonic()
            thread.start()

    @staticmethod
    def _refuse(sock: socket.socket, reason: str) -> None:
        body = json.dumps({"refused": reason}).encode()
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.send(struct.pack(">I", len(body)) + body)
        sock.close()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stream = _Stream(sock, self.idle_timeout)
            refusal = self._prove(stream)
            if refusal is not None:
                logger.warning("asyncckpt: the memory tier's receiver at %s refused a connection from %s: %s; nothing "
                               "read or written", format_address(self.address), peer, refusal)
                self._refuse(sock, refusal)
                return
            while True:
                request = stream.read_message(end_allowed=True)
                if request is None:
                    return
                if "put" in request:
                    self._receive(stream, request)
                elif "get" in request:
                    self._send(stream, request)
                elif "remove" in request:
                    self._remove(stream, request)
                else:
                    raise _Broken("an unknown request")
        except (OSError, _Stalled, _Broken):
            pass  # the peer went silent, left or broke the protocol: it reports that; nothing was published
        finally:
            sock.close()
            with self._lock:
                self._connections.pop(sock, None)
                self._last_connected = time.monotonic()
                self._ended.notify_all()

    def _prove(self, stream: _Stream) -> Optional[str]:
        """The handshake, as the receiving side: our nonce, then the peer's nonce and proof, then ours. None once
        the connection is proven, else why it is refused (nothing but its first message was read)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        try:
            stream.send_message({**HELLO, "nonce": nonce.hex()})
            hello = stream.read_message()
        except (OSError, _Stalled, _Broken) as e:
            return f"{_reason(e)} before it proved it belongs to this job"
        theirs = _greeting(hello)
        if theirs is None:
            return f"not a {HELLO['protocol']} version {HELLO['version']} peer"
        nonces = nonce + theirs
        if not _proves(hello.get("proof"), _keyed(self._secret, b"proof:peer", nonces)):
            return "it did not prove it belongs to this job (no proof, or another job's secret)"
        stream.send_message({"proof": _keyed(self._secret, b"proof:receiver", nonces).hex()})
        stream.authenticated(_keyed(self._secret, b"key:to-peer", nonces),
                             _keyed(self._secret, b"key:to-receiver", nonces))
        return None

    def _receive(self, stream: _Stream, request: dict) -> None:
        path, size, xxh3 = _announced(request, "put")  # no xxh3: it follows the bytes (``Streaming``)
        try:
            _target(self.root, path)
        except ValueError as e:
            stream.discard(size)
            if xxh3 is None:
                stream.read_trailer(path)
            problem: Optional[str] = str(e)
        else:
            mtime_ns = request.get("mtime_ns")
            problem = stream.receive_file(self.root, path, FileChecksum(size, xxh3),
                                          mtime_ns if isinstance(mtime_ns, int) else None)
        stream.send_message({"path": path, "error": problem})

    def _remove(self, stream: _Stream, request: dict) -> None:
        path = request["remove"]
        if not isinstance(path, str):
            raise _Broken("it asked to remove a file without a path")
        problem = None
        try:
            target = _target(self.root, path)
            if os.path.isdir(target) and not os.path.islink(target):
                problem = f"{path}: not a file here"
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(target)
        except ValueError as e:
            problem = str(e)
        except OSError as e:
            problem = f"{path}: cannot be removed here ({e.strerror})"
        stream.send_message({"path": path, "error": problem})

    def _send(self, stream: _Stream, request: dict) -> None:
        path = request["get"]
        if not isinstance(path, str):
            raise _Broken("it asked for a file without a path")
        try:
            fd = os.open(_target(self.root, path), os.O_RDONLY | os.O_CLOEXEC)
        except ValueError as e:
            stream.send_message({"path": path, "error": str(e)})
            return
        except OSError as e:
            stream.send_message({"path": path, "error": f"{path}: not here ({e.strerror})"})
            return
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                stream.send_message({"path": path, "error": f"{path}: not a file here"})
                return
            xxh3 = _file_checksum(fd, info.st_size).xxh3 if request.get("hash") else None
            stream.send_message({"path": path, "size": info.st_size, "xxh3": xxh3, "mtime_ns": info.st_mtime_ns})
            stream.send_file(fd, info.st_size)
        finally:
            os.close(fd)

    def wait_quiet(self, quiet_s: float) -> None:
        """Return once no peer has been connected for ``quiet_s`` seconds: a writer whose training process died
        serves the other nodes' writers until they have what they need of its node (a save's commit record)."""
        with self._lock:
            while True:
                quiet = time.monotonic() - self._last_connected
                if (not self._connections and quiet >= quiet_s) or self._closing:
                    return
                self._ended.wait(quiet_s if self._connections else quiet_s - quiet)

    def close(self) -> None:
        """Stop accepting, end every connection (a file being received is discarded), and return once
        every thread has ended."""
        with self._lock:
            self._closing = True
            self._ended.notify_all()
            connections = dict(self._connections)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._listener.close()
        self._acceptor.join()
        for sock in connections:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes its thread's wait
        for thread in connections.values():
            thread.join()

    def __enter__(self) -> "Receiver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
