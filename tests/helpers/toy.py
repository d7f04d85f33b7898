"""The toy data and models the tests train, in one place: in-process tests import them, and so do the training
programs (``programs/*.py``).

The task: inputs ``x`` of 8 values drawn from a seeded generator, the target their sum; a few optimizer steps learn
it. Sizes vary with what a test needs (a save that outlasts a kill wants a large state), the pieces do not.
"""
from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

# The first line of a program written from a test's text that imports this module (``from toy import ...``).
ON_PATH = f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\n"


def inputs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` inputs of 8 values from a generator seeded with ``seed``, and their sums (``n`` x 1)."""
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return x, x.sum(1, keepdim=True)


def data(n: int = 64, batch_size: int = 8, seed: int = 1) -> DataLoader:
    """The inputs as a loader of ``(x, y)`` batches, in order."""
    return DataLoader(TensorDataset(*inputs(n, seed)), batch_size=batch_size, shuffle=False)


def body(*widths: int, relu: bool = False) -> torch.nn.Sequential:
    """``Linear(8, widths[0])``, ..., ``Linear(widths[-1], 1)``, with a ReLU between layers where ``relu``."""
    sizes = [8, *widths, 1]
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        if relu and i:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(a, b))
    return torch.nn.Sequential(*layers)


class Toy(Dataset):
    """The Transformers Trainer's form of the data: ``{"x", "labels"}`` items."""

    def __init__(self, n: int = 256, seed: int = 0):
        self.x, self.y = inputs(n, seed)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


class Endless(Dataset):
    """More items than a run killed (or interrupted) before its end uses: item ``i`` drawn with seed ``i``."""

    def __len__(self):
        return 100000

    def __getitem__(self, i):
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        return {"x": x, "labels": x.sum(0, keepdim=True)}


class Net(torch.nn.Module):
    """A model as the Trainer takes it: the loss and the logits from ``(x, labels)``; ``body(16, relu=True)`` unless
    given another."""

    def __init__(self, net: torch.nn.Module | None = None):
        super().__init__()
        self.body = net if net is not None else body(16, relu=True)

    def forward(self, x, labels=None):
        out = self.body(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


try:  # the Lightning pieces, where Lightning is installed
    import lightning as L
except ImportError:
    L = None
if L is not None:
    QUIET = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)

    class TinyModule(L.LightningModule):
        """Linear regression plus a 1 MiB buffer, so that writes take long enough to still be pending
        at the next checkpoint (test_lightning.py's ordering cases check that they were)."""

        def __init__(self, lr: float = 0.05, ballast: int = 1 << 18):
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(8, 1)
            self.register_buffer("ballast", torch.randn(ballast))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_loss", torch.nn.functional.mse_loss(self.net(x), y))

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=5)}
