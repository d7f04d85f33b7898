"""Lightning's training program (``control.py`` says how to run it): ``ModelCheckpoint`` saves every step through
``AsyncCkptIO``, as ``step=N.ckpt`` and ``last.ckpt``."""
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from asyncckpt.adapters.lightning import AsyncCkptIO
from control import announce, die_if_asked, keep, keep_reference, mode, model, root, steps, toy


class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = model()

    def training_step(self, batch, batch_idx):
        announce(self.global_step)
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())


class Report(Callback):
    def on_train_start(self, trainer, module):
        print(f"START {trainer.global_step}", flush=True)
        trainer.should_stop = mode == "resume"


class Saved(ModelCheckpoint):
    def _save_checkpoint(self, trainer, filepath):
        last = os.path.basename(filepath) == "last.ckpt"
        if last:
            keep_reference(trainer.lightning_module, trainer.optimizers[0])
        super()._save_checkpoint(trainer, filepath)
        print(f"SAVED {os.path.basename(filepath)}", flush=True)
        if last:
            die_if_asked("saved")


trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                    enable_model_summary=False, plugins=[AsyncCkptIO()],
                    callbacks=[Report(), Saved(dirpath=root, every_n_train_steps=1, save_top_k=keep or -1,
                                               monitor="loss", filename="{step}", save_last=True)])
trainer.fit(Lit(), toy.data(4096, batch_size=2, seed=0), ckpt_path="last" if mode == "resume" else None)
