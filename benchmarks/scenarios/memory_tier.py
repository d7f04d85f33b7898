"""The memory tier on two nodes: what a save costs, what a restart takes from each source, what replicating
costs the training loop; and the time to durable on two and four nodes.

Ranks each a node of its own on this machine (its own ``ASYNCCKPT_NODE`` and memory root in tmpfs, replicas
over loopback), each with its own share (an Adam-like mix of tensors).
**Time to durable** (2 and 4 nodes, ``durable_mib`` each): durably only, and with the memory tier (``replicas=1``,
every save durable too: each rank's writer writes its own share from its node's memory once the save committed
there); per save the seconds from the call to durable on every rank, and the bytes each writer wrote against its
own files'.
**Saves** (2 nodes, ``size_mib`` each, ``async_save``): durably only (to the disk); with the memory tier
(``replicas=1``: committed in its own node's memory and in the other's) in memory only (the run's last written to the
disk at its end), and durable on the S3 server too (moto; each save written there from memory behind it,
``persist_every=1``). Per save: the stall, the time to committed (in
memory with its replica, or durable), the time to durable; against the snapshot (a held memcpy of the share) plus a
raw socket transfer of it, verified once (``os.sendfile`` into another process that writes it into tmpfs and hashes
it, xxh3, as it arrives: a replica stays verified when it arrives; both shares at once, as the job moves them;
measured right after each job of the memory arm, in the same minutes of this shared machine).
Every job with the tier (saves and training alike) first saves twice, the durable arms once: the tier at its steady
state, its pages held and recycled, as the floors' processes hold theirs from the start; a run's first saves pay for
new tmpfs pages once (with one warm-up save, the first measured one took 4-7 s to commit, the later ones ~1.5 s), and
the page gives what those first two saves took.
**Restarts** (a fresh two-rank job: ``latest_checkpoint`` + ``load``, checked bit for bit): from each node's own
memory (a process restart; both nodes at once, and one node at a time, each load with the machine's cores to
itself as on nodes of their own: a node's turn begins once the machine is quiet, the writer the node before
started after its load done), with node 1's memory gone (a replaced node: it fetches its share from node 0's
replica), from the disk with its pages evicted, from the S3 server; against a memcpy of the share.
**Training**: both ranks compute (one thread each: every core busy), saving every few seconds with the memory
tier (in memory only), against the same loop saving nothing, saving durably, with another process writing the same
bytes to the disk at the same steps, and with another process sending the same bytes over loopback into the other
node's tmpfs at the same steps, hashed there once (the floor of a replica); then the same arms with a core left
free, as a GPU trainer leaves its CPU: rank 0 computes on one thread, rank 1 keeps step with it without computing.
``--set node_cores=N`` (a machine of 2N cores or more, such as a lent GPU machine): each node's rank, writer and
floor processes on N cores of its own, its training on N threads, as on nodes of their own.
``--set device=cuda`` (where a GPU is lent): the training arms' shares in GPU memory and their steps on the GPU
(both ranks on the one GPU), a GPU trainer as it is, its cores free; ``--set saves=false``: the training alone.
From the measured costs, the work a day of failures loses against the checkpoint interval, with and without the
tier (``asyncckpt.core.api.interval``).
"""
from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import threading
import time

from harness import Option, Scenario
from harness.floors import HeldMemcpy, RawWriter
from harness.machine import evict, settle
from harness.ranks import on_ranks
from harness.report import bars, fmt, table
from harness.util import median, now
from harness.workloads import (GpuMMLoop, MMLoop, flat_tensors, make_adam, n_tensors, on_device, same_state,
                               state_bytes, zeros_like_state)
from scenarios.object_store import Server
from scenarios.replication import VERIFIED, raw_reader, started  # noqa: F401 - raw_reader runs in a child of this scenario

SAVES = {"durable": "durable only (disk)", "memory": "**memory tier**, in memory only (durable at the run's end)",
         "memory_s3": "**memory tier**, durable on S3"}
RESTARTS = {"own": "own node's memory", "own_alone": "own node's memory, one node at a time",
            "peer": "node 1 replaced: its share from node 0", "disk": "disk (cold)", "s3": "S3 server"}
TRAINING = {"none": "no checkpoints", "durable": "durable only (asyncckpt, disk)",
            "memory": "**memory tier** (1 replica, memory only)",
            "raw": "floor: another process writes the same bytes to the disk (O_DIRECT)",
            "socket": "floor: another process sends the same bytes to the other node's tmpfs (loopback), hashed once "
                      "there"}
DURABLE_NODES = (2, 4)
DURABLE_ARMS = {"durable": "durable only", "memory": "**memory tier** (1 replica, every save durable too)"}
FREE = "free_"  # a training arm's prefix where the training leaves a core free (rank 0 alone computes)
BUCKET = "memory-tier"


# ------------------------------------------------------------------------------------------ in each rank
def _node(rank: int, memory_root: str, node_cores: int = 0) -> None:
    """This rank is node ``n{rank}`` (as torchrun starts one rank per node), its memory root under ``memory_root``,
    reached over loopback; with ``node_cores``, on cores of its own (``node_cpus``), which its writer inherits."""
    os.environ.update({"ASYNCCKPT_NODE": f"n{rank}", "ASYNCCKPT_MEMORY_ROOT": os.path.join(memory_root, f"n{rank}"),
                       "ASYNCCKPT_REPLICATION_ADDRESS": "127.0.0.1", "GROUP_RANK": str(rank), "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1"})
    if node_cores:
        import torch

        os.sched_setaffinity(0, node_cpus(rank, node_cores))
        torch.set_num_threads(node_cores)


