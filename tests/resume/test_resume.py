"""The resume helper every adapter uses (``asyncckpt.core.integration.resume``): with ``resume_from_intact``
each framework resumes from the newest checkpoint that checks out, skipping every damaged newer one with
a warning naming it; and a resume reads each checkpoint file once: its checksum is computed over the
bytes the framework's load uses, never in a pass of its own before it.

"Read once" is observed in the kernel's count of the bytes the process brought in from the disk
(``read_bytes`` in ``/proc/self/io``: reads and page faults of a mapping alike, every thread), with the
checkpoint's pages evicted from the page cache first: a resume that checks a file on its own pass and
then lets the framework read it again reads it twice unless the first pass left it cached, so the test
also counts what the calling thread read through read-family system calls (``rchar`` in
``/proc/thread-self/io``, cache hits included): the framework's own reads of the ``torch.save`` files,
and no more (the check reads through a mapping, on a thread of its own).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from asyncckpt.core.loading.hashed_reads import BackgroundCheck
from asyncckpt.core.storage.file_checksums import FileChecksum
from asyncckpt.core.formats.checksum import checksum
from test_resume_verified import _accelerator, _lightning_resume, damage

IO_COUNTERS = Path("/proc/thread-self/io")
needs_io_counters = pytest.mark.skipif(not IO_COUNTERS.exists(), reason="no per-thread I/O accounting")


def io_counter(name: str, counters: Path = IO_COUNTERS) -> int:
    return int(next(line for line in counters.read_text().splitlines() if line.startswith(name + ":")).split()[1])


def bytes_read() -> int:
    """What this thread has read through read-family system calls so far (cache hits included)."""
    return io_counter("rchar")


def bytes_from_disk() -> int:
    """What this process (every thread) has brought in from the disk so far, page faults included."""
    return io_counter("read_bytes", Path("/proc/self/io"))


def evict(path: Path) -> int:
    """Drop the pages of ``path`` (a file, or every file under a directory) from the page cache; their bytes."""
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    os.sync()
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return sum(f.stat().st_size for f in files)


def torch_file_bytes(path: Path) -> int:
    """The size of the ``torch.save`` files (zip archives) in a checkpoint directory: the files a
    loader reads; safetensors files are mapped (their pages never pass through ``read``)."""
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and f.read_bytes()[:4] == b"PK\x03\x04")


# ---------------------------------------------------------------------- the check beside the load
def test_a_background_check_covers_every_byte(tmp_path):
    """The thread hashes the whole file whatever the loader reads: a flipped byte at the very end, a
    truncated or a missing file are each named."""
    data = bytearray(os.urandom(40 << 20 | 12345))  # more than two of its pieces
    path = tmp_path / "file"
    path.write_bytes(data)
    expected = FileChecksum(len(data), checksum(bytes(data)))
    assert BackgroundCheck(str(path), expected).problem() is None
    with open(path, "r+b") as f:
        f.seek(len(data) - 5)
        f.write(bytes([data[-5] ^ 0x01]))
    assert "checksum mismatch" in BackgroundCheck(str(path), expected).problem()
    os.truncate(path, len(data) // 2)
    assert BackgroundCheck(str(path), expected).problem().startswith("truncated")
    path.unlink()
    assert BackgroundCheck(str(path), expected).problem().startswith("missing")


def test_a_checkpoint_without_checksums_leaves_torch_load_alone(tmp_path):
    """Written without asyncckpt: nothing to check, so the framework's load runs exactly as it would."""
    from safetensors.torch import save_file

    from asyncckpt import core
    from asyncckpt.core.integration import resume

    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")  # what Accelerate writes, natively
    torch.save({"state": {}, "param_groups": []}, tmp_path / "optimizer.bin")
    load = torch.load
    with core.Checkpointer() as checkpointer:
        verified = resume.verify(checkpointer, str(tmp_path))
    assert verified.report.status == "NATIVE" and not verified.kept
    with verified.serving():
        assert torch.load is load


