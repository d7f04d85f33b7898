"""CUDA paths: pinned snapshot buffers, copies on a side stream, and the frameworks' own FSDP launch paths.

Skipped where no GPU exists (the project's own machine has none; these run where one is lent or
in a user's CI: ``bash benchmarks/gpu_sitting.sh`` runs them with the GPU benchmark). The multi-GPU tests run each
framework the way its users launch FSDP, which the CPU tests in ``tests/test_fsdp.py`` cannot (the launchers
refuse FSDP without GPUs); each adapter also runs under NCCL with a world of one, its usual DDP launch on one GPU
(NCCL carries no CPU tensors at any world size: what asyncckpt exchanges goes by its own transport,
``snapshot.collectives``; ``tests/test_collectives.py`` runs the 2-rank cases on CPU with ``cuda:gloo``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# The launcher tests run on 2 GPUs where there are 2 (sharded across ranks), else on the one there is (the
# launcher's FSDP path with a world of 1: NCCL refuses two ranks on one device).
RANKS = min(2, torch.cuda.device_count())


def test_sharded_save_from_cuda_uses_pinned_buffers_and_survives_in_place_updates(tmp_path):
    from asyncckpt.core import Checkpointer

    torch.manual_seed(0)
    state = {"big": torch.randn(16 << 20, device="cuda"), "small": torch.randn(7, 3, device="cuda"),
             "step": torch.tensor(5, device="cuda"), "note": "cuda"}
    expected = {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in state.items()}
    checkpointer = Checkpointer()
    try:
        handle = checkpointer.async_save(state, tmp_path / "ckpt")
        for value in state.values():  # the snapshot was taken before async_save returned
            if isinstance(value, torch.Tensor):
                value.add_(1)
        handle.result()
        assert any(slot.buffer.pinned for slot in checkpointer._parts.buffers.slots())
        target = {key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else None for key, value in state.items()}
        checkpointer.load(target, tmp_path / "ckpt")
    finally:
        checkpointer.close()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert target[key].is_cuda and torch.equal(target[key], value), key
        else:
            assert target[key] == value


def test_native_file_from_cuda_tensors_is_what_torch_save_writes(tmp_path):
    from asyncckpt.core import Checkpointer

    state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(3, device="cuda", dtype=torch.bfloat16)}
    expected = {key: value.clone() for key, value in state.items()}
    checkpointer = Checkpointer()
    try:
        handle = checkpointer.async_save_file(state, tmp_path / "model.pt")
        state["w"].mul_(0)  # after the snapshot: not in the file
        handle.result()
    finally:
        checkpointer.close()
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert loaded[key].device == value.device and loaded[key].dtype == value.dtype and torch.equal(loaded[key], value)


def _torchrun(tmp_path: Path, program: str, *args: str, timeout: float = 600, ranks: int = RANKS
             ) -> subprocess.CompletedProcess:
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(program))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    # --standalone: the launcher binds its rendezvous port itself (a port picked here and handed over can be taken
    # in between: a resume run once failed EADDRINUSE).
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                           str(script), *args], env=env, capture_output=True, text=True, timeout=timeout)


ACCELERATE = """
    import os, sys, torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from asyncckpt.adapters.accelerate import enable_async_checkpointing
    from asyncckpt.core import MemoryTier
    root, kind = sys.argv[1], sys.argv[2]
    # FSDP2 (kind: its state dict type), or DDP ("DDP") with the memory tier
    sharding = {} if kind == "DDP" else {"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=kind)}
    accelerator = Accelerator(**sharding)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    tier = {"memory_tier": MemoryTier(replicas=0, persist_every=1)} if kind == "DDP" else {}  # each durable too
    handle = enable_async_checkpointing(accelerator, **tier)
    def steps(numbers):
        for n in numbers:
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1000 * n + accelerator.process_index)).cuda()
            accelerator.backward(model(x).square().mean()); optimizer.step(); optimizer.zero_grad()
    def snapshot():
        return [p.detach().full_tensor().cpu() if hasattr(p, "full_tensor") else p.detach().cpu() for p in model.parameters()]
    steps(range(3))
    accelerator.save_state(os.path.join(root, "ckpt"))
    steps(range(3, 6))
    expected = snapshot()
    handle.wait()
    accelerator.load_state(os.path.join(root, "ckpt"))
    steps(range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(expected, snapshot())), "not bit for bit after resume"
    assert dist.get_backend() in ("nccl", "cuda:nccl,cpu:gloo"), dist.get_backend()
    accelerator.end_training()
    handle.remove()
    print("OK", flush=True)
