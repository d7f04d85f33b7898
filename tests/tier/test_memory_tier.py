"""The memory tier on one node, through the core: checkpoints committed in node memory, every persist_every-th
also durable, a restart after kill -9 loads the newest from memory, a damaged memory copy gives way to its
durable one, a tier that does not fit saves durably only, and a run that ends leaves nothing in memory."""
from __future__ import annotations

import logging
import os
import signal
import sys
import textwrap

import pytest
import torch

from asyncckpt import core
from asyncckpt.core.formats import names
from asyncckpt.core import tier
from processes import Program
from writers import wait_until_gone, writers_of

TIER = core.MemoryTier(persist_every=3, keep=2, replicas=0)


@pytest.fixture
def memory_root(tmp_path, monkeypatch):
    """This test's node memory: a directory of its own (``ASYNCCKPT_MEMORY_ROOT``), on tmpfs where there is one."""
    root = tmp_path / "memory"
    monkeypatch.setenv("ASYNCCKPT_MEMORY_ROOT", str(root))
    return root


def _state(step: int) -> dict:
    return {"w": torch.full((1 << 16,), float(step)), "b": torch.arange(10) * step, "step": step}


def _load(path: str) -> dict:
    state = {"w": torch.zeros(1 << 16), "b": torch.zeros(10, dtype=torch.int64), "step": None}
    core.load(state, path)
    return state


def _names(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if not name.startswith(".")) if os.path.isdir(folder) else []


def test_checkpoints_live_in_memory_and_every_third_is_durable(tmp_path, memory_root):
    durable = tmp_path / "run"
    with core.Checkpointer(memory_tier=TIER) as checkpointer:
        for step in range(1, 8):
            checkpointer.async_save(_state(step), str(durable / f"step_{step:03d}"), step=step)
        checkpointer.wait()
        memory = tier.run_dir(str(durable))
        assert _names(durable) == ["step_003", "step_006"]  # persist_every=3
        assert _names(memory) == ["step_006", "step_007"]  # keep=2
        assert core.latest_checkpoint(str(durable)) == os.path.join(memory, "step_007")  # in memory only, newest
        assert torch.equal(_load(core.latest_checkpoint(str(durable)))["w"], _state(7)["w"])
        assert core.is_complete(str(durable / "step_006")) and torch.equal(_load(str(durable / "step_006"))["b"],
                                                                        _state(6)["b"])
    # the end of the run: its last checkpoint durable too, nothing left in memory
    assert _names(durable) == ["step_003", "step_006", "step_007"]
    assert not os.listdir(memory_root)


def test_the_framework_rotation_removes_both_copies(tmp_path, memory_root):
    durable = tmp_path / "run"
    with core.Checkpointer(memory_tier=core.MemoryTier(persist_every=1, keep=3, replicas=0)) as checkpointer:
        for step in (1, 2):
            checkpointer.async_save(_state(step), str(durable / f"step_{step}"), step=step)
        checkpointer.remove([str(durable / "step_1")], after=checkpointer.pending()[-1]).result()
        assert _names(durable) == ["step_2"] and _names(tier.run_dir(str(durable))) == ["step_2"]
        assert checkpointer.will_exist(str(durable / "step_2")) and not checkpointer.will_exist(str(durable / "step_1"))


def test_a_memory_save_is_the_snapshot_buffer_itself_and_kept_ones_are_never_copied_into(tmp_path, memory_root):
    """A memory-tier save's data file is the snapshot buffer the snapshot was copied into (a second name for the same
    pages, not a copy), for as long as the training process keeps the buffer; a buffer that a kept checkpoint holds is
    never copied into again, so every kept checkpoint loads as it was saved; the tier holds keep + 1 shares (no
    spare besides the buffers); the run leaves nothing. The next run of the same Checkpointer (a framework's second
    ``fit``) links its saves too: the first run's buffers went with its run directory, and new ones are made in the
    new one."""
    durable, data, share = tmp_path / "run", names.data_file_name(0), 6 << 22

    def state(step: int) -> dict:
        return {"w": torch.full((6 << 20,), float(step)), "step": step}  # 24 MiB

    def loaded(path: str) -> dict:
        restored = {"w": torch.zeros(6 << 20), "step": None}
        core.load(restored, path)
        return restored

    memory = tier.run_dir(str(durable))
    with core.Checkpointer(memory_tier=core.MemoryTier(persist_every=100, keep=2, replicas=0)) as checkpointer:
        for step in range(1, 6):
            checkpointer.save(state(step), str(durable / f"step_{step}"), step=step)
            checkpointer.wait()  # and the retention behind it
            assert os.stat(os.path.join(memory, f"step_{step}", data)).st_nlink == 2  # the buffer's pages
            assert tier.stored_bytes(str(memory_root)) < 3 * share + (1 << 20)  # keep=2 checkpoints and a buffer
        assert _names(memory) == ["step_4", "step_5"]
        for step in (4, 5):
            restored = loaded(os.path.join(memory, f"step_{step}"))
            assert torch.equal(restored["w"], state(step)["w"]) and restored["step"] == step
        checkpointer.teardown()  # the end of a run: the tier's copies go (written durably first), the buffers stay
        assert not os.path.exists(memory) and loaded(str(durable / "step_5"))["step"] == 5
        for step in (6, 7):  # the next run
            checkpointer.save(state(step), str(durable / f"step_{step}"), step=step)
            checkpointer.wait()
            assert os.stat(os.path.join(memory, f"step_{step}", data)).st_nlink == 2  # linked, not copied
        restored = loaded(os.path.join(memory, "step_7"))
        assert torch.equal(restored["w"], state(7)["w"]) and restored["step"] == 7
    assert not os.listdir(memory_root)


