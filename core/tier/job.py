"""The memory tier of one ``Checkpointer`` (``Tier``; ``NoTier`` where it is off): the one thing the Checkpointer
and the adapter kit call about the tier. Where each checkpoint goes, what its requests carry, what follows its commit.

More: docs/MODULES.md, core/tier/job.py.
"""
from __future__ import annotations

import logging
import os
import posixpath
import socket
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.distributed as dist

from asyncckpt.core.api.options import CheckpointOptions
from asyncckpt.core.formats import names
from asyncckpt.core.formats.checksum import FileChecksum
from asyncckpt.core.snapshot.buffer_pool import FileBuffers
from asyncckpt.core.snapshot.collectives import any_rank, over
from asyncckpt.core.snapshot.dist_env import dist_ready, rank_and_world
from asyncckpt.core.storage import commit
from asyncckpt.core import tier
from asyncckpt.core.storage.backend import is_url
from asyncckpt.core.writer.mirror import CopyRequest
from asyncckpt.core.writer.barrier import BarrierSpec
from asyncckpt.core.tier.requests import MemoryRetentionRequest, PersistRequest
from asyncckpt.core.tier.nodes import (
    FileReplicas,
    NodeMap,
    Replicas,
    TierSave,
    fetch_file,
    fetch_missing,
    missing_files,
)
from asyncckpt.core.tier.transport import (
    format_address,
    job_secret,
    listening_socket,
    peer_address,
    peers_for,
    publish_address,
)

NODE_KEY = "asyncckpt/tier/node/{rank}"  # in the Store: the node id of each (global) rank

logger = logging.getLogger("asyncckpt.core")


@dataclass
class _Run:
    """The checkpoints of one durable root, as this process saved them."""

    directory: str  # its run directory in memory on this node
    owner: str  # this process's owner token in it (``tier.claim_run``)
    saves: int = 0  # checkpoints saved: distinct steps (a framework may save one step under two names)
    last_step: Optional[int] = None
    last_bytes: int = 0  # the size of its last checkpoint: what the next one is expected to need
    unpersisted: Optional[str] = None  # the memory path of its newest checkpoint not written durably (yet)
    durable_only: bool = False  # its checkpoints do not fit in memory
    expected: bool = False  # every rank expects its files (``expect``): a single file saved here goes to the peers


@dataclass(frozen=True)
class _Nodes:
    """The job's nodes, as ``Tier.connect`` found them (two or more)."""

    of_rank: tuple[str, ...]  # the node id of each global rank
    map: NodeMap  # what a writer needs to reach the other nodes

    @property
    def count(self) -> int:
        return len(set(self.of_rank))


@dataclass
class Placement:
    """Where one checkpoint went: its memory path and its durable one, and whether it is also persisted."""

    memory: str
    durable: str
    persist: bool
    run: _Run = field(repr=False)
    save: Optional[BarrierSpec] = None  # where its ranks met (``follow_ups``; None: a single file, one rank's)