def node_cpus(node: int, node_cores: int) -> set[int]:
    """The cores of node ``node`` where each node has ``node_cores`` of its own (``--set node_cores=N``): the
    ``N``-th block of the machine's (a lent GPU machine's 16)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < (node + 1) * node_cores:
        raise SystemExit(f"node_cores={node_cores}: this machine has {len(cpus)} cores, not {node + 1} nodes' worth")
    return set(cpus[node * node_cores:(node + 1) * node_cores])


def _share(rank: int, size_mib: int, device: str = "cpu") -> dict:
    """Rank ``rank``'s own share (its keys its own: every rank writes its ``size_mib``), on ``device``."""
    return on_device({f"rank{rank}": make_adam(size_mib << 20, seed=1 + rank)}, device)


def _drop(path: str) -> None:
    """A measured checkpoint removed once the next one is durable (the S3 server holds what it is sent in memory)."""
    if path.startswith("s3://"):
        import boto3

        bucket, _, prefix = path[len("s3://"):].partition("/")
        objects = boto3.resource("s3").Bucket(bucket).objects.filter(Prefix=prefix + "/")
        objects.delete()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _saves_rank(rank: int, world: int, arm: str, size_mib: int, reps: int, root: str, memory_root: str,
                keep_to: str, node_cores: int) -> dict:
    import torch.distributed as dist

    _node(rank, memory_root, node_cores)
    from asyncckpt.core import Checkpointer, MemoryTier

    state = _share(rank, size_mib)
    every = 1 if arm == "memory_s3" else 1 << 30  # in memory only: its commit against its floor, nothing beside it
    options = {"memory_tier": MemoryTier(replicas=1, persist_every=every, keep=1)} if arm != "durable" else {}
    rows: dict[str, list[float]] = {"stall_s": [], "committed_s": [], "durable_s": []}
    memcpy, sources = HeldMemcpy(), list(flat_tensors(state).values())
    snapshot_s = []
    warmup_s: list[float] = []
    with Checkpointer(**options) as checkpointer:
        previous = ""
        for warm in range(2 if arm != "durable" else 1):  # the tier at its steady state: keep + 1 saves' pages held
            path = f"{root}/warmup_{warm}"
            t0 = now()
            checkpointer.save(state, path, step=0)  # plans, snapshot buffers, writers, receivers, pages: new
            warmup_s.append(now() - t0)
            checkpointer.wait()  # and its durable copy written: not in the next save's way
            dist.barrier()
            if rank == 0 and previous:
                _drop(previous)
            previous = path
        for rep in range(1, reps + 1):
            snapshot_s.append(memcpy(sources)[0])
            dist.barrier()
            path = f"{root}/step_{rep}"
            t0 = now()
            handle = checkpointer.async_save(state, path, step=rep)
            rows["stall_s"].append(now() - t0)
            handle.result()
            rows["committed_s"].append(now() - t0)
            checkpointer.wait_for(path)  # its durable copy (with the tier, written from memory behind it)
            rows["durable_s"].append(now() - t0)
            dist.barrier()
            if rank == 0:
                _drop(previous)
            previous = path
        if keep_to:  # this node's memory as a run killed now would leave it: the restarts' source
            checkpointer.wait()  # the tier's retention behind the last save too
            dist.barrier()
            shutil.copytree(os.environ["ASYNCCKPT_MEMORY_ROOT"], os.path.join(keep_to, f"n{rank}"), symlinks=True)
            dist.barrier()
    return {"state_bytes": state_bytes(state), "tensors": n_tensors(state), "reps": rows, "snapshot_s": snapshot_s,
            "warmup_s": warmup_s, "kept": previous}


def _durable_rank(rank: int, world: int, arm: str, size_mib: int, reps: int, root: str, memory_root: str,
                  node_cores: int) -> dict:
    """``reps`` saves of this rank's share, each waited for until durable: the seconds from the call to its commit
    record on the disk, to its handle done (committed in memory, or durable), and what this rank's writer wrote
    meanwhile to storage (``/proc/<pid>/io``'s ``write_bytes``, which writes into tmpfs, the
    memory tier's, do not count in), against the bytes of the files this rank saved (``tier.writer_of``)."""
    import torch.distributed as dist

    _node(rank, memory_root, node_cores)
    from asyncckpt.core import Checkpointer, MemoryTier
    from asyncckpt.core.formats.names import COMMIT_RECORD
    from asyncckpt.core.storage import commit
    from asyncckpt.core import tier

    def written(checkpointer) -> int:
        with open(f"/proc/{checkpointer.writer_pid()}/io") as f:
            return int(next(line.split()[1] for line in f if line.startswith("write_bytes")))

    def own_files(path: str) -> int:
        record = commit.read_commit_record(path)
        return sum(size for name, size in record["files"].items() if tier.writer_of(record, name) == rank)

    state = _share(rank, size_mib)
    options = {"memory_tier": MemoryTier(replicas=1, persist_every=1, keep=1)} if arm == "memory" else {}
    durable_s, committed_s, wrote, own = [], [], [], []
    with Checkpointer(**options) as checkpointer:
        checkpointer.start()
        previous = ""
        for step in range(-(2 if arm == "memory" else 1), reps):  # warm-up saves first, as in the saves' jobs
            dist.barrier()
            path = f"{root}/step_{step + 2}"
            before = written(checkpointer)
            t0 = now()
            handle = checkpointer.async_save(state, path, step=step + 2)
            while not os.path.exists(os.path.join(path, COMMIT_RECORD)):  # committed on the disk, by rank 0 (its
                time.sleep(0.001)  # record is the last thing it publishes), whatever handle reports it
            seconds = now() - t0
            handle.result()
            committed = now() - t0
            checkpointer.wait_for(path)
            if step >= 0:
                durable_s.append(seconds)
                committed_s.append(committed)
                wrote.append(written(checkpointer) - before)
                own.append(own_files(path))
            dist.barrier()
            if rank == 0 and previous:
                _drop(previous)
            previous = path
    return {"durable_s": durable_s, "committed_s": committed_s, "wrote": wrote, "own": own}


