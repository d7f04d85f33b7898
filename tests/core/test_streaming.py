"""The writer streams a snapshot to disk while it is still being copied (``CopyProgress``)."""
from __future__ import annotations

import mmap
import os
import threading
import time

import pytest
import torch

from asyncckpt import core
from asyncckpt.core.writer import copy_progress
from asyncckpt.core.snapshot import shared_buffer
from asyncckpt.core.storage import diskio
from asyncckpt.core.errors import CheckpointTimeoutError, CheckpointWriteError


def _state(seed: int) -> dict:
    """64 MiB in 16 tensors: several copy segments (``MIN_SEGMENT_BYTES`` = 4 MiB)."""
    generator = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(1 << 20, generator=generator) for i in range(16)} | {"step": seed}


def _blank() -> dict:
    return {f"layer{i}.weight": torch.zeros(1 << 20) for i in range(16)} | {"step": None}


def _assert_same(loaded: dict, expected: dict) -> None:
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key


def test_slow_copy_is_streamed_and_saved_exactly(tmp_path, monkeypatch):
    """Each copy segment takes 50 ms, so the writer has to wait for progress between segments
    (it starts writing before the copy is done); the checkpoint still loads bit for bit and its
    checksums verify."""
    real_copy = shared_buffer._copy_group
    copies = []

    def slow_copy(views, sources):
        copies.append(time.monotonic())
        time.sleep(0.05)
        real_copy(views, sources)

    monkeypatch.setattr(shared_buffer, "_copy_group", slow_copy)
    checkpointer = core.Checkpointer()
    try:
        state = _state(1)
        checkpointer.save(state, tmp_path / "a")
        assert len(checkpointer._parts.buffers.slots()[0].buffer.copy_segments) >= 4
        assert len(copies) >= 8
        loaded = _blank()
        checkpointer.load(loaded, tmp_path / "a", verify=True)
        _assert_same(loaded, state)
    finally:
        checkpointer.close()


def test_progress_never_covers_a_unit_still_being_copied(tmp_path, monkeypatch):
    """The copy threads take units in turn, so a later unit can finish before an earlier one: here
    every other unit is slow. The writer streams the second save over the first one's bytes in the
    same buffer; had progress covered an unfinished unit, the file would hold some of the first
    save's values."""
    real_copy = shared_buffer._copy_group
    calls = []

    def uneven_copy(views, sources):
        calls.append(1)
        time.sleep(0.06 if len(calls) % 2 else 0.0)
        real_copy(views, sources)

    checkpointer = core.Checkpointer()
    try:
        checkpointer.save(_state(1), tmp_path / "a")
        segments = checkpointer._parts.buffers.slots()[0].buffer.copy_segments
        assert len(segments) >= 4 and all(len(segment.units) >= 2 for segment in segments)
        monkeypatch.setattr(shared_buffer, "_copy_group", uneven_copy)
        second = _state(2)
        checkpointer.save(second, tmp_path / "b")
        assert len(calls) == sum(len(segment.units) for segment in segments)
        loaded = _blank()
        checkpointer.load(loaded, tmp_path / "b", verify=True)
        _assert_same(loaded, second)
    finally:
        checkpointer.close()


