# python hf_trainer_min.py 2 && python hf_trainer_min.py 4   (2nd run resumes from newest hfrun/checkpoint-N)
import os, sys, torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint
from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback   # <- the only added import

class Toy(Dataset):
    def __init__(self, n=256):
        g = torch.Generator().manual_seed(0); self.x = torch.randn(n, 8, generator=g); self.y = self.x.sum(1, keepdim=True)
    def __len__(self): return len(self.x)
    def __getitem__(self, i): return {"x": self.x[i], "labels": self.y[i]}

class Net(torch.nn.Module):                       # plain nn.Module: Trainer saves it as model.safetensors
    def __init__(self):
        super().__init__(); self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    def forward(self, x, labels=None):
        out = self.body(x); return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

if __name__ == "__main__":
    torch.manual_seed(0)
    args = TrainingArguments(output_dir="hfrun", per_device_train_batch_size=16, num_train_epochs=int(sys.argv[1]) if len(sys.argv) > 1 else 4, learning_rate=1e-2,
                             save_strategy="steps", save_steps=10, save_total_limit=2, logging_steps=10,
                             report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=Net(), args=args, train_dataset=Toy(),
                      callbacks=[AsyncCheckpointCallback()],    # <- the only added argument
                      )
    resume = os.path.isdir(args.output_dir) and get_last_checkpoint(args.output_dir) is not None
    trainer.train(resume_from_checkpoint=resume)
