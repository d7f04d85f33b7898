"""Checking a checkpoint against what was written: every kind, for ``asyncckpt verify`` and for the
adapters, which verify a checkpoint on the framework's own resume path before any state changes.

More: docs/MODULES.md, core/verify/integrity.py.
"""
from __future__ import annotations

import logging
import mmap
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from asyncckpt.core.verify import checkpoint_kinds
from asyncckpt.core.storage import commit
from asyncckpt.core.storage import file_checksums
from asyncckpt.core.formats import names
from asyncckpt.core.formats.checksum import checksum
from asyncckpt.core.errors import CheckpointError, CorruptCheckpointError
from asyncckpt.core.formats.checksum import FileChecksum
from asyncckpt.core.storage.backend import Backend, backend_for, basename, is_file
from asyncckpt.core.storage.contents import local_copy
from asyncckpt.core.loading.metadata_io import check_relative_path, load_dcp_metadata
from asyncckpt.core.storage.sidecar_io import read_rank_sidecar

# torch.save containers are zip files: a local file header first, the end-of-central-directory
# record (22 bytes, no comment) last. Stock DCP loading needs both intact; our checksums cover
# only the tensor bytes between them, so their signatures are checked separately.
_ZIP_LOCAL_HEADER, _ZIP_END, _ZIP_END_SIZE = b"PK\x03\x04", b"PK\x05\x06", 22

Progress = Callable[[int], None]
# How a file with a recorded checksum is checked: what is wrong with it, or None. The default reads it
# for nothing else; a resume passes one that loads it for the framework while hashing (integration.resume).
FileCheck = Callable[[str, FileChecksum, Optional[Progress]], Optional[str]]
logger = logging.getLogger("asyncckpt")


@dataclass
class Report:
    """What checking one checkpoint found."""

    path: str
    kind: str
    status: str  # "COMPLETE", "INCOMPLETE", "NATIVE" (written without asyncckpt)
    problems: list[str] = field(default_factory=list)
    checked_files: int = 0
    checked_bytes: int = 0
    unverified: list[str] = field(default_factory=list)  # files with no checksum to check against
    differences: list[str] = field(default_factory=list)  # files removed or added since the commit (directories)

    @property
    def intact(self) -> bool:
        return self.status != "INCOMPLETE" and not self.problems


def check(path: str, *, on_problem: Callable[[str], None] = lambda message: None,
          progress: Optional[Progress] = None, share: tuple[int, int] = (0, 1),
          check_file: FileCheck = file_checksums.problem) -> Report:
    """Check the checkpoint at ``path``; ``on_problem`` hears each problem as it is found. With
    ``share=(index, count)``, only the data files of the ranks ``index, index + count, ...`` of a
    sharded checkpoint are read (the ranks of a job check their shares side by side); ``check_file``
    checks each file that has a checksum (a resume's hashes the bytes the framework loads). A checkpoint
    in an object store is checked on a local copy of what its commit record lists
    (``contents.local_copy``: every byte has to be read anyway, and a copy under the same names is
    the same checkpoint), every message naming the URL."""
    backend = backend_for(path)
    if not names.is_hidden(path) and is_file(backend, path):
        report = Report(path, "file", "COMPLETE")

        def problem(message: str) -> None:
            report.problems.append(message)
            on_problem(message)

        _check_file(path, basename(path), file_checksums.read_record(path), report, problem, progress,
                    check_file)
        return report
    with local_copy(path, _names_to_check(backend, path)) as local:
        report = _check_local(local, lambda message: on_problem(message.replace(local, path)), progress, share,
                              check_file)
    report.path = path
    report.problems = [message.replace(local, path) for message in report.problems]
    return report


def _names_to_check(backend: Backend, path: str) -> list[str]:
    """What a check reads of the checkpoint at ``path``: what its commit record lists, with the
    record and the sidecars; uncommitted, only what says what it is (sidecars, ``.metadata``)."""
    record = commit.read_commit_record(path)
    if record is not None:
        return sorted(set(record.get("files", {})) | {names.COMMIT_RECORD} | {
            names.sidecar_name(rank) for rank in range(record.get("world_size") or 0)})
    try:
        entries = backend.names(path)
    except NotADirectoryError:  # a hidden file: a leftover
        return []
    return sorted(name for name in entries if name == names.DCP_METADATA_FILE or names.SIDECAR_PATTERN.match(name))


