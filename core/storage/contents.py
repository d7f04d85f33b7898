"""What lies under a checkpoint's directory or prefix, read through any backend and written once:
the files a commit record lists, the bytes a checkpoint (or leftover) uses (and how to say them to
people), a local copy of some of its files.

Kept free of torch: the background writer imports it.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator, Optional

from asyncckpt.core.formats import names
from asyncckpt.core.storage.backend import Backend, backend_for, basename, join


def published_files(backend: Backend, directory: str, *, descend: bool = True) -> tuple[dict[str, int], list[str]]:
    """``(files, coordination)`` of the staging ``directory``: every file that belongs to the
    checkpoint and its size, those in subdirectories by their relative paths (``descend``; links
    are not followed into), in name order; and the names directly in it that belong to the
    coordination of its writers instead (``names.is_published_file``). A hidden subdirectory (an
    object store's barrier place) is not the checkpoint's: it is never listed."""
    files: dict[str, int] = {}
    coordination: list[str] = []

    def walk(path: str, prefix: str) -> None:
        for entry in sorted(backend.listing(path), key=lambda item: item.name):
            if not names.is_published_file(entry.name):
                if not prefix:
                    coordination.append(entry.name)
            elif not entry.is_dir:
                files[prefix + entry.name] = entry.size
            elif descend and not entry.link:
                walk(entry.path, f"{prefix}{entry.name}/")

    walk(directory, "")
    return files, coordination


def used_bytes(path: str) -> int:
    """The bytes stored under ``path``: a file's, or every file's below a directory or prefix
    (symlinks not followed: what it holds itself); 0 if there is nothing."""
    backend = backend_for(path)
    try:
        found = backend.stat(path)
    except FileNotFoundError:
        return 0
    if found.link:
        return 0
    return _below(backend, path) if found.is_dir else found.size


def human_bytes(nbytes: int) -> str:
    """Sizes for people (binary units: ``512 B``, ``10.1 KiB``, ``40.0 GiB``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _below(backend: Backend, path: str) -> int:
    try:
        entries = backend.listing(path)
    except (FileNotFoundError, NotADirectoryError):  # a save or a cleanup running concurrently
        return 0
    return sum(0 if entry.link else _below(backend, entry.path) if entry.is_dir else entry.size for entry in entries)


@contextlib.contextmanager
def local_copy(path: str, wanted: list[str]) -> Iterator[str]:
    """A local directory holding the files ``wanted`` of the checkpoint at ``path`` (those that
    exist): the checkpoint itself where it is local, else a temporary copy under the same name
    (local space the size of what is fetched, under ``TMPDIR``), each file written as it arrives."""
    backend = backend_for(path)
    if not backend.remote:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="asyncckpt-copy-") as parent:
        copy = os.path.join(parent, basename(path))
        os.makedirs(copy)

        def land(index: int, body: Optional[bytes]) -> None:
            if body is not None:
                target = os.path.join(copy, wanted[index])
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(body)

        backend.read_ranges([(join(path, name), 0, None) for name in wanted], land)
        yield copy
