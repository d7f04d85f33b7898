"""Durable file-system primitives: fsync'd atomic writes, directory fsync, atomic exchange."""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

from asyncckpt.core.formats import names
from asyncckpt.core.storage.owners import owner_token

_RENAME_EXCHANGE = 2


def fsync_dir(path: str) -> None:
    """Make directory entries (new files, renames) in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    """Make the content of the file at ``path`` durable (one written by someone else: a copy, a download)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so readers see either nothing/the old file, or all of it."""
    tmp = names.hidden_path(path, "tmp", owner_token())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _load_renameat2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return function


_renameat2 = _load_renameat2()
_AT_FDCWD = -100


def exchange_paths(a: str, b: str) -> bool:
    """Atomically swap two existing paths (Linux renameat2 RENAME_EXCHANGE). False if unsupported."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), a)
