"""Reading the bytes every rank of a job loads once per job, not once per rank (a cooperative load).

More: docs/MODULES.md, core/loading/cooperative.py.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import shutil
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator, Literal, Optional

import torch
import torch.distributed as dist

from asyncckpt.core.errors import CheckpointError, CheckpointTimeoutError, CorruptCheckpointError
from asyncckpt.core.loading.reader import FileSpans
from asyncckpt.core.snapshot.collectives import Collectives, over
from asyncckpt.core.snapshot.dist_env import dist_ready, rank_and_world
from asyncckpt.core import tier
from asyncckpt.core.storage.backend import backend_for, basename, is_url

logger = logging.getLogger("asyncckpt")

PIECE_BYTES = 64 << 20  # one broadcast; the buffer each rank that only relays a piece takes it into
READ_BYTES = 32 << 20  # one read (a ranged GET) of a reader's part
Readers = Literal["job", "node", "off"]


@dataclass(frozen=True)
class Piece:
    """Bytes ``start`` to ``start + length`` of file ``file`` (an index), read from storage by ``reader``."""

    file: int
    start: int
    length: int
    reader: int  # rank in the group


def split(sizes: list[int], readers: list[int]) -> list[Piece]:
    """The files of ``sizes``, one run of bytes, cut into one contiguous, byte-balanced part per reader (in the
    order of ``readers``), each part as the pieces of the files it covers."""
    total = sum(sizes)
    share = -(-total // len(readers)) if total else 0
    pieces: list[Piece] = []
    offset = 0  # in the run of bytes
    for index, size in enumerate(sizes):
        start = 0
        while start < size:
            reader = min(offset // share, len(readers) - 1)
            length = min(size - start, (reader + 1) * share - offset)
            pieces.append(Piece(index, start, length, readers[reader]))
            start, offset = start + length, offset + length
    return pieces


@dataclass
class _Node:
    """This rank's view of the job's nodes."""

    of_rank: list[str]  # node of each rank in the group

    def leader(self, rank: int) -> int:
        """The lowest rank of ``rank``'s node (it writes what other nodes send into the node's copy)."""
        return self.of_rank.index(self.of_rank[rank])

    @property
    def count(self) -> int:
        return len(set(self.of_rank))


@contextlib.contextmanager
def shared_copy(paths: list[str], group: Optional[dist.ProcessGroup], *, timeout: float,
                readers: Readers = "job", memory_root: Optional[str] = None) -> Iterator[Optional[dict[str, str]]]:
    """A collective of every rank of ``group`` loading ``paths`` (files or objects): ``{path: its copy in this
    node's memory}``, each byte read from storage once per job (see the module docstring), for the duration of
    the block; or None where each rank reads by itself (no process group, one rank, ``readers="off"``, ranks
    that load different files or sizes, a node without room; logged once, with the reason)."""
    rank, world = rank_and_world(group)
    if readers == "off" or not dist_ready() or world < 2:
        yield None
        return
    root = tier.loads_dir(tier.memory_root(memory_root))
    sizes = _sizes(paths)
    free = _free_bytes(root)
    ranks = over(group)
    _within(timeout, "meet", lambda: ranks.barrier(timeout))  # then the gather below finds every rank there
    gathered = ranks.gather((tier.node_id(), paths, sizes, free, uuid.uuid4().hex[:12], os.getpid()))
    nodes = _Node([entry[0] for entry in gathered])
    if nodes.count == 1 and not any(is_url(path) for path in paths):
        yield None  # files of one node: its page cache already reads each byte from storage once for all its ranks
        return
    reason = _cannot_share(gathered)
    if reason:
        logger.warning("asyncckpt: each rank loads %s by itself: %s", _named(paths), reason)
        yield None
        return
    leader = nodes.leader(rank)
    folder = os.path.join(root, f"{gathered[0][4]}-{gathered[leader][5]}")  # the load's token, the node leader's pid
    leader = leader == rank
    if leader:
        for dead in tier.dead_loads(root):
            shutil.rmtree(dead, ignore_errors=True)
    while True:
        try:
            os.makedirs(folder, exist_ok=True)
            break
        except FileNotFoundError:  # the last load of another job (or ``asyncckpt clean``) removed ``root`` meanwhile
            continue
    copies = {path: os.path.join(folder, f"{index}-{basename(path)}") for index, path in enumerate(paths)}
    try:
        with _Mapped([copies[path] for path in paths], sizes) as views:
            reading = [rank for rank in range(world) if readers == "job" or nodes.leader(rank) == rank]
            pieces = split(sizes, reading)
            _read_parts(paths, pieces, views, ranks, rank, timeout)
            if nodes.count > 1:
                _exchange(paths, pieces, views, ranks, rank, nodes, timeout)
            _within(timeout, "finish the copies", lambda: ranks.barrier(timeout))
        yield copies
    finally:
        with contextlib.suppress(Exception):  # every rank is done with the files (a rank that failed: the timeout)
            ranks.barrier(timeout)
        if leader:
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(root)  # the last load of the node: nothing left of ours


def _sizes(paths: list[str]) -> Optional[list[int]]:
    """Each file's size, as this rank sees it (None: one is missing or unreadable: the rank's own load says so)."""
    try:
        return [backend_for(path).stat(path).size for path in paths]
    except (OSError, CheckpointError):
        return None


def _free_bytes(root: str) -> int:
    """The bytes a node copy could take under ``root``: the free space of the file system of its nearest existing
    folder, 0 where this process could not make it there. ``root`` itself is made only by a load that copies (made
    here, every load that then reads by itself left it empty in the node's memory)."""
    where = root
    while not os.path.isdir(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    try:
        found = os.statvfs(where)
    except OSError:
        return 0
    return found.f_bavail * found.f_frsize if os.access(where, os.W_OK | os.X_OK) else 0


def _cannot_share(gathered: list) -> Optional[str]:
    """Why the ranks cannot load these files together (None: they can)."""
    first = gathered[0]
    for rank, (_node, paths, sizes, _free, _token, _pid) in enumerate(gathered):
        if paths != first[1]:
            return f"the ranks load different files (rank 0: {_named(first[1])}, rank {rank}: {_named(paths)})"
        if sizes is None or sizes != first[2]:
            return f"rank {rank} cannot read them all, or sees other sizes ({sizes} where rank 0 sees {first[2]})"
    total = sum(first[2])
    short = sorted({entry[0] for entry in gathered if entry[3] < total})
    if short:
        return f"node {', '.join(short)} lacks the memory for a copy ({total} B)"
    return None


def _named(paths: list[str]) -> str:
    return paths[0] if len(paths) == 1 else f"{len(paths)} files of {os.path.dirname(paths[0])}"


class _Mapped:
    """The node's copies, each created at its size (by whichever rank of the node comes first: each sets the
    same size) and mapped read-write; ``__enter__`` gives a writable view of each (None for an empty file)."""

    def __init__(self, files: list[str], sizes: list[int]) -> None:
        self.files, self.sizes = files, sizes
        self.maps: list[Optional[mmap.mmap]] = []
        self.views: list[Optional[memoryview]] = []

    def __enter__(self) -> list[Optional[memoryview]]:
        for file, size in zip(self.files, self.sizes):
            fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
                self.maps.append(mmap.mmap(fd, size) if size else None)
            finally:
                os.close(fd)
        self.views = [memoryview(m) if m is not None else None for m in self.maps]
        return self.views

    def __exit__(self, *exc: object) -> None:
        for view, mapping in zip(self.views, self.maps):
            if mapping is not None:
                with contextlib.suppress(BufferError):  # a view still exported: unmapped when collected
                    view.release()
                    mapping.close()


def _read_parts(paths: list[str], pieces: list[Piece], views: list, ranks: Collectives, rank: int,
                timeout: float) -> None:
    """This rank's part from storage into the node's copy; then every rank learns whether every part was read:
    one that was not fails the load on every rank, naming the rank and the file."""
    error: Optional[str] = None
    for piece in (p for p in pieces if p.reader == rank):
        try:
            _read(paths[piece.file], piece.start, views[piece.file][piece.start:piece.start + piece.length])
        except Exception as e:  # noqa: BLE001 - named to every rank below
            error = f"rank {rank} could not read bytes {piece.start}..{piece.start + piece.length} of " \
                    f"{paths[piece.file]}: {type(e).__name__}: {e}"
            break
    failures = _failures(error, ranks, timeout)
    if failures:
        raise CheckpointError("; ".join(failures), path=paths[0])


def _failures(failure: Optional[object], ranks: Collectives, timeout: float) -> list:
    """Every rank's ``failure`` (None: it succeeded) that is not None, in rank order: each rank learns whether
    every rank succeeded (one small all_gather, waited on with ``timeout``), and only then what failed."""
    flags: list = []
    _within(timeout, "read every rank's part", lambda: flags.extend(ranks.gather_ints([failure is not None], timeout)))
    if not any(flag for flag, in flags):
        return []
    return [entry for entry in ranks.gather(failure) if entry is not None]


def _read(path: str, start: int, into: memoryview) -> None:
    """Bytes ``start..start + len(into)`` of ``path`` into ``into``: ranged GETs of ``READ_BYTES`` from an object
    store (several in flight), ``preadv`` from a file."""
    if is_url(path):
        ranges = [(path, start + offset, start + min(offset + READ_BYTES, len(into)))
                  for offset in range(0, len(into), READ_BYTES)]

        def land(index: int, body: Optional[bytes]) -> None:
            if body is None:
                raise FileNotFoundError(path)
            offset = ranges[index][1] - start
            into[offset:offset + len(body)] = body

        backend_for(path).read_ranges(ranges, land)
        return
    with open(path, "rb", buffering=0) as f:
        # Exactly this part: the kernel's own read-ahead would run on into the next rank's part (its bytes read
        # twice where that rank is on another node), so it is off, and the part is prefetched ahead of the reads.
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        ahead = 0
        done = 0
        while done < len(into):
            while ahead < min(len(into), done + 2 * READ_BYTES):
                os.posix_fadvise(f.fileno(), start + ahead, min(READ_BYTES, len(into) - ahead), os.POSIX_FADV_WILLNEED)
                ahead += READ_BYTES
            read = os.preadv(f.fileno(), [into[done:done + READ_BYTES]], start + done)
            if read == 0:
                raise EOFError(f"the file ends at byte {start + done}")
            done += read


def _exchange(paths: list[str], pieces: list[Piece], views: list, ranks: Collectives, rank: int, nodes: _Node,
              timeout: float) -> None:
    """Every part to every other node: a broadcast per ``PIECE_BYTES`` among the nodes' lowest ranks alone (every
    rank calls it: it makes their group), from the copy of the reader's node into the others'."""
    leaders = sorted({nodes.leader(r) for r in range(ranks.world)})
    among = ranks.among(leaders)
    if among is None:  # this node's copy is its lowest rank's to complete
        return
    sent: list[tuple[Piece, int, dist.Work]] = []
    for piece in pieces:
        source = leaders.index(nodes.leader(piece.reader))
        for offset in range(0, piece.length, PIECE_BYTES):
            length = min(PIECE_BYTES, piece.length - offset)
            start = piece.start + offset
            tensor = torch.frombuffer(views[piece.file][start:start + length], dtype=torch.uint8)
            sent.append((piece, start, among.broadcast_bytes(tensor, source)))
    for piece, start, work in sent:
        try:
            work.wait(timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001 - which part, from which rank
            raise CheckpointError(f"bytes {start}.. of {paths[piece.file]}, read by rank {piece.reader}, did not "
                                  f"arrive: {e}", path=paths[piece.file], rank=piece.reader) from e


def _within(timeout: float, what: str, collective) -> None:
    """``collective()``, its failure (a rank gone, or not there within ``timeout``) said as what the load waited for."""
    try:
        collective()
    except CheckpointError:
        raise
    except (RuntimeError, ValueError) as e:
        raise CheckpointTimeoutError(f"the ranks' cooperative load failed to {what} within {timeout:.0f} s: {e}") from e


# ------------------------------------------------------------------ replicated tensors of a sharded checkpoint
SMALL_BYTES = 1 << 20  # spans below this travel packed together (one transfer per ``PIECE_BYTES`` at most)


@dataclass
class _Transfer:
    """Spans (this rank's, of the same keys on every rank involved) read by ``reader`` and sent to ``receivers``
    (None: every other rank, by broadcast); one span, or small ones packed into one buffer."""

    reader: int
    receivers: Optional[tuple[int, ...]]
    spans: list


@dataclass
class SharedSpans:
    """A load whose ranks read some of the same spans (replicated tensors): ``mine`` is what this rank reads from
    storage (its byte-balanced share of the shared spans, and every span no other rank reads); ``load`` reads it
    and then hands every shared span from the rank that read it straight into the other ranks' targets."""

    mine: list
    transfers: list[_Transfer]  # this rank's, in the job's order
    ranks: Collectives
    rank: int
    timeout: float

    def load(self, read: Callable[[list[FileSpans]], None]) -> None:
        """``read(self.mine)``, then, once every rank has read its share, the exchange. A rank that failed
        (damage it found, a file it could not read) fails every rank's load with its error, naming the file
        and key: the ranks waiting for its spans would otherwise wait for the timeout."""
        failure: Optional[BaseException] = None
        try:
            read(self.mine)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            failure = e
        failures = _failures(None if failure is None else (type(failure).__name__, f"rank {self.rank}: {failure}"),
                             self.ranks, self.timeout)
        if failure is not None:
            raise failure
        if failures:
            kind = CorruptCheckpointError if failures[0][0] == CorruptCheckpointError.__name__ else CheckpointError
            raise kind("; ".join(message for _kind, message in failures))
        for transfer in self.transfers:
            if len(transfer.spans) == 1 and transfer.spans[0].nbytes >= SMALL_BYTES:
                self._transfer(_as_bytes(transfer.spans[0].target), transfer)
            else:
                self._transfer_packed(transfer)

    def _transfer_packed(self, transfer: _Transfer) -> None:
        buffer = torch.empty(sum(span.nbytes for span in transfer.spans), dtype=torch.uint8)
        offsets = [0]
        for span in transfer.spans:
            offsets.append(offsets[-1] + span.nbytes)
        if self.rank == transfer.reader:
            for span, start in zip(transfer.spans, offsets):
                buffer[start:start + span.nbytes] = _as_bytes(span.target)
        self._transfer(buffer, transfer)
        if self.rank != transfer.reader:
            for span, start in zip(transfer.spans, offsets):
                _as_bytes(span.target).copy_(buffer[start:start + span.nbytes])

    def _transfer(self, tensor: torch.Tensor, transfer: _Transfer) -> None:
        if not tensor.numel():
            return
        try:
            if transfer.receivers is None:
                works = [self.ranks.broadcast_bytes(tensor, transfer.reader)]
            elif self.rank == transfer.reader:
                works = [self.ranks.send_bytes(tensor, r) for r in transfer.receivers]
            else:
                works = [self.ranks.receive_bytes(tensor, transfer.reader)]
            for work in works:
                work.wait(timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001 - which key, from which rank
            raise CheckpointTimeoutError(f"key '{transfer.spans[0].key}', read by rank {transfer.reader}, did not "
                                         f"arrive within {self.timeout:.0f} s: {e}", rank=transfer.reader) from e


def share_spans(files: list[FileSpans], group: Optional[dist.ProcessGroup], *, timeout: float, remote: bool,
                readers: Readers = "job") -> Optional[SharedSpans]:
    """A collective of the ranks of a load through our reader (the direct load, ``loading.direct_load``, and DCP's,
    ``loading.dcp_reader``): where ranks read the same spans of the same files (``FileSpans``) from an object
    store (``remote``) or on several nodes, each such span is read from storage by one of the ranks that need it
    (byte-balanced; with ``readers="node"``, one per node) and ``SharedSpans.load`` hands it to the others. Every
    rank reading the same (DDP's replicated state) is shared by broadcast; some ranks reading the same (HSDP's
    replica groups; a tensor kept whole by every rank of a sharded checkpoint) by sends to those ranks alone.
    None where no two ranks read the same span, or for local files on one node (its page cache reads them once)."""
    rank, world = rank_and_world(group)
    if readers == "off" or not dist_ready() or world < 2:
        return None
    flat = [(entry, span) for entry in files for span in entry.spans]
    listed = [(entry.relative_path, span.offset, span.nbytes) for entry, span in flat]
    digest = hashlib.blake2b(repr(listed).encode(), digest_size=16).hexdigest()
    ranks = over(group)
    _within(timeout, "meet", lambda: ranks.barrier(timeout))  # then the gathers below find every rank there
    gathered = ranks.gather((tier.node_id(), digest))
    nodes = _Node([entry[0] for entry in gathered])
    if nodes.count == 1 and not remote:
        return None  # files of one node: its page cache already reads each byte once for all its ranks
    if all(entry[1] == digest for entry in gathered):  # every rank reads the same spans: broadcasts
        reading = [r for r in range(world) if readers == "job" or nodes.leader(r) == r]
        owner = _owners([span.nbytes for _entry, span in flat], reading)
        shared = [(span.nbytes, reader, None, index) for index, ((_entry, span), reader) in enumerate(zip(flat, owner))]
        of = flat  # refs: indices into it
    else:
        shared = _shared_spans(ranks.gather(listed), nodes, readers)
        if not shared:
            return None
        of = dict(zip(listed, flat))
    transfers = [_Transfer(reader, receivers, [of[ref][1] for ref in refs])
                 for reader, receivers, refs in _packed(shared) if receivers is None or rank == reader or rank in receivers]
    received = {id(span) for transfer in transfers if transfer.reader != rank for span in transfer.spans}
    mine: dict = {}
    for entry, span in flat:
        if id(span) not in received:
            mine.setdefault(entry.relative_path, (entry, []))[1].append(span)
    own = [FileSpans(entry.relative_path, spans, entry.needed_size, entry.needed_by) for entry, spans in mine.values()]
    return SharedSpans(own, transfers, ranks, rank, timeout)


def _shared_spans(every: list[list[tuple]], nodes: _Node, readers: Readers) -> list[tuple]:
    """``(nbytes, reader, receivers, key)`` of each span that several ranks read (``every``: each rank's keys), in
    one order every rank computes alike: the reader is the rank among them with the fewest bytes to read so far
    (per node with ``readers="node"``); a key some rank reads twice is left to each rank."""
    needers: dict[tuple, list[int]] = {}
    twice: set = set()
    for rank, keys in enumerate(every):
        seen: set = set()
        for key in keys:
            if key in seen:
                twice.add(key)
            seen.add(key)
            needers.setdefault(key, []).append(rank)
    load = [0] * len(every)
    shared = []
    for key in sorted(needers.keys() - twice):
        ranks = needers[key]
        cliques = [ranks] if readers == "job" else [[r for r in ranks if nodes.of_rank[r] == node]
                                                    for node in sorted({nodes.of_rank[r] for r in ranks})]
        for clique in (c for c in cliques if len(c) > 1):
            reader = min(clique, key=lambda r: (load[r], r))
            load[reader] += key[2]
            shared.append((key[2], reader, tuple(r for r in clique if r != reader), key))
    return shared


def _packed(shared: list[tuple]) -> list[tuple]:
    """``shared`` spans ``(nbytes, reader, receivers, ref)``, the job's list, as transfers ``(reader, receivers,
    refs)``: consecutive small spans of the same reader and receivers packed together up to ``PIECE_BYTES``.
    Packed from the job's list, not a rank's own, so that every rank involved cuts the same packs."""
    packs: list[tuple] = []
    size = 0
    for nbytes, reader, receivers, ref in shared:
        if (nbytes < SMALL_BYTES and packs and packs[-1][3] and (packs[-1][0], packs[-1][1]) == (reader, receivers)
                and size + nbytes <= PIECE_BYTES):
            packs[-1][2].append(ref)
            size += nbytes
            continue
        packs.append((reader, receivers, [ref], nbytes < SMALL_BYTES))
        size = nbytes
    return [(reader, receivers, refs) for reader, receivers, refs, _small in packs]


def _owners(sizes: list[int], readers: list[int]) -> list[int]:
    """The reader of each of ``sizes`` (whole items, in order): contiguous runs of about equal bytes."""
    total = sum(sizes) or 1
    owners, done = [], 0
    for size in sizes:
        owners.append(readers[min(len(readers) - 1, (done + size // 2) * len(readers) // total)])
        done += size
    return owners


def _as_bytes(target) -> torch.Tensor:
    """A span's target (a contiguous CPU tensor, or a bytearray) as a flat uint8 tensor over the same memory."""
    if isinstance(target, bytearray):
        return torch.frombuffer(target, dtype=torch.uint8) if len(target) else torch.empty(0, dtype=torch.uint8)
    return target.detach().reshape(-1).view(torch.uint8)
