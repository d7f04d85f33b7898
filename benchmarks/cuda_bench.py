#!/usr/bin/env python
"""Saves from GPU memory: how long training blocks, against the device-to-host copy that any
asynchronous save must make and against the synchronous and asynchronous saves users have today.

    python benchmarks/cuda_bench.py --out benchmarks/results/cuda.json --md docs/benchmarks_cuda.md

Needs a CUDA device (the project's own machine has none; this ran where one was lent). One process,
one GPU, the checkpoint on the machine's local disk. Two workloads, each on the GPU:

  large   --large-mib of fp32 in 8 equal tensors (weights of a mid-sized model)
  adam    2,000 small parameters with Adam's two moments and a 0-dim step each (6,000 tensors, ~24 MiB):
          the per-tensor cost, which a copy of bytes does not show

Per workload, back to back, --reps reps of each (the first rep of a method warms its buffers and
plans and is reported apart):

  d2h       copy every tensor into held pinned host memory and synchronize (the stall's floor)
  torch     torch.save of the state + fsync (a synchronous save: stall = durable)
  dcp       torch.distributed.checkpoint.async_save, no process group (its default: a thread):
            stall = until it returns, durable = until its future is done
  ours      Checkpointer.async_save: stall = until it returns, durable = until the handle's result

and, for the large workload, a GPU matmul loop's steps per second alone, while our writer writes a
save in the background, and while it exports that checkpoint as Hugging Face safetensors (what work
in flight costs the training that goes on).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from typing import Any, Callable

import torch

MiB = 1 << 20


def make_large(total_mib: int) -> dict[str, torch.Tensor]:
    per = total_mib * MiB // 8 // 4
    return {f"layer{i}.weight": torch.randn(per, device="cuda") for i in range(8)}


def make_adam(params: int = 2000) -> dict[str, Any]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    state: dict[str, Any] = {"model": {}, "optim": {}}
    for i in range(params):
        shape = (1024,) if i % 2 else (32, 32)
        state["model"][f"p{i}"] = torch.randn(shape, device="cuda", generator=generator)
        state["optim"][f"p{i}"] = {"exp_avg": torch.randn(shape, device="cuda", generator=generator),
                                   "exp_avg_sq": torch.rand(shape, device="cuda", generator=generator),
                                   "step": torch.tensor(float(i), device="cuda")}
    return state


def tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in tensors(value)]
    return []


def nbytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(state))


def timed(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def d2h(state: Any, reps: int) -> list[dict]:
    held = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors(state)]

    def copy() -> None:
        for src, dst in zip(tensors(state), held):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
    return [{"stall_s": timed(copy)} for _ in range(reps)]


def fsync_tree(path: str) -> None:
    from asyncckpt.core.storage.fsio import fsync_file

    for root, _, files in os.walk(path):
        for name in files:
            fsync_file(os.path.join(root, name))


def torch_save(state: Any, root: str, reps: int) -> list[dict]:
    out = []
    for rep in range(reps):
        path = os.path.join(root, f"torch{rep}.pt")

        def save() -> None:
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        seconds = timed(save)
        out.append({"stall_s": seconds, "durable_s": seconds})
        os.unlink(path)
    return out


def dcp_async(state: Any, root: str, reps: int) -> list[dict]:
    import torch.distributed.checkpoint as dcp

    out = []
    for rep in range(reps):
        path = os.path.join(root, f"dcp{rep}")
        torch.cuda.synchronize()
        start = time.perf_counter()
        future = dcp.async_save(state, checkpoint_id=path, no_dist=True)
        stall = time.perf_counter() - start
        future.result()
        fsync_tree(path)
        out.append({"stall_s": stall, "durable_s": time.perf_counter() - start})
        shutil.rmtree(path)
    return out


def ours(state: Any, root: str, reps: int, checkpointer) -> list[dict]:
    out = []
    for rep in range(reps):
        path = os.path.join(root, f"ours{rep}")
        torch.cuda.synchronize()
        start = time.perf_counter()
        handle = checkpointer.async_save(state, path)
        stall = time.perf_counter() - start
        handle.result()
        out.append({"stall_s": stall, "durable_s": time.perf_counter() - start})
        shutil.rmtree(path)
    return out


def matmul_rate(seconds: float, during: Callable[[], Any] | None = None) -> float:
    """Steps per second of a 4096x4096 bf16 matmul loop, over ``seconds`` (or until ``during`` is done)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    steps, start = 0, time.perf_counter()
    while True:
        for _ in range(20):
            a = (a @ a).tanh_()
        torch.cuda.synchronize()
        steps += 20
        elapsed = time.perf_counter() - start
        if (during is None and elapsed >= seconds) or (during is not None and during()):
            return steps / elapsed