def _check_local(path: str, on_problem: Callable[[str], None], progress: Optional[Progress],
                 share: tuple[int, int], check_file: FileCheck) -> Report:
    entry = checkpoint_kinds.classify(path, read_step=False)
    if entry is None:
        raise FileNotFoundError(f"{path}: not a checkpoint (a file, or a sharded or native checkpoint directory)")
    report = Report(path, entry.kind, entry.status)

    def problem(message: str) -> None:
        report.problems.append(message)
        on_problem(message)

    if entry.status == "INCOMPLETE":
        return report
    if entry.status == "NATIVE":
        report.unverified = sorted(os.listdir(path))
    elif entry.kind == "directory":
        record = commit.read_commit_record(path)
        files, sharded = _split_sharded_parts(record.get("files", {}))
        report.differences = _differences(path, record.get("files", {}))
        for name, size in sorted(files.items()):
            if not os.path.lexists(os.path.join(path, name)):
                continue  # removed: a difference
            expected = record.get("checksums", {}).get(name)
            _check_file(os.path.join(path, name), name, FileChecksum(expected["size"], expected["xxh3"]) if expected else None,
                        report, problem, progress, check_file, size)
        for subdirectory, part_files in sorted(sharded.items()):
            _check_sharded(os.path.join(path, subdirectory), {"files": part_files}, report,
                           lambda message, prefix=subdirectory: problem(f"{prefix}/{message}"),
                           progress or (lambda n: None), share)
    else:
        _check_sharded(path, commit.read_commit_record(path), report, problem, progress or (lambda n: None), share)
    return report


def _differences(path: str, committed: dict[str, int]) -> list[str]:
    """The files of a directory checkpoint removed or added since its commit (paths relative to it)."""
    on_disk = {os.path.relpath(os.path.join(parent, name), path)
               for parent, _dirs, entries in os.walk(path) for name in entries} - {names.COMMIT_RECORD}
    return [f"{name}: removed" for name in sorted(set(committed) - on_disk)] + \
        [f"{name}: added" for name in sorted(on_disk - set(committed))]


def _split_sharded_parts(files: dict[str, int]) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """A directory checkpoint's files: those checked one by one, and its DCP subdirectories (a
    framework's FSDP shards, ``DirectoryTransaction.save_sharded``), each checked item by item."""
    sharded_dirs = {os.path.dirname(name) for name in files
                    if os.path.dirname(name) and os.path.basename(name) == names.DCP_METADATA_FILE}
    plain: dict[str, int] = {}
    sharded: dict[str, dict[str, int]] = {subdirectory: {} for subdirectory in sharded_dirs}
    for name, size in files.items():
        subdirectory = os.path.dirname(name)
        if subdirectory in sharded:
            sharded[subdirectory][os.path.basename(name)] = size
        else:
            plain[name] = size
    return plain, sharded


def total_bytes(path: str) -> int:
    """What ``check`` will checksum, in bytes (the total of its ``progress`` calls, for a progress bar)."""
    entry = checkpoint_kinds.classify(path, read_step=False)
    if entry is None or entry.status != "COMPLETE" and entry.kind != "file":
        return 0
    if entry.kind == "file":
        record = file_checksums.read_record(path)
        return record.size if record else 0
    record = commit.read_commit_record(path)
    extra = sum(expected["size"] for expected in record.get("checksums", {}).values())
    parts = [os.path.join(path, subdirectory) for subdirectory in _split_sharded_parts(record.get("files", {}))[1]] \
        if entry.kind == "directory" else [path]
    return extra + sum(_item_bytes(part, record if part == path else {}) for part in parts)


def _item_bytes(path: str, record: dict) -> int:
    world_size = record.get("world_size") or max(sidecar_ranks(path), default=-1) + 1
    sidecars = load_sidecars(path, range(world_size), lambda message: None)
    return sum(item["nbytes"] for sidecar in sidecars.values() for item in sidecar["items"])