class Tier:
    """The memory tier of a Checkpointer whose options are ``checkpoint_options`` (``memory_tier`` set): the one
    thing the Checkpointer and the adapter kit call about it (``NoTier`` where it is off).
    ``store()``: the torch.distributed Store (None without one: the tier is then one node's); ``queue``: the
    Checkpointer's ``WriterQueue``, whose writer serves this node's memory to the others."""

    active = True

    def __init__(self, checkpoint_options: CheckpointOptions, *, store: Callable[[], Any], queue: Any,
                 process_group: Any = None) -> None:
        self.options, self.checkpoint_options = checkpoint_options.memory_tier, checkpoint_options
        self.object_store = checkpoint_options.object_store
        self.root = tier.memory_root(self.options.root)
        self._store, self._queue, self._group = store, queue, process_group
        self._foreign: dict[str, set[str]] = {}  # run directory -> its memory checkpoints of another job's shape
        self._runs: dict[str, _Run] = {}
        self._placed: dict[str, Placement] = {}  # by memory path
        self._lock = threading.Lock()
        self._connecting = threading.Lock()  # held for the whole of ``connect``: a second caller waits for it
        self._connected = False
        self._nodes: Optional[_Nodes] = None  # the job's nodes, where there are several
        self._listener: Optional[socket.socket] = None
        self._serve_later = False  # ``connect(serve=False)`` left the writer's start to ``serve``
        self._agreed: dict[str, Optional[str]] = {}  # run directory -> the memory checkpoint the nodes agreed on

    # ------------------------------------------------------------------ nodes
    def connect(self, *, serve: bool = True) -> None:
        """Find this rank's node among the job's nodes: at ``Checkpointer.start``, the first save and a resume (not
        a collective, but it waits in the Store until every rank has left its node there: every rank starts, or
        saves). On several nodes, the lowest rank of each node publishes where its writer serves the node's memory
        (``transport.publish_address``) and hands it the listening socket (``serve=False``: the writer serves
        from its next start, ``serve``). Once per Checkpointer; nothing without a Store or with one rank; not yet
        on a rank of several whose process group is not up (Lightning starts its plugin before it): at the next
        call then."""
        with self._connecting:
            if not self._connected and (dist_ready() or rank_and_world()[1] < 2):
                self._nodes = self._find_nodes(serve)
                self._connected = True

    def serve(self) -> None:
        """This node's writer serves its memory to the other nodes from now on (started if it is not), where
        ``connect`` left that for later: after a restart's load (the writer's start-up would share the node's
        cores with it: docs/DESIGN.md, "Measured"), or before a peer fetches from here."""
        if self._serve_later:
            self._serve_later = False
            self._queue.start()

    def _find_nodes(self, serve: bool) -> Optional[_Nodes]:
        store = self._store()
        rank, world = rank_and_world()
        if store is None and _spans_nodes():
            raise ValueError(f"memory_tier on several nodes ({world} ranks, {os.environ['LOCAL_WORLD_SIZE']} a node) needs "
                             "torch.distributed's Store to tell the nodes apart and meet: use_collectives=True (the "
                             "default), or save durably only (memory_tier=None)")
        if store is None or world < 2:
            return None
        node = tier.node_id()
        store.set(NODE_KEY.format(rank=rank), node)
        of_rank = tuple(_text(store.get(NODE_KEY.format(rank=other))) for other in range(world))
        if len(set(of_rank)) < 2:
            return None
        secret = job_secret(store)
        if of_rank.index(node) == rank and self._listener is None:
            self._listener = listening_socket()
            publish_address(store, node, self._listener.getsockname()[:2])
            self._queue.serve_replicas(self._listener, self.root, secret, now=serve)
            self._serve_later = not serve
        addresses = tuple((other, format_address(peer_address(store, other))) for other in sorted(set(of_rank))
                          if other != node)
        return _Nodes(of_rank, NodeMap(self.root, node, addresses, self.options.peer_timeout, secret))

    @property
    def across_nodes(self) -> bool:
        """The job runs on several nodes (``connect``): each node's memory holds its own copy of a checkpoint."""
        return self._nodes is not None

    def save_tier(self, path: str, group: Any) -> Optional[TierSave]:
        """What the requests of this rank's part of the save at ``path`` (a memory path ``place`` gave) over
        ``group`` carry: the job's topology, and where the save's ranks are on several nodes, how this rank's part
        reaches the others; None where it is not in memory."""
        placed = self._placed.get(path)
        if placed is None:
            return None
        rank = rank_and_world(group)[0]
        node_of = self._node_of(group)
        ranks_per_node = tuple(node_of.count(node) for node in dict.fromkeys(node_of))
        persist_to = placed.durable if placed.persist and not is_url(placed.durable) else None
        members = tuple(sorted(set(node_of)))
        if len(members) < 2:
            return TierSave(ranks_per_node, persist_to=persist_to)
        nodes = self._nodes
        node = node_of[rank]
        peers = self._peers(node, members)
        publishes = node_of.index(node) == rank and node != node_of[0]
        return TierSave(ranks_per_node, Replicas(nodes.map, peers, node_of[0], members, publishes), persist_to)

    def _node_of(self, group: Any) -> list[str]:
        """The node of each rank of ``group`` (``connect``; on one node, this one's)."""
        world = rank_and_world(group)[1]
        if self._nodes is None:
            return [tier.node_id()] * world
        return [self._nodes.of_rank[dist.get_global_rank(group, r) if group is not None else r] for r in range(world)]

    def _foreign_to_job(self, run_directory: str, checkpoints: list[tier.MemoryCheckpoint]) -> set[str]:
        """The memory checkpoints of ``checkpoints`` (in ``run_directory``) that a job of another shape saved (its
        world size, its ranks per node: ``TierSave.topology`` in their commit records): this job does not resume
        from them, whose shares are not its ranks' (their durable copies, if any, load as from storage, resharded);
        said in one line per run directory, by one process of the node. A single file has no shape: it is the
        whole state."""
        node_of = self._node_of(self._group)
        job = TierSave(tuple(node_of.count(node) for node in dict.fromkeys(node_of))).topology
        foreign = {c.name for c in checkpoints if c.record is not None
                   and c.record.get(tier.TIER_ENTRY, {}).get("topology", job) != job}
        said = self._foreign.setdefault(run_directory, set())
        if foreign - said and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            logger.warning("asyncckpt: not resuming from the memory checkpoint(s) %s of %s: saved by a job of another "
                           "shape (%s), this job has %d rank(s), %s a node; their durable copies, if any, load as from "
                           "storage", ", ".join(sorted(foreign - said)), tier.durable_root_of(run_directory),
                           "; ".join(sorted({_shape(c.record) for c in checkpoints if c.name in foreign - said})),
                           job["world_size"], "/".join(map(str, job["ranks_per_node"])))
        said |= foreign
        return foreign

    def latest_checkpoint(self, root: str, group: Any, orphan_timeout: float) -> Optional[str]:
        """The newest committed checkpoint of the durable ``root`` this job resumes from, in any tier (a collective on
        several nodes: ``assemble``; the newest on storage where the nodes hold none in memory); of the memory
        checkpoints, those of this job's shape only (``_foreign_to_job``)."""
        assembled = self.assemble(root, group)
        if self.across_nodes:
            return assembled or commit.latest_checkpoint(root, orphan_timeout=orphan_timeout)
        run_directory = self.run_dir(root)
        foreign = self._foreign_to_job(run_directory, tier.memory_checkpoints(run_directory))
        return tier.latest_checkpoint(root, orphan_timeout=orphan_timeout, memory_root=self.options.root,
                                      skipped=foreign)

    def _peers(self, node: str, members: tuple[str, ...]) -> tuple[str, ...]:
        """The nodes of ``members`` (sorted) that hold ``node``'s replicas (``peers_for``)."""
        return tuple(members[i] for i in peers_for(members.index(node), len(members), self.options.replicas))

    def _received(self) -> int:
        """Replicas of other nodes' shares this node holds, per share of its own (``peers_for``: as many as it
        sends)."""
        return 0 if self._nodes is None else min(self.options.replicas, self._nodes.count - 1)

    def persist_request(self, memory: str, durable: str, save: Optional[BarrierSpec], rank: int) -> Any:
        """The request that writes this rank's part of the memory checkpoint ``memory`` durably at ``durable``: its
        own files, the ranks meeting as those of the ``save`` did (its meeting point: its ranks, its id, the
        Store or markers; ``tier.requests``). ``save`` None: a single file, which its one rank copies whole."""
        if save is None:
            return CopyRequest(memory, durable, self.object_store)
        options = self.checkpoint_options
        return PersistRequest(memory, durable, rank, save.world_size, save.key, save.kind, options.timeout,
                              options.direct_io, options.io_threads, self.object_store)

    # ------------------------------------------------------------------ a restart on several nodes
    def assemble(self, durable_root: str, group: Any, *, single_files: Optional[Callable[[str], bool]] = None
                 ) -> Optional[str]:
        """Before a resume from ``durable_root`` on several nodes (a collective over ``group``: every rank calls
        it): the ranks agree on the newest memory checkpoint whose every file some node holds, not older than the
        newest durable one; each node's lowest rank fetches what its node lacks of it from the nodes that hold it
        (``nodes.fetch_missing``: checked against the record, a damaged copy named and the next holder tried);
        if a node cannot complete it, the next one is tried. With ``single_files`` (which names a framework picks
        from, as Lightning's ``last.ckpt``), of the single-file checkpoints so named, the newest by modification
        time (as the framework picks), fetched whole where missing (``nodes.fetch_file``). Returns its path on
        this node, None if there is none (or one node: nothing is asked): storage then. What a resume on this node
        may load from memory is then that checkpoint only (``usable``): every rank tries the same copies in the
        same order. This node's writer starts serving here where another node may fetch from it, or nothing is
        agreed on; else after the load (``Checkpointer.load`` calls ``serve``)."""
        self.connect(serve=False)
        nodes = self._nodes
        if nodes is None:
            return None
        run_directory = tier.open_run(durable_root, self.options.root)  # a replaced node's is made (to fetch into)
        here = tier.memory_checkpoints(run_directory)
        foreign = self._foreign_to_job(run_directory, here)
        here = [c for c in here if c.name not in foreign]
        if single_files:
            held = [(c.name, _file_record(c), [c.name]) for c in here
                    if c.checksum is not None and c.complete and single_files(c.name)]
        else:
            held = [(c.name, c.record, sorted(set(c.record.get("files", {})) - set(c.missing)))
                    for c in here if c.record is not None]
        gathered = over(group).gather((nodes.map.node, held))
        if any(theirs != held for _node, theirs in gathered):  # a node lacks what another holds: it fetches
            self.serve()
        node_of = [node for node, _held in gathered]
        leads = node_of.index(nodes.map.node) == dist.get_rank(group)
        agreed = None
        candidates = _newest_files(dict(gathered)) if single_files else _candidates(dict(gathered),
                                                                                    _durable_step(durable_root))
        for name, record, holders in candidates:
            path = os.path.join(run_directory, name)
            if single_files:
                missing = not any(c.name == name and c.checksum == _checksum(record) for c in here)
                unavailable = missing and leads and not fetch_file(nodes.map, path, _checksum(record), holders[name])
            else:
                unavailable = bool(fetch_missing(nodes.map, path, record, holders)) \
                    if leads and missing_files(path, record) else False
            if not any_rank(bool(unavailable), group):
                agreed = name
                break
        self._agreed[run_directory] = agreed
        if agreed is None:
            self.serve()
        return None if agreed is None else os.path.join(run_directory, agreed)

    def usable(self, run_directory: str) -> set[str]:
        """The memory checkpoints in ``run_directory`` a resume on this node may load (names): on several nodes, the
        one they agreed on (``assemble``; none before it, nor before the nodes are known on a job the launcher says
        spans several); on one node, each of this job's shape (``_foreign_to_job``; each is whole there)."""
        if self._nodes is None:
            if not self._connected and _spans_nodes():
                return set()
            here = tier.memory_checkpoints(run_directory)
            return {c.name for c in here} - self._foreign_to_job(run_directory, here)
        return {self._agreed[run_directory]} if self._agreed.get(run_directory) else set()

    def expect(self, durable_root: str) -> None:
        """Every rank calls it: one of them saves single files under ``durable_root`` (Lightning's rank 0), which
        reach this node as replicas. This process owns the root's run directory here as if it saved them, so that
        no cleaner takes it for an orphan while the job runs and the end of the run removes it (``clear``); a single
        file saved there is replicated (the peers expect it too). Nothing on one node."""
        if self._nodes is None or is_url(durable_root):
            return
        with self._lock:
            if durable_root not in self._runs:
                self._runs[durable_root] = self._open(durable_root)
            self._runs[durable_root].expected = True

    def close(self) -> None:
        """The Checkpointer is closed: its listening socket goes (a writer serving on it keeps its own)."""
        if self._listener is not None:
            self._listener.close()

    def place(self, durable: str, nbytes: int, step: Optional[int], *, durable_too: Optional[bool] = None,
              agree_over: Any = False) -> str:
        """Where the checkpoint of ``step`` asked for at ``durable`` (of ``nbytes`` on this rank, 0 where not known
        yet) is saved: its memory path (counted for the persist cadence, one count per step: Lightning saves a
        step's ``last.ckpt`` beside its top-k file; ``durable_too`` overrides the cadence), or ``durable`` itself
        where its root's checkpoints do not fit in memory (one warning saying what would). A save that every rank
        of ``agree_over`` makes (a group; None: the default one) is placed alike on all of them: a collective,
        where one node's memory would not fit, every rank saves to storage."""
        root = posixpath.dirname(durable) if is_url(durable) else os.path.dirname(durable)
        with self._lock:
            run = self._runs.get(root)
            if run is None:
                run = self._runs[root] = self._open(root)
            if not run.durable_only:  # this node holds its own shares and the replicas of others'
                run.durable_only = not self._fits(run, max(nbytes, run.last_bytes) * (1 + self._received()))
                if agree_over is not False:  # (any_rank is False without torch.distributed: this rank's answer)
                    run.durable_only = any_rank(run.durable_only, agree_over) or run.durable_only
            if run.durable_only:
                return durable
            if step is None or step != run.last_step:
                run.saves, run.last_step = run.saves + 1, step
            memory = os.path.join(run.directory, os.path.basename(durable.rstrip("/")))
            persist = run.saves % self.options.persist_every == 0 if durable_too is None else durable_too
            self._placed[memory] = Placement(memory, durable, persist, run)
            return memory

    def placement(self, memory: str) -> Optional[Placement]:
        """Where the checkpoint saved at ``memory`` went (None: not a memory save of this process)."""
        return self._placed.get(memory)

    def file_buffers(self, memory: str) -> Optional[FileBuffers]:
        """The save at ``memory``'s snapshot buffers as files of its run directory (``tier.BUFFERS_DIR``: the writer
        links its data files to them), ``keep`` + 1 of them; None where it is not a memory save of this process."""
        placed = self._placed.get(memory)
        if placed is None:
            return None
        return FileBuffers(os.path.join(placed.run.directory, tier.BUFFERS_DIR), self.options.keep + 1)

    def run_dir(self, durable_root: str) -> str:
        """The memory run directory of ``durable_root`` on this node (whether or not it exists)."""
        return tier.run_dir(durable_root, self.options.root)

    def places(self, durable_root: str) -> list[str]:
        """Where the checkpoints of ``durable_root`` may be on this node, the durable root first: it, and its memory
        run directory (for an adapter that lists a framework's checkpoints itself)."""
        return [durable_root, self.run_dir(durable_root)]

    def memory_path(self, durable: str) -> str:
        """Where the memory copy of the checkpoint at ``durable`` lives on this node (whether or not it is there)."""
        return tier.memory_path(durable, self.options.root)

    def _open(self, root: str) -> _Run:
        """A root's run directory, this process its owner (first: a restart must not take its own tier for an
        orphan), the snapshot buffers its dead processes left there and the orphaned runs of dead jobs on this node
        gone."""
        directory = tier.open_run(root, self.options.root)
        run = _Run(directory, tier.claim_run(directory))
        tier.remove_dead_buffers(directory)
        tier.remove_orphans(self.root)
        return run

    def _fits(self, run: _Run, nbytes: int) -> bool:
        capacity = tier.capacity(self.root, self.options.max_bytes, for_run=run.directory)
        if tier.fits(tier.needed_bytes(nbytes, self.options.keep), capacity):
            return True
        logger.warning("asyncckpt: the memory tier does not fit the checkpoints of %s: %s; saving them to storage "
                       "only", tier.durable_root_of(run.directory), tier.what_would_fit(nbytes, self.options.keep,
                                                                                         capacity))
        return False

    def follow_ups(self, memory: str, nbytes: int, *, rank: int, save: Optional[BarrierSpec]) -> list[tuple[str, str, Any]]:
        """The writer jobs behind the commit of the checkpoint saved at ``memory`` (``nbytes`` on this ``rank``),
        as ``(kind, path, request)``: its persistence when due, by every rank of the ``save`` (its meeting point;
        None: a single file, by its one rank); a single file of a root every rank ``expect``s, its replicas (a
        directory's go with its files); then, by one rank per node, the tier's retention on this node."""
        placed = self._placed.get(memory)
        if placed is None:
            return []
        placed.run.unpersisted = None if placed.persist else memory
        placed.run.last_bytes, placed.save = nbytes, save
        jobs = []
        if placed.persist:
            jobs.append(("persist", placed.durable, self.persist_request(memory, placed.durable, save, rank)))
        if save is None and placed.run.expected and self._nodes is not None:
            peers = self._peers(self._nodes.map.node, tuple(sorted(set(self._nodes.of_rank))))
            jobs.append(("replicate", memory, FileReplicas(memory, self._nodes.map, peers, self.options.keep)))
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            jobs.append(("retention", placed.run.directory, MemoryRetentionRequest(placed.run.directory,
                                                                                   self.options.keep)))
        return jobs

    def unpersisted(self) -> list[Placement]:
        """The newest checkpoint of each root that is in memory only: what the end of a run persists."""
        with self._lock:
            return [self._placed[run.unpersisted] for run in self._runs.values() if run.unpersisted is not None]

    def clear(self, *, remove: bool) -> None:
        """The end of a run: this process no longer owns its run directories; with ``remove`` (one process per
        node), this node's memory copies of every root it saved go."""
        with self._lock:
            runs, self._runs, self._placed = list(self._runs.values()), {}, {}
        self._serve_later = False  # the run's writer is stopped; a later run's starts serving with it
        for run in runs:
            tier.release_run(run.directory, run.owner)
            if remove:
                tier.remove_run(run.directory)


