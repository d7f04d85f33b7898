"""Mirrors to object storage from the adapters, against a real S3 server: with ``mirror_to="s3://..."`` each
committed checkpoint of Accelerate / the Trainer is copied to the bucket in the background, removed from there when
the framework's retention removes it locally, and a run on a machine without the local copy resumes from the bucket."""
from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("accelerate")
from asyncckpt.adapters.accelerate import enable_async_checkpointing  # noqa: E402
from asyncckpt import core  # noqa: E402
from asyncckpt.core.storage.backend import backend_for  # noqa: E402
from test_accelerate import _fresh_accelerator, _train_objects, handles, listing  # noqa: E402,F401


def test_mirrored_checkpoints_resume_when_the_local_copy_is_gone(tmp_path, handles, s3_root):  # noqa: F811
    mirror = f"{s3_root}/run"
    acc = _fresh_accelerator(tmp_path / "p", total_limit=2)
    handles.append(enable_async_checkpointing(acc, mirror_to=mirror))
    model, _, step = _train_objects(acc)
    for _ in range(3):
        step()
        acc.save_state()
    handles[-1].wait()
    assert core.latest_checkpoint(mirror) == f"{mirror}/checkpoint_2"
    # the mirror follows Accelerate's total_limit: checkpoint_0 went from the bucket with its local copy
    assert sorted(backend_for(mirror).names(mirror)) == listing(tmp_path / "p" / "checkpoints") == \
        ["checkpoint_1", "checkpoint_2"]
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    shutil.rmtree(tmp_path / "p")  # a new machine: nothing local
    acc = _fresh_accelerator(tmp_path / "p", total_limit=2)
    handles.append(enable_async_checkpointing(acc, mirror_to=mirror))
    model, _, step = _train_objects(acc, seed=1)
    acc.load_state()
    assert listing(tmp_path / "p" / "checkpoints") == ["checkpoint_2"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert acc.project_configuration.iteration == 3


def test_trainer_mirror_resumes_from_the_bucket(tmp_path, s3_root):
    pytest.importorskip("transformers")
    from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback
    from test_hf_trainer import StopAt, _train_toy

    mirror = f"{s3_root}/trainer"
    first = _train_toy(tmp_path / "a", callbacks=[AsyncCheckpointCallback(mirror_to=mirror), StopAt(20)])
    assert core.latest_checkpoint(mirror) == f"{mirror}/checkpoint-20"
    full = _train_toy(tmp_path / "b", callbacks=[AsyncCheckpointCallback(mirror_to=f"{s3_root}/other")])
    from transformers import TrainerCallback

    class StartedAt(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.step = state.global_step

    started = StartedAt()
    resumed = _train_toy(tmp_path / "c", callbacks=[AsyncCheckpointCallback(mirror_to=mirror), started], resume=True)
    assert started.step == 20  # restored from the bucket into the empty output_dir, then resumed
    assert first.state.global_step == 20 and resumed.state.global_step == full.state.global_step
    for name, value in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name


def test_lightning_mirror_restores_last_ckpt_where_it_is_missing(tmp_path, s3_root):
    """Each committed .ckpt is copied to the bucket; a run in an empty directory with ``ckpt_path="last"``
    restores ``last.ckpt`` from there first, and resumes as from the local file (bit for bit)."""
    L = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from asyncckpt.adapters.lightning import AsyncCkptIO
    from toy import QUIET, TinyModule, data

    mirror = f"{s3_root}/lightning"

    class StartedAt(Callback):
        def on_train_start(self, trainer, pl_module):
            self.step = trainer.global_step

    def fit(root, max_steps, mirror_to=mirror, **fit_kwargs):
        torch.manual_seed(0)
        model, started = TinyModule(), StartedAt()
        trainer = L.Trainer(max_steps=max_steps, plugins=[AsyncCkptIO(mirror_to=mirror_to)], default_root_dir=root,
                            callbacks=[ModelCheckpoint(dirpath=root / "ckpts", save_last=True, every_n_train_steps=4),
                                       started], **QUIET)
        trainer.fit(model, data(), **fit_kwargs)
        return model, started.step

    fit(tmp_path / "a", 8)
    mirrored = backend_for(mirror).names(mirror)
    # the top-k rotation (save_top_k=1) removed step 4's file from the bucket too: the bucket holds what dirpath does
    assert sorted(mirrored) == listing(tmp_path / "a" / "ckpts") and len(mirrored) == 2, mirrored
    straight, _ = fit(tmp_path / "b", 12, mirror_to=f"{s3_root}/other")
    resumed, started_at = fit(tmp_path / "c", 12, ckpt_path="last")  # nothing local: last.ckpt comes from the bucket
    assert started_at == 8
    for name, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
