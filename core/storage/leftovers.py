"""What crashed saves leave behind, whether its writer still lives, and removing it.

Every entry asyncckpt makes beside a checkpoint has a hidden name (``names``). Whether one is a
leftover is decided by its owner, not its age: entries of a single writer carry that writer's
*owner token* in their name, and a staging directory (shared by every rank of a save) holds an
owner marker per rank. A token names the host, the boot and the process id, so on the host that
made it, a process that is gone, or a boot that is over, means a leftover. An entry made on
another host cannot be judged here: ``asyncckpt clean`` removes those only past an age the user
gives. Checkpoints being deleted (``replaced``, ``removing``) are garbage whoever holds them.

Removal renames the leftover to a ``removing`` name of our own first, so that two cleaners (two
ranks' writers, the CLI) never delete into each other, and a crash half-way through leaves a
leftover that is recognisably dead.

Kept free of torch: the background writer and the CLI use it.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import secrets
import shutil
import socket
import time
from dataclasses import dataclass
from typing import Optional

from asyncckpt.core.formats import names

_TOKEN = re.compile(r"^(?P<host>[0-9a-f]{6})(?P<boot>[0-9a-f]{6})-(?P<pid>\d+)-[0-9a-f]+$")


def _short_hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=3).hexdigest()


@functools.lru_cache(maxsize=None)
def _host_and_boot() -> tuple[str, str]:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # not Linux: no boot id; a reboot then looks like a live owner (never wrongly deleted)
        boot = "unknown"
    return _short_hash(socket.gethostname()), _short_hash(boot)


def owner_token() -> str:
    """This process as an owner: host, boot, pid, and a random part that keeps names unique."""
    host, boot = _host_and_boot()
    return f"{host}{boot}-{os.getpid()}-{secrets.token_hex(3)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:  # an exited process nobody reaped yet (an orphaned writer, until init reaps it) is gone
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def owner_alive(token: str) -> Optional[bool]:
    """True / False for a token made on this host; None when that cannot be known here (another
    host, or not a token of ours)."""
    match = _TOKEN.match(token)
    if match is None:
        return None
    host, boot = _host_and_boot()
    if match["host"] != host:
        return None
    if match["boot"] != boot:
        return False
    return _pid_alive(int(match["pid"]))


def _same_process(a: str, b: str) -> bool:
    """Two owner tokens made by one process (they differ in their random part)."""
    return a.rsplit("-", 1)[0] == b.rsplit("-", 1)[0]


def claim(staging_dir: str, rank: int, token: str) -> None:
    """Create ``staging_dir`` (if needed) and add ``token``'s process to this rank's owner marker,
    so that nobody takes the directory for a leftover while any process writing into it lives:
    the training process, and its writer, which finishes the save if the training process dies.
    The staging directory of a single process's save is named with its owner token already
    (``Checkpointer.begin_directory``): only other processes are added."""
    os.makedirs(staging_dir, exist_ok=True)
    hidden = names.parse_hidden(os.path.basename(staging_dir))
    if hidden is not None and _TOKEN.match(hidden.token) and _same_process(hidden.token, token):
        return
    marker = os.path.join(staging_dir, names.owner_marker_name(rank))
    try:
        with open(marker) as f:
            owners = f.read().split()
    except FileNotFoundError:
        owners = []
    if any(_same_process(owner, token) for owner in owners):
        return
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{token}\n".encode())  # one write: two claimers never interleave a line
    finally:
        os.close(fd)


def _staging_alive(path: str) -> Optional[bool]:
    """A staging directory lives while any rank's writer does; None if no marker says."""
    verdicts = []
    try:
        entries = os.listdir(path)
    except OSError:
        return False
    for entry in entries:
        if names.OWNER_MARKER_PATTERN.match(entry):
            try:
                with open(os.path.join(path, entry)) as f:
                    verdicts.extend(owner_alive(token) for token in f.read().split())
            except OSError:
                continue
    if any(v is True for v in verdicts):
        return True
    if verdicts and all(v is False for v in verdicts):
        return False
    if not verdicts and names.COMMIT_RECORD in entries:  # a checkpoint a publish swapped out
        return False
    return None


@dataclass(frozen=True)
class Leftover:
    """A hidden entry of ours (or, in an object store, what a crashed writer left: ``object_backend``):
    ``alive`` True (a writer still uses it), False (a leftover), or None (made elsewhere: cannot
    tell). ``size`` where finding it measured it (object stores), else None (``Backend.used_bytes``)."""

    path: str
    kind: str
    belongs_to: str
    alive: Optional[bool]
    modified: float
    size: Optional[int] = None

    def describe(self) -> str:
        state = {True: "in use", False: "left by a process that is gone", None: "owner unknown (another host?)"}
        return f"{self.kind} of {self.belongs_to}: {self.path} ({state[self.alive]})"


def _judge(path: str, hidden: names.HiddenName) -> Optional[bool]:
    if hidden.kind == "removing":
        return False
    if hidden.kind == "replaced":  # the only copy left if a crash came between the two renames of a
        # publish without an atomic exchange: kept until its checkpoint's name is back
        return False if os.path.lexists(os.path.join(os.path.dirname(path), hidden.name)) else None
    if hidden.kind == "staging" and not _TOKEN.match(hidden.token):  # a save id shared by ranks: markers say
        return _staging_alive(path)
    alive = owner_alive(hidden.token)
    if hidden.kind == "staging" and alive is not True and _staging_alive(path) is True:
        return True  # its writer finishes it (the process that began it is gone)
    return alive


def find(parent: str) -> list[Leftover]:
    """Every hidden entry of ours directly in ``parent``."""
    try:
        entries = os.listdir(parent)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in sorted(entries):
        hidden = names.parse_hidden(entry)
        if hidden is None:
            continue
        path = os.path.join(parent, entry)
        try:
            modified = os.lstat(path).st_mtime
        except FileNotFoundError:  # removed meanwhile
            continue
        found.append(Leftover(path, hidden.kind, hidden.name, _judge(path, hidden), modified))
    return found


def delete(path: str, token: Optional[str] = None) -> None:
    """Delete an entry of ours for good: renamed to a ``removing`` name owned by ``token`` (this
    process by default) unless it has one already, then removed."""
    hidden = names.parse_hidden(os.path.basename(path))
    if os.path.isdir(path) and not os.path.islink(path):
        if hidden is None or hidden.kind != "removing":
            doomed = names.hidden_path(path, "removing", token or owner_token())
            try:
                os.rename(path, doomed)
            except FileNotFoundError:  # another cleaner took it
                return
            path = doomed
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def removable(leftover: Leftover, unknown_older_than: Optional[float] = None) -> bool:
    """Whether a cleaner may delete ``leftover``: its owner is gone; or its owner cannot be judged
    here, ``unknown_older_than`` (seconds) is given, and it is older than that. Never one in use."""
    if leftover.alive is False:
        return True
    return leftover.alive is None and unknown_older_than is not None and time.time() - leftover.modified >= unknown_older_than


def clean(parent: str, *, unknown_older_than: Optional[float] = None) -> list[Leftover]:
    """Delete the leftovers in ``parent`` that are ``removable``; returns them."""
    removed = [leftover for leftover in find(parent) if removable(leftover, unknown_older_than)]
    for leftover in removed:
        delete(leftover.path)
    return removed
