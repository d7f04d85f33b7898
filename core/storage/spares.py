"""The memory tier's spare files: what its retention drops, written over by the next save instead of freed.

Writing into tmpfs costs most where its pages are new. A ``write()`` of 1 GiB into a new tmpfs file took 0.45-0.60 s
of a core here, over the pages of an existing file 0.31-0.45 s, and received into a mapping of existing pages
(populated at once) 0.07-0.10 s more than the receive itself (docs/memory_tier.md, measured 2026-11-28). With the
memory tier every save writes its share into tmpfs and receives its peers' replicas there, while the tier's retention
frees as many bytes of the checkpoint it drops: fresh pages each save, on both sides, paid for by the training loop's
cores. So the retention keeps the large files of what it drops as the run directory's spares (``recycle``), and the
replicas the next save receives (``tier.transport``), and its own file where it is written rather than linked
to its staging buffer (``diskio.write_image``; ``snapshot.shared_buffer``), are written over a spare of at least
their size (``take``). A file a staging buffer links to is the training process's, never a spare.

* A spare is a file in ``SPARES_DIR`` of a memory run directory, taken by renaming it to the path a writer is about
  to write: each goes to one taker, whichever process (two ranks' writers, a receiver) asks at once.
* The spares no save took by the time the retention drops the next checkpoint are freed then: the run holds at most
  one dropped checkpoint's files besides its ``keep`` newest (``tier.needed_bytes`` counts one being saved, which
  the spares become), and they go with the run directory (the end of a run, an orphan's removal).
* A checkpoint is out of every listing (renamed aside, as ``removal`` removes one) before its files become spares;
  a file's attached checksum (a single-file checkpoint's) does not follow it.

Kept free of torch: the background writer uses it.
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