KILLED = textwrap.dedent('''
    import sys, time, torch
    from asyncckpt import core
    root = sys.argv[1]
    checkpointer = core.Checkpointer(memory_tier=core.MemoryTier(persist_every=3, keep=2, replicas=0))
    for step in range(1, 6):  # w: 20 MiB
        state = {"w": torch.full((5 << 20,), float(step)), "b": torch.arange(10) * step, "step": step}
        checkpointer.async_save(state, f"{root}/step_{step:03d}", step=step)
        print(f"saved {step}", flush=True)
    time.sleep(3600)  # killed here, its last save handed over
''')


def test_a_restart_after_kill_9_resumes_from_memory(tmp_path, memory_root):
    """kill -9 the training process right after a memory-only save returned: its writer finishes that save in
    memory, and a new process resumes from it (newer than the last durable one), bit for bit; the memory that the
    killed process's snapshot buffers held beyond its checkpoints is freed once the new one saves there."""
    durable = str(tmp_path / "run")
    program = tmp_path / "killed.py"
    program.write_text(KILLED)
    process = Program([sys.executable, str(program), durable], tmp_path / "logs")
    try:
        process.wait_for_line("saved 5", timeout=180)
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    finally:
        process.kill()
    wait_until_gone(process.pid)
    latest = core.latest_checkpoint(durable)
    assert latest == tier.memory_path(f"{durable}/step_005")  # memory only: the durable one is step 3
    assert _names(durable) == ["step_003"]
    state = {"w": torch.zeros(5 << 20), "b": torch.zeros(10, dtype=torch.int64), "step": None}
    core.load(state, latest)
    assert state["step"] == 5 and torch.equal(state["w"], torch.full((5 << 20,), 5.0))
    with core.Checkpointer(memory_tier=core.MemoryTier(persist_every=3, keep=2, replicas=0)) as checkpointer:
        state["step"] = 6
        checkpointer.save(state, f"{durable}/step_006", step=6)
        checkpointer.wait()
        # keep=2 checkpoints, this process's next buffer, the dropped one's file as a spare (the killed one's 6)
        assert tier.stored_bytes(str(memory_root)) < 4 * (5 << 22) + (1 << 20)


def test_a_damaged_memory_copy_gives_way_to_its_durable_copy(tmp_path, memory_root, caplog):
    """The kit's resume tries the nearest copy first; a flipped byte in it is found by checksum, named in a
    warning, and the durable copy of the same checkpoint is loaded instead."""
    from asyncckpt.core.integration import resume

    durable = tmp_path / "run"
    checkpointer = core.Checkpointer(memory_tier=core.MemoryTier(persist_every=1, keep=2, replicas=0))
    checkpointer.save(_state(4), str(durable / "step_004"), step=4)
    checkpointer.wait()
    memory = tier.memory_path(str(durable / "step_004"))
    data = next(os.path.join(memory, name) for name in os.listdir(memory) if name.endswith(".distcp"))
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    loaded = {}

    def load(path):
        loaded["path"] = path
        return _load(path)

    with caplog.at_level(logging.WARNING, logger="asyncckpt"):
        state = resume.resume(checkpointer, load, reads="directory", root=str(durable),
                              key=resume.numbered(__import__("re").compile(r"^step_(\d+)$")))
    assert loaded["path"] == str(durable / "step_004") and state["step"] == 4
    assert any(memory in record.getMessage() and "not resuming from" in record.getMessage() for record in caplog.records)
    checkpointer.close()


