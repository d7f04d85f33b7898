"""Demo: 2 local ranks save a sharded checkpoint asynchronously, then load it back resharded.

Run with:  bash .ci/demo      (sets up .venv on first use)
"""
from __future__ import annotations

import datetime
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from asyncckpt import core


def model_state(mesh, placement) -> dict:
    """A 256 MiB 'model' sharded across the ranks, an optimizer-like step and a config object."""
    torch.manual_seed(0)
    full = {f"layer{i}.weight": torch.randn(2048, 4096) for i in range(8)}  # 8 x 32 MiB
    return {
        "model": {name: distribute_tensor(t, mesh, [placement]) for name, t in full.items()},
        "step": 1000,
        "config": {"lr": 3e-4, "betas": (0.9, 0.95)},
    }


def run(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world,))
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    state = model_state(mesh, Shard(0))
    nbytes = sum(t.to_local().numel() * 4 for t in state["model"].values())
    say(f"[demo] {world} ranks, each holding {nbytes / 2**20:.0f} MiB of a row-sharded model")

    with core.Checkpointer() as checkpointer:
        for step in (1000, 2000):
            state["step"] = step
            start = time.perf_counter()
            handle = checkpointer.async_save(state, os.path.join(root, f"step_{step:06d}"), step=step)
            stall = time.perf_counter() - start
            for t in state["model"].values():  # training goes on and changes the weights at once
                t.to_local().mul_(0.5)
            handle.result()
            total = time.perf_counter() - start
            first = " (first save: starts the background writer, allocates buffers)" if step == 1000 else ""
            say(f"[demo] step {step}: training blocked {stall * 1e3:.0f} ms (snapshot), "
                f"committed after {total:.2f} s ({2 * nbytes / total / 1e9:.2f} GB/s for both ranks){first}")

        latest = core.latest_checkpoint(root)
        say(f"[demo] latest complete checkpoint: {os.path.basename(latest)}; files: {sorted(os.listdir(latest))}")
        # Load it with a different layout (column-sharded) and check it against the values at save time.
        target = model_state(mesh, Shard(1))
        for t in target["model"].values():
            t.to_local().zero_()
        start = time.perf_counter()
        checkpointer.load(target, latest)
        elapsed = time.perf_counter() - start
        reference = model_state(mesh, Shard(0))
        same = all(torch.equal(target["model"][k].full_tensor(), reference["model"][k].full_tensor() * 0.5)
                   for k in reference["model"])
        say(f"[demo] loaded into a column-sharded model in {elapsed:.2f} s; step={target['step']}; "
            f"values equal to the snapshot: {same}")
        if not same:
            raise SystemExit("demo failed: loaded values differ")
    dist.destroy_process_group()


if __name__ == "__main__":
    keep = len(sys.argv) > 1
    root = sys.argv[1] if keep else tempfile.mkdtemp(prefix="asyncckpt-demo-")
    port = 29500 + os.getpid() % 1000
    mp.spawn(run, args=(2, port, root), nprocs=2)
    if keep:
        print(f"[demo] checkpoints kept in {root}  (try: .venv/bin/asyncckpt ls {root})")
    else:
        shutil.rmtree(root)
        print("[demo] done (pass a directory to keep the checkpoints: bash .ci/demo DIR)")
