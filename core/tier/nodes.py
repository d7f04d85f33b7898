"""A memory-tier save on several nodes: how every node ends with a committed copy of the checkpoint, of the files
written on it and the replicas it took.

More: docs/MODULES.md, core/tier/nodes.py.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from asyncckpt.core.errors import CheckpointTimeoutError, CheckpointWriteError
from asyncckpt.core.formats import commit_record, names
from asyncckpt.core.formats.checksum import FileChecksum
from asyncckpt.core.storage import owners
from asyncckpt.core import tier
from asyncckpt.core.storage.backend import Backend, at_once, backend_for
from asyncckpt.core.storage.contents import published_files
from asyncckpt.core.storage.sidecar_io import RecordedFile, write_files_record
from asyncckpt.core.storage.staging import remove_coordination_files
from asyncckpt.core.storage.file_checksums import read_record
from asyncckpt.core.writer.barrier import (
    COORDINATOR,
    BarrierSpec,
    Heartbeats,
    MarkerBarrier,
    failure_error,
    poll,
    silence_limit,
)
from asyncckpt.core.writer.protocol import RequestContext
from asyncckpt.core.tier.transport import (
    Address,
    PeerConnection,
    ReplicationError,
    Streaming,
    Transfer,
    fetch,
    file_checksum,
    parse_address,
    send,
)

logger = logging.getLogger("asyncckpt")

#: How long a peer that did not answer is left out before a save tries it again: a peer that hangs costs a save
#: the wait for it (``NodeMap.timeout``), and saves coming faster than that would pile up behind it.
RETRY_AFTER_S = 30.0


@dataclass(frozen=True)
class NodeMap:
    """The nodes of a job, as a writer reaching other nodes needs them (plain data, in a request)."""

    root: str  # this node's memory root
    node: str  # this node's id (``tier.node_id``)
    addresses: tuple[tuple[str, str], ...]  # (node id, "host:port") of every other node's receiver
    timeout: float  # the longest wait for a peer, each wait (``replication``), before it is left out
    secret: bytes = field(repr=False)  # what the job's nodes prove themselves with (``transport.job_secret``)

    def address(self, node: str) -> Address:
        return parse_address(dict(self.addresses)[node])

    def relative(self, path: str) -> str:
        """``path`` (under this node's memory root) as every node names it: relative to its memory root."""
        return os.path.relpath(path, self.root)


@dataclass(frozen=True)
class Replicas:
    """How one rank's part of a memory-tier save on several nodes reaches the others (plain data, in its request)."""

    nodes: NodeMap
    peers: tuple[str, ...]  # the nodes that hold this node's replicas (``transport.peers_for``)
    coordinator: str  # rank 0's node: where the save is committed first
    members: tuple[str, ...]  # every node a rank of the save is on
    publishes: bool  # this rank publishes its node's copy (the save's lowest rank on a node not rank 0's)


@dataclass(frozen=True)
class TierSave:
    """A memory-tier save, as each rank's request carries it (plain data): the job's topology, which its commit
    record binds the checkpoint to (a job of another shape does not use it: ``tier.TIER_ENTRY``), and on several
    nodes how this rank's part reaches the others."""

    ranks_per_node: tuple[int, ...]  # the save's ranks on each of its nodes, in the order of their lowest ranks
    replicas: Optional[Replicas] = None  # on several nodes
    persist_to: Optional[str] = None  # its durable path where its cadence writes it there too, a local one: a sharded
    # save is saved there from the same snapshot beside its save in memory (``requests.save_beside``)

    @property
    def topology(self) -> dict:
        return {"world_size": sum(self.ranks_per_node), "ranks_per_node": list(self.ranks_per_node)}


class Peers:
    """Which peers did not answer lately, in this process: each is left out until ``RETRY_AFTER_S`` passed, and
    said once (a warning per peer for the life of the process, not one per save)."""

    def __init__(self) -> None:
        self._down: dict[str, float] = {}
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def left_out(self, node: str) -> bool:
        with self._lock:
            return time.monotonic() < self._down.get(node, 0.0)

    def failed(self, node: str, address: str, reason: str) -> None:
        with self._lock:
            self._down[node] = time.monotonic() + RETRY_AFTER_S
            if node in self._said:
                return
            self._said.add(node)
        logger.warning("asyncckpt: node %s (%s) does not take memory-tier replicas: %s; checkpoints are committed "
                       "in memory with the replicas the other nodes took while it does not answer (it is tried again "
                       "every %.0f s; said once)", node, address, reason, RETRY_AFTER_S)

    def answered(self, node: str) -> None:
        with self._lock:
            self._down.pop(node, None)


PEERS = Peers()


def _send(nodes: NodeMap, node: str, paths: Mapping[str, FileChecksum]) -> list[str]:
    """Send ``paths`` (relative to the memory root, with their checksums) to ``node``: those it now holds."""
    address = dict(nodes.addresses)[node]
    try:
        outcomes = send(parse_address(address), nodes.root, list(paths), secret=nodes.secret,
                        timeout=nodes.timeout, checksums=paths)
    except ReplicationError as e:
        PEERS.failed(node, address, e.reason)
        return [transfer.path for transfer in e.finished if transfer.ok]
    PEERS.answered(node)
    refused = [transfer.error for transfer in outcomes if not transfer.ok]
    if refused:  # it answered, but took not all: no room there, say
        PEERS.failed(node, address, "; ".join(refused))
    return [transfer.path for transfer in outcomes if transfer.ok]


_STREAMS = ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-replicate")  # ``stream_file``'s thread, once used


def stream_file(replicas: Replicas, path: str, streaming: Streaming) -> "Future[list[str]]":
    """Send ``path`` (in this node's memory root), a file still being written (``Streaming``), to each peer that is
    not left out, one after the other, on a thread of its own: the peers that then hold it, or what ``streaming``
    raised (the copy failed)."""
    return _STREAMS.submit(_stream_file, replicas, path, streaming)


def _stream_file(replicas: Replicas, path: str, streaming: Streaming) -> list[str]:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        relative = replicas.nodes.relative(path)
        return _to_each(replicas.nodes, replicas.peers, lambda connection: connection.put(relative, fd, streaming))
    finally:
        os.close(fd)


def _to_each(nodes: NodeMap, peers: Sequence[str], exchange: Callable[[PeerConnection], Optional[str]]) -> list[str]:
    """``exchange`` with each of ``peers`` that is not left out, one after the other, on a connection of its own
    (None: done, else why the peer did not take it: it is left out, ``Peers``): the peers that took it."""
    took = []
    for peer in peers:
        if PEERS.left_out(peer):
            continue
        address = dict(nodes.addresses)[peer]
        try:
            with PeerConnection(parse_address(address), secret=nodes.secret, timeout=nodes.timeout) as connection:
                refused = exchange(connection)
        except ReplicationError as e:
            PEERS.failed(peer, address, e.reason)
            continue
        if refused:  # it answered, but did not take it: no room there, say
            PEERS.failed(peer, address, refused)
        else:
            PEERS.answered(peer)
            took.append(peer)
    return took


def _replicate(replicas: Replicas, paths: Mapping[str, FileChecksum]) -> dict[str, list[str]]:
    """``paths`` to each peer that is not left out: relative path -> the peers that now hold it."""
    held: dict[str, list[str]] = {path: [] for path in paths}
    for peer in replicas.peers:
        if PEERS.left_out(peer):
            continue
        for path in _send(replicas.nodes, peer, paths):
            held[path].append(peer)
    return held


def spread(replicas: Replicas, staging_dir: str, rank: int, files: Mapping[str, FileChecksum], *,
           coordinator_needs: Sequence[str] = (), sent: Optional[Mapping[str, list[str]]] = None) -> None:
    """Step 1 of the module docstring, for ``rank``'s ``files`` (names in ``staging_dir``, with their checksums;
    ``coordinator_needs``: those of them rank 0 reads to commit; ``sent``: those ``stream_file`` sent already, with
    the peers that hold them). Raises ``CheckpointWriteError`` if rank 0's node does not take the files record and
    ``coordinator_needs``."""
    nodes, sent = replicas.nodes, sent or {}
    base = nodes.relative(staging_dir)
    held = _replicate(replicas, {os.path.join(base, name): checksum for name, checksum in files.items()
                                 if name not in sent})
    holders = {name: [nodes.node, *(sent[name] if name in sent else held[os.path.join(base, name)])]
               for name in files}
    record = write_files_record(staging_dir, rank, files, holders)
    needed = {name: files[name] for name in coordinator_needs if replicas.coordinator not in holders[name]}
    to_coordinator(replicas, staging_dir, rank, {**needed, record: file_checksum(os.path.join(staging_dir, record))})


def to_coordinator(replicas: Replicas, staging_dir: str, rank: int, files: Mapping[str, FileChecksum]) -> None:
    """What rank 0 needs to commit (``files``, names in ``staging_dir`` with their checksums), to rank 0's node
    where that is another; ``CheckpointWriteError`` if it does not take them (the save cannot commit)."""
    nodes = replicas.nodes
    if replicas.coordinator == nodes.node:
        return
    paths = {os.path.join(nodes.relative(staging_dir), name): checksum for name, checksum in files.items()}
    address = dict(nodes.addresses)[replicas.coordinator]
    try:
        outcomes = send(parse_address(address), nodes.root, list(paths), secret=nodes.secret,
                        timeout=nodes.timeout, checksums=paths)
        refused = "; ".join(transfer.error for transfer in outcomes if not transfer.ok)
    except ReplicationError as e:
        refused = str(e)
    if refused:
        raise CheckpointWriteError(f"rank {rank}: rank 0's node {replicas.coordinator} did not take what it needs to "
                                   f"commit: {refused}")


def commit_entries(save: TierSave, staging_dir: str, records: Mapping[str, RecordedFile],
                   recorded: Mapping[str, dict], coordinator_files: Sequence[str]) -> dict:
    """Step 2 (rank 0, every rank arrived, every file of its own written in ``staging_dir``): what the commit record
    of a memory-tier save adds, its ``tier.TIER_ENTRY``: the job's topology, the rank that wrote each file of a rank's
    files record (``records``, gathered by ``sidecar_io.take_files_records``; ``tier.writer_of``), and on several nodes
    the record's ``"files"`` (every rank's, and what is here: rank 0's ``coordinator_files``, which every node
    fetches), which node holds each, and their checksums the record does not carry yet (``recorded``)."""
    entry: dict = {"topology": save.topology,
                   "ranks": {name: file.rank for name, file in sorted(records.items()) if file.rank}}
    if save.replicas is None:
        return {tier.TIER_ENTRY: entry}
    written_here = {name: file_checksum(os.path.join(staging_dir, name)) for name in coordinator_files}
    files = {**published_files(backend_for(staging_dir), staging_dir)[0],
             **{name: file.checksum.size for name, file in records.items()}}
    holders = {name: list(file.holders) for name, file in records.items()}
    holders.update({name: list(save.replicas.members) for name in written_here})
    checksums = {**{name: file.checksum for name, file in records.items()}, **written_here}
    entry.update({"holders": dict(sorted(holders.items())),
                  "checksums": {name: {"size": c.size, "xxh3": c.xxh3} for name, c in sorted(checksums.items())
                                if name not in recorded}})
    return {"files": dict(sorted(files.items())), tier.TIER_ENTRY: entry}


def publish_copy(replicas: Replicas, staging_dir: str, final_path: str, token: str) -> None:
    """Step 3, once the save is committed (on rank 0's node): this node's copy published with the commit record.
    If rank 0's node does not answer, this node's copy is given up (warned once: ``Peers``); the checkpoint stays
    committed on the nodes that have it."""
    nodes = replicas.nodes
    coordinator = replicas.coordinator
    final, staging = nodes.relative(final_path), nodes.relative(staging_dir)
    here = os.path.join(staging_dir, names.COMMIT_RECORD)
    try:
        _fetched(nodes, coordinator, [os.path.join(final, names.COMMIT_RECORD)], staging, final, {})
        with open(here, "rb") as f:
            body = f.read()
        record = commit_record.parse(body)
        if record is None:
            raise CheckpointWriteError(f"{final_path}: rank 0's node sent no commit record")
        wanted = [name for name, held in tier.holders(record).items()
                  if nodes.node in held and not os.path.exists(os.path.join(staging_dir, name))]
        _fetched(nodes, coordinator, [os.path.join(final, name) for name in wanted], staging, final,
                 tier.record_checksums(record))
    except (ReplicationError, CheckpointWriteError) as e:
        PEERS.failed(coordinator, dict(nodes.addresses)[coordinator], str(e))
        backend_for(staging_dir).remove_tree(staging_dir, token, later=at_once)
        return
    for directory, _subdirectories, _files in os.walk(staging_dir):  # a DCP part's barrier files too
        remove_coordination_files(directory)
    replaced = backend_for(final_path).publish(staging_dir, final_path, body)
    if replaced is not None:
        backend_for(replaced).remove_tree(replaced, token, later=at_once)


def _fetched(nodes: NodeMap, node: str, paths: list[str], staging: str, final: str,
             checksums: Mapping[str, FileChecksum]) -> None:
    """Fetch ``paths`` (under the checkpoint ``final`` on ``node``) into the staging directory ``staging``
    (both relative to the memory root); raises ``CheckpointWriteError`` for a file that did not come whole."""
    if not paths:
        return
    outcomes = fetch(nodes.address(node), nodes.root, paths, secret=nodes.secret, timeout=nodes.timeout,
                     checksums={path: checksums[os.path.relpath(path, final)] for path in paths
                                if os.path.relpath(path, final) in checksums},
                     local_paths={path: os.path.join(staging, os.path.relpath(path, final)) for path in paths})
    failed = [transfer.error for transfer in outcomes if not transfer.ok]
    if failed:
        raise CheckpointWriteError("; ".join(failed))


class CoordinatorMarkers(MarkerBarrier):
    """The markers of a memory-tier save on several nodes (``barrier.MarkerBarrier``), for a rank whose node is not
    rank 0's: the ranks' staging directories are each on its own node, so each marker this rank's writer writes goes
    to rank 0's node too (its staging directory there, over the replication transport), where rank 0's writer waits
    for every rank's; and this rank waits for the commit by asking rank 0's node for the commit record. So the
    writers of a save meet without the Store that rank 0's training process holds (``barrier.SurvivingBarrier``):
    a save that returned on every rank commits when every training process dies."""

    def __init__(self, spec: BarrierSpec, replicas: Replicas, heartbeats: Optional[Heartbeats] = None,
                 judge_silence: Callable[[], bool] = lambda: False) -> None:
        super().__init__(spec, heartbeats, judge_silence)
        self.nodes, self.coordinator = replicas.nodes, replicas.coordinator
        self.backend = _AlsoOnNode(self.backend, self.nodes, self.coordinator)

    def wait_commit(self) -> None:
        spec, nodes = self.spec, self.nodes
        record_path = os.path.join(nodes.relative(spec.final_path), names.COMMIT_RECORD)
        abort_path = os.path.join(nodes.relative(self.place), names.ABORT_MARKER)
        limit = silence_limit(spec.timeout)
        connection: list[PeerConnection] = []
        answered = time.monotonic()

        def committed_or_failed() -> bool:
            nonlocal answered
            try:
                if not connection:
                    connection.append(PeerConnection(nodes.address(self.coordinator), secret=nodes.secret,
                                                     timeout=nodes.timeout))
                record = commit_record.parse(connection[0].read(record_path))
                reason = None if record is not None else connection[0].read(abort_path)
            except ReplicationError as e:
                connection.clear()
                if time.monotonic() - answered > limit:
                    raise failure_error(COORDINATOR, f"its node {self.coordinator} did not answer for {limit:.0f}s "
                                                     f"({e.reason})") from None
                return False
            answered = time.monotonic()
            if record is not None and record.get("save_id") == (spec.save_id or spec.key):
                return True
            if reason is not None:
                failure = json.loads(reason)
                raise failure_error(failure["rank"], failure["error"])
            return False

        try:
            poll(committed_or_failed, spec.timeout, lambda: CheckpointTimeoutError(
                f"rank 0 did not commit it within {spec.timeout:.0f}s"), max_delay=COMMIT_POLL_S)
        finally:
            for open_connection in connection:
                open_connection.close()


#: How often a rank of another node asks rank 0's node whether a save is committed, once the Store is gone: each
#: look is a request over the network.
COMMIT_POLL_S = 0.05


class _AlsoOnNode:
    """A ``storage.backend.Backend`` whose markers are also written on another node (the same path relative to the
    memory root, over the replication transport); everything else is the local ``backend``'s."""

    def __init__(self, backend: Backend, nodes: NodeMap, node: str) -> None:
        self._backend, self._nodes, self._node = backend, nodes, node

    def __getattr__(self, name: str):
        return getattr(self._backend, name)

    def write_marker(self, path: str, data: bytes, *, exclusive: bool = False, append: bool = False) -> None:
        self._backend.write_marker(path, data, exclusive=exclusive, append=append)
        [sent] = send(self._nodes.address(self._node), self._nodes.root, [self._nodes.relative(path)],
                      secret=self._nodes.secret, timeout=self._nodes.timeout)
        if not sent.ok:
            raise CheckpointWriteError(f"rank 0's node {self._node} did not take {sent.path}: {sent.error}")


def missing_files(path: str, record: dict) -> list[str]:
    """The files of the checkpoint whose commit record is ``record`` that its copy at ``path`` lacks (absent, or
    not of the size recorded)."""
    missing = []
    for name, size in sorted(record.get("files", {}).items()):
        try:
            if os.stat(os.path.join(path, name)).st_size == size:
                continue
        except (FileNotFoundError, NotADirectoryError):
            pass
        missing.append(name)
    return missing


def fetch_missing(nodes: NodeMap, path: str, record: dict, holders: Mapping[str, Sequence[str]]) -> list[str]:
    """Step 4: each file of the checkpoint ``record`` that this node's copy at ``path`` lacks, fetched from a node
    of ``holders[file]`` (in their order; this node and nodes without a known address are skipped), each checked
    against the record as it arrives; a copy that is damaged or gone is named in a warning and the next holder
    tried. Where this node holds no copy, the files go to a staging directory published with ``record`` once all
    are here. Returns the files no holder gave (the copy is then as it was; an empty list: it is whole)."""
    committed = tier.record_checksums(record)
    known = dict(nodes.addresses)
    fresh = commit_record.parse(_read(os.path.join(path, names.COMMIT_RECORD))) is None
    into = names.staging_dir_for(path, owners.owner_token()) if fresh else path
    left = list(record.get("files", {})) if fresh else missing_files(path, record)
    tried: dict[str, set[str]] = defaultdict(set)
    unavailable: list[str] = []
    while left:
        batches: dict[str, list[str]] = defaultdict(list)
        for name in left:
            holder = next((node for node in holders.get(name, ()) if node != nodes.node and node in known
                           and node not in tried[name]), None)
            if holder is None:
                unavailable.append(name)
            else:
                tried[name].add(holder)
                batches[holder].append(name)
        left = []
        for holder, batch in batches.items():
            sources = {os.path.join(nodes.relative(path), name): name for name in batch}
            try:
                outcomes = fetch(nodes.address(holder), nodes.root, list(sources), secret=nodes.secret, timeout=nodes.timeout,
                                 checksums={source: committed[name] for source, name in sources.items()
                                            if name in committed},
                                 local_paths={source: os.path.join(nodes.relative(into), name)
                                              for source, name in sources.items()})
            except ReplicationError as e:
                done = {transfer.path for transfer in e.finished}
                outcomes = e.finished + [Transfer(source, e.reason) for source in sources if source not in done]
            for transfer in outcomes:
                if not transfer.ok:
                    logger.warning("asyncckpt: not using the copy of %s on node %s: %s", transfer.path, holder,
                                   transfer.error)
                    left.append(sources[transfer.path])
    if fresh:
        if unavailable:
            backend_for(into).remove_tree(into, owners.owner_token(), later=at_once)
        else:
            backend_for(path).publish(into, path, json.dumps(record, indent=1).encode())
    return sorted(unavailable)


@dataclass(frozen=True)
class FileReplicas:
    """A writer request, right behind the commit of the single-file checkpoint ``path`` in this node's memory: the
    file to each of ``peers`` (with its checksum and modification time), and the peers' copies of the files this
    node's retention (``keep``, ``tier.stale``) is about to remove, removed. A peer that does not answer is left out
    (``Peers``); the checkpoint stays committed on the nodes that have it."""

    path: str
    nodes: NodeMap
    peers: tuple[str, ...]
    keep: int

    def run(self, context: RequestContext) -> None:
        nodes = self.nodes
        checksum = read_record(self.path) or file_checksum(self.path)
        dropped = [nodes.relative(path) for path in tier.stale(os.path.dirname(self.path), self.keep)
                   if os.path.isfile(path)]
        relative = nodes.relative(self.path)

        def exchange(connection: PeerConnection) -> Optional[str]:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                refused = connection.put(relative, fd, checksum, as_file=True)
            finally:
                os.close(fd)
            for path in dropped:
                refused = refused or connection.remove(path)
            return refused

        _to_each(nodes, self.peers, exchange)


def fetch_file(nodes: NodeMap, path: str, checksum: FileChecksum, holders: Sequence[str]) -> bool:
    """The single-file checkpoint ``path`` (on this node's memory), fetched from the first of ``holders`` that gives
    it whole and matching ``checksum`` (its checksum attached, its modification time kept); a copy that is damaged
    or gone is named in a warning and the next holder tried. Whether it is here now."""
    relative = nodes.relative(path)
    known = dict(nodes.addresses)
    for holder in holders:
        if holder == nodes.node or holder not in known:
            continue
        try:
            [transfer] = fetch(nodes.address(holder), nodes.root, [relative], secret=nodes.secret, timeout=nodes.timeout,
                               checksums={relative: checksum}, as_files=True)
        except ReplicationError as e:
            transfer = Transfer(relative, e.reason)
        if transfer.ok:
            return True
        logger.warning("asyncckpt: not using the copy of %s on node %s: %s", relative, holder, transfer.error)
    return False


def _read(path: str) -> Optional[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