def summarize(reps: list[dict]) -> dict:
    first, rest = reps[0], reps[1:] or reps[:1]
    return {"first": first, **{key: statistics.median(r[key] for r in rest) for key in rest[0]}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--large-mib", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--root", default=None, help="where checkpoints are written (default: a temporary folder)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--md", default=None)
    args = parser.parse_args()
    from asyncckpt.core import Checkpointer

    root = tempfile.mkdtemp(prefix="cuda-bench-", dir=args.root)
    results: dict[str, Any] = {
        "when": datetime.datetime.now().isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "cpus": os.cpu_count(), "load": os.getloadavg(), "workloads": {},
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()}
    checkpointer = Checkpointer()
    try:
        for name, make in (("large", lambda: make_large(args.large_mib)), ("adam", make_adam)):
            state = make()
            torch.cuda.synchronize()
            entry: dict[str, Any] = {"bytes": nbytes(state), "tensors": len(tensors(state))}
            for method, run in (("d2h", lambda: d2h(state, args.reps)), ("torch", lambda: torch_save(state, root, args.reps)),
                                ("dcp", lambda: dcp_async(state, root, args.reps)),
                                ("ours", lambda: ours(state, root, args.reps, checkpointer))):
                try:
                    entry[method] = summarize(run())
                except Exception as error:  # a failing peer is a result, not a crash
                    entry[method] = {"error": f"{type(error).__name__}: {error}"[:600]}
                print(name, method, json.dumps(entry[method]), flush=True)
            if name == "large":
                alone = matmul_rate(3.0)
                handle = checkpointer.async_save(state, os.path.join(root, "during"))
                during = matmul_rate(0, handle.done)
                handle.result()
                from asyncckpt.core import ExportOptions

                started = time.perf_counter()
                export = checkpointer.export(os.path.join(root, "during"), ExportOptions(directory=os.path.join(root, "exports")))
                during_export = matmul_rate(0, export.done)
                export.result()
                entry["training"] = {"steps_per_s_alone": alone, "steps_per_s_during_write": during,
                                     "slowdown": 1 - during / alone, "steps_per_s_during_export": during_export,
                                     "export_slowdown": 1 - during_export / alone,
                                     "export_s": time.perf_counter() - started}
                print(name, "training", json.dumps(entry["training"]), flush=True)
            results["workloads"][name] = entry
            del state
            torch.cuda.empty_cache()
    finally:
        checkpointer.close()
        shutil.rmtree(root, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(render(results))


def render(results: dict) -> str:
    lines = [f"# Saves from GPU memory ({results['device']}, torch {results['torch']}, {results['when']}, "
             f"commit {results['commit']}, load {results['load'][0]:.1f})", "",
             "Generated by `benchmarks/cuda_bench.py`; medians of the reps after the first; stall = how long the "
             "training loop was blocked, durable = until the checkpoint was fsynced/committed.", ""]
    for name, entry in results["workloads"].items():
        lines += [f"## {name}: {entry['bytes'] / MiB:.0f} MiB in {entry['tensors']} tensors", "",
                  "| method | stall (s) | durable (s) | stall / d2h copy | first rep stall (s) |", "|---|---|---|---|---|"]
        floor = entry["d2h"].get("stall_s")
        for method in ("d2h", "torch", "dcp", "ours"):
            row = entry[method]
            if "error" in row:
                lines.append(f"| {method} | error: {row['error'][:120]} | | | |")
                continue
            ratio = f"{row['stall_s'] / floor:.2f}x" if floor else ""
            durable = f"{row['durable_s']:.3f}" if "durable_s" in row else ""
            lines.append(f"| {method} | {row['stall_s']:.3f} | {durable} | {ratio} | {row['first']['stall_s']:.3f} |")
        if "training" in entry:
            t = entry["training"]
            lines += ["", f"GPU matmul loop: {t['steps_per_s_alone']:.1f} steps/s alone, "
                          f"{t['steps_per_s_during_write']:.1f} while our writer writes ({t['slowdown']:+.1%} slowdown), "
                          f"{t['steps_per_s_during_export']:.1f} while it exports the checkpoint as safetensors "
                          f"({t['export_s']:.2f} s; {t['export_slowdown']:+.1%} slowdown)."]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