def test_copy_failing_after_the_writer_started_fails_only_that_save(tmp_path, monkeypatch):
    """The copy fails in its third segment, after the writer received the request and wrote the
    first parts: the save fails with the copy's error, nothing is published at its path, the
    previous checkpoint stays the latest and loads, and the next save (same buffer, a new copy
    generation) succeeds."""
    checkpointer = core.Checkpointer()
    try:
        first = _state(1)
        checkpointer.save(first, tmp_path / "step_1", step=1)
        real_copy = shared_buffer._copy_group
        calls = []

        def failing_copy(views, sources):
            calls.append(1)
            if len(calls) == 5:
                raise RuntimeError("simulated copy fault")
            time.sleep(0.02)
            real_copy(views, sources)

        monkeypatch.setattr(shared_buffer, "_copy_group", failing_copy)
        with pytest.raises(CheckpointWriteError, match="simulated copy fault") as failure:
            checkpointer.save(_state(2), tmp_path / "step_2", step=2)
        assert "step_2" in str(failure.value)
        monkeypatch.setattr(shared_buffer, "_copy_group", real_copy)
        checkpointer.wait()
        assert not (tmp_path / "step_2").exists()
        assert core.latest_checkpoint(tmp_path) == str(tmp_path / "step_1")
        loaded = _blank()
        checkpointer.load(loaded, tmp_path / "step_1")
        _assert_same(loaded, first)

        third = _state(3)
        checkpointer.save(third, tmp_path / "step_3", step=3)
        loaded = _blank()
        checkpointer.load(loaded, tmp_path / "step_3")
        _assert_same(loaded, third)
    finally:
        checkpointer.close()


def test_copy_progress_names_a_failed_or_replaced_copy_and_times_out():
    mapping = mmap.mmap(-1, copy_progress.PROGRESS_BYTES)  # dropped with the test (the waiter keeps a view)
    progress = copy_progress.CopyProgress(mapping)
    progress.publish(3, 10 * 4096 + 100)
    assert progress.finished_bytes(3) == 10 * 4096  # whole pages only: the rest may be mid-copy
    wait = progress.waiter(3, timeout=0.2, abandoned=lambda: False)
    threading.Timer(0.05, progress.complete, args=(3,)).start()
    assert wait(10 * 4096) == float("inf")
    with pytest.raises(CheckpointWriteError, match="replaced"):
        progress.finished_bytes(2)
    progress.fail(3)
    with pytest.raises(CheckpointWriteError, match="copy failed"):
        progress.finished_bytes(3)
    progress.publish(4, 0)
    with pytest.raises(CheckpointTimeoutError):
        progress.waiter(4, timeout=0.05, abandoned=lambda: False)(0)


def test_streamed_image_write_waits_for_each_part(tmp_path):
    """``write_image`` with ``wait_ready`` writes only what the progress covers, in order of
    arrival, and ends with exactly the image's bytes on disk."""
    size = 6 * (1 << 20) + 123
    image = memoryview(mmap.mmap(-1, (size + 4095) // 4096 * 4096))
    mapping = mmap.mmap(-1, copy_progress.PROGRESS_BYTES)
    progress = copy_progress.CopyProgress(mapping)
    payload = os.urandom(size)
    progress.publish(7, 0)

    def copy_in_parts():
        for start in range(0, size, 1 << 20):
            end = min(start + (1 << 20), size)
            image[start:end] = payload[start:end]
            progress.publish(7, end)
            time.sleep(0.01)
        progress.complete(7)

    copier = threading.Thread(target=copy_in_parts)
    copier.start()
    diskio.write_image(str(tmp_path / "image"), image, size, wait_ready=progress.waiter(7, timeout=5, abandoned=lambda: False))
    copier.join()
    assert (tmp_path / "image").read_bytes() == payload


@pytest.mark.parametrize("size", [0, 100, 4096, 3 * 4096 + 7, (5 << 20) + 1])
def test_a_mapped_file_is_written_directly_but_its_partial_last_block(tmp_path, size):
    """A memory-mapped file (a memory-tier checkpoint written durably: ``mirror.copy``) ends at its size, not at a
    whole block as a snapshot buffer does: its whole blocks go with O_DIRECT, its partial last block through the page
    cache, and the file is exactly its bytes."""
    source = tmp_path / "source"
    payload = os.urandom(size)
    source.write_bytes(payload)
    with open(source, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    image = memoryview(mapping if mapping is not None else b"")
    used_direct = diskio.write_image(str(tmp_path / "copy"), image, size)
    assert (tmp_path / "copy").read_bytes() == payload
    probe, direct_here = diskio._open_for_write(str(tmp_path / "probe"), True)
    os.close(probe)
    assert used_direct == direct_here  # O_DIRECT wherever this file system takes it
