# python accelerate_min.py 2 && python accelerate_min.py 4   (2nd run resumes from newest accrun/checkpoints/checkpoint_N)
import os, sys, torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset
from asyncckpt.adapters.accelerate import enable_async_checkpointing   # <- the only added import

set_seed(0)
acc = Accelerator(project_config=ProjectConfiguration(project_dir="accrun", automatic_checkpoint_naming=True, total_limit=2))
enable_async_checkpointing(acc)                                # <- the only added line (registers the hooks)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20)
x = torch.randn(256, 8); dl = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16, shuffle=True)
model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
start_epoch = 0
ckdir = os.path.join("accrun", "checkpoints")
if os.path.isdir(ckdir) and os.listdir(ckdir):
    acc.load_state()                                              # picks the highest checkpoint_N
    start_epoch = max(int(d.rsplit("_", 1)[1]) for d in os.listdir(ckdir)) + 1
    acc.project_configuration.iteration = start_epoch             # natively needed (accelerate #3306); the adapter does it too
for epoch in range(start_epoch, int(sys.argv[1]) if len(sys.argv) > 1 else 4):
    for xb, yb in dl:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        acc.backward(loss); opt.step(); sched.step(); opt.zero_grad()
    acc.save_state()                                              # -> accrun/checkpoints/checkpoint_<iteration>
    acc.print(f"epoch {epoch} loss {loss.item():.4f}")
acc.end_training()
