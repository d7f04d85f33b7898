"""Every file the core writes carries a checksum, and each framework's own resume path checks the
checkpoint before loading anything from it: a flipped byte, a truncated file (or a deleted single
file or data file) raises an error naming the checkpoint and the file; files removed from or added
to a directory checkpoint by the user get one warning, and the framework's own loader decides; with ``resume_from_intact`` (where the framework picks
the checkpoint itself) the resume goes on from the newest checkpoint that checks out, with a
warning naming the one skipped. Checkpoints written without asyncckpt load unchecked, as before.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from asyncckpt import core
from asyncckpt.core import CorruptCheckpointError

DAMAGE = ("flip", "truncate")  # in a directory checkpoint a deleted file is the user's change, not damage


def damage(path: Path, how: str) -> str:
    """Damage ``path`` as a disk or a person might; returns what the error must say."""
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        return "checksum mismatch"
    assert how == "truncate", how
    os.truncate(path, path.stat().st_size // 2)
    return "truncated"


# ---------------------------------------------------------------------- Lightning
def _lightning_run(root: Path) -> None:
    """Checkpoints of a short fit with the plugin: epoch=0-step=8.ckpt, epoch=1-step=16.ckpt, last.ckpt.
    (Made afresh for each case: a single file's checksum record names its inode, so a copy of the
    file would count as unverified, not as damaged.)"""
    L = pytest.importorskip("lightning")
    from toy import TinyModule, data
    from lightning.pytorch.callbacks import ModelCheckpoint

    from asyncckpt.adapters.lightning import AsyncCkptIO

    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[AsyncCkptIO()],
                        callbacks=[ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1, save_last=True)])
    trainer.fit(TinyModule(), data())


def _lightning_resume(root: Path, **plugin_options):
    import lightning as L
    from toy import TinyModule, data
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from asyncckpt.adapters.lightning import AsyncCkptIO

    class StartedAt(Callback):
        step = None

        def on_train_start(self, trainer, module):
            StartedAt.step = trainer.global_step

    trainer = L.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[AsyncCkptIO(**plugin_options)],
                        callbacks=[ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1, save_last=True),
                                   StartedAt()])
    trainer.fit(TinyModule(), data(), ckpt_path="last")
    return StartedAt.step


@pytest.mark.parametrize("how", ["flip", "truncate"])  # a deleted last.ckpt is Lightning's own "no last checkpoint"
def test_lightning_resume_checks_the_file(tmp_path, how, caplog):
    root = tmp_path / "ckpts"
    _lightning_run(root)
    said = damage(root / "last.ckpt", how)
    with pytest.raises(CorruptCheckpointError, match=rf"checkpoint {root / 'last.ckpt'} is damaged: last.ckpt: {said}"):
        _lightning_resume(root)
    with caplog.at_level("WARNING", logger="asyncckpt.core"):
        started = _lightning_resume(root, resume_from_intact=True)
    assert started == 16  # from epoch=1-step=16.ckpt, the newest that checks out
    assert "not resuming from" in caplog.text and "last.ckpt" in caplog.text and "epoch=1-step=16.ckpt instead" in caplog.text


def test_lightning_loads_a_natively_written_checkpoint_unchecked(tmp_path):
    import lightning as L
    from toy import QUIET, TinyModule, data

    from asyncckpt.adapters.lightning import AsyncCkptIO

    trainer = L.Trainer(max_epochs=1, enable_checkpointing=False, **QUIET)
    trainer.fit(TinyModule(), data())
    trainer.save_checkpoint(tmp_path / "native.ckpt")  # TorchCheckpointIO: no checksum record
    loaded = AsyncCkptIO().load_checkpoint(tmp_path / "native.ckpt")
    assert loaded["global_step"] == 8


def test_a_damaged_sharded_checkpoint_is_refused_by_lightnings_sharded_load(tmp_path):
    """FSDP's sharded load (a DCP directory) through the strategy, single process: checked first,
    naming the file and the key."""
    pytest.importorskip("lightning")
    from lightning.pytorch.strategies import FSDPStrategy

    from asyncckpt.adapters.lightning import AsyncCkptIO

    strategy = FSDPStrategy(state_dict_type="sharded")
    io = AsyncCkptIO()
    strategy.checkpoint_io = io
    model = torch.nn.Linear(64, 64)
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [], "global_step": 3, "epoch": 0}
    strategy.save_checkpoint(checkpoint, tmp_path / "sharded.ckpt")
    io.wait()
    data_file = tmp_path / "sharded.ckpt" / "__0_0.distcp"
    damage(data_file, "flip")
    with pytest.raises(CorruptCheckpointError, match=r"__0_0\.distcp: key 'model\.weight' \(rank 0\) .*checksum mismatch"):
        strategy.load_checkpoint(tmp_path / "sharded.ckpt")


# ---------------------------------------------------------------------- Accelerate
def _accelerator(project: Path, width: int = 256, **options):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    from asyncckpt.adapters.accelerate import enable_async_checkpointing

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(project),
                                                                   automatic_checkpoint_naming=True))
    handle = enable_async_checkpointing(acc, **options) if options.get("adapter", True) else None
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    return acc, handle, model


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory):
    pytest.importorskip("accelerate")
    project = tmp_path_factory.mktemp("accelerate")
    acc, handle, model = _accelerator(project)
    for _ in range(3):
        with torch.no_grad():
            model.weight.add_(1.0)
        acc.save_state()
    handle.remove()
    return project


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("file", ["model.safetensors", "optimizer.bin", "random_states_0.pkl"])
def test_accelerate_load_state_checks_the_checkpoint(accelerate_run, tmp_path, how, file, caplog):
    project = tmp_path / "project"
    shutil.copytree(accelerate_run, project)
    said = damage(project / "checkpoints" / "checkpoint_2" / file, how)
    acc, handle, model = _accelerator(project)
    before = model.weight.detach().clone()
    with pytest.raises(CorruptCheckpointError, match=rf"checkpoint_2 is damaged: {file}: {said}"):
        acc.load_state()
    assert torch.equal(model.weight, before)  # refused before anything was loaded
    handle.remove()
    acc, handle, model = _accelerator(project, resume_from_intact=True)
    with caplog.at_level("WARNING", logger="asyncckpt.core"):
        acc.load_state()
    assert "checkpoint_2" in caplog.text and "checkpoint_1 instead" in caplog.text
    assert acc.project_configuration.iteration == 3  # counting goes on after the newest checkpoint_N
    with pytest.raises(CorruptCheckpointError):  # a path the user named: never replaced by another
        acc.load_state(str(project / "checkpoints" / "checkpoint_2"))
    handle.remove()


def test_accelerate_loads_a_natively_written_checkpoint_unchecked(tmp_path):
    pytest.importorskip("accelerate")
    acc, _, model = _accelerator(tmp_path, adapter=False)
    acc.save_state()  # Accelerate's own: no commit record
    acc, handle, model = _accelerator(tmp_path)
    acc.load_state()
    handle.remove()


# ---------------------------------------------------------------------- Transformers
def _train(out: Path, resume=None, max_steps: int = 10, width: int = 0, **options):
    """Train (or resume) to ``max_steps``, saving every 5 steps; a ``width`` makes the model wider."""
    from test_hf_trainer import _args
    from toy import Net, Toy
    from transformers import Trainer, TrainerCallback

    from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback

    class StartedAt(TrainerCallback):
        step = None

        def on_train_begin(self, args, state, control, **kwargs):
            StartedAt.step = state.global_step

    torch.manual_seed(0)
    model = Net()
    if width:
        model.body = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                         torch.nn.ReLU(), torch.nn.Linear(width, 1))
    trainer = Trainer(model=model, args=_args(out, max_steps=max_steps, save_steps=5, save_total_limit=None),
                      train_dataset=Toy(), callbacks=[AsyncCheckpointCallback(**options), StartedAt()])
    trainer.train(resume_from_checkpoint=resume)
    return StartedAt.step


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("trainer")
    _train(out)
    return out


@pytest.mark.parametrize("how", DAMAGE)
def test_trainer_resume_checks_the_checkpoint(trainer_run, tmp_path, how, caplog):
    out = tmp_path / "out"
    shutil.copytree(trainer_run, out)
    said = damage(out / "checkpoint-10" / "optimizer.pt", how)
    with pytest.raises(CorruptCheckpointError, match=rf"checkpoint-10 is damaged: optimizer.pt: {said}"):
        _train(out, resume=True)
    with pytest.raises(CorruptCheckpointError, match="optimizer.pt"):
        _train(out, resume=str(out / "checkpoint-10"))
    with caplog.at_level("WARNING", logger="asyncckpt.core"):
        assert _train(out, resume=True, resume_from_intact=True) == 5  # from checkpoint-5
    assert "checkpoint-10" in caplog.text and "checkpoint-5 instead" in caplog.text


# ---------------------------------------------------------------------- the core, sharded
def test_a_damaged_sharded_checkpoint_names_file_and_key(tmp_path):
    state = {"model": {"w": torch.randn(256, 256), "b": torch.randn(256)}, "step": 3}
    core.save(state, tmp_path / "ckpt")
    damage(tmp_path / "ckpt" / "__0_0.distcp", "flip")
    with core.Checkpointer() as checkpointer:
        with pytest.raises(CorruptCheckpointError, match=r"ckpt is damaged: __0_0\.distcp: key 'model\.w' \(rank 0\)"):
            checkpointer.require_intact(tmp_path / "ckpt")


def test_accelerate_load_state_leaves_a_file_the_user_removed_to_accelerate(accelerate_run, tmp_path, caplog):
    project = tmp_path / "project"
    shutil.copytree(accelerate_run, project)
    (project / "checkpoints" / "checkpoint_2" / "random_states_0.pkl").unlink()
    acc, handle, model = _accelerator(project)
    with caplog.at_level("WARNING", logger="asyncckpt"):
        acc.load_state()  # Accelerate itself carries on without the RNG states (its own warning)
    assert "checkpoint_2 differs from what was committed (random_states_0.pkl: removed)" in caplog.text
    assert acc.project_configuration.iteration == 3  # loaded: counting goes on after checkpoint_2
    handle.remove()


def test_trainer_resumes_from_a_checkpoint_the_user_resharded(trainer_run, tmp_path, caplog):
    """What Transformers' own test_resume_training_with_shard_checkpoint does: model.safetensors
    replaced by sharded files and an index before resuming. One warning; the Trainer loads them."""
    import json

    from safetensors.torch import load_file, save_file

    out = tmp_path / "out"
    shutil.copytree(trainer_run, out)
    checkpoint = out / "checkpoint-10"
    weights = load_file(checkpoint / "model.safetensors")
    keys = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, shard_keys in shards.items():
        save_file({key: weights[key] for key in shard_keys}, checkpoint / name, metadata={"format": "pt"})
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {key: name for name, shard_keys in shards.items() for key in shard_keys}}))
    (checkpoint / "model.safetensors").unlink()
    with caplog.at_level("WARNING", logger="asyncckpt"):
        assert _train(out, resume=str(checkpoint)) == 10
    said = [r.getMessage() for r in caplog.records if "differs from what was committed" in r.getMessage()]
    assert len(said) == 1, said
    for change in ("model.safetensors: removed", "model-00001-of-00002.safetensors: added",
                   "model.safetensors.index.json: added"):
        assert change in said[0]
    damage(checkpoint / "optimizer.pt", "flip")
    with pytest.raises(CorruptCheckpointError, match="optimizer.pt: checksum mismatch"):
        _train(out, resume=str(checkpoint))  # a committed file changed in place is damage, always
