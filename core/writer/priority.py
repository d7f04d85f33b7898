"""The writer's share of the node's CPU: the training's where the node has none to spare, only the idle CPU where it has.

The background writer competes with the training process for the node's cores. Where training leaves cores idle (a
GPU trainer's CPU), whatever the writer takes from the training's own cores is lost for nothing: at the lowest priority
its work runs on the idle cores instead. Where training keeps every core busy, the lowest priority starves the writer
for no less slowdown in all: the work is the same, only later, and the next save waits for it. Measured with the
memory tier's saves (docs/DESIGN.md, Measured): with a core idle, a one-thread training loop ran 10-13% slower beyond
the saves' stalls at the training's priority, 2-3% at the lowest (commits 1.7 -> 2.2 s); with every core busy, the
lowest priority left the slowdown as it was and made the commits take 12-16 s instead of ~2 s, stalling saves that
found their buffer still in use.

So, before each batch of requests, the writer looks at how much CPU the node left idle since its previous batch
(``/proc/stat``) and takes the lowest priority only where at least ``IDLE_CORES`` were. The priority is its scheduling
group's (``/proc/self/autogroup``): the writer has a session of its own, and with it, where the kernel groups by
session (``sched_autogroup_enabled``), a group that competes with the training's as an equal whatever its threads'
nice values. A process may raise its group's nice value and lower it back to 0 without privileges. Where there is no
such group, nothing changes.

Kept free of torch: the background writer uses it.
"""
from __future__ import annotations

import os
import time
from typing import Optional

IDLE_CORES = 0.5  # idle cores (averaged since the previous batch) from which the writer takes only idle CPU
LOWEST = 19
_MIN_WINDOW_S = 0.5  # a shorter gap between batches (one save's requests arriving in parts) keeps the choice made
_AUTOGROUP = "/proc/self/autogroup"


def set_group_nice(nice: int) -> Optional[int]:
    """Set the nice value of this process's scheduling group; the one it had (None: no such group here)."""
    try:
        with open(_AUTOGROUP) as f:
            previous = int(f.read().rsplit("nice", 1)[1])
        with open(_AUTOGROUP, "w") as f:
            f.write(str(nice))
    except (OSError, ValueError, IndexError):
        return None
    return previous


def _idle_seconds() -> Optional[float]:
    """CPU-seconds the node's cores have spent idle (idle and iowait) since boot; None where ``/proc/stat`` is not."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return (int(fields[4]) + int(fields[5])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class CpuShare:
    """The writer's priority, chosen before each batch of requests (``choose``) from the idle CPU since the end of the
    previous one (``settle``)."""

    def __init__(self) -> None:
        self._since: tuple[float, Optional[float]] = (time.monotonic(), _idle_seconds())

    def settle(self) -> None:
        """A batch is done: the window the next choice looks at starts now."""
        self._since = (time.monotonic(), _idle_seconds())

    def choose(self) -> None:
        """Before a batch: the lowest priority if the node left at least ``IDLE_CORES`` idle since the last batch,
        else the training's; the choice made stays where that window is too short to tell."""
        started, idle_then = self._since
        idle_now, seconds = _idle_seconds(), time.monotonic() - started
        if idle_then is None or idle_now is None or seconds < _MIN_WINDOW_S:
            return
        set_group_nice(LOWEST if (idle_now - idle_then) / seconds >= IDLE_CORES else 0)
