"""Checkpoints share the bytes of what did not change since the one before, and each stays complete on its own:
it loads alone (``core.load`` and stock ``dcp.load``) after every other was deleted, holds new bytes however they
were written, and damage in a file it shares is found in every checkpoint that uses it."""
from __future__ import annotations

import copy
import ctypes
import os
import shutil
import subprocess

import pytest
import torch
import torch.distributed.checkpoint as dcp

from asyncckpt import core
from asyncckpt.core.cli.main import main as cli

FROZEN, TRAINED = (256, 1024), (64, 256)  # 1 MiB frozen, 64 KiB trained (and its Adam state)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Linear(*FROZEN[::-1])
        self.trained = torch.nn.Linear(*TRAINED[::-1])
        self.frozen.requires_grad_(False)


def _state(model: Model, optimizer: torch.optim.Optimizer, step: int) -> dict:
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}


def _train(model: Model, optimizer: torch.optim.Optimizer) -> None:
    model.trained(model.frozen(torch.randn(4, FROZEN[1]))).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _flat(state: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat(value, f"{name}."))
        elif isinstance(value, torch.Tensor):
            flat[name] = value.clone()
    return flat


def _blank(model: Model, optimizer: torch.optim.Optimizer) -> dict:
    """A state dict of the same structure, every tensor a zeroed copy."""
    state = copy.deepcopy(_state(model, optimizer, -1))
    _zero(state)
    return state


def _zero(state: dict) -> None:
    for value in state.values():
        if isinstance(value, dict):
            _zero(value)
        elif isinstance(value, torch.Tensor):
            value.zero_()


def _stored(root: str) -> int:
    """The bytes the file system stores for everything under ``root`` (each file once, holes not counted)."""
    return int(subprocess.run(["du", "-s", "--block-size=1", root], capture_output=True, text=True,
                              check=True).stdout.split()[0])


def _alone(root: str, name: str, scratch: str) -> str:
    """A copy of ``root`` (hard links kept as links: what the checkpoints share stays shared) in which every other
    checkpoint was deleted: ``name``'s path there."""
    shutil.rmtree(scratch, ignore_errors=True)
    subprocess.run(["cp", "-a", root, scratch], check=True)
    for other in os.listdir(scratch):
        if other != name:
            shutil.rmtree(os.path.join(scratch, other))
    return os.path.join(scratch, name)


def test_frozen_part_is_written_once_and_every_checkpoint_loads_alone(tmp_path, capsys):
    torch.manual_seed(0)
    model = Model()
    optimizer = torch.optim.Adam(model.trained.parameters())
    root = str(tmp_path / "ckpts")
    saved, written = {}, []
    frozen = model.frozen.weight
    with core.Checkpointer() as checkpointer:
        for step in range(5):
            _train(model, optimizer)
            if step == 2:  # writes autograd's version counter never sees: each must reach the next checkpoint
                frozen.data[0, 0] += 1.0
                frozen.numpy()[1, 1] += 1.0
                ctypes.memmove(frozen.data_ptr() + 8, (ctypes.c_float * 1)(7.5), 4)
            state = _state(model, optimizer, step)
            handle = checkpointer.async_save(state, f"{root}/step_{step}", step=step)
            handle.result()
            saved[step] = _flat(state)
            written.append((handle.written, handle.shared))
    frozen_bytes = FROZEN[0] * FROZEN[1] * 4
    trained_bytes = 3 * (TRAINED[0] * TRAINED[1] + TRAINED[0]) * 4  # weights and Adam's two moments
    assert written[0][1] == 0 and written[0][0] > frozen_bytes  # the first save writes everything
    for step in (1, 4):  # after it, about what changed: the trained part and its state (and framing, pages)
        assert trained_bytes <= written[step][0] < 1.05 * trained_bytes + 64 * 1024, written
        assert written[step][1] >= frozen_bytes
    # the frozen weight written through .data, numpy and memmove is written again, and once more by the save
    # after (its content id is recorded only where its xxh3-64 did not change: docs/FORMAT.md)
    assert written[2][0] > frozen_bytes and written[3][0] > frozen_bytes
    for step in range(5):
        path = _alone(root, f"step_{step}", str(tmp_path / "alone"))
        for load in (lambda sd, p: core.load(sd, p), lambda sd, p: dcp.load(sd, checkpoint_id=p)):
            target = _blank(model, optimizer)
            load(target, path)
            loaded = _flat(target)
            assert loaded.keys() == saved[step].keys()
            for key, tensor in saved[step].items():
                assert torch.equal(loaded[key], tensor), (step, key)
    # `ls` says what each checkpoint shares; the five use about one frozen part and five trained ones
    assert cli(["ls", root]) == 0
    assert capsys.readouterr().out.count("shares ") == 5
    # stored: the frozen part three times (the first save, and the two after the writes above), the trained one five
    used = _stored(root)
    assert used < 3 * frozen_bytes + 5 * trained_bytes * 1.3 < 0.75 * 5 * (frozen_bytes + trained_bytes), used


