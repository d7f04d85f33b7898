"""Helper program for test_crash.py: saves forever until killed.

Every tensor of checkpoint k holds the value k, so a loaded checkpoint is consistent exactly when
all its tensors hold the same value as its recorded step.
Usage: crash_writer.py ROOT MODE   (MODE: "steps" -> ROOT/step_k, "same" -> ROOT/ckpt every time)
"""
import os
import sys

import torch

from asyncckpt import core

root, mode = sys.argv[1], sys.argv[2]
state = {f"layer{i}.weight": torch.zeros(4 << 20) for i in range(12)}  # 192 MiB
state["step"] = 0
checkpointer = core.Checkpointer(max_in_flight=1)  # "submitted k": step k-1 is committed, step k being written
for step in range(1, 10**6):
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            tensor.fill_(float(step))
    state["step"] = step
    path = os.path.join(root, f"step_{step:06d}" if mode == "steps" else "ckpt")
    checkpointer.async_save(state, path, step=step)
    print(f"submitted {step}", flush=True)
