"""What checkpointing costs a training run: the adapter scenarios' shared measurement.

Each arm (no checkpoints, the framework's own saving, asyncckpt, the raw-write floor, ...) trains the
same model from the same seed in a fresh process (``StepLog`` records it there); the arms alternate
(ABBA) over the sitting. Per run: each step's time, each save's stall and a held memcpy of the same
tensors right before it (the machine's copy speed drifts within a minute, so each stall is judged
against its own), each ``optimizer.step()``'s time where the loop shows it, the drain at the end.

The first save (at step ``every``: buffers allocated, the writer started) is reported apart, together
with the next step's wait for it. The window runs from step ``every + 1`` to the last step.

Slowdown, two ways:
- **within the run** (``within_run``): (the window's stalls + the extra time of the ``AFFECTED_STEPS``
  steps after each save over the run's own undisturbed step time) / (window steps x that step time).
  The drift of a shared machine between runs does not reach it; the same computation on the runs
  without saves, around the steps where saves would have been, is its noise floor.
- **against the runs without checkpoints**: window wall time / theirs - 1 (at the mercy of the load).
"""
from __future__ import annotations

import statistics
from typing import Callable, Iterable, Optional

from . import report
from .floors import HeldMemcpy, RawWriter
from .report import arm_name, each, fmt, pct, table
from .util import median, now, spread

AFFECTED_STEPS = 4  # steps after a save that a background write (or the kernel's writeback) may slow down
# glibc keeps freed memory: per-step allocations must not fault fresh pages from the VM's host (~0.3 GB/s)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(64 << 30)}


def within_run(step_s: dict[int, float], saves: Iterable[int], stalls_s: float) -> dict:
    """``step_s``: the window's steps (a save's own time excluded); ``saves``: the steps after which a save
    ran (or would have); ``stalls_s``: the time the window's saves blocked the loop."""
    affected = {save + k for save in saves for k in range(1, AFFECTED_STEPS + 1)} & step_s.keys()
    if len(affected) == len(step_s):
        return {"slowdown": None}  # saves too close together to leave an undisturbed step
    base = statistics.median(s for step, s in step_s.items() if step not in affected)
    extra = sum(step_s[step] - base for step in affected)
    return {"base_step_s": base, "stalls_s": stalls_s, "extra_step_time_s": extra,
            "slowdown": (stalls_s + extra) / (len(step_s) * base)}


class StepLog:
    """A training run's clock, in its process: call ``began(step)`` / ``ended(step)`` around each step's
    computation, ``save(step, call, tensors)`` for each checkpoint, ``optimizer(step, seconds)`` where
    the loop times ``optimizer.step()``; ``result()`` at the end."""

    def __init__(self, mode: str, every: int, steps: int) -> None:
        self.mode, self.every, self.steps = mode, every, steps
        self.start: dict[int, float] = {}
        self.end: dict[int, float] = {}
        self.saves: list[dict] = []
        self.optimizer_s: dict[int, float] = {}
        self.memcpy = HeldMemcpy()
        self.raw: Optional[RawWriter] = None
        self.state_bytes = self.tensors = 0

    def began(self, step: int) -> None:
        self.start[step] = now()

    def ended(self, step: int) -> None:
        self.end[step] = now()

    def optimizer(self, step: int, seconds: float) -> None:
        self.optimizer_s[step] = seconds

    def save(self, step: int, call: Callable[[], None], tensors: list, directory: str) -> None:
        """Time ``call()`` (the arm's save), after a held memcpy of ``tensors`` (not counted in the window).
        The raw-write arm writes the same bytes from another process instead."""
        memcpy_s, self.state_bytes, self.tensors = self.memcpy(tensors)
        if self.mode == "raw_write" and self.raw is None:
            self.raw = RawWriter(self.state_bytes, directory)  # started at the first save (reported apart)
        t0 = now()
        self.raw.start() if self.mode == "raw_write" else call()
        self.saves.append({"step": step, "stall_s": now() - t0, "memcpy_s": memcpy_s})

    def result(self, returned: float, **extra) -> dict:
        """``returned``: when the framework's run returned (the last write drained)."""
        if self.raw is not None:
            self.raw.close()
        first = self.every + 1
        window_memcpy = sum(s["memcpy_s"] for s in self.saves if first <= s["step"] < self.steps)
        return {"mode": self.mode, "state_bytes": self.state_bytes, "tensors": self.tensors,
                "step_s": {str(s): self.end[s] - self.start[s] for s in self.end if s in self.start},
                "saves": self.saves, "optimizer_s": {str(k): v for k, v in self.optimizer_s.items()},
                "window_s": self.end[self.steps] - self.start[first] - window_memcpy,
                "drain_s": returned - self.end[self.steps], **extra}


# ------------------------------------------------------------------------------------------ the parent
def measure(sitting, arms: Iterable[str], revisioned: Iterable[str], **config) -> dict:
    """Every arm ``sitting.o.reps`` times in ABBA order, each in a fresh child running the scenario's
    ``train(mode=..., **config)``."""
    runs = []
    for rnd, run in sitting.abba(sitting.runs(list(arms), revisioned), sitting.o.reps):
        result = sitting.child("train", revision=run.revision, env=MALLOC_ENV, mode=run.arm, **config)
        result.update(label=run.label, round=rnd)
        sitting.log(f"{run.label}: window {result['window_s']:.1f} s, stalls "
                    f"{each([s['stall_s'] for s in result['saves']])}, load {result['_child']['loadavg'][0]:.1f}")
        runs.append(result)
    return {"config": config, "runs": runs, "summary": summarize(runs, config["every"], config["steps"])}