# ---------------------------------------------------------------------- newest intact, per adapter
def test_lightning_skips_every_damaged_newer_checkpoint(tmp_path, caplog):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from toy import QUIET, TinyModule, data

    from asyncckpt.adapters.lightning import AsyncCkptIO

    root = tmp_path / "ckpts"
    L.Trainer(max_epochs=3, plugins=[AsyncCkptIO()], **QUIET,
              callbacks=[ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1, save_last=True)]
              ).fit(TinyModule(), data())
    damage(root / "last.ckpt", "flip")
    damage(root / "epoch=2-step=24.ckpt", "truncate")
    with caplog.at_level("WARNING", logger="asyncckpt"):
        assert _lightning_resume(root, resume_from_intact=True) == 16
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("asyncckpt: not resuming from")]
    assert len(skipped) == 2 and "last.ckpt" in skipped[0] and "epoch=2-step=24.ckpt" in skipped[1], skipped
    assert "resuming from" in caplog.text and "epoch=1-step=16.ckpt instead" in caplog.text


def test_accelerate_skips_every_damaged_newer_checkpoint(tmp_path, caplog):
    pytest.importorskip("accelerate")
    acc, handle, model = _accelerator(tmp_path)
    saved = []
    for _ in range(3):
        with torch.no_grad():
            model.weight.add_(1.0)
        acc.save_state()
        saved.append(model.weight.detach().clone())
    handle.remove()
    damage(tmp_path / "checkpoints" / "checkpoint_2" / "optimizer.bin", "flip")
    damage(tmp_path / "checkpoints" / "checkpoint_1" / "model.safetensors", "flip")
    acc, handle, model = _accelerator(tmp_path, resume_from_intact=True)
    with caplog.at_level("WARNING", logger="asyncckpt"):
        acc.load_state()
    assert torch.equal(model.weight, saved[0])  # checkpoint_0: the newest intact one
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("asyncckpt: not resuming from")]
    assert len(skipped) == 2 and "checkpoint_2" in skipped[0] and "checkpoint_1" in skipped[1], skipped
    assert "checkpoint_0 instead" in caplog.text
    handle.remove()


def test_trainer_skips_every_damaged_newer_checkpoint(tmp_path, caplog):
    pytest.importorskip("transformers")
    from test_resume_verified import _train

    out = tmp_path / "out"
    _train(out, max_steps=15)
    damage(out / "checkpoint-15" / "model.safetensors", "truncate")
    damage(out / "checkpoint-10" / "optimizer.pt", "flip")
    with caplog.at_level("WARNING", logger="asyncckpt"):
        assert _train(out, resume=True, resume_from_intact=True, max_steps=15) == 5
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("asyncckpt: not resuming from")]
    assert len(skipped) == 2 and "checkpoint-15" in skipped[0] and "checkpoint-10" in skipped[1], skipped
    assert "checkpoint-5 instead" in caplog.text


# ---------------------------------------------------------------------- each file read once
@needs_io_counters
def test_lightning_resume_reads_the_file_once(tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from toy import QUIET, TinyModule, data

    from asyncckpt.adapters.lightning import AsyncCkptIO

    io = AsyncCkptIO()
    L.Trainer(max_epochs=1, plugins=[io], **QUIET,
              callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="model", save_last=False)]
              ).fit(TinyModule(ballast=1 << 22), data())  # a 16 MiB checkpoint
    path = tmp_path / "model.ckpt"
    io.load_checkpoint(path)  # imports and first-use work out of the way
    size = evict(path)
    before, before_disk = bytes_read(), bytes_from_disk()
    loaded = io.load_checkpoint(path)
    read, from_disk = bytes_read() - before, bytes_from_disk() - before_disk
    assert loaded["state_dict"]["ballast"].numel() == 1 << 22
    assert size <= read < 1.1 * size, (read, size)  # Lightning's own reads of the file, and nothing of ours
    assert from_disk < 1.1 * size, (from_disk, size)  # the check found the pages the load brought in, or v.v.
    damage(path, "flip")
    with pytest.raises(Exception, match="model.ckpt: checksum mismatch"):
        io.load_checkpoint(path)


