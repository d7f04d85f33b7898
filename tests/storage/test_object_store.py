"""Checkpoints in S3 through fsspec/s3fs, against a real S3 server (moto's threaded server on 127.0.0.1).

Real ranks (gloo, spawned processes, each with its own temporary directory: nothing shared but the
bucket and the Store), real server stops, real kill -9.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from asyncckpt import core
from asyncckpt.core.cli import main
from asyncckpt.core.storage import file_checksums
from asyncckpt.core.storage import leftovers
from asyncckpt.core.storage.backend import backend_for, read_bytes
from asyncckpt.core.storage.object_store import ObjectStoreError, ObjectStoreOptions, store_for
from dist_helper import run_on_ranks
from processes import Program
from s3_server import S3Server
from writers import writers_of

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")


def reference(name: str, shape=(64, 48)) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def test_round_trip_one_rank(s3_root, capsys):
    root = f"{s3_root}/ckpts"
    state = {"w": reference("w", (512, 1024)), "small": [reference(f"s{i}", (17,)) for i in range(300)],
             "step": 5, "meta": {"name": "run"}}
    options = ObjectStoreOptions(part_bytes=5 << 20, concurrency=4)  # the 2 MiB tensor and batches in several ranges
    with core.Checkpointer(object_store=options) as checkpointer:
        checkpointer.async_save(state, f"{root}/step_000005", step=5).result()
        checkpointer.save(state, f"{root}/step_000006", step=6)  # streamed while copying
        assert core.latest_checkpoint(root) == f"{root}/step_000006"
        for name in ("step_000005", "step_000006"):
            target = {"w": torch.zeros(512, 1024), "small": [torch.zeros(17) for _ in range(300)], "step": 0,
                      "meta": {"name": None}}
            checkpointer.load(target, f"{root}/{name}")
            assert torch.equal(target["w"], state["w"]) and target["step"] == 5 and target["meta"] == {"name": "run"}
            assert all(torch.equal(a, b) for a, b in zip(target["small"], state["small"]))
    store = store_for(root)
    names = {entry.name for entry in store.list(f"{root}/step_000005")}
    assert names == {".asyncckpt-commit.json", ".metadata", "__0.asyncckpt.json", "__0_0.distcp", "__0_1.distcp"}
    assert main.main(["verify", "--no-progress", f"{root}/step_000005"]) == main.EXIT_OK
    capsys.readouterr()
    assert main.main(["inspect", f"{root}/step_000005"]) == main.EXIT_OK
    shown = capsys.readouterr().out
    assert "COMPLETE, step 5, world size 1" in shown and "w  tensor  float32  [512, 1024]  2097152 B  1 chunk(s)" in shown
    assert "small.299  tensor  float32  [17]" in shown and "meta.name  object" in shown
    assert "    chunk at [0, 0] size [512, 1024]: rank 0, 2097152 B data in __0_0.distcp [" in shown  # from the sidecar
    assert "  rank 0: 301 tensor chunk(s) 2117552 B, 2 object(s)" in shown


def test_ls_and_inspect_read_a_bucket_as_a_directory(s3_root, tmp_path, capsys):
    """One ``ls`` and one ``inspect`` for every store: the same checkpoints written to a directory and
    to a bucket list as the same rows (name, step, status, kind) and inspect alike."""
    listings = {}
    for root in (str(tmp_path / "run"), f"{s3_root}/run"):
        state = {"w": reference("w", (64, 32)), "step": 4}
        with core.Checkpointer() as checkpointer:
            checkpointer.save(state, f"{root}/step_000004", step=4)
            checkpointer.save({"w": state["w"] + 1, "step": 6}, f"{root}/step_000006", step=6)  # shares nothing
            remote = backend_for(root).remote
            directory = tmp_path / "local" / "checkpoint_5" if remote else f"{root}/checkpoint_5"
            with checkpointer.begin_directory(directory, step=5) as tx:
                tx.save_file({"w": state["w"]}, "model.bin")
                saved = tx.commit()
            if remote:  # a directory of native files reaches a bucket as a mirror
                checkpointer.mirror(directory, f"{root}/checkpoint_5", after=saved)
                with pytest.raises(ValueError, match="written to a local path; to keep it in an object store, mirror it"):
                    checkpointer.begin_directory(f"{root}/checkpoint_8", step=8)
                with pytest.raises(ValueError, match="a symbolic link lives on a local file system"):
                    checkpointer.link(f"{root}/step_000004", f"{root}/latest")
            checkpointer.save_file({"state_dict": {"w": state["w"]}, "global_step": 7}, f"{root}/epoch=0-step=7.ckpt")
            checkpointer.wait()
        backend = backend_for(root)
        backend.delete([f"{root}/step_000006/.asyncckpt-commit.json"])  # a save that crashed
        capsys.readouterr()
        assert main.main(["ls", root]) == main.EXIT_OK
        rows = [line.split() for line in capsys.readouterr().out.splitlines()]
        listings[backend.remote] = [(row[0], row[1], row[4], " ".join(row[5:])) for row in rows]
        assert main.main(["inspect", f"{root}/step_000004"]) == main.EXIT_OK
        shown = capsys.readouterr().out
        assert "COMPLETE, step 4, world size 1" in shown and "w  tensor  float32  [64, 32]  8192 B  1 chunk(s)" in shown
        assert "  rank 0: 1 tensor chunk(s) 8192 B, 1 object(s)" in shown
        assert main.main(["inspect", f"{root}/step_000006"]) == main.EXIT_INCOMPLETE
        assert main.main(["inspect", f"{root}/epoch=0-step=7.ckpt"]) == main.EXIT_OK
        assert "single file, " in capsys.readouterr().out
        assert main.main(["inspect", f"{root}/checkpoint_5"]) == main.EXIT_OK
        assert "model.bin" in capsys.readouterr().out
    assert listings[False] == listings[True] == [
        ("step_000004", "4", "COMPLETE", "(sharded)"),
        ("checkpoint_5", "5", "COMPLETE", "(directory)"),
        ("step_000006", "6", "INCOMPLETE", "(sharded, no commit record)"),
        ("epoch=0-step=7.ckpt", "7", "COMPLETE", "(file, epoch 0)"),
    ], listings


def test_load_finds_damage_and_refuses_uncommitted(s3_root):
    path = f"{s3_root}/c/step_000001"
    core.Checkpointer().save({"w": torch.ones(1000)}, path, step=1)
    store = store_for(path)
    data = bytearray(store.get(f"{path}/__0_0.distcp"))
    data[-100] ^= 0xFF  # inside the tensor's bytes (the container's tail is 22 B + the version records)
    data[len(data) // 2] ^= 0xFF
    store.put(f"{path}/__0_0.distcp", bytes(data))
    with pytest.raises(core.CorruptCheckpointError, match="checksum mismatch for key 'w'"):
        core.Checkpointer().load({"w": torch.zeros(1000)}, path)
    assert main.main(["verify", "--no-progress", path]) == main.EXIT_PROBLEM
    store.delete([f"{path}/.asyncckpt-commit.json"])
    assert core.latest_checkpoint(f"{s3_root}/c") is None
    with pytest.raises(core.IncompleteCheckpointError):
        core.Checkpointer().load({"w": torch.zeros(1000)}, path)
    assert main.main(["inspect", path]) == main.EXIT_INCOMPLETE
    assert main.main(["verify", "--no-progress", path]) == main.EXIT_INCOMPLETE
    assert main.main(["inspect", f"{s3_root}/c/never_written"]) == main.EXIT_PROBLEM


def test_a_commit_record_of_a_newer_version_is_rejected_as_locally(s3_root, tmp_path):
    """One parser for every store: a record newer than this code is no commit, on s3:// as on disk."""
    state = {"w": reference("w", (8,))}
    for root in (f"{s3_root}/versions", str(tmp_path / "versions")):
        path = f"{root}/step_000001"
        core.Checkpointer().save(state, path, step=1)
        assert core.latest_checkpoint(root) == path
        backend = backend_for(path)
        record = json.loads(read_bytes(backend, f"{path}/.asyncckpt-commit.json"))
        newer = json.dumps({**record, "version": record["version"] + 1}).encode()
        if backend.remote:
            store_for(path).put(f"{path}/.asyncckpt-commit.json", newer)
        else:
            with open(f"{path}/.asyncckpt-commit.json", "wb") as f:
                f.write(newer)
        assert core.latest_checkpoint(root) is None, root
        assert not core.is_complete(path)
        with pytest.raises(core.IncompleteCheckpointError):
            core.Checkpointer().load({"w": torch.zeros(8)}, path)


