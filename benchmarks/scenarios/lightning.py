"""Lightning: the stall of ``trainer.save_checkpoint`` and the training slowdown, per checkpoint IO."""
from __future__ import annotations

import os
import shutil
import tempfile

from harness import Option, Scenario, training
from harness.floors import checkpoint_tensors
from harness.util import now

ARMS = ("none", "native", "native_async", "asyncckpt", "raw_write")
NAMES = {"native": "`TorchCheckpointIO` (Lightning's default, synchronous)",
         "native_async": "Lightning `AsyncCheckpointIO` (clone in the caller, `torch.save` on a thread)",
         "asyncckpt": "**`AsyncCkptIO`**", "raw_write": "floor: a raw O_DIRECT write of the same bytes by another process"}


def train(mode: str, steps: int, every: int, width: int, depth: int, batch: int) -> dict:
    """One run in this process: an MLP of ``depth`` x Linear(``width``) + AdamW, ``ModelCheckpoint`` every
    ``every`` steps keeping one file (rotation)."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(os.cpu_count() or 1)
    log = training.StepLog(mode, every, steps)
    workdir = tempfile.mkdtemp(prefix="lightning_bench_")

    class Big(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

    class Clock(Callback):  # Lightning runs ModelCheckpoint's hooks after the others: a save follows ended()
        def on_train_batch_start(self, trainer, *args):
            log.began(trainer.global_step + 1)

        def on_train_batch_end(self, trainer, *args):
            log.ended(trainer.global_step)

    plugins = None
    if mode == "native_async":
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        plugins = [AsyncCheckpointIO()]
    elif mode == "asyncckpt":
        from asyncckpt.adapters.lightning import AsyncCkptIO

        plugins = [AsyncCkptIO()]
    callbacks = [Clock()] + ([] if mode == "none" else [ModelCheckpoint(dirpath=workdir, every_n_train_steps=every,
                                                                        save_top_k=1)])
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=mode != "none", callbacks=callbacks,
                        plugins=plugins, num_sanity_val_steps=0)
    model = Big()
    save_checkpoint = trainer.save_checkpoint
    trainer.save_checkpoint = lambda *a, **k: log.save(trainer.global_step, lambda: save_checkpoint(*a, **k),
                                                       checkpoint_tensors(model, trainer.optimizers[0]), workdir)
    data = torch.randn(batch * steps, width, generator=torch.Generator().manual_seed(0))
    trainer.fit(model, DataLoader(TensorDataset(data), batch_size=batch))
    result = log.result(returned=now())
    shutil.rmtree(workdir, ignore_errors=True)
    return result


def measure(sitting) -> dict:
    o = sitting.o
    return training.measure(sitting, ARMS, {"asyncckpt"}, steps=o.steps, every=o.every, width=o.width,
                            depth=o.depth, batch=o.batch)


SETUP = ("Model: an MLP of {depth} x Linear({width}, {width}) + AdamW: the checkpoint holds **{state_mb:.0f} MB** of "
         "tensors ({tensors} tensors). `ModelCheckpoint(every_n_train_steps={every}, save_top_k=1)` (rotation), "
         "{steps} steps of batch {batch}.")

SCENARIO = Scenario(
    title="Lightning: the save's stall and the training slowdown",
    question="What a Lightning run pays for its checkpoints with `AsyncCkptIO`, against Lightning's own checkpoint IO "
             "(synchronous and asynchronous), a run without checkpoints, and the floor: another process writing the same "
             "bytes durably (no snapshot, no checksums).",
    measure=measure,
    render=lambda result: training.render(result, NAMES, SETUP),
    plot=training.plot,
    options={"steps": Option(60, 18), "every": Option(10, 6), "width": Option(2048, 256), "depth": Option(10, 2),
             "batch": Option(32, 4)},
    reps=(2, 1),
    revisioned=True,
)