class NoTier:
    """No memory tier: every checkpoint is saved where it was asked for, and resumed from there (the ``Tier`` that
    the Checkpointer and the adapter kit call, where ``memory_tier`` is off)."""

    active = False
    across_nodes = False

    def connect(self, *, serve: bool = True) -> None:
        pass

    def serve(self) -> None:
        pass

    def close(self) -> None:
        pass

    def place(self, durable: str, nbytes: int, step: Optional[int], *, durable_too: Optional[bool] = None,
              agree_over: Any = False) -> str:
        return durable

    def placement(self, memory: str) -> Optional[Placement]:
        return None

    def save_tier(self, path: str, group: Any) -> Optional[TierSave]:
        return None

    def file_buffers(self, memory: str) -> Optional[FileBuffers]:
        return None

    def follow_ups(self, memory: str, nbytes: int, *, rank: int, save: Optional[BarrierSpec]) -> list:
        return []

    def memory_path(self, durable: str) -> Optional[str]:
        return None

    def places(self, durable_root: str) -> list[str]:
        return [durable_root]

    def latest_checkpoint(self, root: str, group: Any, orphan_timeout: float) -> Optional[str]:
        """The newest checkpoint of ``root`` in any tier of this node (``tier.latest_checkpoint``: a memory copy a
        run with the tier left too)."""
        return tier.latest_checkpoint(root, orphan_timeout=orphan_timeout)

    def assemble(self, durable_root: str, group: Any, *, single_files: Optional[Callable[[str], bool]] = None
                 ) -> Optional[str]:
        return None

    def usable(self, run_directory: str) -> set[str]:
        return set()

    def expect(self, durable_root: str) -> None:
        pass

    def unpersisted(self) -> list[Placement]:
        return []

    def clear(self, *, remove: bool) -> None:
        pass