def _restart_rank(rank: int, world: int, size_mib: int, root: str, memory_root: str, breakdown: bool,
                  turns: bool, node_cores: int) -> dict:
    """``turns``: the ranks load one after the other (the agreement together; each load then rank-local, as it
    reads only its own keys), then take a held memcpy of the share in turn: what a node's restart takes with the
    machine's cores to itself. Each turn begins once the machine is quiet (``settle``): the writer a node's load
    starts after it runs on that node's cores, not on the next node's."""
    import torch.distributed as dist

    _node(rank, memory_root, node_cores)
    from asyncckpt.core import Checkpointer, MemoryTier

    expected = _share(rank, size_mib)
    target = zeros_like_state(expected)
    parts = {}
    with Checkpointer(memory_tier=MemoryTier(replicas=1)) as checkpointer:
        dist.barrier()
        t0 = now()
        path = checkpointer.latest_checkpoint(root)
        parts["agree_s"] = now() - t0
        for turn in range(world if turns else 1):
            if turns:
                _turn(turn, rank)
                t0 = now() - parts["agree_s"]
            if turn == rank or not turns:  # alone: the load without collectives (each rank reads its own keys)
                checkpointer.load(target, path, use_collectives=not turns)
                load_s = now() - t0
        parts["load_s"] = load_s - parts["agree_s"]
        if turns:
            for turn in range(world):
                _turn(turn, rank)
                if turn == rank:
                    parts["memcpy_s"] = HeldMemcpy()(list(flat_tensors(target).values()))[0]
        if not same_state(target, expected):
            raise AssertionError(f"rank {rank} loaded {path}: not the state it saved")
        if breakdown:  # the same load again unverified, a bare read of this rank's files, a memcpy: both ranks at once
            parts.update(_load_parts(checkpointer, target, path, rank))
    return {"load_s": load_s, "path": path, "parts": parts}


def _turn(turn: int, rank: int) -> None:
    """The ranks meet for ``turn``; the rank whose turn it is first waits for the machine to be quiet."""
    import torch.distributed as dist

    if turn == rank:
        settle()
    dist.barrier()