def test_damage_in_a_shared_file_is_found_in_every_checkpoint_that_uses_it(tmp_path, capsys):
    root = str(tmp_path / "ckpts")
    frozen = torch.randn(512, 512)
    with core.Checkpointer() as checkpointer:
        for step in range(3):
            checkpointer.save({"frozen": frozen, "trained": torch.full((1024,), float(step))}, f"{root}/s{step}")
    shared = [name for name in os.listdir(f"{root}/s2") if name.startswith("__0_0.") and name.count(".") == 2]
    assert len(shared) == 1 and os.stat(f"{root}/s2/{shared[0]}").st_nlink == 3
    with open(f"{root}/s0/__0_0.distcp", "r+b") as f:  # the file every checkpoint links, under its names
        data = bytearray(f.read())
        at = data.index(frozen.numpy().tobytes()[:64]) + 1000
        f.seek(at)
        f.write(bytes([data[at] ^ 0xFF]))
    assert cli(["verify", root]) == 1
    out = capsys.readouterr().out
    for step in range(3):  # each checkpoint that uses the file, named, with the file (under its name there) and key
        assert f"s{step}: FAILED: 1 problem" in out, out
    assert out.count("checksum mismatch") == out.count("key 'frozen'") == 3, out
    for step in range(3):
        with pytest.raises(core.CorruptCheckpointError, match=r"__0_0(\.[0-9a-z-]+)?\.distcp.*'frozen'"):
            core.load({"frozen": torch.zeros(512, 512), "trained": torch.zeros(1024)}, f"{root}/s{step}")


def test_retention_gives_back_what_no_checkpoint_needs_and_sharing_can_be_turned_off(tmp_path):
    frozen = torch.randn(1024, 1024)  # 4 MiB
    root, plain = str(tmp_path / "shared"), str(tmp_path / "plain")
    with core.Checkpointer() as checkpointer:
        manager = core.CheckpointManager(root, keep_last=2, checkpointer=checkpointer)
        for step in range(5):
            manager.save(step, {"frozen": frozen, "trained": torch.full((256, 1024), float(step))})
        checkpointer.wait()
    with core.Checkpointer(share_unchanged=False) as checkpointer:
        checkpointer.save({"frozen": frozen, "trained": torch.zeros(256, 1024)}, f"{plain}/a")
        checkpointer.save({"frozen": frozen, "trained": torch.ones(256, 1024)}, f"{plain}/b")
    assert all(entry.count(".") == 1 for entry in os.listdir(f"{plain}/b") if entry.endswith(".distcp"))
    used = _stored(root)
    # two checkpoints left: one frozen part (the ranges only removed checkpoints used, punched out) and two trained
    assert used < (4 + 2 * 1 + 0.5) * 2 ** 20, used
    for name in os.listdir(root):
        target = {"frozen": torch.zeros(1024, 1024), "trained": torch.zeros(256, 1024)}
        core.load(target, os.path.join(root, name))
        assert torch.equal(target["frozen"], frozen)
    shutil.rmtree(os.path.join(root, sorted(os.listdir(root))[0]))  # by hand: `asyncckpt clean` gives back the rest
    assert cli(["clean", root]) == 0
    assert _stored(root) < (4 + 1 + 0.5) * 2 ** 20, _stored(root)
    target = {"frozen": torch.zeros(1024, 1024), "trained": torch.zeros(256, 1024)}
    core.load(target, os.path.join(root, os.listdir(root)[0]))
    assert torch.equal(target["frozen"], frozen) and bool((target["trained"] == 4).all())


