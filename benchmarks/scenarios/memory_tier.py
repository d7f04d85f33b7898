"""The memory tier: what a save costs and a restart takes, from node memory against storage.

One rank saves a state of ``size_mib`` (an Adam-like mix of tensors) with ``async_save``: durably (to the disk), and
with the memory tier (committed in tmpfs first, every save in memory, the durable copy written from memory behind
it). Per save: the stall (the call), the time to committed in memory, the time to durable. Then a restart (a fresh
process) loads the checkpoint: from this node's memory, from the disk with its pages evicted (cold), and from the
disk cached. Against the machine: a held memcpy of the same bytes (the floor of a load from memory) and a cold read
of them. From the measured costs, the work a day of failures loses against the checkpoint interval, with and
without the tier (``asyncckpt.core.api.interval``).
"""
from __future__ import annotations

import os
import shutil

from harness import Option, Scenario
from harness.machine import evict
from harness.report import bars, fmt, table
from harness.util import median, now
from harness.workloads import flat_tensors, make_adam, n_tensors, state_bytes, zeros_like_state

ARMS = ("durable", "memory")


def saves(size_mib: int, reps: int, root: str, memory_root: str, tier: bool) -> dict:
    """``reps`` saves of the state in this process: stall, committed (in memory, or durable) and durable times."""
    os.environ["ASYNCCKPT_MEMORY_ROOT"] = memory_root
    from asyncckpt.core import Checkpointer, MemoryTier

    state = make_adam(size_mib << 20)
    options = {"memory_tier": MemoryTier(persist_every=1, keep=2, replicas=0)} if tier else {}
    rows: dict[str, list[float]] = {"stall_s": [], "committed_s": [], "durable_s": []}
    with Checkpointer(**options) as checkpointer:
        checkpointer.save(state, os.path.join(root, "warmup"), step=0)  # plan and staging buffer warm
        for rep in range(1, reps + 1):
            path = os.path.join(root, f"step_{rep}")
            t0 = now()
            handle = checkpointer.async_save(state, path, step=rep)
            rows["stall_s"].append(now() - t0)
            handle.result()
            rows["committed_s"].append(now() - t0)
            checkpointer.wait_for(path)  # its durable copy (with the tier, written from memory behind it)
            rows["durable_s"].append(now() - t0)
    return {"state_bytes": state_bytes(state), "tensors": n_tensors(state), "reps": rows}


def restart(size_mib: int, path: str, cold: bool) -> dict:
    """A fresh process loads ``path`` (evicted from the page cache first, where ``cold``): the load's seconds."""
    from asyncckpt import core

    target = zeros_like_state(make_adam(size_mib << 20))
    if cold:
        evict([os.path.join(directory, name) for directory, _, names in os.walk(path) for name in names])
    t0 = now()
    core.load(target, path)
    return {"load_s": now() - t0}


def memcpy(size_mib: int, reps: int) -> dict:
    """A copy of the same tensors into memory the process holds: the floor of a load from memory."""
    import torch

    sources = list(flat_tensors(make_adam(size_mib << 20)).values())
    targets = [torch.empty_like(t) for t in sources]
    torch._foreach_copy_(targets, sources)
    times = []
    for _ in range(reps):
        t0 = now()
        torch._foreach_copy_(targets, sources)
        times.append(now() - t0)
    return {"memcpy_s": times}


def measure(sitting) -> dict:
    o = sitting.o
    out: dict = {"saves": {}, "restart": {}}
    memory_root = sitting.directory("memory_root")
    for _, run in sitting.abba(sitting.runs(list(ARMS)), 2):
        root = sitting.directory(f"run_{run.label}")
        with sitting.phase(f"saves {run.label}"):
            found = sitting.child("saves", size_mib=o.size_mib, reps=o.reps, root=root, memory_root=memory_root,
                                  tier=run.label == "memory")
        entry = out["saves"].setdefault(run.label, {"state_bytes": found["state_bytes"], "tensors": found["tensors"],
                                                    "reps": {k: [] for k in found["reps"]}})
        for key, values in found["reps"].items():
            entry["reps"][key] += values
        shutil.rmtree(root, ignore_errors=True)
    # a restart's sources: one checkpoint in memory, one on the disk (the memory root kept by a run that "died")
    root = sitting.directory("restart")
    kept = sitting.child("saves_kept", size_mib=o.size_mib, root=root, memory_root=memory_root)
    sources = {"memory": kept["memory"], "disk (cold)": kept["durable"], "disk (cached)": kept["durable"]}
    for _ in range(o.reps):
        for source, path in sources.items():
            with sitting.phase(f"restart {source}"):
                out["restart"].setdefault(source, []).append(
                    sitting.child("restart", size_mib=o.size_mib, path=path, cold=source == "disk (cold)")["load_s"])
    out["memcpy"] = sitting.child("memcpy", size_mib=o.size_mib, reps=o.reps)["memcpy_s"]
    out["failures_per_day"] = o.failures_per_day
    return out


