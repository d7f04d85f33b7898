"""The memory tier (docs/memory_tier.md), in one package; this module is its place on a node: where a checkpoint lives
in node-local memory, and whose it is.

More: docs/MODULES.md, core/tier/__init__.py.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import stat
import time
from dataclasses import dataclass
from typing import Callable, Collection, Optional

from asyncckpt.core.formats import names
from asyncckpt.core.formats.checksum import FileChecksum
from asyncckpt.core.storage import commit, file_checksums, fsio, leftovers, orphans, owners
from asyncckpt.core.storage.backend import backend_for, normalize
from asyncckpt.core.storage.contents import human_bytes, used_bytes

NODE_ENV, MEMORY_ROOT_ENV = "ASYNCCKPT_NODE", "ASYNCCKPT_MEMORY_ROOT"
DEFAULT_MEMORY_ROOT = "/dev/shm/asyncckpt"
RUN_RECORD = ".asyncckpt-tier.json"  # in a run directory: the durable root it holds memory copies of
OWNER_MARKER_PREFIX = ".owner-"  # in a run directory: ``.owner-<owner token>``, one per process using it now
#: In a run directory: the snapshot buffers of its saves, files named ``<owner token>.<n>`` after the training process
#: that made them (``snapshot.shared_buffer``); a rank's data file of a checkpoint is a hard link to one.
BUFFERS_DIR = ".asyncckpt-buffers"

#: How long a run directory nobody alive owns is kept (seconds since anything in it last changed). Not at once:
#: a job restarted after a crash (its launcher's retry, a SLURM requeue) must find its memory checkpoints on the
#: node, and every process of the dead job is gone by then. Not for ever: a job that never comes back must not
#: hold the node's memory (a tmpfs takes its pages from RAM). A job restarted later than this resumes from the
#: durable checkpoints, which a restart after so long would mostly have to do anyway (its node was likely
#: given to another job).
ORPHAN_AFTER_S = 3600.0


def node_id() -> str:
    """This node's name among the job's nodes (the launcher's, or ``ASYNCCKPT_NODE``)."""
    for variable in (NODE_ENV, "GROUP_RANK", "SLURM_NODEID"):
        value = os.environ.get(variable)
        if value:
            return value
    return socket.gethostname()


def memory_root(configured: Optional[str] = None) -> str:
    """Where this node keeps memory checkpoints: ``ASYNCCKPT_MEMORY_ROOT``, else ``configured``, else
    ``/dev/shm/asyncckpt``."""
    return os.path.abspath(os.environ.get(MEMORY_ROOT_ENV) or configured or DEFAULT_MEMORY_ROOT)


def loads_dir(memory_root_dir: str) -> str:
    """Beside a memory root, where cooperative loads keep their node copies (``loading.cooperative``): one folder
    ``<load token>-<node leader's pid>`` per load, for its duration."""
    return memory_root_dir.rstrip("/") + "-loads"


def dead_loads(loads: str) -> list[str]:
    """The node copies under ``loads`` (``loads_dir``) whose node leader no longer runs on this machine: what a
    killed load left."""
    return _entries_where(loads, lambda name: name.rpartition("-")[2].isdigit()
                          and not os.path.exists(f"/proc/{name.rpartition('-')[2]}"))


def captures_dir(memory_root_dir: str) -> str:
    """Beside a memory root, where a framework's save is captured (``integration.capture``): one scratch folder per
    capture, named after its process (an owner token), for the capture's duration."""
    return memory_root_dir.rstrip("/") + "-captures"


def dead_captures(captures: str) -> list[str]:
    """The scratch folders under ``captures`` (``captures_dir``) whose process is gone: what a save killed while it
    was captured left."""
    return _entries_where(captures, lambda name: owners.owner_alive(name) is False)


def remove_dead_buffers(run_directory: str) -> None:
    """Remove the names of the snapshot buffers (``BUFFERS_DIR``) of training processes that are gone from the run
    directory: a killed run's, found by its restart. The checkpoints linked to them keep their pages, and their
    files are the retention's to recycle again (``spares`` takes only files no other name links to)."""
    for path in _entries_where(os.path.join(run_directory, BUFFERS_DIR),
                               lambda name: owners.owner_alive(name.rpartition(".")[0]) is False):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def stored_bytes(path: str) -> int:
    """The bytes of the files under the local directory ``path``, each file once whatever its names (a checkpoint's
    data file and the snapshot buffer it links to are the same pages); 0 if there is nothing."""
    seen, total = set(), 0
    for directory, _subdirectories, files in os.walk(path):
        for name in files:
            try:
                found = os.lstat(os.path.join(directory, name))
            except FileNotFoundError:  # removed meanwhile
                continue
            if stat.S_ISREG(found.st_mode) and (found.st_dev, found.st_ino) not in seen:
                seen.add((found.st_dev, found.st_ino))
                total += found.st_size
    return total


def _entries_where(folder: str, dead: Callable[[str], bool]) -> list[str]:
    """The paths of the entries of ``folder`` whose name ``dead`` says is a dead process's, in name order."""
    try:
        names_here = sorted(os.listdir(folder))
    except OSError:
        return []
    return [os.path.join(folder, name) for name in names_here if dead(name)]


def run_name(durable_root: str) -> str:
    """The name of the run directory holding the memory copies of the checkpoints under ``durable_root``:
    readable, and unique per root (two runs with the same last path component do not share one). The root is
    taken as the core keeps it (``backend.normalize``: absolute, a URL without a trailing slash), so that a
    relative path, or ``asyncckpt ls`` run elsewhere, names the same run."""
    durable_root = normalize(durable_root)
    digest = hashlib.blake2b(durable_root.encode(), digest_size=6).hexdigest()
    return f"{os.path.basename(durable_root) or 'root'}-{digest}"


def run_dir(durable_root: str, root: Optional[str] = None) -> str:
    """The run directory of ``durable_root`` under this node's memory root."""
    return os.path.join(memory_root(root), run_name(durable_root))


def memory_path(durable_path: str, root: Optional[str] = None) -> str:
    """Where the memory copy of the checkpoint ``durable_path`` lives on this node."""
    durable_path = durable_path.rstrip("/")
    return os.path.join(run_dir(os.path.dirname(durable_path), root), os.path.basename(durable_path))


def open_run(durable_root: str, root: Optional[str] = None) -> str:
    """The run directory of ``durable_root``, created (with its record) if it is not there; returns it."""
    directory = run_dir(durable_root, root)
    record = os.path.join(directory, RUN_RECORD)
    if not os.path.exists(record):
        os.makedirs(directory, exist_ok=True)
        fsio.atomic_write_bytes(record, json.dumps({"durable_root": normalize(durable_root), "node": node_id(),
                                                    "created_ns": time.time_ns()}).encode())
    return directory


def durable_root_of(directory: str) -> Optional[str]:
    """The durable root whose memory copies the run directory ``directory`` holds (None: not a run directory)."""
    try:
        with open(os.path.join(directory, RUN_RECORD)) as f:
            return json.load(f)["durable_root"]
    except (OSError, ValueError, KeyError):
        return None


# ------------------------------------------------------------------------------------- what a run holds
#: In the commit record of a memory checkpoint saved on several nodes (``tier.nodes``): ``{"holders": {file:
#: [node, ...]}, "checksums": {file: {"size": ..., "xxh3": ...}}}``: which nodes hold each file (its own and the
#: peers that took a replica, as the save left them), and the whole-file checksums the record does not carry
#: otherwise (a sharded save's data files, sidecars, ``.metadata``), which a copy from another node is checked by.
TIER_ENTRY = "tier"


def record_checksums(record: dict) -> dict[str, FileChecksum]:
    """Every whole-file checksum the commit record ``record`` carries: its ``"checksums"`` (a directory
    checkpoint's files, a sharded one's extra files) and its ``TIER_ENTRY``'s."""
    entries = {**record.get(TIER_ENTRY, {}).get("checksums", {}), **record.get("checksums", {})}
    return {name: FileChecksum(entry["size"], entry["xxh3"]) for name, entry in entries.items()}


def writer_of(record: dict, name: str) -> int:
    """The rank that wrote the file ``name`` of the memory checkpoint whose commit record is ``record``: as the record's
    ``TIER_ENTRY`` says (a directory checkpoint's files, those of a save on several nodes), else the rank a sharded
    save's file is named after (its data files, its sidecar), else rank 0 (what the commit added: DCP's ``.metadata``,
    a save's extra files)."""
    ranks = record.get(TIER_ENTRY, {}).get("ranks", {})
    if name in ranks:
        return ranks[name]
    match = names.DATA_FILE_PATTERN.match(name) or names.SIDECAR_PATTERN.match(name)
    return int(match[1]) if match else 0


def holders(record: dict) -> dict[str, list[str]]:
    """The nodes that hold each file of the checkpoint whose commit record is ``record``, as its save left them
    (none recorded: a save on one node)."""
    return dict(record.get(TIER_ENTRY, {}).get("holders", {}))


@dataclass(frozen=True)
class MemoryCheckpoint:
    """A committed checkpoint in a run directory, as this node holds it. A node's copy of a checkpoint may hold
    only some of its files (its own ranks' shares and the replicas it received): ``missing`` names the others."""

    name: str  # as in the durable root
    path: str
    step: Optional[int]  # the commit record's, else the one its name gives
    committed_at: float  # seconds since the epoch: its commit record's time; a single file's modification time
    bytes_here: int  # what it uses on this node
    missing: tuple[str, ...]  # the files its record lists that are not here, or not of the size recorded
    record: Optional[dict]  # its commit record (a directory)
    checksum: Optional[FileChecksum] = None  # a single file's checksum record

    @property
    def complete(self) -> bool:
        """Every file of the checkpoint is here (a resume needs nothing of it from elsewhere)."""
        return not self.missing


def memory_checkpoints(run_directory: str) -> list[MemoryCheckpoint]:
    """The committed checkpoints in ``run_directory``, newest first (by step, then commit time, as
    ``commit.latest_checkpoint`` ranks them; a step-less one ranks below every step). Committed means what it
    means anywhere: a directory under its final name with its commit record, or a single file under its final
    name (published whole, by rename). Anything hidden (a save being staged, a checkpoint being removed, the
    run's own record and owner markers) is none. Nothing if the directory does not exist."""
    try:
        with os.scandir(run_directory) as scan:
            entries = [entry for entry in scan if not entry.name.startswith(".")]
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                checkpoint = _directory_checkpoint(entry.path)
            elif entry.is_file(follow_symlinks=False):
                checkpoint = _file_checkpoint(entry.path)
            else:
                continue
        except FileNotFoundError:  # removed meanwhile (retention, a cleaner)
            continue
        if checkpoint is not None:
            found.append(checkpoint)
    return sorted(found, key=lambda c: (-1 if c.step is None else c.step, c.committed_at), reverse=True)


def _directory_checkpoint(path: str) -> Optional[MemoryCheckpoint]:
    record = commit.read_commit_record(path)
    if record is None:
        return None
    name = os.path.basename(path)
    files = record.get("files") if isinstance(record.get("files"), dict) else {}
    missing = tuple(sorted(file for file, size in files.items() if _size(os.path.join(path, file)) != size))
    step = record["step"] if isinstance(record.get("step"), int) else names.step_from_name(name)
    committed_at = (record.get("committed_at_ns") or 0) / 1e9 or os.stat(path).st_mtime
    return MemoryCheckpoint(name, path, step, committed_at, used_bytes(path), missing, record)


def _file_checkpoint(path: str) -> MemoryCheckpoint:
    name, found = os.path.basename(path), os.stat(path)
    checksum = file_checksums.read_record(path)
    missing = (name,) if checksum is not None and checksum.size != found.st_size else ()
    return MemoryCheckpoint(name, path, names.step_from_name(name), found.st_mtime, found.st_size, missing, None,
                            checksum)


def _size(path: str) -> Optional[int]:
    try:
        return os.stat(path).st_size
    except (FileNotFoundError, NotADirectoryError):
        return None


def stale(run_directory: str, keep: int) -> list[str]:
    """The paths of the memory checkpoints in ``run_directory`` beyond its ``keep`` most recently committed (never
    the newest, whatever ``keep``): what retention removes (``removal.remove``). By commit time, not step: a
    framework's checkpoint without a step of its own (Lightning's ``last.ckpt``) is as new as its save."""
    newest_first = sorted(memory_checkpoints(run_directory), key=lambda checkpoint: checkpoint.committed_at,
                          reverse=True)
    return [checkpoint.path for checkpoint in newest_first[max(keep, 1):]]


# ------------------------------------------------------------------------------------------- capacity
@dataclass(frozen=True)
class Capacity:
    """What the memory tier may use on this node, and what it uses."""

    root: str  # the memory root
    limit: int  # bytes the tier may use on this node: MemoryTier.max_bytes, else half of the file system
    used: int  # bytes under the memory root now (every run's)
    available: int  # bytes the memory root's file system has free now (other programs use it too)
    filesystem: int  # bytes of the memory root's file system
    configured: bool  # ``limit`` is MemoryTier.max_bytes

    @property
    def free(self) -> int:
        """Bytes the tier may still take: below its limit, and there on the file system."""
        return max(0, min(self.limit - self.used, self.available))


def capacity(root: str, max_bytes: Optional[int] = None, for_run: Optional[str] = None) -> Capacity:
    """The capacity of the memory root ``root`` (a directory, ``memory_root()``; its file system is that of
    its nearest existing parent until it exists): ``max_bytes`` if given, else half of its file system, so
    that the tier never takes the memory training needs (a tmpfs holds its pages in RAM). ``for_run``: the
    run directory it is asked for; what that run holds already (a restarted job's checkpoints) counts as
    free, since it is part of what the run needs (``needed_bytes``): retention makes room for the new ones."""
    probe = os.path.abspath(root)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    stats = os.statvfs(probe)
    filesystem, available = stats.f_blocks * stats.f_frsize, stats.f_bavail * stats.f_frsize
    limit = max_bytes if max_bytes is not None else filesystem // 2
    own = stored_bytes(for_run) if for_run is not None else 0
    return Capacity(os.path.abspath(root), limit, stored_bytes(root) - own, available + own, filesystem,
                    max_bytes is not None)


def needed_bytes(per_checkpoint: int, keep: int) -> int:
    """The most a run's tier holds on a node: its ``keep`` newest checkpoints and the one being saved (retention
    removes the oldest only once the new one is committed). ``per_checkpoint``: this node's bytes of one
    checkpoint, its own ranks' shares and the replicas it receives."""
    return per_checkpoint * (keep + 1)


def fits(needed: int, capacity: Capacity) -> bool:
    """Whether ``needed`` more bytes fit in the tier on this node."""
    return needed <= capacity.free


def what_would_fit(per_checkpoint: int, keep: int, capacity: Capacity) -> str:
    """One sentence for the warning when a run's tier does not fit (``fits(needed_bytes(...))`` is False): what
    it needs, what is free, and what would fit: a smaller ``keep``, else a larger ``max_bytes``, else a larger
    file system (``mount -o size=``) under the memory root."""
    needed = needed_bytes(per_checkpoint, keep)
    said = (f"the memory tier needs {human_bytes(needed)} on this node ({keep + 1} checkpoints of "
            f"{human_bytes(per_checkpoint)}: keep={keep} and the one being saved), {human_bytes(capacity.free)} "
            f"is free for it under {capacity.root}")
    if fits(needed, capacity):
        return f"{said}; it fits"
    smaller = next((k for k in range(keep - 1, 0, -1) if fits(needed_bytes(per_checkpoint, k), capacity)), None)
    if smaller is not None:
        return f"{said}; keep={smaller} would fit"
    if needed <= capacity.available:  # the limit, not the file system, is too small
        limit = _rounded_up(capacity.used + needed)
        default = "" if capacity.configured else f" (the default is half of its {human_bytes(capacity.filesystem)})"
        return f"{said}; max_bytes={limit}{default} would fit"
    size = capacity.filesystem - capacity.available + needed  # what others use of it stays theirs
    if not capacity.configured:
        size = max(size, 2 * (capacity.used + needed))  # the default limit is half of it
    return f"{said}; a {human_bytes(_rounded_up(size))} tmpfs would fit"


def _rounded_up(nbytes: int) -> int:
    """``nbytes`` rounded up to whole MiB (whole GiB from 1 GiB on): a size to configure."""
    unit = 1 << 30 if nbytes >= 1 << 30 else 1 << 20
    return -(-nbytes // unit) * unit


# ------------------------------------------------------------------------------------ owners and orphans
def claim_run(directory: str) -> str:
    """Mark the run directory ``directory`` (``open_run``) as used by this process; returns the owner token
    to ``release_run`` it with. While any owner lives, no cleaner removes the run. FileNotFoundError if the
    directory is not there."""
    token = owners.owner_token()
    fd = os.open(os.path.join(directory, OWNER_MARKER_PREFIX + token), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.close(fd)
    return token


def release_run(directory: str, token: str) -> None:
    """This process no longer uses the run directory (``claim_run``'s token): from now on, with no other owner,
    the run is removed once ``ORPHAN_AFTER_S`` passed without a change in it."""
    try:
        os.unlink(os.path.join(directory, OWNER_MARKER_PREFIX + token))
    except FileNotFoundError:
        pass


@dataclass(frozen=True)
class Run:
    """A run directory under a memory root, and whether anybody uses it."""

    path: str
    durable_root: str
    owners: tuple[str, ...]  # the owner tokens of its markers
    alive: bool  # one of its owners is a live process of this host's current boot
    idle_s: float  # seconds since anything in it (an entry directly in it) last changed

    def orphaned(self, older_than_s: float = ORPHAN_AFTER_S) -> bool:
        """No live owner, and nothing changed in it for ``older_than_s``."""
        return not self.alive and self.idle_s >= older_than_s


def runs(root: str) -> list[Run]:
    """Every run directory under the memory root ``root``, in name order: the directories with a run record
    (``open_run``; nothing else there is ours to judge). An owner counts as alive only if it is a live process
    of this host's current boot (``owners.owner_alive``): a marker made on another host or boot is a dead
    owner's, since a tmpfs does not outlive a reboot, and a memory root is one node's."""
    try:
        with os.scandir(root) as scan:
            candidates = sorted(entry.path for entry in scan
                                if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for path in candidates:
        durable_root = durable_root_of(path)
        if durable_root is None:
            continue
        try:
            tokens, changed = _owners_and_last_change(path)
        except FileNotFoundError:  # removed meanwhile
            continue
        alive = any(owners.owner_alive(token) is True for token in tokens)
        found.append(Run(path, durable_root, tokens, alive, max(0.0, time.time() - changed)))
    return found


def _owners_and_last_change(directory: str) -> tuple[tuple[str, ...], float]:
    """The owner tokens of ``directory``'s markers, and when it or an entry directly in it last changed (a
    save published, a checkpoint removed, a marker made or released)."""
    tokens, changed = [], os.stat(directory).st_mtime
    with os.scandir(directory) as scan:
        for entry in scan:
            if entry.name.startswith(OWNER_MARKER_PREFIX):
                tokens.append(entry.name[len(OWNER_MARKER_PREFIX):])
            try:
                changed = max(changed, entry.stat(follow_symlinks=False).st_mtime)
            except FileNotFoundError:
                continue
    return tuple(sorted(tokens)), changed


def orphaned_runs(root: str, older_than_s: float = ORPHAN_AFTER_S) -> list[str]:
    """The run directories under the memory root ``root`` that no live process owns and in which nothing
    changed for ``older_than_s`` seconds (``runs``)."""
    return [run.path for run in runs(root) if run.orphaned(older_than_s)]


def remove_run(directory: str) -> None:
    """Delete the run directory ``directory`` with everything in it: renamed to a hidden name first, so that
    nothing sees it half-deleted, and a cleaner that dies half-way leaves a leftover any cleaner removes
    (``remove_orphans``). Nothing if it is gone already."""
    aside = _take_aside(directory)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def _take_aside(directory: str) -> Optional[str]:
    aside = names.hidden_path(directory, "removing", owners.owner_token())
    try:
        os.rename(directory, aside)
    except FileNotFoundError:  # another cleaner took it
        return None
    return aside


def remove_orphan(directory: str) -> bool:
    """Remove the run directory ``directory``, found orphaned (``Run.orphaned``), unless an owner claimed it
    since; returns whether it was removed. A process claiming the run just as it is taken aside would lose it,
    so it is judged once more once out of sight, and put back if a live owner showed up meanwhile."""
    aside = _take_aside(directory)
    if aside is None:
        return False
    tokens, _changed = _owners_and_last_change(aside)
    if any(owners.owner_alive(token) is True for token in tokens):
        try:
            os.rename(aside, directory)
            return False
        except OSError:  # its owner opened a new one meanwhile: this one is nobody's any more
            pass
    shutil.rmtree(aside, ignore_errors=True)
    return True


def remove_orphans(root: str, older_than_s: float = ORPHAN_AFTER_S) -> list[str]:
    """Remove the orphaned run directories under the memory root ``root`` (``orphaned_runs``), and what
    cleaners that died left there (``leftovers``); returns the run directories removed. Called by every process
    that opens a run (a Checkpointer with the tier, as it starts) and by ``asyncckpt clean``."""
    leftovers.clean(root)
    return [path for path in orphaned_runs(root, older_than_s) if remove_orphan(path)]


def latest_checkpoint(root: str, *, orphan_timeout: float = 600.0, memory_root: Optional[str] = None,
                      skipped: Collection[str] = ()) -> Optional[str]:
    """The newest complete checkpoint of ``root`` in any tier of this node (by step, then commit time), or None:
    directly under ``root`` (``commit.latest_checkpoint``), or in its memory run directory (under ``memory_root``,
    else the environment's or the default; but those named in ``skipped``), whose copy is the nearer where both hold
    the same step. A writer of a
    previous run still finishing a checkpoint in either is waited for first, up to ``orphan_timeout`` seconds. This
    node's view only: on several nodes, ``Checkpointer.latest_checkpoint`` (the nodes agree, and complete their
    copies from each other)."""
    best_key, best_path = None, None
    for place, nearness in ((root, 0), (run_dir(root, memory_root), 1)):
        if nearness and not os.path.isdir(place):
            continue
        if not backend_for(place).remote:
            orphans.wait_for_orphans(place, orphan_timeout)
        for path, record in commit.committed_under(place):
            if record is None or (nearness and os.path.basename(path) in skipped):
                continue
            step = record.get("step")
            key = (step if step is not None else -1, nearness, record.get("committed_at_ns", 0))
            if best_key is None or key > best_key:
                best_key, best_path = key, path
    return best_path
