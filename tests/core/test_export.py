"""Exports to Hugging Face safetensors (background, after each commit, and ``asyncckpt export``) and
user code run on each committed checkpoint (``on_commit``, the Trainer's ``on_save`` after the commit,
``push_to_hub`` after the commit).

Real parts: multi-process gloo saves of DTensors, the real Transformers Trainer with a real model
class and ``from_pretrained``, PEFT, a real writer process killed with SIGKILL, a real RLIMIT_FSIZE
(EFBIG, as on a full disk) in the writer. The Hugging Face Hub cannot be reached here: the upload
is replaced at the ``huggingface_hub`` boundary (``Trainer``'s ``upload_folder``/``create_repo``).
"""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dist_helper import run_on_ranks
from toy import ON_PATH, body
from writers import limit_file_size
from asyncckpt.core import Checkpointer, CheckpointWriteError, ExportOptions, is_complete
from asyncckpt.core.cli.main import main as cli
from asyncckpt.core.storage import leftovers
from asyncckpt.core.verify import integrity

REPO = Path(__file__).resolve().parents[2]


def exported(directory) -> dict[str, torch.Tensor]:
    """Every tensor of an export, through safetensors' own loader, checking the index names every one."""
    directory = Path(directory)
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    index = list(directory.glob("*.safetensors.index.json"))
    if index:
        weight_map = json.loads(index[0].read_text())["weight_map"]
        assert set(weight_map) == set(tensors)
        assert all(name in load_file(directory / file) for name, file in weight_map.items())
    return tensors


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------- core, 2 ranks, DTensors
def _dtensor_save(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = {"embed.weight": torch.randn(50, 12), "proj.weight": torch.randn(12, 34),  # rows, columns
            "proj.bias": torch.randn(34).to(torch.bfloat16), "scale": torch.tensor(3.5)}
    placements = {"embed.weight": Shard(0), "proj.weight": Shard(1), "proj.bias": Shard(0)}
    model = {k: distribute_tensor(v, mesh, [placements[k]]) if k in placements else v for k, v in full.items()}
    options = ExportOptions(max_shard_size=1000, buffer_bytes=4096)  # several files; a buffer smaller than a tensor
    with Checkpointer(export=options) as checkpointer:
        checkpointer.async_save({"model": model, "optim": {"lr": 0.1, "m": torch.ones(3)}}, f"{root}/step_7", step=7)
        checkpointer.wait()
    return as_bytes(full)


def as_bytes(tensors: dict) -> bytes:
    """What a rank returns (tensors themselves would travel as shared memory its exit takes away)."""
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def test_core_two_rank_dtensor_checkpoint_exports_whole_tensors_bitwise(tmp_path):
    full = torch.load(io.BytesIO(run_on_ranks(_dtensor_save, 2, str(tmp_path), timeout=240)[0]))

    export = tmp_path / "exports" / "step_7"
    assert is_complete(str(export)) and is_complete(str(tmp_path / "step_7"))
    assert same(exported(export), full)  # the model's keys without "model.", whole, dtypes as saved
    assert len(list(export.glob("model-0000*-of-0000*.safetensors"))) > 1
    assert cli(["verify", str(export), "--no-progress"]) == 0
    module = torch.nn.Module()  # load_state_dict(strict=True) into modules of those shapes
    module.embed, module.proj = torch.nn.Embedding(50, 12), torch.nn.Linear(12, 34)
    module.register_buffer("scale", torch.tensor(0.0))
    tensors = exported(export)
    tensors["proj.weight"] = tensors["proj.weight"].T.contiguous()  # Linear stores [out, in]
    tensors["proj.bias"] = tensors["proj.bias"].float()
    module.load_state_dict(tensors, strict=True)


def test_export_casts_to_the_dtype_asked_for_as_torch_does_bit_for_bit(tmp_path):
    values = torch.cat([torch.randn(10_000), torch.tensor([float("nan"), -float("nan"), float("inf"), -0.0, 1e-40,
                                                           3.4e38, 65504.0, 7e4, 1.0000001])])
    state = {"model": {"a": values, "b": values.to(torch.bfloat16), "c": values.double(), "n": torch.arange(7)}}
    with Checkpointer() as checkpointer:
        checkpointer.save(state, str(tmp_path / "ck"))
    for flag, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        assert cli(["export", str(tmp_path / "ck"), str(tmp_path / flag), "--dtype", flag, "--no-progress"]) == 0
        got = exported(tmp_path / flag)
        for key in "abc":
            expected = state["model"][key].to(dtype)
            bits = torch.int16 if dtype != torch.float32 else torch.int32
            nan = expected.isnan()
            assert got[key].dtype == dtype and torch.equal(got[key].isnan(), nan), (flag, key)
            assert torch.equal(got[key][~nan].view(bits), expected[~nan].view(bits)), (flag, key)  # bit for bit
        assert torch.equal(got["n"], state["model"]["n"])  # integers stay as they are


# ----------------------------------------------------------------------------- offline, other writers
def test_cli_exports_a_stock_dcp_checkpoint_and_a_torch_save_file(tmp_path):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)  # no asyncckpt
    assert cli(["export", str(tmp_path / "dcp"), str(tmp_path / "out"), "--no-progress"]) == 0
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    fresh.load_state_dict(exported(tmp_path / "out"), strict=True)
    assert same(fresh.state_dict(), model.state_dict())
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, tmp_path / "last.ckpt")  # Lightning's layout
    assert cli(["export", str(tmp_path / "last.ckpt"), str(tmp_path / "out2"), "--no-progress"]) == 0
    assert same(exported(tmp_path / "out2"), model.state_dict())
    assert cli(["export", str(tmp_path / "nothing"), str(tmp_path / "out3"), "--no-progress"]) == 1
    assert not (tmp_path / "out3").exists()