def _load_parts(checkpointer, target: dict, path: str, rank: int) -> dict:
    """What a load from memory is made of, each timed on both ranks at once (a barrier before each): the load
    without checksums, a read of this rank's data files into a held buffer (large ``preadv``s, no hash), an xxh3 of
    them (through a mapping), a held memcpy of the share."""
    import mmap

    import torch.distributed as dist

    from asyncckpt.core.formats.checksum import checksum_stream

    parts = {}
    dist.barrier()
    t0 = now()
    checkpointer.load(target, path, verify=False)
    parts["load_unverified_s"] = now() - t0
    files = [os.path.join(path, name) for name in os.listdir(path) if name.startswith(f"__{rank}_")]
    nbytes = sum(os.path.getsize(f) for f in files)
    import torch

    held = torch.empty(nbytes, dtype=torch.uint8)
    held.zero_()
    view = memoryview(held.numpy())
    dist.barrier()
    t0, offset = now(), 0
    for name in files:
        with open(name, "rb", buffering=0) as f:
            while (got := f.readinto(view[offset:offset + (16 << 20)])):
                offset += got
    parts["read_s"] = now() - t0
    dist.barrier()
    t0 = now()
    for name in files:
        with open(name, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as pages:
            digest = checksum_stream()
            with memoryview(pages) as data:
                for start in range(0, len(data), 16 << 20):
                    digest.update(data[start:start + (16 << 20)])
    parts["hash_s"] = now() - t0
    dist.barrier()
    parts["memcpy_s"] = HeldMemcpy()(list(flat_tensors(target).values()))[0]
    parts["files_bytes"] = nbytes
    return parts


def _train_rank(rank: int, world: int, arm: str, size_mib: int, seconds: float, saves: int, root: str,
                memory_root: str, readers: list, device: str, node_cores: int) -> dict:
    import torch
    import torch.distributed as dist

    _node(rank, memory_root, node_cores)
    from asyncckpt.core import Checkpointer, MemoryTier

    free, arm = arm.startswith(FREE), arm.removeprefix(FREE)
    computes = not free or rank == 0  # with a core left free, rank 1 keeps step without computing
    state, loop = _share(rank, size_mib, device), GpuMMLoop() if device == "cuda" else MMLoop()
    rate = torch.tensor([loop.rate_alone(2.0) if computes else float("inf")])
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)  # both ranks run the same steps (a save is collective)
    steps = int(rate.item() * seconds)
    every = max(1, steps // (saves + 1))
    raw = RawWriter(state_bytes(state), root) if arm == "raw" else None
    if arm == "socket":  # to the other node's reader, as its replica goes
        raw = RawSender(state_bytes(state), memory_root, readers[(rank + 1) % len(readers)])
    checkpointer = None
    if arm in ("memory", "durable"):
        options = {"memory_tier": MemoryTier(replicas=1, persist_every=1 << 30, keep=1)} if arm == "memory" else {}
        checkpointer = Checkpointer(**options)
        for warm in range(2 if arm == "memory" else 1):  # the tier at its steady state: keep + 1 saves' pages held
            checkpointer.save(state, f"{root}/warmup_{warm}", step=0)
        checkpointer.wait()
    dist.barrier()
    stalls, t0 = [], now()
    for step in range(1, steps + 1):
        if computes:
            loop.step()  # on the GPU: each rank's own stream, the two ranks sharing the one GPU
        if step % every == 0 and step // every <= saves:
            if free:
                dist.barrier()  # the idle rank waits for the computing one here, in every arm alike
            s0 = now()
            if raw is not None:
                raw.start()
            elif checkpointer is not None:
                checkpointer.async_save(state, f"{root}/step_{step}", step=step)
            stalls.append(now() - s0)
    wall_s = now() - t0
    if raw is not None:
        raw.wait()
        raw.close()
    if checkpointer is not None:
        checkpointer.close()
    return {"wall_s": wall_s, "steps": steps, "stalls_s": stalls}


def _serve_sends(conn, nbytes: int, scratch: str, address: tuple) -> None:
    """``RawSender``'s process: ``nbytes`` in a tmpfs file of its own; per message, the file whole with
    ``os.sendfile`` to the raw reader at ``address`` (into the pages of a tmpfs file it kept, as the tier lands
    replicas in its spares, hashed once as it arrives, as a replica is verified), the seconds back."""
    fd, path = tempfile.mkstemp(dir=scratch)
    pattern = os.urandom(1 << 20)  # incompressible, like tensor data
    with os.fdopen(fd, "wb") as f:
        for offset in range(0, nbytes, len(pattern)):
            f.write(pattern[:nbytes - offset])
    conn.send("ready")
    try:
        with open(path, "rb") as f:
            while conn.recv() is not None:
                t0 = now()
                with socket.create_connection(tuple(address)) as connection:
                    connection.sendall(struct.pack(">QB", nbytes, 3 | VERIFIED))
                    connection.sendfile(f, 0)
                    if connection.recv(1) != b"k":
                        raise ConnectionError("the raw reader did not take every byte")
                conn.send(now() - t0)
    finally:
        os.unlink(path)
    conn.send("stopped")


class RawSender(RawWriter):
    """The floor of a replica during training: another process sends the share's bytes over loopback into the
    other node's tmpfs at each save (``RawWriter``'s protocol: ``start``, ``wait``, ``close``): no snapshot, no
    commit, the kernel's copies on both sides, into pages the receiver kept, and one xxh3 of what arrived there (a
    replica stays verified when it arrives)."""

    def __init__(self, nbytes: int, scratch: str, address: tuple) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._conn, child_end = context.Pipe()
        self._process = context.Process(target=_serve_sends, args=(child_end, nbytes, scratch, address), daemon=True)
        self._process.start()
        child_end.close()
        assert self._conn.recv() == "ready"
        self._count, self._pending, self.seconds = 0, False, []


# ------------------------------------------------------------------------------------------ children
def job_saves(arm: str, size_mib: int, reps: int, root: str, memory_root: str, keep_to: str, node_cores: int) -> dict:
    """``reps`` saves on both nodes (after the warm-up saves); per save the slower rank's seconds."""
    r0, r1 = on_ranks(_saves_rank, 2, arm, size_mib, reps, root, memory_root, keep_to, node_cores)
    out = {key: [max(a, b) for a, b in zip(r0["reps"][key], r1["reps"][key])] for key in r0["reps"]}
    return {"reps": out, "snapshot_s": r0["snapshot_s"] + r1["snapshot_s"], "state_bytes": r0["state_bytes"],
            "tensors": r0["tensors"], "kept": r0["kept"],
            "warmup_s": [max(a, b) for a, b in zip(r0["warmup_s"], r1["warmup_s"])]}


def job_durable(arm: str, nodes: int, size_mib: int, reps: int, root: str, memory_root: str, node_cores: int) -> dict:
    """``reps`` saves on ``nodes`` nodes, each waited for until durable: per save the slowest rank's seconds, and
    every rank's bytes written against its own files'."""
    ranks = on_ranks(_durable_rank, nodes, arm, size_mib, reps, root, memory_root, node_cores)
    return {"durable_s": [max(seconds) for seconds in zip(*(r["durable_s"] for r in ranks))],
            "committed_s": [max(seconds) for seconds in zip(*(r["committed_s"] for r in ranks))],
            "wrote": [r["wrote"] for r in ranks], "own": [r["own"] for r in ranks]}


def job_restart(size_mib: int, root: str, memory_root: str, breakdown: bool, turns: bool, node_cores: int) -> dict:
    ranks = on_ranks(_restart_rank, 2, size_mib, root, memory_root, breakdown, turns, node_cores)
    return {"load_s": max(r["load_s"] for r in ranks), "paths": [r["path"] for r in ranks],
            "parts": {key: max(r["parts"][key] for r in ranks) for key in ranks[0]["parts"]}}


def job_train(arm: str, size_mib: int, seconds: float, saves: int, root: str, memory_root: str,
              readers: list, device: str, node_cores: int) -> dict:
    ranks = on_ranks(_train_rank, 2, arm, size_mib, seconds, saves, root, memory_root, readers, device, node_cores)
    return {"wall_s": max(r["wall_s"] for r in ranks), "steps": ranks[0]["steps"],
            "stall_s": median([s for r in ranks for s in r["stalls_s"]])}


def raw_transfers(addresses: list, size_mib: int, scratch: str, reps: int, node_cores: int) -> dict:
    """Both shares at once, each a file in tmpfs sent whole with ``os.sendfile`` into a raw reader that lands it in
    tmpfs and hashes it once as it arrives (the floor of a replica landing verified in another process's memory):
    into a fresh file (``"s"``), and into the pages of a file kept from the transfer before (``"reused_s"``, as the
    tier's spares), seconds per rep (rep 0 warms). With ``node_cores``, share ``i`` is sent from node ``i``'s
    cores."""
    nbytes = size_mib << 20
    files = []
    for i in range(len(addresses)):
        fd, path = tempfile.mkstemp(dir=scratch)
        with os.fdopen(fd, "wb") as f:
            for _ in range(size_mib):
                f.write(os.urandom(1 << 20))
        files.append(path)

    def send(node, address, path, mode) -> None:
        if node_cores:
            os.sched_setaffinity(0, node_cpus(node, node_cores))  # this thread's
        with socket.create_connection(tuple(address)) as connection, open(path, "rb") as f:
            connection.sendall(struct.pack(">QB", nbytes, mode | VERIFIED))
            connection.sendfile(f)
            if connection.recv(1) != b"k":
                raise ConnectionError("the raw reader did not take every byte")

    seconds: dict[int, list[float]] = {1: [], 3: []}
    for _ in range(reps + 1):
        for mode, times in seconds.items():
            threads = [threading.Thread(target=send, args=(node, address, path, mode))
                       for node, (address, path) in enumerate(zip(addresses, files))]
            t0 = now()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            times.append(now() - t0)
    for path in files:
        os.unlink(path)
    return {"s": seconds[1][1:], "reused_s": seconds[3][1:]}


# ------------------------------------------------------------------------------------------ the sitting
def _restored(backup: str, memory_root: str, nodes: tuple[str, ...]) -> None:
    shutil.rmtree(memory_root, ignore_errors=True)
    os.makedirs(memory_root)
    for node in nodes:
        shutil.copytree(os.path.join(backup, node), os.path.join(memory_root, node), symlinks=True)


def measure(sitting) -> dict:
    o = sitting.o
    out: dict = {"saves": {}, "restart": {}, "training": {}, "durable": {}}
    memory_root = tempfile.mkdtemp(prefix="asyncckpt-bench-", dir="/dev/shm")
    try:
        if o.durable:
            _durable(sitting, memory_root, out)
        if o.saves:
            _saves_and_restarts(sitting, memory_root, out)
        if o.training:
            _training(sitting, memory_root, out)
    finally:
        shutil.rmtree(memory_root, ignore_errors=True)
    out["failures_per_day"] = o.failures_per_day
    return out


def _durable(sitting, memory_root: str, out: dict) -> None:
    """The time to durable on 2 and 4 nodes, durable only and with the tier, in ABBA order at each node count."""
    o = sitting.o
    for nodes in DURABLE_NODES:
        for _, run in sitting.abba(sitting.runs(list(DURABLE_ARMS)), 2):
            root = sitting.directory(f"durable_{nodes}_{run.label}")
            with sitting.phase(f"durable {nodes} nodes {run.label}"):
                found = sitting.child("job_durable", arm=run.arm, nodes=nodes, size_mib=o.durable_mib, reps=o.reps,
                                      root=root, memory_root=memory_root, node_cores=o.node_cores)
            entry = out["durable"].setdefault(str(nodes), {}).setdefault(run.arm, {"durable_s": [], "committed_s": [],
                                                                                  "wrote": [], "own": []})
            for key in entry:
                entry[key] += found[key]
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(memory_root, ignore_errors=True)
            os.makedirs(memory_root)


def _saves_and_restarts(sitting, memory_root: str, out: dict) -> None:
    import boto3

    o = sitting.o
    server = Server("moto", sitting.directory("s3"))
    try:
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        backup, kept = sitting.directory("kept_memory"), {}
        rounds = 2
        arms = [arm for arm in SAVES if o.s3 or arm != "memory_s3"]
        for r, run in sitting.abba(sitting.runs(arms), rounds):
            root = f"s3://{BUCKET}/run_{run.label}" if run.arm == "memory_s3" else sitting.directory(f"run_{run.label}")
            keep_to = backup if (run.arm == "memory" and r == rounds - 1) else ""
            with sitting.phase(f"saves {run.label}"):
                found = sitting.child("job_saves", arm=run.arm, size_mib=o.size_mib, reps=o.reps, root=root,
                                      memory_root=memory_root, keep_to=keep_to, node_cores=o.node_cores)
            entry = out["saves"].setdefault(run.arm, {"state_bytes": found["state_bytes"], "tensors": found["tensors"],
                                                      "reps": {k: [] for k in found["reps"]}, "snapshot_s": [],
                                                      "warmup_s": []})
            for key, values in found["reps"].items():
                entry["reps"][key] += values
            entry["snapshot_s"] += found["snapshot_s"]
            entry["warmup_s"].append(found["warmup_s"])
            if r == rounds - 1 and run.arm != "durable":
                kept[run.arm] = found["kept"]  # the newest checkpoint, durable (and in memory: ``backup``)
            elif not root.startswith("s3://"):
                shutil.rmtree(root, ignore_errors=True)
            if run.arm == "memory":  # its floor right after it: the same minutes of this shared machine
                with sitting.phase(f"raw transfers {r}"):
                    raw = _raw_transfers(sitting, memory_root)
                out.setdefault("raw_transfer_s", []).extend(raw["s"])
                out.setdefault("raw_transfer_reused_s", []).extend(raw["reused_s"])
        disk_root = os.path.dirname(kept["memory"])
        sources = {"own": (disk_root, ("n0", "n1")), "own_alone": (disk_root, ("n0", "n1")),
                   "peer": (disk_root, ("n0",)), "disk": (disk_root, ()),
                   "s3": (os.path.dirname(kept.get("memory_s3", "")), ())}
        sources = {source: where for source, where in sources.items()
                   if source in o.restarts.split(",") and (o.s3 or source != "s3")}
        for _ in range(o.reps):
            for source, (root, nodes) in sources.items():
                _restored(backup, memory_root, nodes)
                if source == "disk":
                    evict([os.path.join(d, n) for d, _, names in os.walk(root) for n in names])
                with sitting.phase(f"restart {source}"):
                    found = sitting.child("job_restart", size_mib=o.size_mib, root=root, memory_root=memory_root,
                                          breakdown=source == "own", turns=source == "own_alone",
                                          node_cores=o.node_cores)
                out["restart"].setdefault(source, []).append(found["load_s"])
                out.setdefault("restart_parts", {}).setdefault(source, []).append(found["parts"])
                out.setdefault("restart_paths", {})[source] = found["paths"]
        shutil.rmtree(disk_root, ignore_errors=True)
        _restored(backup, memory_root, ())
    finally:
        server.stop()


def node_reader(sink: str, node: int, node_cores: int) -> None:
    """``raw_reader`` on node ``node``'s cores (with ``node_cores``: the floor's receiving side where the tier's is)."""
    if node_cores:
        os.sched_setaffinity(0, node_cpus(node, node_cores))
    raw_reader(sink)


def _raw_transfers(sitting, memory_root: str) -> dict:
    """``raw_transfers`` between two raw readers of their own, and their files removed after."""
    sinks = [tempfile.mkdtemp(dir=memory_root) for _ in range(2)]
    readers = [started(sitting, "node_reader", sink=sink, node=node, node_cores=sitting.o.node_cores)
               for node, sink in enumerate(sinks)]
    try:
        return sitting.child("raw_transfers", addresses=[a for _, a in readers], size_mib=sitting.o.size_mib,
                             scratch=memory_root, reps=sitting.o.reps, node_cores=sitting.o.node_cores)
    finally:
        for child, _ in readers:
            child.process.kill()
            child.process.wait()
        for sink in sinks:
            shutil.rmtree(sink, ignore_errors=True)


def _training(sitting, memory_root: str, out: dict) -> None:
    """The training arms in ABBA order; on the GPU without the core-free arms (a GPU trainer leaves its cores)."""
    o = sitting.o
    readers = [started(sitting, "node_reader", sink=tempfile.mkdtemp(dir=memory_root), node=node,
                       node_cores=o.node_cores) for node in range(2)]
    try:
        training = list(TRAINING) + ([FREE + arm for arm in TRAINING] if o.device == "cpu" and o.free_core else [])
        for _, run in sitting.abba(sitting.runs(training), 2):
            root = sitting.directory(f"train_{run.label}")
            with sitting.phase(f"training {run.label}"):
                found = sitting.child("job_train", arm=run.arm, size_mib=o.size_mib, seconds=o.train_s,
                                      saves=o.train_saves, root=root, memory_root=memory_root,
                                      readers=[a for _, a in readers], device=o.device, node_cores=o.node_cores)
            out["training"].setdefault(run.arm, []).append(found)
            shutil.rmtree(root, ignore_errors=True)
    finally:
        for child, _ in readers:
            child.process.kill()
            child.process.wait()


# ------------------------------------------------------------------------------------------ the page
def _costs(figures: dict) -> dict:
    """The medians the interval needs: the stall, the time to safe (memory + replica, or durable), the restart."""
    saves = figures["saves"]
    return {"stall": median(saves["memory"]["reps"]["stall_s"]),
            "durable": (median(saves["durable"]["reps"]["committed_s"]), median(figures["restart"]["disk"])),
            "memory": (median(saves["memory"]["reps"]["committed_s"]), median(figures["restart"]["own"]))}


def render(result: dict) -> str:
    figures = result["figures"]
    lines = _durable_lines(result)
    lines += _saves_and_restarts_lines(result) if figures["saves"] else []
    lines += _training_lines(result)
    if figures["saves"]:
        lines += _interval_lines(figures)
    return "\n".join(lines)


def _durable_lines(result: dict) -> list[str]:
    """The time to durable on 2 and 4 nodes, and what each writer wrote against its own files."""
    durable = result["figures"].get("durable")
    if not durable:
        return []

    def ratios(arm: dict) -> str:
        each = [wrote / own for ranks_wrote, ranks_own in zip(arm["wrote"], arm["own"])
                for wrote, own in zip(ranks_wrote, ranks_own)]
        return f"{min(each):.3f}–{max(each):.3f}"

    rows = []
    for nodes, arms in durable.items():
        alone, tiered = (median(arms[arm]["durable_s"]) for arm in DURABLE_ARMS)
        rows.append([nodes, fmt(alone), fmt(median(arms["memory"]["committed_s"])), fmt(tiered),
                     f"**{tiered / alone:.2f}x**", ratios(arms["durable"]), ratios(arms["memory"])])
    return [f"**Time to durable**, {result['options']['durable_mib']} MiB per rank, each rank a node: from the save "
            f"call to the checkpoint's commit record on the disk (each rank polls for it; the slowest rank's; the "
            f"memory commit: its handle done; medians over "
            f"{result['options']['reps']} saves per arm and sitting half, ABBA, after the warm-up saves). With the tier "
            "each rank's writer saves its share durably from the same snapshot beside its save in memory (a sharded "
            "save to a local durable place; behind the memory commit, from memory, otherwise), all nodes at once. "
            "Bytes: what each writer wrote to storage (`/proc/<pid>/io`'s "
            "`write_bytes`: writes into tmpfs, the tier's, do not count) over the bytes of the files its rank saved, "
            "min–max over ranks and saves.", "",
            *table(["nodes", "durable only s", "memory tier: in memory s", "memory tier: durable s",
                    "tier / durable only (goal 1.2x)",
                    "bytes written / own, durable only", "bytes written / own, memory tier"], rows), ""]


def _saves_and_restarts_lines(result: dict) -> list[str]:
    figures = result["figures"]
    saves = figures["saves"]
    first = saves["durable"]
    snapshot_s = median(saves["memory"]["snapshot_s"])
    fresh_s = median(figures["raw_transfer_s"])
    reused_s = median(figures.get("raw_transfer_reused_s") or figures["raw_transfer_s"])
    raw_s = min(fresh_s, reused_s)
    floor_s = snapshot_s + raw_s
    lines = [f"{first['state_bytes'] / 2**30:.2f} GiB in {first['tensors']} tensors per rank, 2 ranks, each a node; "
             f"medians in seconds over {result['options']['reps']} saves per arm and sitting half (ABBA), each the "
             f"slower rank's.", "",
             *table(["", "stall", "committed (memory + replica, or durable)", "durable (the time to durable on disk: "
                     "above)", "committed / floor"],
                    [[name, fmt(median(saves[arm]["reps"]["stall_s"])), fmt(median(saves[arm]["reps"]["committed_s"])),
                      fmt(median(saves[arm]["reps"]["durable_s"])) if arm != "memory" else "—",
                      fmt(median(saves[arm]["reps"]["committed_s"]) / floor_s, ".2f") + "x"]
                     for arm, name in SAVES.items() if arm in saves]), "",
             f"Floor of the memory commit with a replica: the snapshot (a held memcpy of the share, {fmt(snapshot_s)} s) "
             f"+ a raw socket transfer of the share, hashed once (xxh3) as it arrives ({fmt(raw_s)} s, both shares at "
             f"once, right after each job of the memory arm; the faster of into fresh "
             f"tmpfs pages, {fmt(fresh_s)} s, and into the pages of a file kept from the transfer before, "
             f"{fmt(reused_s)} s, as the tier's spares) = {fmt(floor_s)} s "
             f"(goal: committed within 1.25x; a replica stays verified when it arrives, so the floor verifies its "
             f"bytes once). With the tier, each rank's writer writes its own share durably from its node's memory.", "",
             *_warmup_lines(saves),
             "A restart (a fresh two-rank job: `latest_checkpoint` + `load`, the slower rank, checked bit for bit):", "",
             *table(["source", "load s", "x the saves' memcpy of the share", "vs disk (cold)"],
                    [[RESTARTS[source], fmt(median(times)), fmt(median(times) / snapshot_s, ".2f") + "x",
                      fmt(median(figures["restart"]["disk"]) / median(times), ".1f") + "x faster"]
                     for source, times in figures["restart"].items()]), "",
             f"Goals: from memory within 1.5x of a memcpy, at least 5x faster than the disk cold. The memcpy above is "
             f"the saves' snapshot ({fmt(snapshot_s)} s, the median of every save's); the one each rank takes right "
             f"after its load (below) is the closer comparison where the two differ.", ""]
    alone = figures.get("restart_parts", {}).get("own_alone")
    if alone and "memcpy_s" in alone[0]:
        load_s, memcpy_s = median([p["load_s"] for p in alone]), median([p["memcpy_s"] for p in alone])
        lines += [f"One node at a time (each rank's load, then its held memcpy of the share, with the machine's cores "
                  f"to itself, as on a node of its own; the slower rank's): `load` {fmt(load_s)} s against a memcpy of "
                  f"{fmt(memcpy_s)} s, **{fmt(load_s / memcpy_s, '.2f')}x**; both nodes at once (above) share this "
                  f"machine's two cores between two loads. Each node's writer starts during the restart too (before "
                  f"its load up to 5aa1dd8, after it since), on the same cores here; one node at a time, the next "
                  f"node's turn waits for it since 290d016.", ""]
    parts = figures.get("restart_parts", {}).get("own")
    if parts and "read_s" in parts[0]:
        part = {key: median([p[key] for p in parts]) for key in parts[0]}
        lines += ["What a restart from its own memory is made of (the same process right after it, both ranks at once, "
                  "each the slower rank's median):", "",
                  *table(["part", "s", "x memcpy"],
                         [[name, fmt(part[key]), fmt(part[key] / part["memcpy_s"], ".2f") + "x"] for key, name in (
                             ("agree_s", "`latest_checkpoint` (the nodes agree on the checkpoint)"),
                             ("load_s", "`load` (plan, read, verify by checksum)"),
                             ("load_unverified_s", "`load` again, `verify=False`"),
                             ("read_s", "bare read of the rank's data files into a held buffer (16 MiB reads)"),
                             ("hash_s", "bare xxh3 of the rank's data files (through a mapping)"),
                             ("memcpy_s", "held memcpy of the share (the same process, then)"))]), ""]
    return lines


def _warmup_lines(saves: dict) -> list[str]:
    """What a run's first saves cost, before the measured ones (each job's, ``save``: blocking to committed)."""
    jobs = saves["memory"].get("warmup_s")
    if not jobs:
        return []
    first, second = (median([job[n] for job in jobs]) for n in range(2))
    return [f"Not in the table: a run's first two saves with the tier, which each job makes before the measured ones "
            f"(so that these find the tier at its steady state, as the floor's processes hold their pages from the "
            f"start): the first {fmt(first)} s to committed (plans, the writer and the receivers start, a staging "
            f"buffer and the peer's copy in new tmpfs pages), the second {fmt(second)} s (a second snapshot buffer, "
            f"kept while the first holds the newest checkpoint, and the peer's second copy in new pages); medians "
            f"over {len(jobs)} jobs.", ""]


def _training_lines(result: dict) -> list[str]:
    training, lines = result["figures"]["training"], []
    on_gpu = result["options"].get("device") == "cuda"
    for title, prefix, goal in (
            ("both ranks computing on the one GPU, each rank's CPU thread waiting for its steps: the cores free, as a "
             "GPU trainer leaves them" if on_gpu else "both ranks computing, one thread each: every core busy", "",
             "Goal (a GPU trainer): the background work at most 5% slower than no checkpoints." if on_gpu else
             "Goal (every core busy): the memory tier's slowdown no worse than its floor's: the same bytes sent by "
             "another process over loopback into the other node's tmpfs, hashed there once as they arrive."),
            ("a core left free: rank 0 computes on one thread, rank 1 keeps step without computing, as a GPU "
             "trainer leaves its CPU", FREE, "Goal (a core free): the background work at most 5% slower than no "
             "checkpoints (the stalls are the snapshot's, measured above).")):
        runs_of = {arm: training[prefix + arm] for arm in TRAINING if prefix + arm in training}
        if not runs_of:
            continue
        none_s, saves = median([run["wall_s"] for run in runs_of["none"]]), result["options"]["train_saves"]
        rows = []
        for arm, runs in runs_of.items():
            wall_s = median([run["wall_s"] for run in runs])
            stall_s = median([run["stall_s"] for run in runs if run["stall_s"] is not None])
            rows.append([TRAINING[arm], fmt(wall_s), f"{(wall_s / none_s - 1) * 100:+.1f}%", fmt(stall_s),
                         f"{((wall_s - saves * stall_s) / none_s - 1) * 100:+.1f}%"])
        lines += [f"The training loop ({title}; the same steps in every arm):", "",
                  *table(["arm", "wall s", "vs no checkpoints", "stall per save s",
                          "beyond the stalls (the background work's share)"], rows), "", goal, ""]
    return lines


def _interval_lines(figures: dict) -> list[str]:
    from asyncckpt.core.api import interval

    costs = _costs(figures)
    rate = figures["failures_per_day"]
    losses = {name: interval.least_loss(costs["stall"], *costs[name], rate) for name in ("durable", "memory")}
    return ["", f"At {rate:g} failure(s) a day (`api.interval`, Young/Daly; the memory tier's restart from "
                  f"its own memory, the durable one's from the disk cold):", "",
              *table(["", "least-loss interval", "lost per failure", "lost per day"],
                     [[name, f"{loss.seconds:.0f} s", f"{loss.lost_per_failure_s:.1f} s", f"{loss.lost_per_day_s:.0f} s"]
                      for name, loss in (("durable only", losses["durable"]), ("**memory tier**", losses["memory"]))])]


def plot(result: dict, figure) -> None:
    from asyncckpt.core.api import interval

    restarts = result["figures"]["restart"]
    if not restarts:  # the training arms alone: each arm's wall time
        runs = result["figures"]["training"]
        arms = [arm for arm in TRAINING if arm in runs]
        bars(figure.subplots(1, 1), [TRAINING[arm].replace("**", "") for arm in arms],
             [median([run["wall_s"] for run in runs[arm]]) for arm in arms], "training loop, wall s")
        return
    restart_axes, loss_axes = figure.subplots(1, 2)
    bars(restart_axes, [RESTARTS[s] for s in restarts], [median(restarts[s]) for s in restarts], "restart load, s")
    costs, rate = _costs(result["figures"]), result["figures"]["failures_per_day"]
    intervals = [10 * 1.25 ** k for k in range(40)]
    for name, key in (("durable only", "durable"), ("memory tier", "memory")):
        safe, restart_s = costs[key]
        loss = [86400 / t * costs["stall"] + rate * (max(t, safe) / 2 + restart_s) for t in intervals]
        least = interval.least_loss(costs["stall"], safe, restart_s, rate).seconds
        loss_axes.plot(intervals, loss, label=f"{name} (least at {least:.0f} s)")
    loss_axes.set_xscale("log")
    loss_axes.set_xlabel("checkpoint interval, s")
    loss_axes.set_ylabel(f"work lost per day, s ({rate:g} failure(s)/day)")
    loss_axes.legend()


SCENARIO = Scenario(
    title="The memory tier: saves, restarts and training on two nodes, time to durable on two and four",
    question=__doc__.split("\n\n", 1)[1].strip().replace("\n", " "),
    measure=measure, render=render, plot=plot,
    options={"size_mib": Option(1024, 32), "failures_per_day": Option(1.0, 1.0),
             "durable": Option(True, True, help="the time to durable on 2 and 4 nodes, and each writer's bytes"),
             "durable_mib": Option(256, 16, help="each rank's share in the time-to-durable part"),
             "node_cores": Option(0, 0, help="N: each node (its rank, writer and floor processes) on N cores of its "
                                             "own, its training on N threads (a machine of 2N cores or more)"),
             "s3": Option(True, True, help="false: no S3 arm (saves, restarts)"),
             "free_core": Option(True, True, help="false: no training arms with a core left free"),
             "restarts": Option("own,own_alone,peer,disk,s3", "own,own_alone,peer,disk,s3",
                                help="the restart sources measured"),
             "train_s": Option(30.0, 4.0, help="seconds of computation per training run"),
             "train_saves": Option(5, 2, help="saves per training run"),
             "training": Option(True, True, help="false: the saves and restarts only"),
             "saves": Option(True, True, help="false: the training arms only"),
             "device": Option("cpu", "cpu", help="cuda: the training arms' shares and steps on the GPU")},
    reps=(3, 1),
    limits=("memcpy", "odirect_write", "cold_read"),
)
