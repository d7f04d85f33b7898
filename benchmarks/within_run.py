"""What checkpointing costs a training run, measured inside that one run.

This machine's speed drifts by several percent between runs minutes apart (freed memory handed back
to the VM's host, a shared virtio disk), so comparing a run with saves against another run without
them mixes the saves' cost with that drift. Inside one run the drift is small: the steps that no save
touched give the run's own step time, and the saves cost their stalls plus whatever extra time the
few steps after each save took (the background write competing for the cores). Run on a run without
saves, around the steps where saves would have been, the same computation gives the noise floor.
"""
from __future__ import annotations

import statistics
from typing import Iterable

AFFECTED_STEPS = 4  # steps after a save that a background write (or the kernel's writeback) may slow down


def within_run_slowdown(step_seconds: dict[int, float], saves: Iterable[int], stalls_s: float,
                        affected_steps: int = AFFECTED_STEPS) -> dict:
    """``step_seconds``: the measured window's steps (step number -> seconds, a save's own time
    excluded); ``saves``: the steps after which a save ran (or would have); ``stalls_s``: the time
    the window's saves blocked the loop. Returns the run's undisturbed step time, the stalls, the
    extra time of the affected steps, and ``slowdown`` = (stalls + extra) / (window steps x step time).
    """
    affected = {save + k for save in saves for k in range(1, affected_steps + 1)} & step_seconds.keys()
    base = statistics.median(seconds for step, seconds in step_seconds.items() if step not in affected)
    extra = sum(step_seconds[step] - base for step in affected)
    return {"base_step_s": base, "stalls_s": stalls_s, "extra_step_time_s": extra,
            "slowdown": (stalls_s + extra) / (len(step_seconds) * base)}
