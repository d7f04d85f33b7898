"""``asyncckpt``: look at and check checkpoints on disk without loading them.

    asyncckpt ls ROOT        every checkpoint directory under ROOT (staging ones too), newest last
    asyncckpt inspect PATH   keys, shapes, dtypes, chunks and which rank wrote them
    asyncckpt verify PATH    recompute every checksum; exit 0 good, 1 damaged, 2 incomplete

The tool reads only what the format promises (see docs/FORMAT.md): the commit record, the JSON
sidecars, and ``.metadata`` through the restricted unpickler, so pointing it at a checkpoint of
unknown origin is as safe as loading one with asyncckpt. Tensor data is never deserialized.
"""
from __future__ import annotations

import argparse
import mmap
import os
import re
import sys
from collections import defaultdict
from typing import Optional, Sequence

from torch.distributed.checkpoint.metadata import MetadataIndex
from tqdm import tqdm

from . import commit, leftovers, names
from .checksum import checksum
from .errors import CheckpointError
from .metadata_io import check_relative_path, load_dcp_metadata
from .names import DCP_METADATA_FILE
from .sidecar import read_rank_sidecar

EXIT_OK, EXIT_PROBLEM, EXIT_INCOMPLETE = 0, 1, 2
_TRAILING_NUMBER_RE = re.compile(r"(\d+)$")
# torch.save containers are zip files: a local file header first, the end-of-central-directory
# record (22 bytes, no comment) last. Stock DCP loading needs both intact; our checksums cover
# only the tensor bytes between them, so verify checks these signatures separately.
_ZIP_LOCAL_HEADER, _ZIP_END, _ZIP_END_SIZE = b"PK\x03\x04", b"PK\x05\x06", 22