def _save_on_two_ranks(rank, world, root):
    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix=f"rank{rank}-")  # nothing local is shared
    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(reference("w"), mesh, [Shard(0)]),
             "own": reference(f"own{rank}", (8,)) if rank == 0 else reference("own0", (8,)), "step": 3}
    with core.Checkpointer() as checkpointer:
        handle = checkpointer.async_save(state, f"{root}/step_000003", step=3)
        handle.result()
        target = {"w": distribute_tensor(torch.zeros(64, 48), mesh, [Shard(0)]), "own": torch.zeros(8), "step": 0}
        checkpointer.load(target, core.latest_checkpoint(root))
        assert torch.equal(target["w"].full_tensor(), reference("w")) and target["step"] == 3
        checkpointer.wait(everywhere=True)
    return os.environ["TMPDIR"]


def test_two_ranks_without_shared_filesystem_then_reshard_to_one(s3_root):
    root = f"{s3_root}/sharded"
    tmpdirs = run_on_ranks(_save_on_two_ranks, 2, root)
    assert tmpdirs[0] != tmpdirs[1]
    names = {entry.name for entry in store_for(root).list(f"{root}/step_000003")}
    assert {"__0.asyncckpt.json", "__1.asyncckpt.json", "__0_0.distcp", "__1_0.distcp"} <= names
    assert not any(name.startswith(".asyncckpt-owner") for name in names)  # the commit dropped the owner markers
    record = json.loads(store_for(root).get(f"{root}/step_000003/.asyncckpt-commit.json"))
    assert record["world_size"] == 2 and record["step"] == 3
    target = {"w": torch.zeros(64, 48), "own": torch.zeros(8), "step": 0}  # one rank, whole tensors: resharded
    core.Checkpointer().load(target, f"{root}/step_000003")
    assert torch.equal(target["w"], reference("w")) and torch.equal(target["own"], reference("own0", (8,)))