def require_intact(path: str, share: tuple[int, int] = (0, 1), check_file: FileCheck = file_checksums.problem) -> Report:
    """``check``, raising ``CorruptCheckpointError`` (naming the checkpoint, the files, the keys) if
    anything is wrong, ``IncompleteCheckpointError`` if it was never committed; files removed or
    added since the commit get one warning naming them."""
    report = check(path, share=share, check_file=check_file)
    if report.differences:
        logger.warning("asyncckpt: %s differs from what was committed (%s); resuming from it as it is, unverified "
                       "where it differs", path, ", ".join(report.differences))
    if report.status == "INCOMPLETE":
        commit.require_complete(path)  # raises, saying so
    if report.problems:
        raise damaged(path, report.problems)
    return report


def damaged(path: str, problems: list[str]) -> CorruptCheckpointError:
    """The error for a checkpoint found damaged: its path and the first few problems."""
    shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
    return CorruptCheckpointError(f"checkpoint {path} is damaged: {shown} (asyncckpt verify {path} lists every problem)",
                                  path=path)


def _check_file(path: str, name: str, expected: Optional[FileChecksum], report: Report, problem: Callable[[str], None],
                progress: Optional[Progress], check_file: FileCheck, committed_size: Optional[int] = None) -> None:
    if expected is None:  # no checksum: written natively, or before asyncckpt recorded them
        actual = os.path.getsize(path) if os.path.exists(path) else None
        if committed_size is not None and actual != committed_size:
            problem(f"{name}: {'missing' if actual is None else f'{actual} B on disk'}, the commit record says "
                    f"{committed_size} B")
        report.unverified.append(name)
        return
    found = check_file(path, expected, progress)
    report.checked_files += 1
    report.checked_bytes += expected.size
    if found:
        problem(f"{name}: {found}")


# ------------------------------------------------------------------------------------------ sharded
def sidecar_ranks(path: str) -> list[int]:
    """Ranks whose sidecar is present (found by name: an incomplete save may lack some)."""
    try:
        entries = os.listdir(path)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(names.SIDECAR_PATTERN.match, entries) if m)


def rank_of_file(relative_path: str) -> Optional[int]:
    """The writing rank encoded in a DCP data file name (``__{rank}_{n}.distcp``)."""
    match = names.DATA_FILE_PATTERN.match(relative_path)
    return int(match.group(1)) if match else None


def _well_formed(item: object) -> bool:
    """Sidecars are input like any other: check the fields we index with before trusting them."""
    return (
        isinstance(item, dict)
        and all(isinstance(item.get(key), str) for key in ("fqn", "file", "xxh3"))
        and all(isinstance(item.get(key), int) and item[key] >= 0 for key in ("start", "length", "data_start", "nbytes"))
    )


def load_sidecars(path: str, ranks: Sequence[int], problem: Callable[[str], None]) -> dict[int, dict]:
    """The readable, well-formed sidecars of ``ranks``; what is wrong with the others goes to ``problem``."""
    sidecars = {}
    for rank in ranks:
        try:
            sidecar = read_rank_sidecar(path, rank)
        except FileNotFoundError:
            problem(f"{names.sidecar_name(rank)}: missing: rank {rank}'s checksums are gone")
            continue
        except CheckpointError as e:
            problem(str(e))
            continue
        items = sidecar.get("items")
        if not isinstance(items, list) or not all(map(_well_formed, items)):
            problem(f"{names.sidecar_name(rank)}: malformed item list")
            continue
        sidecars[rank] = sidecar
    return sidecars