def saves_kept(size_mib: int, root: str, memory_root: str) -> dict:
    """One checkpoint in memory and on the disk, and a copy of the memory one kept where a killed run would have
    left it (this run, ending normally, empties its tier): the restart's sources."""
    os.environ["ASYNCCKPT_MEMORY_ROOT"] = memory_root
    from asyncckpt.core import Checkpointer, MemoryTier
    from asyncckpt.core.storage import tier

    durable = os.path.join(root, "kept")
    memory = os.path.join(memory_root, "killed-run", "kept")
    with Checkpointer(memory_tier=MemoryTier(persist_every=1, keep=1, replicas=0)) as checkpointer:
        checkpointer.save(make_adam(size_mib << 20), durable, step=1)
        checkpointer.wait()
        shutil.copytree(tier.memory_path(durable), memory)
    return {"memory": memory, "durable": durable}


def _losses(result: dict) -> dict:
    """The least-loss interval and the loss per day, with and without the tier, at the measured costs."""
    from asyncckpt.core.api import interval

    saves, rate = result["figures"]["saves"], result["figures"]["failures_per_day"]
    stall = median(saves["memory"]["reps"]["stall_s"])
    durable_s = median(saves["durable"]["reps"]["committed_s"])
    memory_s = median(saves["memory"]["reps"]["committed_s"])
    restart = result["figures"]["restart"]
    return {"durable": interval.least_loss(stall, durable_s, median(restart["disk (cold)"]), rate),
            "memory": interval.least_loss(stall, memory_s, median(restart["memory"]), rate)}


def render(result: dict) -> str:
    figures = result["figures"]
    saves = figures["saves"]
    first = next(iter(saves.values()))
    memcpy_s = median(figures["memcpy"])
    lines = [f"{first['state_bytes'] / 2**30:.2f} GiB in {first['tensors']} tensors, one rank; medians in seconds over "
             f"{result['options']['reps']} saves per arm and sitting half (ABBA).", "",
             *table(["", "stall", "committed (memory, or durable)", "durable", "stall / memcpy"],
                    [[name, fmt(median(saves[arm]["reps"]["stall_s"])), fmt(median(saves[arm]["reps"]["committed_s"])),
                      fmt(median(saves[arm]["reps"]["durable_s"])),
                      fmt(median(saves[arm]["reps"]["stall_s"]) / memcpy_s, ".2f") + "x"]
                     for arm, name in (("durable", "durable only"), ("memory", "**memory tier**"))]), "",
             "A restart (a fresh process, `core.load` of the newest checkpoint):", "",
             *table(["source", "load s", "x memcpy", "vs disk (cold)"],
                    [[source, fmt(median(times)), fmt(median(times) / memcpy_s, ".2f") + "x",
                      fmt(median(figures["restart"]["disk (cold)"]) / median(times), ".1f") + "x faster"]
                     for source, times in figures["restart"].items()]), "",
             f"memcpy of the same tensors (held memory): {fmt(memcpy_s)} s."]
    losses = _losses(result)
    lines += ["", f"At {figures['failures_per_day']:g} failure(s) a day (`api.interval`, Young/Daly):", "",
              *table(["", "least-loss interval", "lost per failure", "lost per day"],
                     [[name, f"{loss.seconds:.0f} s", f"{loss.lost_per_failure_s:.1f} s", f"{loss.lost_per_day_s:.0f} s"]
                      for name, loss in (("durable only", losses["durable"]), ("**memory tier**", losses["memory"]))])]
    return "\n".join(lines)


def plot(result: dict, figure) -> None:
    from asyncckpt.core.api import interval

    restart_axes, loss_axes = figure.subplots(1, 2)
    sources = list(result["figures"]["restart"])
    bars(restart_axes, sources, [median(result["figures"]["restart"][s]) for s in sources], "restart load, s")
    saves, rate = result["figures"]["saves"], result["figures"]["failures_per_day"]
    stall = median(saves["memory"]["reps"]["stall_s"])
    intervals = [10 * 1.25 ** k for k in range(40)]
    for name, safe, restart_s in (("durable only", median(saves["durable"]["reps"]["committed_s"]),
                                   median(result["figures"]["restart"]["disk (cold)"])),
                                  ("memory tier", median(saves["memory"]["reps"]["committed_s"]),
                                   median(result["figures"]["restart"]["memory"]))):
        loss = [86400 / t * stall + rate * (max(t, safe) / 2 + restart_s) for t in intervals]
        loss_axes.plot(intervals, loss, label=f"{name} (least at {interval.least_loss(stall, safe, restart_s, rate).seconds:.0f} s)")
    loss_axes.set_xscale("log")
    loss_axes.set_xlabel("checkpoint interval, s")
    loss_axes.set_ylabel(f"work lost per day, s ({rate:g} failure(s)/day)")
    loss_axes.legend()


SCENARIO = Scenario(
    title="The memory tier: saves and restarts from node memory",
    question=__doc__.split("\n\n", 1)[1].strip().replace("\n", " "),
    measure=measure, render=render, plot=plot,
    options={"size_mib": Option(1024, 32), "failures_per_day": Option(1.0, 1.0)},
    reps=(5, 1),
    limits=("memcpy", "odirect_write", "cold_read"),
)
