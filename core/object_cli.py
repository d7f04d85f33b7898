"""``asyncckpt ls / verify / clean`` for object-store URLs (``cli`` hands URLs here).

What they read is what ``object_checkpoints`` promises: commit objects from one delimited listing
of the root (never the data objects of other checkpoints), a single file's checksum from its
object metadata, owner markers for leftovers. ``verify`` of a checkpoint prefix copies its objects
(those the commit record lists, and the sidecars) into a temporary directory and checks that copy
with ``integrity``, exactly as a local checkpoint is checked: every byte has to be read anyway,
and a copy under the same names is the same checkpoint. ``inspect`` is local-only for now.
"""
from __future__ import annotations

import os
import posixpath
import sys
import tempfile
import time
from typing import Callable

from . import checkpoint_kinds, file_checksums, integrity, names
from .checksum import checksum
from .object_checkpoints import committed_under, delete_leftover, leftovers_under, removable
from .object_store import ObjectStoreError, store_for

EXIT_OK, EXIT_PROBLEM, EXIT_INCOMPLETE = 0, 1, 2


def cmd_ls(root: str, human: Callable[[int], str]) -> int:
    """Committed checkpoints (from their commit objects), single-file objects and leftovers, newest last."""
    root = root.rstrip("/")
    store = store_for(root)
    try:
        entries = store.list(root)
    except FileNotFoundError:
        entries = []
    except ObjectStoreError as e:
        print(f"asyncckpt ls: {e}", file=sys.stderr)
        return EXIT_PROBLEM
    rows = []
    for url, record in committed_under(root):
        if record is not None:
            step = record.get("step") if isinstance(record.get("step"), int) else checkpoint_kinds.step_from_name(url)
            size = sum(record.get("files", {}).values())
            kind = "sharded" if names.DCP_METADATA_FILE in record.get("files", {}) else "directory"
            rows.append(((step if step is not None else -1, record.get("committed_at_ns", 0) / 1e9), posixpath.basename(url),
                         step, size, "COMPLETE", kind))
    for entry in entries:
        if not entry.is_prefix and not entry.name.startswith(".") and entry.name.endswith(checkpoint_kinds.NATIVE_FILE_SUFFIXES):
            step = checkpoint_kinds.step_from_name(entry.name)
            note = "file" if file_checksums.read_record(entry.url) else "file, no checksums"
            rows.append(((step if step is not None else -1, entry.modified), entry.name, step, entry.size, "COMPLETE", note))
    for leftover in leftovers_under(root):
        name = leftover.url[len(root) + 1:]
        step = checkpoint_kinds.step_from_name(leftover.belongs_to)
        rows.append(((step if step is not None else -1, leftover.modified), name, step, leftover.size, "INCOMPLETE",
                     leftover.kind))
    rows.sort(key=lambda row: row[0])
    width = max((len(row[1]) for row in rows), default=0)
    for _key, name, step, size, status, note in rows:
        print(f"{name:<{width}}  {'-' if step is None else step:>8}  {human(size):>10}  {status}  ({note})")
    return EXIT_OK


def cmd_verify(url: str) -> int:
    """Check a checkpoint prefix (a copy of it, see the module docstring) or a single-file object."""
    url = url.rstrip("/")
    store = store_for(url)
    try:
        store.info(url)  # an object (a prefix is not one)
        return _verify_file(url)
    except FileNotFoundError:
        pass
    from .commit import read_commit_record

    record = read_commit_record(url)
    if record is None:
        if store.exists(url):
            print(f"{url}: INCOMPLETE: no commit object ({names.COMMIT_RECORD}): the save that wrote it did not "
                  "finish (crash, failure, still running). Not verified.")
            return EXIT_INCOMPLETE
        print(f"asyncckpt verify: {url}: not a checkpoint this tool knows", file=sys.stderr)
        return EXIT_PROBLEM
    wanted = sorted(set(record.get("files", {})) | {names.COMMIT_RECORD} | {
        names.sidecar_name(rank) for rank in range(record.get("world_size") or 0)})
    with tempfile.TemporaryDirectory(prefix="asyncckpt-verify-") as parent:
        copy = os.path.join(parent, posixpath.basename(url))
        os.makedirs(copy)
        for name, body in zip(wanted, store.get_many([posixpath.join(url, name) for name in wanted])):
            if body is not None:
                with open(os.path.join(copy, name), "wb") as f:
                    f.write(body)
        report = integrity.check(copy, on_problem=lambda message: print(message.replace(copy, url)))
    if report.problems:
        print(f"{url}: FAILED: {len(report.problems)} problem(s)")
        return EXIT_PROBLEM
    print(f"{url}: OK: {report.checked_files} file(s), {report.checked_bytes} B verified by checksum")
    return EXIT_OK


def _verify_file(url: str) -> int:
    expected = file_checksums.read_record(url)
    data = store_for(url).get(url)
    if expected is None:
        print(f"{url}: OK: {len(data)} B, without a checksum (written natively or by an older asyncckpt)")
        return EXIT_OK
    found = checksum(data) if len(data) == expected.size else None
    if found != expected.xxh3:
        what = f"{len(data)} B, {expected.size} B when written" if found is None else \
            f"checksum mismatch: expected xxh3 {expected.xxh3}, found {found}"
        print(f"{url}: FAILED: {what}")
        return EXIT_PROBLEM
    print(f"{url}: OK: 1 file(s), {expected.size} B verified by checksum")
    return EXIT_OK


def cmd_clean(root: str, min_age_s: float, dry_run: bool, human: Callable[[int], str]) -> int:
    """Remove what killed or crashed writers left under ``root``: uncommitted prefixes, single-file
    markers, incomplete multipart uploads (as ``cli.cmd_clean`` does for local leftovers)."""
    root = root.rstrip("/")
    freed = count = 0
    try:
        found = leftovers_under(root)
    except ObjectStoreError as e:
        print(f"asyncckpt clean: {e}", file=sys.stderr)
        return EXIT_PROBLEM
    for leftover in found:
        name = leftover.url[len(root) + 1:]
        if not removable(leftover, min_age_s):
            why = ("in use by a live writer" if leftover.alive else
                   f"its writer cannot be checked from this host; removed once untouched for {min_age_s:.0f} s")
            print(f"kept     {name}  ({why})")
            continue
        if not dry_run:
            delete_leftover(leftover)
        freed, count = freed + leftover.size, count + 1
        age = time.time() - leftover.modified
        print(f"{'would remove' if dry_run else 'removed'}  {name}  {human(leftover.size)}  ({leftover.kind} of "
              f"{leftover.belongs_to}, {age:.0f} s old)")
    print(f"{'would free' if dry_run else 'freed'} {human(freed)} in {count} entr{'y' if count == 1 else 'ies'}")
    return EXIT_OK
