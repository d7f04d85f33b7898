"""Restarts at scale: the bytes every rank of a job loads are read from storage once per job, split across the
ranks and shared over the process group (``loading.cooperative``), on one node and across simulated nodes
(each with its own ``ASYNCCKPT_NODE`` and memory root), from local files and from a real S3 server whose GET
bytes are counted; with the framework's own load through each adapter in test_cooperative_resume.py."""
from __future__ import annotations

import hashlib
import json
import os
import time

import pytest

from asyncckpt.core.loading.cooperative import Piece, split
from dist_helper import run_on_ranks

SIZES = [40 << 20, 3 << 20 | 17, 0, 9 << 20]  # a large file, odd sizes, an empty one


def test_the_files_are_split_into_one_byte_balanced_contiguous_part_per_reader():
    pieces = split(SIZES, [0, 1, 2])
    per_reader = {reader: sum(p.length for p in pieces if p.reader == reader) for reader in (0, 1, 2)}
    assert max(per_reader.values()) - min(per_reader.values()) <= 2, per_reader
    covered = {index: [] for index in range(len(SIZES))}
    for piece in pieces:
        covered[piece.file].append((piece.start, piece.start + piece.length))
    for index, size in enumerate(SIZES):  # every byte once, in order
        assert [end for _start, end in covered[index]][-1:] == ([size] if size else []), covered[index]
        assert all(a[1] == b[0] for a, b in zip(covered[index], covered[index][1:]))
    assert [p.reader for p in pieces] == sorted(p.reader for p in pieces)  # contiguous parts
    assert split([5], [3, 7]) == [Piece(0, 0, 3, 3), Piece(0, 3, 2, 7)]


def _files(folder) -> list[str]:
    paths = []
    for index, size in enumerate(SIZES):
        path = folder / f"file{index}.bin"
        path.write_bytes(os.urandom(size))
        paths.append(str(path))
    return paths


def _digests(paths) -> list[str]:
    return [hashlib.sha256(open(path, "rb").read()).hexdigest() for path in paths]


def _evict(paths) -> None:
    os.sync()  # dirty pages are not dropped
    for path in paths:
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _io(counter: str) -> int:
    """One of this process's I/O counters (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith(f"{counter}:")).split()[1])


def _load_together(rank, world, paths, nodes, memory, readers="job"):
    """This rank's view of a cooperative load of ``paths``: its copies' digests, where they were, the bytes it
    read from storage."""
    node = rank * nodes // world
    os.environ.update(ASYNCCKPT_NODE=f"n{node}", ASYNCCKPT_MEMORY_ROOT=f"{memory}/node{node}")
    from asyncckpt.core.loading import cooperative

    before = _io("rchar")
    with cooperative.shared_copy(paths, None, timeout=60, readers=readers) as copies:
        read = _io("rchar") - before
        assert copies is not None
        return _digests([copies[path] for path in paths]), sorted({os.path.dirname(c) for c in copies.values()}), read


def _each_by_itself(rank, world, paths, memory):
    os.environ["ASYNCCKPT_MEMORY_ROOT"] = f"{memory}/node0"
    from asyncckpt.core.loading import cooperative

    with cooperative.shared_copy(paths, None, timeout=60) as copies:
        return copies


def test_files_of_one_node_are_left_to_its_page_cache(tmp_path):
    """Ranks of one node loading local files: the page cache reads each byte once for all of them, so no copy, and
    nothing made beside the node's memory root."""
    memory = tmp_path / "memory"
    memory.mkdir()
    assert run_on_ranks(_each_by_itself, 2, _files(tmp_path), str(memory)) == [None, None]
    assert not os.listdir(memory)


@pytest.mark.parametrize("world,nodes", [(2, 2), (4, 2)])
def test_local_files_are_read_once_per_job_and_every_rank_gets_them_whole(tmp_path, world, nodes):
    paths = _files(tmp_path)
    want = _digests(paths)
    _evict(paths)
    results = run_on_ranks(_load_together, world, paths, nodes, str(tmp_path / "memory"))
    assert all(digests == want for digests, _where, _read in results)
    assert len({tuple(where) for _d, where, _r in results}) == nodes  # one copy per node, shared by its ranks
    # What each process's read calls returned (page cache or disk alike; the bytes the disk served to this machine
    # are the benchmark's, on a quiet machine: here other jobs' memory pressure adds page faults of their own)
    read = [read for _d, _w, read in results]
    total = sum(SIZES)
    assert sum(read) <= 1.05 * total, (read, total)  # once per job
    assert all(0.95 * total / world <= r <= 1.05 * total / world for r in read), read  # each rank its share
    assert not os.listdir(tmp_path / "memory")  # nothing left in the nodes' memory


