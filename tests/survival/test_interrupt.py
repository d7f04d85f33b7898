"""Ctrl-C, or kill -9, during training, in each adapter: saves already handed over finish and commit.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group. Each program runs in a
process group of its own (as under a terminal), saves at every step and prints ``SAVED <step>``
each time a save call returns; SIGINT goes to the group at a random moment. The background writer
does not receive it (a session of its own), so every save that returned before the interrupt is
committed when the process has exited, as natively every completed save is on disk; the process
exits as it would without the adapter; and the next run resumes from the newest checkpoint.
Both runs are forks of one process that imported the framework once (``zygote.py``), each in a
fresh process (the interrupted one in a session of its own), as ``python train.py`` would be.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from asyncckpt.core import is_complete
from asyncckpt.core.formats import names
from test_kill_rotation import IMPORTS  # what each adapter's program imports
from processes import Program
from writers import wait_until_gone
from zygote import Zygote

COMMON = """
import os, sys, torch
mode, root = sys.argv[1], sys.argv[2]
torch.manual_seed(int(os.environ.get("SEED", "0")))
WIDTH = int(os.environ.get("WIDTH", "1024"))  # the kill -9 test grows the state until a save outlasts the kill
def die_if_asked(point):  # the kill -9 test: SIGKILL at this point, from inside (no scheduling delay)
    if os.environ.get("KILL_AT") == point:
        import signal; os.kill(os.getpid(), signal.SIGKILL)
def keep_reference(net, optimizer):  # the benchmark's kill trials: what the save about to be made holds, kept natively
    if os.environ.get("REFERENCE"):
        torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, os.environ.pop("REFERENCE"))
def model():
    return torch.nn.Sequential(torch.nn.Linear(8, WIDTH), torch.nn.Linear(WIDTH, 512), torch.nn.Linear(512, 1))
