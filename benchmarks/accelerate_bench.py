"""save_state() stall and training slowdown of Accelerate checkpointing on a >= 500 MB-state model.

    python benchmarks/accelerate_bench.py      # ~3-6 min on 2 shared cores; writes
                                               # benchmarks/results/accelerate.json and docs/benchmarks_accelerate.md

Modes (each in its own fresh process, same seed, same steps):
  none        no save_state() at all (the baseline)
  native      Accelerate's own save_state() (synchronous; page-cache writes, no fsync)
  asyncckpt   the same program after ``enable_async_checkpointing(accelerator)`` (this project; durable writes)
  asyncckpt_overlap  ``enable_async_checkpointing(accelerator, overlap_optimizer=True)``: optimizer.bin is snapshot
              on a thread during the next forward/backward; the next optimizer.step() waits for it
  asyncckpt_base  the same, with asyncckpt as of ``--base-rev`` (before/after in one run; see base_revision.py)
  raw_write   the floor: at each save, instead of save_state(), another process writes the same number of bytes
              durably with O_DIRECT from memory it holds (``raw_writer.RawWriter``: no snapshot, no checksums,
              no metadata); what is left is the cost of the disk I/O itself on these 2 cores

Training: an MLP of ``--layers`` Linear(hidden, hidden) + ReLU (default 10 x 2048: 42 M parameters) with
AdamW: ``save_state()`` writes model.safetensors (168 MB) + optimizer.bin (336 MB) + scheduler.bin +
random_states_0.pkl: **504 MB** of tensors. ``ProjectConfiguration(automatic_checkpoint_naming=True,
total_limit=2)`` (rotation on), ``save_state()`` every ``--every`` (10) steps. Steps 1..10 are warm-up:
the save at step 10 is the *first* save (staging-buffer allocation) and is reported apart; with
``overlap_optimizer=True`` its snapshot finishes in step 11, whose ``optimizer.step()`` waits for it: that wait counts
as part of the first save, not of the window (nor of step 11's time). The measured
window runs from the start of step 11 to the end of the last step; the save after the last step and the
wait for its write are the "drain".

Reported per mode:
  stall      time ``accelerator.save_state()`` blocked the training loop (median over the window's saves)
  memcpy     copying the same tensors (weights + AdamW state) into held (pre-allocated, pre-touched) memory,
             in the same process right before each save (the machine is shared and its speed drifts within a
             minute); not counted in the window
  slowdown   window wall time / the no-checkpoint window wall time - 1 (mean of the 'none' runs); the
             window includes the stalls. "step slowdown" compares the median step time (saves excluded).
  commit     (asyncckpt) from save_state() returning to checkpoint_N appearing, durable
The children run with glibc's malloc told to keep freed memory (MALLOC_MMAP_THRESHOLD_=32 MiB,
MALLOC_TRIM_THRESHOLD_=64 GiB) in every mode, so that per-step allocations do not fault fresh pages from the
VM's host at ~0.3 GB/s (/work/shared/research/machine.md 1a); ``--no-malloc-env`` turns that off.
``--profile`` adds a cProfile of the asyncckpt window's save_state() calls (top functions by own time).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from base_revision import env_for_mode
from held_memcpy import HeldMemcpy, checkpoint_tensors
from raw_writer import RawWriter
from within_run import AFFECTED_STEPS, within_run_slowdown

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "native", "asyncckpt_base", "asyncckpt", "asyncckpt_overlap", "raw_write")
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}


# --------------------------------------------------------------------------------------------- child
def child(args) -> dict:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed

    set_seed(0)
    workdir = tempfile.mkdtemp(prefix="accelerate_bench_", dir=args.dir)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=workdir, automatic_checkpoint_naming=True, total_limit=2))
    handle = None
    if args.mode.startswith("asyncckpt"):
        from asyncckpt.adapters.accelerate import enable_async_checkpointing

        handle = enable_async_checkpointing(acc, **({"overlap_optimizer": True} if args.mode == "asyncckpt_overlap" else {}))
    step_waits: dict[int, float] = {}  # save step -> time the next optimizer.step() waited for its overlapped snapshot
    last_save = [0]
    # how long callers waited for the staging thread, in total (asyncckpt_base: a revision without this counter)
    stager = getattr(getattr(handle, "checkpointer", None), "stager", None)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    model, opt, sched = acc.prepare(model, opt, sched)
    data = torch.Generator().manual_seed(0)

    def step():
        x = torch.randn(args.batch, args.hidden, generator=data)
        loss = model(x).square().mean()
        acc.backward(loss)
        waited_before = stager.staged_wait_s if stager is not None else 0.0
        opt.step()  # with overlap_optimizer, waits for the last save's optimizer snapshot
        if stager is not None and stager.staged_wait_s > waited_before:
            step_waits[last_save[0]] = step_waits.get(last_save[0], 0.0) + stager.staged_wait_s - waited_before
        sched.step()
        opt.zero_grad(set_to_none=False)

    held_memcpy = HeldMemcpy()

    def memcpy() -> tuple[float, int, int]:
        """Copy exactly the checkpointed tensors (weights + optimizer state) into held memory."""
        return held_memcpy(checkpoint_tensors(acc.unwrap_model(model), opt.optimizer))

    ckpt_root = os.path.join(workdir, "checkpoints")
    returned_at: dict[str, float] = {}
    committed_at: dict[str, float] = {}
    stop = threading.Event()

    def watch_commits():  # when does checkpoint_N appear (complete, durable) under its final name?
        while not stop.is_set():
            if os.path.isdir(ckpt_root):
                for name in os.listdir(ckpt_root):
                    committed_at.setdefault(name, time.perf_counter())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch_commits, daemon=True)
    if args.mode.startswith("asyncckpt"):
        watcher.start()
    profiler = None
    if args.profile and args.mode.startswith("asyncckpt"):
        import cProfile

        profiler = cProfile.Profile()

    raw_writer: list[RawWriter] = []

    def save() -> None:
        if args.mode != "raw_write":
            acc.save_state()
            return
        if not raw_writer:  # started at the first save, which is reported apart (the optimizer state exists)
            raw_writer.append(RawWriter(memcpy()[1], workdir))
        raw_writer[0].start()

    starts, ends, stalls, memcpys, excluded = {}, {}, [], [], 0.0
    for i in range(1, args.steps + 1):
        starts[i] = time.perf_counter()
        step()
        ends[i] = time.perf_counter()
        if args.mode != "none" and i % args.every == 0 and i < args.steps:
            measured, _, _ = memcpy()
            if i > args.every:
                excluded += measured
            memcpys.append(measured)
            name = f"checkpoint_{acc.project_configuration.iteration}"
            use_profiler = profiler is not None and i > args.every
            t0 = time.perf_counter()
            if use_profiler:
                profiler.enable()
            save()
            if use_profiler:
                profiler.disable()
            t1 = time.perf_counter()
            returned_at[name] = t1
            stalls.append((i, t1 - t0))
            last_save[0] = i
    end_of_window = ends[args.steps]
    if args.mode != "none":  # the drain: the last save and the wait for the last write
        save()
    if handle is not None:
        handle.wait()
    for writer in raw_writer:
        writer.close()
    drained = time.perf_counter()
    stop.set()
    times = [memcpy()[0] for _ in range(4)]
    _, nbytes, n_tensors = memcpy()

    first_wait = step_waits.get(args.every, 0.0)  # the first save's overlapped snapshot, waited for in the next step
    starts[args.every + 1] += first_wait
    window = end_of_window - starts[args.every + 1] - excluded
    step_times = [ends[s] - starts[s] for s in ends if s > args.every]
    checkpoints = sorted(os.listdir(ckpt_root)) if os.path.isdir(ckpt_root) else []
    files = {}
    if checkpoints:
        last = os.path.join(ckpt_root, checkpoints[-1])
        files = {f: os.path.getsize(os.path.join(last, f)) for f in sorted(os.listdir(last))}
    commit_latency = {n: committed_at[n] - returned_at[n] for n in returned_at if n in committed_at}
    profile = None
    if profiler is not None:
        import io
        import pstats

        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(14)
        profile = out.getvalue()
    acc.end_training()
    shutil.rmtree(workdir, ignore_errors=True)
    return {
        "mode": args.mode, "state_bytes": nbytes, "n_tensors": n_tensors,
        "params": sum(p.numel() for p in model.parameters()),
        "memcpy_s": statistics.median(times[1:]), "memcpy_reps_s": times[1:], "stalls": stalls,
        "memcpy_before_save_s": memcpys, "window_s": window, "window_steps": args.steps - args.every,
        "drain_s": drained - end_of_window, "median_step_s": statistics.median(step_times),
        "mean_step_s": statistics.mean(step_times), "step_times_s": [ends[i] - starts[i] for i in range(1, args.steps + 1)],
        "checkpoints": checkpoints, "files": files,
        "commit_latency_s": commit_latency, "profile": profile,
        "step_waits_s": {str(k): v for k, v in step_waits.items()}, "first_save_wait_s": first_wait,
    }


# -------------------------------------------------------------------------------------------- parent
def wait_quiet(max_wait_s: float, threshold_pct: float = 15.0, quiet_for_s: float = 20.0) -> dict:
    """Wait (at most ``max_wait_s``) until the whole machine has been nearly idle for ``quiet_for_s``."""
    import psutil

    t0 = time.monotonic()
    quiet_since = None
    while time.monotonic() - t0 < max_wait_s:
        busy = psutil.cpu_percent(interval=2.0)
        if busy < threshold_pct:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= quiet_for_s:
                return {"waited_s": round(time.monotonic() - t0, 1), "quiet": True}
        else:
            quiet_since = None
    return {"waited_s": round(time.monotonic() - t0, 1), "quiet": max_wait_s <= 0}


def run_mode(mode: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", mode] + [f"--{k}={getattr(args, k)}" for k in
                                                          ("steps", "every", "hidden", "layers", "batch")]
    if args.dir:
        cmd += ["--dir", args.dir]
    if args.profile:
        cmd += ["--profile"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **({} if args.no_malloc_env else MALLOC_ENV),
           **env_for_mode(mode, args.base_rev, _trees)}
    before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(loadavg_before=before, loadavg_after=os.getloadavg()[0], process_wall_s=time.perf_counter() - t0)
    print(f"  {mode}: window {result['window_s']:.1f} s, stalls "
          f"{', '.join('%.3f' % s for _, s in result['stalls'])}, memcpy "
          f"{', '.join('%.3f' % s for s in result['memcpy_before_save_s'])}, load {before:.1f}", file=sys.stderr)
    return result


_trees: dict = {}
def run_slowdown(run: dict, args) -> dict:
    """``within_run.within_run_slowdown`` of one run: its window runs from the step after the first save
    (step ``every``, reported apart) to the end; the save after the last step belongs to the drain."""
    times = run["step_times_s"]  # times[i - 1] = step i, the save (if any) excluded
    window = {i: times[i - 1] for i in range(args.every + 1, args.steps + 1)}
    stalls = sum(stall for step, stall in run["stalls"] if step > args.every)
    return within_run_slowdown(window, range(args.every, args.steps, args.every), stalls)


def summarize(runs: list[dict], args) -> dict:
    baseline = [r["window_s"] for r in runs if r["mode"] == "none"]
    base = statistics.mean(baseline) if baseline else float("nan")
    base_step = statistics.mean(r["median_step_s"] for r in runs if r["mode"] == "none") if baseline else float("nan")
    rows = {}
    for mode in MODES[1:]:
        mine = [r for r in runs if r["mode"] == mode]
        if not mine:
            continue
        pairs = [(s, m) for r in mine for (step, s), m in zip(r["stalls"], r["memcpy_before_save_s"]) if step > args.every]
        first = [s + r.get("first_save_wait_s", 0.0) for r in mine for step, s in r["stalls"] if step <= args.every]
        stall = statistics.median(s for s, _ in pairs)
        memcpy = statistics.median(m for _, m in pairs)
        window = statistics.mean(r["window_s"] for r in mine)
        commits = [v for r in mine for v in r["commit_latency_s"].values()]
        rows[mode] = {
            "runs": len(mine), "first_save_stall_s": first, "stalls_s": [s for s, _ in pairs],
            "memcpy_before_save_s": [m for _, m in pairs], "stall_median_s": stall, "stall_max_s": max(s for s, _ in pairs),
            "saves_in_window": len(pairs), "memcpy_s": memcpy,
            "stall_over_memcpy": statistics.median(s / m for s, m in pairs),
            "stall_over_memcpy_per_save": [s / m for s, m in pairs],
            "window_s": window, "windows_s": [r["window_s"] for r in mine], "slowdown": window / base - 1.0,
            "median_step_s": statistics.mean(r["median_step_s"] for r in mine),
            "step_slowdown": statistics.mean(r["median_step_s"] for r in mine) / base_step - 1.0,
            "drain_s": statistics.mean(r["drain_s"] for r in mine),
            "commit_latency_median_s": statistics.median(commits) if commits else None,
            "within_run": [run_slowdown(r, args) for r in mine],
            "next_step_wait_median_s": statistics.median(
                r.get("step_waits_s", {}).get(str(step), 0.0) for r in mine for step, _ in r["stalls"] if step > args.every),
            "within_run_slowdown": statistics.median(run_slowdown(r, args)["slowdown"] for r in mine),
            "loadavg": [[r["loadavg_before"], r["loadavg_after"]] for r in mine], "files": mine[-1]["files"],
        }
    noise = [run_slowdown(r, args)["slowdown"] for r in runs if r["mode"] == "none"]
    return {"baseline_window_s": baseline, "baseline_median_step_s": [r["median_step_s"] for r in runs
                                                                     if r["mode"] == "none"],
            "noise_floor_within_run": noise, "modes": rows}


def markdown(result: dict) -> str:
    cfg, summary = result["config"], result["summary"]
    run0 = result["runs"][0]
    saves = cfg["steps"] // cfg["every"] - 2
    lines = [
        "# Accelerate `save_state()` benchmark",
        "",
        f"`python benchmarks/accelerate_bench.py` ({result['date']}, {cfg['cpus']} shared CPU cores, torch "
        f"{result['versions']['torch']}, accelerate {result['versions']['accelerate']}). Model: MLP of {cfg['layers']} x "
        f"Linear({cfg['hidden']}, {cfg['hidden']}) ({run0['params'] / 1e6:.1f} M parameters) + AdamW + StepLR: "
        f"`save_state()` writes **{run0['state_bytes'] / 1e6:.0f} MB** of tensors ({run0['n_tensors']} tensors: "
        "model.safetensors, optimizer.bin, scheduler.bin, random_states_0.pkl). "
        f"`ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)`, `save_state()` every {cfg['every']} "
        f"steps, {cfg['steps']} steps of batch {cfg['batch']}; window = step {cfg['every'] + 1} to the end of step "
        f"{cfg['steps']} ({saves} saves per run; the first save, at step {cfg['every']}, is reported apart; the save after "
        "the last step and the wait for its write are the drain). Each mode runs in a fresh process; run order "
        f"`{','.join(cfg['modes'])}`.",
        "",
        "stall = time `accelerator.save_state()` blocked training (median over the window's saves of all runs of the "
        "mode); memcpy = copying the same tensors into held memory in the same process right before each save "
        "(median); stall / memcpy = median of the per-save ratios (each stall against its own memcpy); slowdown = window wall time (stalls included) vs the runs without checkpoints (baseline windows: "
        f"{', '.join('%.1f s' % w for w in summary['baseline_window_s'])}); step slowdown = median step time, saves "
        "excluded (the background writer's interference); next step's wait = time the "
        "`optimizer.step()` after a save waited for its overlapped optimizer snapshot (median); commit = from `save_state()` returning to `checkpoint_N` "
        "appearing, durable (fsynced). slowdown (within run) = (the window's stalls + the extra time of the "
        f"{AFFECTED_STEPS} steps after each save over the run's own undisturbed step time) / (window steps x that "
        "step time), median over the mode's runs: robust to the shared machine's drift between runs (noise floor, "
        "the same computation on the runs without saves: "
        f"{', '.join('%+.1f%%' % (100 * x) for x in summary['noise_floor_within_run'])}).",
        "",
        "| mode | first save stall s | stall s (median) | stall max s | next step's wait s | memcpy s | stall / memcpy "
        "| slowdown (within run) | window s | slowdown (vs none runs) | step slowdown | commit s | drain s "
        "| load avg (before, after) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = {"native": "Accelerate native `save_state()`", "asyncckpt": "**`enable_async_checkpointing`**",
             "asyncckpt_overlap": "`enable_async_checkpointing(overlap_optimizer=True)`",
             "asyncckpt_base": f"`enable_async_checkpointing` at {cfg.get('base_rev')} (before)",
             "raw_write": "floor: a raw O_DIRECT write of the same bytes by another process"}
    for mode, row in summary["modes"].items():
        commit = "-" if row["commit_latency_median_s"] is None else f"{row['commit_latency_median_s']:.2f}"
        loads = "; ".join(f"{a:.1f}, {b:.1f}" for a, b in row["loadavg"])
        lines.append(
            f"| {names[mode]} | {', '.join('%.2f' % s for s in row['first_save_stall_s'])} | {row['stall_median_s']:.3f} "
            f"| {row['stall_max_s']:.3f} | {row['next_step_wait_median_s']:.3f} | {row['memcpy_s']:.3f} | "
            f"{row['stall_over_memcpy']:.2f}x | "
            f"{100 * row['within_run_slowdown']:+.1f}% | {row['window_s']:.1f} | {100 * row['slowdown']:+.1f}% | {100 * row['step_slowdown']:+.1f}% | {commit} | "
            f"{row['drain_s']:.2f} | {loads} |")
    lines += ["", "Per-save stall / memcpy: " + "; ".join(
        f"{names[mode]}: " + ", ".join(f"{x:.2f}" for x in row["stall_over_memcpy_per_save"])
        for mode, row in summary["modes"].items()) + "."]
    lines += ["", "Median step time without checkpoints: "
              f"{', '.join('%.3f s' % s for s in summary['baseline_median_step_s'])}.", "",
              "Goals: stall <= 1.2x memcpy, slowdown <= 5%.", ""]
    if result.get("notes"):
        lines += [result["notes"], ""]
    if result.get("profile"):
        lines += ["cProfile of the asyncckpt window's `save_state()` calls (top functions by own time):", "",
                  "<!-- doc-test: skip (not code: a profiler's output) -->", "```",  # tests/test_docs.py
                  result["profile"].strip(), "```", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=MODES)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--modes", default="none,native,asyncckpt,asyncckpt,native,none",
                        help="comma-separated run order")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: the temp dir)")
    parser.add_argument("--base-rev", default=None, help="git revision that mode asyncckpt_base runs (before/after)")
    parser.add_argument("--profile", action="store_true", help="cProfile the asyncckpt saves")
    parser.add_argument("--no-malloc-env", action="store_true", help="run the children with glibc's default malloc")
    parser.add_argument("--notes", default="", help="a paragraph added to the markdown")
    parser.add_argument("--wait-quiet", type=float, default=0.0,
                        help="first wait up to this many seconds for the (shared) machine to be idle for 20 s")
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "accelerate.json"))
    parser.add_argument("--markdown", default=str(REPO / "docs" / "benchmarks_accelerate.md"))
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
        print(json.dumps(child(args)))
        return
    import accelerate
    import torch

    modes = args.modes.split(",")
    quiet = wait_quiet(args.wait_quiet) if args.wait_quiet > 0 else None
    if quiet is not None:
        print(f"wait for an idle machine: {quiet}", file=sys.stderr)
    runs = []
    for mode in modes:
        runs.append(run_mode(mode, args))
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
        "versions": {"torch": torch.__version__, "accelerate": accelerate.__version__, "python": platform.python_version()},
        "config": {"steps": args.steps, "every": args.every, "hidden": args.hidden, "layers": args.layers,
                   "base_rev": args.base_rev,
                   "batch": args.batch, "modes": modes, "cpus": os.cpu_count(), "malloc_env": not args.no_malloc_env},
        "runs": runs, "summary": None, "notes": args.notes, "wait_quiet": quiet,
        "profile": next((r["profile"] for r in runs if r.get("profile")), None),
    }
    result["summary"] = summarize(runs, args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    Path(args.markdown).write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