def test_objects_are_downloaded_once_per_job_across_nodes_and_one_reader_per_node_on_request(tmp_path, s3_server,
                                                                                          s3_root):
    from asyncckpt.core.storage.object_store import store_for

    local = _files(tmp_path)
    urls = [f"{s3_root}/ckpt/{os.path.basename(path)}" for path in local]
    for path, url in zip(local, urls):
        store_for(url).put(url, open(path, "rb").read())
    want, total = _digests(local), sum(SIZES)
    for readers in ("job", "node"):
        before = s3_server.get_bytes
        results = run_on_ranks(_load_together, 4, urls, 2, str(tmp_path / "memory"), readers)
        assert all(digests == want for digests, _where, _read in results)
        downloaded = s3_server.get_bytes - before
        assert total <= downloaded <= 1.05 * total, (readers, downloaded, total)


def _different_files(rank, world, folder):
    """Each rank (a node of its own) loads a file of its own: no sharing, each reads by itself, one line says why."""
    import logging

    os.environ["ASYNCCKPT_NODE"] = f"n{rank}"

    from asyncckpt.core.loading import cooperative

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("asyncckpt").addHandler(handler)
    with cooperative.shared_copy([f"{folder}/file{rank}.bin"], None, timeout=60) as copies:
        return copies, said


def test_ranks_that_load_different_files_each_read_their_own_and_say_why(tmp_path):
    _files(tmp_path)
    results = run_on_ranks(_different_files, 2, str(tmp_path))
    for copies, said in results:
        assert copies is None
        assert len(said) == 1 and "the ranks load different files" in said[0] and "file1.bin" in said[0], said


def _failing_rank(rank, world, paths, failing, how, report, memory=None):
    """``failing`` cannot read its part (``how``: "error") or dies reading it ("killed"); what every other rank
    saw, and how long it took, goes to ``report``. Each rank a node of its own (``memory``: its memory root there)."""
    os.environ["ASYNCCKPT_NODE"] = f"n{rank}"
    if memory is not None:
        os.environ["ASYNCCKPT_MEMORY_ROOT"] = f"{memory}/n{rank}"
    from asyncckpt.core.errors import CheckpointError
    from asyncckpt.core.loading import cooperative

    if rank == failing:
        def read(path, start, into):
            if how == "killed":
                os._exit(9)
            raise OSError(5, "Input/output error")

        cooperative._read = read  # this rank's storage fails (its own process only)
    started = time.monotonic()
    try:
        with cooperative.shared_copy(paths, None, timeout=20):
            outcome = "loaded"
    except CheckpointError as error:
        outcome = f"{type(error).__name__}: {error}"
    with open(f"{report}.{rank}", "w") as f:
        json.dump([outcome, time.monotonic() - started], f)


def test_a_rank_that_cannot_read_its_part_fails_every_rank_naming_the_rank_and_the_file(tmp_path):
    paths = _files(tmp_path)
    report = str(tmp_path / "report")
    run_on_ranks(_failing_rank, 3, paths, 1, "error", report)
    for rank in range(3):
        outcome, _seconds = json.load(open(f"{report}.{rank}"))
        assert outcome.startswith("CheckpointError: rank 1 could not read bytes"), outcome
        assert "file0.bin" in outcome and "Input/output error" in outcome, outcome


def _loading_rank(rank, world, paths, memory):
    """A cooperative load of ``paths`` on nodes of their own (memory roots under ``memory``): what it read."""
    os.environ.update(ASYNCCKPT_NODE=f"n{rank}", ASYNCCKPT_MEMORY_ROOT=f"{memory}/n{rank}")
    from asyncckpt.core.loading import cooperative

    with cooperative.shared_copy(paths, None, timeout=60) as copies:
        return [hashlib.sha256(open(copies[path], "rb").read()).hexdigest() for path in paths]


