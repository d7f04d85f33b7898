"""The commit record (``.asyncckpt-commit.json``): encoding it, and the one parser every store uses.

A checkpoint is complete when its commit record exists under its final name (docs/FORMAT.md).
Local directories and object-store prefixes hold the same document, so they are read by the
same parser: a record of another format, or of a newer version than this code knows, is not a
commit record here, whatever store it comes from (a newer asyncckpt may have changed what it
promises; treating its checkpoint as complete could load it wrongly).
"""
from __future__ import annotations

import json
import time
from typing import Optional

COMMIT_FORMAT = "asyncckpt-commit"
COMMIT_VERSION = 1


def encode(record: dict) -> bytes:
    """The commit record document: ``record`` with the format, version and commit time added."""
    body = {"format": COMMIT_FORMAT, "version": COMMIT_VERSION, "committed_at_ns": time.time_ns(), **record}
    return json.dumps(body, indent=1).encode()


def parse(body: Optional[bytes]) -> Optional[dict]:
    """The commit record in ``body``, or None: no body, not JSON, not a commit record, or a version
    newer than ``COMMIT_VERSION``."""
    if body is None:
        return None
    try:
        record = json.loads(body)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("format") != COMMIT_FORMAT:
        return None
    version = record.get("version", 0)
    if not isinstance(version, int) or version > COMMIT_VERSION:
        return None
    return record