def _check_sharded(path: str, record: dict, report: Report, problem: Callable[[str], None], progress: Progress,
                   share: tuple[int, int]) -> None:
    world_size = record.get("world_size") or max(sidecar_ranks(path), default=-1) + 1
    sidecars = load_sidecars(path, range(world_size), problem)
    for rank, sidecar in sidecars.items():
        if record.get("save_id") and sidecar.get("save_id") != record["save_id"]:
            problem(f"{names.sidecar_name(rank)}: written by save {sidecar.get('save_id')}, but the commit record is "
                    f"for save {record['save_id']} (stale rank share)")
    per_file: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    for rank, sidecar in sidecars.items():
        for item in sidecar["items"]:
            per_file[item["file"]].append((rank, item))
    for name, size in sorted(record.get("files", {}).items()):
        if name in per_file:  # data files: a missing one is left to the data pass, which names its keys
            full = os.path.join(path, name)
            if os.path.exists(full) and os.path.getsize(full) != size:
                actual = os.path.getsize(full)
                problem(f"{name}: {'truncated' if actual < size else 'grown'}: {actual} B on disk, the commit record "
                        f"says {size} B")
            continue
        if name == names.DCP_METADATA_FILE or names.SIDECAR_PATTERN.match(name):
            continue  # parsed and cross-checked below: structure, not data to checksum
        expected = record.get("checksums", {}).get(name)
        _check_file(os.path.join(path, name), name, FileChecksum(expected["size"], expected["xxh3"]) if expected else None,
                    report, problem, progress, file_checksums.problem, size)
    _check_metadata(path, sidecars, problem)
    index, count = share
    for name, items in sorted(per_file.items()):
        if (rank_of_file(name) or 0) % count != index:
            continue
        _check_data_file(path, name, items, problem, progress)
        report.checked_files += 1
        report.checked_bytes += sum(item["nbytes"] for _rank, item in items)


def _check_metadata(path: str, sidecars: dict[int, dict], problem: Callable[[str], None]) -> None:
    """Every location ``.metadata`` sends a loader to must be one a sidecar checksums."""
    try:
        metadata = load_dcp_metadata(path)
    except FileNotFoundError:
        problem(f"{names.DCP_METADATA_FILE}: missing")
        return
    except CheckpointError as e:
        problem(str(e))
        return
    covered = {(item["file"], item["start"], item["length"]) for sc in sidecars.values() for item in sc["items"]}
    for index, info in metadata.storage_data.items():
        if (info.relative_path, info.offset, info.length) not in covered:
            problem(f"{names.DCP_METADATA_FILE}: key '{index.fqn}' points at {info.relative_path} "
                    f"[{info.offset}, {info.offset + info.length}), which no sidecar checksums")


def _check_data_file(path: str, name: str, items: list[tuple[int, dict]], problem: Callable[[str], None],
                     progress: Progress) -> None:
    """Checksum every item of one data file, mapped read-only (no copies, any file size)."""
    try:
        full = check_relative_path(path, name)  # sidecars are input too: never read outside PATH
        with open(full, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except FileNotFoundError:
        keys = ", ".join(sorted({item["fqn"] for _rank, item in items}))
        problem(f"{name}: missing data file (holds {len(items)} item(s): {keys})")
        progress(sum(item["nbytes"] for _rank, item in items))
        return
    except CheckpointError as e:
        problem(str(e))
        progress(sum(item["nbytes"] for _rank, item in items))
        return
    computed: dict[tuple[int, int], str] = {}  # tied tensors: several items, one byte range
    try:
        for rank, item in sorted(items, key=lambda ri: ri[1]["start"]):
            start, end = item["start"], item["start"] + item["length"]
            data_start, data_end = item["data_start"], item["data_start"] + item["nbytes"]
            label = f"{name}: key '{item['fqn']}' (rank {rank})"
            if end > size:
                problem(f"{label} bytes [{start}, {end}): beyond the end of the file ({size} B): truncated")
            else:
                if (data_start, data_end) not in computed:
                    computed[data_start, data_end] = checksum(memoryview(mapping)[data_start:data_end])
                actual = computed[data_start, data_end]
                if actual != item["xxh3"]:
                    problem(f"{label} bytes [{data_start}, {data_end}): checksum mismatch: "
                            f"expected xxh3 {item['xxh3']}, found {actual}")
                if item.get("kind") == "tensor" and (
                    mapping[start:start + 4] != _ZIP_LOCAL_HEADER or mapping[end - _ZIP_END_SIZE:end - _ZIP_END_SIZE + 4] != _ZIP_END
                ):
                    problem(f"{label} bytes [{start}, {end}): torch.save container framing is damaged "
                            "(data intact, but torch's own loader would fail)")
            progress(item["nbytes"])
    finally:
        if size:
            mapping.close()
