"""Where the ranks of one save meet: every share durable, then the commit, or a failure for all.

A failure on any rank ends the wait on every rank, and a rank that never arrives ends it after the save's timeout,
named: no rank waits forever and none commits a checkpoint missing a share.

More: docs/MODULES.md, core/writer/barrier.py.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from asyncckpt.core.formats import names
from asyncckpt.core.errors import CheckpointTimeoutError, CheckpointWriteError
from asyncckpt.core.storage.backend import Backend, backend_for, join, read_bytes
from asyncckpt.core.storage.commit import read_commit_record
from asyncckpt.core.storage.owners import owner_alive

POLL_MAX_DELAY = 0.005
HEARTBEAT_S = 2.0  # how often a writer at work on a multi-rank save rewrites its liveness marker
COORDINATOR = 0  # the rank that waits for every share and commits


def silence_limit(timeout: float) -> float:
    """How long a writer that waits by markers without a training process (or a Store) waits for a
    rank whose writer shows no sign of life (no liveness marker, or one not rewritten) before the
    save fails naming that rank. Far above the heartbeat and a writer's start under load; far below
    the save's timeout, which still bounds the wait for a rank whose writer is at work."""
    return min(60.0, timeout / 4)


@dataclass(frozen=True)
class BarrierSpec:
    """One save's meeting point, as plain data: the requests of every rank carry the same one."""

    kind: str  # "files", "store", or "solo" (one rank saving to an object store)
    key: str  # the save's id, the same on every rank and unique in the job
    world_size: int
    staging_dir: str
    final_path: str
    timeout: float
    object_store: Any = None  # ObjectStoreOptions where ``final_path`` is a URL
    save_id: Optional[str] = None  # the save its commit record names, where that is not ``key`` (a memory checkpoint's
    # durable copy keeps its save's: ``tier.requests``)


class Barrier(Protocol):
    def begin(self, rank: int) -> None:
        """This rank's writer is at work on the save (it shows so until it arrives or fails)."""

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


# ----------------------------------------------------------------------------- markers
class Heartbeats:
    """One writer's liveness markers, each rewritten every ``HEARTBEAT_S`` (the first at once) by
    one thread until stopped. ``stop`` returns once no write of that marker can follow, so that
    none lands in a staging directory that was published or discarded meanwhile."""

    def __init__(self, token: str) -> None:
        self.token = token
        self._markers: dict[str, Backend] = {}
        self._beats = 0  # written into every marker: each rewrite changes it
        self._lock = threading.Lock()  # held while writing: ``stop`` waits for a write in progress
        self._due = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self, backend: Backend, path: str) -> None:
        with self._lock:
            if path in self._markers:
                return
            self._markers[path] = backend
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="asyncckpt-writer-heartbeat", daemon=True)
                self._thread.start()
        self._due.set()

    def stop(self, *paths: str) -> None:
        with self._lock:
            for path in paths:
                self._markers.pop(path, None)

    def stop_all(self) -> None:
        with self._lock:
            self._markers.clear()

    def _run(self) -> None:
        while True:
            self._due.wait(HEARTBEAT_S if self._markers else None)  # an idle writer's thread sleeps until ``start``
            self._due.clear()
            with self._lock:
                self._beats += 1
                for path, backend in self._markers.items():
                    try:
                        backend.write_marker(path, f"{self.token}\n{self._beats}\n".encode())
                    except Exception:  # noqa: BLE001 - the storage may be what fails: the others judge the silence
                        pass


