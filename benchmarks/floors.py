#!/usr/bin/env python
"""Where workload (b)'s stall and load sit against what torch and Python themselves allow here.

    .venv/bin/python benchmarks/floors.py [--size-mib 1024] [--reps 9] [--json F] [--markdown F]

Core I judges a load against one sequential read from the page cache, and Core II the async stall
against one contiguous memcpy of the same bytes. With ~8,000 tensors (core_bench's workload (b)),
part of each is the cost of touching 8,000 separate tensors at all. This script splits the two
figures into their parts, timed rep after rep in rotation in one process (this machine's copy speed
differs between processes and drifts within minutes, so floors measured elsewhere mislead):

stall
  memcpy            one ``dst.copy_(src)`` of the same bytes (core_bench's paired memcpy)
  copy engine       our snapshot copy alone: ``start_copy`` of the tensors into the warm staging
                    buffer on its two lanes, with nothing else (no flatten, structure check, pickling)
  foreach copy      one ``torch._foreach_copy_`` of every tensor into its slot, from one thread
  async_save        the whole call on a warm Checkpointer (its write is awaited outside the timing)
load
  cached read       the checkpoint's data files read from the page cache into one held buffer
  reads             the planned reads alone, checksums verified (a plan made beforehand)
  planning          the planning alone: sidecars parsed, the state dict's keys matched and checked
  core.load         the whole call, checksums verified
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import PairedMemcpy, git_meta, make_adam, n_tensors, same_state, state_bytes, zeros_like_state  # noqa: E402
from load_bench import HeldBuffer, cached_read, data_files, reset, timed  # noqa: E402

from asyncckpt import core  # noqa: E402
from asyncckpt.core.storage import commit  # noqa: E402
from asyncckpt.core.loading.direct_load import paused_gc, plan_direct_load  # noqa: E402
from asyncckpt.core.snapshot.shared_buffer import start_copy  # noqa: E402


def stall_rows(checkpointer: core.Checkpointer, state: dict, directory: str) -> tuple[dict, Callable]:
    """The stall's parts, on a checkpointer that already saved ``state`` (plan cached, buffer held)."""
    buffer, sources = checkpointer.sharded.last_copy(state)
    views = buffer.unique_views
    memcpy = PairedMemcpy(state_bytes(state))
    pending: list = []

    def async_save() -> None:
        pending.append(checkpointer.async_save(state, os.path.join(directory, "stall")))

    def settle() -> None:  # between reps, outside the timing: the write of the last async_save
        while pending:
            pending.pop().result()

    def foreach_copy() -> None:
        with torch.no_grad():
            torch._foreach_copy_(views, sources)

    return {
        "memcpy": memcpy,
        "copy engine": lambda: start_copy(buffer, sources, checkpointer.copy_threads).wait(),
        "foreach copy": foreach_copy,
        "async_save": async_save,
    }, settle


def load_rows(checkpointer: core.Checkpointer, state: dict, path: str) -> tuple[dict, Callable, dict]:
    target = zeros_like_state(state)
    record = commit.require_complete(path)
    buffer = HeldBuffer(sum(os.path.getsize(f) for f in data_files(path)))
    planned: list = []

    def plan() -> None:
        with paused_gc():
            planned.append(plan_direct_load(target, path, record, strict=True, verify=True))

    def reads() -> None:
        with paused_gc():
            planned.pop().run(checkpointer.io_threads)

    def prepare(row: str) -> None:  # outside the timing
        reset(target, state)
        if row == "reads":
            plan()

    rows = {
        "cached read": lambda: cached_read(data_files(path), buffer),
        "reads": reads,
        "planning": lambda: (plan(), planned.clear()),
        "core.load": lambda: checkpointer.load(target, path),
    }
    return rows, prepare, target


def rotate(rows: dict, reps: int, before: Callable[[str], None]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {row: [] for row in rows}
    for rep in range(reps + 1):  # rep 0 warms everything up and is dropped
        for row, call in rows.items():
            before(row)
            seconds = timed(call)
            if rep:
                times[row].append(seconds)
    return times


def summary(times: dict[str, list[float]], reference: str) -> dict:
    ref = statistics.median(times[reference])
    return {row: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v),
                  "x_reference": statistics.median(v) / ref} for row, v in times.items()}


def render(result: dict) -> str:
    """The markdown report: both tables, and what the goals leave once the floors are paid."""
    stall, load = result["stall"], result["load"]
    lines = [
        "# Floors of workload (b): what torch and Python themselves cost",
        "",
        f"`python benchmarks/floors.py` ({result['date']}, asyncckpt {result['revision']}, torch {result['torch']}, "
        f"{result['threads']} threads). {result['bytes'] / 2**30:.3f} GiB in {result['tensors']} tensors (core_bench's "
        f"workload (b)); {result['reps']} reps of every row in rotation in one process, medians (min-max); `x` = the "
        "row's median / the first row's. The rows are described in the script's docstring.",
        "",
    ]
    for section in ("stall", "load"):
        lines += [f"| {section} | median ms (min-max) | x |", "|---|---|---|"]
        for row, r in result[section].items():
            lines.append(f"| {row} | {1e3 * r['median_s']:.1f} ({1e3 * r['min_s']:.1f}-{1e3 * r['max_s']:.1f}) "
                         f"| {r['x_reference']:.2f} |")
        lines.append("")
    memcpy, engine, whole = (stall[row]["median_s"] for row in ("memcpy", "copy engine", "async_save"))
    read, reads, planning, loaded = (load[row]["median_s"] for row in ("cached read", "reads", "planning", "core.load"))
    lines += [
        f"- **Stall.** The goal (<= 1.2x the memcpy) allows {1e3 * 1.2 * memcpy:.1f} ms. Copying the tensors alone "
        f"takes {1e3 * engine:.1f} ms ({engine / memcpy:.2f}x); everything else the call does for 8k tensors in Python "
        f"(flatten, structure check, sources, hand-off) adds {1e3 * (whole - engine):.1f} ms, against "
        f"{1e3 * max(0.0, 1.2 * memcpy - engine):.1f} ms left by the goal.",
        f"- **Load.** The goal (>= 0.8x the cached read's bandwidth, i.e. <= 1.25x its time) allows "
        f"{1e3 * 1.25 * read:.1f} ms. The verified reads alone take {1e3 * reads:.1f} ms ({reads / read:.2f}x); "
        f"matching 8k keys to the sidecars takes {1e3 * planning:.1f} ms, against "
        f"{1e3 * max(0.0, 1.25 * read - reads):.1f} ms left by the goal; the whole load {1e3 * loaded:.1f} ms "
        f"({loaded / read:.2f}x).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="floors_", dir=args.dir)
    try:
        state = make_adam(args.size_mib << 20)
        with core.Checkpointer() as checkpointer:
            path = os.path.join(root, "load")
            checkpointer.save(state, path)
            stall, settle = stall_rows(checkpointer, state, root)
            stall_times = rotate(stall, args.reps, lambda row: settle())
            settle()
            rows, prepare, target = load_rows(checkpointer, state, path)
            load_times = rotate(rows, args.reps, prepare)
            if not same_state(target, state):
                raise AssertionError("core.load loaded values that differ from the saved state")
        meta = git_meta()
        result = {"bytes": state_bytes(state), "tensors": n_tensors(state), "reps": args.reps,
                  "revision": meta["git_commit"][:7] + ("+" if meta["core_dirty"] else ""),
                  "date": time.strftime("%Y-%m-%d %H:%M"),
                  "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "stall": summary(stall_times, "memcpy"), "load": summary(load_times, "cached read")}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(render(result))

if __name__ == "__main__":
    main()