def _per_run(run: dict, every: int, steps: int) -> dict:
    step_s = {int(k): v for k, v in run["step_s"].items()}
    optimizer = {int(k): v for k, v in run["optimizer_s"].items()}
    after_save = {s["step"] + 1 for s in run["saves"]} | {k * every + 1 for k in range(1, steps // every + 1)}
    usual = median(v for k, v in optimizer.items() if k not in after_save)
    wait = {s["step"]: max(0.0, optimizer[s["step"] + 1] - usual) if usual is not None and s["step"] + 1 in optimizer
            else None for s in run["saves"]}
    first_wait = wait.get(every) or 0.0
    window = {step: s for step, s in step_s.items() if every < step <= steps}
    if every + 1 in window:
        window[every + 1] -= first_wait  # the first save's wait is the first save's
    in_window = [s for s in run["saves"] if every < s["step"] < steps]
    would_be = range(every, steps, every)  # where saves are, or would be in the runs without any
    return {"first": [s["stall_s"] + first_wait for s in run["saves"] if s["step"] == every],
            "pairs": [(s["stall_s"], s["memcpy_s"]) for s in in_window],
            "waits": [wait[s["step"]] for s in in_window if wait[s["step"]] is not None],
            "within_run": within_run(window, would_be, sum(s["stall_s"] for s in in_window))["slowdown"],
            "window_s": run["window_s"] - first_wait}


def summarize(runs: list[dict], every: int, steps: int) -> dict:
    none = [_per_run(r, every, steps) for r in runs if r["mode"] == "none"]
    base_window = median(r["window_s"] for r in none)
    rows = {}
    for label in dict.fromkeys(r["label"] for r in runs if r["mode"] != "none"):
        mine = [r for r in runs if r["label"] == label]
        per = [_per_run(r, every, steps) for r in mine]
        pairs = [p for x in per for p in x["pairs"]]
        rows[label] = {
            "first_save_s": [f for x in per for f in x["first"]],
            "stall_s": spread(s for s, _ in pairs), "memcpy_s": spread(m for _, m in pairs),
            "stall_over_memcpy": median(s / m for s, m in pairs),
            "stall_over_memcpy_per_save": [s / m for s, m in pairs],
            "next_step_wait_s": median(w for x in per for w in x["waits"]),
            "within_run": [x["within_run"] for x in per],
            "vs_none": [x["window_s"] / base_window - 1 for x in per] if base_window else [],
            "drain_s": [r["drain_s"] for r in mine],
            "loadavg": [r["_child"]["loadavg"] for r in mine],
        }
    return {"noise_floor_within_run": [x["within_run"] for x in none], "none_window_s": [x["window_s"] for x in none],
            "none_loadavg": [r["_child"]["loadavg"] for r in runs if r["mode"] == "none"], "arms": rows}


def render(result: dict, names: dict, setup: str) -> str:
    """The adapter pages' table: one row per arm (and revision)."""
    f = result["figures"]
    s, config = f["summary"], f["config"]
    run0 = next(r for r in f["runs"] if r["mode"] != "none")
    lines = [
        setup.format(state_mb=run0["state_bytes"] / 1e6, tensors=run0["tensors"], **config),
        "",
        f"Each arm trains in a fresh process, {result['options']['reps']} run(s) per arm, the arms alternating (ABBA). "
        f"Saves every {config['every']} steps; the first (step {config['every']}: buffers allocated, the writer "
        f"started) is reported apart; the window is steps {config['every'] + 1}..{config['steps']}. **stall** = the time "
        "the save call blocked training (median (min–max) over the window's saves); **memcpy** = copying the same "
        "tensors into held memory in the same process right before each save; **stall / memcpy** = the median of the "
        "per-save ratios; **next step's wait** = how much longer the `optimizer.step()` after a save took than the "
        "others (an overlapped snapshot finishing); **within run** = (stalls + the extra time of the "
        f"{AFFECTED_STEPS} steps after each save over the run's own step time) / (window steps x that step time), "
        "per run (noise floor, the same on the runs without checkpoints: "
        f"{each([100 * x for x in s['noise_floor_within_run']], '+.1f')} %); **vs no checkpoints** = window wall time / "
        f"the median of the runs without checkpoints ({each(s['none_window_s'], '.1f')} s) - 1. Goals: stall <= 1.2x "
        "memcpy, slowdown <= 5%.",
        "",
        *table(["arm", "first save s", "stall s", "memcpy s", "stall / memcpy", "next step's wait s", "within run",
                "vs no checkpoints", "drain s", "load average (per run)"],
               [[arm_name(label, names, result), each(row["first_save_s"], ".2f"), report.cell(row["stall_s"]),
                 fmt(row["memcpy_s"]["median"]), f"{fmt(row['stall_over_memcpy'], '.2f')}x",
                 fmt(row["next_step_wait_s"]), ", ".join(pct(x) for x in row["within_run"]),
                 ", ".join(pct(x) for x in row["vs_none"]), each(row["drain_s"], ".2f"),
                 "; ".join(f"{a:.1f}→{b:.1f}" for a, b in row["loadavg"])] for label, row in s["arms"].items()]),
        "Per-save stall / memcpy: " + "; ".join(f"{label}: {each(row['stall_over_memcpy_per_save'], '.2f')}"
                                                  for label, row in s["arms"].items()) + ".",
    ]
    return "\n".join(lines)


def plot(result: dict, figure) -> None:
    s = result["figures"]["summary"]["arms"]
    labels = list(s)  # the arms' keys: short, and "@before" marks the base revision's runs
    left, right = figure.subplots(1, 2)
    report.bars(left, labels, [row["stall_over_memcpy"] for row in s.values()], "stall / held memcpy", 1.2, "goal 1.2x")
    report.bars(right, labels, [100 * (median(row["within_run"]) or 0.0) for row in s.values()],
                "slowdown within the run, %", 5.0, "goal 5%")
