"""The persistent background writer: one process per rank, started once, fed plain data.

A process of its own, torch-free and outside the training's GIL and signals, so that writes overlap training and a
save that returned is finished even if the training process dies.

More: docs/MODULES.md, core/writer/process.py.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import mmap
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from dataclasses import dataclass
from typing import Any, Callable, Optional

from asyncckpt.core.storage import commit, leftovers, orphans, owners

from asyncckpt.core import tier
from asyncckpt.core.storage.backend import backend_for, join
from asyncckpt.core.writer import protocol
from asyncckpt.core.writer.barrier import (
    BarrierSpec,
    Heartbeats,
    MarkerBarrier,
    SoloBarrier,
    StoreUnreachable,
    SurvivingBarrier,
)
from asyncckpt.core.writer.copy_progress import PROGRESS_BYTES, CopyProgress
from asyncckpt.core.writer.mirror import CopyRequest
from asyncckpt.core.tier.requests import PersistRequest
from asyncckpt.core.writer.priority import CpuShare
from asyncckpt.core.tier.nodes import CoordinatorMarkers, Replicas
from asyncckpt.core.tier.transport import Receiver
from asyncckpt.core.errors import CheckpointError, CheckpointTimeoutError, CheckpointWriteError

#: An orphaned writer that serves its node's memory (``Receiver``) exits only once no other node's writer has been
#: connected for this long: they finish the same saves (a save's commit record fetched from rank 0's node), and their
#: training processes, which would tell them the job's state, died with this one's.
RECEIVER_QUIET_S = 5.0
_REMEMBERED_FAILURES = 256  # saves whose failure (or files) on this rank a later request of theirs may ask about


class TrainingProcess:
    """The training process this writer serves, as the writer sees it: alive, or gone.

    A thread waits for its exit (a pidfd; polling ``getppid`` where there is none). From then on
    the writer is an orphan: it has ``timeout`` seconds to finish what it was handed (SIGALRM
    ends it after that), and every request it finishes is logged beside its checkpoint."""

    def __init__(self, pid: int, timeout: float) -> None:
        self.pid, self.timeout = pid, timeout
        self.gone = threading.Event()
        self.on_gone: list[Callable[[], None]] = []

    def watch(self) -> None:
        threading.Thread(target=self._wait_for_exit, name="asyncckpt-writer-watch", daemon=True).start()

    def _wait_for_exit(self) -> None:
        try:
            fd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd here, or the process is gone already
            fd = None
        # Our parent until it dies: checked after opening the pidfd, so that a pid the dead
        # training process left behind, and the kernel gave to another process, is never watched.
        if fd is not None and os.getppid() == self.pid:
            select.select([fd], [], [])  # readable once the process has exited
        while os.getppid() == self.pid:  # no pidfd here
            time.sleep(0.2)
        self.gone.set()
        signal.alarm(max(1, int(self.timeout + 0.999)))
        for action in self.on_gone:
            action()

    @property
    def alive(self) -> bool:
        return not self.gone.is_set()


class Channel:
    """The writer's end of the socket. Messages are taken in order, except the answer to a
    barrier call, which the request waiting for it takes out of turn (the training process may
    have queued more work meanwhile). Once the training process is gone, replies are dropped and
    the messages it sent before it died are still read, in order, up to the end of the stream."""

    def __init__(self, conn: Connection, trainer: TrainingProcess) -> None:
        self.conn, self.trainer = conn, trainer
        self._queued: list[tuple[tuple, Any]] = []

    def _receive(self) -> tuple[tuple, Any]:
        message = self.conn.recv()
        fd: Any = None
        if message[0] == protocol.BUFFER:
            fd = recv_handle(self.conn), recv_handle(self.conn)  # its image, its progress
        elif message[0] == protocol.RECEIVER:
            fd = recv_handle(self.conn)
        return message, fd

    def next_message(self) -> tuple[tuple, Any]:
        """The next message (and the file descriptors a BUFFER or RECEIVER message brings)."""
        return self._queued.pop(0) if self._queued else self._receive()

    def ready(self, timeout: float) -> bool:
        """Whether a message (or the end of the connection) is there, waiting up to ``timeout`` seconds."""
        return bool(self._queued) or self.conn.poll(timeout)

    def send(self, *message: Any) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionResetError):
            # Its end is closed: it died. A process that dies closes its files before its parent (and our
            # watch) learns of its exit, so this comes first under load: nobody to tell; the work goes on.
            pass
        except OSError:
            if self.trainer.alive and os.getppid() == self.trainer.pid:
                raise
            # the training process is gone: nobody to tell

    def call_barrier(self, spec: BarrierSpec, method: str, args: tuple) -> None:
        """Run a barrier method in the training process's Store. Raises ``StoreUnreachable`` when
        the training process is gone, or its Store cannot be reached (rank 0's process died)."""
        if not self.trainer.alive:
            raise StoreUnreachable("the training process is gone")
        try:
            self.conn.send((protocol.BARRIER_CALL, spec, method, args))
            while True:
                message, fd = self._receive()
                if message[0] != protocol.BARRIER_RESULT:
                    self._queued.append((message, fd))
                    continue
                break
        except (EOFError, OSError) as e:
            raise StoreUnreachable(f"the training process is gone ({e})") from None
        _, error = message
        if error is None:
            return
        kind, text = error
        if kind == CheckpointTimeoutError.__name__:
            raise CheckpointTimeoutError(text)
        if kind == CheckpointWriteError.__name__:
            raise CheckpointWriteError(text)
        raise StoreUnreachable(f"{kind}: {text}")  # the Store itself failed (its server died with rank 0)


class RemoteBarrier:
    """A ``StoreBarrier`` run by the training process, which holds the Store (see ``barrier``)."""

    def __init__(self, spec: BarrierSpec, channel: Channel) -> None:
        self.spec, self.channel = spec, channel

    def __getattr__(self, method: str) -> Callable[..., None]:
        if method not in ("arrive", "fail", "wait_all", "committed", "wait_commit"):
            raise AttributeError(method)
        return lambda *args: self.channel.call_barrier(self.spec, method, args)


class Writer:
    """The state a writer keeps across requests: mapped buffers, which jobs failed, which saves
    failed on this rank, and the work left for after the replies (deletions, tidying)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.trainer = channel.trainer
        self.current: Optional[protocol.Job] = None
        self.announced: dict[int, tuple[str, str]] = {}  # orphaned: job id -> (parent, name) it logs
        self.logged_in: set[str] = set()
        self.trainer.on_gone.append(lambda: self.current is not None and self.announce(self.current))
        self.buffers: dict[int, MappedBuffer] = {}
        self.failed_jobs: set[int] = set()
        self.failures: dict[str, str] = {}
        self.files: dict[str, dict[str, Any]] = {}  # save key -> name -> FileChecksum, until its commit
        self.tidying: set[str] = set()  # directories to tidy after the current batch's replies
        self.after_replies: list[Callable[[], None]] = []
        self.heartbeats = Heartbeats(self.token)  # liveness markers of the saves at work (``barrier``)
        self.terminated = False  # a SIGTERM, SIGUSR1 or SIGUSR2 reached this writer: its job is ending
        self.memory_saves: dict[str, Any] = {}  # memory run directory -> how its newest checkpoint is written durably
        self.cpu_share = CpuShare()  # the training's priority, or only idle CPU where the node leaves some
        self.receiver: Optional[Receiver] = None  # it serves its node's memory to the other nodes (RECEIVER)

    def _note_memory_save(self, request: Any) -> None:
        """Remember how to write durably the newest memory-tier checkpoint this writer took part in (this rank's files
        of a directory or sharded save, ``PersistRequest``; a single file it saved, ``CopyRequest``), and forget one
        once it was written durably."""
        source = getattr(request, "source", None)
        if source is not None:  # a durable copy (``PersistRequest``, ``CopyRequest``)
            self.memory_saves = {run: persist for run, persist in self.memory_saves.items() if persist.source != source}
            return
        barrier, path = getattr(request, "barrier", "absent"), getattr(request, "final_path", None)
        if isinstance(barrier, BarrierSpec) and isinstance(path, str) and not getattr(request, "directory_barrier", None):
            durable_root = tier.durable_root_of(os.path.dirname(path))
            if durable_root is not None:
                self.memory_saves[os.path.dirname(path)] = PersistRequest(
                    path, join(durable_root, os.path.basename(path)), request.rank, barrier.world_size, barrier.key,
                    "files", barrier.timeout)
        elif barrier is None and isinstance(getattr(request, "path", None), str):  # a single file
            durable_root = tier.durable_root_of(os.path.dirname(request.path))
            if durable_root is not None:
                self.memory_saves[os.path.dirname(request.path)] = CopyRequest(
                    request.path, join(durable_root, os.path.basename(request.path)))

    def persist_memory(self) -> None:
        """Write durably, and commit there, the newest checkpoint of each memory run this writer took part in that
        is in memory only (its durable copy missing, or of another save): each rank's writer its own files, the
        ranks meeting by markers on the durable storage; then forget them."""
        saves, self.memory_saves = self.memory_saves, {}
        for persist in saves.values():
            durable = persist.target
            try:
                if not commit.same_save(persist.source, durable):
                    persist.run(_Context(self, None))
                    orphans.note(os.path.dirname(durable), self.token, f"wrote {durable} from memory (SIGTERM)")
            except (OSError, CheckpointError) as e:
                orphans.note(os.path.dirname(durable), self.token,
                             f"could not write {durable} from memory (SIGTERM): {type(e).__name__}: {e}")

    def run_jobs(self, jobs: list[protocol.Job]) -> None:
        self.cpu_share.choose()
        for job in jobs:
            if job.after is not None and job.after in self.failed_jobs:
                self.failed_jobs.add(job.job_id)
                self.channel.send(protocol.CANCELLED, job.job_id)
                continue
            context = _Context(self, self.buffers[job.buffer_id] if job.buffer_id is not None else None)
            self.current = job
            if not self.trainer.alive:
                self.announce(job)
            try:
                job.request.run(context)
                self.channel.send(protocol.DONE, job.job_id, context.counts or None)
                self.log_outcome(job, None)
                self._note_memory_save(job.request)
            except BaseException as e:  # report everything; the training process decides what to raise
                self.failed_jobs.add(job.job_id)
                self.channel.send(protocol.FAILED, job.job_id, *protocol.error_text(e), traceback.format_exc())
                self.log_outcome(job, e)
            finally:
                self.current = None
        self.heartbeats.stop_all()  # a save whose requests did not all come in this batch shows itself again
        self._after_replies()
        self.cpu_share.settle()

    # ------------------------------------------------------------------ orphaned
    def announce(self, job: protocol.Job) -> None:
        """Orphaned: log that this writer is finishing ``job``'s checkpoint (a restarted job waits for it)."""
        where = _checkpoint_of(job.request)
        if where is None or job.job_id in self.announced:
            return
        parent, name = where
        self.announced[job.job_id] = (parent, name)
        self.logged_in.add(parent)
        orphans.note(parent, self.token, f"finishing {name} (training process {self.trainer.pid} died)")

    def log_outcome(self, job: protocol.Job, error: Optional[BaseException]) -> None:
        where = self.announced.pop(job.job_id, None)
        if where is not None:
            parent, name = where
            orphans.note(parent, self.token, f"committed {name}" if error is None
                         else f"not committed {name}: {type(error).__name__}: {error}")

    def log_exit(self, event: str) -> None:
        for parent in sorted(self.logged_in):
            orphans.note(parent, self.token, event)

    @functools.cached_property
    def token(self) -> str:
        return owners.owner_token()

    def _after_replies(self) -> None:
        """Work nobody waits for, done once the replies are sent: deleting what commits replaced
        or removals renamed away, tidying leftovers; then collecting garbage. Automatic collection
        is off in the writer: a save parses and builds tens of thousands of small objects, and a
        full collection in the middle of one delayed its commit (docs/DESIGN.md, "The writer's per-save
        CPU is small"). Freezing what survives keeps caches out of later ones."""
        actions, self.after_replies = self.after_replies, []
        self.tidying.clear()
        for action in actions:
            try:
                action()
            except OSError:
                pass  # a leftover stays a leftover: the next tidy or ``asyncckpt clean`` takes it
        gc.collect()
        gc.freeze()


@dataclass
class MappedBuffer:
    """The writer's side of a snapshot buffer (``snapshot.shared_buffer``): its image and its copy's progress mapped,
    and the image's descriptor where it is a file (the hard link that publishes it: ``link_image``)."""

    layout: Any
    image: mmap.mmap
    progress: mmap.mmap
    file: Optional[int]

    @classmethod
    def mapped(cls, layout: Any, image_fd: int, progress_fd: int) -> "MappedBuffer":
        """Map a buffer handed over; its descriptors are kept (the file's) or closed."""
        try:
            image, progress = mmap.mmap(image_fd, 0), mmap.mmap(progress_fd, PROGRESS_BYTES)
        finally:
            os.close(progress_fd)
        if os.fstat(image_fd).st_nlink == 0:  # a memfd: nothing to link
            os.close(image_fd)
            image_fd = None
        return cls(layout, image, progress, image_fd)

    def forget(self) -> None:
        """The training process dropped it. Only our descriptor goes: views of the mappings may outlive a failed
        request (its traceback), and a mapping unmaps itself once the last of them is gone."""
        if self.file is not None:
            os.close(self.file)
            self.file = None


class _Context:
    """``protocol.RequestContext`` for one request."""

    def __init__(self, writer: Writer, buffer: Optional[MappedBuffer]) -> None:
        self.writer, self.buffer = writer, buffer
        self.layout = buffer.layout if buffer is not None else None
        self.image = memoryview(buffer.image) if buffer is not None else None
        self.progress = CopyProgress(buffer.progress) if buffer is not None else None
        self.counts: dict[str, int] = {}

    def link_image(self, path: str) -> bool:
        if self.buffer is None or self.buffer.file is None:
            return False
        try:
            with contextlib.suppress(FileNotFoundError):  # one there (a save's request run again) is replaced
                os.unlink(path)
            descriptors = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:  # linkat(AT_SYMLINK_FOLLOW) of the descriptor's file (a plain link() would link the /proc entry)
                os.link(str(self.buffer.file), path, src_dir_fd=descriptors, follow_symlinks=True)
            finally:
                os.close(descriptors)
        except OSError:  # another file system (a tier that did not fit), the buffer's names all removed (ENOENT)
            return False
        return True

    def token(self) -> str:
        return owners.owner_token()

    def trainer_gone(self) -> bool:
        return not self.writer.trainer.alive

    def tidy(self, parent: str) -> None:
        parent = os.path.abspath(parent)
        if parent not in self.writer.tidying:
            self.writer.tidying.add(parent)
            self.after_reply(lambda: leftovers.clean(parent))

    def barrier(self, spec: BarrierSpec, replicas: Optional[Replicas] = None):
        writer = self.writer
        if spec.kind == "solo":
            return SoloBarrier(spec)

        def markers(judge_silence: Callable[[], bool]) -> MarkerBarrier:  # on several nodes: met on rank 0's
            if replicas is not None and replicas.coordinator != replicas.nodes.node:
                return CoordinatorMarkers(spec, replicas, writer.heartbeats, judge_silence)
            return MarkerBarrier(spec, writer.heartbeats, judge_silence)

        if spec.kind == "files":  # a rank that is late while this training process lives is waited for
            return markers(self.trainer_gone)
        # kind "store": the markers decide only once the Store cannot be reached, when every rank still
        # at work on the save is at work in its writer
        return SurvivingBarrier(RemoteBarrier(spec, writer.channel), markers(lambda: True), lambda: writer.trainer.alive)

    def after_reply(self, action: Callable[[], None]) -> None:
        self.writer.after_replies.append(action)

    def report(self, **counts: int) -> None:
        for name, count in counts.items():
            self.counts[name] = self.counts.get(name, 0) + count

    def record_failure(self, save_key: str, reason: str) -> None:
        failures = self.writer.failures
        failures.setdefault(save_key, reason)
        while len(failures) > _REMEMBERED_FAILURES:
            failures.pop(next(iter(failures)))

    def failure(self, save_key: str) -> Optional[str]:
        return self.writer.failures.get(save_key)

    def record_file(self, save_key: str, name: str, checksum: Any) -> None:
        files = self.writer.files
        files.setdefault(save_key, {})[name] = checksum
        while len(files) > _REMEMBERED_FAILURES:  # saves begun and never committed
            files.pop(next(iter(files)))

    def files(self, save_key: str) -> dict[str, Any]:
        return self.writer.files.pop(save_key, {})


def serve(writer: "Writer") -> None:
    """Run requests until told to stop."""
    channel = writer.channel
    while True:
        while writer.terminated and writer.memory_saves and not channel.ready(0.2):
            writer.persist_memory()  # only between requests: nothing runs beside a request
        try:
            message, fd = channel.next_message()
        except (EOFError, OSError):  # the training process closed the socket, or died: all it sent was run
            message, fd = (protocol.STOP,), None
            if writer.receiver is not None:  # (no STOP: it died) the other nodes' writers may still need this
                writer.receiver.wait_quiet(RECEIVER_QUIET_S)  # node's memory to finish the same saves
        kind = message[0]
        if kind == protocol.BUFFER:
            _, buffer_id, layout = message
            writer.buffers[buffer_id] = MappedBuffer.mapped(layout, *fd)
        elif kind == protocol.DROP:
            dropped = writer.buffers.pop(message[1], None)
            if dropped is not None:
                dropped.forget()
        elif kind == protocol.RUN:
            writer.run_jobs(message[1])
        elif kind == protocol.RECEIVER:  # threads of its own until the process exits: nothing to stop
            writer.receiver = Receiver(message[1], secret=message[2], listener=socket.socket(fileno=fd))
        elif kind == protocol.STOP:
            if writer.terminated:
                writer.persist_memory()
            writer.log_exit("exiting")
            with contextlib.suppress(OSError):
                channel.send(protocol.STOPPED)
                channel.conn.close()
            os._exit(0)  # everything is durable already; skip the interpreter's teardown


def _checkpoint_of(request: Any) -> Optional[tuple[str, str]]:
    """Where an orphan logs a request's checkpoint, and its name: the directory its staging
    directory is in (beside the checkpoint, or where a framework that counts every entry of the
    checkpoint's directory keeps it: Accelerate's ``checkpoints/``), or a single file's directory.
    None for work that commits nothing of its own."""
    final = getattr(request, "final_path", None)
    if final is not None and not getattr(request, "directory_barrier", None):
        if backend_for(final).remote:
            return None
        return os.path.dirname(getattr(request, "staging_dir", None) or final), os.path.basename(final)
    if getattr(request, "barrier", "absent") is None and isinstance(getattr(request, "path", None), str):
        return os.path.dirname(request.path), os.path.basename(request.path)  # a single file
    return None


def main() -> None:
    fd, parent_pid, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    # No check of whether the training process still lives: the save that started this process
    # returned once its request and snapshot buffer were in the socket, and a training process that
    # died in the meantime (as this one started) left them there for us to finish, as an orphan.
    trainer = TrainingProcess(parent_pid, timeout)
    channel = Channel(Connection(fd), trainer)
    writer = Writer(channel)
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(signum, signal.SIG_IGN)
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, lambda signum, frame: setattr(writer, "terminated", True))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, protocol.WRITER_SIGNALS)  # blocked since the spawn (``client``)

    def give_up(signum: int, frame: Any) -> None:  # orphaned, and past the saves' timeout
        writer.log_exit(f"gave up after {timeout:.0f}s")
        os._exit(1)

    signal.signal(signal.SIGALRM, give_up)
    trainer.watch()
    gc.disable()
    serve(writer)


if __name__ == "__main__":
    main()