@needs_io_counters
def test_a_directory_loaded_in_place_is_read_once_and_checked_beside_the_load(tmp_path):
    """A framework's DCP load of a sharded directory (Lightning's FSDP resume) runs while the check hashes
    the same pages: the disk is read once, and a flipped byte raises once the load is over, naming the key."""
    import torch.distributed.checkpoint as dcp

    from asyncckpt import core

    path = str(tmp_path / "sharded")
    state = {"w": torch.randn(1 << 24), "b": torch.randn(1000)}  # 64 MiB
    core.save(state, path)
    checkpointer = core.Checkpointer()
    target = {"w": torch.zeros(1 << 24), "b": torch.zeros(1000)}
    checkpointer.load_while_checking(path, lambda: dcp.load(target, checkpoint_id=path))  # first-use work
    size = evict(Path(path))
    before_disk = bytes_from_disk()
    target = {"w": torch.zeros(1 << 24), "b": torch.zeros(1000)}
    assert checkpointer.load_while_checking(path, lambda: dcp.load(target, checkpoint_id=path) or "loaded") == "loaded"
    from_disk = bytes_from_disk() - before_disk
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    assert from_disk < 1.1 * size, (from_disk, size)
    damage(Path(path) / "__0_0.distcp", "flip")
    with pytest.raises(core.CorruptCheckpointError, match=r"__0_0\.distcp: key '\w' \(rank 0\) .*checksum mismatch"):
        checkpointer.load_while_checking(path, lambda: dcp.load(target, checkpoint_id=path))
    checkpointer.close()


def _load_damaged_share_on_ranks(rank, world, path):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from asyncckpt import core

    mesh = init_device_mesh("cpu", (world,))
    core.save({"w": distribute_tensor(torch.arange(4096.0).view(64, 64), mesh, [Shard(0)])}, path)
    if rank == 0:
        damage(Path(path) / "__1_0.distcp", "flip")  # rank 1's share
    dist.barrier()
    target = {"w": distribute_tensor(torch.zeros(64, 64), mesh, [Shard(0)])}
    with core.Checkpointer() as checkpointer:
        try:
            checkpointer.load_while_checking(path, lambda: dcp.load(target, checkpoint_id=path), everywhere=True)
        except core.CorruptCheckpointError as e:
            return str(e)
    return "loaded"


def test_damage_in_one_ranks_share_raises_on_every_rank_after_the_load(tmp_path):
    """Each rank checks its share beside its own load; the ranks agree after the load (a collective on
    the calling thread, after DCP's own), so the rank whose share is intact raises too."""
    from dist_helper import run_on_ranks

    messages = run_on_ranks(_load_damaged_share_on_ranks, 2, str(tmp_path / "sharded"))
    assert "found on another rank" in messages[0], messages
    assert "__1_0.distcp: key 'w' (rank 1)" in messages[1] and "checksum mismatch" in messages[1], messages


@needs_io_counters
def test_accelerate_load_state_reads_each_file_once(tmp_path):
    pytest.importorskip("accelerate")
    acc, handle, model = _accelerator(tmp_path, width=1024)  # ~4 MiB of weights, ~8 MiB of AdamW state
    model(torch.randn(2, 1024)).sum().backward()
    acc._optimizers[0].step()
    acc.save_state()
    handle.remove()
    checkpoint = tmp_path / "checkpoints" / "checkpoint_0"
    acc, handle, model = _accelerator(tmp_path, width=1024)
    acc.load_state()
    size = evict(checkpoint)
    before, before_disk = bytes_read(), bytes_from_disk()
    acc.load_state()
    read, from_disk = bytes_read() - before, bytes_from_disk() - before_disk
    assert torch_file_bytes(checkpoint) <= read < 1.1 * torch_file_bytes(checkpoint), (read, torch_file_bytes(checkpoint))
    assert from_disk < 1.1 * size, (from_disk, size)
    assert acc._optimizers[0].state_dict()["state"][0]["exp_avg"].abs().sum() > 0  # the optimizer state is back
    handle.remove()


@needs_io_counters
def test_trainer_resume_reads_each_file_once(tmp_path):
    pytest.importorskip("transformers")
    from test_resume_verified import _train

    out = tmp_path / "out"
    _train(out, max_steps=5, width=1024)
    checkpoint = out / "checkpoint-5"
    _train(out, resume=str(checkpoint), max_steps=5, width=1024)  # first-use work out of the way
    size = evict(checkpoint)
    before, before_disk = bytes_read(), bytes_from_disk()
    assert _train(out, resume=str(checkpoint), max_steps=5, width=1024) == 5
    read, from_disk = bytes_read() - before, bytes_from_disk() - before_disk
    assert from_disk < 1.1 * size, (from_disk, size)
    assert torch_file_bytes(checkpoint) <= read < 1.1 * torch_file_bytes(checkpoint), (read, torch_file_bytes(checkpoint))