def test_an_object_store_copies_what_did_not_change_on_the_server(s3_server, s3_root):
    import s3fs
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    frozen = torch.randn(4, 2 ** 20)  # 16 MiB: above S3's smallest part, so it can be a part copied by the server
    received, saved = [], {}
    with core.Checkpointer() as checkpointer:
        for step in range(3):
            state = {"frozen": frozen, "trained": torch.full((2 ** 16,), float(step)), "step": step}
            before = s3_server.received_bytes
            checkpointer.save(state, f"{s3_root}/s{step}")
            received.append(s3_server.received_bytes - before)
            saved[step] = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
    assert received[0] > frozen.numel() * 4
    assert received[1] < 8 << 20 and received[2] < 8 << 20, received  # the frozen part: copied, not sent
    fs = s3fs.S3FileSystem()
    for step in (1, 2):  # each after every checkpoint before it is deleted: the newest, alone
        fs.rm(f"{s3_root}/s{step - 1}", recursive=True)
        for load in (lambda sd, p: core.load(sd, p), lambda sd, p: dcp.load(sd, storage_reader=FsspecReader(p))):
            target = {"frozen": torch.zeros(4, 2 ** 20), "trained": torch.zeros(2 ** 16), "step": -1}
            load(target, f"{s3_root}/s{step}")
            assert torch.equal(target["frozen"], frozen) and torch.equal(target["trained"], saved[step]["trained"])
            assert target["step"] == step


def test_accelerate_shares_the_file_of_a_frozen_model_and_every_checkpoint_loads_alone(tmp_path):
    from accelerate.utils import set_seed
    from test_accelerate import _fresh_accelerator

    from asyncckpt.adapters.accelerate import enable_async_checkpointing

    def objects(acc):
        set_seed(0)
        trained, frozen = torch.nn.Linear(64, 64), torch.nn.Linear(512, 512)  # a frozen encoder: 1 MiB
        frozen.requires_grad_(False)
        optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-2)
        return acc.prepare(trained, frozen, optimizer)

    acc = _fresh_accelerator(tmp_path / "run")
    handle = enable_async_checkpointing(acc)
    trained, frozen, optimizer = objects(acc)
    saved = []
    for _ in range(5):
        trained(frozen(torch.randn(4, 512))[:, :64]).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        saved.append((str(acc.save_state()), {k: v.clone() for k, v in trained.state_dict().items()}))
    acc.end_training()  # the last save's record reaches the trackers at the end of the run
    handle.remove()
    records = handle.metrics.history  # each as the trackers got it
    assert records[0]["bytes_shared"] == 0 and all(r["bytes_shared"] >= 512 * 512 * 4 for r in records[1:]), records
    assert all(r["bytes_written"] < r["bytes"] - 512 * 512 * 4 for r in records[1:]), records
    root = str(tmp_path / "run" / "checkpoints")
    assert os.stat(os.path.join(saved[-1][0], "model_1.safetensors")).st_nlink == 5
    for path, expected in saved:
        alone = _alone(root, os.path.basename(path), str(tmp_path / "alone"))
        plain = _fresh_accelerator(tmp_path / "plain")  # no asyncckpt: Accelerate's own load_state
        trained2, frozen2, _ = objects(plain)
        torch.nn.init.zeros_(trained2.weight)
        plain.load_state(alone)
        assert all(torch.equal(trained2.state_dict()[k], v) for k, v in expected.items())
        assert torch.equal(frozen2.weight, frozen.weight)