def test_cli_exports_to_and_from_s3(tmp_path, s3_root):
    from asyncckpt.core.verify import integrity

    model = torch.nn.Linear(4, 3)
    with Checkpointer() as checkpointer:
        checkpointer.save({"model": model.state_dict()}, str(tmp_path / "ck"))
        checkpointer.save({"model": model.state_dict()}, f"{s3_root}/run/ck")
    assert cli(["export", str(tmp_path / "ck"), f"{s3_root}/exports/ck", "--no-progress"]) == 0
    assert integrity.check(f"{s3_root}/exports/ck").intact
    assert cli(["export", f"{s3_root}/run/ck", str(tmp_path / "from_s3"), "--no-progress"]) == 0
    assert same(exported(tmp_path / "from_s3"), model.state_dict())
    assert cli(["export", f"{s3_root}/run/nothing", str(tmp_path / "none"), "--no-progress"]) == 1
    assert not (tmp_path / "none").exists()


def _download(url: str, directory: Path) -> Path:
    from asyncckpt.core.writer.mirror import restore

    return Path(restore(url, str(directory)))


def test_checkpoints_saved_to_s3_are_exported_there_in_the_background(tmp_path, s3_root):
    """``export=`` on a Checkpointer saving to s3://: each committed checkpoint's export is committed
    under ``exports/`` beside it in the bucket (verifiable, loadable), and follows the checkpoints' retention."""
    from asyncckpt.core.verify import integrity

    models = [torch.nn.Linear(4, 3) for _ in range(2)]
    with Checkpointer(export="safetensors") as checkpointer:
        for step, model in enumerate(models):
            checkpointer.save({"model": model.state_dict()}, f"{s3_root}/run/step_{step}", step=step)
        checkpointer.wait()
        for step, model in enumerate(models):
            assert integrity.check(f"{s3_root}/run/exports/step_{step}").intact
            assert same(exported(_download(f"{s3_root}/run/exports/step_{step}", tmp_path / f"e{step}")),
                        model.state_dict())
        checkpointer.remove([f"{s3_root}/run/step_0"]).result()
        checkpointer.save({"model": models[1].state_dict()}, f"{s3_root}/run/step_2", step=2)
        checkpointer.wait()
    assert not is_complete(f"{s3_root}/run/exports/step_0")  # its checkpoint is gone
    assert is_complete(f"{s3_root}/run/exports/step_1") and is_complete(f"{s3_root}/run/exports/step_2")
    with Checkpointer() as checkpointer:  # asked for explicitly, by URL
        checkpointer.export(f"{s3_root}/run/step_1", ExportOptions(directory=f"{s3_root}/by_hand")).result()
    assert same(exported(_download(f"{s3_root}/by_hand/step_1", tmp_path / "by_hand")), models[1].state_dict())


