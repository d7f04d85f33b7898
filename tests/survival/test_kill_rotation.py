"""kill -9 at random moments while checkpoints are saved and rotated, in each adapter.

Each trial runs a real training program that saves at every step with rotation on (every save
deletes an older checkpoint), kills it after a random delay, and then looks at what the framework
would see: every checkpoint under the framework's own names must be complete (its commit record
and all its files, loadable). Whatever a kill interrupts (a save, a deletion) may leave only a
hidden leftover, which the next run's first save removes. 7 trials per adapter, 21 in all; the
delays are random but seeded, so a failure can be replayed. Each trial is a fresh process forked from
one that imported the framework once (``zygote.py``): what a kill leaves does not depend on how the
process started, and the imports would cost more than the trials.
"""
from __future__ import annotations

import os
import random
import textwrap
import time
from pathlib import Path

import pytest
import torch

from asyncckpt.core import is_complete
from asyncckpt.core.formats import names
from zygote import Zygote

TRIALS = 7

COMMON = """
import os, sys, torch
mode, root = sys.argv[1], sys.argv[2]
def big_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 1024), torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1))  # ~13 MB with Adam
def announce(i):
    if i == 3: print("READY", flush=True)  # rotation has started
"""

PROGRAMS = {
    "hf_trainer": COMMON + textwrap.dedent("""
        from torch.utils.data import Dataset
        from transformers import Trainer, TrainerCallback, TrainingArguments
        from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback
        class Toy(Dataset):
            def __len__(self): return 100000
            def __getitem__(self, i):
                x = torch.randn(8, generator=torch.Generator().manual_seed(i)); return {"x": x, "labels": x.sum(0, keepdim=True)}
        class Net(torch.nn.Module):
            def __init__(self): super().__init__(); self.body = big_model()
            def forward(self, x, labels=None):
                out = self.body(x); return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}
        class Announce(TrainerCallback):
            def on_save(self, args, state, control, **kwargs): announce(state.global_step)
        args = TrainingArguments(output_dir=root, per_device_train_batch_size=2, max_steps=100000 if mode == "loop" else 1,
                                 save_steps=1, save_total_limit=1, report_to=[], use_cpu=True, disable_tqdm=True,
                                 logging_strategy="no")
        Trainer(model=Net(), args=args, train_dataset=Toy(), callbacks=[AsyncCheckpointCallback(), Announce()]).train()
    """),
    "accelerate": COMMON + textwrap.dedent("""
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration
        from asyncckpt.adapters.accelerate import enable_async_checkpointing
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True,
                                                                       total_limit=2))
        handle = enable_async_checkpointing(acc)
        model = big_model(); opt = torch.optim.Adam(model.parameters())
        model, opt = acc.prepare(model, opt)
        if mode == "once":
            acc.load_state()
        else:  # number on after the last trial's checkpoints, as a resumed run does (Accelerate refuses to overwrite)
            named = os.listdir(os.path.join(root, "checkpoints")) if os.path.isdir(os.path.join(root, "checkpoints")) else []
            acc.project_configuration.iteration = 1 + max((int(n.split("_")[1]) for n in named if n.startswith("checkpoint_")),
                                                          default=-1)
        for i in range(100000 if mode == "loop" else 1):
            model(torch.randn(2, 8)).square().mean().backward(); opt.step(); opt.zero_grad()
            acc.save_state(); announce(i)
        acc.end_training()
    """),
    "lightning": COMMON + textwrap.dedent("""
        import lightning as L
        from lightning.pytorch.callbacks import ModelCheckpoint
        from torch.utils.data import DataLoader, TensorDataset
        from asyncckpt.adapters.lightning import AsyncCkptIO
        class Lit(L.LightningModule):
            def __init__(self): super().__init__(); self.net = big_model()
            def training_step(self, batch, batch_idx):
                announce(self.global_step); x, y = batch; loss = torch.nn.functional.mse_loss(self.net(x), y)
                self.log("loss", loss); return loss
            def configure_optimizers(self): return torch.optim.Adam(self.parameters())
        x = torch.randn(4096, 8)
        trainer = L.Trainer(max_steps=100000 if mode == "loop" else 1, accelerator="cpu", logger=False,
                            enable_progress_bar=False, enable_model_summary=False, plugins=[AsyncCkptIO()],
                            callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=2, monitor="loss",
                                                       save_last=True)])
        trainer.fit(Lit(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2))
    """),
}


def _framework_sees(adapter: str, root: Path) -> list[Path]:
    """What the framework lists as checkpoints."""
    if adapter == "hf_trainer":
        return sorted(p for p in root.glob("checkpoint-*"))
    if adapter == "accelerate":
        return sorted((root / "checkpoints").iterdir()) if (root / "checkpoints").is_dir() else []
    return sorted(root.glob("*.ckpt"))


def _assert_complete(adapter: str, checkpoint: Path) -> None:
    if adapter == "lightning":  # single files: written under a hidden name, renamed when durable
        assert torch.load(checkpoint, weights_only=False)["state_dict"], checkpoint
        return
    assert is_complete(str(checkpoint)), f"{checkpoint} visible without its commit record: {os.listdir(checkpoint)}"
    expected = {"model.safetensors", "optimizer.bin" if adapter == "accelerate" else "optimizer.pt"}
    assert expected <= set(os.listdir(checkpoint)), (checkpoint, os.listdir(checkpoint))


# What each program imports: its zygote imports them once, and every trial is a fork of it.
IMPORTS = {
    "hf_trainer": ["transformers.trainer", "asyncckpt.adapters.hf_trainer"],
    "accelerate": ["accelerate", "asyncckpt.adapters.accelerate"],
    "lightning": ["lightning", "asyncckpt.adapters.lightning"],
}


def _hidden_parents(adapter: str, root: Path) -> list[Path]:
    """Where a kill can leave hidden entries: beside the checkpoints."""
    return [root, root / "checkpoints"] if adapter == "accelerate" else [root]


def _run_trials(adapter: str, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(PROGRAMS[adapter])
    root = tmp_path / "run"
    delays = random.Random(f"{adapter}-kill").sample(range(0, 2500, 50), TRIALS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with Zygote(["torch", *IMPORTS[adapter]], env, tmp_path) as zygote:
        for delay_ms in delays:
            run = zygote.run(script, "loop", root)
            try:
                run.wait_for_line("READY")
                time.sleep(delay_ms / 1000)
            finally:
                run.kill()
            assert run.wait() == -9, f"the program ended on its own (exit {run.returncode}) before the kill"
            seen = _framework_sees(adapter, root)
            assert seen, f"nothing visible after a kill {delay_ms} ms into rotation"
            for checkpoint in seen:
                _assert_complete(adapter, checkpoint)
        # what the kills left is hidden, and the next run's save removes it (its writers are gone: the zygote
        # reaped them, as it reaps every process a run started before it reports the run's exit)
        once = zygote.run(script, "once", root)
        assert once.wait() == 0, once.stderr()[-3000:]
    hidden = [entry for parent in _hidden_parents(adapter, root) if parent.is_dir() for entry in os.listdir(parent)
              if names.parse_hidden(entry)]
    assert hidden == [], hidden
    for checkpoint in _framework_sees(adapter, root):
        _assert_complete(adapter, checkpoint)


@pytest.mark.parametrize("adapter", ["hf_trainer", "accelerate", "lightning"])
def test_kill9_at_random_moments_during_rotation_leaves_only_complete_checkpoints(tmp_path, adapter):
    pytest.importorskip({"hf_trainer": "transformers"}.get(adapter, adapter))
    _run_trials(adapter, tmp_path)
