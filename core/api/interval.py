"""How often to checkpoint: the interval that loses the least work (Young 1974, Daly 2006), from measured costs.

A failure loses the work since the last checkpoint that survives it, on average half an interval ``T``, plus the
restart ``R``; each checkpoint costs training its stall ``C``. Over a mean time between failures ``M``, the work
lost per unit of time is ``C / T + (T / 2 + R) / M``, least at Young's ``T = sqrt(2 C M)`` (Daly's refinement
changes it by less than ``C``, which is milliseconds here). An interval can be no shorter than the time a
checkpoint takes to become safe (asyncckpt lets ``max_in_flight`` saves queue, and a checkpoint not yet safe
protects nothing): the durable write without the memory tier, the memory commit with it. That floor is what the
memory tier changes, with the restart: a process restart (most failures) reloads from memory.

The costs come from the run itself (the first durable save: its stall, its durable write, its memory commit); the
failure rate from the user (``failures_per_day``, default one a day: docs/memory_tier.md says why).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

DAY_S = 86400.0


@dataclass(frozen=True)
class Interval:
    """The least-loss checkpoint interval for one way of saving, and what a failure then costs."""

    seconds: float  # the interval
    floor_s: float  # the time a checkpoint takes to become safe: no interval is shorter
    lost_per_failure_s: float  # half an interval, plus the restart
    lost_per_day_s: float  # the stalls of a day's checkpoints, plus a day's failures' losses


def least_loss(stall_s: float, safe_after_s: float, restart_s: float, failures_per_day: float) -> Interval:
    """Young's interval ``sqrt(2 C M)`` for a stall ``C`` and a mean time between failures ``M``, no shorter than
    the ``safe_after_s`` a checkpoint takes to become safe; with the ``restart_s`` a failure adds."""
    mtbf = DAY_S / max(failures_per_day, 1e-9)
    seconds = max(math.sqrt(2 * max(stall_s, 1e-6) * mtbf), safe_after_s)
    lost = seconds / 2 + restart_s
    return Interval(seconds, safe_after_s, lost, DAY_S / seconds * stall_s + failures_per_day * lost)


@dataclass(frozen=True)
class Advice:
    """The line a run logs, and the interval it recommends for that run (with the memory tier, the tier's)."""

    line: str
    seconds: float


def advice(stall_s: float, durable_s: float, failures_per_day: float,
           memory_commit_s: Optional[float] = None) -> Advice:
    """The least-loss interval from this run's costs, without the memory tier and with it (a restart from storage
    takes about as long as the write did; from memory, as long as the memory commit did)."""
    durable = least_loss(stall_s, durable_s, durable_s, failures_per_day)
    line = (f"asyncckpt: at {failures_per_day:g} failure(s) a day (failures_per_day), checkpointing every "
            f"{human(durable.seconds)} loses the least work (Young/Daly; this run: stall {stall_s:.3f} s, durable in "
            f"{durable_s:.1f} s): {human(durable.lost_per_failure_s)} lost per failure")
    if memory_commit_s is None:
        return Advice(line, durable.seconds)
    memory = least_loss(stall_s, memory_commit_s, memory_commit_s, failures_per_day)
    line += (f"; with the memory tier (committed in memory in {memory_commit_s:.2f} s) every "
             f"{human(memory.seconds)}, {human(memory.lost_per_failure_s)} lost per process restart")
    return Advice(line, memory.seconds)


def human(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h"
