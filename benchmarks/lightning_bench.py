"""Per-save stall and training slowdown of Lightning checkpointing on a >= 500 MB-state model.

    python benchmarks/lightning_bench.py            # all modes, ~5 min on 2 cores; writes
                                                    # benchmarks/results/lightning.json and docs/benchmarks_lightning.md

Modes (each in its own fresh process, same seed, same steps):
  none             no checkpointing (the baseline step time)
  torch            Lightning's default TorchCheckpointIO (torch.save, synchronous)
  lightning_async  Lightning's AsyncCheckpointIO (clone on the caller, torch.save on a thread)
  asyncckpt        AsyncCkptIO (this project)
  asyncckpt_base   AsyncCkptIO as of ``--base-rev`` (only with that option): before/after in one run

Training: an MLP (``--depth`` x Linear(``--width``, ``--width``)) with AdamW; the checkpoint holds the
weights and both Adam moments (width 2048, depth 10: 42 M parameters, 504 MB of tensors).
``ModelCheckpoint(every_n_train_steps=10, save_top_k=1)`` saves every 10 steps and removes the
previous file (rotation). Steps 1..10 are warm-up (their save at step 10 is the *first* save:
buffer allocation, writer start-up) and steps 11..20 absorb its one-time costs (AsyncCkptIO's writer
process imports torch there); the measured window is steps ``--warmup``+1..``--steps`` (default 21..65,
saves at 30..60).

Reported per mode:
  stall            time ``trainer.save_checkpoint`` blocked the training loop (median over the
                   window's saves; first save reported apart)
  memcpy           copying the same tensors into held (pre-allocated, pre-touched) memory, in the same
                   process right before each save (not counted in the window); stall / memcpy is the
                   median of the per-save ratios
  overhead         window wall time / (window steps x the run's own median step-to-step interval) - 1,
                   minus the same figure of the no-checkpoint runs: what checkpointing added to training,
                   robust to the load drifting between runs on a shared machine
  vs baseline run  window wall time / the no-checkpoint window of the same round - 1
  drain            time from the last step to fit() returning (the last write finishing)
The machine is shared: the 1-minute load average is recorded around every run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from base_revision import env_for_mode
from held_memcpy import HeldMemcpy, checkpoint_tensors

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "torch", "lightning_async", "asyncckpt_base", "asyncckpt")


def child(args) -> dict:
    import torch
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(max(1, os.cpu_count() or 1))

    class Big(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.depth)])

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-5)

    class Clock(Callback):
        def __init__(self):
            self.start, self.end = {}, {}

        def on_train_batch_start(self, trainer, *a):
            self.start[trainer.global_step + 1] = time.perf_counter()

        def on_train_batch_end(self, trainer, *a):  # runs before ModelCheckpoint's hook (Lightning orders it last)
            self.end[trainer.global_step] = time.perf_counter()

    plugins = None
    if args.mode == "lightning_async":
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        plugins = [AsyncCheckpointIO()]
    elif args.mode.startswith("asyncckpt"):
        from asyncckpt.adapters.lightning import AsyncCkptIO

        plugins = [AsyncCkptIO()]
    workdir = tempfile.mkdtemp(prefix="lightning_bench_", dir=args.dir)
    callbacks = [clock := Clock()]
    if args.mode != "none":
        callbacks.append(ModelCheckpoint(dirpath=workdir, every_n_train_steps=args.every, save_top_k=1))
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=args.mode != "none", callbacks=callbacks,
                        plugins=plugins, num_sanity_val_steps=0)
    stalls, profile, memcpys = [], {}, []
    original_save = trainer.save_checkpoint

    held_memcpy = HeldMemcpy()

    def memcpy() -> tuple[float, int, int]:
        """Copy exactly the checkpointed tensors (weights + optimizer state) into held memory."""
        return held_memcpy(checkpoint_tensors(model, trainer.optimizers[0]))

    def timed_save(*a, **k):
        memcpys.append((trainer.global_step, memcpy()[0]))
        profiler = None
        if args.profile and len(stalls) == 3:  # one save in the window, under cProfile (reported apart)
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        t0 = time.perf_counter()
        original_save(*a, **k)
        elapsed = time.perf_counter() - t0
        if profiler is not None:
            profiler.disable()
            profile.update(where_the_stall_goes(profiler, elapsed), step=trainer.global_step)
        stalls.append((trainer.global_step, elapsed))

    trainer.save_checkpoint = timed_save
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(args.batch * args.steps, args.width, generator=g)), batch_size=args.batch)
    model = Big()
    trainer.fit(model, data)
    returned = time.perf_counter()

    times = [memcpy()[0] for _ in range(6)]
    _, nbytes, n_tensors = memcpy()

    # the memcpy before each save is measurement, not training: taken out of the window and its step
    excluded = {step: m for step, m in memcpys}
    window = clock.end[args.steps] - clock.start[args.warmup + 1] - sum(
        m for step, m in memcpys if args.warmup < step <= args.steps)
    # start-to-start intervals: a step plus every callback after it (the checkpoint save included)
    intervals = [clock.start[s + 1] - clock.start[s] - excluded.get(s, 0.0) for s in range(args.warmup + 1, args.steps)]
    intervals.append(clock.end[args.steps] - clock.start[args.steps] - excluded.get(args.steps, 0.0))
    step_times = {s: clock.end[s] - clock.start[s] for s in clock.end if s in clock.start}
    files = sorted(os.listdir(workdir))
    sizes = [os.path.getsize(os.path.join(workdir, f)) for f in files]
    for f in files:
        os.unlink(os.path.join(workdir, f))
    os.rmdir(workdir)
    return {
        "mode": args.mode, "state_bytes": nbytes, "n_tensors": n_tensors, "memcpy_s": statistics.median(times[1:]),
        "memcpy_reps_s": times[1:], "stalls": stalls, "memcpy_before_save": memcpys, "window_s": window,
        "window_steps": args.steps - args.warmup, "drain_s": returned - clock.end[args.steps],
        "median_step_s": statistics.median(step_times.values()), "files": files, "file_bytes": sizes,
        "profile": profile, "window_intervals_s": intervals,
        "excess": window / (len(intervals) * statistics.median(intervals)) - 1.0,
    }


def where_the_stall_goes(profiler, elapsed: float) -> dict:
    """Cumulative seconds of the functions that make up a save's stall (from one cProfile'd save)."""
    import pstats

    wanted = {
        "dump_checkpoint": "Lightning: dump_checkpoint (build the checkpoint dict)",
        "torch_file_image": "core (before): torch_file_image (torch.save(skip_data) framing, zip parse)",
        "pickle_records": "core: pickle_records (torch's pickler: data.pkl, the snapshot of non-tensor values)",
        "render_template": "core: render_template (framing of a new structure; not per save)",
        "stage_image": "core: stage_image (copy tensor bytes into the held staging buffer)",
        "_apply_back_pressure": "core: back-pressure wait",
        "_free_file_slot": "core: staging buffer lookup/allocation",
        "_save": "torch.serialization._save (pickling + zip records)",
        "clone": "Lightning AsyncCheckpointIO: clone",
        "_atomic_save": "Lightning TorchCheckpointIO: _atomic_save (torch.save + write)",
    }
    stats = pstats.Stats(profiler)
    found: dict = {}
    for (filename, line, name), (cc, nc, tt, ct, callers) in stats.stats.items():
        if name in wanted:
            found[wanted[name]] = found.get(wanted[name], 0.0) + ct
    out = {"profiled_save_s": elapsed}
    out.update({label: round(found[label], 4) for label in wanted.values() if label in found})
    return out


def load_average() -> float:
    return os.getloadavg()[0]


def run_mode(mode: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--steps", str(args.steps), "--every", str(args.every),
           "--warmup", str(args.warmup), "--profile", str(args.profile),
           "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch)]
    if args.dir:
        cmd += ["--dir", args.dir]
    before = load_average()
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **env_for_mode(mode, args.base_rev, _trees)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(loadavg_before=before, loadavg_after=load_average(), process_wall_s=time.perf_counter() - t0)
    return result


_trees: dict = {}


def summarize(runs: list[dict], args) -> dict:
    """Per mode, over all rounds. Each stall is compared with the memcpy taken right before it; the
    slowdown with the no-checkpoint run of the same round (the machine's load drifts between rounds)."""
    baseline = {r["round"]: r["window_s"] for r in runs if r["mode"] == "none"}
    jitter = statistics.median(r["excess"] for r in runs if r["mode"] == "none")
    rows = {}
    for mode in MODES[1:]:
        mine = [r for r in runs if r["mode"] == mode]
        if not mine:
            continue
        window_stalls, memcpys, first, ratios, slowdowns = [], [], [], [], []
        for r in mine:
            pairs = [(s, m) for (step, s), (_, m) in zip(r["stalls"], r["memcpy_before_save"])
                     if args.warmup < step <= args.steps and step != r["profile"].get("step")]  # cProfile'd: apart
            window_stalls += [s for s, _ in pairs]
            memcpys += [m for _, m in pairs]
            ratios += [s / m for s, m in pairs]
            first += [s for step, s in r["stalls"] if step <= args.warmup][:1]
            slowdowns.append(r["window_s"] / baseline[r["round"]] - 1.0)
        rows[mode] = {
            "first_save_stall_s": statistics.median(first) if first else None,
            "stall_median_s": statistics.median(window_stalls), "stall_max_s": max(window_stalls),
            "saves_in_window": len(window_stalls), "memcpy_s": statistics.median(memcpys),
            "memcpy_end_of_run_s": [r["memcpy_s"] for r in mine],
            "stall_over_memcpy": statistics.median(ratios), "stall_over_memcpy_per_save": ratios,
            "slowdown": statistics.median(slowdowns), "slowdown_per_round": slowdowns,
            "overhead": statistics.median(r["excess"] for r in mine) - jitter,
            "excess_per_run": [r["excess"] for r in mine],
            "window_s": [r["window_s"] for r in mine], "drain_s": max(r["drain_s"] for r in mine),
            "median_step_s": [r["median_step_s"] for r in mine],
            "loadavg": [round(x, 1) for r in mine for x in (r["loadavg_before"], r["loadavg_after"])],
            "profile": mine[-1].get("profile", {}),
        }
    return {"baseline_window_s": baseline, "baseline_excess": jitter, "modes": rows}


def markdown(result: dict) -> str:
    cfg, summary = result["config"], result["summary"]
    run0 = next(r for r in result["runs"] if r["mode"] == "asyncckpt")
    names = {"torch": "TorchCheckpointIO (default)", "lightning_async": "Lightning AsyncCheckpointIO",
             "asyncckpt_base": f"AsyncCkptIO at {cfg.get('base_rev')} (before)", "asyncckpt": "**AsyncCkptIO**"}
    lines = [
        "# Lightning checkpointing benchmark",
        "",
        f"`python benchmarks/lightning_bench.py` ({result['date']}, commit {result.get('commit', '?')}, "
        f"{cfg['cpus']} CPUs, shared with other jobs: "
        "see the load averages). Model: MLP "
        f"{cfg['depth']} x Linear({cfg['width']}, {cfg['width']}) + AdamW; the checkpoint holds "
        f"**{run0['state_bytes'] / 1e6:.0f} MB** of tensors ({run0['n_tensors']} tensors; file "
        f"{max(run0['file_bytes'] or [0]) / 1e6:.0f} MB). `ModelCheckpoint(every_n_train_steps={cfg['every']}, "
        f"save_top_k=1)` (rotation); {cfg['steps']} steps; measured window = steps {cfg['warmup'] + 1}..{cfg['steps']} "
        f"({summary['modes']['asyncckpt']['saves_in_window'] // cfg['rounds']} saves per run); {cfg['rounds']} rounds, "
        "each mode in a fresh process per round.",
        "",
        "* **stall**: time `trainer.save_checkpoint` blocked the training loop (median over the window saves, the cProfile'd one left out).",
        "* **memcpy**: copying the same tensors into held (pre-allocated, pre-touched) memory, measured in the same",
        "  process right before each save (median); **stall / memcpy** is the median of the per-save ratios (the",
        "  machine's speed drifts within a minute, so each stall is compared with its own memcpy).",
        "* **overhead** (the slowdown estimate that survives the machine's drifting load): each run's window wall",
        "  time / (window steps x that run's median step-to-step interval) - 1, i.e. the time the checkpoints added",
        "  on top of the run's own undisturbed step time (stalls, and steps slowed by a background writer), minus the",
        f"  same figure for the runs without checkpoints ({100 * summary['baseline_excess']:+.1f}%: jitter); the median"
        " over runs minus that jitter, and in brackets each run's own figure before the jitter is subtracted.",
        "* **vs baseline run**: window wall time / the no-checkpoint run's window in the same round - 1. Only",
        "  meaningful on a quiet machine: here step times varied up to several-fold between runs (median step",
        "  column). Baseline windows: "
        + ", ".join(f"round {k}: {v:.1f} s" for k, v in summary["baseline_window_s"].items()) + ".",
        "* **first save**: the save at step 10, outside the window (buffer allocation; AsyncCkptIO also starts its",
        "  writer process then).",
        "",
        "| mode | stall s (median) | stall max s | memcpy s | stall / memcpy | overhead | vs baseline run "
        "| first save s | median step s (per run) | load avg (per run, before/after) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, row in summary["modes"].items():
        lines.append(
            f"| {names[mode]} | {row['stall_median_s']:.3f} | {row['stall_max_s']:.3f} | {row['memcpy_s']:.3f} "
            f"| {row['stall_over_memcpy']:.2f}x | {100 * row['overhead']:+.1f}% "
            f"({', '.join('%+.1f%%' % (100 * x) for x in row['excess_per_run'])}) "
            f"| {', '.join('%+.0f%%' % (100 * x) for x in row['slowdown_per_round'])} "
            f"| {row['first_save_stall_s']:.2f} | {', '.join('%.2f' % x for x in row['median_step_s'])} "
            f"| {', '.join('%.1f' % x for x in row['loadavg'])} |")
    prof = summary["modes"]["asyncckpt"].get("profile") or {}
    if prof:
        lines += ["", f"Where AsyncCkptIO's stall goes (one save under cProfile, {prof['profiled_save_s']:.2f} s):", ""]
        lines += [f"* {k}: {v:.3f} s" for k, v in prof.items() if k not in ("profiled_save_s", "step")]
    lines += ["", "Per-save stall / memcpy: " + "; ".join(
        f"{names[mode]}: " + ", ".join(f"{x:.2f}" for x in row["stall_over_memcpy_per_save"])
        for mode, row in summary["modes"].items()) + "."]
    lines += ["", "Goals: stall <= 1.2x memcpy, slowdown <= 5%.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=MODES)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=65)
    parser.add_argument("--warmup", type=int, default=20, help="steps before the measured window (2 saves)")
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: the temp dir)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over all modes (order reversed every round)")
    parser.add_argument("--profile", type=int, default=1,
                        help="cProfile the 4th save of each run (reported apart, left out of the stall figures)")
    parser.add_argument("--base-rev", default=None,
                        help="also run mode asyncckpt_base: AsyncCkptIO as of this git revision (before/after)")
    parser.add_argument("--from-json", help="only re-render the markdown from a results file")
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "lightning.json"))
    parser.add_argument("--markdown", default=str(REPO / "docs" / "benchmarks_lightning.md"))
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
        print(json.dumps(child(args)))
        return
    if args.from_json:
        Path(args.markdown).write_text(markdown(json.loads(Path(args.from_json).read_text())))
        return
    runs = []
    modes = tuple(m for m in MODES if args.base_rev or m != "asyncckpt_base")
    for round_ in range(args.rounds):
        order = modes if round_ % 2 == 0 else tuple(reversed(modes))
        for mode in order:
            print(f"round {round_}: running {mode} ...", file=sys.stderr, flush=True)
            runs.append(run_mode(mode, args) | {"round": round_})
            print(f"  window {runs[-1]['window_s']:.1f} s, median step {runs[-1]['median_step_s']:.3f} s, stalls "
                  f"{[round(s, 3) for _, s in runs[-1]['stalls']]}", file=sys.stderr, flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "commit": commit.strip(),
              "config": vars(args) | {"cpus": os.cpu_count()}, "runs": runs}
    result["summary"] = summarize(runs, args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    Path(args.markdown).write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