def test_single_file_object_with_checksum_and_overwrite(s3_root):
    path = f"{s3_root}/lightning/last.ckpt"
    with core.Checkpointer(object_store=ObjectStoreOptions(part_bytes=5 << 20)) as checkpointer:
        for step in (1, 2):
            checkpointer.async_save_file({"w": torch.full((3 << 20,), float(step)), "step": step}, path, step=step)
        checkpointer.wait()
    import fsspec

    with fsspec.open(path, "rb") as f:  # what Lightning's own loader does with a URL
        loaded = torch.load(f, weights_only=True)
    assert loaded["step"] == 2 and torch.equal(loaded["w"], torch.full((3 << 20,), 2.0))
    record = file_checksums.read_record(path)
    assert record is not None and record.size == backend_for(path).stat(path).size
    assert main.main(["verify", "--no-progress", path]) == main.EXIT_OK
    assert main.main(["inspect", path]) == main.EXIT_OK
    assert store_for(path).incomplete_uploads(f"{s3_root}/lightning") == []
    assert [e.name for e in store_for(path).list(f"{s3_root}/lightning")] == ["last.ckpt"]  # no marker left


def test_retention_keeps_the_newest_and_remove_deletes_commit_first(s3_root):
    root = f"{s3_root}/managed"
    with core.CheckpointManager(root, keep_last=2) as manager:
        for step in range(1, 5):
            manager.save(step, {"w": torch.full((1000,), float(step)), "step": step})
        assert manager.steps() == [3, 4]
        target = {"w": torch.zeros(1000), "step": 0}
        assert manager.load(target) == 4 and target["w"][0] == 4.0
        manager.checkpointer.remove([manager.path_for(3)]).result()
        assert manager.steps() == [4]
    assert [e.name for e in store_for(root).list(root)] == ["step_000004"]


