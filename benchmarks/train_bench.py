#!/usr/bin/env python
"""Training slowdown from checkpointing: a small transformer trained on CPU, checkpoint every N steps.

    .venv/bin/python benchmarks/train_bench.py [--steps 60] [--every 10] [--rounds 3] \
        [--out benchmarks/results/train_loop.json] [--md docs/benchmarks_training.md] [--variants ours]

One process, 2 intra-op threads (the machine's cores). Each variant trains the same model from
the same seed for ``--steps`` steps (AdamW) and checkpoints model + optimizer every ``--every``
steps; the time of the whole loop (including waiting for the last save to finish) is compared
with the same loop without checkpoints. Variants run interleaved, ``--rounds`` times, and the
median is reported, since this machine's speed drifts over minutes. Each step is timed too, for the
slowdown measured inside each run (``within_run.py``), which that drift does not reach. Before each
run the disk settles (``settle``): the peers write through the page cache, and deleting their files
afterwards leaves writeback and (on a ``discard`` mount) TRIM work that the next run must not inherit.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from asyncckpt import core
from within_run import AFFECTED_STEPS, within_run_slowdown


class TinyLM(nn.Module):
    """A GPT-like encoder stack: ~25M parameters (~100 MB fp32)."""

    def __init__(self, vocab: int = 8000, width: int = 512, layers: int = 7, seq: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(seq, width))
        layer = nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens) + self.position))


class Saver:
    """One way of checkpointing: ``save(state, path)`` each checkpoint step, ``finish()`` at the end."""

    def __init__(self, name: str, save: Callable[[dict, str], float], finish: Callable[[], None] = lambda: None,
                 guard: Callable[[torch.optim.Optimizer], None] = lambda _optimizer: None) -> None:
        self.name, self.save, self.finish, self.guard = name, save, finish, guard


def savers(directory: str) -> list[Saver]:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    ours = core.Checkpointer()
    overlapped = core.Checkpointer(overlap_staging=True)
    lightning_io = AsyncCheckpointIO(TorchCheckpointIO())
    dcp_pending: list = []

    def torch_save(state, path):
        torch.save(state, path)

    def dcp_async(state, path):
        if dcp_pending:
            dcp_pending.pop().result()  # DCP keeps one save in flight, as ours does by default
        dcp_pending.append(dcp.async_save(state, checkpoint_id=path, no_dist=True))

    def dcp_finish():
        while dcp_pending:
            dcp_pending.pop().result()

    return [
        Saver("none", lambda state, path: None),
        Saver("none again (the measurement's noise)", lambda state, path: None),
        Saver("torch.save (synchronous)", torch_save),
        Saver("dcp.async_save (thread, default stager)", dcp_async, dcp_finish),
        Saver("Lightning AsyncCheckpointIO", lambda state, path: lightning_io.save_checkpoint(state, path),
              lightning_io.teardown),
        Saver("ours core.async_save", lambda state, path: ours.async_save(state, path), ours.wait),
        Saver("ours core.async_save, overlap_staging + guard", lambda state, path: overlapped.async_save(state, path),
              overlapped.wait, lambda optimizer: overlapped.guard(optimizer)),
    ]


def settle(seconds: float) -> None:
    """Let the previous run's disk work finish (dirty pages written back, deleted files trimmed)."""
    os.sync()
    time.sleep(seconds)


def train(saver: Saver, args, directory: str) -> dict:
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    hooks = saver.guard(optimizer) or []
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 8000, (args.batch, 64), generator=generator) for _ in range(4)]
    stalls = []
    step_seconds: dict[int, float] = {}

    def step(i: int) -> None:
        tokens = batches[i % len(batches)]
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 8000), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(3):  # warm up: allocator, optimizer state, first save (writer start, plans, buffers)
        step(i)
    saver.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": 0}, os.path.join(directory, "warm"))
    saver.finish()
    started = time.perf_counter()
    for i in range(1, args.steps + 1):
        t0 = time.perf_counter()
        step(i)
        step_seconds[i] = time.perf_counter() - t0
        if i % args.every == 0:
            t0 = time.perf_counter()
            saver.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": i},
                       os.path.join(directory, f"step{i}"))
            stalls.append(time.perf_counter() - t0)
    saver.finish()
    elapsed = time.perf_counter() - started
    for hook in hooks:
        hook.remove()
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    within = within_run_slowdown(step_seconds, range(args.every, args.steps + 1, args.every), sum(stalls))
    return {"seconds": elapsed, "stalls": stalls, "state_bytes": state_bytes, "step_seconds": step_seconds,
            "within_run": within}


