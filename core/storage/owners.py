"""Who owns what asyncckpt writes: owner tokens, and the owner markers of a staging directory.

More: docs/MODULES.md, core/storage/owners.py.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import secrets
import socket
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


def is_owner_token(text: str) -> bool:
    """Whether ``text`` is an owner token (rather than a save id shared by the ranks of a save)."""
    return _TOKEN.match(text) is not None


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


def same_process(a: str, b: str) -> bool:
    """Two owner tokens made by one process (they differ in their random part)."""
    return a.rsplit("-", 1)[0] == b.rsplit("-", 1)[0]


def claim(staging_dir: str, rank: int, token: str) -> None:
    """Create the local ``staging_dir`` of a directory checkpoint (if needed) and add ``token``'s
    process to this rank's owner marker, so that nobody takes the directory for a leftover while
    any process writing into it lives: the training process, which writes files into it itself,
    and its writer, which finishes the save if the training process dies. The staging directory
    of a single process's save is named with its owner token already
    (``Checkpointer.begin_directory``): only other processes are added. (A sharded save's
    staging has one writer per rank: ``staging.Staging.claim``.)"""
    os.makedirs(staging_dir, exist_ok=True)
    hidden = names.parse_hidden(os.path.basename(staging_dir))
    if hidden is not None and is_owner_token(hidden.token) and same_process(hidden.token, token):
        return
    marker = os.path.join(staging_dir, names.owner_marker_name(rank))
    try:
        with open(marker) as f:
            owners = f.read().split()
    except FileNotFoundError:
        owners = []
    if any(same_process(owner, token) for owner in owners):
        return
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, f"{token}\n".encode())  # one write: two claimers never interleave a line
    finally:
        os.close(fd)


def verdict(tokens: list[Optional[str]]) -> Optional[bool]:
    """Whether a place its writers share (a staging directory, an object-store prefix being
    written) is in use, from the tokens of its owner markers (None for a marker that could not be
    read: it vanished meanwhile, as when the save commits): True if any owner lives, False if every
    one is known gone, else None (cannot tell here)."""
    verdicts = [owner_alive(token) if token is not None else None for token in tokens]
    if any(v is True for v in verdicts):
        return True
    if verdicts and all(v is False for v in verdicts):
        return False
    return None
