#!/usr/bin/env python
"""Load speed of ``core.load`` against this machine's cached-read limit and ``dcp.load``, in one process.

    .venv/bin/python benchmarks/load_bench.py [--workloads large,adam] [--size-mib 1024] [--reps 7] [--profile]

For each workload (section 2 of core_bench.py: (a) ``large``, 16 fp32 tensors; (b) ``adam``, ~8,020 tensors
of params + Adam state + objects) it saves one checkpoint with ``core.save``, warms the page cache, and then
times, rep after rep in rotation (so machine noise hits every row alike):

- ``cached read``: the checkpoint's data files read from the page cache into one held buffer, 32 MiB per
  ``preadv`` (what ``core_bench.py``'s limits section measures): the limit a load is compared with;
- ``core.load`` with checksums verified, and without;
- stock ``dcp.load`` (torch's ``FileSystemReader``) of the same checkpoint.

Every load goes into one preallocated, pre-faulted state dict (held memory, as in a resume) and is checked
against the saved values. Prints medians (min-max) and ratios measured in this run. ``--profile`` adds a
cProfile of one verified ``core.load`` per workload.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import mmap
import os
import pstats
import shutil
import statistics
import sys
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import make_adam, make_large, non_tensors_equal, same_state, state_bytes, zeros_like_state  # noqa: E402

READ_CHUNK = 32 << 20


class HeldBuffer:
    """Anonymous memory, pre-faulted once and reused by every cached-read rep."""

    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, max(nbytes, 1))
        self.view = memoryview(self.map)
        torch.frombuffer(self.map, dtype=torch.uint8).fill_(1)


def data_files(path: str) -> list[str]:
    return sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp"))


def cached_read(files: list[str], buffer: HeldBuffer) -> None:
    """Sequential reads of every data file from the page cache into the held buffer."""
    cursor = 0
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            for offset in range(0, size, READ_CHUNK):
                n = min(READ_CHUNK, size - offset)
                os.preadv(fd, [buffer.view[cursor + offset:cursor + offset + n]], offset)
        finally:
            os.close(fd)
        cursor += size


def timed(call) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def reset(target, saved) -> None:
    """Zero every tensor and scramble the objects, so a load has to restore all of it."""
    for value in target.values():
        if isinstance(value, dict):
            reset(value, None)
        elif isinstance(value, torch.Tensor):
            value.zero_()
    if saved is not None and "optim" in target:
        target["optim"]["param_groups"] = zeros_like_state(saved["optim"]["param_groups"])


def bench(name: str, state: dict, root: str, reps: int, profile: bool) -> None:
    from asyncckpt import core

    path = os.path.join(root, name)
    shutil.rmtree(path, ignore_errors=True)
    core.save(state, path)
    files = data_files(path)
    file_bytes = sum(os.path.getsize(f) for f in files)
    nbytes = state_bytes(state)
    buffer = HeldBuffer(file_bytes)
    target = zeros_like_state(state)
    checkpointer = core.Checkpointer()

    rows = {
        "cached read (page cache -> held buffer)": lambda: cached_read(files, buffer),
        "core.load verify on": lambda: checkpointer.load(target, path),
        "core.load verify off": lambda: checkpointer.load(target, path, verify=False),
        "dcp.load (FileSystemReader), same checkpoint": lambda: dcp.load(target, checkpoint_id=path, no_dist=True),
    }
    times: dict[str, list[float]] = {row: [] for row in rows}
    for row, call in rows.items():  # warm-up: page cache, imports, first-call costs
        reset(target, state)
        call()
        if row.startswith(("core", "dcp")) and not (same_state(target, state) and non_tensors_equal(target, state)):
            raise AssertionError(f"{name}: {row} loaded values that differ from the saved state")
    for _ in range(reps):
        for row, call in rows.items():
            reset(target, state)
            times[row].append(timed(call))
            if row.startswith("core") and not same_state(target, state):
                raise AssertionError(f"{name}: {row} loaded values that differ from the saved state")
    tensors = sum(1 for _ in _tensors(state))
    print(f"\n## {name}: {nbytes / 2**30:.3f} GiB in {tensors} tensors; data files {file_bytes / 2**30:.3f} GiB; "
          f"{reps} reps, medians (min-max)")
    limit_gbps = file_bytes / statistics.median(times["cached read (page cache -> held buffer)"]) / 1e9
    ours = statistics.median(times["core.load verify on"])
    print(f"cached read limit: {limit_gbps:.2f} GB/s (data file bytes, framing included, per second)")
    print("| what | median s (min-max) | GB/s of tensor data | x cached read GB/s | / core.load verify on |")
    print("|---|---|---|---|---|")
    for row, values in times.items():
        m = statistics.median(values)
        gbps = (file_bytes if row.startswith("cached") else nbytes) / m / 1e9
        print(f"| {row} | {m:.4f} ({min(values):.4f}-{max(values):.4f}) | {gbps:.2f} | "
              f"{gbps / limit_gbps:.2f} | {m / ours:.2f} |")
    if profile:
        prof = cProfile.Profile()
        reset(target, state)
        prof.enable()
        checkpointer.load(target, path)
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("cumulative").print_stats(30)
        stats.sort_stats("tottime").print_stats(25)
        print(out.getvalue())
    checkpointer.close()
    shutil.rmtree(path, ignore_errors=True)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="large,adam")
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--n-small", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dir", default="/work/bench-tmp/load_bench")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    os.makedirs(args.dir, exist_ok=True)
    from asyncckpt import core

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}; "
          f"asyncckpt.core from {os.path.dirname(core.__file__)}")
    makers = {"large": lambda: make_large(args.size_mib << 20), "adam": lambda: make_adam(args.size_mib << 20, args.n_small)}
    for name in args.workloads.split(","):
        bench(name, makers[name](), args.dir, args.reps, args.profile)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
