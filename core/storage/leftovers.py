"""What crashed saves leave behind, whether its writer still lives, and removing it: written once
over the storage primitives, for every store.

More: docs/MODULES.md, core/storage/leftovers.py.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

from asyncckpt.core.formats import commit_record
from asyncckpt.core.formats import names
from asyncckpt.core.storage import owners
from asyncckpt.core.storage.backend import Backend, at_once, backend_for, join, read_all
from asyncckpt.core.storage.listing import IncompleteUpload, Listed
from asyncckpt.core.storage.object_store import ObjectStoreOptions


@dataclass(frozen=True)
class Leftover:
    """What a crashed writer may have left: ``alive`` True (a writer still uses it), False (a
    leftover), or None (made elsewhere: cannot tell). ``size`` where finding it measured it, else
    None (``contents.used_bytes``)."""

    path: str
    kind: str  # a hidden name's kind, "uncommitted" (an object-store prefix) or "upload"
    belongs_to: str
    alive: Optional[bool]
    modified: float
    size: Optional[int] = None
    is_dir: bool = False  # a directory or prefix (deleted with everything under it)

    def describe(self) -> str:
        state = {True: "in use", False: "left by a process that is gone", None: "owner unknown (another host?)"}
        return f"{self.kind} of {self.belongs_to}: {self.path} ({state[self.alive]})"


def find(root: str) -> list[Leftover]:
    """Every leftover directly under ``root`` (see the module docstring), in name order; nothing if
    there is nothing under ``root``. NotADirectoryError if ``root`` is a file."""
    backend = backend_for(root)
    try:
        entries = sorted(backend.listing(root), key=lambda entry: entry.name)
    except FileNotFoundError:
        return []
    present = {entry.name for entry in entries}
    found: list[Leftover] = []
    for entry in entries:
        hidden = names.parse_hidden(entry.name)
        if hidden is not None:
            is_dir = entry.is_dir and not entry.link
            found.append(Leftover(entry.path, hidden.kind, hidden.name, _judge(backend, entry, hidden, present),
                                  entry.modified, None if is_dir else entry.size, is_dir))
    uploads = backend.uploads(root)
    if backend.remote:  # written in place: a prefix without a commit record is a save that never committed
        prefixes = [entry for entry in entries if entry.is_dir and not entry.name.startswith(".")]
        records = read_all(backend, [join(entry.path, names.COMMIT_RECORD) for entry in prefixes])
        found += [_uncommitted(backend, entry, uploads) for entry, record in zip(prefixes, records)
                  if commit_record.parse(record) is None]
    found += _unfinished(root, uploads, found)
    return found


def _judge(backend: Backend, entry: Listed, hidden: names.HiddenName, present: set[str]) -> Optional[bool]:
    if hidden.kind == "removing":
        return False
    if hidden.kind == "replaced":  # the only copy left if a crash came between the two renames of a
        # publish without an atomic exchange: kept until its checkpoint's name is back
        return False if hidden.name in present else None
    if hidden.kind == "staging" and not owners.is_owner_token(hidden.token):  # a save id shared by ranks
        return _place_alive(backend, entry.path)
    alive = owners.owner_alive(hidden.token)
    if hidden.kind == "staging" and alive is not True and _place_alive(backend, entry.path) is True:
        return True  # its writer finishes it (the process that began it is gone)
    return alive


def _place_alive(backend: Backend, path: str, entries: Optional[list[Listed]] = None) -> Optional[bool]:
    """A place the ranks of a save share lives while any rank's writer does (its owner markers);
    None if no marker says. One with a removing marker, or a checkpoint a publish swapped out (a
    commit record, no marker), is garbage."""
    if entries is None:
        try:
            entries = backend.listing(path)
        except OSError:
            return False
    present = {entry.name for entry in entries}
    if names.REMOVING_MARKER in present:
        return False
    markers = [entry.path for entry in entries if names.OWNER_MARKER_PATTERN.match(entry.name)]
    tokens: list[Optional[str]] = []
    for body in read_all(backend, markers):
        tokens += [None] if body is None else body.decode(errors="replace").split()
    if not tokens and names.COMMIT_RECORD in present:
        return False
    return owners.verdict(tokens)


def _uncommitted(backend: Backend, entry: Listed, uploads: list[IncompleteUpload]) -> Leftover:
    """A prefix written in place that has no commit record, judged by its owner markers."""
    try:
        entries = backend.listing(entry.path)
    except FileNotFoundError:  # deleted meanwhile
        entries = []
    modified = max([e.modified for e in entries] + [u.initiated for u in uploads if u.url.startswith(entry.path + "/")],
                   default=0.0)
    return Leftover(entry.path, "uncommitted", entry.name, _place_alive(backend, entry.path, entries), modified,
                    sum(e.size for e in entries), True)


def _unfinished(root: str, uploads: list[IncompleteUpload], found: list[Leftover]) -> list[Leftover]:
    """Incomplete uploads that do not go with an uncommitted prefix: a single file's (its writer
    named by the marker beside it) or one inside a committed checkpoint (nobody's to judge)."""
    dead_prefixes = [leftover.path for leftover in found if leftover.kind == "uncommitted"]
    writing: dict[str, Optional[bool]] = {}  # single-file name -> whether a writer of it lives
    for leftover in found:
        if leftover.kind == "tmp":
            writing[leftover.belongs_to] = True if leftover.alive or writing.get(leftover.belongs_to) else leftover.alive
    result = []
    for upload in uploads:
        if any(upload.url.startswith(prefix + "/") for prefix in dead_prefixes):
            continue  # goes with its prefix
        below = upload.url[len(root.rstrip("/")) + 1:]
        name = below.split("/", 1)[0]
        result.append(Leftover(upload.url, "upload", name, writing.get(name) if "/" not in below else None,
                               upload.initiated, 0))
    return result


def delete(leftover: Leftover, token: Optional[str] = None) -> None:
    """Delete a leftover for good (as ``token``, this process by default): a directory or prefix
    with everything under it, interrupted uploads aborted."""
    backend = backend_for(leftover.path)
    if leftover.kind == "upload":
        backend.abort_uploads(leftover.path)
    elif leftover.is_dir:
        backend.abort_uploads(leftover.path)
        backend.remove_tree(leftover.path, token or owners.owner_token(), later=at_once)
    else:
        backend.delete([leftover.path], durable=False)


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
        delete(leftover)
    return removed


def tidy_parent(path: str, options: Optional[ObjectStoreOptions] = None) -> Optional[str]:
    """The local directory beside ``path`` whose dead writers' leftovers a writer removes after
    its reply; None in an object store (listing a bucket per save is not free: ``asyncckpt clean``)."""
    return None if backend_for(path, options).remote else os.path.dirname(os.path.abspath(path))