# ----------------------------------------------------------------------------- failures
def test_kill9_during_an_export_leaves_no_export_and_the_checkpoint_intact(tmp_path):
    state = {"model": {f"w{i}": torch.randn(256, 1024) for i in range(64)}}  # 64 MiB, read through 4 KiB
    with Checkpointer() as checkpointer:
        checkpointer.save(state, str(tmp_path / "ck"))
    process = subprocess.Popen([sys.executable, "-m", "asyncckpt.core.cli", "export", str(tmp_path / "ck"),
                                str(tmp_path / "out"), "--buffer", "4KiB", "--no-progress"], cwd=REPO)
    deadline = time.monotonic() + 60
    while not any(name.startswith(".out.") for name in os.listdir(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert process.poll() is None, "the export ended before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (tmp_path / "out").exists()  # nothing under the export's name
    assert [leftover.kind for leftover in leftovers.find(str(tmp_path))] == ["staging"]
    assert integrity.check(str(tmp_path / "ck")).intact
    leftovers.clean(str(tmp_path))  # its writer is gone: a leftover
    assert not leftovers.find(str(tmp_path))
    assert cli(["export", str(tmp_path / "ck"), str(tmp_path / "out"), "--no-progress"]) == 0
    assert same(exported(tmp_path / "out"), state["model"])


def test_a_full_disk_during_a_background_export_names_the_checkpoint_and_training_goes_on(tmp_path, caplog):
    state = {"model": {"w": torch.randn(512, 512).to(torch.bfloat16)}}  # 512 KiB saved; 1 MiB exported as float32
    with Checkpointer(export=ExportOptions(dtype="float32")) as checkpointer:
        limit_file_size(checkpointer, 800 << 10)  # a real EFBIG in the writer
        first = checkpointer.async_save(state, str(tmp_path / "step_1"), step=1)
        checkpointer.wait()  # the export's failure is logged, not raised: training goes on
        second = checkpointer.async_save(state, str(tmp_path / "step_2"), step=2)
        checkpointer.wait()
    assert first.exception() is None and second.exception() is None
    assert is_complete(str(tmp_path / "step_1")) and integrity.check(str(tmp_path / "step_1")).intact
    assert not (tmp_path / "exports" / "step_1").exists() and not (tmp_path / "exports" / "step_2").exists()
    messages = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any(f"{tmp_path / 'step_1'}" in m and "the checkpoint is not affected" in m for m in messages), messages
    assert not leftovers.find(str(tmp_path / "exports"))  # the failed export's staging directory is gone


# ----------------------------------------------------------------------------- on_commit
def test_on_commit_sees_each_checkpoint_complete_in_order_and_its_failure_names_the_checkpoint(tmp_path):
    import shutil

    seen = []

    def copy_it(path: str) -> None:
        shutil.copytree(path, tmp_path / "copies" / os.path.basename(path))  # FileNotFoundError if not there yet
        seen.append(os.path.basename(path))
        if path.endswith("step_3"):
            raise ValueError("the evaluation failed")

    model = torch.nn.Linear(64, 64)
    with Checkpointer(on_commit=copy_it, max_in_flight=2) as checkpointer:
        for step in range(1, 4):
            checkpointer.async_save({"model": model.state_dict()}, str(tmp_path / f"step_{step}"), step=step)
        with pytest.raises(CheckpointWriteError, match=r"step_3 \(step 3\) failed: ValueError: the evaluation failed"):
            checkpointer.wait()
        checkpointer.async_save({"model": model.state_dict()}, str(tmp_path / "step_4"), step=4)
        checkpointer.wait()  # raised once
    assert seen == ["step_1", "step_2", "step_3", "step_4"]
    for step in seen:
        assert integrity.check(str(tmp_path / "copies" / step)).intact  # a complete copy, commit record included


# ----------------------------------------------------------------------------- the Transformers Trainer
def _trainer(output_dir, callbacks, model=None, **arguments):
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class Tokens(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    model = model or GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=str(output_dir), max_steps=4, save_steps=2, per_device_train_batch_size=4,
                             use_cpu=True, report_to=[], logging_strategy="no", **arguments)
    return Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)


class CopyOnSave:
    """A user's callback: copies ``checkpoint-N`` in ``on_save`` (FileNotFoundError when it is not there)."""

    def __init__(self, into):
        import shutil
        from transformers import TrainerCallback

        self.into, self.copied, self.threads = into, [], []

        class Callback(TrainerCallback):
            def on_save(inner, args, state, control, **kwargs):
                name = f"checkpoint-{state.global_step}"
                shutil.copytree(os.path.join(args.output_dir, name), os.path.join(self.into, name),
                                dirs_exist_ok=True)  # the Trainer saves the last step twice (step and epoch end)
                if name not in self.copied:
                    self.copied.append(name)
                self.threads.append(__import__("threading").current_thread().name)

        self.callback = Callback()


def test_trainer_exports_each_checkpoint_for_from_pretrained_and_on_save_finds_it_committed(tmp_path):
    from transformers import AutoModelForCausalLM

    from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback

    user = CopyOnSave(str(tmp_path / "copies"))
    trainer = _trainer(tmp_path / "run", [AsyncCheckpointCallback(export=ExportOptions(max_shard_size="100KB"),
                                                                  on_save_after_commit=True), user.callback])
    trainer.train()

    assert user.copied == ["checkpoint-2", "checkpoint-4"] and set(user.threads) != {"MainThread"}
    for name in user.copied:  # complete when on_save ran: commit record included, every checksum right
        assert integrity.check(str(tmp_path / "copies" / name)).intact
    export = tmp_path / "run" / "exports" / "checkpoint-4"
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(os.listdir(export))
    loaded = AutoModelForCausalLM.from_pretrained(str(export))
    trained = trainer.model.state_dict()
    assert all(torch.equal(loaded.state_dict()[k], trained[k]) for k in trained)  # bit for bit, tied weights too
    assert cli(["verify", str(export), "--no-progress"]) == 0


def test_trainer_push_to_hub_uploads_each_checkpoint_after_its_commit_in_order(tmp_path, monkeypatch):
    import threading
    from concurrent.futures import Future

    import huggingface_hub
    from huggingface_hub import RepoUrl

    from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback

    uploads = []

    def upload_folder(self, *, repo_id, folder_path, path_in_repo=None, **kwargs):  # the Hub is not reachable here
        uploads.append((os.path.basename(folder_path), is_complete(folder_path) if path_in_repo else None,
                        threading.current_thread().name))
        done = Future()
        done.set_result(None)
        return done

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo",
                        lambda self, name, **kwargs: RepoUrl(f"https://huggingface.co/{name}"))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    trainer = _trainer(tmp_path / "run", [AsyncCheckpointCallback()], push_to_hub=True, hub_strategy="all_checkpoints",
                       hub_model_id="user/run")
    trainer.train()

    checkpoints = [(name, complete) for name, complete, _thread in uploads if complete is not None]
    assert checkpoints == [("checkpoint-2", True), ("checkpoint-4", True)]  # after its commit, in order
    assert all(thread.startswith("asyncckpt-on-commit") for _name, _c, thread in uploads[:4])  # off the training loop


