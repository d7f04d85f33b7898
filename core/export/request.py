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
from typing import TYPE_CHECKING, Callable

from asyncckpt.core.export.options import ExportOptions
from asyncckpt.core.export.writing import export_checkpoint, stale_exports
from asyncckpt.core.storage import removal
from asyncckpt.core.storage.backend import backend_for
from asyncckpt.core.writer.priority import LOWEST, set_group_nice

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
    training loop leaves, rather than competing with it (docs/benchmarks/export.md). A thread of its
    own, because an unprivileged thread cannot leave ``SCHED_IDLE`` again; where the policy is refused,
    it runs as usual (a child process it starts inherits the policy). The writer's scheduling group
    (``writer.priority``) is at the lowest priority meanwhile, whatever idle CPU the node has: an export is
    never urgent (what it cost training without that: docs/benchmarks/export.md). What ``work`` raises is
    raised here."""
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

    previous = set_group_nice(LOWEST)
    try:
        thread = threading.Thread(target=idle, name="asyncckpt-export")
        thread.start()
        thread.join()
    finally:
        if previous is not None:
            set_group_nice(previous)
    if failure:
        raise failure[0]
