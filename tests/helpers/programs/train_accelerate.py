"""Accelerate's training program (``control.py`` says how to run it): ``save_state`` every step, automatic
checkpoint naming (``checkpoints/checkpoint_<i>``)."""
import os

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

from asyncckpt.adapters.accelerate import enable_async_checkpointing
from control import announce, die_if_asked, keep, keep_reference, mode, model, root, steps

acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True,
                                                                total_limit=keep))
enable_async_checkpointing(acc)
net = model()
opt = torch.optim.Adam(net.parameters())
net, opt = acc.prepare(net, opt)
if mode == "run":  # number on after the checkpoints there, as a resumed run does (Accelerate refuses to overwrite)
    folder = os.path.join(root, "checkpoints")
    named = os.listdir(folder) if os.path.isdir(folder) else []
    acc.project_configuration.iteration = 1 + max((int(n.split("_")[1]) for n in named if n.startswith("checkpoint_")),
                                                  default=-1)
else:
    acc.load_state()
print(f"START {acc.project_configuration.iteration}", flush=True)
for i in range(steps if mode == "run" else 1):
    net(torch.randn(2, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    if i == 0:
        keep_reference(net, opt)
    if i == 1:
        die_if_asked("next step")  # the first save's optimizer snapshot is complete
    print(f"SAVED {os.path.basename(acc.save_state())}", flush=True)
    if i == 0:
        die_if_asked("saved")  # at once (no optimizer state is snapshot later)
    announce(i)
acc.end_training()