"""


@pytest.mark.parametrize("kind, ranks", [("SHARDED_STATE_DICT", RANKS), ("FULL_STATE_DICT", RANKS), ("DDP", 1)])
def test_accelerate_on_gpus_saves_asynchronously_and_resumes_bit_for_bit(tmp_path, monkeypatch, kind, ranks):
    """FSDP2 on the GPUs there are; DDP under NCCL with a world of one, with the memory tier."""
    pytest.importorskip("accelerate")
    from asyncckpt.core.verify import integrity

    monkeypatch.setenv("ASYNCCKPT_MEMORY_ROOT", str(tmp_path / "memory"))  # the program's
    result = _torchrun(tmp_path, ACCELERATE, str(tmp_path), kind, ranks=ranks)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-4000:]
    report = integrity.check(str(tmp_path / "ckpt"))
    assert report.intact and not report.unverified, report


TRAINER = """
    import sys, torch
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments
    from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback
    import torch.distributed as dist
    root, resume, fsdp = sys.argv[1], sys.argv[2] == "resume", sys.argv[3] == "fsdp"
    class Toy(Dataset):
        def __len__(self): return 256
        def __getitem__(self, i):
            x = torch.randn(64, generator=torch.Generator().manual_seed(i)); return {"x": x, "labels": x[:8]}
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__(); torch.manual_seed(0)
            self.a, self.b = torch.nn.Linear(64, 256), torch.nn.Linear(256, 8)
        def forward(self, x, labels=None):
            out = self.b(torch.relu(self.a(x))); return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}
    sharding = {"fsdp": "full_shard", "fsdp_config": {"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}} if fsdp else {}
    args = TrainingArguments(output_dir=root, per_device_train_batch_size=4, max_steps=8, save_steps=4, report_to=[],
                             disable_tqdm=True, logging_strategy="no", **sharding)
    callback = AsyncCheckpointCallback()
    Trainer(model=Net(), args=args, train_dataset=Toy(), callbacks=[callback]).train(resume_from_checkpoint=resume or None)
    assert [t["step"] for t in callback.metrics] == ([8] if resume else [4, 8]), callback.metrics
    assert dist.get_backend() == "nccl", dist.get_backend()
    print("OK", flush=True)
"""


@pytest.mark.parametrize("sharding, ranks", [("fsdp", RANKS), ("ddp", 1)])
def test_trainer_on_gpus_saves_asynchronously_and_resumes(tmp_path, sharding, ranks):
    """FSDP on the GPUs there are; DDP under NCCL with a world of one."""
    pytest.importorskip("transformers")
    from asyncckpt.core.verify import integrity

    first = _torchrun(tmp_path, TRAINER, str(tmp_path / "run"), "fresh", sharding, ranks=ranks)
    assert first.returncode == 0 and "OK" in first.stdout, first.stderr[-4000:]
    for step in (4, 8):
        report = integrity.check(str(tmp_path / "run" / f"checkpoint-{step}"))
        assert report.intact and not report.unverified, report
    import shutil

    shutil.rmtree(tmp_path / "run" / "checkpoint-8")
    resumed = _torchrun(tmp_path, TRAINER, str(tmp_path / "run"), "resume", sharding, ranks=ranks)
    assert resumed.returncode == 0 and "OK" in resumed.stdout, resumed.stderr[-4000:]


LIGHTNING_FSDP = """
    import os, sys, torch
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.utils.data import DataLoader, TensorDataset
    from asyncckpt.adapters.lightning import AsyncCkptIO
    root, kind, resume = sys.argv[1], sys.argv[2], sys.argv[3] == "resume"
    class Lit(L.LightningModule):
        def __init__(self): super().__init__(); torch.manual_seed(0); self.net = torch.nn.Linear(64, 8)
        def training_step(self, batch, batch_idx):
            x, y = batch; return torch.nn.functional.mse_loss(self.net(x), y)
        def configure_optimizers(self): return torch.optim.Adam(self.parameters())
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(max_epochs=4 if resume else 2, accelerator="cuda", devices=int(os.environ["WORLD_SIZE"]),
                        strategy=FSDPStrategy(state_dict_type=kind), plugins=[AsyncCkptIO()], logger=False,
                        enable_progress_bar=False, callbacks=[ModelCheckpoint(dirpath=root, save_last=True)])
    trainer.fit(Lit(), DataLoader(TensorDataset(x, x[:, :8]), batch_size=8), ckpt_path="last" if resume else None)
    print("OK", trainer.global_step, flush=True)
"""


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_lightning_fsdp_on_gpus_saves_asynchronously_and_resumes_from_last(tmp_path, kind):
    pytest.importorskip("lightning")
    from asyncckpt.core.verify import integrity

    first = _torchrun(tmp_path, LIGHTNING_FSDP, str(tmp_path / "ckpts"), kind, "fresh")
    assert first.returncode == 0 and f"OK {16 // RANKS}" in first.stdout, first.stderr[-4000:]
    last = tmp_path / "ckpts" / "last.ckpt"
    report = integrity.check(str(last))
    assert report.intact and report.checked_files >= 1, report
    resumed = _torchrun(tmp_path, LIGHTNING_FSDP, str(tmp_path / "ckpts"), kind, "resume")
    assert resumed.returncode == 0 and f"OK {32 // RANKS}" in resumed.stdout, resumed.stderr[-4000:]


LIGHTNING_DDP = """
    import os, sys, torch
    import torch.distributed as dist
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset
    from asyncckpt.adapters.lightning import AsyncCkptIO
    from asyncckpt.core import MemoryTier
    root = sys.argv[1]
    class Lit(L.LightningModule):
        def __init__(self): super().__init__(); torch.manual_seed(0); self.net = torch.nn.Linear(64, 8)
        def training_step(self, batch, batch_idx):
            x, y = batch; return torch.nn.functional.mse_loss(self.net(x), y)
        def configure_optimizers(self): return torch.optim.Adam(self.parameters())
    class Begins(Callback):
        def on_train_start(self, trainer, module):
            print("BEGINS", trainer.global_step, dist.get_backend(), flush=True)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    def fit(epochs, resume, run="run"):
        module = Lit()
        trainer = L.Trainer(max_epochs=epochs, accelerator="cuda", devices=1, strategy="ddp", logger=False,
                            plugins=[AsyncCkptIO(memory_tier=MemoryTier(replicas=0, persist_every=2))],
                            enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[ModelCheckpoint(dirpath=os.path.join(root, run), save_last=True), Begins()])
        trainer.fit(module, DataLoader(TensorDataset(x, x[:, :8]), batch_size=8), ckpt_path="last" if resume else None)
        return [p.detach().cpu() for p in module.parameters()]
    fit(2, False)  # epochs 0-1, then a resume from its last.ckpt to epoch 4: the same weights as 4 epochs at once
    resumed = fit(4, True)
    assert all(torch.equal(a, b) for a, b in zip(fit(4, False, "reference"), resumed)), "not bit for bit after resume"
    print("OK", flush=True)
"""


def test_lightning_ddp_under_nccl_with_a_world_of_one_saves_to_memory_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    monkeypatch.setenv("ASYNCCKPT_MEMORY_ROOT", str(tmp_path / "memory"))  # the program's
    result = _torchrun(tmp_path, LIGHTNING_DDP, str(tmp_path / "run"), ranks=1)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-4000:]
    begins = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("BEGINS")]
    assert begins == [["0", "nccl"], ["16", "nccl"], ["0", "nccl"]], begins


MEMORY_TIER_CUDA = """
    import glob, os, sys, torch
    import torch.distributed as dist
    root = sys.argv[1]
    rank = int(os.environ["RANK"])
    # two nodes of one rank each on this machine, the ranks sharing the GPU (the tier's traffic is host-side)
    os.environ.update(ASYNCCKPT_NODE=f"n{rank}", ASYNCCKPT_MEMORY_ROOT=os.path.join(root, "memory", f"n{rank}"),
                      ASYNCCKPT_REPLICATION_ADDRESS="127.0.0.1", GROUP_RANK=str(rank), LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo")
    from asyncckpt import core
    from asyncckpt.core import tier
    torch.manual_seed(rank)
    share = {"w": torch.randn(24 << 20, device="cuda"), "h": torch.randn(7, 3, device="cuda", dtype=torch.bfloat16)}
    state, durable, expected = {f"rank{rank}": share, "step": 0}, os.path.join(root, "run"), {}
    with core.Checkpointer(memory_tier=core.MemoryTier(replicas=1, persist_every=100, keep=2)) as checkpointer:
        for step in (1, 2):
            state["step"] = step
            checkpointer.async_save(state, f"{durable}/step_{step}", step=step)
            expected[step] = {key: value.clone() for key, value in share.items()}
            for value in share.values():  # after the snapshot: in no checkpoint
                value.add_(1)
        checkpointer.wait()
        latest = core.latest_checkpoint(durable)
        assert latest == tier.memory_path(f"{durable}/step_2"), latest  # memory only: nothing durable yet
        own = os.environ["ASYNCCKPT_MEMORY_ROOT"]  # committed here: this node's share and its peer's replica
        assert glob.glob(f"{own}/*/step_2/__{1 - rank}_0.distcp"), f"node n{rank} holds no replica of its peer's share"
        target = {f"rank{rank}": {key: torch.zeros_like(value) for key, value in share.items()}, "step": None}
        core.load(target, latest)
        assert target["step"] == 2, target["step"]
        for key, value in target[f"rank{rank}"].items():
            assert value.is_cuda and torch.equal(value, expected[2][key]), key
    dist.barrier()
    dist.destroy_process_group()
    print("OK", flush=True)
"""


def test_memory_tier_from_cuda_state_replicates_and_loads_back_onto_the_gpu(tmp_path):
    """Two nodes (one rank each, sharing the GPU): a save of GPU tensors is committed in node memory with its
    replica on the other node, and the restart's load from memory puts the state back on the GPU, bit for bit;
    the run's end leaves only the durable copy."""
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(MEMORY_TIER_CUDA))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.count("OK") == 2, result.stderr[-4000:]
    assert sorted(os.listdir(tmp_path / "run")) == ["step_2"]  # the run's last checkpoint, durable at its end
    assert [name for node in ("n0", "n1") for name in os.listdir(tmp_path / "memory" / node)] == []