def test_trainer_push_to_hub_failure_is_logged_and_training_goes_on(tmp_path, monkeypatch, caplog):
    """An upload that fails at the call (a token the Hub refuses, a repository it cannot make) is logged by the
    Trainer's logger, as the Trainer's own failed uploads are, and neither the save nor training fails: every
    checkpoint is committed locally."""
    import logging

    import huggingface_hub
    from huggingface_hub import RepoUrl

    from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback

    def upload_folder(self, **kwargs):
        raise PermissionError("401 Client Error: Unauthorized (the Hub cannot be reached here)")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo",
                        lambda self, name, **kwargs: RepoUrl(f"https://huggingface.co/{name}"))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    trainer = _trainer(tmp_path / "run", [AsyncCheckpointCallback()], push_to_hub=True, hub_model_id="user/run")
    with caplog.at_level(logging.ERROR, logger="transformers.trainer"):
        trainer.train()
    failures = sorted({r.getMessage() for r in caplog.records if "to the Hub failed (training goes on" in r.getMessage()})
    assert len(failures) == 2 and "checkpoint-2" in failures[0] and "401 Client Error" in failures[0], failures
    assert all(is_complete(str(tmp_path / "run" / name)) for name in ("checkpoint-2", "checkpoint-4"))


@pytest.fixture
def peft_run(tmp_path):
    """A LoRA fine-tune of a base model saved in ``base/``: (the trained PeftModel, the run's directory)."""
    peft = pytest.importorskip("peft")
    from transformers import GPT2Config, GPT2LMHeadModel

    from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    base.save_pretrained(tmp_path / "base")
    base = GPT2LMHeadModel.from_pretrained(tmp_path / "base")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                                      init_lora_weights=False))
    trainer = _trainer(tmp_path / "run", [AsyncCheckpointCallback()], model=model)
    trainer.train()
    return trainer.model, tmp_path


