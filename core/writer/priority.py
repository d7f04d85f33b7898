"""The writer's share of the node's CPU: the training's where the node has none to spare, only the idle CPU where it has.

More: docs/MODULES.md, core/writer/priority.py.
"""
from __future__ import annotations

import os
import threading
import time
from typing import NamedTuple, Optional

IDLE_CORES = 0.5  # cores left idle (averaged since the previous batch) from which the writer takes only idle CPU
LOWEST = 19
PERIOD_S = 0.25  # how often a writer at the lowest priority checks that it is not starved
STARVED = 0.05  # the writer's threads ran for less than this share of the time they waited for a core
_MIN_WINDOW_S = 0.5  # a shorter gap between batches (one save's requests arriving in parts) keeps the choice made
_AUTOGROUP = "/proc/self/autogroup"
_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


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


class _Sample(NamedTuple):
    at: float  # monotonic seconds
    idle: float  # CPU-seconds the node's cores sat idle (idle and iowait) since boot
    ours: float  # CPU-seconds of this process (every thread)


def _sample() -> Optional[_Sample]:
    try:
        with open("/proc/stat") as f:
            ticks = [int(value) for value in f.readline().split()[1:6]]
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        ours = (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime
    except (OSError, ValueError, IndexError):
        return None
    return _Sample(time.monotonic(), (ticks[3] + ticks[4]) * _TICK_S, ours)


def _threads_run_and_wait() -> tuple[float, float]:
    """Seconds this process's threads have run, and waited runnable for a core, since each started."""
    run = wait = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/schedstat") as f:
                ran, waited = f.read().split()[:2]
        except (OSError, ValueError):
            continue  # a thread that ended meanwhile
        run, wait = run + int(ran), wait + int(waited)
    return run / 1e9, wait / 1e9


class CpuShare:
    """The writer's priority: chosen before each batch of requests (``choose``) from the idle CPU since the end of the
    previous one (``settle``), given up while starved (a thread of its own, until the writer exits)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lowest = False
        self._since = _sample()
        threading.Thread(target=self._watch, name="asyncckpt-cpu-share", daemon=True).start()

    def settle(self) -> None:
        """A batch is done: the window the next choice looks at starts now."""
        self._since = _sample()

    def choose(self) -> None:
        """Before a batch: the lowest priority if the node left at least ``IDLE_CORES`` idle since the last batch
        (beyond what this writer used), else the training's; the choice made stays where that window is too short
        to tell."""
        before, now = self._since, _sample()
        if before is None or now is None or now.at - before.at < _MIN_WINDOW_S:
            return
        # idle time, not the cores less their busy time: a virtual machine's cores also lose time to its host
        # (steal), which no process of the node can use
        spare = ((now.idle - before.idle) + (now.ours - before.ours)) / (now.at - before.at)
        self._set(spare >= IDLE_CORES)

    def _set(self, lowest: bool) -> None:
        with self._lock:
            self._lowest = set_group_nice(LOWEST if lowest else 0) is not None and lowest

    def _watch(self) -> None:
        """Looks only while the writer is at the lowest priority (two looks apart: starved within ``2 * PERIOD_S``)."""
        before: Optional[tuple[float, float]] = None
        while True:
            time.sleep(PERIOD_S)
            if not self._lowest:
                before = None
                continue
            now = _threads_run_and_wait()
            if before is not None:
                ran, waited = now[0] - before[0], now[1] - before[1]
                if waited > PERIOD_S / 2 and ran < STARVED * waited:
                    self._set(False)
            before = now
