# python lightning_min.py 2 && python lightning_min.py 4   (2nd run resumes from ckpts/last.ckpt)
import sys, torch, lightning as L
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch.callbacks import ModelCheckpoint
from asyncckpt.adapters.lightning import AsyncCkptIO   # <- the only added import

class LitReg(L.LightningModule):
    def __init__(self, lr: float = 0.05):
        super().__init__(); self.save_hyperparameters(); self.net = torch.nn.Linear(8, 1)
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y); self.log("train_loss", loss); return loss
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=20)}

if __name__ == "__main__":
    L.seed_everything(0)
    x = torch.randn(256, 8); ds = TensorDataset(x, x.sum(1, keepdim=True))
    ckpt = ModelCheckpoint(dirpath="ckpts", every_n_train_steps=10, save_top_k=2, monitor="train_loss", save_last=True)
    trainer = L.Trainer(max_epochs=int(sys.argv[1]) if len(sys.argv) > 1 else 4, accelerator="cpu", callbacks=[ckpt], logger=False,
                        enable_progress_bar=False,
                        plugins=[AsyncCkptIO()],                  # <- the only added argument
                        )
    trainer.fit(LitReg(), DataLoader(ds, batch_size=16, shuffle=True), ckpt_path="last")
    print("done at global_step", trainer.global_step, "best:", ckpt.best_model_path)