def test_a_peft_checkpoint_exports_the_adapter_alone_or_merged_as_chosen(peft_run, monkeypatch):
    import peft
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    model, root = peft_run
    checkpoint = root / "run" / "checkpoint-4"
    assert cli(["export", str(checkpoint), str(root / "adapter"), "--no-progress"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(root / "adapter"))
    fresh = peft.PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(root / "base"), str(root / "adapter"))
    lora = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert lora and all(torch.equal(fresh.state_dict()[k], v) for k, v in lora.items())

    with Checkpointer() as checkpointer:  # in the background writer, as the export= option runs it
        checkpointer.export(checkpoint, ExportOptions(directory=str(root / "merged"), peft="merged",
                                                      base_model=str(root / "base"))).result()
    loaded = AutoModelForCausalLM.from_pretrained(root / "merged" / "checkpoint-4")
    reference = model.merge_and_unload().state_dict()
    assert reference.keys() == loaded.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in reference.items())  # bit for bit

    # the base model as a Hub id (what adapter configs hold): fetched as from_pretrained would, here from the Hub's
    # cache (HF_HUB_OFFLINE: the Hub cannot be reached from here); one the Hub does not give is a clear error
    repo = root / "hub" / "models--org--tiny-base"
    shutil.copytree(root / "base", repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(root / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with Checkpointer() as checkpointer:
        checkpointer.export(checkpoint, ExportOptions(directory=str(root / "from_hub"), peft="merged",
                                                      base_model="org/tiny-base")).result()
        assert same(exported(root / "from_hub" / "checkpoint-4"), exported(root / "merged" / "checkpoint-4"))
        with pytest.raises(CheckpointWriteError, match="'org/missing' is neither a local directory nor a model the "
                                                       "Hugging Face Hub gave"):
            checkpointer.export(checkpoint, ExportOptions(directory=str(root / "missing"), peft="merged",
                                                          base_model="org/missing")).result()


# ----------------------------------------------------------------------------- Accelerate and Lightning, FSDP2
def _accelerate_fsdp2_export(rank, world, root):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from asyncckpt.adapters.accelerate import enable_async_checkpointing
    from test_fsdp import fsdp_accelerator, train

    accelerator, model, optimizer = fsdp_accelerator("SHARDED_STATE_DICT")
    handle = enable_async_checkpointing(accelerator, export=ExportOptions(max_shard_size="8KB"), inline_bytes=0)
    train(model, optimizer, range(3), rank)
    accelerator.save_state(f"{root}/checkpoint")
    handle.wait()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    handle.remove()
    return as_bytes(full) if rank == 0 else None


def test_accelerate_fsdp2_sharded_checkpoint_exports_the_trained_model(tmp_path):
    from test_fsdp import _model

    full = torch.load(io.BytesIO(run_on_ranks(_accelerate_fsdp2_export, 2, str(tmp_path), timeout=300)[0]))
    export = tmp_path / "exports" / "checkpoint"
    assert is_complete(str(export)) and len(list(export.glob("model-*.safetensors"))) > 1
    tensors = exported(export)
    assert same(tensors, {k: v for k, v in full.items()})  # from both ranks' shards, bit for bit
    _model().load_state_dict(tensors, strict=True)


LIGHTNING_MODEL_PARALLEL = ON_PATH + '''
import sys, torch, lightning as L
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.callbacks import ModelCheckpoint
from asyncckpt.adapters.lightning import AsyncCkptIO
from asyncckpt.core import ExportOptions
from toy import body

class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = body(16, relu=True)
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        for m in self.net:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
    def training_step(self, b, i):
        return torch.nn.functional.mse_loss(self.net(b[0]), b[1])
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

if __name__ == "__main__":
    root = sys.argv[1]
    L.seed_everything(0, verbose=False)
    x = torch.randn(64, 8)
    committed = []
    io = AsyncCkptIO(export=ExportOptions(add_prefix="module."), on_commit=committed.append)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[io],
                        callbacks=[ModelCheckpoint(dirpath=root + "/ckpts", every_n_train_steps=2, save_top_k=-1)],
                        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
    model = M()
    trainer.fit(model, DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8))
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.global_rank == 0:
        torch.save({"full": full, "committed": committed}, root + "/result.pt")
'''


def test_lightning_model_parallel_sharded_checkpoint_exports_the_module_with_the_chosen_prefix(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(LIGHTNING_MODEL_PARALLEL)
    process = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert process.returncode == 0, process.stderr[-4000:]
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    names = sorted(os.path.basename(p) for p in result["committed"])
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]  # on_commit, once each checkpoint committed
    export = tmp_path / "ckpts" / "exports" / "epoch=0-step=4"
    tensors = exported(export)
    assert same(tensors, {f"module.{k}": v for k, v in result["full"].items()})
    net = body(16, relu=True)
    net.load_state_dict({k.removeprefix("module.net."): v for k, v in tensors.items()}, strict=True)


def test_lightning_ckpt_files_are_exported_and_exports_follow_the_checkpoints_retention(tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from asyncckpt.adapters.lightning import AsyncCkptIO

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    model = Module()
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[AsyncCkptIO(export="safetensors")],
                        callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=1,
                                                   monitor="step", mode="max")])
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(48, 4)), batch_size=4))

    assert sorted(os.listdir(tmp_path / "exports")) == ["epoch=0-step=6"]  # those of removed .ckpt files went too
    model.net.load_state_dict({k.removeprefix("net."): v for k, v in exported(tmp_path / "exports" / "epoch=0-step=6").items()},
                              strict=True)
    assert same(exported(tmp_path / "exports" / "epoch=0-step=6"), model.state_dict())