def test_a_tier_that_does_not_fit_saves_durably_with_one_warning(tmp_path, memory_root, caplog):
    durable = tmp_path / "run"
    small = core.MemoryTier(persist_every=5, keep=2, replicas=0, max_bytes=1 << 16)  # less than one checkpoint
    with caplog.at_level(logging.WARNING, logger="asyncckpt"), core.Checkpointer(memory_tier=small) as checkpointer:
        for step in (1, 2, 3):
            checkpointer.async_save(_state(step), str(durable / f"step_{step}"), step=step)
    warnings = [record.getMessage() for record in caplog.records if "memory tier does not fit" in record.getMessage()]
    assert len(warnings) == 1 and "would fit" in warnings[0], warnings
    assert _names(durable) == ["step_1", "step_2", "step_3"]
    assert _names(tier.run_dir(str(durable))) == []


TERMINATED = textwrap.dedent('''
    import sys, time, torch
    from asyncckpt import core
    root = sys.argv[1]
    checkpointer = core.Checkpointer(memory_tier=core.MemoryTier(persist_every=10, keep=2, replicas=0))
    for step in range(1, 4):
        checkpointer.save({"w": torch.full((1 << 16,), float(step)), "step": step}, f"{root}/step_{step:03d}", step=step)
    print("saved 3", flush=True)
    time.sleep(3600)  # a preemption's SIGTERM comes here
''')


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_preemption_sigterm_writes_the_newest_memory_checkpoint_durably(tmp_path, memory_root, signum):
    """A preemption signals every process of the job (SLURM: SIGTERM, or SIGUSR1 with ``--signal=USR1@<s>``): the
    writer then writes the newest checkpoint it published that is in memory only to the durable place before it
    exits (the node and its memory may go next)."""
    durable = str(tmp_path / "run")
    program = tmp_path / "terminated.py"
    program.write_text(TERMINATED)
    process = Program([sys.executable, str(program), durable], tmp_path / "logs")
    try:
        process.wait_for_line("saved 3", timeout=180)
        writers = writers_of(process.pid)
        assert len(writers) == 1 and _names(durable) == []  # all three in memory only
        os.kill(writers[0], signum)
        process.send_signal(signum)
        process.wait(30)
    finally:
        process.kill()
    wait_until_gone(process.pid)
    assert _names(durable) == ["step_003"] and core.is_complete(f"{durable}/step_003")
    state = {"w": torch.zeros(1 << 16), "step": None}
    core.load(state, f"{durable}/step_003")
    assert state["step"] == 3 and torch.equal(state["w"], torch.full((1 << 16,), 3.0))


def test_the_first_durable_save_logs_the_least_loss_interval(tmp_path, memory_root, caplog):
    from asyncckpt.core.api import interval

    with caplog.at_level(logging.INFO, logger="asyncckpt"):
        with core.Checkpointer(memory_tier=core.MemoryTier(persist_every=2, replicas=0), failures_per_day=24) as ck:
            for step in (1, 2, 3, 4):
                ck.save(_state(step), str(tmp_path / "run" / f"step_{step}"), step=step)
    lines = [record.getMessage() for record in caplog.records if "loses the least work" in record.getMessage()]
    assert len(lines) == 1 and "at 24 failure(s) a day" in lines[0] and "with the memory tier" in lines[0], lines
    # Young: sqrt(2 C M); never shorter than the time a checkpoint takes to be safe
    assert interval.least_loss(0.5, 1.0, 0.0, 24).seconds == pytest.approx((2 * 0.5 * 3600) ** 0.5)
    assert interval.least_loss(0.5, 600.0, 0.0, 24).seconds == 600.0


def test_the_pool_makes_the_buffers_a_tier_needs_beside_the_saves_and_never_hands_out_a_held_one(tmp_path):
    """Asked for two file buffers per structure (keep=1), the pool makes the second on a thread of its own once a
    save took the first: the next save, finding the first held by its checkpoint, takes that one and makes none (its
    stall pays no new pages). A buffer a checkpoint holds is not handed out until the checkpoint is gone; closing the
    pool removes the buffers' names, and a checkpoint linked to one keeps its bytes."""
    import time

    from asyncckpt.core.formats.layout import RankLayout
    from asyncckpt.core.snapshot.buffer_pool import BufferPool, FileBuffers

    pool, files = BufferPool(lambda _buffer_id: None), FileBuffers(str(tmp_path / "buffers"), count=2)
    layout = RankLayout("data", (), 1 << 20, 1 << 20)
    first = pool.take("structure", layout, "save 1", files=files)
    first.buffer.bytes.fill_(7)
    deadline = time.monotonic() + 60
    while len(pool.slots()) < 2:  # the second, made beside the save
        assert time.monotonic() < deadline, "the pool made no second buffer"
        time.sleep(0.05)
    checkpoint = tmp_path / "checkpoint"
    os.link(first.buffer.path, checkpoint)  # what the writer does to publish it
    pool.give_back(first)
    for save in (2, 3):  # the first is held: the other one, each time, and no third
        taken = pool.take("structure", layout, f"save {save}", files=files)
        assert taken is not first and len(pool.slots()) == 2
        pool.give_back(taken)
    os.unlink(checkpoint)
    assert pool.take_free_of("structure", "save 4") is not None and len(pool.slots()) == 2
    os.link(first.buffer.path, checkpoint)
    pool.close()
    assert os.listdir(tmp_path / "buffers") == [] and checkpoint.read_bytes() == bytes([7]) * (1 << 20)


