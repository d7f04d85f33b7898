"""The export as the background writer runs it: behind the save of a checkpoint, on idle CPU.

``ExportRequest`` runs in rank 0's background writer, queued behind the save of a checkpoint and
run only if it committed (``Checkpointer.export``; the ``export=`` option of the Checkpointer and
the adapters queues one per checkpoint). Kept free of torch: the writer unpickles it (a checkpoint
only torch reads is exported by a child process: ``writing.export_local``).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from asyncckpt.core.export.options import ExportOptions
from asyncckpt.core.export.writing import export_checkpoint, stale_exports
from asyncckpt.core.storage import removal
from asyncckpt.core.storage.backend import backend_for

if TYPE_CHECKING:
    from asyncckpt.core.writer.protocol import RequestContext


@dataclass
class ExportRequest:
    """Export the committed checkpoint ``checkpoint`` to ``target``, then apply the exports' retention."""

    checkpoint: str
    target: str
    options: ExportOptions

    def run(self, context: "RequestContext") -> None:
        root = os.path.dirname(self.target)
        if not backend_for(root).remote:
            context.tidy(root)  # a killed export's staging directory
        on_idle_cpu(lambda: export_checkpoint(self.checkpoint, self.target, self.options, token=context.token()))
        removal.remove(stale_exports(root, self.options.keep_last), context.token(), context.after_reply)


def on_idle_cpu(work: Callable[[], object]) -> None:
    """Run ``work`` in a thread of its own scheduled ``SCHED_IDLE``: the export takes the CPU time the
    training loop leaves, rather than competing with it (docs/benchmarks_export.md). A thread of its
    own, because an unprivileged thread cannot leave ``SCHED_IDLE`` again; where the policy is refused,
    it runs as usual (a child process it starts inherits the policy). The writer has a session of its
    own, and with it (where the kernel groups by session: ``sched_autogroup_enabled``) a scheduling
    group of its own, which competes with the training process's group as an equal whatever its
    threads' policies: the group is niced to 19 meanwhile (what it cost training without that:
    docs/benchmarks_export.md). What ``work`` raises is raised here."""
    failure: list[BaseException] = []

    def idle() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
        except (OSError, AttributeError):
            pass
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - raised in the calling thread
            failure.append(e)

    previous = _set_group_nice(19)
    try:
        thread = threading.Thread(target=idle, name="asyncckpt-export")
        thread.start()
        thread.join()
    finally:
        if previous is not None:
            _set_group_nice(previous)
    if failure:
        raise failure[0]


_AUTOGROUP = "/proc/self/autogroup"


def _set_group_nice(nice: int) -> Optional[int]:
    """Set the nice value of this process's scheduling group; the one it had (None: no such group here)."""
    try:
        with open(_AUTOGROUP) as f:
            previous = int(f.read().rsplit("nice", 1)[1])
        with open(_AUTOGROUP, "w") as f:
            f.write(str(nice))
    except (OSError, ValueError, IndexError):
        return None
    return previous
