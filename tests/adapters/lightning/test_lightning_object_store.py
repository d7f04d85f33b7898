"""Lightning with ``ModelCheckpoint(dirpath="s3://...")`` through ``AsyncCkptIO``, against a real S3
server (moto's threaded server): saves go to the bucket asynchronously, top-k rotation removes
objects, and ``ckpt_path="last"`` resumes from there, checked against the object's checksum."""
from __future__ import annotations

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from asyncckpt.adapters.lightning import AsyncCkptIO  # noqa: E402
from asyncckpt.core.storage import file_checksums  # noqa: E402
from asyncckpt.core.storage.object_store import store_for  # noqa: E402
from toy import QUIET, TinyModule, data  # noqa: E402


class _Recorder(L.Callback):
    """The plugin's pending work right after each save returned: proof that the upload ran behind."""

    def __init__(self) -> None:
        self.pending_after_save: list[int] = []

    def on_save_checkpoint(self, trainer, module, checkpoint) -> None:
        self.pending_after_save.append(len(trainer.strategy.checkpoint_io.pending()))


def _trainer(root: str, epochs: int, recorder=None) -> L.Trainer:
    checkpoint = ModelCheckpoint(dirpath=f"{root}/checkpoints", monitor="loss", save_top_k=2, save_last=True,
                                 every_n_epochs=1)
    return L.Trainer(max_epochs=epochs, default_root_dir=root, plugins=[AsyncCkptIO()],
                     callbacks=[checkpoint] + ([recorder] if recorder else []), **QUIET)


def test_model_checkpoint_on_s3_saves_async_and_resumes_last(s3_root):
    root = f"{s3_root}/run"
    torch.manual_seed(0)
    model = TinyModule()
    trainer = _trainer(root, 4)
    trainer.fit(model, data())
    store = store_for(root)
    names = sorted(entry.name for entry in store.list(f"{root}/checkpoints"))
    assert "last.ckpt" in names and len([n for n in names if n.startswith("epoch=")]) == 2, names  # top-2 rotated
    assert not [n for n in names if n.startswith(".")]  # no marker left behind
    assert file_checksums.read_record(f"{root}/checkpoints/last.ckpt") is not None
    assert trainer.checkpoint_callback.last_model_path == f"{root}/checkpoints/last.ckpt"

    resumed = TinyModule()
    recorder = _Recorder()
    again = _trainer(root, 6, recorder)
    again.fit(resumed, data(), ckpt_path="last")
    assert again.current_epoch == 6 and again.global_step == 6 * 8
    assert len(recorder.pending_after_save) == 2 * 2  # top-k and last of epochs 5 and 6 only: resumed after epoch 4
    assert max(recorder.pending_after_save) >= 1  # a save returned while earlier ones were still uploading
    with store_for(root).fs.open(f"{root}/checkpoints/last.ckpt", "rb") as f:
        last = torch.load(f, weights_only=False)
    assert last["global_step"] == 48 and torch.equal(last["state_dict"]["net.weight"], resumed.net.weight.detach())


def test_a_damaged_checkpoint_object_is_refused_by_name(s3_root):
    """Resuming from a URL: the object is fetched once, loaded and hashed; a flipped byte is refused."""
    from asyncckpt.core import CorruptCheckpointError

    url = f"{s3_root}/run/last.ckpt"
    io = AsyncCkptIO()
    io.save_checkpoint({"state_dict": {"w": torch.arange(1 << 16, dtype=torch.float32)}, "global_step": 3}, url)
    io.wait()
    assert io.load_checkpoint(url)["global_step"] == 3
    store = store_for(url)
    data = bytearray(store.get(url))
    data[len(data) // 2] ^= 0x01
    store.put(url, bytes(data), metadata=store.user_metadata(url))  # the checksum kept, the bytes changed
    assert file_checksums.read_record(url) is not None
    with pytest.raises(CorruptCheckpointError, match=r"last\.ckpt: checksum mismatch"):
        io.load_checkpoint(url)
    io.teardown()
