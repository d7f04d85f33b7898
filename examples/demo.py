"""The demo: what asyncckpt does, on your machine, with the torch you have (CPU or CUDA), in a temporary directory.

    bash .ci/demo            # or: python examples/demo.py [DIR] [--mib N]

1. What training waits for: a model and its optimizer state (on the GPU if there is one) saved with
   ``torch.save``, then with ``core.async_save``, which returns after a copy into host memory.
2. A save survives the process: a child process saves, then kills itself (SIGKILL) the moment the save returns;
   its background writer still commits the checkpoint, which then loads equal to what was saved.
3. Two ranks save one sharded checkpoint and load it back with another sharding (DCP's resharding).
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from asyncckpt import core


def say(*parts: object) -> None:
    print("[demo]", *parts, flush=True)


def training_state(mib: int, device: str) -> dict:
    """A model of ``mib`` MiB (fp32) and an Adam-like optimizer state twice its size, as a framework saves them."""
    torch.manual_seed(0)
    rows = max(1, mib * (1 << 20) // (4 * 4096 * 8))
    model = {f"layer{i}.weight": torch.randn(rows, 4096, device=device) for i in range(8)}
    optim = {name: {"exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.ones_like(w)} for name, w in model.items()}
    return {"model": model, "optim": optim, "step": 0}


def part1_what_training_waits_for(root: str, mib: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = training_state(mib, device)
    nbytes = sum(t.numel() * t.element_size() for t in state["model"].values()) * 3
    say(f"1. a {nbytes / 2**30:.2f} GiB training state (model + Adam state) in {device} memory "
        f"({torch.cuda.get_device_name() if device == 'cuda' else 'no GPU'}; torch {torch.__version__})")
    start = time.perf_counter()
    torch.save(state, os.path.join(root, "torch_save.pt"))
    say(f"   torch.save blocks training for {time.perf_counter() - start:.2f} s")
    with core.Checkpointer() as checkpointer:
        for step in (1, 2, 3):
            state["step"] = step
            start = time.perf_counter()
            handle = checkpointer.async_save(state, os.path.join(root, f"step_{step}"), step=step)
            stall = time.perf_counter() - start
            handle.result()  # a training loop would go on instead: here, to time the background write
            durable = time.perf_counter() - start
            first = ("  <- the first save of a process also starts the background writer and allocates "
                     "(and pins) the host buffer") if step == 1 else ""
            say(f"   async_save step {step}: training blocked {stall:.3f} s; committed, fsynced, "
                f"after {durable:.2f} s{first}")


CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    from asyncckpt import core
    state = {"w": torch.arange(1 << 24, dtype=torch.float32), "step": 7}
    core.async_save(state, sys.argv[1], step=7)  # returns after the snapshot
    os.kill(os.getpid(), signal.SIGKILL)          # the process dies at once: kill -9, the OOM killer, a crash
""")


def part2_survives_the_process(root: str) -> None:
    path = os.path.join(root, "killed_at_step_7")
    child = subprocess.run([sys.executable, "-c", CHILD, path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    say(f"2. a process saved 64 MiB and killed itself (SIGKILL) as the save returned: exit status {child.returncode}")
    deadline = time.monotonic() + 60
    while not core.is_complete(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    state = {"w": torch.zeros(1 << 24), "step": None}
    core.load(state, path)
    same = torch.equal(state["w"], torch.arange(1 << 24, dtype=torch.float32)) and state["step"] == 7
    say(f"   its background writer committed the checkpoint anyway; it loads equal to what was saved: {same}")
    if not same:
        raise SystemExit("demo failed: the checkpoint of the killed process differs")


def part3_rank(rank: int, world: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (world,))

    def sharded(placement: Shard) -> dict:
        torch.manual_seed(0)
        return {f"layer{i}.weight": distribute_tensor(torch.randn(1024, 2048), mesh, [placement]) for i in range(4)}

    path = os.path.join(root, "sharded_step_100")
    core.save({"model": sharded(Shard(0)), "step": 100}, path)  # blocking: committed on every rank on return
    loaded = {"model": {k: v.zero_() for k, v in sharded(Shard(1)).items()}, "step": None}
    core.load(loaded, path)  # rows were split across the ranks; now columns are
    reference = sharded(Shard(0))
    same = all(torch.equal(loaded["model"][k].full_tensor(), reference[k].full_tensor()) for k in reference)
    if rank == 0:
        files = ", ".join(sorted(name for name in os.listdir(path) if not name.startswith("."))[:2])
        say(f"3. {world} ranks saved one sharded checkpoint ({files}, ...) and loaded it with another sharding: "
            f"equal: {same}")
    dist.destroy_process_group()
    if not same:
        raise SystemExit("demo failed: the resharded load differs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", nargs="?", help="keep the checkpoints here (default: a temporary directory)")
    parser.add_argument("--mib", type=int, default=256, help="the model's size in MiB (the state is 3x it)")
    args = parser.parse_args()
    root = args.directory or tempfile.mkdtemp(prefix="asyncckpt-demo-")
    os.makedirs(root, exist_ok=True)
    started = time.perf_counter()
    part1_what_training_waits_for(root, args.mib)
    part2_survives_the_process(root)
    mp.spawn(part3_rank, args=(2, 29500 + os.getpid() % 1000, root), nprocs=2)
    say(f"done in {time.perf_counter() - started:.0f} s.", f"Checkpoints kept in {root}: try `asyncckpt ls {root}`"
        if args.directory else "(pass a directory to keep the checkpoints)")
    if not args.directory:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
