"""Where the ranks of one save meet: every share durable, then the commit, or a failure for all.

A multi-rank save needs two cross-rank waits: the coordinator (rank 0) waits until every rank's
share is durable before it commits, and every other rank waits until the coordinator committed.
A failure on any rank must end both waits on every rank, and a rank that never arrives must end
them after the save's timeout, naming it. ``Barrier`` is that contract; there are two:

* ``FileBarrier``: marker files in the save's staging directory, polled. Needs nothing but the
  shared filesystem the checkpoint is written to: used without torch.distributed
  (``use_collectives=False``). On NFS, attribute and listing caches can delay what other nodes
  see by seconds.
* ``StoreBarrier``: keys in the torch.distributed Store that every process group has (the
  rendezvous store, a TCP server on rank 0): used whenever a process group exists. Nothing is
  listed or polled on the checkpoint's filesystem, so it also serves object storage. The Store
  lives in the training process; the background writer, which does not load torch, reaches it
  through its writer queue (``RemoteBarrier``, see ``protocol``).

Both poll every few milliseconds: a writer waits only once its own share is durable, when the
others are usually a few tens of milliseconds behind, and longer sleeps left each wait late.

Kept free of torch: the writer imports it.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from asyncckpt.core.formats import names
from asyncckpt.core.errors import CheckpointTimeoutError, CheckpointWriteError
from asyncckpt.core.storage.commit import read_commit_record

POLL_MAX_DELAY = 0.005


@dataclass(frozen=True)
class BarrierSpec:
    """One save's meeting point, as plain data: the requests of every rank carry the same one."""

    kind: str  # "files", "store", or "solo" (one rank saving to an object store)
    key: str  # the save's id, the same on every rank and unique in the job
    world_size: int
    staging_dir: str
    final_path: str
    timeout: float


class Barrier(Protocol):
    def arrive(self, rank: int) -> None:
        """This rank's share is durable."""

    def fail(self, rank: int, reason: str) -> None:
        """This rank failed: the save fails on every rank."""

    def wait_all(self) -> None:
        """Coordinator: return once every rank arrived; raise if one failed or never arrives."""

    def committed(self) -> None:
        """Coordinator: the checkpoint is published."""

    def wait_commit(self) -> None:
        """Any other rank: return once the coordinator committed; raise if the save failed."""


def failure_error(rank: Any, reason: str) -> CheckpointWriteError:
    """The save failed on ``rank`` (the training process adds which checkpoint)."""
    return CheckpointWriteError(f"rank {rank}: {reason}")


def poll(condition: Callable[[], Any], timeout: float, on_timeout: Callable[[], BaseException],
         max_delay: float = POLL_MAX_DELAY) -> Any:
    """Wait until ``condition()`` returns something truthy (sleeps growing from 1 ms to
    ``max_delay``); after ``timeout`` seconds raise ``on_timeout()``."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise on_timeout()
        time.sleep(delay)
        delay = min(delay * 1.5, max_delay)


# ----------------------------------------------------------------------------- files
class FileBarrier:
    """Markers in the staging directory: ``__{rank}.done``, ``__{rank}.error.json`` and
    ``ABORTED.json``; the commit is the commit record under the final name."""

    def __init__(self, spec: BarrierSpec) -> None:
        self.spec = spec

    def _path(self, name: str) -> str:
        return os.path.join(self.spec.staging_dir, name)

    def arrive(self, rank: int) -> None:
        os.makedirs(self.spec.staging_dir, exist_ok=True)
        with open(self._path(names.done_marker_name(rank)), "w") as f:  # coordination only: the
            f.write(self.spec.key)  # share itself was made durable before

    def fail(self, rank: int, reason: str) -> None:
        record = json.dumps({"rank": rank, "error": reason}).encode()
        try:
            os.makedirs(self.spec.staging_dir, exist_ok=True)
            _write_new(self._path(names.error_marker_name(rank)), record)
            _write_new(self._path(names.ABORT_MARKER), record)  # the first failure is the one reported
        except OSError:
            pass  # the disk itself may be what failed: the others then time out instead

    def _abort_reason(self) -> Optional[dict]:
        try:
            with open(self._path(names.ABORT_MARKER), "rb") as f:
                return json.load(f)
        except (FileNotFoundError, ValueError):
            return None

    def wait_all(self) -> None:
        spec = self.spec
        errors = {names.error_marker_name(rank) for rank in range(spec.world_size)}
        done = {names.done_marker_name(rank) for rank in range(spec.world_size)}
        present: set = set()

        def everyone_arrived() -> bool:
            nonlocal present
            try:
                present = set(os.listdir(spec.staging_dir))
            except FileNotFoundError:
                return False
            if present & errors or names.ABORT_MARKER in present:
                reason = self._abort_reason() or {"rank": "?", "error": "aborted"}
                raise failure_error(reason["rank"], reason["error"])
            return present >= done

        def missing() -> BaseException:
            absent = sorted(r for r in range(spec.world_size) if names.done_marker_name(r) not in present)
            return _missing_error(spec, absent)

        poll(everyone_arrived, spec.timeout, missing, max_delay=POLL_MAX_DELAY * max(1.0, spec.world_size / 64))
        self.forget_arrivals()

    def forget_arrivals(self) -> None:
        """Coordinator, every rank arrived: the arrival markers go before the directory is published."""
        for rank in range(self.spec.world_size):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(names.done_marker_name(rank)))

    def committed(self) -> None:
        pass  # the commit record under the final name is what the others wait for

    def wait_commit(self) -> None:

        spec = self.spec

        def committed_or_failed() -> bool:
            record = read_commit_record(spec.final_path)
            if record is not None and record.get("save_id") == spec.key:
                return True
            reason = self._abort_reason()
            if reason is not None:
                raise failure_error(reason["rank"], reason["error"])
            return False

        poll(committed_or_failed, spec.timeout, lambda: _no_commit_error(spec))


def _write_new(path: str, data: bytes) -> None:
    """Create ``path`` with ``data`` unless it exists (the first writer wins)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _missing_error(spec: BarrierSpec, absent: list[int]) -> CheckpointTimeoutError:
    return CheckpointTimeoutError(f"rank(s) {absent} did not finish writing within {spec.timeout:.0f}s (not committed)")


