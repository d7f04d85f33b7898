"""The async pipeline: snapshot semantics, back-pressure, failures, drains, overlap, retention."""
from __future__ import annotations

import argparse
import copy
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from asyncckpt.core.formats.names import COMMIT_RECORD
import torch.distributed.checkpoint as dcp

from asyncckpt import core
from dist_helper import run_on_ranks
from writers import limit_file_size


def _mutable_state():
    torch.manual_seed(0)
    shared = torch.randn(64, 32)
    embedding = torch.randn(100, 16)
    return {
        "weight": shared,
        "weight_rows": shared[8:24],  # a view of the same storage
        "embed.weight": embedding,
        "lm_head.weight": embedding,  # tied
        "bf16": torch.randn(33).to(torch.bfloat16),
        "step": torch.tensor(5),
        "opt": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}], "history": [1, 2, 3]},
        "args": argparse.Namespace(seed=1, name="run"),
    }


def _mutate_everything(state):
    for value in (state["weight"], state["embed.weight"], state["bf16"], state["step"]):
        value.fill_(-7)
    state["opt"]["param_groups"][0]["lr"] = 99.0
    state["opt"]["history"].append(4)
    state["args"].seed = 2


def _blank(state):
    """Same nesting as ``state``; tensors zeroed, other leaves None (so loading must fill them)."""
    if isinstance(state, dict):
        return {k: _blank(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_blank(v) for v in state]
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else None


def test_snapshot_holds_call_time_values_after_mutation(tmp_path):
    state = _mutable_state()
    with core.Checkpointer() as checkpointer:
        # the second save of the structure copies speculatively, before the structure agreement
        checkpointer.async_save(state, tmp_path / "first").result()
        for value in (state["weight"], state["embed.weight"], state["bf16"], state["step"]):
            value.add_(1)  # new values for the second save, unlike what _mutate_everything writes
        expected = copy.deepcopy(state)
        handle = checkpointer.async_save(state, tmp_path / "ckpt")
        _mutate_everything(state)
        handle.result()
        loaded = _blank(expected)
        tied = loaded["embed.weight"]
        loaded["lm_head.weight"] = tied
        checkpointer.load(loaded, tmp_path / "ckpt")
    for key in ("weight", "weight_rows", "embed.weight", "bf16", "step"):
        assert torch.equal(loaded[key], expected[key]), key
    assert loaded["lm_head.weight"] is tied and torch.equal(tied, expected["embed.weight"])  # still tied
    assert loaded["opt"] == expected["opt"] and vars(loaded["args"]) == vars(expected["args"])


def test_same_keys_new_structure_is_saved_right(tmp_path):
    """A save whose keys match the last save starts copying before the structure is confirmed;
    when shapes, dtypes or kinds changed under the same keys, that copy must be thrown away."""
    states = [
        {"a": torch.arange(6.0), "b": torch.ones(3, 2), "n": 1},
        {"a": torch.arange(8.0), "b": torch.ones(3, 2) * 2, "n": 2},  # shape changed
        {"a": torch.arange(8, dtype=torch.float64), "b": torch.ones(3, 2) * 3, "n": 3},  # dtype changed
        {"a": "no longer a tensor", "b": torch.ones(3, 2) * 4, "n": 4},  # kind changed
        {"a": torch.arange(8, dtype=torch.float64) * 5, "b": torch.ones(3, 2) * 5, "n": 5},  # the earlier structure again
    ]
    with core.Checkpointer() as checkpointer:
        for i, state in enumerate(states):
            checkpointer.save(state, tmp_path / f"s{i}")
            checkpointer.save(state, tmp_path / f"t{i}")  # same structure twice: the speculative copy is used
        for i, state in enumerate(states):
            for name in (f"s{i}", f"t{i}"):
                target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}
                checkpointer.load(target, tmp_path / name)
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        assert torch.equal(target[key], value) and target[key].dtype == value.dtype, (name, key)
                    else:
                        assert target[key] == value, (name, key)


