#!/usr/bin/env python
"""Where the time of a warm ``core`` save / load goes (cProfile), for the figures core_bench.py reports.

    .venv/bin/python benchmarks/profile_core.py [--workload adam|large] [--size-mib 1024] [--top 25]

Profiles, on a warm Checkpointer (plan cached, staging buffer held):
  1. the caller's part of ``Checkpointer.async_save`` (the stall);
  2. the background writer's part (``request.run(layout, image)``), run in this process by a
     stand-in for the worker so cProfile sees it (same code the worker runs);
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


class InProcessWorker:
    """Runs each request in the calling thread (under the active profiler) instead of the worker process."""

    alive = True

    def __init__(self, checkpointer, profiler: cProfile.Profile) -> None:
        self.ck, self.profiler, self.seconds, self.pending = checkpointer, profiler, [], []

    def submit(self, jobs) -> None:
        self.pending.extend((job_id, request, buffer) for job_id, request, _buffer_id, buffer in jobs)

    def run_pending(self) -> None:
        """Run the queued requests (after async_save returned), profiled, then complete their handles."""
        while self.pending:
            job_id, request, buffer = self.pending.pop(0)
            image = memoryview(buffer.mmap) if buffer is not None else None
            t0 = time.perf_counter()
            self.profiler.enable()
            try:
                request.run(buffer.layout if buffer is not None else None, image)
            finally:
                self.profiler.disable()
            self.seconds.append(time.perf_counter() - t0)
            self.ck._on_worker_reply("done", job_id, None)

    def drop_buffer(self, buffer_id) -> None:
        pass

    def stop(self, timeout: float = 10.0) -> None:
        pass


def show(title: str, prof: cProfile.Profile, top: int) -> None:
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    print(f"\n===== {title} =====")
    print(out.getvalue())


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
    ck = Checkpointer()
    stall_prof, write_prof, load_prof = cProfile.Profile(), cProfile.Profile(), cProfile.Profile()
    worker = InProcessWorker(ck, write_prof)
    ck._ensure_worker = lambda: worker  # noqa: E731  (profiling stand-in for the writer process)
    handle = ck.async_save(sd, os.path.join(args.dir, "warmup"))  # plan, buffer
    worker.run_pending()
    handle.result()
    worker.seconds.clear()
    write_prof = cProfile.Profile()
    worker.profiler = write_prof
    stalls = []
    for i in range(args.reps):
        shutil.rmtree(os.path.join(args.dir, f"ck{i - 1}"), ignore_errors=True)
        os.sync()
        t0 = time.perf_counter()
        stall_prof.enable()
        handle = ck.async_save(sd, os.path.join(args.dir, f"ck{i}"))
        stall_prof.disable()
        stalls.append(time.perf_counter() - t0)
        worker.run_pending()
        handle.result()
    print(f"caller part (stall) per save: {[round(s, 3) for s in stalls]} s; writer part: {[round(s, 3) for s in worker.seconds]} s")
    show("caller part of async_save (writer excluded)", stall_prof, args.top)
    show("writer part (request.run)", write_prof, args.top)
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
