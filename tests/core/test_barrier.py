"""Where the ranks of a save meet: the two ``Barrier`` implementations, on real torch.distributed ranks.

Both (the markers on a filesystem and in a bucket of the S3 server the tests start) are driven the way the writers drive them (every rank arrives once its share is durable,
rank 0 waits for all and commits, the others wait for the commit), with a rank that fails and a
rank that never arrives; then whole saves of each kind (sharded, directory) go through the Store
barrier across ranks, with an I/O failure on one rank.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from asyncckpt import core
from asyncckpt.core.formats import commit_record, names
from asyncckpt.core.storage.backend import backend_for
from asyncckpt.core.writer.barrier import BarrierSpec, MarkerBarrier, StoreBarrier
from asyncckpt.core.snapshot.dist_env import default_store
from dist_helper import run_on_ranks
from writers import limit_file_size


def _barrier(kind: str, root: str, key: str, world: int, timeout: float):
    final = os.path.join(root, f"ckpt-{key}")
    staging = final if kind == "objects" else os.path.join(root, f".ckpt-{key}.asyncckpt-staging-{key}")  # in place
    spec = BarrierSpec(kind, key, world, staging, final, timeout)
    return StoreBarrier(default_store(), spec) if kind == "store" else MarkerBarrier(spec)


@pytest.fixture(params=["store", "files", "objects"])
def kind_and_root(request, tmp_path) -> tuple[str, str]:
    return request.param, request.getfixturevalue("s3_root") if request.param == "objects" else str(tmp_path)


FAILS_TIMEOUT = 60.0  # far beyond any wait a failure ends, however loaded the machine


def _meet(rank, world, kind, root, scenario):
    """Returns what this rank saw: "ok", or the error's type and message."""
    barrier = _barrier(kind, root, scenario, world, timeout=FAILS_TIMEOUT if scenario == "fails" else 4.0)
    started = time.monotonic()
    try:
        if scenario == "fails" and rank == 2:
            barrier.fail(rank, "OSError: [Errno 28] No space left on device")
            return "failed", 0.0
        if scenario == "absent" and rank == 1:
            return "absent", 0.0
        barrier.arrive(rank)
        if rank == 0:
            barrier.wait_all()
            if kind != "store":  # the commit record under the final name is what the others wait for
                record = f"{barrier.spec.final_path}/{names.COMMIT_RECORD}"
                if kind == "files":
                    os.makedirs(barrier.spec.final_path)
                backend_for(record).write(record, commit_record.encode({"files": {}, "save_id": scenario}), atomic=True)
            barrier.committed()
        else:
            barrier.wait_commit()
        return "ok", time.monotonic() - started
    except core.CheckpointError as e:
        return f"{type(e).__name__}: {e}", time.monotonic() - started


def test_barrier_all_arrive_then_commit(kind_and_root):
    seen = run_on_ranks(_meet, 3, *kind_and_root, "all")
    assert [outcome for outcome, _ in seen] == ["ok"] * 3


def test_a_failing_rank_ends_every_wait_at_once_naming_it(kind_and_root):
    seen = run_on_ranks(_meet, 3, *kind_and_root, "fails")
    assert seen[2][0] == "failed"
    for outcome, elapsed in seen[:2]:  # rank 0 in wait_all, rank 1 in wait_commit
        assert outcome == "CheckpointWriteError: rank 2: OSError: [Errno 28] No space left on device", outcome
        assert elapsed < FAILS_TIMEOUT / 2  # not the timeout: the failure ended the wait


def test_a_rank_that_never_arrives_is_a_bounded_wait_naming_it(kind_and_root):
    seen = run_on_ranks(_meet, 3, *kind_and_root, "absent")
    coordinator, waiting = seen[0], seen[2]
    assert coordinator[0] == "CheckpointTimeoutError: rank(s) [1] did not finish writing within 4s (not committed)"
    assert 3.5 < coordinator[1] < 15
    assert waiting[0] == "CheckpointTimeoutError: rank 0 did not commit it within 4s"


def _saves_through_the_store(rank, world, root):
    """Every kind of save across ranks, meeting in the Store; then an I/O error on rank 1."""
    store = default_store()
    with core.Checkpointer(timeout=30) as checkpointer:
        sharded = checkpointer.async_save({"w": torch.full((1000,), float(rank))}, f"{root}/sharded")
        sharded.result()
        tx = checkpointer.begin_directory(f"{root}/checkpoint-1", step=1)
        tx.save_file({"w": torch.full((4,), float(rank))}, f"model_{rank}.pt")
        tx.commit().result()
        met_in_store = [store.get(f"asyncckpt/{key}/final") for key in (sharded.request.save_id, tx.save_id)]
        if rank == 1:  # a real EFBIG in this rank's writer
            limit_file_size(checkpointer, 1 << 20)
        failed = None
        try:
            tx = checkpointer.begin_directory(f"{root}/checkpoint-2", step=2)
            tx.save_file({"w": torch.zeros(1 << 20)}, f"model_{rank}.pt")  # 4 MiB
            tx.commit().result()
        except core.CheckpointWriteError as e:
            failed = str(e)
    return met_in_store, failed


def test_sharded_and_directory_saves_meet_in_the_store(tmp_path):
    results = run_on_ranks(_saves_through_the_store, 2, str(tmp_path))
    for met_in_store, failed in results:
        assert met_in_store == [b"ok", b"ok"]  # committed through the Store barrier
        assert failed is not None and "checkpoint-2 (step 2) failed on rank 1: " in failed and "[Errno" in failed, failed
    assert core.is_complete(str(tmp_path / "sharded")) and core.is_complete(str(tmp_path / "checkpoint-1"))
    assert sorted(os.listdir(tmp_path / "checkpoint-1")) == [".asyncckpt-commit.json", "model_0.pt", "model_1.pt"]
    assert not os.path.exists(tmp_path / "checkpoint-2")