def tier_of(checkpoint_options: CheckpointOptions, *, store: Callable[[], Any], queue: Any,
            process_group: Any = None) -> "Tier | NoTier":
    """The memory tier of a Checkpointer with ``checkpoint_options`` (``Tier``'s arguments): ``NoTier`` where
    ``memory_tier`` is off."""
    if not checkpoint_options.memory_tier:
        return NoTier()
    return Tier(checkpoint_options, store=store, queue=queue, process_group=process_group)


def _shape(record: dict) -> str:
    """A memory checkpoint's job shape, as its commit record binds it: ``4 rank(s), 2/2 a node``."""
    topology = record[tier.TIER_ENTRY]["topology"]
    return f"{topology['world_size']} rank(s), {'/'.join(map(str, topology['ranks_per_node']))} a node"


def _spans_nodes() -> bool:
    """The launcher says this job has ranks on several nodes (torchrun's ``LOCAL_WORLD_SIZE`` below the world)."""
    world = rank_and_world()[1]
    return world > int(os.environ.get("LOCAL_WORLD_SIZE", world))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _file_record(checkpoint: tier.MemoryCheckpoint) -> dict:
    """What the nodes compare of a single-file checkpoint they hold: its checksum and modification time."""
    return {"size": checkpoint.checksum.size, "xxh3": checkpoint.checksum.xxh3,
            "mtime_ns": int(checkpoint.committed_at * 1e9)}


