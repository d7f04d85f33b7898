#!/usr/bin/env python
"""The first save of a process, which starts its background writer: what it blocks, and whether it
survives the trainer's death at once after it returned (issue 33), before and after, in one sitting.

    .venv/bin/python benchmarks/first_save_bench.py [--base-rev c96db64] [--reps 6] [--kills 5]
    # writes benchmarks/results/first_save.json and docs/benchmarks_first_save.md

Each rep is a fresh process (``--child``) with 1 GiB in 16 tensors, the revisions alternating (ABBA),
``--base-rev`` imported as ``base_revision`` does:

  timing   the process's first ``async_save`` (the call starts the writer: stall, then time to
           durable), then a second one (the writer runs: stall, durable)
  kill     the process SIGKILLs itself the moment its first ``async_save`` returned, having noted
           whether that checkpoint was visible then; the parent looks whether it is committed (and
           loads equal) within 60 s

A child reports in a file (``result.json``), never a pipe: a writer that outlives its killed process
inherits the process's output.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from base_revision import env_for_mode  # noqa: E402
from harness import GiB, git_meta, log, make_large, same_state, write_report  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def child(mode: str, directory: str) -> None:
    from asyncckpt import core

    state = make_large(GiB, 16)
    checkpointer = core.Checkpointer()
    started = time.perf_counter()
    handle = checkpointer.async_save(state, os.path.join(directory, "first"))
    stall = time.perf_counter() - started
    report = os.path.join(directory, "result.json")
    if mode == "kill":
        with open(report, "w") as f:
            json.dump({"visible_at_death": core.is_complete(os.path.join(directory, "first"))}, f)
        os.kill(os.getpid(), signal.SIGKILL)
    handle.result()
    durable = time.perf_counter() - started
    started = time.perf_counter()
    handle = checkpointer.async_save(state, os.path.join(directory, "second"))
    stall2 = time.perf_counter() - started
    handle.result()
    durable2 = time.perf_counter() - started
    checkpointer.close()
    with open(report, "w") as f:
        json.dump({"first_stall": stall, "first_durable": durable, "second_stall": stall2, "second_durable": durable2}, f)


def run(revision: str, mode: str, directory: str, cache: dict) -> tuple[int, dict]:
    """The child's exit code and its report."""
    os.makedirs(directory, exist_ok=True)
    env = {**os.environ, **env_for_mode("run_base" if revision != "this" else "run", revision, cache)}
    with open(os.path.join(directory, "stderr.txt"), "w") as err:
        code = subprocess.run([sys.executable, __file__, "--child", mode, directory], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=err, timeout=600).returncode
    try:
        with open(os.path.join(directory, "result.json")) as f:
            return code, json.load(f)
    except FileNotFoundError:
        with open(os.path.join(directory, "stderr.txt")) as f:
            raise RuntimeError(f"{revision} {mode}: exit {code}, no report: {f.read()[-3000:]}") from None


def kill_trial(revision: str, directory: str, cache: dict) -> dict:
    from asyncckpt import core

    path = os.path.join(directory, "first")
    code, report = run(revision, "kill", directory, cache)  # returns once the process died of its own SIGKILL
    deadline = time.monotonic() + 60
    while not core.is_complete(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    committed = core.is_complete(path)
    equal = False
    if committed:
        state = make_large(GiB, 16)
        loaded = {key: torch.empty_like(value) for key, value in state.items()}
        core.load(loaded, path)
        equal = same_state(loaded, state)
    return {"returncode": code, "visible_at_death": report["visible_at_death"], "committed": committed, "loads_equal": equal}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--base-rev", default="c96db64", help="the revision before (its writer exited when its trainer died as it started)")
    parser.add_argument("--reps", type=int, default=6, help="timed processes per revision (ABBA)")
    parser.add_argument("--kills", type=int, default=5, help="kill trials per revision")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "first_save.json"))
    parser.add_argument("--markdown", default=str(REPO / "docs" / "benchmarks_first_save.md"))
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0
    cache: dict = {}
    revisions = ["this", args.base_rev]
    meta = {**git_meta(), "started": datetime.datetime.now().isoformat(timespec="seconds"), "base_rev": args.base_rev,
            "loadavg_before": os.getloadavg()}
    timings: dict = {revision: [] for revision in revisions}
    kills: dict = {revision: [] for revision in revisions}
    base = tempfile.mkdtemp(prefix="first_save_", dir=args.dir)
    try:
        for rep in range(args.reps):
            for revision in revisions if rep % 2 == 0 else revisions[::-1]:
                directory = os.path.join(base, f"t-{rep}-{revision}")
                timings[revision].append(run(revision, "timing", directory, cache)[1])
                log(f"timing {revision}: {timings[revision][-1]}")
                shutil.rmtree(directory, ignore_errors=True)
        for trial in range(args.kills):
            for revision in revisions if trial % 2 == 0 else revisions[::-1]:
                directory = os.path.join(base, f"k-{trial}-{revision}")
                kills[revision].append(kill_trial(revision, directory, cache))
                log(f"kill {revision}: {kills[revision][-1]}")
                time.sleep(1)  # a writer of the base revision exits as it starts; ours has committed
                shutil.rmtree(directory, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    meta["loadavg_after"] = os.getloadavg()
    result = {"meta": meta, "timings": timings, "kills": kills}
    write_report(result, args.json, args.markdown, render(result))
    return 0


def render(result: dict) -> str:
    meta, base = result["meta"], result["meta"]["base_rev"]
    names = {"this": f"{meta['git_commit'][:7]} (after)", base: f"{base} (before)"}
    lines = [
        "# The first save of a process: its stall, and whether it survives the trainer's death",
        "",
        f"`benchmarks/first_save_bench.py` at {meta['git_commit'][:7]} against {base}, one sitting, {meta['started']}; "
        f"load average {meta['loadavg_before'][0]:.2f} before, {meta['loadavg_after'][0]:.2f} after (2 vCPUs shared "
        "with other jobs). Each rep a fresh process with 1 GiB in 16 tensors, the revisions alternating (ABBA); "
        "medians, seconds.",
        "",
        "| revision | first save: the call blocks (starts the writer) | durable | second save: blocks | durable |",
        "|---|---|---|---|---|",
    ]
    for revision, rows in result["timings"].items():
        cells = [statistics.median(row[key] for row in rows) for key in ("first_stall", "first_durable", "second_stall", "second_durable")]
        lines.append(f"| {names[revision]} | " + " | ".join(f"{value:.3f}" for value in cells) + " |")
    each = {revision: ", ".join(f"{row['first_stall']:.3f}" for row in rows) for revision, rows in result["timings"].items()}
    lines += ["", "Each rep (first stall): " + "; ".join(f"{names[revision]} {each[revision]}" for revision in each) + ".",
        "", "Kill at the return of the first save (the process SIGKILLs itself; committed within 60 s, loading equal):", ""]
    for revision, rows in result["kills"].items():
        lines.append(f"- {names[revision]}: {len(rows)} trials, {sum(not r['visible_at_death'] for r in rows)} not yet visible "
                     f"when the process had died, {sum(r['committed'] and r['loads_equal'] for r in rows)} committed and "
                     "loading equal.")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
