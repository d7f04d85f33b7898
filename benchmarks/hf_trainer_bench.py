"""Per-save stall and training slowdown of Transformers Trainer checkpointing on a >= 500 MB-state model.

    python benchmarks/hf_trainer_bench.py        # ~10-15 min on 2 shared cores; writes
                                                 # benchmarks/results/hf_trainer.json and docs/benchmarks_hf_trainer.md

Modes (each in its own fresh process, same seed, same steps; run order: none, native, asyncckpt,
asyncckpt_sync, none):
  none           save_strategy="no" (the baseline)
  native         the Trainer's own _save_checkpoint (synchronous)
  asyncckpt      Trainer(callbacks=[AsyncCheckpointCallback()]) (this project, core as it is in the tree):
                 optimizer.pt is snapshot on a thread during the next forward/backward (``overlap_optimizer``,
                 on by default); the next optimizer.step() waits for it
  asyncckpt_sync AsyncCheckpointCallback(overlap_optimizer=False): every file snapshot before the save returns
  asyncckpt_base AsyncCheckpointCallback() with asyncckpt as of ``--base-rev`` (before/after in one run)
  raw_write      the floor: at each save, instead of checkpointing, another process writes the same number of
                 bytes durably with O_DIRECT from memory it holds (``raw_writer.RawWriter``: no snapshot, no
                 checksums, no metadata); what is left is the cost of the disk I/O itself on these 2 cores

Training: ``LlamaForCausalLM`` from a config (no download): hidden 1024, 4 layers, MLP 2816, vocab 1024,
untied embeddings -> 53.5 M parameters; AdamW -> the checkpoint holds 642 MB of tensors (model.safetensors
214 MB + optimizer.pt 428 MB) plus config.json, generation_config.json, scheduler.pt, rng_state.pth,
trainer_state.json, training_args.bin. ``save_strategy="steps", save_steps=10, save_total_limit=2``
(rotation on). Steps 1..10 are warm-up: the save at step 10 is the *first* save (buffer allocation,
writer start-up) and is reported apart; with ``overlap_optimizer`` (the default) its snapshot (the allocation
included) finishes in step 11, so the wait of step 11's ``optimizer.step()`` for it counts as part of
the first save too and is taken out of the window. The measured window runs from the start of step 11 to the end
of the last step; the save at the last step and the wait for the last write (the Trainer drains before
it returns) are reported as "drain".

Reported per mode:
  stall        time ``trainer._save_checkpoint`` blocked the training loop (median over the window's saves)
  memcpy       copying the same tensors (weights + Adam moments) into held (pre-allocated, pre-touched)
               memory, in the same process immediately before each save (median); the machine is shared and
               its speed drifts by 2-10x within a minute, so each stall is paired with its own memcpy; the
               memcpy time is not counted in the window
  slowdown     window wall time / the mean no-checkpoint window - 1 (across processes: at the mercy of the
               other users of the machine; the load average is recorded around every run)
  blocked      in-run: sum of the window's stalls / (window - that sum): the slowdown the saves' blocking
               causes at this run's own training speed
  interference in-run: median duration of the 3 steps after each save (the writer busy) / median of the
               window's other steps - 1
  drain        from the end of the last step to train() returning (last save, last write, writer stop)
The children run with glibc's malloc told to keep freed memory (MALLOC_MMAP_THRESHOLD_=32 MiB,
MALLOC_TRIM_THRESHOLD_=64 GiB) in every mode, so that training's per-step allocations do not fault fresh
pages from the VM's host at ~0.3 GB/s (/work/shared/research/machine.md 1a); ``--no-malloc-env`` turns
that off.
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
from raw_writer import RawWriter

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "native", "asyncckpt_base", "asyncckpt", "asyncckpt_sync", "raw_write")
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}
AFTER_SAVE_STEPS = 3


def child(args) -> dict:
    import torch
    from torch.utils.data import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments


    class Tokens(Dataset):
        def __len__(self):
            return args.steps * args.batch

        def __getitem__(self, i):
            ids = torch.randint(0, args.vocab, (args.seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    class Clock(TrainerCallback):
        def __init__(self):
            self.start, self.end = {}, {}
            self.excluded = self.excluded_in_window = 0.0

        def on_step_begin(self, a, state, control, **kw):
            self.start[state.global_step + 1] = time.perf_counter()
            if state.global_step == args.every:  # the first save's memcpy came before the window
                self.excluded = 0.0
            self.excluded_in_window = self.excluded

        def on_step_end(self, a, state, control, **kw):  # before the Trainer's evaluate/save of that step
            self.end[state.global_step] = time.perf_counter()

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.mlp, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 64,
                         vocab_size=args.vocab, max_position_embeddings=max(64, args.seq), tie_word_embeddings=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(config)
    workdir = tempfile.mkdtemp(prefix="hf_trainer_bench_", dir=args.dir)
    callbacks = [clock := Clock()]
    asyncckpt_callback = None
    if args.mode.startswith("asyncckpt"):
        from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback

        callbacks.append(asyncckpt_callback := AsyncCheckpointCallback(overlap_optimizer=args.mode != "asyncckpt_sync"))
    targs = TrainingArguments(output_dir=workdir, max_steps=args.steps, per_device_train_batch_size=args.batch,
                              learning_rate=1e-5, save_strategy="no" if args.mode == "none" else "steps",
                              save_steps=args.every, save_total_limit=2, logging_steps=args.every, report_to=[],
                              use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=callbacks)

    held_memcpy = HeldMemcpy()

    def memcpy() -> tuple[float, int, int]:
        """Copy exactly the checkpointed tensors (weights + optimizer state) into held memory."""
        return held_memcpy(checkpoint_tensors(trainer.model, trainer.optimizer))

    stalls, save_memcpy = [], []
    raw_writer: list[RawWriter] = []

    def raw_save(*a, **k):  # started at the first save, which is reported apart (the optimizer state exists)
        if not raw_writer:
            raw_writer.append(RawWriter(memcpy()[1], workdir))
        raw_writer[0].start()

    # the async one when the callback is installed (on_init_end)
    inner_save = raw_save if args.mode == "raw_write" else trainer._save_checkpoint

    def timed_save(*a, **k):
        measured, _, _ = memcpy()
        clock.excluded += measured
        save_memcpy.append(measured)
        t0 = time.perf_counter()
        inner_save(*a, **k)
        stalls.append((trainer.state.global_step, time.perf_counter() - t0))

    trainer._save_checkpoint = timed_save
    trainer.train()
    for writer in raw_writer:
        writer.close()
    returned = time.perf_counter()
    times = [memcpy()[0] for _ in range(6)]
    _, nbytes, n_tensors = memcpy()

    timings = asyncckpt_callback.timings if asyncckpt_callback else []
    first_save_wait = timings[0].get("optimizer_step_waited_s", 0.0) if timings else 0.0  # overlap mode
    window = clock.end[args.steps] - clock.start[args.every + 1] - clock.excluded_in_window - first_save_wait
    window_steps = range(args.every + 1, args.steps + 1)
    step_time = {s: clock.end[s] - clock.start[s] for s in window_steps}
    after_save = [step_time[s] for s in window_steps if (s - 1) % args.every < AFTER_SAVE_STEPS]
    others = [step_time[s] for s in window_steps if (s - 1) % args.every >= AFTER_SAVE_STEPS]
    checkpoints = sorted(n for n in os.listdir(workdir) if n.startswith("checkpoint-"))
    files = {}
    if checkpoints:
        last = os.path.join(workdir, checkpoints[-1])
        files = {f: os.path.getsize(os.path.join(last, f)) for f in sorted(os.listdir(last))}
    subprocess.run(["rm", "-rf", workdir], check=False)
    return {
        "mode": args.mode, "state_bytes": nbytes, "n_tensors": n_tensors, "params": model.num_parameters(),
        "memcpy_s": statistics.median(times[1:]), "memcpy_reps_s": times[1:], "stalls": stalls,
        "memcpy_before_save_s": save_memcpy, "window_s": window, "window_steps": len(window_steps),
        "drain_s": returned - clock.end[args.steps], "median_step_s": statistics.median(step_time.values()),
        "median_step_after_save_s": statistics.median(after_save), "median_step_other_s": statistics.median(others),
        "checkpoints": checkpoints, "files": files,
        "waited_for_previous_commit_s": [t["waited_s"] for t in asyncckpt_callback.timings]
        if asyncckpt_callback else None,
        "optimizer_step_waited_s": [t.get("optimizer_step_waited_s", 0.0) for t in asyncckpt_callback.timings]
        if asyncckpt_callback else [0.0] * len(stalls),
    }


def run_mode(mode: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", mode] + [f"--{k}={getattr(args, k)}" for k in
                                                          ("steps", "every", "hidden", "mlp", "layers", "vocab",
                                                           "seq", "batch")]
    if args.dir:
        cmd += ["--dir", args.dir]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **({} if args.no_malloc_env else MALLOC_ENV),
           **env_for_mode(mode, args.base_rev, _trees)}
    before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(loadavg_before=before, loadavg_after=os.getloadavg()[0], process_wall_s=time.perf_counter() - t0)
    return result


_trees: dict = {}


def summarize(runs: list[dict], args) -> dict:
    """Per mode, over all its runs: stalls against the memcpy taken right before each of them; the
    in-run figures (blocked, interference) per run."""
    baseline = [r["window_s"] for r in runs if r["mode"] == "none"]
    base = statistics.mean(baseline) if baseline else float("nan")
    rows = {}
    for mode in dict.fromkeys(r["mode"] for r in runs if r["mode"] != "none"):
        mine = [r for r in runs if r["mode"] == mode]
        pairs, first, with_waits, blocked, within = [], [], [], [], []
        for r in mine:
            pairs += [(s, m) for (step, s), m in zip(r["stalls"], r["memcpy_before_save_s"]) if step > args.every]
            step_waits = {step: w for (step, _), w in zip(r["stalls"], r["optimizer_step_waited_s"])}
            first += [s + step_waits.get(step, 0.0) for step, s in r["stalls"] if step <= args.every]
            with_waits += [s + step_waits.get(step, 0.0) for step, s in r["stalls"] if step > args.every]
            # overlap mode: the next optimizer.step() may wait for the snapshot; that is blocking time too
            stalled = sum(s for step, s in r["stalls"] if args.every < step < args.steps) + sum(
                w for step, w in step_waits.items() if args.every < step < args.steps)
            blocked.append(stalled / (r["window_s"] - stalled))
            within.append(_within_run(r, stalled, args))
        rows[mode] = {
            "runs": len(mine), "first_save_stall_s": first, "stalls_s": [s for s, _ in pairs],
            "memcpy_before_save_s": [m for _, m in pairs],
            "stall_median_s": statistics.median(s for s, _ in pairs), "stall_max_s": max(s for s, _ in pairs),
            "saves_measured": len(pairs), "memcpy_s": statistics.median(m for _, m in pairs),
            "stall_over_memcpy_per_save": [s / m for s, m in pairs],
            "stall_over_memcpy": statistics.median(s / m for s, m in pairs),
            "waited_for_previous_commit_s": [w for r in mine for w in (r["waited_for_previous_commit_s"] or [])],
            "optimizer_step_waited_s": [w for r in mine for w in r["optimizer_step_waited_s"]],
            "stall_plus_step_wait_median_s": statistics.median(with_waits),
            "window_s": [r["window_s"] for r in mine], "slowdown": [r["window_s"] / base - 1.0 for r in mine],
            "blocked_in_run": blocked, "slowdown_within_run": within,
            "interference": [r["median_step_after_save_s"] / r["median_step_other_s"] - 1.0 for r in mine],
            "drain_s": [r["drain_s"] for r in mine], "median_step_s": [r["median_step_s"] for r in mine],
            "loadavg": [[r["loadavg_before"], r["loadavg_after"]] for r in mine], "files": mine[-1]["files"],
        }
    none = [r for r in runs if r["mode"] == "none"]
    return {"baseline_window_s": baseline, "baseline_median_step_s": [r["median_step_s"] for r in none],
            "baseline_interference": [r["median_step_after_save_s"] / r["median_step_other_s"] - 1.0 for r in none],
            "baseline_within_run": [_within_run(r, 0.0, args) for r in none],
            "modes": rows}


def _within_run(run: dict, stalled: float, args) -> float:
    """What the saves cost this run at its own speed: (the window's stalls and overlapped-snapshot waits +
    the extra time of the steps after each save over the run's other steps) / (window steps x a normal
    step). Robust to the shared machine's drift between runs; on a run without saves it is the noise floor."""
    after = sum(1 for step in range(args.every + 1, args.steps + 1) if (step - 1) % args.every < AFTER_SAVE_STEPS)
    normal = run["median_step_other_s"]
    extra = after * (run["median_step_after_save_s"] - normal)
    return (stalled + extra) / (run["window_steps"] * normal)