def _checksum(record: dict) -> FileChecksum:
    return FileChecksum(record["size"], record["xxh3"])


def _newest_files(held_by_node: dict[str, list]) -> list[tuple[str, dict, dict]]:
    """From what each node holds (node -> [(name, file record, [name])]), the single-file checkpoints, newest
    first by modification time (as a framework picks its newest file): ``(name, record, {name: [nodes]})``; a name
    whose nodes hold different contents is each content its own candidate."""
    found: dict[tuple[str, str], tuple[dict, list[str]]] = {}
    for node, files in sorted(held_by_node.items()):
        for name, record, _names in files:
            found.setdefault((name, record["xxh3"]), (record, []))[1].append(node)
    ordered = sorted(found.items(), key=lambda item: item[1][0]["mtime_ns"], reverse=True)
    return [(name, record, {name: holders}) for (name, _xxh3), (record, holders) in ordered]


def _durable_step(durable_root: str) -> Optional[int]:
    """The step of the newest committed checkpoint under ``durable_root`` (None: none, or none says its step)."""
    latest = commit.latest_checkpoint(durable_root)
    if latest is None:
        return None
    step = (commit.read_commit_record(latest) or {}).get("step")
    return step if isinstance(step, int) else names.step_from_name(os.path.basename(latest))


def _candidates(held_by_node: dict[str, list], durable_step: Optional[int]) -> list[tuple[str, dict, dict]]:
    """From what each node holds (node -> [(name, record, files here)]), the memory checkpoints a resume may
    assemble, newest first: ``(name, record, {file: [nodes that hold it]})`` for each whose every file some node
    holds and that is not older than the newest durable checkpoint (``durable_step``)."""
    found: dict[tuple[str, Any], tuple[dict, dict[str, list[str]]]] = {}
    for node, checkpoints in sorted(held_by_node.items()):
        for name, record, files in checkpoints:
            _record, holders = found.setdefault((name, record.get("save_id")), (record, defaultdict(list)))
            for file in files:
                holders[file].append(node)

    def step(name: str, record: dict) -> int:  # -1: none (older than any step)
        number = record["step"] if isinstance(record.get("step"), int) else names.step_from_name(name)
        return -1 if number is None else number

    usable = [(name, record, dict(holders)) for (name, _save_id), (record, holders) in found.items()
              if set(record.get("files", {})) <= set(holders)
              and (durable_step is None or step(name, record) >= durable_step)]
    return sorted(usable, key=lambda c: (step(c[0], c[1]), c[1].get("committed_at_ns", 0)), reverse=True)
