"""Where a checkpoint lives: a local path or an object-store URL, and reading small files from either.

A URL (``s3://bucket/ckpts/step_100``, any ``scheme://``) names a prefix in an object store
(``object_store``); everything else is a local path. The core's functions that read what a
checkpoint says about itself (commit record, sidecars, ``.metadata``, listings of a root) go
through the few functions here, which keep local paths on the plain ``os`` calls they always
used and send URLs to the object store. The store is imported only for a URL, so local saves,
loads and the background writer never load fsspec.

Kept free of torch: the background writer imports it.
"""
from __future__ import annotations

import os
import posixpath


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` names an object-store location (``scheme://...``) rather than a local path."""
    return "://" in os.fspath(path)


def normalize(path: str | os.PathLike) -> str:
    """The form the core keeps a path in: a local path made absolute, a URL without a trailing slash."""
    path = os.fspath(path)
    return path.rstrip("/") if is_url(path) else os.path.abspath(path)


def join(base: str, *parts: str) -> str:
    return posixpath.join(base, *parts) if is_url(base) else os.path.join(base, *parts)


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/")) if is_url(path) else os.path.basename(path)


def read_bytes(path: str) -> bytes:
    """The whole content of a small file or object; FileNotFoundError if there is none."""
    if is_url(path):
        from asyncckpt.core.storage.object_store import store_for

        return store_for(path).get(path)
    with open(path, "rb") as f:
        return f.read()


def size_of(path: str) -> int:
    """Its size in bytes; FileNotFoundError if absent."""
    if is_url(path):
        from asyncckpt.core.storage.object_store import store_for

        return store_for(path).size(path)
    return os.stat(path).st_size


def list_names(path: str) -> list[str]:
    """The names directly under ``path`` (for a URL: objects and sub-prefixes one level down, by a
    delimited listing: nothing deeper is listed); FileNotFoundError if there is nothing there."""
    if is_url(path):
        from asyncckpt.core.storage.object_store import store_for

        return [entry.name for entry in store_for(path).list(path)]
    return os.listdir(path)


def exists(path: str) -> bool:
    if is_url(path):
        from asyncckpt.core.storage.object_store import store_for

        return store_for(path).exists(path)
    return os.path.exists(path)