def _fsdp_saves(rank, world, root):
    """Accelerate's FSDP2 sharded save (its DCP parts) of a model whose first layer is frozen, three times; then the
    newest alone (the others deleted) through Accelerate's own load_state."""
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from test_fsdp import local_state, train
    from torch.distributed.fsdp import fully_shard

    from asyncckpt.adapters.accelerate import enable_async_checkpointing

    def build():
        accelerator = Accelerator(cpu=True)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        model[0].requires_grad_(False)
        for layer in (model[0], model[2], model):
            fully_shard(layer)
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        accelerator._models.append(model)
        accelerator._optimizers.append(AcceleratedOptimizer(optimizer, device_placement=False))
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
        return accelerator, model, optimizer

    accelerator, model, optimizer = build()
    handle = enable_async_checkpointing(accelerator, inline_bytes=0)
    for index in range(3):
        train(model, optimizer, [index], rank)
        accelerator.save_state(os.path.join(root, f"ckpt_{index}"))
    expected = local_state(model, optimizer)
    handle.remove()
    newest = os.path.join(root, "ckpt_2", "pytorch_model_fsdp_0")
    shared = sorted(name for name in os.listdir(newest) if name.count(".") == 2 and name.endswith(".distcp"))
    dist.barrier()
    if rank == 0:
        for index in range(2):
            shutil.rmtree(os.path.join(root, f"ckpt_{index}"))
    dist.barrier()
    train(model, optimizer, [7], rank)  # moved away from what was saved
    accelerator.load_state(os.path.join(root, "ckpt_2"))  # Accelerate's own: load_fsdp_model / optimizer (dcp.load)
    loaded = local_state(model, optimizer)
    return {"shared": shared, "same": len(loaded) == len(expected) and all(map(torch.equal, loaded, expected))}


def test_fsdp_parts_share_the_frozen_layers_shards_and_the_newest_loads_alone(tmp_path):
    from dist_helper import run_on_ranks

    results = run_on_ranks(_fsdp_saves, 2, str(tmp_path), timeout=300)
    for rank, result in enumerate(results):
        assert result["same"], rank
        assert any(name.startswith(f"__{rank}_0.") for name in result["shared"]), result  # its frozen shard, linked


class _FrozenNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(8, 512)  # frozen
        self.encoder.requires_grad_(False)
        self.head = torch.nn.Linear(512, 1)

    def forward(self, x, labels=None):
        out = self.head(self.encoder(x))
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def test_trainer_checkpoints_each_load_alone_as_the_trainers_own(tmp_path):
    from test_hf_trainer import _args, _assert_same_training_state, _checkpoints
    from toy import Toy
    from transformers import Trainer

    from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback

    for name, callbacks in (("native", []), ("async", [AsyncCheckpointCallback()])):
        torch.manual_seed(0)
        trainer = Trainer(model=_FrozenNet(), train_dataset=Toy(), callbacks=callbacks,
                          args=_args(tmp_path / name, max_steps=10, save_steps=2, save_total_limit=None))
        trainer.train()
    names = _checkpoints(tmp_path / "async")
    assert len(names) == 5 and names == _checkpoints(tmp_path / "native")
    for name in names:  # the Trainer's files of each, alone, as its own save wrote them
        alone = _alone(str(tmp_path / "async"), name, str(tmp_path / "alone"))
        _assert_same_training_state(alone, str(tmp_path / "native" / name))


def test_lightning_checkpoints_each_load_alone(tmp_path):
    """Lightning's ``.ckpt`` is one file holding the step: written whole (FORMAT.md §5b); each loads alone."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from asyncckpt.adapters.lightning import AsyncCkptIO

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.frozen, self.trained = torch.nn.Linear(64, 256), torch.nn.Linear(256, 1)
            self.frozen.requires_grad_(False)
            self.seen = {}

        def training_step(self, batch, batch_idx):
            return self.trained(self.frozen(batch[0])).pow(2).mean()

        def on_save_checkpoint(self, checkpoint):
            self.seen[self.global_step] = {k: v.clone() for k, v in self.state_dict().items()}

        def configure_optimizers(self):
            return torch.optim.Adam(self.trained.parameters())

    torch.manual_seed(0)
    module = Module()
    trainer = L.Trainer(max_steps=5, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[AsyncCkptIO()],
                        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)])
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(40, 64)), batch_size=8))
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert len(names) == 5
    for name in names:
        alone = tmp_path / "alone"
        shutil.rmtree(alone, ignore_errors=True)
        alone.mkdir()
        shutil.copy2(tmp_path / "ckpt" / name, alone / name)  # the others deleted
        loaded = torch.load(alone / name, weights_only=False)  # what Lightning's own load reads
        expected = module.seen[loaded["global_step"]]
        assert all(torch.equal(loaded["state_dict"][k], v) for k, v in expected.items()), name
