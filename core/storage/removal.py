"""Removing checkpoints and files so that none is ever seen half-removed: written once over the
storage primitives, for every store.

More: docs/MODULES.md, core/storage/removal.py.
"""
from __future__ import annotations

import os
from typing import Optional

from asyncckpt.core.storage import sharing
from asyncckpt.core.storage.backend import Later, backend_for
from asyncckpt.core.storage.object_store import ObjectStoreOptions


def remove(paths: list[str], token: str, later: Later, *, hidden_parent: Optional[str] = None,
           options: Optional[ObjectStoreOptions] = None) -> None:
    """Remove each of ``paths`` (all of one store, reached with ``options``; absent ones are fine):
    a checkpoint by ``Backend.remove_tree`` (moved into ``hidden_parent`` if given: a directory
    whose every entry a framework counts), owned by ``token``, its deletion left to ``later``; a
    single file, or a link, deleted."""
    if not paths:
        return
    backend = backend_for(paths[0], options)
    files = []
    for path in paths:
        try:
            found = backend.stat(path)
        except FileNotFoundError:  # a dangling link is deleted as a file
            found = None
        if found is not None and found.is_dir and not found.link:
            backend.remove_tree(path, token, later=later, hidden_parent=hidden_parent)
        else:
            files.append(path)
    backend.delete(files)
    if not backend.remote:  # once they are deleted: what only they used, of the files they shared, goes too
        for root in {os.path.dirname(os.path.abspath(path)) for path in paths}:
            later(lambda root=root: sharing.compact(root))