def test_unreachable_endpoint_and_missing_bucket_are_named():
    options = ObjectStoreOptions(storage_options={"key": "k", "secret": "s", "client_kwargs": {
        "endpoint_url": "http://127.0.0.1:9"}, "config_kwargs": {"retries": {"max_attempts": 1}}})
    with pytest.raises(ObjectStoreError, match=r"bucket 'nowhere', endpoint http://127.0.0.1:9") as raised:
        store_for("s3://nowhere/x", options).get("s3://nowhere/x/.asyncckpt-commit.json")
    assert "cannot reach the endpoint" in str(raised.value)


def test_missing_bucket_fails_the_save_naming_it(s3_server):
    with core.Checkpointer() as checkpointer:
        handle = checkpointer.async_save({"w": torch.ones(10)}, "s3://no-such-bucket/ckpt")
        with pytest.raises(core.CheckpointWriteError, match="no-such-bucket.*endpoint " + s3_server.endpoint):
            handle.result()


# ------------------------------------------------------------------------------ failures mid-save
def _save_while_the_server_stops(rank, world, root, endpoint, started):
    options = ObjectStoreOptions(storage_options={"client_kwargs": {"endpoint_url": endpoint},
                                                  "config_kwargs": {"retries": {"max_attempts": 1},
                                                                    "connect_timeout": 2, "read_timeout": 5}},
                                 part_bytes=5 << 20, concurrency=2)
    with core.Checkpointer(object_store=options, timeout=60) as checkpointer:
        checkpointer.save({"w": torch.full((1 << 20,), 1.0), "step": 1}, f"{root}/step_000001", step=1)
        big = {"w": torch.full((64 << 20,), 2.0), "step": 2}  # 256 MiB per rank: seconds to upload here
        began = time.monotonic()
        handle = checkpointer.async_save(big, f"{root}/step_000002", step=2)
        started.set()
        with pytest.raises(core.CheckpointError) as raised:
            handle.result()
        try:
            checkpointer.close()
        except core.CheckpointError:
            pass
        return str(raised.value), time.monotonic() - began


def test_server_stopped_mid_save_fails_every_rank_and_keeps_the_previous(s3_server):
    server = S3Server()  # its own, to stop: moto keeps the buckets in this process, so a restart finds them
    bucket = server.new_bucket()
    root = f"s3://{bucket}/run"
    import multiprocessing

    started = multiprocessing.get_context("spawn").Event()

    def stop_soon() -> None:
        started.wait(120)
        time.sleep(0.5)
        server.stop()

    stopper = threading.Thread(target=stop_soon)
    stopper.start()
    try:
        results = run_on_ranks(_save_while_the_server_stops, 2, root, server.endpoint, started, timeout=170)
    finally:
        stopper.join()
    for message, seconds in results:
        assert seconds < 60, f"the failure took {seconds:.0f}s"
        assert "step_000002" in message and "nothing was published" in message
    assert any(f"endpoint {server.endpoint}" in message and f"bucket '{bucket}'" in message for message, _ in results)
    restarted = S3Server.on_port(server.port)
    try:
        options = ObjectStoreOptions(storage_options={"client_kwargs": {"endpoint_url": restarted.endpoint}})
        from asyncckpt.core.storage import object_store

        object_store.configure(options, prefix=root)
        try:
            assert core.latest_checkpoint(root) == f"{root}/step_000001"
            target = {"w": torch.zeros(1 << 20), "step": 0}
            core.Checkpointer(object_store=options).load(target, f"{root}/step_000001")
            assert target["step"] == 1 and bool((target["w"] == 1.0).all())
        finally:
            object_store.configure(None, prefix=root)
    finally:
        restarted.stop()


