"""Where workload (b)'s stall and load sit against what torch and Python themselves allow here.

The core's goals judge a load against one sequential read from the page cache and the async stall
against one contiguous memcpy of the same bytes. With ~8,000 tensors part of each is the cost of
touching 8,000 tensors at all. The figures are split into their parts, rep after rep in rotation in one
process (this machine's copy speed differs between processes and drifts within minutes):

stall: ``memcpy`` (one ``dst.copy_(src)`` of the same bytes); ``foreach copy`` (one ``torch._foreach_copy_``
of every tensor into a held clone); ``copy + hand-off`` (the snapshot copy within ``async_save``, as its
handle reports it: ``timings["copy_s"]``); ``async_save`` (the whole call on a warm Checkpointer).
load: ``cached read`` (the data files from the page cache into one held buffer); ``reads`` (the planned
reads alone, checksums verified); ``planning`` (sidecars parsed, the state dict's keys matched and checked);
``core.load`` (the whole call, verified).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable

from harness import Option, Scenario
from harness.floors import AlignedBuffer, PairedMemcpy, read_files
from harness.report import bars, table
from harness.util import now, spread
from harness.workloads import iter_tensors, make_adam, n_tensors, reset_state, same_state, state_bytes, zeros_like_state


def rotate(rows: dict[str, Callable[[], float]], reps: int, before: Callable[[str], None]) -> dict[str, list[float]]:
    """Each row's seconds, ``reps`` times in rotation; a row returns its own seconds (rep 0 warms, dropped)."""
    times: dict[str, list[float]] = {row: [] for row in rows}
    for rep in range(reps + 1):
        for row, call in rows.items():
            before(row)
            seconds = call()
            if rep:
                times[row].append(seconds)
    return times


def timed(call: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        t0 = now()
        call()
        return now() - t0
    return run


def direct_load_parts(target: dict, path: str, threads: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(plan, read) of ``core.load``'s direct path, apart: ``plan()`` plans a load into ``target``, ``read()``
    runs the last plan. asyncckpt has no public seam for this split: these are the loading package's own
    functions, the one place a scenario reaches inside asyncckpt."""
    from asyncckpt.core.loading.direct_load import paused_gc, plan_direct_load
    from asyncckpt.core.storage import commit

    record, planned = commit.require_complete(path), []

    def plan() -> None:
        with paused_gc():
            planned[:] = [plan_direct_load(target, path, record, rank=0, strict=True, verify=True)]

    def read() -> None:
        with paused_gc():
            planned.pop().run(threads)
    return plan, read


def parts(size_mib: int, reps: int) -> dict:
    """Both tables' rows, in this process."""
    import torch

    from asyncckpt import core

    root = tempfile.mkdtemp(prefix="floors_")
    state = make_adam(size_mib << 20)
    with core.Checkpointer() as checkpointer:
        checkpointer.save(state, os.path.join(root, "load"))  # also warms the plan and the snapshot buffer
        sources = [t for _, t in iter_tensors(state)]
        held = [torch.zeros_like(t) for t in sources]
        copies: list[float] = []

        def async_save() -> float:
            t0 = now()
            handle = checkpointer.async_save(state, os.path.join(root, "stall"))
            seconds = now() - t0
            handle.result()  # outside the timing
            copies.append(handle.timings["copy_s"])
            return seconds

        stall = rotate({"memcpy": PairedMemcpy(state_bytes(state)),
                        "foreach copy": timed(lambda: torch._foreach_copy_(held, sources)), "async_save": async_save},
                       reps, lambda row: None)
        stall["copy + hand-off"] = copies[1:]
        held.clear()  # frees the clones before the loads
        path = os.path.join(root, "load")
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp"))
        buffer = AlignedBuffer(sum(os.path.getsize(f) for f in files))
        target = zeros_like_state(state)
        plan, read = direct_load_parts(target, path, checkpointer.io_threads)

        def prepare(row: str) -> None:  # outside the timing
            reset_state(target, state)
            if row == "reads":
                plan()

        load = rotate({"cached read": lambda: read_files(files, buffer.view)["s"], "reads": timed(read),
                       "planning": timed(plan), "core.load": timed(lambda: checkpointer.load(target, path))}, reps, prepare)
        if not same_state(target, state):
            raise AssertionError("core.load loaded values that differ from the saved state")
        buffer.close()
    shutil.rmtree(root, ignore_errors=True)
    return {"bytes": state_bytes(state), "tensors": n_tensors(state),
            "stall": {row: spread(v) for row, v in stall.items()}, "load": {row: spread(v) for row, v in load.items()}}


def measure(sitting) -> dict:
    return sitting.child("parts", size_mib=sitting.o.size_mib, reps=sitting.o.reps)


def render(result: dict) -> str:
    f = result["figures"]
    lines = [f"{f['bytes'] / 2**30:.3f} GiB in {f['tensors']} tensors (the core's workload (b)); {result['options']['reps']} "
             "reps of every row in rotation in one process, milliseconds, median (min–max); `x` = the row's median / the "
             "first row's.", ""]
    for section in ("stall", "load"):
        rows, first = f[section], next(iter(f[section].values()))["median"]
        lines += table([section, "ms", "x"], [[row, f"{1e3 * r['median']:.1f} ({1e3 * r['min']:.1f}–{1e3 * r['max']:.1f})",
                                               f"{r['median'] / first:.2f}"] for row, r in rows.items()])
    s = {row: r["median"] for row, r in f["stall"].items()}
    ld = {row: r["median"] for row, r in f["load"].items()}
    lines += [
        f"- **Stall.** The goal (<= 1.2x the memcpy) allows {1e3 * 1.2 * s['memcpy']:.1f} ms. The copy and the hand-off "
        f"take {1e3 * s['copy + hand-off']:.1f} ms ({s['copy + hand-off'] / s['memcpy']:.2f}x); everything else the call "
        f"does for {f['tensors']} tensors in Python (flatten, structure check, sources) adds "
        f"{1e3 * (s['async_save'] - s['copy + hand-off']):.1f} ms, against "
        f"{1e3 * max(0.0, 1.2 * s['memcpy'] - s['copy + hand-off']):.1f} ms left by the goal.",
        f"- **Load.** The goal (>= 0.8x the cached read's bandwidth, i.e. <= 1.25x its time) allows "
        f"{1e3 * 1.25 * ld['cached read']:.1f} ms. The verified reads alone take {1e3 * ld['reads']:.1f} ms "
        f"({ld['reads'] / ld['cached read']:.2f}x); planning takes {1e3 * ld['planning']:.1f} ms, against "
        f"{1e3 * max(0.0, 1.25 * ld['cached read'] - ld['reads']):.1f} ms left by the goal; the whole load "
        f"{1e3 * ld['core.load']:.1f} ms ({ld['core.load'] / ld['cached read']:.2f}x).", ""]
    return "\n".join(lines)


def plot(result: dict, figure) -> None:
    left, right = figure.subplots(1, 2)
    for ax, section in ((left, "stall"), (right, "load")):
        rows = result["figures"][section]
        bars(ax, list(rows), [1e3 * r["median"] for r in rows.values()], f"{section}: ms (median)")


SCENARIO = Scenario(
    title="Floors of workload (b): what torch and Python themselves cost",
    question=__doc__.split("\n\n", 1)[1].split("\n\nstall:")[0].strip().replace("\n", " "),
    measure=measure, render=render, plot=plot,
    options={"size_mib": Option(1024, 32)},
    reps=(9, 1),
)
