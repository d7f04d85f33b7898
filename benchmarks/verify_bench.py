"""What checking a checkpoint on resume costs, per adapter layout, against the load it guards.

    .venv/bin/python benchmarks/verify_bench.py [--size-mib 1024] [--reps 5]
    # writes benchmarks/results/verify.json and docs/benchmarks_verify.md

Each adapter checks a checkpoint against its checksums (``Checkpointer.require_intact``) before the
framework loads it. For 1 GiB of state in (a) 16 large tensors and (b) ~8,000 tensors (a model and
its Adam state), written through the core the way each adapter writes it:

  lightning    one ``torch.save`` file (``async_save_file``), loaded with ``torch.load`` (what
               ``TorchCheckpointIO.load_checkpoint`` does)
  accelerate   a directory: ``model.safetensors`` (the model) + ``optimizer.bin`` (torch.save), loaded
               with ``safetensors.torch.load_file`` + ``torch.load`` (what ``load_state`` reads)
  hf_trainer   the same with ``optimizer.pt``, as the Trainer's resume reads it

and measured in rotation, page cache warm: ``cached read`` (reading the files into held memory: the
limit), ``verify`` (the check), ``load`` (the framework's reads, no check). Target: verify <= 10% of
load or <= 1.25x the cached read, whichever is larger.
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
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import git_meta, make_adam, make_large, n_tensors  # noqa: E402

from asyncckpt.core import Checkpointer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, f"{name}."))
        elif isinstance(value, torch.Tensor):
            out[name] = value
    return out


def write_checkpoints(checkpointer: Checkpointer, state: dict, root: str) -> dict[str, list[str]]:
    """The three layouts; returns each one's files."""
    model = flat(state.get("model", state))
    rest = {k: v for k, v in state.items() if k != "model"} or {"step": 1}
    lightning = os.path.join(root, "last.ckpt")
    checkpointer.save_file({"state_dict": model, "optimizer_states": [rest], "global_step": 1}, lightning)
    layouts = {"lightning": [lightning]}
    for adapter, optimizer_name in (("accelerate", "optimizer.bin"), ("hf_trainer", "optimizer.pt")):
        directory = os.path.join(root, adapter)
        with checkpointer.begin_directory(directory) as tx:
            tx.save_file(model, "model.safetensors", format="safetensors", metadata={"format": "pt"})
            tx.save_file(rest, optimizer_name)
            tx.commit().result()
        layouts[adapter] = [os.path.join(directory, "model.safetensors"), os.path.join(directory, optimizer_name)]
    return layouts


def cached_read(files: list[str], buffer: bytearray) -> None:
    view = memoryview(buffer)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def framework_load(adapter: str, files: list[str]) -> None:
    for path in files:
        if path.endswith(".safetensors"):
            load_file(path)
        else:
            torch.load(path, map_location="cpu", weights_only=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "verify.json"))
    parser.add_argument("--markdown", default=str(REPO / "docs" / "benchmarks_verify.md"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    results: dict = {}
    with Checkpointer() as checkpointer:
        for workload, make in (("a: 16 large tensors", make_large), ("b: ~8,000 tensors", make_adam)):
            state = make(args.size_mib << 20)
            root = tempfile.mkdtemp(prefix="verify_bench_", dir=args.dir)
            layouts = write_checkpoints(checkpointer, state, root)
            buffer = bytearray(4 << 20)
            for adapter, files in layouts.items():
                target = files[0] if adapter == "lightning" else os.path.dirname(files[0])
                rows = {"cached read": lambda: cached_read(files, buffer),
                        "verify": lambda: checkpointer.require_intact(target),
                        "load": lambda: framework_load(adapter, files)}
                times: dict[str, list[float]] = {row: [] for row in rows}
                for rep in range(args.reps + 1):  # rep 0 warms the page cache and is dropped
                    for row, run in rows.items():
                        t0 = time.perf_counter()
                        run()
                        if rep:
                            times[row].append(time.perf_counter() - t0)
                med = {row: statistics.median(v) for row, v in times.items()}
                target_s = max(0.10 * med["load"], 1.25 * med["cached read"])
                results.setdefault(workload, {})[adapter] = {
                    "bytes": sum(os.path.getsize(f) for f in files), "tensors": n_tensors(state), "reps": times,
                    "median": med, "verify_over_cached_read": med["verify"] / med["cached read"],
                    "verify_over_load": med["verify"] / med["load"], "target_s": target_s,
                    "met": med["verify"] <= target_s}
                print(workload, adapter, {k: round(v, 4) for k, v in med.items()}, flush=True)
            shutil.rmtree(root, ignore_errors=True)
    result = {"meta": {**git_meta(), "python": platform.python_version(), "torch": torch.__version__,
                       "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
              "args": vars(args), "results": results}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    lines = ["# Checking a checkpoint on resume", "",
             f"`benchmarks/verify_bench.py` ({args.size_mib} MiB of state, {args.reps} reps in rotation, page cache warm, "
             f"medians; load average {load_before[0]:.2f} before, {result['meta']['loadavg_after'][0]:.2f} after; "
             "2 shared vCPUs). **verify** = `Checkpointer.require_intact` (what each adapter runs before the framework "
             "loads); **load** = the framework's own reads of the same files, unchecked; **cached read** = reading the "
             "files into held memory (the limit). Target: verify <= max(10% of load, 1.25x cached read).", "",
             "| workload | layout | bytes | cached read s | verify s | load s | verify / cached read | verify / load | target met |",
             "|---|---|---|---|---|---|---|---|---|"]
    for workload, per_adapter in results.items():
        for adapter, r in per_adapter.items():
            m = r["median"]
            lines.append(f"| {workload} | {adapter} | {r['bytes'] / 2**20:.0f} MiB | {m['cached read']:.3f} | {m['verify']:.3f} | "
                         f"{m['load']:.3f} | {r['verify_over_cached_read']:.2f}x | {100 * r['verify_over_load']:.0f}% | "
                         f"{'yes' if r['met'] else '**no**'} |")
    lines.append("")
    with open(args.markdown, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