def _kill_mid_upload(root: str, logs: str) -> None:
    proc = Program([sys.executable, os.path.join(HERE, "crash_writer.py"), root, "steps"], logs)
    try:
        proc.wait_for_line("submitted 2", timeout=120)
        time.sleep(0.4)  # the writer is uploading step 2's 192 MiB
        for writer in writers_of(proc.pid):  # both die, as when a node goes down (a writer alone would
            os.kill(writer, signal.SIGKILL)   # finish the upload its training process handed over)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)


def test_kill_9_mid_upload_is_invisible_and_clean_removes_it(s3_root, capsys, tmp_path):
    root = f"{s3_root}/killed"
    _kill_mid_upload(root, str(tmp_path))
    latest = core.latest_checkpoint(root)
    assert latest in (None, f"{root}/step_000001")
    deadline = time.monotonic() + 10  # the killed processes may not be reaped yet
    while any(leftover.alive for leftover in leftovers.find(root)) and time.monotonic() < deadline:
        time.sleep(0.1)
    found = leftovers.find(root)
    assert found and all(leftover.alive is False for leftover in found), found
    uncommitted = [leftover.path for leftover in found if leftover.kind == "uncommitted"]
    assert f"{root}/step_000002" in uncommitted
    with pytest.raises(core.IncompleteCheckpointError):
        core.Checkpointer().load({"step": None}, f"{root}/step_000002")
    assert main.main(["ls", root]) == main.EXIT_OK
    assert "INCOMPLETE" in capsys.readouterr().out
    assert main.main(["clean", root]) == main.EXIT_OK
    assert leftovers.find(root) == []
    assert store_for(root).incomplete_uploads(root) == []
    assert core.latest_checkpoint(root) == latest


# ------------------------------------------------------------------------------ mirrors of local checkpoints
def test_mirror_of_committed_directory_and_restore(s3_root, tmp_path):
    local_root, url_root = tmp_path / "checkpoints", f"{s3_root}/mirror"
    with core.Checkpointer() as checkpointer:
        for step in (1, 2):
            with checkpointer.begin_directory(local_root / f"checkpoint_{step}", step=step) as tx:
                tx.save_file({"w": torch.full((1 << 20,), float(step))}, "model.bin")
                tx.write_bytes("state.json", json.dumps({"step": step}).encode())
                saved = tx.commit()
            checkpointer.mirror(local_root / f"checkpoint_{step}", f"{url_root}/checkpoint_{step}", after=saved)
        failed = checkpointer.begin_directory(local_root / "checkpoint_3", step=3)
        failed.abort(RuntimeError("the framework's save failed"))
        cancelled = checkpointer.mirror(local_root / "checkpoint_3", f"{url_root}/checkpoint_3", after=failed.handle)
        checkpointer.wait()
    assert cancelled.exception() is not None  # nothing is mirrored for a save that did not commit
    assert core.latest_checkpoint(url_root) == f"{url_root}/checkpoint_2"
    assert main.main(["verify", "--no-progress", f"{url_root}/checkpoint_2"]) == main.EXIT_OK
    local_record = json.loads((local_root / "checkpoint_2" / ".asyncckpt-commit.json").read_bytes())
    assert json.loads(store_for(url_root).get(f"{url_root}/checkpoint_2/.asyncckpt-commit.json")) == local_record

    restored_root = tmp_path / "elsewhere"  # a new machine: no local copy
    with core.Checkpointer() as restorer:
        restored = restorer.restore_mirrored(url_root, str(restored_root))
    assert restored == str(restored_root / "checkpoint_2") and core.is_complete(restored)
    assert core.Checkpointer().require_intact(restored).checked_files == 2
    assert torch.load(os.path.join(restored, "model.bin"))["w"][0] == 2.0
    assert sorted(os.listdir(restored_root)) == ["checkpoint_2"]  # published by rename: no staging left