"""

PROGRAMS = {
    "lightning": COMMON + textwrap.dedent("""
        import lightning as L
        from lightning.pytorch.callbacks import Callback, ModelCheckpoint
        from torch.utils.data import DataLoader, TensorDataset
        from asyncckpt.adapters.lightning import AsyncCkptIO
        class Lit(L.LightningModule):
            def __init__(self): super().__init__(); self.net = model()
            def training_step(self, batch, batch_idx):
                x, y = batch; loss = torch.nn.functional.mse_loss(self.net(x), y); self.log("loss", loss); return loss
            def configure_optimizers(self): return torch.optim.Adam(self.parameters())
        class Report(Callback):
            def on_train_start(self, trainer, module):
                print(f"START {trainer.global_step}", flush=True); trainer.should_stop = mode == "resume"
        class Saved(ModelCheckpoint):
            def _save_checkpoint(self, trainer, filepath):
                if os.path.basename(filepath) == "last.ckpt": keep_reference(trainer.lightning_module, trainer.optimizers[0])
                super()._save_checkpoint(trainer, filepath); print(f"SAVED {os.path.basename(filepath)}", flush=True)
                if os.path.basename(filepath) == "last.ckpt": die_if_asked("saved")
        x = torch.randn(1024, 8)
        trainer = L.Trainer(max_steps=100000, accelerator="cpu", logger=False,
                            enable_progress_bar=False, enable_model_summary=False, plugins=[AsyncCkptIO()],
                            callbacks=[Report(), Saved(dirpath=root, every_n_train_steps=1, save_top_k=-1,
                                                       filename="{step}", save_last=True)])
        trainer.fit(Lit(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2),
                    ckpt_path="last" if mode == "resume" else None)
    """),
    "accelerate": COMMON + textwrap.dedent("""
        from accelerate import Accelerator
        from accelerate.utils import ProjectConfiguration
        from asyncckpt.adapters.accelerate import enable_async_checkpointing
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True))
        enable_async_checkpointing(acc)
        net = model(); opt = torch.optim.Adam(net.parameters())
        net, opt = acc.prepare(net, opt)
        if mode == "resume":
            acc.load_state()
            print(f"START {acc.project_configuration.iteration}", flush=True)
        for i in range(100000 if mode == "run" else 1):
            net(torch.randn(2, 8)).square().mean().backward(); opt.step(); opt.zero_grad()
            if i == 0: keep_reference(net, opt)
            if i == 1: die_if_asked("next step")  # the first save's optimizer snapshot is complete
            print(f"SAVED {os.path.basename(acc.save_state())}", flush=True)
            if i == 0: die_if_asked("saved")  # the kill trials: at once (no optimizer state is snapshot later)
        acc.end_training()
    """),
    "hf_trainer": COMMON + textwrap.dedent("""
        from torch.utils.data import Dataset
        from transformers import Trainer, TrainerCallback, TrainingArguments
        from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback
        class Toy(Dataset):
            def __len__(self): return 100000
            def __getitem__(self, i):
                x = torch.randn(8, generator=torch.Generator().manual_seed(i)); return {"x": x, "labels": x.sum(0, keepdim=True)}
        class Net(torch.nn.Module):
            def __init__(self): super().__init__(); self.body = model()
            def forward(self, x, labels=None):
                out = self.body(x); return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}
        class Report(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                print(f"START {state.global_step}", flush=True); control.should_training_stop = mode == "resume"
            def on_save(self, args, state, control, **kwargs): print(f"SAVED checkpoint-{state.global_step}", flush=True)
            def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
                if state.global_step == 1: keep_reference(model, optimizer)  # checkpoint-1 is saved after this
                if state.global_step == 2: die_if_asked("next step")  # after step 2's optimizer step
        args = TrainingArguments(output_dir=root, per_device_train_batch_size=2, max_steps=100000,
                                 save_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no")
        trainer = Trainer(model=Net(), args=args, train_dataset=Toy(), callbacks=[AsyncCheckpointCallback(), Report()])
        trainer.train(resume_from_checkpoint=mode == "resume")
    """),
}
NATIVE_EXIT = {"lightning": 1, "accelerate": -signal.SIGINT, "hf_trainer": -signal.SIGINT}  # Lightning: sys.exit(1)


def _checkpoint(adapter: str, root: Path, name: str) -> Path:
    return root / "checkpoints" / name if adapter == "accelerate" else root / name


def _complete(adapter: str, path: Path) -> bool:
    if adapter == "lightning":
        import torch

        return path.is_file() and "state_dict" in torch.load(path, weights_only=False)
    return is_complete(str(path))


@pytest.mark.parametrize("adapter", ["lightning", "accelerate", "hf_trainer"])
def test_ctrl_c_keeps_every_save_that_returned_and_resume_continues(tmp_path, adapter):
    pytest.importorskip({"hf_trainer": "transformers"}.get(adapter, adapter))
    script, root = tmp_path / "train.py", tmp_path / "run"
    script.write_text(PROGRAMS[adapter])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    with Zygote(["torch", *IMPORTS[adapter]], env, tmp_path) as zygote:
        run = zygote.run(script, "run", root, new_session=True)  # its own process group
        saved = []
        try:
            while len(saved) < 3 and (line := run.read_line(timeout=300)) is not None:
                if line.startswith("SAVED "):
                    saved.append(line.split()[1])
            time.sleep(random.Random(adapter).uniform(0.0, 0.4))
            os.killpg(run.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
            out, deadline = [], time.monotonic() + 120  # a run the interrupt did not stop must not save on and on
            while time.monotonic() < deadline and (line := run.read_line(timeout=120)) is not None:
                out.append(line)
        finally:
            if run.returncode is None:
                run.kill()  # its process group
                run.wait()
        err = run.stderr()
        saved += [line.split()[1] for line in out if line.startswith("SAVED ")]
        assert run.returncode == NATIVE_EXIT[adapter], err[-3000:]
        assert "KeyboardInterrupt" in err or adapter == "lightning"
        # No failed save (every message of ours starts "asyncckpt: ", a writer's failure included: the training
        # process reports it; the one advice line aside: this toy run saves far more often than it need) and no
        # traceback of a writer (it runs as ``python -m``: runpy would be in its frames).
        ours = [line for line in err.splitlines() if "asyncckpt: " in line and "loses the least work" not in line]
        assert not ours and "runpy" not in err, err[-3000:]
        for name in saved:  # every save that returned before the interrupt is committed
            assert _complete(adapter, _checkpoint(adapter, root, name)), (name, saved)
        parents = [root, root / "checkpoints"]  # where staging directories and temporary files are
        assert not [e for p in parents if p.is_dir() for e in os.listdir(p) if names.parse_hidden(e)]

        resumed = zygote.run(script, "resume", root)
        out = resumed.remaining_lines(timeout=180)
    assert resumed.returncode == 0, resumed.stderr()[-3000:]
    start = int(next(line.split()[1] for line in out if line.startswith("START ")))
    assert start > 0  # not from scratch


@pytest.mark.parametrize("adapter", ["lightning", "accelerate", "hf_trainer"])
def test_kill_9_after_a_save_returned_keeps_it_and_resume_continues_from_it(tmp_path, adapter):
    """SIGKILL to the training process right after a save call returned (Lightning), or once the
    next step began (Accelerate, the Trainer: their optimizer state is snapshot while the next
    forward and backward run, and the guarantee starts when that is complete): the background
    writer finishes and commits that save, no writer remains, and the next run resumes from it."""
    pytest.importorskip({"hf_trainer": "transformers"}.get(adapter, adapter))
    script, root = tmp_path / "train.py", tmp_path / "run"
    script.write_text(PROGRAMS[adapter])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "WIDTH": "65536",  # ~0.4 GiB saves
           "KILL_AT": "saved" if adapter == "lightning" else "next step"}
    proc = Program([sys.executable, str(script), "run", str(root)], tmp_path / "logs", env=env, start_new_session=True)
    try:
        proc.wait(300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    kept = _checkpoint(adapter, root, "last.ckpt" if adapter == "lightning" else "checkpoint_0" if adapter == "accelerate"
                       else "checkpoint-1")  # the save that returned before the kill (Lightning resumes from last.ckpt)
    print(f"{adapter}: {kept.name} visible when the trainer died: {_complete(adapter, kept)}")
    saved = [line.split()[1] for line in proc.lines() if line.startswith("SAVED ")]
    assert kept.name in saved, (saved, proc.error_output()[-3000:])
    wait_until_gone(proc.pid, timeout=120, what="the orphaned writer still runs")
    assert _complete(adapter, kept), f"{kept.name} was handed over before the kill and is not committed"

    env.pop("KILL_AT")
    resumed = subprocess.run([sys.executable, str(script), "resume", str(root)], capture_output=True, text=True,
                             env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start = int(next(line.split()[1] for line in resumed.stdout.splitlines() if line.startswith("START ")))
    step_of = {"lightning": lambda name: int(name.split("=")[1].split(".")[0]),
               "accelerate": lambda name: int(name.split("_")[1]) + 1,  # checkpoint_i is saved after step i+1
               "hf_trainer": lambda name: int(name.split("-")[1])}[adapter]
    assert start >= step_of(saved[0]), (start, saved)