def render(results: dict) -> str:
    meta = results["meta"]
    lines = [
        "# Training slowdown from checkpointing (benchmarks/train_bench.py)",
        "",
        f"Generated {meta['date']} on {meta['machine']}; torch {meta['torch']}, {meta['threads']} intra-op threads; "
        f"load average at start {meta['loadavg_start']}, at end {meta['loadavg_end']}.",
        "",
        f"A {meta['params'] / 1e6:.1f}M-parameter transformer ({meta['param_mb']:.0f} MB of parameters, "
        f"{meta['state_mb']:.0f} MB of checkpoint state with AdamW), batch {meta['batch']} x 64 tokens, trained "
        f"{meta['steps']} steps with a checkpoint every {meta['every']} steps ({meta['steps'] // meta['every']} saves), "
        f"{meta['rounds']} interleaved rounds; `slowdown` = median over rounds of (loop time / the same round's loop "
        "time without checkpoints - 1). "
        "The loop time includes waiting for the last save to finish. "
        f"`within run` = the slowdown measured inside each run (`benchmarks/within_run.py`): (the saves' stalls + the "
        f"extra time of the {AFFECTED_STEPS} steps after each save over the run's other steps) / (steps x a normal step); "
        "the drift between runs does not reach it, and the `none` rows (would-be save steps) are its noise floor; the "
        "wait for the last save's write at the end (once per run, not per save) is in the loop time only. "
        "Goal for ours: <= 5%.",
        "",
        "| variant | loop s (per round) | slowdown per round | slowdown (median) | within run, per round | "
        "within run (median) | stall per save, median s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, v in results["variants"].items():
        stall = statistics.median(v["stalls"]) if v["stalls"] else None
        lines.append(f"| {name} | {', '.join(f'{s:.2f}' for s in v['rounds_s'])} | "
                     f"{', '.join(f'{x * 100:+.1f}%' for x in v['round_slowdowns'])} | {v['slowdown'] * 100:+.1f}% | "
                     f"{', '.join(f'{x * 100:+.1f}%' for x in v['within_run'])} | "
                     f"{statistics.median(v['within_run']) * 100:+.1f}% | {'–' if stall is None else f'{stall:.3f}'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dir", default="/work/bench-tmp/train")
    ap.add_argument("--settle-s", type=float, default=5.0, help="idle seconds after a sync before each run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--variants", default=None,
                    help="comma-separated substrings of the variant names to run (default: all); the two 'none' runs always run")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 2)
    os.makedirs(args.dir, exist_ok=True)
    variants: dict[str, dict] = {}
    loadavg_start = os.getloadavg()
    all_savers = savers(args.dir)
    if args.variants:
        wanted = args.variants.split(",")
        all_savers = [s for s in all_savers if s.name.startswith("none") or any(w in s.name for w in wanted)]
    state_bytes = 0
    for round_index in range(args.rounds):
        for saver in all_savers:
            directory = os.path.join(args.dir, f"r{round_index}-{len(variants.get(saver.name, {}).get('rounds_s', []))}")
            shutil.rmtree(directory, ignore_errors=True)
            os.makedirs(directory)
            settle(args.settle_s)
            result = train(saver, args, directory)
            shutil.rmtree(directory, ignore_errors=True)
            state_bytes = result["state_bytes"]
            entry = variants.setdefault(saver.name, {"rounds_s": [], "stalls": [], "within_run": [], "step_seconds": []})
            entry["rounds_s"].append(result["seconds"])
            entry["stalls"].extend(result["stalls"])
            entry["within_run"].append(result["within_run"]["slowdown"])
            entry["step_seconds"].append(result["step_seconds"])
            print(f"round {round_index} {saver.name}: {result['seconds']:.2f} s, within run "
                  f"{result['within_run']['slowdown'] * 100:+.1f}%, stalls {[round(s, 3) for s in result['stalls']]}",
                  flush=True)
    for saver in all_savers:
        saver.finish()
    for entry in variants.values():
        entry["median_s"] = statistics.median(entry["rounds_s"])
    for entry in variants.values():  # against the loop without checkpoints of the same round (the machine drifts)
        entry["round_slowdowns"] = [s / base - 1 for s, base in zip(entry["rounds_s"], variants["none"]["rounds_s"])]
        entry["slowdown"] = statistics.median(entry["round_slowdowns"])
    model = TinyLM()
    params = sum(p.numel() for p in model.parameters())
    results = {
        "meta": {
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": f"{os.cpu_count()} CPUs",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "steps": args.steps, "every": args.every,
            "rounds": args.rounds, "batch": args.batch, "params": params, "param_mb": params * 4 / 1e6,
            "state_mb": state_bytes / 1e6, "loadavg_start": [round(x, 2) for x in loadavg_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        },
        "variants": variants,
    }
    for name, entry in variants.items():
        print(f"{name}: median {entry['median_s']:.2f} s, slowdown {entry['slowdown'] * 100:+.1f}%, "
              f"within run {statistics.median(entry['within_run']) * 100:+.1f}%")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(render(results))
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
