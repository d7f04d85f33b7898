"""The background writer's protocol: what a request is, and the messages the two sides exchange.

More: docs/MODULES.md, core/writer/protocol.py.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:
    from asyncckpt.core.writer.barrier import Barrier, BarrierSpec
    from asyncckpt.core.writer.copy_progress import CopyProgress
    from asyncckpt.core.formats.checksum import FileChecksum
    from asyncckpt.core.formats.layout import RankLayout

BUFFER, DROP, RUN, BARRIER_RESULT, RECEIVER, STOP = "buffer", "drop", "run", "barrier-result", "receiver", "stop"
DONE, FAILED, CANCELLED, BARRIER_CALL, STOPPED = "done", "failed", "cancelled", "barrier-call", "stopped"

# The signals a scheduler or a shell sends whose default action would end the writer: SLURM's ``--signal`` and
# ``scancel --signal`` reach every process of the job step, a closed terminal sends SIGHUP, and SIGPIPE ends a process
# until its interpreter ignores it. Blocked from the writer's spawn (``client.writer_queue``) until it has set its
# own action for each (``process.main``); SIGCONT and SIGWINCH leave a process running by default.
WRITER_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE, signal.SIGUSR1,
                            signal.SIGUSR2})


class RequestContext(Protocol):
    """What the writer gives a running request."""

    layout: Optional["RankLayout"]  # of the snapshot buffer the request writes from (None: no buffer)
    image: Optional[memoryview]  # that buffer's bytes
    progress: Optional["CopyProgress"]  # how far the snapshot copy into it has got

    def link_image(self, path: str) -> bool:
        """Make the snapshot buffer the file ``path`` by a hard link (a memory-tier save's buffer is a file of the
        tier: ``snapshot.shared_buffer``), in place of writing its image there: whether it could (not where the buffer
        is a memfd, on another file system, or its name is gone)."""

    def token(self) -> str:
        """A fresh owner token of this writer (``leftovers``), for a hidden name it creates."""

    def trainer_gone(self) -> bool:
        """The training process that handed this request over has died (the writer finishes alone)."""

    def tidy(self, parent: str) -> None:
        """Remove our leftovers in ``parent`` whose owner is gone (after the reply)."""

    def barrier(self, spec: "BarrierSpec", replicas: Any = None) -> "Barrier":
        """Where this request meets the other ranks of its save (``replicas``: a memory-tier save on several nodes,
        whose ranks' staging places are each on its own node: ``tier.nodes.Replicas``)."""

    def after_reply(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the request's outcome is reported (deletions nobody waits for)."""

    def report(self, **counts: int) -> None:
        """Counts the request's reply carries to the training process (a share's bytes ``written`` and ``shared``:
        each save's metrics)."""

    def record_failure(self, save_key: str, reason: str) -> None:
        """Remember that a request of save ``save_key`` failed on this rank (a later request of
        the same save, e.g. a directory's commit, then fails too)."""

    def failure(self, save_key: str) -> Optional[str]:
        """The failure recorded for ``save_key`` on this rank, if any."""

    def record_file(self, save_key: str, name: str, checksum: "FileChecksum") -> None:
        """Remember the checksum of a file this rank wrote for save ``save_key`` (a directory's
        commit record lists them)."""

    def files(self, save_key: str) -> dict[str, "FileChecksum"]:
        """The files recorded for ``save_key`` on this rank (forgotten once asked for)."""


@runtime_checkable
class Request(Protocol):
    """A unit of work for the background writer (plain, torch-free data)."""

    def run(self, context: RequestContext) -> None: ...


@dataclass
class Job:
    """A request as queued: its id, the snapshot buffer it reads (if any), and the job it depends
    on: with ``after`` set, it runs only if that earlier job succeeded, and is cancelled otherwise
    (nothing is deleted or linked on the strength of a save that did not commit)."""

    job_id: int
    request: Request
    buffer_id: Optional[int] = None
    after: Optional[int] = None


class Idle:
    """A request that does nothing: its reply means every earlier request, and the work left for
    after their replies, is finished (``Checkpointer.wait`` ends with one)."""

    def run(self, context: RequestContext) -> None:
        pass


def error_text(error: BaseException) -> tuple[str, str]:
    """What the writer reports of an exception: its type's name and its message."""
    return type(error).__name__, str(error)