def markdown(result: dict) -> str:
    cfg, summary = result["config"], result["summary"]
    run0 = result["runs"][0]
    saves = cfg["steps"] // cfg["every"] - 1
    lines = [
        "# Transformers Trainer checkpointing benchmark",
        "",
        f"`python benchmarks/hf_trainer_bench.py` ({result['date']}, {cfg['cpus']} CPU cores shared with other jobs). "
        f"Model: `LlamaForCausalLM` from a config (hidden {cfg['hidden']}, {cfg['layers']} layers, MLP {cfg['mlp']}, "
        f"vocab {cfg['vocab']}; {run0['params'] / 1e6:.1f} M parameters) + AdamW: checkpoint state "
        f"**{run0['state_bytes'] / 1e6:.0f} MB** of tensors ({run0['n_tensors']} tensors). `save_strategy=\"steps\", "
        f"save_steps={cfg['every']}, save_total_limit=2`; {cfg['steps']} steps of batch {cfg['batch']} x {cfg['seq']} "
        f"tokens. Each mode runs in a fresh process; run order `{cfg['modes']}` (columns with several values: one per "
        f"run). Stalls: the {saves} saves after the first (steps {2 * cfg['every']}..{cfg['steps']}) of every run of "
        f"the mode. Window: step {cfg['every'] + 1} to the end of step {cfg['steps']}.",
        "",
        "* **stall** = time `trainer._save_checkpoint` blocked training; **+ next step's wait** = stall plus the time "
        "the next `optimizer.step()` waited for an overlapped optimizer snapshot (median; = stall without overlap); "
        "**memcpy** = copying the same tensors into held memory in the same process right before each save; "
        "**stall / memcpy** = median of the per-save ratios.",
        "* **slowdown** = window wall time vs the runs without checkpoints (baseline windows: "
        f"{', '.join('%.1f s' % w for w in summary['baseline_window_s'])}; median step "
        f"{', '.join('%.2f s' % s for s in summary['baseline_median_step_s'])}): across processes, so it moves with the "
        "other jobs on the machine (load average in the last column).",
        "* **slowdown (within run)** = (the window's stalls and overlapped-snapshot waits + the extra time of the "
        f"{AFTER_SAVE_STEPS} steps after each save over the run's other steps) / (window steps x the run's median "
        "other step): what the saves cost the run at its own speed (noise floor, the same on the runs without "
        f"checkpoints: {', '.join('%+.1f%%' % (100 * x) for x in summary['baseline_within_run'])}).",
        "* **blocked** = in-run share of the window's stalls (and overlapped-snapshot waits): sum / (window - sum); "
        "**interference** = "
        f"in-run: median time of the {AFTER_SAVE_STEPS} steps after each save (writer busy) vs the other steps "
        f"(without checkpoints the same ratio is {', '.join('%+.1f%%' % (100 * x) for x in summary['baseline_interference'])}).",
        "",
        "| mode | first save stall s | stall s (median) | stall max s | + next step's wait s | memcpy s (median) "
        "| stall / memcpy | slowdown (within run) | slowdown | blocked | interference | median step s | drain at end s "
        "| load avg (before, after) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    names = {"native": "Trainer native `_save_checkpoint`", "asyncckpt": "**AsyncCheckpointCallback()**",
             "asyncckpt_sync": "AsyncCheckpointCallback(overlap_optimizer=False)",
             "asyncckpt_base": f"AsyncCheckpointCallback() at {cfg.get('base_rev')} (before)",
             "raw_write": "floor: a raw O_DIRECT write of the same bytes by another process"}
    def each(values, form):
        return ", ".join(form % v for v in values)

    for mode, row in summary["modes"].items():
        lines.append(
            f"| {names[mode]} | {each(row['first_save_stall_s'], '%.2f')} | {row['stall_median_s']:.3f} | "
            f"{row['stall_max_s']:.3f} | {row['stall_plus_step_wait_median_s']:.3f} | {row['memcpy_s']:.3f} | "
            f"{row['stall_over_memcpy']:.2f}x | {each([100 * x for x in row['slowdown_within_run']], '%+.1f%%')} | "
            f"{each([100 * x for x in row['slowdown']], '%+.1f%%')} | "
            f"{each([100 * x for x in row['blocked_in_run']], '%.1f%%')} | "
            f"{each([100 * x for x in row['interference']], '%+.1f%%')} | {each(row['median_step_s'], '%.2f')} | "
            f"{each(row['drain_s'], '%.2f')} | {'; '.join(each(pair, '%.1f') for pair in row['loadavg'])} |")
    lines += ["", "Per-save stall / memcpy ratios: " + "; ".join(
        f"{mode}: " + ", ".join(f"{x:.2f}" for x in row["stall_over_memcpy_per_save"])
        for mode, row in summary["modes"].items()) + ".",
        "", "Goals: stall <= 1.2x memcpy, slowdown <= 5%. Where the stall goes: docs/hf_trainer.md (Performance).", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", choices=MODES)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--mlp", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--modes", default="none,native,asyncckpt,asyncckpt_sync,none",
                        help="comma-separated run order")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: the temp dir)")
    parser.add_argument("--base-rev", default=None, help="git revision that mode asyncckpt_base runs (before/after)")
    parser.add_argument("--no-malloc-env", action="store_true", help="run the children with glibc's default malloc")
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "hf_trainer.json"))
    parser.add_argument("--markdown", default=str(REPO / "docs" / "benchmarks_hf_trainer.md"))
    args = parser.parse_args()
    if args.child:
        args.mode = args.child
        print(json.dumps(child(args)))
        return
    runs = []
    for mode in args.modes.split(","):
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        runs.append(run_mode(mode, args))
        r = runs[-1]
        print(f"  window {r['window_s']:.1f} s, median step {r['median_step_s']:.2f} s, stalls "
              f"{[round(s, 3) for _, s in r['stalls']]}, memcpy {[round(m, 3) for m in r['memcpy_before_save_s']]}, "
              f"load {r['loadavg_before']:.1f}->{r['loadavg_after']:.1f}", file=sys.stderr, flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "config": vars(args) | {"cpus": os.cpu_count()}, "runs": runs}
    result["summary"] = summarize(runs, args)
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    with open(args.markdown, "w") as f:
        f.write(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