def test_a_rank_killed_during_the_load_fails_the_others_within_the_timeout(tmp_path):
    """...and the node copy its killed node leader left in memory goes at the next cooperative load on that node."""
    paths, memory = _files(tmp_path), tmp_path / "memory"
    report = str(tmp_path / "report")
    with pytest.raises(AssertionError, match=r"rank 1: no result .* exit code 9"):
        run_on_ranks(_failing_rank, 3, paths, 1, "killed", report, str(memory))
    for rank in (0, 2):
        outcome, seconds = json.load(open(f"{report}.{rank}"))
        assert outcome.startswith("CheckpointTimeoutError: the ranks' cooperative load failed"), outcome
        assert seconds < 20 + 10, seconds
    left = memory / "n1-loads"
    assert len(os.listdir(left)) == 1, os.listdir(left)  # the dead leader's copy of node n1 (its pid gone)
    expected = [hashlib.sha256(open(path, "rb").read()).hexdigest() for path in paths]
    assert run_on_ranks(_loading_rank, 2, paths, str(memory)) == [expected, expected]
    assert list(left.glob("*")) == [] and list((memory / "n0-loads").glob("*")) == []  # the loads' own went too


def _restore_together(rank, world, url_root, local_roots, memory):
    """Each rank the first process of a node of its own, without a shared filesystem: the mirrored checkpoint restored
    into its node's directory; the digests of what it restored."""
    os.environ.update(ASYNCCKPT_NODE=f"n{rank}", ASYNCCKPT_MEMORY_ROOT=f"{memory}/node{rank}", LOCAL_RANK="0")
    from asyncckpt.core import Checkpointer

    checkpointer = Checkpointer()
    restored = checkpointer.restore_mirrored(url_root, local_roots[rank])
    checkpointer.close()
    return {name: hashlib.sha256(open(os.path.join(restored, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(restored))}


def test_a_mirrored_checkpoint_is_downloaded_once_per_job_onto_every_node(tmp_path, s3_server, s3_root):
    import torch

    from asyncckpt.core import Checkpointer

    checkpointer = Checkpointer()
    state = {f"w{i}": torch.randn(1 << 20) for i in range(8)}  # 32 MiB
    local = tmp_path / "run" / "step-1"
    checkpointer.async_save(state, local).result()
    checkpointer.mirror(local, f"{s3_root}/run/step-1").result()
    checkpointer.close()
    want = {name: hashlib.sha256((local / name).read_bytes()).hexdigest() for name in sorted(os.listdir(local))}
    before = s3_server.get_bytes
    roots = [str(tmp_path / f"node{rank}" / "run") for rank in range(2)]
    results = run_on_ranks(_restore_together, 2, f"{s3_root}/run", roots, str(tmp_path / "memory"))
    downloaded = s3_server.get_bytes - before
    assert all(restored == want for restored in results)  # every node its own copy, whole, its record included
    size = sum(f.stat().st_size for f in local.iterdir())
    assert size <= downloaded <= 1.05 * size, (downloaded, size)  # once per job, not once per node


def _load_replicated(rank, world, path, damaged):
    """Every rank loads the same (replicated) state, as DDP ranks do, each rank a node of its own: what it loaded,
    what its own read calls returned, and what loading the damaged copy raised."""
    os.environ["ASYNCCKPT_NODE"] = f"n{rank}"
    import torch

    from asyncckpt.core import Checkpointer
    from asyncckpt.core.errors import CheckpointError

    checkpointer = Checkpointer()
    state = {"big": {f"w{i}": torch.zeros(1 << 20) for i in range(12)}, "small": torch.zeros(7, dtype=torch.int16),
             "step": 0}
    before = _io("rchar")
    checkpointer.load(state, path)
    read = _io("rchar") - before
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in [*state["big"].values(), state["small"]])).hexdigest()
    try:
        checkpointer.load(state, damaged)
        outcome = "loaded"
    except CheckpointError as error:
        outcome = f"{type(error).__name__}: {error}"
    checkpointer.close()
    return digest, state["step"], read, outcome


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_tensors_of_a_sharded_checkpoint_are_read_once_per_job(tmp_path, world):
    import shutil

    import torch

    from asyncckpt.core import Checkpointer

    generator = torch.Generator().manual_seed(0)
    state = {"big": {f"w{i}": torch.randn(1 << 20, generator=generator) for i in range(12)},
             "small": torch.arange(7, dtype=torch.int16), "step": 41}
    path, damaged = tmp_path / "step-41", tmp_path / "damaged"
    checkpointer = Checkpointer()
    checkpointer.async_save(state, path).result()
    checkpointer.close()
    data = [f for f in path.iterdir() if f.suffix == ".distcp"]
    shutil.copytree(path, damaged)
    target = damaged / data[0].name
    flipped = bytearray(target.read_bytes())
    flipped[len(flipped) // 2] ^= 1
    target.write_bytes(bytes(flipped))
    want = hashlib.sha256(b"".join(t.numpy().tobytes() for t in [*state["big"].values(), state["small"]])).hexdigest()

    results = run_on_ranks(_load_replicated, world, str(path), str(damaged))
    size = sum(f.stat().st_size for f in data)
    assert all(digest == want and step == 41 for digest, step, _read, _outcome in results)
    read = [r for _d, _s, r, _o in results]
    assert sum(read) <= 1.05 * size, (read, size)  # every rank's own read calls: its share only
    for _d, _s, _r, outcome in results:  # found by the rank that read it, raised on every rank, naming file and key
        assert outcome.startswith("CorruptCheckpointError") and data[0].name in outcome and "big.w" in outcome, outcome


def _load_replica_groups(rank, world, path):
    """HSDP on 4 ranks, each a node of its own: ``w`` sharded within the replica groups {0, 1} and {2, 3} (each
    shard read by two ranks), ``b`` replicated on all four; saved, then loaded through DCP's resharding path with
    our reader: what the load gave, what this rank's read calls returned, and what loading a damaged copy raised."""
    os.environ["ASYNCCKPT_NODE"] = f"n{rank}"
    import shutil

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from asyncckpt.core import Checkpointer
    from asyncckpt.core.errors import CheckpointError

    mesh = init_device_mesh("cpu", (2, 2))
    generator = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(4096, 1024, generator=generator), "b": torch.randn(1 << 18, generator=generator)}

    def state(fill):
        return {"model": {"w": distribute_tensor(fill(full["w"]), mesh, [Replicate(), Shard(0)]),
                          "b": distribute_tensor(fill(full["b"]), mesh, [Replicate(), Replicate()])}, "step": 0}

    checkpointer = Checkpointer()
    saved = state(lambda t: t)
    saved["step"] = 12
    checkpointer.save(saved, path)
    damaged = path + "-damaged"
    if rank == 0:
        shutil.copytree(path, damaged)
        largest = max((f for f in os.listdir(damaged) if f.endswith(".distcp")),
                      key=lambda f: os.path.getsize(os.path.join(damaged, f)))
        flipped = bytearray(open(os.path.join(damaged, largest), "rb").read())
        flipped[len(flipped) // 2] ^= 1
        open(os.path.join(damaged, largest), "wb").write(bytes(flipped))
    dist.barrier()
    loaded = state(torch.zeros_like)
    before = _io("rchar")
    checkpointer.load(loaded, path)
    read = _io("rchar") - before
    equal = all(torch.equal(loaded["model"][k].full_tensor(), full[k]) for k in full) and loaded["step"] == 12
    try:
        checkpointer.load(state(torch.zeros_like), damaged)
        outcome = "loaded"
    except CheckpointError as error:
        outcome = f"{type(error).__name__}: {error}"
    checkpointer.close()
    return equal, read, outcome


def test_chunks_that_replica_groups_share_are_read_once_per_job(tmp_path):
    """DCP's path (DTensors): each whole chunk that several ranks load (a shard of an HSDP replica group, a
    tensor replicated everywhere, the saved objects) is read by one of them and sent to the others."""
    path = tmp_path / "step-12"
    results = run_on_ranks(_load_replica_groups, 4, str(path))
    data = sum(f.stat().st_size for f in path.iterdir() if f.suffix == ".distcp")
    assert all(equal for equal, _read, _outcome in results)
    read = [r for _e, r, _o in results]
    assert sum(read) <= 1.05 * data, (read, data)  # without sharing: twice the shards and four times ``b``
    for _e, _r, outcome in results:  # found by the rank that read it, raised on every rank, naming file and key
        assert outcome.startswith("CorruptCheckpointError") and ".distcp" in outcome and "model.w" in outcome, outcome
