"""Which checkpoints are committed: the commit record of a checkpoint, every one under a root,
``latest_checkpoint``, and taking a commit back; written once over the storage primitives.

More: docs/MODULES.md, core/storage/commit.py.
"""
from __future__ import annotations

import hashlib
import os
from typing import Optional

from asyncckpt.core.errors import IncompleteCheckpointError
from asyncckpt.core.formats import commit_record
from asyncckpt.core.formats import names
from asyncckpt.core.storage import file_checksums, orphans
from asyncckpt.core.storage.backend import backend_for, exists, join, read_all
from asyncckpt.core.storage.object_store import ObjectStoreOptions


def read_commit_record(path: str, options: Optional[ObjectStoreOptions] = None) -> Optional[dict]:
    """The commit record of the checkpoint at ``path`` (a directory, or an object-store prefix
    whose commit object it is, reached with ``options``), or None."""
    return commit_record.parse(read_all(backend_for(path, options), [join(path, names.COMMIT_RECORD)])[0])


def is_complete(path: str) -> bool:
    """A committed checkpoint: final (non-hidden) name and a valid commit record."""
    return not names.is_hidden(path) and read_commit_record(path) is not None


def require_complete(path: str) -> dict:
    """The commit record of ``path``; raises a clear error if it is missing or was never committed."""
    if not exists(backend_for(path), path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    record = read_commit_record(path)
    if record is None or names.is_hidden(path):
        raise IncompleteCheckpointError(
            f"checkpoint {path} is incomplete: it has no commit record ({names.COMMIT_RECORD}); the save that wrote it "
            "did not finish (crash, failure, or still in progress)", path=path)
    return record


def committed_under(root: str, options: Optional[ObjectStoreOptions] = None) -> list[tuple[str, Optional[dict]]]:
    """``(path, commit record or None)`` of every checkpoint name directly under ``root`` (an
    object store reached with ``options``): one listing of ``root`` (for a URL, one delimited
    listing: never the checkpoints' own objects), then the commit records, read side by side
    where the store allows. Nothing if ``root`` does not exist."""
    backend = backend_for(root, options)
    try:
        entries = backend.listing(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    candidates = [entry.path for entry in entries if entry.is_dir and not entry.name.startswith(".")]
    bodies = read_all(backend, [join(path, names.COMMIT_RECORD) for path in candidates])
    return [(path, commit_record.parse(body)) for path, body in zip(candidates, bodies)]


def uncommit(path: str, options: Optional[ObjectStoreOptions] = None) -> None:
    """Durably remove the commit record of the checkpoint at ``path``, so it no longer counts as
    complete: before a save writes anything under a checkpoint's final name (an object store's
    prefix, a DCP save in place)."""
    backend_for(path, options).delete([join(path, names.COMMIT_RECORD)])


def latest_checkpoint(root: str, *, orphan_timeout: float = 600.0) -> Optional[str]:
    """The newest complete checkpoint directly under ``root`` (by step, then commit time), or None.
    A writer of a previous run still finishing a checkpoint there (its training process died after
    the save call returned, ``orphans``) is waited for first, up to ``orphan_timeout`` seconds: a
    restarted job resumes from the checkpoint it commits."""
    if not backend_for(root).remote:
        orphans.wait_for_orphans(root, orphan_timeout)
    best_key, best_path = None, None
    for path, record in committed_under(root):
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


def same_save(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are copies of one save (a memory copy and its durable one): committed directories
    with the same save in their commit records (a copy carries its source's record), or single files with equal
    checksum records. What lacks a record is not known to be the same."""
    if os.path.isdir(a) and os.path.isdir(b):
        records = [read_commit_record(path) for path in (a, b)]
        return all(records) and records[0].get("save_id") is not None \
            and records[0].get("save_id") == records[1].get("save_id")
    checksums = [file_checksums.read_record(path) for path in (a, b)]
    return all(checksums) and checksums[0] == checksums[1]
