"""What stopping the background writer at the end of a run costs the next run, and where it goes.

    .venv/bin/python benchmarks/restart_bench.py [--reps 7] [--size-mib 256]
    # writes benchmarks/results/restart.json and docs/benchmarks_lifecycle.md

Since ``teardown()`` stops the writer process and every thread of ours when a framework's run
ends, the next run starts them again. Measured on a Checkpointer whose staging buffer and plan are
warm (a later ``fit``/``train`` in the same process), in alternating reps:

  start()         the caller's cost of starting the writer (a Popen; the writer's own start-up runs
                  in the background)
  ready           from start() until the writer answered a request (its interpreter start-up)
  teardown        wait + stop the writer, the reader and copy threads
  stall, lazy     the first async_save after a teardown, with no start(): the writer is started
                  inside it (at the hand-over)
  stall, started  the same after start() was called one training step (``--step-s``) earlier, as
                  the adapters do at the framework's run start
  stall, warm     an async_save with the writer running (the reference)
  durable, lazy / started / warm   the same saves, until committed
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import git_meta, make_adam, n_tensors, state_bytes  # noqa: E402

from asyncckpt.core import Checkpointer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--step-s", type=float, default=0.3, help="time between start() and the first save")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "restart.json"))
    parser.add_argument("--markdown", default=str(REPO / "docs" / "benchmarks_lifecycle.md"))
    args = parser.parse_args()

    state = make_adam(args.size_mib << 20, 500)
    root = tempfile.mkdtemp(prefix="restart_bench_", dir=args.dir)
    load_before = os.getloadavg()
    rows: dict[str, list[float]] = {k: [] for k in ("start_s", "ready_s", "teardown_s", "stall_lazy_s", "stall_started_s",
                                                    "stall_warm_s", "durable_lazy_s", "durable_started_s", "durable_warm_s")}
    checkpointer = Checkpointer()
    checkpointer.save(state, os.path.join(root, "warmup"))  # plan and staging buffer: warm from here on
    counter = iter(range(1 << 30))

    def timed_save(kind: str) -> None:
        path = os.path.join(root, f"ck{next(counter)}")
        t0 = time.perf_counter()
        handle = checkpointer.async_save(state, path)
        rows[f"stall_{kind}_s"].append(time.perf_counter() - t0)
        handle.result()
        rows[f"durable_{kind}_s"].append(time.perf_counter() - t0)
        shutil.rmtree(path, ignore_errors=True)

    for _ in range(args.reps):
        timed_save("warm")
        t0 = time.perf_counter()
        checkpointer.teardown()
        rows["teardown_s"].append(time.perf_counter() - t0)
        timed_save("lazy")
        checkpointer.teardown()
        t0 = time.perf_counter()
        checkpointer.start()
        rows["start_s"].append(time.perf_counter() - t0)
        checkpointer.wait()  # an Idle request: answered once the writer has started
        rows["ready_s"].append(time.perf_counter() - t0)
        checkpointer.teardown()
        checkpointer.start()
        time.sleep(args.step_s)  # one training step
        timed_save("started")
    checkpointer.close()
    shutil.rmtree(root, ignore_errors=True)

    medians = {k: statistics.median(v) for k, v in rows.items()}
    result = {"meta": {**git_meta(), "python": platform.python_version(), "torch": torch.__version__,
                       "cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
              "args": vars(args), "state_bytes": state_bytes(state), "reps": rows, "median": medians}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    ms = {k: 1000 * v for k, v in medians.items()}
    lines = [
        "# Restarting the background writer between runs",
        "",
        f"`benchmarks/restart_bench.py` at {result['meta'].get('git_commit', '?')[:7]}: {state_bytes(state) / 2**20:.0f} MiB "
        f"in {n_tensors(state)} tensors, {args.reps} alternating reps, medians; "
        f"load average {load_before[0]:.2f} before, {result['meta']['loadavg_after'][0]:.2f} after (2 vCPUs, shared).",
        "",
        "Since a framework's run end (`Trainer.fit` returning, `end_training()`, the Trainer's `train()`) stops the",
        "writer process and every thread of ours (`Checkpointer.teardown()`), the next run starts them again.",
        "",
        "| what | ms |",
        "|---|---|",
        f"| `start()`: the caller's part (a Popen) | {ms['start_s']:.1f} |",
        f"| from `start()` until the writer answers | {ms['ready_s']:.1f} |",
        f"| `teardown()`: drain, stop the writer and threads | {ms['teardown_s']:.1f} |",
        f"| first save's stall after a teardown, no `start()` | {ms['stall_lazy_s']:.1f} |",
        f"| first save's stall, `start()` one step ({1000 * args.step_s:.0f} ms) earlier | {ms['stall_started_s']:.1f} |",
        f"| a save's stall, writer running | {ms['stall_warm_s']:.1f} |",
        f"| time to durable: no `start()` / `start()` earlier / running | {ms['durable_lazy_s']:.0f} / "
        f"{ms['durable_started_s']:.0f} / {ms['durable_warm_s']:.0f} |",
        "",
        "The adapters call `start()` where the framework offers a moment before the first save (Lightning's",
        "`Strategy.setup_environment`, the Trainer's `on_train_begin`, `enable_async_checkpointing`), so the first",
        "save of a run stalls like one with the writer running, and its write is not delayed by the writer's start-up.",
        "",
    ]
    with open(args.markdown, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