def test_native_files_hold_call_time_values(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    state = _mutable_state()
    expected = copy.deepcopy(state)
    with core.Checkpointer() as checkpointer:
        as_torch = checkpointer.async_save_file(state, tmp_path / "model.ckpt")
        flat = {"a": state["weight"], "b": state["bf16"]}
        as_safetensors = checkpointer.async_save_file(flat, tmp_path / "model.safetensors", format="safetensors")
        _mutate_everything(state)
        as_torch.result()
        as_safetensors.result()
    loaded = torch.load(tmp_path / "model.ckpt", weights_only=False)
    assert torch.equal(loaded["weight"], expected["weight"]) and torch.equal(loaded["weight_rows"], expected["weight_rows"])
    assert loaded["embed.weight"].data_ptr() == loaded["lm_head.weight"].data_ptr()  # tied, saved once
    assert loaded["opt"] == expected["opt"] and loaded["args"].seed == 1
    st = safetensors.load_file(tmp_path / "model.safetensors")
    assert torch.equal(st["a"], expected["weight"]) and torch.equal(st["b"], expected["bf16"])


def _dtensor_mutation(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    state = {"w": distribute_tensor(full.clone(), mesh, [Shard(0)]), "step": 10}
    with core.Checkpointer() as checkpointer:
        handle = checkpointer.async_save(state, path)
        state["w"].to_local().fill_(-1)
        state["step"] = 11
        handle.result()
        target = {"w": distribute_tensor(torch.zeros(64, 8), mesh, [Shard(1)]), "step": None}
        checkpointer.load(target, path)
    assert torch.equal(target["w"].full_tensor(), full) and target["step"] == 10


def test_dtensor_snapshot_on_two_ranks(tmp_path):
    run_on_ranks(_dtensor_mutation, 2, str(tmp_path / "ckpt"))


def _writer_holds_torch(checkpointer) -> bool:
    """Whether the checkpointer's background writer has torch's library mapped."""
    with open(f"/proc/{checkpointer.writer_pid()}/maps") as maps:
        return "libtorch" in maps.read()


def _sharded_saves_writers_hold_torch(rank, world, root):
    with core.Checkpointer() as ck:
        for step in range(2):
            ck.save({"a": torch.full((1024,), float(step)), "b": torch.full((2048,), float(step)), "step": step},
                    f"{root}/s{step}")
        return _writer_holds_torch(ck)


def test_no_writer_loads_torch_in_sharded_saves(tmp_path):
    assert run_on_ranks(_sharded_saves_writers_hold_torch, 2, str(tmp_path)) == [False, False]


def test_back_pressure_bounds_saves_in_flight(tmp_path):
    state = {"w": torch.randn(8 << 20)}  # 32 MiB
    with core.Checkpointer(max_in_flight=1) as one:
        first = one.async_save(state, tmp_path / "a")
        one.async_save(state, tmp_path / "b")
        assert first.done()  # the second save waited for the first before taking its snapshot
        assert len(one._parts.buffers.slots()) == 1
    with core.Checkpointer(max_in_flight=2) as two:
        handles = [two.async_save(state, tmp_path / f"c{i}") for i in range(3)]
        assert len(two._parts.buffers.slots()) == 2 and handles[0].done()
    assert all(core.is_complete(str(tmp_path / n)) for n in ("a", "b", "c0", "c1", "c2"))


def test_killed_worker_fails_the_save_and_is_restarted(tmp_path):
    state = {"w": torch.randn(32 << 20)}  # 128 MiB: the write takes a while
    with core.Checkpointer() as checkpointer:
        checkpointer.save({"w": torch.ones(4)}, tmp_path / "before")
        handle = checkpointer.async_save(state, tmp_path / "torn")
        first_pid = checkpointer.writer_pid()
        os.kill(first_pid, signal.SIGKILL)
        with pytest.raises(core.CheckpointWriteError, match=r"saving checkpoint .*torn failed on rank 0: the background writer died"):
            handle.result(timeout=30)
        assert not core.is_complete(str(tmp_path / "torn"))
        checkpointer.save(state, tmp_path / "after")  # a new writer takes over
        assert checkpointer.writer_pid() != first_pid
    assert core.latest_checkpoint(str(tmp_path)) in (str(tmp_path / "after"), str(tmp_path / "before"))
    loaded = {"w": torch.zeros(32 << 20)}
    core.load(loaded, tmp_path / "after")
    assert torch.equal(loaded["w"], state["w"])


def _io_error_on_rank_one(rank, world, root):
    with core.Checkpointer(timeout=60) as checkpointer:
        if rank == 1:  # a real EFBIG from the kernel in rank 1's writer, as on a full disk
            limit_file_size(checkpointer, 1 << 20)
        checkpointer.save({"small": torch.full((1000,), float(rank))}, f"{root}/good")
        started = time.monotonic()
        with pytest.raises(core.CheckpointWriteError, match=r"failed on rank 1: .*(File too large|EFBIG|27)"):
            checkpointer.save({f"big{i}": torch.randn(2 << 20) for i in range(4)}, f"{root}/bad")  # 8 MiB per rank
        assert time.monotonic() - started < 30
        assert not core.is_complete(f"{root}/bad")
        target = {"small": torch.zeros(1000)}
        checkpointer.load(target, f"{root}/good")
        checkpointer.save({"small": torch.full((1000,), 2.0)}, f"{root}/good_again")  # the job goes on
    return "ok"


def test_io_error_on_one_rank_reaches_every_rank(tmp_path):
    assert run_on_ranks(_io_error_on_rank_one, 2, str(tmp_path)) == ["ok", "ok"]


def _stuck_peer(rank, world, root):
    if rank == 1:
        return "never saved"  # a rank that never shows up
    with core.Checkpointer(timeout=3, use_collectives=False) as checkpointer:
        started = time.monotonic()
        with pytest.raises(core.CheckpointTimeoutError, match=r"saving checkpoint .*ckpt failed: rank\(s\) \[1\] did not finish writing within 3s"):
            checkpointer.save({"w": torch.ones(10)}, f"{root}/ckpt")
        return time.monotonic() - started


def test_a_stuck_rank_becomes_a_timeout_not_a_hang(tmp_path):
    elapsed, _ = run_on_ranks(_stuck_peer, 2, str(tmp_path), init_process_group=False, timeout=90)
    assert elapsed < 20


def _failure_behind_a_slow_rank(rank, world, root):
    if rank == 1:
        return "never saved"  # still writing, as far as the coordinator can tell
    with core.Checkpointer(timeout=60, use_collectives=False) as checkpointer:
        if rank == 2:  # a real EFBIG in rank 2's writer
            limit_file_size(checkpointer, 1 << 20)
        started = time.monotonic()
        with pytest.raises(core.CheckpointWriteError, match=r"failed on rank 2: .*(File too large|EFBIG|27)"):
            checkpointer.save({f"big{i}": torch.randn(2 << 20) for i in range(4)}, f"{root}/bad")
        return time.monotonic() - started


def test_a_failed_rank_is_seen_while_an_earlier_rank_is_still_writing(tmp_path):
    """The coordinator learns of rank 2's failure at once, not after waiting out rank 1."""
    elapsed, _, _ = run_on_ranks(_failure_behind_a_slow_rank, 3, str(tmp_path), init_process_group=False, timeout=120)
    assert elapsed < 20  # the timeout for rank 1 is 60 s
    assert not core.is_complete(f"{tmp_path}/bad")


def test_normal_exit_drains_accepted_saves(tmp_path):
    script = textwrap.dedent(f"""
        import torch
        from asyncckpt import core
        state = {{"w": torch.randn(16 << 20)}}
        core.async_save(state, {str(tmp_path / 'via_default')!r})
        checkpointer = core.Checkpointer()
        checkpointer.async_save(state, {str(tmp_path / 'via_instance')!r})
        torch.save(state["w"][:10].clone(), {str(tmp_path / 'expected.pt')!r})
        # no wait(), no close(): the interpreter exits right away
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    expected = torch.load(tmp_path / "expected.pt")
    for name in ("via_default", "via_instance"):
        assert core.is_complete(str(tmp_path / name)), name
        loaded = {"w": torch.zeros(16 << 20)}
        core.load(loaded, tmp_path / name)
        assert torch.equal(loaded["w"][:10], expected)


def test_overlapped_staging_guard_makes_optimizer_step_wait(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 512)).sum().backward()
    optimizer.step()
    with core.Checkpointer(overlap_snapshot=True) as checkpointer:
        hooks = checkpointer.snapshot_thread.guard(optimizer)
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        expected = copy.deepcopy(state)
        handle = checkpointer.async_save(state, tmp_path / "ckpt")
        model(torch.randn(4, 512)).sum().backward()  # runs while the snapshot is copied
        optimizer.step()  # the guard waits for the snapshot before mutating anything
        assert handle.snapshot_taken()
        handle.result()
        for hook in hooks:
            hook.remove()
        loaded = {"model": copy.deepcopy(model).state_dict(), "optim": copy.deepcopy(optimizer.state_dict())}
        checkpointer.load(loaded, tmp_path / "ckpt")
    for key, value in expected["model"].items():
        assert torch.equal(loaded["model"][key], value), key
    assert torch.equal(loaded["optim"]["state"][0]["exp_avg"], expected["optim"]["state"][0]["exp_avg"])
    assert not torch.equal(model[0].weight.detach(), expected["model"]["0.weight"])  # training did move on


def _overlapped_ddp_saves(rank, world, root):
    """Overlapped saves on 2 ranks with DDP: each snapshot (and its structure agreement, on the
    checkpointer's own group) runs in the background while DDP all-reduces gradients."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    expected = []
    with core.Checkpointer(overlap_snapshot=True) as checkpointer:
        checkpointer.snapshot_thread.guard(optimizer)
        for step in range(3):
            model(torch.randn(4, 256)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            state = {"model": model.module.state_dict(), "optim": optimizer.state_dict(), "step": step}
            expected.append(copy.deepcopy(state))
            checkpointer.async_save(state, f"{root}/s{step}")
            model(torch.randn(4, 256)).sum().backward()  # all-reduces while the snapshot is taken
            optimizer.step()  # waits for the snapshot
            optimizer.zero_grad()
        checkpointer.wait()
        for step, want in enumerate(expected):
            got = {"model": copy.deepcopy(model.module).state_dict(), "optim": copy.deepcopy(optimizer.state_dict()), "step": -1}
            checkpointer.load(got, f"{root}/s{step}")
            assert got["step"] == step
            for key, value in want["model"].items():
                assert torch.equal(got["model"][key], value), (step, key)
            for index, entry in want["optim"]["state"].items():
                assert torch.equal(got["optim"]["state"][index]["exp_avg_sq"], entry["exp_avg_sq"]), (step, index)
    return "ok"


def test_overlapped_saves_on_two_ranks_with_ddp(tmp_path):
    assert run_on_ranks(_overlapped_ddp_saves, 2, str(tmp_path)) == ["ok", "ok"]


def test_directory_transaction_publishes_all_or_nothing(tmp_path):
    with core.Checkpointer() as checkpointer:
        tx = checkpointer.begin_directory(tmp_path / "checkpoint-1", step=1)
        tx.save_file({"w": torch.ones(3)}, "model.safetensors", format="safetensors")
        tx.write_bytes("trainer_state.json", b"{}")
        tx.commit().result()
        assert sorted(os.listdir(tmp_path / "checkpoint-1")) == [".asyncckpt-commit.json", "model.safetensors",
                                                                  "trainer_state.json"]
        broken = checkpointer.begin_directory(tmp_path / "checkpoint-2", step=2)
        with open(broken.path("sub"), "w"):  # a regular file where the writer needs a directory
            pass
        broken.save_file({"w": torch.ones(3)}, "model.safetensors", format="safetensors")
        broken.save_file({"x": 1}, "sub/optimizer.pt")
        with pytest.raises(core.CheckpointWriteError, match=r"saving checkpoint .*checkpoint-2 \(step 2\) failed on rank 0: "
                                                            r"FileExistsError: .*'[^']*/checkpoint-2/sub'"):
            broken.commit().result()  # the file's failure is the directory's (its message names the final path)
        checkpointer.wait()  # and is reported once
    assert not os.path.exists(tmp_path / "checkpoint-2")
    assert core.latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-1")


def test_a_directory_never_committed_is_discarded_when_the_checkpointer_closes(tmp_path):
    """An interrupt between a directory's files and its commit (Ctrl-C in the Trainer's save, then the exit's drain):
    what the writer staged goes, nothing of it is left beside the checkpoints, and the committed one still loads."""
    with core.Checkpointer() as checkpointer:
        tx = checkpointer.begin_directory(tmp_path / "checkpoint-1", step=1)
        tx.save_file({"w": torch.ones(3)}, "model.safetensors", format="safetensors")
        tx.commit().result()
        tx = checkpointer.begin_directory(tmp_path / "checkpoint-2", step=2)
        tx.save_file({"w": torch.full((3,), 2.0)}, "model.safetensors", format="safetensors")
        with open(tx.path("trainer_state.json"), "w") as f:  # a file the framework writes there itself
            f.write("{}")
        tx.release()  # the file's write reaches the writer (as waiting for a held file releases it)
        checkpointer.wait()
        assert sorted(os.listdir(tmp_path)) == sorted(["checkpoint-1", os.path.basename(tx.staging_dir)])
    assert os.listdir(tmp_path) == ["checkpoint-1"]
    assert core.latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-1")


def test_retention_deletes_only_after_a_newer_commit(tmp_path):
    manager = core.CheckpointManager(tmp_path, keep_last=1, keep_every=10)
    small = {"w": torch.ones(1000)}
    limit_file_size(manager.checkpointer, 4 << 20)  # the writer's files over 4 MiB fail
    manager.save(10, small)
    for step in (11, 12):
        manager.save(step, small)
    manager.wait()
    assert manager.steps() == [10, 12]  # 11 went once 12 was committed; 10 is kept by keep_every
    with pytest.raises(core.CheckpointWriteError):
        manager.save(13, {"w": torch.ones(2 << 20)})  # 8 MiB: fails in the background
    manager.checkpointer.wait()
    assert manager.steps() == [10, 12]  # a failed newer save never costs an older checkpoint
    assert manager.load({"w": torch.zeros(1000)}) == 12
    manager.close()


def test_a_commit_deletes_old_checkpoints_a_killed_writer_left_beside_it(tmp_path):
    """A writer killed between a commit and the deletion of the checkpoint it replaced leaves
    that checkpoint under a hidden name. The next commit at the same path deletes it; a hidden
    directory without a commit record (another rank's save in progress) is left alone."""
    import shutil

    target = tmp_path / "last"
    with core.Checkpointer() as checkpointer:
        checkpointer.save({"w": torch.full((1000,), 1.0)}, target)
        for hidden in (".last.asyncckpt-replaced-0ld", ".last.asyncckpt-staging-1nflight"):
            shutil.copytree(target, tmp_path / "copy")  # then renamed in: the writer may be tidying the directory
            if hidden.endswith("1nflight"):
                os.remove(tmp_path / "copy" / COMMIT_RECORD)
            os.rename(tmp_path / "copy", tmp_path / hidden)
        checkpointer.save({"w": torch.full((1000,), 2.0)}, target)
        checkpointer.wait()
        assert sorted(os.listdir(tmp_path)) == [".last.asyncckpt-staging-1nflight", "last"]
        loaded = {"w": torch.zeros(1000)}
        checkpointer.load(loaded, target)
        assert torch.equal(loaded["w"], torch.full((1000,), 2.0))


def test_a_directory_counts_as_one_save_in_flight(tmp_path):
    with core.Checkpointer(max_in_flight=1) as checkpointer:
        checkpointer.start()
        tx = checkpointer.begin_directory(tmp_path / "checkpoint-1", step=1)
        first = tx.save_file({"w": torch.randn(8 << 20)}, "a.pt")
        tx.save_file({"w": torch.randn(8 << 20)}, "b.pt")
        assert not first.done() or len(checkpointer._parts.buffers.slots()) == 2  # the second file did not wait for the first
        done = tx.commit()
        second = checkpointer.begin_directory(tmp_path / "checkpoint-2", step=2)  # waits for checkpoint-1
        assert done.done()
        second.save_file({"w": torch.ones(3)}, "a.pt")
        second.commit().result()
    assert core.latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")


def test_a_rotation_counts_a_checkpoint_committing_while_it_lists_once(tmp_path):
    """A framework's rotation lists its checkpoints while the previous save may commit: listed before its commit
    and no longer pending after it, that checkpoint was counted nowhere, and a rotation kept one too many (a
    clean-clone run under load left Accelerate's checkpoint_1 beside checkpoint_2 and 3 so)."""
    from asyncckpt.core.integration import saving

    with core.Checkpointer() as checkpointer:
        for step in (0, 1):
            checkpointer.save({"w": torch.ones(3)}, tmp_path / f"checkpoint_{step}")
        tx = checkpointer.begin_directory(tmp_path / "checkpoint_2", step=2)
        tx.save_file({"w": torch.ones(3)}, "model.pt")
        saving.finish(checkpointer, tx, removals=[str(tmp_path / "checkpoint_0")])

        def listed_then_committed():  # the listing, then the commit lands before the rotation counts
            names = sorted(os.listdir(tmp_path))
            tx.handle.result()
            return [str(tmp_path / name) for name in names if name.startswith("checkpoint_")]

        doomed = saving.rotation(checkpointer, str(tmp_path), listed_then_committed, keep=2, adding=1)
        assert doomed == [str(tmp_path / "checkpoint_1")]
        checkpointer.wait()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1", "checkpoint_2"]


def test_killed_worker_fails_a_pending_single_file_save(tmp_path):
    with core.Checkpointer() as checkpointer:
        handle = checkpointer.async_save_file({"w": torch.randn(32 << 20)}, tmp_path / "model.pt")
        os.kill(checkpointer.writer_pid(), signal.SIGKILL)
        with pytest.raises(core.CheckpointWriteError, match=r"saving checkpoint .*model\.pt failed on rank 0: the background writer died"):
            handle.result(timeout=30)
        checkpointer.save_file({"w": torch.ones(3)}, tmp_path / "model.pt")
    assert torch.equal(torch.load(tmp_path / "model.pt")["w"], torch.ones(3))


def test_a_removal_queued_behind_a_failed_save_is_not_done(tmp_path):
    """Nothing is deleted on the strength of a save that did not commit, and the save's error says
    what it cancelled."""
    with core.Checkpointer() as checkpointer:
        checkpointer.save({"w": torch.ones(1000)}, tmp_path / "old")
        limit_file_size(checkpointer, 1 << 20)
        failing = checkpointer.async_save({"w": torch.zeros(1 << 20)}, tmp_path / "new", step=2)  # 4 MiB
        removal = checkpointer.remove([tmp_path / "old"], after=failing)
        with pytest.raises(core.CheckpointWriteError) as info:
            failing.result()
        message = str(info.value)
        assert message.startswith(f"asyncckpt: saving checkpoint {tmp_path / 'new'} (step 2) failed on rank 0: ")
        assert f"not done either, since they waited for it: removing {tmp_path / 'old'}" in message
        with pytest.raises(core.CheckpointCancelledError):
            removal.result()
        checkpointer.wait()  # reported once: nothing left to raise
    assert core.is_complete(str(tmp_path / "old")) and not os.path.exists(tmp_path / "new")


def test_a_failure_settled_between_the_next_saves_look_and_its_admission_is_raised_by_it():
    """The next save looks for unseen failures, then is admitted; a writer's reply that lands in between
    (a save failing just then) must still be raised by that save, not only at exit."""
    from asyncckpt.core.client.ledger import Ledger

    ledger = Ledger(max_in_flight=1, timeout=10.0, store=lambda: None, writer_idle_timeout=None)
    failing = ledger.admit("file", "/ckpts/a.ckpt", rank=0)
    ledger.raise_unobserved()  # the next save's first look: nothing has failed yet
    ledger.complete(failing, OSError("No space left on device"))  # the reply lands now
    with pytest.raises(core.CheckpointWriteError, match=r"saving checkpoint /ckpts/a\.ckpt failed: .*No space left"):
        ledger.admit("file", "/ckpts/b.ckpt", rank=0)
    assert ledger.admit("file", "/ckpts/c.ckpt", rank=0) is not None  # raised once


def _idle_core_seconds() -> float:
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="the kernel groups no sessions")
def test_the_writer_takes_only_idle_cpu_where_the_node_leaves_some(tmp_path):
    """Before each batch of saves the writer's scheduling group takes the training's priority where every core was
    busy since its previous batch, and the lowest where at least half a core sat idle; at the lowest, it takes the
    training's back as soon as it is starved (``writer.priority``). The busy case is made here (a busy loop per core)
    and always checked; the idle one, and the starved save after it, in a window where this machine was idle enough
    to tell (other jobs may keep it busy)."""
    small, large = {"w": torch.randn(1 << 16)}, {"w": torch.randn(64 << 20)}  # 256 MiB: a batch that lasts

    def busy_loops() -> list[subprocess.Popen]:
        """A busy loop per core, returned once each one runs (a loaded machine may take seconds to start them)."""
        loops = [subprocess.Popen([sys.executable, "-c", "import os; os.write(1, b'.'); os.close(1)\n"
                                   "while True: pass"], stdout=subprocess.PIPE) for _ in range(os.cpu_count() or 1)]
        for loop in loops:
            loop.stdout.read()
        return loops

    def stop(loops: list[subprocess.Popen]) -> None:
        for loop in loops:
            loop.kill()
            loop.wait()

    with core.Checkpointer() as checkpointer:
        checkpointer.save(small, tmp_path / "first")
        group = f"/proc/{checkpointer.writer_pid()}/autogroup"

        def nice(value=None) -> int:
            if value is not None:
                with open(group, "w") as f:
                    f.write(str(value))
            with open(group) as f:
                return int(f.read().rsplit("nice", 1)[1])

        checkpointer.wait()  # the writer's batch over, work after its replies included: the window starts here
        assert nice(19) == 19
        loops = busy_loops()
        try:
            before, started = _idle_core_seconds(), time.monotonic()
            time.sleep(1.5)
            idle = (_idle_core_seconds() - before) / (time.monotonic() - started)
            checkpointer.save(small, tmp_path / "busy")
            assert idle < 0.5 and nice() == 0, f"{idle:.2f} cores idle"
        finally:
            stop(loops)
        for attempt in range(4):
            checkpointer.wait()
            nice(0)
            before, started = _idle_core_seconds(), time.monotonic()
            time.sleep(1.5)
            idle = (_idle_core_seconds() - before) / (time.monotonic() - started)
            checkpointer.save(small, tmp_path / f"idle-{attempt}")
            if idle >= 1.0:
                assert nice() == 19, f"{idle:.2f} cores idle"
                loops = busy_loops()
                try:
                    for loop in loops:  # held until the save's batch has begun at the lowest priority
                        os.kill(loop.pid, signal.SIGSTOP)
                    handle = checkpointer.async_save(large, tmp_path / "starved")
                    for loop in loops:
                        os.kill(loop.pid, signal.SIGCONT)
                    handle.result()
                    assert nice() == 0  # given up while the busy loops starved it
                finally:
                    stop(loops)
                break
    assert core.is_complete(str(tmp_path / "busy")) and core.is_complete(str(tmp_path / "first"))


def test_a_slow_commit_says_how_to_size_the_timeout_and_so_does_a_wait_that_gives_up(tmp_path, caplog):
    """The writer stopped (SIGSTOP) for longer than half the timeout: a wait shorter than that gives up with a
    ``CheckpointTimeoutError`` saying how to size ``timeout``; the checkpoint commits once the writer runs again, with
    one warning giving the timeout checkpoints of this size need here."""
    import logging

    with core.Checkpointer(timeout=1.0) as checkpointer:
        checkpointer.start()
        writer = checkpointer.writer_pid()
        os.kill(writer, signal.SIGSTOP)
        try:
            handle = checkpointer.async_save({"w": torch.ones(1 << 16)}, str(tmp_path / "step_1"), step=1)
            with pytest.raises(core.CheckpointTimeoutError, match=r"step_1 \(step 1\): not done after 0s; 0\.00 GiB "
                                                                  r"from this rank\. The timeout option bounds each wait"):
                handle.result(timeout=0.2)
            time.sleep(0.6)
        finally:
            os.kill(writer, signal.SIGCONT)
        with caplog.at_level(logging.WARNING, logger="asyncckpt"):
            handle.result()
    slow = [r.getMessage() for r in caplog.records if "more than half of timeout=1 s" in r.getMessage()]
    assert len(slow) == 1 and "step_1" in slow[0] and "set timeout to at least 3x that" in slow[0], slow


def test_the_interval_advice_warns_where_the_run_saves_far_more_often_than_it_advises(tmp_path, caplog):
    """At a failure every million days the least-loss interval is hours: a run saving every fraction of a second gets
    the advice as a warning, once, with the interval it saves at."""
    import logging

    with caplog.at_level(logging.INFO, logger="asyncckpt"):
        with core.Checkpointer(failures_per_day=1e-6) as checkpointer:
            for step in (1, 2, 3):
                checkpointer.save({"w": torch.full((1 << 10,), float(step))}, str(tmp_path / f"step_{step}"), step=step)
    advice = [r for r in caplog.records if "loses the least work" in r.getMessage()]
    assert len(advice) == 1 and advice[0].levelno == logging.WARNING, advice
    assert "this run saves every" in advice[0].getMessage() and " h " in advice[0].getMessage()
