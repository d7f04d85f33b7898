"""Making a checkpoint visible: the commit record, publishing by rename, ``latest_checkpoint``.

A checkpoint is written under a hidden staging name next to its final path (``names``). When
every rank's share is durable, the coordinator writes DCP's ``.metadata`` and then our commit
record (``.asyncckpt-commit.json``), fsyncs the directory, and renames it to its final name
(atomically exchanging it with an older checkpoint at that path, deleted only afterwards). So a
directory under its final name with a commit record is complete; anything else is not.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Optional

from asyncckpt.core.storage import locations, orphans
from asyncckpt.core.formats import names
from asyncckpt.core.errors import IncompleteCheckpointError
from asyncckpt.core.storage.fsio import atomic_write_bytes, exchange_paths, fsync_dir

COMMIT_FORMAT = "asyncckpt-commit"
COMMIT_VERSION = 1


def read_commit_record(path: str) -> Optional[dict]:
    """The commit record of the checkpoint at ``path`` (a directory, or an object-store prefix
    whose commit object it is), or None."""
    try:
        record = json.loads(locations.read_bytes(locations.join(path, names.COMMIT_RECORD)))
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != COMMIT_FORMAT or record.get("version", 0) > COMMIT_VERSION:
        return None
    return record


def is_complete(path: str) -> bool:
    """A committed checkpoint: final (non-hidden) name and a valid commit record."""
    return not names.is_hidden(path) and read_commit_record(path) is not None


def require_complete(path: str) -> dict:
    """The commit record of ``path``; raises a clear error if it is missing or was never committed."""
    if not locations.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    record = read_commit_record(path)
    if record is None or names.is_hidden(path):
        raise IncompleteCheckpointError(
            f"checkpoint {path} is incomplete: it has no commit record ({names.COMMIT_RECORD}); the save that wrote it "
            "did not finish (crash, failure, or still in progress)", path=path)
    return record


def latest_checkpoint(root: str, *, orphan_timeout: float = 600.0) -> Optional[str]:
    """The newest complete checkpoint directly under ``root`` (by step, then commit time), or None.
    A writer of a previous run still finishing a checkpoint there (its training process died after
    the save call returned, ``orphans``) is waited for first, up to ``orphan_timeout`` seconds: a
    restarted job resumes from the checkpoint it commits."""
    if locations.is_url(root):
        from asyncckpt.core.storage.object_checkpoints import committed_under

        found = committed_under(root)
    else:
        orphans.wait_for_orphans(root, orphan_timeout)
        try:
            entries = os.listdir(root)
        except FileNotFoundError:
            return None
        found = ((os.path.join(root, entry), read_commit_record(os.path.join(root, entry)))
                 for entry in entries if not entry.startswith("."))
    best_key, best_path = None, None
    for path, record in found:
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


def commit_record_bytes(record: dict) -> bytes:
    """The commit record document: ``record`` with the format, version and commit time added."""
    body = {"format": COMMIT_FORMAT, "version": COMMIT_VERSION, "committed_at_ns": time.time_ns(), **record}
    return json.dumps(body, indent=1).encode()


def write_commit_record(directory: str, record: dict) -> None:
    atomic_write_bytes(os.path.join(directory, names.COMMIT_RECORD), commit_record_bytes(record))


def uncommit(path: str) -> None:
    """Durably remove the commit record, so ``path`` no longer counts as complete (before it is
    overwritten in place)."""
    record = os.path.join(path, names.COMMIT_RECORD)
    if os.path.exists(record):
        os.unlink(record)
        fsync_dir(path)


def publish_with_record(staging_dir: str, final_path: str, record: dict) -> Optional[str]:
    """Coordinator: write the commit record (listing the checkpoint's files and sizes, those in
    subdirectories by their relative paths), rename into place (``publish``), then drop the
    writers' owner markers (until the rename they tell any cleaner that this staging directory
    is in use)."""
    files = {}
    for directory, subdirectories, entries in os.walk(staging_dir):
        subdirectories.sort()
        for entry in sorted(entries):
            if names.is_published_file(entry):
                path = os.path.join(directory, entry)
                files[os.path.relpath(path, staging_dir)] = os.path.getsize(path)
        if directory != staging_dir:
            fsync_dir(directory)  # the entries of files written into it
    write_commit_record(staging_dir, {"files": files, **record})
    replaced = publish(staging_dir, final_path)
    for entry in os.listdir(final_path):
        if names.OWNER_MARKER_PATTERN.match(entry):
            os.unlink(os.path.join(final_path, entry))
    return replaced


def publish(staging_dir: str, final_path: str) -> Optional[str]:
    """Rename the fully written, fsynced ``staging_dir`` to ``final_path``, replacing an older one;
    returns where the replaced checkpoint now is (a hidden name), to be deleted once the commit is
    reported: deleting a large tree (freeing extents, discards) takes ~0.1 s per GiB here, which
    is not part of making the new checkpoint durable.

    An existing checkpoint at ``final_path`` is swapped out atomically (renameat2 EXCHANGE), so
    there is no moment with neither checkpoint at the final name. Without renameat2 it is first
    renamed aside, never deleted before the new one is in place.
    """
    fsync_dir(staging_dir)
    parent = os.path.dirname(os.path.abspath(final_path))
    replaced = None
    if os.path.lexists(final_path):
        replaced = staging_dir
        if not exchange_paths(staging_dir, final_path):
            hidden = names.parse_hidden(os.path.basename(staging_dir))
            replaced = names.hidden_path(final_path, "replaced", hidden.token, os.path.dirname(staging_dir))
            os.rename(final_path, replaced)
            os.rename(staging_dir, final_path)
        else:  # the staging name now holds the old checkpoint: give it the name that says so
            hidden = names.parse_hidden(os.path.basename(staging_dir))
            aside = names.hidden_path(final_path, "replaced", hidden.token, os.path.dirname(staging_dir))
            os.rename(staging_dir, aside)
            replaced = aside
    else:
        os.rename(staging_dir, final_path)
    fsync_dir(parent)
    return replaced