# ---------------------------------------------------------------------------------------- helpers
def _human(nbytes: int) -> str:
    """Sizes for people (binary units); ``inspect`` also prints exact byte counts."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _tree_size(path: str) -> int:
    """Bytes of every file under ``path`` (symlinks not followed: we report what this dir holds)."""
    total = 0
    for parent, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except FileNotFoundError:  # a save or a cleanup running concurrently
                pass
    return total


def _sidecar_ranks(path: str) -> list[int]:
    """Ranks whose sidecar is present (found by name: an incomplete save may lack some)."""
    try:
        entries = os.listdir(path)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(names.SIDECAR_PATTERN.match, entries) if m)


def _well_formed(item: object) -> bool:
    """Sidecars are input like any other: check the fields we index with before trusting them."""
    return (
        isinstance(item, dict)
        and all(isinstance(item.get(key), str) for key in ("fqn", "file", "xxh3"))
        and all(isinstance(item.get(key), int) and item[key] >= 0 for key in ("start", "length", "data_start", "nbytes"))
    )


def _load_sidecars(path: str, ranks: Sequence[int], problems: list[str]) -> dict[int, dict]:
    """The readable, well-formed sidecars of ``ranks``; what is wrong with the others goes to ``problems``."""
    sidecars = {}
    for rank in ranks:
        try:
            sidecar = read_rank_sidecar(path, rank)
        except FileNotFoundError:
            problems.append(f"__{rank}.asyncckpt.json: missing: rank {rank}'s checksums are gone")
            continue
        except CheckpointError as e:
            problems.append(str(e))
            continue
        items = sidecar.get("items")
        if not isinstance(items, list) or not all(map(_well_formed, items)):
            problems.append(f"__{rank}.asyncckpt.json: malformed item list")
            continue
        sidecars[rank] = sidecar
    return sidecars


def _rank_of_file(relative_path: str) -> Optional[int]:
    """The writing rank encoded in a DCP data file name (``__{rank}_{n}.distcp``)."""
    match = names.DATA_FILE_PATTERN.match(relative_path)
    return int(match.group(1)) if match else None


def _is_native_dir(path: str, record: dict) -> bool:
    """A committed directory of a framework's own files (``DirectoryTransaction``): a commit
    record but no DCP metadata and no sidecars, so there is nothing to checksum per item."""
    return (DCP_METADATA_FILE not in record.get("files", {DCP_METADATA_FILE: 0})
            and not os.path.exists(os.path.join(path, DCP_METADATA_FILE)) and not _sidecar_ranks(path))


def _shape(size) -> str:
    return "[" + ", ".join(str(d) for d in size) + "]"


# --------------------------------------------------------------------------------------------- ls
def _is_checkpoint_dir(path: str, name: str) -> bool:
    """Staging dirs always count (that is what ``ls`` is for); others need checkpoint files."""
    if names.parse_hidden(name):
        return True
    if name.startswith(".") or not os.path.isdir(path):
        return False
    try:
        entries = set(os.listdir(path))
    except OSError:
        return False
    return bool(entries & {names.COMMIT_RECORD, names.DCP_METADATA_FILE}) or any(map(names.SIDECAR_PATTERN.match, entries))


def _step_from_name(name: str) -> Optional[int]:
    """step_000120 -> 120, checkpoint-12 -> 12; staging names are unwrapped first."""
    hidden = names.parse_hidden(name)
    match = _TRAILING_NUMBER_RE.search(hidden.name if hidden else name)
    return int(match.group(1)) if match else None


def cmd_ls(root: str) -> int:
    """One line per checkpoint: name, step, size, status. Sorted by (step, time), like
    ``latest_checkpoint`` ranks them, so the last COMPLETE line is what a resume would pick."""
    try:
        entries = os.listdir(root)
    except OSError as e:
        print(f"asyncckpt ls: {root}: {e.strerror}", file=sys.stderr)
        return EXIT_PROBLEM
    rows = []
    for name in entries:
        path = os.path.join(root, name)
        if not os.path.isdir(path) or not _is_checkpoint_dir(path, name):
            continue
        record = commit.read_commit_record(path)
        step = record.get("step") if record else None
        if not isinstance(step, int):
            step = _step_from_name(name)
        when = (record or {}).get("committed_at_ns") or os.stat(path).st_mtime_ns
        status = "COMPLETE" if commit.is_complete(path) else "INCOMPLETE"
        note = ""
        hidden = names.parse_hidden(name)
        if hidden:
            note = "aborted" if os.path.exists(os.path.join(path, names.ABORT_MARKER)) else hidden.kind
        rows.append(((step if step is not None else -1, when, name), name, step, _tree_size(path), status, note))
    rows.sort(key=lambda row: row[0])
    width = max((len(row[1]) for row in rows), default=0)
    for _key, name, step, size, status, note in rows:
        line = f"{name:<{width}}  {'-' if step is None else step:>8}  {_human(size):>10}  {status}"
        print(f"{line}  ({note})" if note else line)
    return EXIT_OK


# ---------------------------------------------------------------------------------------- inspect
def cmd_inspect(path: str) -> int:
    """Describe a checkpoint from ``.metadata`` (what a loader will read) plus the sidecars
    (who wrote what, exact data offsets). Works for plain DCP checkpoints too (no sidecars)."""
    if not os.path.isdir(path):
        print(f"asyncckpt inspect: {path}: not a directory", file=sys.stderr)
        return EXIT_PROBLEM
    record = commit.read_commit_record(path) or {}
    status = "COMPLETE" if commit.is_complete(path) else "INCOMPLETE"
    print(f"{path}: {status}, step {record.get('step', '-')}, world size {record.get('world_size', '?')}, "
          f"save {record.get('save_id', '?')}")
    problems: list[str] = []
    sidecars = _load_sidecars(path, _sidecar_ranks(path), problems)
    for message in problems:
        print(f"warning: {message}", file=sys.stderr)
    if record and _is_native_dir(path, record):
        print("native files (no DCP metadata):")
        for name, size in sorted(record.get("files", {}).items()):
            print(f"  {name}  {size} B")
        return EXIT_OK
    try:
        metadata = load_dcp_metadata(path)
    except FileNotFoundError:
        print(f"{path}: no {DCP_METADATA_FILE}: the save never reached its commit; nothing a loader could read",
              file=sys.stderr)
        return EXIT_INCOMPLETE
    except CheckpointError as e:
        print(f"asyncckpt inspect: {e}", file=sys.stderr)
        return EXIT_PROBLEM

    by_location = {(item["file"], item["start"]): (rank, item) for rank, sc in sidecars.items() for item in sc["items"]}
    totals: dict = defaultdict(lambda: {"chunks": 0, "tensor_bytes": 0, "objects": 0, "object_bytes": 0})

    def where(info) -> tuple[Optional[int], Optional[dict], str]:
        rank, item = by_location.get((info.relative_path, info.offset), (_rank_of_file(info.relative_path), None))
        return rank, item, f"rank {'?' if rank is None else rank}"

    for fqn, entry in metadata.state_dict_metadata.items():
        if hasattr(entry, "chunks"):  # TensorStorageMetadata
            dtype = entry.properties.dtype
            total = 0
            lines = []
            for chunk in entry.chunks:
                info = metadata.storage_data.get(MetadataIndex(fqn, chunk.offsets))
                numel = 1
                for d in chunk.sizes:
                    numel *= d
                nbytes = numel * dtype.itemsize
                total += nbytes
                if info is None:
                    lines.append(f"    chunk at {_shape(chunk.offsets)} size {_shape(chunk.sizes)}: NOT IN STORAGE DATA")
                    continue
                rank, item, who = where(info)
                totals[rank]["chunks"] += 1
                totals[rank]["tensor_bytes"] += nbytes
                if item is not None:  # the sidecar knows where the raw bytes start
                    place = f"[{item['data_start']}, {item['data_start'] + nbytes}), container {info.length} B"
                else:  # plain DCP: only the container's extent is known
                    place = f"container [{info.offset}, {info.offset + info.length})"
                lines.append(f"    chunk at {_shape(chunk.offsets)} size {_shape(chunk.sizes)}: {who}, {nbytes} B data "
                             f"in {info.relative_path} {place}")
            print(f"{fqn}  tensor  {str(dtype).removeprefix('torch.')}  {_shape(entry.size)}  {total} B  "
                  f"{len(entry.chunks)} chunk(s)")
            print("\n".join(lines))
        else:  # BytesStorageMetadata
            info = metadata.storage_data.get(MetadataIndex(fqn))
            if info is None:
                print(f"{fqn}  object  NOT IN STORAGE DATA")
                continue
            rank, _item, who = where(info)
            totals[rank]["objects"] += 1
            totals[rank]["object_bytes"] += info.length
            print(f"{fqn}  object  {info.length} B  {who}, {info.relative_path} [{info.offset}, {info.offset + info.length})")

    print("per rank:")
    for rank in sorted(totals, key=lambda r: -1 if r is None else r):
        t = totals[rank]
        files = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)
                    if rank is not None and _rank_of_file(n) == rank)
        print(f"  rank {'?' if rank is None else rank}: {t['chunks']} tensor chunk(s) {t['tensor_bytes']} B, "
              f"{t['objects']} object(s) {t['object_bytes']} B, data files {files} B ({_human(files)})")
    return EXIT_OK


# ----------------------------------------------------------------------------------------- verify
def _report(problems: list[str], message: str) -> None:
    problems.append(message)
    tqdm.write(message, file=sys.stdout)  # keeps the progress bar on stderr intact


def _check_commit_files(path: str, record: dict, data_files: set[str], problems: list[str]) -> None:
    """Compare the commit record's file list with the disk. Missing data files are left to the
    data pass, which can name the keys they held."""
    for name, size in sorted(record.get("files", {}).items()):
        full = os.path.join(path, name)
        if not os.path.exists(full):
            if name not in data_files:
                _report(problems, f"{name}: missing (the commit record lists it with {size} B)")
        elif os.path.getsize(full) != size:
            actual = os.path.getsize(full)
            what = "truncated" if actual < size else "grown"
            _report(problems, f"{name}: {what}: {actual} B on disk, the commit record says {size} B")


def _check_metadata(path: str, sidecars: dict[int, dict], problems: list[str]) -> None:
    """Every location ``.metadata`` sends a loader to must be one a sidecar checksums."""
    try:
        metadata = load_dcp_metadata(path)
    except FileNotFoundError:
        _report(problems, f"{DCP_METADATA_FILE}: missing")
        return
    except CheckpointError as e:
        _report(problems, str(e))
        return
    covered = {(item["file"], item["start"], item["length"]) for sc in sidecars.values() for item in sc["items"]}
    for index, info in metadata.storage_data.items():
        if (info.relative_path, info.offset, info.length) not in covered:
            _report(problems, f"{DCP_METADATA_FILE}: key '{index.fqn}' points at {info.relative_path} "
                              f"[{info.offset}, {info.offset + info.length}), which no sidecar checksums")


def _verify_file(path: str, name: str, items: list[tuple[int, dict]], bar: tqdm, problems: list[str]) -> None:
    """Checksum every item of one data file, mapped read-only (no copies, any file size)."""
    try:
        full = check_relative_path(path, name)  # sidecars are input too: never read outside PATH
        with open(full, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except FileNotFoundError:
        keys = ", ".join(sorted({item["fqn"] for _rank, item in items}))
        _report(problems, f"{name}: missing data file (holds {len(items)} item(s): {keys})")
        bar.update(sum(item["nbytes"] for _rank, item in items))
        return
    except CheckpointError as e:
        _report(problems, str(e))
        bar.update(sum(item["nbytes"] for _rank, item in items))
        return
    computed: dict[tuple[int, int], str] = {}  # tied tensors: several items, one byte range
    try:
        for rank, item in sorted(items, key=lambda ri: ri[1]["start"]):
            start, end = item["start"], item["start"] + item["length"]
            data_start, data_end = item["data_start"], item["data_start"] + item["nbytes"]
            label = f"{name}: key '{item['fqn']}' (rank {rank})"
            if end > size:
                _report(problems, f"{label} bytes [{start}, {end}): beyond the end of the file ({size} B): truncated")
            else:
                if (data_start, data_end) not in computed:
                    computed[data_start, data_end] = checksum(memoryview(mapping)[data_start:data_end])
                actual = computed[data_start, data_end]
                if actual != item["xxh3"]:
                    _report(problems, f"{label} bytes [{data_start}, {data_end}): checksum mismatch: "
                                      f"expected xxh3 {item['xxh3']}, found {actual}")
                if item.get("kind") == "tensor" and (
                    mapping[start:start + 4] != _ZIP_LOCAL_HEADER or mapping[end - _ZIP_END_SIZE:end - _ZIP_END_SIZE + 4] != _ZIP_END
                ):
                    _report(problems, f"{label} bytes [{start}, {end}): torch.save container framing is damaged "
                                      "(data intact, but torch's own loader would fail)")
            bar.update(item["nbytes"])
    finally:
        if size:
            mapping.close()


def cmd_verify(path: str, progress: bool = True) -> int:
    """Re-check everything a load relies on; report every problem, not just the first."""
    if not os.path.isdir(path):
        print(f"asyncckpt verify: {path}: not a directory", file=sys.stderr)
        return EXIT_PROBLEM
    if not commit.is_complete(path):
        print(f"{path}: INCOMPLETE: no commit record ({names.COMMIT_RECORD}) under a final name: the save that "
              "wrote it did not finish (crash, failure, still running) or was not asyncckpt's. Not verified.")
        return EXIT_INCOMPLETE
    record = commit.read_commit_record(path)
    problems: list[str] = []
    if _is_native_dir(path, record):
        _check_commit_files(path, record, set(), problems)
        if problems:
            print(f"{path}: FAILED: {len(problems)} problem(s)")
            return EXIT_PROBLEM
        print(f"{path}: OK: {len(record.get('files', {}))} native file(s) present with their committed sizes "
              "(no per-item checksums in this kind of checkpoint)")
        return EXIT_OK
    world_size = record.get("world_size") or max(_sidecar_ranks(path), default=-1) + 1
    sidecar_problems: list[str] = []
    sidecars = _load_sidecars(path, range(world_size), sidecar_problems)
    for message in sidecar_problems:
        _report(problems, message)
    for rank, sidecar in sidecars.items():
        if record.get("save_id") and sidecar.get("save_id") != record["save_id"]:
            _report(problems, f"__{rank}.asyncckpt.json: written by save {sidecar.get('save_id')}, "
                              f"but the commit record is for save {record['save_id']} (stale rank share)")
    per_file: dict[str, list[tuple[int, dict]]] = defaultdict(list)
    for rank, sidecar in sidecars.items():
        for item in sidecar["items"]:
            per_file[item["file"]].append((rank, item))
    _check_commit_files(path, record, set(per_file), problems)
    _check_metadata(path, sidecars, problems)
    total = sum(item["nbytes"] for items in per_file.values() for _rank, item in items)
    count = sum(len(items) for items in per_file.values())
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="verify", file=sys.stderr,
              disable=not progress, dynamic_ncols=True) as bar:
        for name, items in sorted(per_file.items()):
            _verify_file(path, name, items, bar, problems)
    if problems:
        print(f"{path}: FAILED: {len(problems)} problem(s)")
        return EXIT_PROBLEM
    print(f"{path}: OK: {count} item(s), {total} B of data verified across {len(sidecars)} rank(s)")
    return EXIT_OK


# ------------------------------------------------------------------------------------------ clean
def cmd_clean(root: str, min_age_s: float, dry_run: bool) -> int:
    """Delete what crashed or killed saves left under ROOT (``leftovers``): at once what a process
    that is gone left on this host; what was made on another host (whose writer this host cannot
    see) only once untouched for ``min_age_s``. Never anything a live writer still uses."""
    if not os.path.isdir(root):
        print(f"asyncckpt clean: {root}: not a directory", file=sys.stderr)
        return EXIT_PROBLEM
    freed = count = 0
    for leftover in leftovers.find(root):
        name = os.path.basename(leftover.path)
        if not leftovers.removable(leftover, min_age_s):
            why = ("in use by a live writer" if leftover.alive else
                   f"its writer cannot be checked from this host; removed once untouched for {min_age_s:.0f} s")
            print(f"kept     {name}  ({why})")
            continue
        size = _tree_size(leftover.path) if os.path.isdir(leftover.path) else os.lstat(leftover.path).st_size
        if not dry_run:
            leftovers.delete(leftover.path)
        freed, count = freed + size, count + 1
        print(f"{'would remove' if dry_run else 'removed'}  {name}  {_human(size)}  ({leftover.kind} of {leftover.belongs_to})")
    print(f"{'would free' if dry_run else 'freed'} {_human(freed)} in {count} entr{'y' if count == 1 else 'ies'}")
    return EXIT_OK


# ------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncckpt", description="Inspect and verify asyncckpt checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ls = commands.add_parser("ls", help="list checkpoint directories under ROOT (staging ones too), newest last")
    ls.add_argument("root", metavar="ROOT")
    inspect = commands.add_parser("inspect", help="keys, shapes, dtypes, chunks and writing ranks of a checkpoint")
    inspect.add_argument("path", metavar="PATH")
    verify = commands.add_parser("verify", help="recompute every checksum (exit 0 good, 1 damaged, 2 incomplete)")
    verify.add_argument("path", metavar="PATH")
    verify.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    clean = commands.add_parser("clean", help="delete what crashed saves left under ROOT (never what a live save uses)")
    clean.add_argument("root", metavar="ROOT")
    clean.add_argument("--min-age", type=float, default=3600.0, metavar="SECONDS",
                       help="leftovers whose writer cannot be checked from this host (another host) only once "
                            "untouched for this long (default 3600); those of a process that is gone go at once")
    clean.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "ls":
            return cmd_ls(args.root)
        if args.command == "inspect":
            return cmd_inspect(args.path)
        if args.command == "clean":
            return cmd_clean(args.root, args.min_age, args.dry_run)
        return cmd_verify(args.path, progress=not args.no_progress)
    except BrokenPipeError:  # `asyncckpt inspect ... | head`: stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PROBLEM


if __name__ == "__main__":
    sys.exit(main())