def test_exports_and_on_commit_code_act_where_the_checkpoint_was_asked_for_after_its_durable_copy(tmp_path,
                                                                                                   memory_root):
    """Code acting on a committed checkpoint (on_commit, exports; the Trainer's push and after-commit on_save go the
    same way) finds it where it was asked for: it runs after the checkpoint's durable copy, with the durable path,
    and the export goes to that place's ``exports/``; a checkpoint in memory only runs none, unless the end of the run
    writes it durably (the last), which runs them then."""
    durable = tmp_path / "run"
    seen = []
    with core.Checkpointer(memory_tier=core.MemoryTier(persist_every=2, replicas=0), export="safetensors",
                           on_commit=lambda path: seen.append((path, core.is_complete(path)))) as checkpointer:
        for step in (1, 2, 3):
            checkpointer.save(_state(step), str(durable / f"step_{step}"), step=step)
    assert seen == [(str(durable / "step_2"), True), (str(durable / "step_3"), True)]
    assert _names(durable / "exports") == ["step_2", "step_3"]
    assert all(core.is_complete(str(durable / "exports" / name)) for name in ("step_2", "step_3"))
    assert not os.listdir(memory_root)  # and nothing of it left in memory


def _saved_by_two_ranks(rank: int, world: int, durable: str, kept: str) -> None:
    """Two ranks (one node) save steps 1-3, 2 durable too; the node's memory as a killed run would leave it is copied
    to ``kept`` (the run's end then writes step 3 durably too and clears the tier)."""
    import shutil

    import torch.distributed as dist

    with core.Checkpointer(memory_tier=core.MemoryTier(persist_every=2, keep=2, replicas=0)) as checkpointer:
        for step in (1, 2, 3):
            checkpointer.save({f"rank{rank}": torch.full((1024,), float(step)), "step": step}, f"{durable}/step_{step}",
                              step=step)
        checkpointer.wait()  # the tier's retention behind the last save done: nothing is removed while copied
        dist.barrier()
        if rank == 0:
            shutil.copytree(os.environ["ASYNCCKPT_MEMORY_ROOT"], kept, symlinks=True)
        dist.barrier()


def _latest(rank: int, world: int, durable: str) -> str:
    with core.Checkpointer(memory_tier=core.MemoryTier(replicas=0)) as checkpointer:
        return checkpointer.latest_checkpoint(durable)


def test_a_memory_checkpoint_is_resumed_only_by_a_job_of_its_shape(tmp_path, memory_root, caplog):
    """A memory checkpoint is bound to the job that saved it (its durable root, its world size and ranks per node,
    in its commit record): a job of two ranks resumes from its newest, from memory; a job of one rank on the same
    node and durable root does not take the two ranks' shares for its own: it resumes from the durable copy of it,
    with one warning naming the memory ones and both shapes, and offers none of them to a framework's resume."""
    import shutil

    from dist_helper import run_on_ranks

    durable, kept = str(tmp_path / "run"), str(tmp_path / "kept")
    run_on_ranks(_saved_by_two_ranks, 2, durable, kept)
    restored = lambda: (shutil.rmtree(memory_root, ignore_errors=True),  # noqa: E731
                        shutil.copytree(kept, memory_root, symlinks=True))
    restored()
    assert run_on_ranks(_latest, 2, durable) == [os.path.join(tier.run_dir(durable), "step_3")] * 2
    restored()
    with caplog.at_level(logging.WARNING, logger="asyncckpt"), \
            core.Checkpointer(memory_tier=core.MemoryTier(replicas=0)) as checkpointer:
        assert checkpointer.latest_checkpoint(durable) == os.path.join(durable, "step_3")
        assert checkpointer.usable_in_memory(tier.run_dir(durable)) == set()
    said = [record.getMessage() for record in caplog.records if "another shape" in record.getMessage()]
    assert len(said) == 1 and "step_2, step_3" in said[0] and "2 rank(s), 2 a node" in said[0] \
        and "1 rank(s), 1 a node" in said[0], said
