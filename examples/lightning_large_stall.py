# python examples/lightning_large_stall.py            (about 1-2 minutes on 2 CPU cores)
#
# The stall a checkpoint puts on training, on a model whose checkpoint holds 504 MB of tensors
# (10 x Linear(2048, 2048) + AdamW: weights and both Adam moments). The same training runs twice,
# saving every 10 steps with ModelCheckpoint: once with Lightning's default TorchCheckpointIO, once
# with AsyncCkptIO. The only difference between the two runs is `plugins=[AsyncCkptIO()]`.
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from asyncckpt.adapters.lightning import AsyncCkptIO


class Big(L.LightningModule):
    def __init__(self, width: int = 2048, depth: int = 10):
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-5)


def run(name: str, plugins, steps: int, dirpath: str) -> list[float]:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, plugins=plugins,
                        callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=10, save_top_k=1)])
    stalls, save = [], trainer.save_checkpoint

    def timed(*args, **kwargs):  # what the training loop waits for at each checkpoint
        start = time.perf_counter()
        save(*args, **kwargs)
        stalls.append(time.perf_counter() - start)

    trainer.save_checkpoint = timed
    data = DataLoader(TensorDataset(torch.randn(32 * steps, 2048)), batch_size=32)
    start = time.perf_counter()
    trainer.fit(Big(), data)
    print(f"{name:>32}: per-save stall {', '.join('%.2f' % s for s in stalls)} s; "
          f"fit {time.perf_counter() - start:.1f} s")
    return stalls


if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    state = sum(p.numel() for p in Big().parameters()) * 4 * 3  # weights + exp_avg + exp_avg_sq
    print(f"checkpoint: {state / 1e6:.0f} MB of tensors, a save every 10 steps, {steps} steps")
    sync = run("TorchCheckpointIO (default)", None, steps, "ckpts_large_sync")
    # the first AsyncCkptIO save also allocates its reused snapshot buffer and starts the writer process
    fast = run("AsyncCkptIO", [AsyncCkptIO()], steps, "ckpts_large_async")
    steady = fast[1:] or fast
    print(f"median stall after the first save: {sorted(sync[1:] or sync)[len(sync[1:] or sync) // 2]:.2f} s -> "
          f"{sorted(steady)[len(steady) // 2]:.2f} s")
