"""Never writing the same bytes twice: a save shares the items unchanged since the checkpoint before, and each
checkpoint stays complete on its own.

More: docs/MODULES.md, core/storage/sharing.py.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import ctypes.util
import errno
import os
import posixpath
from dataclasses import dataclass, field
from typing import Optional

from asyncckpt.core.errors import CheckpointError
from asyncckpt.core.formats import names
from asyncckpt.core.formats.layout import IO_ALIGNMENT, Slot
from asyncckpt.core.formats.sidecar import ShareItems, Sidecar
from asyncckpt.core.storage import commit
from asyncckpt.core.storage.backend import is_url, join, normalize
from asyncckpt.core.storage.sidecar_io import read_sidecar

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


@dataclass(frozen=True)
class BaseItem:
    """An item of the base: the file of the base that holds it, where, and its two hashes."""

    file: str
    start: int
    length: int
    xxh3: str
    content_id: str


def tensor_key(slot: Slot) -> tuple:
    """What must be equal, besides the bytes, for a tensor item to be shared: key, chunk, dtype, and its place in the
    data file (the base's file then holds the same container where the layout puts it)."""
    return (slot.fqn, tuple(slot.chunk_offsets), tuple(slot.chunk_sizes), slot.dtype, slot.start, slot.length,
            slot.data_start, slot.nbytes)


@dataclass
class Base:
    """What the base offers one rank's next share: its items by key, the ranges of each of its files that it uses,
    and the files linked into the new checkpoint so far."""

    directory: str
    save_id: str
    tensors: dict[tuple, BaseItem]
    objects: dict[str, BaseItem]
    used: dict[str, list[tuple[int, int]]]  # file -> [start, end) of every item of the base in it
    linked: dict[str, Optional[str]] = field(default_factory=dict)  # base file -> its name in the new checkpoint

    def tensor(self, slot: Slot, xxh3: str) -> Optional[BaseItem]:
        """The base's item this slot's bytes may equal (the same place, the same xxh3-64), if any: they are equal if
        its content id (which the base may lack) equals theirs too."""
        item = self.tensors.get(tensor_key(slot))
        return item if item is not None and item.xxh3 == xxh3 else None

    def object(self, fqn: str, data: bytes, xxh3: str) -> Optional[BaseItem]:
        item = self.objects.get(fqn)
        return item if item is not None and item.length == len(data) and item.xxh3 == xxh3 else None

    def link_unchanged(self, item: Optional[BaseItem], content_id: str, directory: str) -> Optional[str]:
        """``link`` of the file that holds ``item``, if it is a candidate whose content id equals ``content_id``."""
        return self.link(item.file, directory) if item is not None and item.content_id == content_id else None

    def link(self, file: str, directory: str) -> Optional[str]:
        """The base's ``file`` linked into ``directory`` (the new checkpoint's staging directory): its name there, or
        None where it cannot be linked (the base removed meanwhile, another file system, too many links): its items
        are then written. A file only the base still links first gives back what the base does not use."""
        if file in self.linked:
            return self.linked[file]
        source = os.path.join(self.directory, file)
        name = names.shared_file_name(file, self.save_id)
        try:
            if os.stat(source).st_nlink == 1:
                punch_unreferenced(source, self.used.get(file, []))
            target = os.path.join(directory, name)
            with contextlib.suppress(FileNotFoundError):  # a save's request run again
                os.unlink(target)
            os.link(source, target)
        except OSError:
            name = None
        self.linked[file] = name
        return name


def parent_of(path: str) -> str:
    """The root a checkpoint at ``path`` (a local path or a URL) is under."""
    return posixpath.dirname(path) if is_url(path) else os.path.dirname(os.path.abspath(path))


def newest_committed(root: str, exclude: str) -> Optional[tuple[str, dict]]:
    """The most recently committed checkpoint directly under ``root`` (its path and commit record), other than
    ``exclude`` (the save's staging: in an object store, the checkpoint being written in place)."""
    best = None
    for path, record in commit.committed_under(root):
        if record is None or path == exclude:
            continue
        if best is None or record.get("committed_at_ns", 0) > best[1].get("committed_at_ns", 0):
            best = (path, record)
    return best


_remembered: dict[tuple[str, int], tuple[str, str, Base]] = {}  # (root, rank) -> this process's last committed share


def remember(final_path: str, save_id: str, rank: int, items: ShareItems) -> None:
    """``rank``'s share of the save ``save_id``, committed at ``final_path``: the base of this writer's next save
    beside it, without listing the root and parsing the sidecar again (a few requests per save in an object store).
    A share that recorded no content ids (sharing off, a memory-tier buffer) offers nothing: it is not kept."""
    if items.layout is not None and items.tensor_ids is None:
        return
    tensors: dict[tuple, BaseItem] = {}
    used: dict[str, list[tuple[int, int]]] = {}
    if items.layout is not None and items.tensor_ids is not None:
        files = items.tensor_files or [items.layout.file_name] * len(items.layout.slots)
        for slot, file, xxh3, content_id in zip(items.layout.slots, files, items.tensor_digests, items.tensor_ids):
            tensors[tensor_key(slot)] = BaseItem(file, slot.start, slot.length, xxh3, content_id or "")
            used.setdefault(file, []).append((slot.start, slot.start + slot.length))
    objects: dict[str, BaseItem] = {}
    files = items.object_files or [items.objects_file] * len(items.objects)
    for (fqn, start, length, xxh3), file, content_id in zip(items.objects, files, items.object_ids or []):
        objects[fqn] = BaseItem(file, start, length, xxh3, content_id)
        used.setdefault(file, []).append((start, start + length))
    root = parent_of(final_path)
    _remembered[root, rank] = (normalize(final_path), save_id, Base(normalize(final_path), save_id, tensors, objects,
                                                                    used))
    while len(_remembered) > 4:  # a writer saves under a root or two
        _remembered.pop(next(iter(_remembered)))


def _remembered_base(root: str, rank: int, exclude: str) -> Optional[Base]:
    """The share this process committed last beside it, if that checkpoint is still there, committed by that save."""
    found = _remembered.get((root, rank))
    if found is None or found[0] == exclude:
        return None
    path, save_id, base = found
    record = commit.read_commit_record(path)
    if record is None or record.get("save_id") != save_id:
        return None
    return dataclasses.replace(base, linked={})


def find_base(final_path: str, staging_dir: str, rank: int, part: str = "") -> Optional[Base]:
    """What the newest committed checkpoint beside ``final_path`` offers ``rank``'s share of the save being written
    in ``staging_dir``: in that checkpoint's ``part`` (a DCP subdirectory of a directory checkpoint, ``""``: the
    checkpoint itself). None where there is none, or it recorded no content ids. The share this process committed
    last there stands for the newest (``remember``): another process's newer one is not looked for."""
    if not part:
        remembered = _remembered_base(parent_of(final_path), rank, normalize(staging_dir))
        if remembered is not None:
            return remembered
    found = newest_committed(parent_of(final_path), normalize(staging_dir))
    if found is None:
        return None
    path, record = found
    directory = join(path, part) if part else path
    try:
        sidecar = read_sidecar(directory, rank)
    except (OSError, CheckpointError):
        return None
    if not part and sidecar.save_id != record.get("save_id"):  # (a DCP part's sidecars carry the part's save id)
        return None
    if sidecar.tensors.xxh3_128 is None and sidecar.tensors.fqn:
        return None
    return _base_of(directory, sidecar)


def _base_of(directory: str, sidecar: Sidecar) -> Base:
    t, o = sidecar.tensors, sidecar.objects
    shapes = [tuple(shape) for shape in t.shapes]
    tensors: dict[tuple, BaseItem] = {}
    used: dict[str, list[tuple[int, int]]] = {}
    for fqn, offsets, sizes, dtype, file, start, length, data_start, nbytes, xxh3, content_id in zip(
            t.fqn, t.chunk_offsets, t.chunk_sizes, t.dtype, t.item_files(), t.start, t.length, t.data_start, t.nbytes,
            t.xxh3, t.xxh3_128 or []):
        tensors[(fqn, shapes[offsets], shapes[sizes], dtype, start, length, data_start, nbytes)] = BaseItem(
            file, start, length, xxh3, content_id)
        used.setdefault(file, []).append((start, start + length))
    objects: dict[str, BaseItem] = {}
    for fqn, file, start, length, xxh3, content_id in zip(o.fqn, o.item_files(), o.start, o.length, o.xxh3,
                                                          o.xxh3_128 or []):
        objects[fqn] = BaseItem(file, start, length, xxh3, content_id)
        used.setdefault(file, []).append((start, start + length))
    return Base(directory, sidecar.save_id, tensors, objects, used)


# ------------------------------------------------------------------------------------------ giving bytes back
_libc = None


def _fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if _libc.fallocate(fd, mode, offset, length) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


def punch_unreferenced(path: str, used: list[tuple[int, int]]) -> int:
    """Give back the whole blocks of the file ``path`` that no range of ``used`` touches (its size stays; they read
    as zeros, and nothing reads them). Returns the bytes punched; 0 where the file system cannot punch holes."""
    punched = 0
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        size, cursor = os.fstat(fd).st_size, 0
        for start, end in sorted(used) + [(size, size)]:
            begin, stop = -(-cursor // IO_ALIGNMENT) * IO_ALIGNMENT, start // IO_ALIGNMENT * IO_ALIGNMENT
            if stop > begin:
                _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, begin, stop - begin)
                punched += stop - begin
            cursor = max(cursor, end)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
    finally:
        os.close(fd)
    return punched


def _sharded_parts(checkpoint: str) -> list[str]:
    """The directories of a committed checkpoint that hold sidecars: itself, or its DCP parts (subdirectories)."""
    found = [checkpoint]
    with contextlib.suppress(OSError):
        found += [entry.path for entry in os.scandir(checkpoint) if entry.is_dir(follow_symlinks=False)]
    return found


def compact(root: str) -> None:
    """After checkpoints under the local directory ``root`` were removed: what the files the remaining ones share
    hold for none of them given back. A file is compacted only where every name it has is one of these checkpoints'
    (its link count says so), so bytes another name may need (a copy made with ``cp -l``) are never taken."""
    holders: dict[tuple[int, int], list] = {}  # (device, inode) -> [path, names found, ranges used]
    for checkpoint, record in commit.committed_under(root):
        if record is None:
            continue
        for directory in _sharded_parts(checkpoint):
            try:
                entries = os.listdir(directory)
                linked = {}
                for name in entries:
                    if names.DATA_FILE_PATTERN.match(name):
                        stat = os.stat(os.path.join(directory, name))
                        if stat.st_nlink > 1 or names.SHARED_FILE_PATTERN.match(name):
                            linked[name] = (stat.st_dev, stat.st_ino, stat.st_nlink)
                if not linked:
                    continue
                used: dict[str, list[tuple[int, int]]] = {}
                for entry in entries:
                    match = names.SIDECAR_PATTERN.match(entry)
                    if match is not None:
                        for file, ranges in _base_of(directory, read_sidecar(directory, int(match.group(1)))).used.items():
                            used.setdefault(file, []).extend(ranges)
            except (OSError, CheckpointError):
                continue  # removed meanwhile, or unreadable: what it holds is not known, so not given back
            for name, (device, inode, count) in linked.items():
                holder = holders.setdefault((device, inode), [os.path.join(directory, name), 0, [], count])
                holder[1] += 1
                holder[2] += used.get(name, [])
    for path, found, ranges, count in holders.values():
        if found == count:
            with contextlib.suppress(OSError):
                punch_unreferenced(path, ranges)


def shared_bytes(directory: str) -> int:
    """The bytes of the files under ``directory`` that other names link too (other checkpoints sharing them):
    what ``asyncckpt ls`` says each checkpoint shares."""
    found = 0
    with contextlib.suppress(OSError):
        for parent, _subdirectories, files in os.walk(directory):
            for name in files:
                with contextlib.suppress(OSError):
                    stat = os.lstat(os.path.join(parent, name))
                    if stat.st_nlink > 1:
                        found += stat.st_blocks * 512
    return found
