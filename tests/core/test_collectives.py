"""The library on a process group that carries no CPU tensors, as NCCL's, on this CPU-only machine.

Each test runs 2 ranks (real processes) in a default group made with ``init_process_group("cuda:gloo")``: it refuses
CPU tensors ("No backend type associated with device type cpu"), as NCCL does at any world size, and here fails
object collectives and barriers too, where NCCL would run them on the GPU. What asyncckpt runs must not need it:
its collectives run on a transport that carries CPU tensors (``snapshot.collectives``). Ranks are nodes of their
own where a test says so (``ASYNCCKPT_NODE``, a memory root each), so that loads share bytes across nodes.

What the emulation cannot run is the training's own, not the library's: DTensors made by ``distribute_tensor`` (a
scatter from rank 0 on the mesh's group) or gathered by ``full_tensor``, FSDP's and DDP's collectives on CPU
parameters; the sharded checkpoints here hold DTensors made from each rank's local shard
(``DTensor.from_local``), as FSDP makes them on a GPU, and HSDP's replica groups need 4 ranks, more than these
tests start.
"""
from __future__ import annotations

import hashlib
import os
import shutil

import torch

from dist_helper import run_on_ranks
from test_cooperative_load import _restore_together
from writers import wait_until_gone

GROUP = "cuda:gloo"


def _io(counter: str) -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith(f"{counter}:")).split()[1])


def _node(rank: int, memory: str) -> None:
    """This rank a node of its own."""
    os.environ.update(ASYNCCKPT_NODE=f"n{rank}", ASYNCCKPT_MEMORY_ROOT=f"{memory}/n{rank}",
                      ASYNCCKPT_REPLICATION_ADDRESS="127.0.0.1")


def _replicated(step: int) -> dict:
    generator = torch.Generator().manual_seed(step)
    return {"model": {f"w{i}": torch.randn(1 << 18, generator=generator) for i in range(8)}, "step": step}


def _sharded(rank: int, mesh, zeros: bool = False) -> dict:
    """A DTensor sharded over the ranks (its shard made locally) and one replicated on both."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shard = torch.zeros(256, 64) if zeros else torch.arange(512 * 64, dtype=torch.float32).reshape(512, 64)[rank * 256:][:256]
    whole = torch.zeros(1 << 20) if zeros else torch.full((1 << 20,), 7.0)
    return {"shard": DTensor.from_local(shard.clone(), mesh, [Shard(0)], run_check=False),
            "whole": DTensor.from_local(whole, mesh, [Replicate()], run_check=False), "step": 0 if zeros else 5}


def _saves_and_loads(rank, world, root):
    """Every kind of save, and loads on two nodes: replicated state (each rank reads its share, the other's
    arrives), a sharded checkpoint through dcp.load (the replicated tensor read once per job)."""
    from torch.distributed.device_mesh import DeviceMesh

    from asyncckpt.core import Checkpointer

    _node(rank, f"{root}/memory")
    checkpointer = Checkpointer()
    checkpointer.save(_replicated(1), f"{root}/sync")
    checkpointer.async_save(_replicated(2), f"{root}/async").result()
    checkpointer.async_save(_replicated(3), f"{root}/overlapped", overlap_snapshot=True)
    checkpointer.wait(everywhere=True)
    loaded = {}
    for name in ("sync", "async", "overlapped"):
        state = _replicated(0)
        before = _io("rchar")
        checkpointer.load(state, f"{root}/{name}")
        loaded[name] = (state["step"], all(torch.equal(a, b) for a, b in zip(state["model"].values(),
                                                                                 _replicated(state["step"])["model"].values())),
                        _io("rchar") - before)
    mesh = DeviceMesh("cpu", list(range(world)))
    checkpointer.save(_sharded(rank, mesh), f"{root}/sharded")
    state = _sharded(rank, mesh, zeros=True)
    before = _io("rchar")
    checkpointer.load(state, f"{root}/sharded")
    read = _io("rchar") - before
    expected = _sharded(rank, mesh)
    same = torch.equal(state["shard"].to_local(), expected["shard"].to_local()) and \
        torch.equal(state["whole"].to_local(), expected["whole"].to_local()) and state["step"] == 5
    checkpointer.close()
    return loaded, (same, read)


def test_saves_and_loads_on_two_nodes(tmp_path):
    """save, async_save, an overlapped async_save (its structure agreed on the snapshot thread), and loads on two
    nodes: the replicated state read once per job, bit for bit; a sharded (DTensor) checkpoint through dcp.load,
    each rank's shard its own, the replicated tensor read by one rank and sent to the other."""
    results = run_on_ranks(_saves_and_loads, 2, str(tmp_path), backend=GROUP)
    for name, step in (("sync", 1), ("async", 2), ("overlapped", 3)):
        size = sum(f.stat().st_size for f in (tmp_path / name).glob("*.distcp"))
        assert [loaded[name][:2] for loaded, _ in results] == [(step, True)] * 2
        assert sum(loaded[name][2] for loaded, _ in results) < 1.2 * size, name  # not once per rank
    assert [same for _, (same, _read) in results] == [True, True]
    whole = 4 << 20
    assert sum(read for _, (_same, read) in results) < whole + 2 * (256 * 64 * 4) + (1 << 20)  # `whole` read once


