# python examples/accelerate_large.py [--layers 10 --hidden 2048 --saves 3 --dir DIR]
# A model with >= 500 MB of checkpoint state (42 M parameters + AdamW = 504 MB): the time save_state()
# blocks training, Accelerate's own vs after enable_async_checkpointing(accelerator), next to a memcpy of
# the same tensors into held memory (the floor for any snapshot).
import argparse
import shutil
import tempfile
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from asyncckpt.adapters.accelerate import enable_async_checkpointing

parser = argparse.ArgumentParser()
parser.add_argument("--layers", type=int, default=10)
parser.add_argument("--hidden", type=int, default=2048)
parser.add_argument("--saves", type=int, default=3)
parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed)")
args = parser.parse_args()

set_seed(0)
acc = Accelerator(cpu=True)
model = torch.nn.Sequential(*[torch.nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
model, opt = acc.prepare(model, opt)
root = args.dir or tempfile.mkdtemp(prefix="accelerate_large_")


def train_step():
    loss = model(torch.randn(16, args.hidden)).square().mean()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()


train_step()  # creates the AdamW state
tensors = list(acc.unwrap_model(model).state_dict().values()) + [v for s in opt.optimizer.state.values() for v in s.values()]
nbytes = sum(t.numel() * t.element_size() for t in tensors)
held = torch.empty(nbytes, dtype=torch.uint8)
held.zero_()


def memcpy() -> float:
    t0, offset = time.perf_counter(), 0
    for t in tensors:
        n = t.numel() * t.element_size()
        held[offset:offset + n].copy_(t.reshape(-1).view(torch.uint8))
        offset += n
    return time.perf_counter() - t0


def timed_saves(label: str) -> list:
    stalls = []
    for i in range(args.saves):
        train_step()
        copy = memcpy()
        t0 = time.perf_counter()
        acc.save_state(f"{root}/{label}/step_{i}")
        stalls.append((time.perf_counter() - t0, copy))
        time.sleep(1.0)  # "training" between saves: the background write overlaps it
    return stalls


print(f"checkpoint state: {nbytes / 1e6:.0f} MB of tensors; {args.saves} saves each")
native = timed_saves("native")
handle = enable_async_checkpointing(acc)  # <- the one added line
ours = timed_saves("async")
t0 = time.perf_counter()
handle.wait()
drain = time.perf_counter() - t0
for label, stalls in (("native save_state()", native), ("asyncckpt save_state()", ours)):
    print(f"{label:24s} stall " + ", ".join(f"{s:.3f}s ({s / c:.1f}x memcpy {c:.3f}s)" for s, c in stalls))
print(f"last async save durable {drain:.2f}s after the final sleep; first async save includes allocating the "
      "snapshot buffers (once)")
acc.end_training()
if args.dir is None:
    shutil.rmtree(root, ignore_errors=True)
