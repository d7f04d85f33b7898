"""How often to checkpoint: the interval that loses the least work (Young 1974, Daly 2006), from measured costs.

More: docs/MODULES.md, core/api/interval.py.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:
    from asyncckpt.core.client.handles import SaveHandle

DAY_S = 86400.0
logger = logging.getLogger("asyncckpt.core")


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


class Cadence:
    """One Checkpointer's saves as a run's cadence: the advice from its first durable checkpoint (``committed``),
    logged once at the save after it (``saving``) with the interval the run saves at; and one warning where a
    checkpoint took more than half the ``timeout``."""

    def __init__(self, timeout: float, failures_per_day: float, in_memory: Callable[[str], Any]) -> None:
        self._timeout, self._failures_per_day, self._in_memory = timeout, failures_per_day, in_memory
        self._advice: Optional[Advice] = None  # from the first durable save's costs (``committed``)
        self._advice_logged = False  # once, at the save after it (``saving``)
        self._saves: tuple[Optional[float], Optional[tuple[Optional[int], float]], int] = (None, None, 0)  # when the
        # first checkpoint was saved, (step, when) of the latest, and how many (of different steps): ``saving``
        self._warned_slow = False  # a checkpoint took more than half the timeout (``committed``), said once

    def committed(self, handle: "SaveHandle", seconds: float) -> None:
        """A checkpoint (or its durable copy) is done: one warning if it took more than half the ``timeout`` (a
        larger checkpoint, or slower storage, would make the waits for it give up); at the first that is durable,
        the checkpoint interval this run's measured costs make the least lossy, logged at the next save, which
        tells how often this run saves."""
        handle.timings["committed_s"] = seconds
        if handle.exception() is not None:
            return
        if seconds > self._timeout / 2 and not self._warned_slow:
            self._warned_slow = True
            logger.warning("asyncckpt: %s took %.0f s to be committed, more than half of timeout=%.0f s, which bounds "
                           "each wait for it and a writer that finishes it after a crash: set timeout to at least 3x "
                           "that (%.0f s) for checkpoints this size on this storage (docs/troubleshooting.md)",
                           handle.describe().removeprefix("saving "), seconds, self._timeout, 3 * seconds)
        if self._advice is not None:
            return
        memory = handle.after if handle.kind == "persist" else None
        if memory is None and self._in_memory(handle.path) is not None:
            return  # in memory: its durable copy, if any, says it
        saved = memory or handle
        if "stall_s" in saved.timings:  # an adapter's framework call, timed whole (``SaveMetrics.saved``)
            stall = saved.timings["stall_s"]
        elif saved.kind == "directory":  # the framework's own code snapshots its files: its adapter times it
            return
        else:
            stall = sum(saved.timings.get(part, 0.0) for part in ("waited_s", "prepare_s", "copy_s"))
        memory_commit = saved.timings.get("committed_s", seconds) - stall if memory is not None else None
        self._advice = advice(stall, seconds - (0.0 if memory is not None else stall), self._failures_per_day,
                              memory_commit)

    def saving(self, step: Optional[int]) -> None:
        """A checkpoint of ``step`` is being saved: the run's saves (of different steps) so far tell its interval;
        once the interval advice is known, it is logged at the next save (``log_advice``)."""
        now = time.monotonic()
        first, last, count = self._saves
        if last is not None and step is not None and step == last[0]:
            return  # another file of the same step (Lightning's last.ckpt beside its top-k file)
        self._saves = (first if first is not None else now, (step, now), count + 1)
        if self._advice is not None and count >= 1:
            self.log_advice()

    def log_advice(self) -> None:
        """The interval advice, once, with the interval this run saves at (from its saves so far): a warning where the
        run saves more than twice or less than half as often as the least-loss interval (where users see it), else
        at INFO (``logging.getLogger("asyncckpt")``)."""
        if self._advice is None or self._advice_logged:
            return
        self._advice_logged = True
        first, last, count = self._saves
        if count < 2:
            logger.info("%s", self._advice.line)
            return
        every = (last[1] - first) / (count - 1)
        far = not self._advice.seconds / 2 <= every <= 2 * self._advice.seconds
        logger.log(logging.WARNING if far else logging.INFO, "%s; this run saves every %s", self._advice.line,
                   human(every))