def _no_commit_error(spec: BarrierSpec) -> CheckpointTimeoutError:
    return CheckpointTimeoutError(f"rank 0 did not commit it within {spec.timeout:.0f}s")


# ----------------------------------------------------------------------------- the Store
class StoreBarrier:
    """Keys under ``asyncckpt/{key}/`` in a torch.distributed Store: ``r{rank}`` per arrival, a
    counter ``n`` whose last increment opens ``gate``, and ``final``. ``gate`` and ``final`` are set
    with compare-and-set, so the first of "all arrived" / "committed" and a failure wins."""

    def __init__(self, store: Any, spec: BarrierSpec) -> None:
        self.store, self.spec = store, spec
        self.prefix = f"asyncckpt/{spec.key}"

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def arrive(self, rank: int) -> None:
        self.store.set(self._key(f"r{rank}"), "1")
        if self.store.add(self._key("n"), 1) == self.spec.world_size:
            self.store.compare_set(self._key("gate"), "", "go")

    def fail(self, rank: int, reason: str) -> None:
        record = "x" + json.dumps({"rank": rank, "error": reason})
        self.store.compare_set(self._key("gate"), "", record)
        self.store.compare_set(self._key("final"), "", record)

    def _wait(self, name: str, on_timeout: Callable[[], BaseException]) -> None:
        key = self._key(name)
        value = poll(lambda: self.store.check([key]) and self.store.get(key), self.spec.timeout, on_timeout)
        if value.startswith(b"x"):
            reason = json.loads(value[1:])
            raise failure_error(reason["rank"], reason["error"])

    def wait_all(self) -> None:
        def missing() -> BaseException:
            return _missing_error(self.spec, [r for r in range(self.spec.world_size)
                                              if not self.store.check([self._key(f"r{r}")])])

        self._wait("gate", missing)

    def committed(self) -> None:
        self.store.compare_set(self._key("final"), "", "ok")
        for name in [f"r{r}" for r in range(self.spec.world_size)] + ["n", "gate"]:
            self.store.delete_key(self._key(name))  # "final" stays: the others may not have read it yet

    def wait_commit(self) -> None:
        self._wait("final", lambda: _no_commit_error(self.spec))


class SoloBarrier:
    """A save of one rank where no marker files can go (an object-store URL): nobody to wait for."""

    def __init__(self, spec: BarrierSpec) -> None:
        self.spec = spec

    def arrive(self, rank: int) -> None:
        pass

    def fail(self, rank: int, reason: str) -> None:
        pass

    def wait_all(self) -> None:
        pass

    def committed(self) -> None:
        pass

    def wait_commit(self) -> None:
        pass


class StoreUnreachable(Exception):
    """The Store barrier cannot be reached: the training process that served it (its own, or rank
    0's, which runs the Store's server) is gone."""


class SurvivingBarrier:
    """A Store barrier that outlives the training processes: the ranks meet in the Store while it can
    be reached, and every arrival and failure is also left as a marker in the staging directory
    (``FileBarrier``'s), so that writers whose training processes died meet there instead and
    finish the saves handed to them. One small file per rank and save is all it costs the others."""

    def __init__(self, store_barrier: Barrier, files: FileBarrier, reachable: Callable[[], bool]) -> None:
        self.store_barrier, self.files, self.reachable = store_barrier, files, reachable

    def _in_store(self, method: str, *args: Any) -> bool:
        """Run ``method`` in the Store; False when the Store cannot be reached (the markers decide)."""
        if not self.reachable():
            return False
        try:
            getattr(self.store_barrier, method)(*args)
        except StoreUnreachable:
            return False
        return True

    def arrive(self, rank: int) -> None:
        self.files.arrive(rank)
        self._in_store("arrive", rank)

    def fail(self, rank: int, reason: str) -> None:
        self.files.fail(rank, reason)
        self._in_store("fail", rank, reason)

    def wait_all(self) -> None:
        if self._in_store("wait_all"):
            self.files.forget_arrivals()
        else:
            self.files.wait_all()

    def committed(self) -> None:
        self._in_store("committed")

    def wait_commit(self) -> None:
        if not self._in_store("wait_commit"):
            self.files.wait_commit()


def local_barrier(spec: BarrierSpec, store: Optional[Any] = None) -> Barrier:
    """The barrier of ``spec`` in a process that can reach it directly."""
    if spec.kind == "files":
        return FileBarrier(spec)
    if spec.kind == "solo":
        return SoloBarrier(spec)
    if store is None:
        raise CheckpointWriteError("its ranks meet in the torch.distributed Store, which this process cannot reach")
    return StoreBarrier(store, spec)
