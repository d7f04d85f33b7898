#!/usr/bin/env python
"""Where the time of a warm ``core`` save / load goes (cProfile), for the figures core_bench.py reports.

    .venv/bin/python benchmarks/profile_core.py [--workload adam|large] [--size-mib 1024] [--top 25]

Profiles, on a warm Checkpointer (plan cached, staging buffer held):
  1. the caller's part of ``Checkpointer.async_save`` (the stall);
  2. the background writer process, from outside: its CPU seconds per save (``/proc/PID/stat``); for
     its functions, sample it with an external profiler (``py-spy record --pid PID``): it has no
     profiling switch of its own;
  3. ``Checkpointer.load`` with verification on.
Prints wall times and the top functions by cumulative and by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import make_adam, make_large, state_bytes, zeros_like_state  # noqa: E402


def show(title: str, prof, top: int) -> None:
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    print(f"\n===== {title} =====")
    print(out.getvalue())


def writer_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", choices=["adam", "large"], default="adam")
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--n-small", type=int, default=2000)
    ap.add_argument("--dir", default="/work/bench-tmp/profile")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()

    from asyncckpt.core import Checkpointer

    nbytes = args.size_mib << 20
    sd = make_adam(nbytes, args.n_small) if args.workload == "adam" else make_large(nbytes)
    print(f"{args.workload}: {state_bytes(sd) / 2**30:.3f} GiB; asyncckpt.core from {sys.modules['asyncckpt.core'].__file__}")
    os.makedirs(args.dir, exist_ok=True)
    stall_prof, load_prof = cProfile.Profile(), cProfile.Profile()
    ck = Checkpointer()
    ck.async_save(sd, os.path.join(args.dir, "warmup")).result()  # plan, buffer
    writer_pid = ck.ledger.queue.writer_pid
    print(f"writer process: pid {writer_pid}")
    stalls, durable, writer_cpu = [], [], []
    for i in range(args.reps):
        shutil.rmtree(os.path.join(args.dir, f"ck{i - 1}"), ignore_errors=True)
        os.sync()
        cpu_before = writer_cpu_s(writer_pid)
        t0 = time.perf_counter()
        stall_prof.enable()
        handle = ck.async_save(sd, os.path.join(args.dir, f"ck{i}"))
        stall_prof.disable()
        stalls.append(time.perf_counter() - t0)
        handle.result()
        durable.append(time.perf_counter() - t0)
        writer_cpu.append(writer_cpu_s(writer_pid) - cpu_before)
    print(f"caller part (stall) per save: {[round(s, 3) for s in stalls]} s; durable after {[round(s, 3) for s in durable]} s")
    print(f"the writer process's CPU per save: {[round(s, 3) for s in writer_cpu]} s")
    show("caller part of async_save (writer excluded)", stall_prof, args.top)
    target = zeros_like_state(sd)
    path = os.path.join(args.dir, f"ck{args.reps - 1}")
    ck.load(target, path)  # warm page cache
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        load_prof.enable()
        ck.load(target, path)
        load_prof.disable()
        times.append(time.perf_counter() - t0)
    print(f"load (verify on): {[round(t, 3) for t in times]} s")
    show("Checkpointer.load (verify on)", load_prof, args.top)
    ck.close()
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
