"""FSDP2 on 2 ranks: Accelerate's ``save_state()`` with the adapter, against Accelerate's own synchronous save
and ``torch.distributed.checkpoint.async_save`` of the same state dicts.

Two gloo processes on CPU; the model is wrapped with FSDP2's ``fully_shard`` and registered with the
Accelerator in FSDP mode by hand (Accelerate's launcher refuses FSDP without GPUs), ``SHARDED_STATE_DICT``:
each rank saves its half. Each rep, on both ranks at once, a barrier between each: a held memcpy of the
rank's shard bytes (the stall's floor), a durable O_DIRECT write of them from held memory, both ranks at
once (the floor of "durable"), Accelerate's own ``save_state`` (stall = durable), ``save_state`` with
``enable_async_checkpointing`` (durable: committed on every rank), ``dcp.async_save`` (its default, a
thread). A figure per rep is the slower rank's; the first rep of each method warms it and is reported apart.
"""
from __future__ import annotations

import os
import shutil
import statistics

from harness import Option, Scenario
from harness.floors import PairedMemcpy, PairedODirect
from harness.ranks import on_ranks
from harness.report import bars, fmt, side, table
from harness.util import now

METHODS = ("memcpy", "raw_write", "native", "ours", "dcp_async")
NAMES = {"native": "Accelerate's own `save_state` (synchronous)", "ours": "**`save_state` with asyncckpt**",
         "dcp_async": "`dcp.async_save` (thread)"}


def _rank(rank: int, world: int, total_mib: int, layers: int, reps: int, root: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    from asyncckpt.adapters.accelerate import enable_async_checkpointing

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    width = int(((total_mib << 20) / (3 * 4 * layers)) ** 0.5)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
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
    native_save_state = type(accelerator).save_state  # Accelerate's, before the adapter is on
    handle = enable_async_checkpointing(accelerator)

    def timed(method: str, path: str) -> dict:
        dist.barrier()
        started = now()
        if method == "memcpy":
            return {"stall_s": memcpy()}
        if method == "raw_write":
            return {"durable_s": raw()}
        if method == "native":
            native_save_state(accelerator, path)
            dist.barrier()
            return {"stall_s": now() - started, "durable_s": now() - started}
        if method == "ours":
            accelerator.save_state(path)
            stall = now() - started
            handle.checkpointer.wait(everywhere=True)
            return {"stall_s": stall, "durable_s": now() - started}
        future = dcp.async_save({"model": get_model_state_dict(model),
                                 "optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)
        stall = now() - started
        future.result()
        dist.barrier()
        return {"stall_s": stall, "durable_s": now() - started}

    rows: dict[str, list[dict]] = {method: [] for method in METHODS}
    for rep in range(reps + 1):  # rep 0 warms every method's caches
        for method in METHODS:
            path = os.path.join(root, f"{method}-{rep}")
            rows[method].append(timed(method, path))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
    handle.remove()
    raw.close()
    return {"shard_bytes": shard_bytes, "rows": rows}


def saves(total_mib: int, layers: int, reps: int, root: str) -> dict:
    """Both ranks' methods; per method and rep, the slower rank's figures."""
    ranks = on_ranks(_rank, 2, total_mib, layers, reps, root)
    per_rep = {m: [{k: max(r.get(k, 0.0) for r in rows) for k in ("stall_s", "durable_s")}
                   for rows in zip(*(rank["rows"][m] for rank in ranks))] for m in METHODS}
    return {"shard_bytes": [rank["shard_bytes"] for rank in ranks], "per_rep": per_rep}


def measure(sitting) -> dict:
    o = sitting.o
    return {run.label: sitting.child("saves", revision=run.revision, total_mib=o.total_mib, layers=o.layers,
                                     reps=o.reps, root=sitting.directory(f"saves_{run.label}"))
            for _, run in sitting.abba(sitting.runs(["asyncckpt"], {"asyncckpt"}), 1)}


def medians(found: dict) -> dict:
    return {m: {k: statistics.median(r[k] for r in rows[1:] or rows) for k in ("stall_s", "durable_s")}
            for m, rows in found["per_rep"].items()}


def render(result: dict) -> str:
    lines = []
    for label, found in result["figures"].items():
        m = medians(found)
        memcpy, raw, native = m["memcpy"]["stall_s"], m["raw_write"]["durable_s"], m["native"]["durable_s"]

        def row(method: str) -> list:
            stall, durable = m[method]["stall_s"], m[method]["durable_s"]
            return [NAMES[method], fmt(stall), f"{stall / memcpy:.2f}x", fmt(durable), f"{durable / raw:.2f}x",
                    f"{native / durable:.1f}x"]

        goals = [("stall <= 1.3x the memcpy of the rank's shard", m["ours"]["stall_s"] / memcpy, 1.3, "<="),
                 ("durable <= 1.3x the raw O_DIRECT write of the shard", m["ours"]["durable_s"] / raw, 1.3, "<="),
                 (">= 5x faster to durable than Accelerate's own save", native / m["ours"]["durable_s"], 5.0, ">=")]
        lines += [*([f"## asyncckpt{side(label, result)}", ""] if side(label, result) else []),
                  f"{result['options']['total_mib']} MiB of parameters + Adam moments over 2 ranks, "
                  f"{found['shard_bytes'][0] / 2**20:.0f} MiB per rank; medians of {result['options']['reps']} reps after a "
                  "warm-up rep, each the slower rank's figure.", "",
                  *table(["", "stall s", "/ memcpy", "durable s", "/ raw write", "native / this, durable"],
                         [["memcpy of the shard (floor)", fmt(memcpy), "1.00x", "", "", ""],
                          ["raw O_DIRECT write of the shard (floor)", "", "", fmt(raw), "1.00x", ""],
                          row("native"), row("ours"), row("dcp_async")]),
                  *table(["goal", "measured", "met"], [[g, f"{v:.2f}", "yes" if (v <= lim if op == "<=" else v >= lim)
                                                        else "**no**"] for g, v, lim, op in goals]),
                  "Warm-up rep (the first save of each method: snapshot buffers allocated, plans made):", "",
                  *table(["", "stall s", "durable s"], [[NAMES[k], fmt(found["per_rep"][k][0]["stall_s"]),
                                                          fmt(found["per_rep"][k][0]["durable_s"])]
                                                         for k in ("native", "ours", "dcp_async")])]
    return "\n".join(lines)


def plot(result: dict, figure) -> None:
    m = medians(result["figures"]["asyncckpt"])
    left, right = figure.subplots(1, 2)
    methods = ("memcpy", "native", "ours", "dcp_async")
    bars(left, list(methods), [m[k]["stall_s"] for k in methods], "stall s (median)")
    methods = ("raw_write", "native", "ours", "dcp_async")
    bars(right, list(methods), [m[k]["durable_s"] for k in methods], "durable s (median)")


SCENARIO = Scenario(
    title="FSDP2 checkpoints on 2 ranks: Accelerate's save_state, asynchronous",
    question=__doc__.split("\n\n", 1)[1].strip().replace("\n", " "),
    measure=measure, render=render, plot=plot,
    options={"total_mib": Option(1024, 24), "layers": Option(8, 2)},
    reps=(3, 1),
    revisioned=True,
)
