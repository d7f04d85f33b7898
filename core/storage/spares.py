"""The memory tier's spare files: what its retention drops, written over by the next save instead of freed.

More: docs/MODULES.md, core/storage/spares.py.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
from typing import Optional

from asyncckpt.core.formats import names

SPARES_DIR = ".asyncckpt-spares"  # in a memory run directory: the spare files (``tier.run_dir``)
MIN_BYTES = 16 << 20  # smaller files are freed: their pages cost little next to a save's large ones
_LEVELS = 3  # a written file lies at most this far below its run directory (a DCP part of a directory checkpoint)


def recycle(paths: list[str], run_directory: str, token: str) -> None:
    """Remove the checkpoints ``paths`` of the memory run directory ``run_directory`` (the retention's), keeping their
    files of at least ``MIN_BYTES`` as its spares, in place of those no save took since the last time. Each
    checkpoint leaves every listing first (a directory renamed to a hidden ``removing`` name owned by ``token``, a
    single file renamed into the spares or deleted)."""
    folder = os.path.join(run_directory, SPARES_DIR)
    shutil.rmtree(folder, ignore_errors=True)
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            aside = names.hidden_path(path, "removing", token)
            try:
                os.rename(path, aside)
            except FileNotFoundError:  # another cleaner took it
                continue
            for directory, _subdirectories, files in os.walk(aside):
                for name in files:
                    _keep(os.path.join(directory, name), folder)
            shutil.rmtree(aside, ignore_errors=True)
        elif not _keep(path, folder):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _keep(path: str, folder: str) -> bool:
    """``path`` moved into the spares ``folder`` if it is a regular file of at least ``MIN_BYTES`` that no other name
    links to (someone keeps those pages: they are not ours to write over): whether it was."""
    try:
        found = os.lstat(path)
        if not (stat.S_ISREG(found.st_mode) and found.st_size >= MIN_BYTES and found.st_nlink == 1):
            return False
        with contextlib.suppress(OSError):  # ENODATA: none attached; unsupported: none could be
            os.removexattr(path, names.CHECKSUM_ATTRIBUTE, follow_symlinks=False)
        os.makedirs(folder, exist_ok=True)
        os.rename(path, os.path.join(folder, uuid.uuid4().hex))
    except FileNotFoundError:
        return False
    return True


def take(path: str, size: int) -> Optional[int]:
    """A descriptor (read-write) of a spare of at least ``size`` bytes of the run directory ``path`` lies in, now
    renamed to ``path`` and cut to ``size``: the smallest such spare. None where there is none (no spares there,
    none large enough, ``size`` below ``MIN_BYTES``): the caller writes a new file."""
    if size < MIN_BYTES:
        return None
    folder = _folder_of(path)
    if folder is None:
        return None
    for spare in _fitting(folder, size):
        try:
            os.rename(spare, path)
        except FileNotFoundError:  # another writer took it
            continue
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd
    return None


def _folder_of(path: str) -> Optional[str]:
    directory = os.path.dirname(os.path.abspath(path))
    for _ in range(_LEVELS):
        folder = os.path.join(directory, SPARES_DIR)
        if os.path.isdir(folder):
            return folder
        directory = os.path.dirname(directory)
    return None


def _fitting(folder: str, size: int) -> list[str]:
    """The spares in ``folder`` of at least ``size`` bytes, smallest first."""
    found = []
    try:
        with os.scandir(folder) as scan:
            for entry in scan:
                try:
                    spare_size = entry.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    continue
                if spare_size >= size:
                    found.append((spare_size, entry.path))
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise
    return [spare for _size, spare in sorted(found)]