class _Silence:
    """Whether the writers of the ranks one waits for are still at work, judged from their liveness
    markers (one listing of the barrier's place every half heartbeat) only while ``judging()``. A
    writer whose training process lives neither looks nor counts silence: it waits for a late rank
    as long as the save's timeout allows, and its training process learns of a writer that died
    (its socket closes: ``client.writer_queue``) and fails the save on every rank."""

    def __init__(self, barrier: "MarkerBarrier", judging: Callable[[], bool]) -> None:
        self.barrier, self.judging = barrier, judging
        self.limit = silence_limit(barrier.spec.timeout)
        self._next_look = 0.0
        self._signs: dict[int, Any] = {}
        self._since: dict[int, float] = {}
        self._tokens: dict[int, str] = {}

    def gone(self, ranks: list[int]) -> Optional[tuple[int, str]]:
        """A rank of ``ranks`` whose writer is gone, and why; None while each may be at work."""
        if not self.judging():
            self._since.clear()  # silence counts from when judging starts
            return None
        now = time.monotonic()
        if now < self._next_look:
            return None
        self._next_look = now + HEARTBEAT_S / 2
        try:
            listed = {entry.name: entry for entry in self.barrier.backend.listing(self.barrier.place)}
        except FileNotFoundError:
            listed = {}
        for rank in ranks:
            entry = listed.get(names.alive_marker_name(rank))
            sign = None if entry is None else (entry.size, entry.modified)
            if rank not in self._since or sign != self._signs[rank]:
                self._signs[rank], self._since[rank] = sign, now
            token = self._token(rank, entry.path) if entry is not None else None
            if token is not None and owner_alive(token) is False:
                return rank, f"its writer {token} is gone (the process exited on this host)"
            if now - self._since[rank] > self.limit:
                return rank, (f"its writer showed no sign of life for {self.limit:.0f}s "
                              f"({'no liveness marker' if sign is None else 'its liveness marker unchanged'})")
        return None

    def _token(self, rank: int, path: str) -> Optional[str]:
        if rank not in self._tokens:
            try:
                token = read_bytes(self.barrier.backend, path).split(b"\n", 1)[0].decode()
            except (FileNotFoundError, UnicodeDecodeError):
                return None
            if not token:  # read between a rewrite's truncation and its write
                return None
            self._tokens[rank] = token
        return self._tokens[rank]


def barrier_place(backend: Backend, staging_dir: str, key: str) -> str:
    """Where the ranks of the save ``key`` leave their markers: its staging directory (each save
    stages in one of its own), or where saves are written in place and so share one (an object
    store), a hidden place of the save's own under it, which is never published."""
    return join(staging_dir, names.barrier_place_name(key)) if backend.remote else staging_dir


