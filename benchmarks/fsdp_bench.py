"""FSDP2 on 2 ranks: Accelerate's ``save_state()`` with the adapter, against Accelerate's own
synchronous save and against ``torch.distributed.checkpoint.async_save`` of the same state dicts.

    .venv/bin/python benchmarks/fsdp_bench.py [--reps 3] [--total-mib 1024]
    # writes benchmarks/results/fsdp.json and docs/benchmarks_fsdp.md

Two gloo processes on CPU; the model is wrapped with FSDP2's ``fully_shard`` and registered with
the Accelerator in FSDP mode by hand, as in ``tests/test_fsdp.py`` (Accelerate's launcher refuses
FSDP without GPUs). Parameters + Adam's two moments come to ``--total-mib`` over both ranks;
``SHARDED_STATE_DICT``, so each rank saves its half (``pytorch_model_fsdp_0/``, ``optimizer_0/``).

Each rep, on both ranks at once and in this order (a barrier between each):

  memcpy       a held copy of the rank's shard bytes (the stall's floor)
  raw write    a durable O_DIRECT write of the rank's shard bytes from held memory, 2 threads of
               32 MiB requests, both ranks writing at once (the disk's floor for "durable")
  native       Accelerate's own save_state (DCP's FileSystemWriter, fsynced): stall = durable
  ours         save_state with enable_async_checkpointing: stall = until it returns; durable =
               until the checkpoint is committed on every rank
  dcp async    dcp.async_save of {"model": get_model_state_dict, "optimizer": get_optimizer_state_dict}
               (its default: a thread): stall = until it returns; durable = until its future is done

A figure per rep is the slower rank's (a checkpoint is done when its last rank is); the table
shows medians over reps, ratios within one run. The first rep of each method warms its caches
(our staging buffers and plans) and is reported separately.
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
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from harness import CpuMonitor, PairedMemcpy, PairedODirect, free_port, git_meta  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
METHODS = ("memcpy", "raw_write", "native", "ours", "dcp_async")


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, root: str, out: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    from asyncckpt.adapters.accelerate import enable_async_checkpointing

    accelerator = Accelerator(cpu=True)
    width = int(((args.total_mib << 20) / (3 * 4 * args.layers)) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, width)).square().mean().backward()
    optimizer.step()
    accelerator._models.append(model)
    accelerator._optimizers.append(AcceleratedOptimizer(optimizer, device_placement=False))
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    shard_bytes = sum(p.to_local().nbytes for p in model.parameters()) + sum(
        v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes for s in optimizer.state.values() for v in s.values())
    memcpy, raw = PairedMemcpy(shard_bytes), PairedODirect(shard_bytes, root)
    native_save_state = type(accelerator).save_state  # before the adapter is on
    handle = enable_async_checkpointing(accelerator)
    native_save_state = getattr(type(accelerator).save_state, "__asyncckpt_original__", native_save_state)

    def timed(method: str, rep: int) -> dict:
        path = os.path.join(root, f"{method}-{rep}")
        dist.barrier()
        started = time.perf_counter()
        if method == "memcpy":
            return {"stall_s": memcpy()}
        if method == "raw_write":
            return {"durable_s": raw()}
        if method == "native":
            native_save_state(accelerator, path)
            dist.barrier()
            return {"stall_s": time.perf_counter() - started, "durable_s": time.perf_counter() - started}
        if method == "ours":
            accelerator.save_state(path)
            stall = time.perf_counter() - started
            handle.checkpointer.wait(everywhere=True)
            return {"stall_s": stall, "durable_s": time.perf_counter() - started}
        import torch.distributed.checkpoint as dcp

        future = dcp.async_save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)},
                                checkpoint_id=path)
        stall = time.perf_counter() - started
        future.result()
        dist.barrier()
        return {"stall_s": stall, "durable_s": time.perf_counter() - started}

    rows: dict[str, list[dict]] = {method: [] for method in METHODS}
    for rep in range(args.reps + 1):  # rep 0 warms every method's caches
        for method in METHODS:
            rows[method].append({"rep": rep, **timed(method, rep)})
            dist.barrier()
            if rank == 0:
                shutil.rmtree(os.path.join(root, f"{method}-{rep}"), ignore_errors=True)
            dist.barrier()
    handle.remove()
    raw.close()
    out.put((rank, {"shard_bytes": shard_bytes, "rows": rows}))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "fsdp.json"))
    parser.add_argument("--markdown", default=str(REPO / "docs" / "benchmarks_fsdp.md"))
    args = parser.parse_args()

    root = tempfile.mkdtemp(prefix="fsdp_bench_", dir=args.dir)
    monitor = CpuMonitor().start()
    load_before, started = os.getloadavg(), time.perf_counter()
    context = mp.get_context("spawn")
    out = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank, args=(rank, 2, port, args, root, out)) for rank in range(2)]
    for process in processes:
        process.start()
    results = dict(out.get(timeout=3600) for _ in processes)
    for process in processes:
        process.join(60)
    monitor.stop()
    shutil.rmtree(root, ignore_errors=True)
    report = summarize(results, args)
    report.update(machine={"load_before": load_before, "load_after": os.getloadavg(),
                           **monitor.window(started, time.perf_counter()), "platform": platform.platform()},
                  git=git_meta(), torch=torch.__version__)
    Path(args.json).write_text(json.dumps(report, indent=1))
    Path(args.markdown).write_text(render(report))
    print(render(report))
    return 0


def summarize(results: dict, args: argparse.Namespace) -> dict:
    """Per method and rep, the slower rank; medians over the reps after the first."""
    per_rep: dict[str, list[dict]] = {}
    for method in METHODS:
        reps = zip(*(results[rank]["rows"][method] for rank in sorted(results)))
        per_rep[method] = [{key: max(row.get(key, 0.0) for row in rows) for key in ("stall_s", "durable_s")}
                           for rows in reps]
    median = {method: {key: statistics.median(r[key] for r in rows[1:]) if len(rows) > 1 else None
                       for key in ("stall_s", "durable_s")} for method, rows in per_rep.items()}
    return {"total_mib": args.total_mib, "reps": args.reps,
            "shard_bytes": [results[rank]["shard_bytes"] for rank in sorted(results)],
            "per_rep": per_rep, "median": median}


def render(report: dict) -> str:
    m = report["median"]
    memcpy, raw, native = m["memcpy"]["stall_s"], m["raw_write"]["durable_s"], m["native"]["durable_s"]

    def row(name: str, method: str) -> str:
        stall, durable = m[method]["stall_s"], m[method]["durable_s"]
        return (f"| {name} | {stall:.3f} | {stall / memcpy:.2f}x | {durable:.3f} | {durable / raw:.2f}x | "
                f"{native / durable:.1f}x |")

    goals = [("stall <= 1.3x memcpy of the rank's shard", m["ours"]["stall_s"] / memcpy, 1.3, "<="),
             ("durable <= 1.3x raw O_DIRECT write of the shard", m["ours"]["durable_s"] / raw, 1.3, "<="),
             (">= 5x faster to durable than Accelerate's own save", native / m["ours"]["durable_s"], 5.0, ">=")]
    machine = report["machine"]
    lines = [
        "# FSDP2 checkpoints on 2 ranks: Accelerate's save_state, asynchronous",
        "",
        "Produced by `benchmarks/fsdp_bench.py` (method in its docstring); JSON in `benchmarks/results/fsdp.json`.",
        f"{report['total_mib']} MiB of parameters + Adam moments over 2 gloo ranks on CPU (FSDP2 `fully_shard`, "
        f"`SHARDED_STATE_DICT`), {report['shard_bytes'][0] / 2**20:.0f} MiB per rank; medians of {report['reps']} reps "
        "after a warm-up rep, each the slower rank's figure.",
        "",
        f"Machine during the run: load average {machine['load_before'][0]:.2f} before, {machine['load_after'][0]:.2f} "
        f"after; other processes used {machine.get('foreign_cpu_cores_mean', 0):.2f} cores on average "
        f"(max {machine.get('foreign_cpu_cores_max', 0):.2f}) of 2. torch {report['torch']}, commit "
        f"{report['git']['git_commit'][:10]}.",
        "",
        "| | stall s | / memcpy | durable s | / raw write | native / this, durable |",
        "|---|---|---|---|---|---|",
        f"| memcpy of the shard (floor) | {memcpy:.3f} | 1.00x | | | |",
        f"| raw O_DIRECT write of the shard (floor) | | | {raw:.3f} | 1.00x | |",
        row("Accelerate's own save_state (synchronous)", "native"),
        row("**save_state with asyncckpt**", "ours"),
        row("`dcp.async_save` (thread)", "dcp_async"),
        "",
        "| goal | measured | met |",
        "|---|---|---|",
        *[f"| {name} | {value:.2f} | {'yes' if (value <= limit if op == '<=' else value >= limit) else '**no**'} |"
          for name, value, limit, op in goals],
        "",
        "Warm-up rep (first save of each method: our staging buffers are allocated and the plan is made here):",
        "",
        "| | stall s | durable s |",
        "|---|---|---|",
        *[f"| {method} | {report['per_rep'][method][0]['stall_s']:.3f} | {report['per_rep'][method][0]['durable_s']:.3f} |"
          for method in ("native", "ours", "dcp_async")],
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