def _from_a_bucket(rank, world, url):
    """Two ranks of one node: a save into the bucket, and its load, each rank downloading its share."""
    from asyncckpt.core import Checkpointer

    checkpointer = Checkpointer()
    checkpointer.save(_replicated(4), url)
    state = _replicated(0)
    checkpointer.load(state, url)
    checkpointer.close()
    return state["step"], all(torch.equal(a, b) for a, b in zip(state["model"].values(), _replicated(4)["model"].values()))


def test_a_bucket_on_one_node_and_a_mirror_restored_on_two(tmp_path, s3_server, s3_root):
    """A checkpoint saved into a bucket and loaded from it on one node, downloaded once per job; then a mirrored
    checkpoint (``mirror_to``'s) restored on two nodes: rank 0 picks it, each node gets it whole, downloaded once."""
    from asyncckpt.core import Checkpointer

    before = s3_server.get_bytes
    assert run_on_ranks(_from_a_bucket, 2, f"{s3_root}/saved", backend=GROUP) == [(4, True)] * 2
    assert s3_server.get_bytes - before < 1.2 * 8 * (1 << 20)  # the 8 MiB: once per job, not once per rank

    checkpointer = Checkpointer()
    local = tmp_path / "run" / "step-1"
    checkpointer.save(_replicated(1), local)
    checkpointer.mirror(local, f"{s3_root}/run/step-1").result()
    checkpointer.close()
    want = {name: hashlib.sha256((local / name).read_bytes()).hexdigest() for name in sorted(os.listdir(local))}
    before = s3_server.get_bytes
    roots = [str(tmp_path / f"node{rank}" / "run") for rank in range(2)]
    results = run_on_ranks(_restore_together, 2, f"{s3_root}/run", roots, str(tmp_path / "memory"), backend=GROUP)
    assert results == [want, want]
    assert s3_server.get_bytes - before <= 1.05 * sum(f.stat().st_size for f in local.iterdir())


def _tier_saves(rank, world, root):
    """Steps 1-3 with the memory tier on two nodes (2 also durable, 3 in memory only, on both nodes); then the job
    dies (``die``)."""
    from asyncckpt.core import Checkpointer, MemoryTier

    _node(rank, f"{root}/memory")
    checkpointer = Checkpointer(memory_tier=MemoryTier(persist_every=2, keep=2, replicas=1, peer_timeout=5))
    for step in (1, 2, 3):
        checkpointer.async_save(_replicated(step), f"{root}/run/step_{step}", step=step)
    checkpointer.wait(everywhere=True)
    return os.getpid()


def _tier_restart(rank, world, root):
    """The restarted job: the nodes agree on the newest memory checkpoint and complete it (node 1, replaced, from
    node 0's replica of its share), then each rank loads step 3 and saves step 4, which the run's end persists."""
    from asyncckpt.core import Checkpointer, MemoryTier

    _node(rank, f"{root}/memory")
    checkpointer = Checkpointer(memory_tier=MemoryTier(persist_every=2, keep=2, replicas=1, peer_timeout=5))
    path = checkpointer.latest_checkpoint(f"{root}/run")
    state = _replicated(0)
    checkpointer.load(state, path)
    expected = _replicated(3)["model"]
    checkpointer.async_save(_replicated(4), f"{root}/run/step_4", step=4)
    checkpointer.close()
    return path, state["step"], all(torch.equal(a, b) for a, b in zip(state["model"].values(), expected.values()))


def test_the_memory_tier_saves_restarts_and_assembles_a_replaced_node(tmp_path):
    """The memory tier on two nodes (its placement agreed at each save, its replicas, its commit), the job killed,
    node 1 replaced (its memory gone): the restart agrees on step 3 (in memory only), node 1 fetches its share from
    node 0, each rank resumes bit for bit; the run's end writes its last save durably."""
    root = tmp_path
    pids = run_on_ranks(_tier_saves, 2, str(root), backend=GROUP, die=True)
    wait_until_gone(*pids)  # the orphaned writers finish what they were handed
    assert sorted(os.listdir(root / "run")) == ["step_2"]
    shutil.rmtree(root / "memory" / "n1")
    results = run_on_ranks(_tier_restart, 2, str(root), backend=GROUP)
    assert [(os.path.basename(path), step, same) for path, step, same in results] == [("step_3", 3, True)] * 2
    assert [str(root / "memory" / f"n{rank}") in path for rank, (path, _s, _same) in enumerate(results)] == [True, True]
    assert sorted(os.listdir(root / "run")) == ["step_2", "step_4"]