class MarkerBarrier:
    """Markers where the checkpoint is written (``barrier_place``): ``__{rank}.done``,
    ``__{rank}.alive``, ``__{rank}.error.json`` and ``ABORTED.json``; the commit is the commit
    record under the final name.

    In a writer, ``heartbeats`` keeps this rank's liveness marker fresh, and ``judge_silence``
    says when a rank whose writer shows no sign of life is given up (see the module docstring);
    elsewhere (the training process reporting a failure) neither is given."""

    def __init__(self, spec: BarrierSpec, heartbeats: Optional[Heartbeats] = None,
                 judge_silence: Callable[[], bool] = lambda: False) -> None:
        self.spec = spec
        self.backend = backend_for(spec.staging_dir, spec.object_store)
        self.place = barrier_place(self.backend, spec.staging_dir, spec.key)
        self.heartbeats, self.judge_silence = heartbeats, judge_silence

    def _path(self, name: str) -> str:
        return join(self.place, name)

    def _alive_path(self, rank: int) -> str:
        return self._path(names.alive_marker_name(rank))

    def _stop_heartbeat(self, *ranks: int) -> None:
        if self.heartbeats is not None:
            self.heartbeats.stop(*(self._alive_path(rank) for rank in ranks))

    def begin(self, rank: int) -> None:
        if self.heartbeats is not None and self.spec.world_size > 1:
            self.heartbeats.start(self.backend, self._alive_path(rank))

    def arrive(self, rank: int) -> None:
        if rank != COORDINATOR:  # the coordinator shows it is at work until every share arrived
            self._stop_heartbeat(rank)
        self.backend.write_marker(self._path(names.done_marker_name(rank)), self.spec.key.encode())

    def fail(self, rank: int, reason: str) -> None:
        self._stop_heartbeat(rank)
        record = json.dumps({"rank": rank, "error": reason}).encode()
        try:
            self.backend.write_marker(self._path(names.error_marker_name(rank)), record, exclusive=True)
            self.backend.write_marker(self._path(names.ABORT_MARKER), record, exclusive=True)  # the first failure is reported
        except Exception:  # noqa: BLE001 - the storage itself may be what failed: the others then time out instead
            pass

    def _abort_reason(self, name: str = names.ABORT_MARKER) -> Optional[dict]:
        """The failure recorded in the marker ``name`` (the first one reported: ``ABORTED.json``)."""
        try:
            return json.loads(read_bytes(self.backend, self._path(name)))
        except (FileNotFoundError, ValueError):
            return None

    def wait_all(self) -> None:
        spec = self.spec
        errors = {names.error_marker_name(rank) for rank in range(spec.world_size)}
        done = {names.done_marker_name(rank) for rank in range(spec.world_size)}
        present: set = set()
        silence = _Silence(self, self.judge_silence)

        def listed() -> set:
            try:
                return set(self.backend.names(self.place))
            except FileNotFoundError:
                return set()

        def everyone_arrived() -> bool:
            nonlocal present
            present = listed()
            if present & errors or names.ABORT_MARKER in present:  # ABORTED.json may not be there yet: its rank's is
                reason = self._abort_reason() or self._abort_reason(min(present & errors, default=names.ABORT_MARKER))
                reason = reason or {"rank": "?", "error": "aborted"}
                raise failure_error(reason["rank"], reason["error"])
            if present >= done:
                return True
            gone = silence.gone([r for r in range(spec.world_size) if names.done_marker_name(r) not in present])
            if gone is not None and names.done_marker_name(gone[0]) not in listed():  # it may have arrived, then exited
                raise failure_error(*gone)
            return False

        def missing() -> BaseException:
            absent = sorted(r for r in range(spec.world_size) if names.done_marker_name(r) not in present)
            return _missing_error(spec, absent)

        poll(everyone_arrived, spec.timeout, missing, max_delay=self.backend.marker_poll_s * max(1.0, spec.world_size / 64))
        self.forget_arrivals()

    def forget_arrivals(self) -> None:
        """Coordinator, every rank arrived: the arrival and liveness markers go before the
        checkpoint is published."""
        ranks = range(self.spec.world_size)
        self._stop_heartbeat(*ranks)
        self.backend.delete([self._path(names.done_marker_name(rank)) for rank in ranks]
                            + [self._alive_path(rank) for rank in ranks], durable=False)

    def committed(self) -> None:
        pass  # the commit record under the final name is what the others wait for

    def wait_commit(self) -> None:
        spec = self.spec
        silence = _Silence(self, self.judge_silence)

        def committed() -> bool:
            record = read_commit_record(spec.final_path, spec.object_store)
            return record is not None and record.get("save_id") == (spec.save_id or spec.key)

        def committed_or_failed() -> bool:
            if committed():
                return True
            reason = self._abort_reason()
            if reason is not None:
                raise failure_error(reason["rank"], reason["error"])
            gone = silence.gone([COORDINATOR])
            if gone is not None and not committed():  # it may have committed, then exited
                raise failure_error(*gone)
            return False

        poll(committed_or_failed, spec.timeout, lambda: _no_commit_error(spec), max_delay=self.backend.marker_poll_s)


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

    def begin(self, rank: int) -> None:
        pass  # the training processes hold the Store: they see a writer that dies (``client.writer_queue``)

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
    """A save of one rank to an object store without a process group: nobody to wait for."""

    def __init__(self, spec: BarrierSpec) -> None:
        self.spec = spec

    def begin(self, rank: int) -> None:
        pass

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
    be reached, and every arrival and failure is also left as a marker where the checkpoint is written
    (``MarkerBarrier``'s), so that writers whose training processes died meet there instead and
    finish the saves handed to them. One small file (object) per rank and save is all it costs the others."""

    def __init__(self, store_barrier: Barrier, files: MarkerBarrier, reachable: Callable[[], bool]) -> None:
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

    def begin(self, rank: int) -> None:
        self.files.begin(rank)

    def arrive(self, rank: int) -> None:
        self.files.arrive(rank)
        self._in_store("arrive", rank)

    def fail(self, rank: int, reason: str) -> None:
        self._in_store("fail", rank, reason)  # first: writing the markers may be slow, or what fails (storage gone)
        self.files.fail(rank, reason)

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
        return MarkerBarrier(spec)
    if spec.kind == "solo":
        return SoloBarrier(spec)
    if store is None:
        raise CheckpointWriteError("its ranks meet in the torch.distributed Store, which this process cannot reach")
    return StoreBarrier(store, spec)
