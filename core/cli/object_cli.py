"""``asyncckpt ls / inspect`` in an object store (``cli.main`` hands a remote backend's paths here).

What they read is what ``object_backend`` promises: commit objects from one delimited listing of
the root (never the data objects of other checkpoints), a single file's checksum from its object
metadata, owner markers for leftovers; ``inspect`` reads a checkpoint's commit object and DCP
``.metadata``, never its data objects. (``verify`` and ``clean`` are the same for every backend:
``cli.main``.)
"""
from __future__ import annotations

import posixpath
import sys
from typing import Callable

from asyncckpt.core.verify import checkpoint_kinds
from asyncckpt.core.storage import commit
from asyncckpt.core.storage import file_checksums
from asyncckpt.core.formats import names
from asyncckpt.core.loading.metadata_io import load_dcp_metadata
from asyncckpt.core.storage.backend import backend_for
from asyncckpt.core.storage.object_store import ObjectStoreError, store_for

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
    for url, record in commit.committed_under(root):
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
    for leftover in backend_for(root).find_leftovers(root):
        name = leftover.path[len(root) + 1:]
        step = checkpoint_kinds.step_from_name(leftover.belongs_to)
        rows.append(((step if step is not None else -1, leftover.modified), name, step, leftover.size, "INCOMPLETE",
                     leftover.kind))
    rows.sort(key=lambda row: row[0])
    width = max((len(row[1]) for row in rows), default=0)
    for _key, name, step, size, status, note in rows:
        print(f"{name:<{width}}  {'-' if step is None else step:>8}  {human(size):>10}  {status}  ({note})")
    return EXIT_OK


def cmd_inspect(url: str) -> int:
    """A checkpoint prefix by its commit object (step, world size, files) and, when sharded, the
    keys its DCP ``.metadata`` lists; a single-file object by its size and checksum."""
    url = url.rstrip("/")
    store = store_for(url)
    record = commit.read_commit_record(url)
    if record is None:
        try:
            size = store.info(url).get("size", 0)
        except FileNotFoundError:
            held = _exists_as_prefix(store, url)
            print(f"{url}: INCOMPLETE: no commit object ({names.COMMIT_RECORD}): the save that wrote it did not finish"
                  if held else f"asyncckpt inspect: {url}: not a checkpoint this tool knows", file=sys.stderr)
            return EXIT_INCOMPLETE if held else EXIT_PROBLEM
        checksum = file_checksums.read_record(url)
        print(f"{url}: single-file object, {size} B, {'checksum attached' if checksum else 'no checksum'}")
        return EXIT_OK
    files = record.get("files", {})
    print(f"{url}: COMPLETE, step {record.get('step', '-')}, world size {record.get('world_size', '-')}, "
          f"save {record.get('save_id', '-')}")
    for name, size in sorted(files.items()):
        print(f"  {name}  {size} B")
    if names.DCP_METADATA_FILE in files:
        for fqn, entry in load_dcp_metadata(url).state_dict_metadata.items():
            if hasattr(entry, "chunks"):  # TensorStorageMetadata
                print(f"{fqn}  tensor  {str(entry.properties.dtype).removeprefix('torch.')}  "
                      f"[{', '.join(map(str, entry.size))}]  {len(entry.chunks)} chunk(s)")
            else:
                print(f"{fqn}  object")
    return EXIT_OK


def _exists_as_prefix(store, url: str) -> bool:
    """Whether anything is stored under ``url``/ (an uncommitted checkpoint's objects)."""
    try:
        return bool(store.list(url))
    except FileNotFoundError:
        return False
