"""Making a checkpoint visible: staging directories, the commit record, ``latest_checkpoint``.

A checkpoint is written under a hidden staging name next to its final path. When every rank's
share is durable, the coordinator writes DCP's ``.metadata`` and then our commit record
(``.asyncckpt-commit.json``), fsyncs the directory, and renames it to its final name (atomically
exchanging it with an older checkpoint at that path, which is deleted only afterwards). So a
directory under its final name with a commit record is complete; anything else is not.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from typing import Optional

from .errors import IncompleteCheckpointError
from .fsio import atomic_write_bytes, exchange_paths, fsync_dir

COMMIT_RECORD = ".asyncckpt-commit.json"
COMMIT_FORMAT = "asyncckpt-commit"
COMMIT_VERSION = 1
ABORT_MARKER = "ABORTED.json"
_STAGING_RE = re.compile(r"^\.(?P<name>.+)\.asyncckpt-(?P<kind>staging|replaced)-(?P<save_id>[0-9a-zA-Z_-]+)$")


def staging_dir_for(final_path: str, save_id: str, staging_parent: Optional[str] = None) -> str:
    """The hidden staging directory of a save: next to the final path, or in ``staging_parent``
    (which must be on the same filesystem, since publishing is a rename)."""
    parent, name = os.path.split(os.path.abspath(final_path))
    return os.path.join(os.path.abspath(staging_parent) if staging_parent else parent,
                        f".{name}.asyncckpt-staging-{save_id}")


def read_commit_record(path: str) -> Optional[dict]:
    try:
        with open(os.path.join(path, COMMIT_RECORD), "rb") as f:
            record = json.load(f)
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != COMMIT_FORMAT or record.get("version", 0) > COMMIT_VERSION:
        return None
    return record


def is_complete(path: str) -> bool:
    """A committed checkpoint: final (non-staging) name and a valid commit record."""
    return not _STAGING_RE.match(os.path.basename(os.path.normpath(path))) and read_commit_record(path) is not None


def require_complete(path: str) -> dict:
    """The commit record of ``path``; raises a clear error if it is missing or was never committed."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    record = read_commit_record(path)
    if record is None or _STAGING_RE.match(os.path.basename(os.path.normpath(path))):
        raise IncompleteCheckpointError(
            f"checkpoint {path} is incomplete: it has no commit record ({COMMIT_RECORD}); the save that wrote it "
            "did not finish (crash, failure, or still in progress)"
        )
    return record


def latest_checkpoint(root: str) -> Optional[str]:
    """The newest complete checkpoint directly under ``root`` (by step, then commit time), or None."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return None
    best_key, best_path = None, None
    for name in names:
        if name.startswith("."):
            continue
        path = os.path.join(root, name)
        record = read_commit_record(path)
        if record is None:
            continue
        step = record.get("step")
        key = (step if step is not None else -1, record.get("committed_at_ns", 0))
        if best_key is None or key > best_key:
            best_key, best_path = key, path
    return best_path


def job_token() -> str:
    """Something every rank of one job shares without talking: torchrun's run id, else the rendezvous."""
    token = os.environ.get("TORCHELASTIC_RUN_ID") or f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"
    return hashlib.blake2b(token.encode(), digest_size=4).hexdigest() if token != ":" else "local"


def write_commit_record(staging_dir: str, record: dict) -> None:
    body = {"format": COMMIT_FORMAT, "version": COMMIT_VERSION, "committed_at_ns": time.time_ns(), **record}
    atomic_write_bytes(os.path.join(staging_dir, COMMIT_RECORD), json.dumps(body, indent=1).encode())


def publish(staging_dir: str, final_path: str) -> None:
    """Rename the fully written, fsynced ``staging_dir`` to ``final_path``, replacing an older one.

    An existing checkpoint at ``final_path`` is swapped out atomically (renameat2 EXCHANGE), so
    there is no moment with neither checkpoint at the final name. Without renameat2 it is first
    renamed aside, never deleted before the new one is in place. The replaced checkpoint, now
    under a hidden name, is deleted by ``remove_replaced`` once the commit has been reported:
    deleting a large tree (freeing extents, discards) takes ~0.1 s per GiB here, which is not
    part of making the new checkpoint durable.
    """
    fsync_dir(staging_dir)
    parent = os.path.dirname(os.path.abspath(final_path))
    if os.path.lexists(final_path):
        if not exchange_paths(staging_dir, final_path):
            aside = staging_dir.replace("-staging-", "-replaced-")
            os.rename(final_path, aside)
            os.rename(staging_dir, final_path)
            staging_dir = aside
        fsync_dir(parent)
        _replaced.append(staging_dir)  # now holds the replaced checkpoint
        _replaced.extend(left_behind_replaced(final_path, keep=staging_dir))
    else:
        os.rename(staging_dir, final_path)
        fsync_dir(parent)


_replaced: list[str] = []


def hidden_kind(name: str) -> Optional[str]:
    """"staging" or "replaced" for the hidden directory names of the commit protocol, else None."""
    match = _STAGING_RE.match(name)
    return match.group("kind") if match else None


def hidden_name_of(name: str) -> Optional[str]:
    """The checkpoint name a hidden directory of the commit protocol belongs to, else None."""
    match = _STAGING_RE.match(name)
    return match.group("name") if match else None


def left_behind_replaced(final_path: str, keep: str) -> list[str]:
    """Hidden directories of ``final_path`` that hold a checkpoint an earlier commit swapped out
    (a writer killed before deleting it left them behind). They are recognised by their commit
    record: a save in progress has none until its rename, so no rank's share is ever taken."""
    parent, name = os.path.split(os.path.abspath(final_path))
    found = []
    for entry in os.listdir(parent):
        path = os.path.join(parent, entry)
        if hidden_name_of(entry) == name and path != keep and read_commit_record(path) is not None:
            found.append(path)
    return found


def remove_replaced() -> None:
    """Delete the checkpoints that ``publish`` swapped out (the writer calls this after replying)."""
    while _replaced:
        _remove_tree(_replaced.pop())


def mark_aborted(staging_dir: str, reason: dict) -> None:
    """Tell every rank waiting on this save that it failed (it will never be committed)."""
    os.makedirs(staging_dir, exist_ok=True)
    atomic_write_bytes(os.path.join(staging_dir, ABORT_MARKER), json.dumps(reason).encode())


def read_abort(staging_dir: str) -> Optional[dict]:
    try:
        with open(os.path.join(staging_dir, ABORT_MARKER), "rb") as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def _remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def uncommit(path: str) -> None:
    """Durably remove the commit record, so ``path`` no longer counts as complete."""
    record = os.path.join(path, COMMIT_RECORD)
    if os.path.exists(record):
        os.unlink(record)
        fsync_dir(path)


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint: first un-commit it (so a crash mid-delete leaves no 'complete' torso)."""
    uncommit(path)
    _remove_tree(path)
