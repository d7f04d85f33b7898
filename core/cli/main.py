"""``asyncckpt``: look at and check checkpoints on disk without loading them.

    asyncckpt ls ROOT        every checkpoint under ROOT, of every kind (``checkpoint_kinds``), newest last
    asyncckpt inspect PATH   keys, shapes, dtypes (and for sharded ones chunks and writing ranks)
    asyncckpt verify PATH    recheck a checkpoint (or every one under a directory); exit 0 good,
                             1 damaged, 2 incomplete
    asyncckpt clean ROOT     remove what crashed saves left (``leftovers``)
    asyncckpt export CHECKPOINT OUT   its model as Hugging Face safetensors (``cli/export``)

The tool reads only what the formats promise (see docs/FORMAT.md): the commit record, the JSON
sidecars, ``.metadata`` through the restricted unpickler, safetensors headers, and torch.save
pickles only if they hold nothing but tensors and plain values (``weights_only``), with tensors
memory-mapped: pointing it at a checkpoint of unknown origin runs none of its code.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from typing import Optional, Sequence

from torch.distributed.checkpoint.metadata import MetadataIndex
from tqdm import tqdm

from asyncckpt.core.verify import checkpoint_kinds
from asyncckpt.core.storage import commit
from asyncckpt.core.verify import integrity
from asyncckpt.core.storage import leftovers, orphans
from asyncckpt.core.formats import names
from asyncckpt.core.cli import export as export_cli
from asyncckpt.core.cli import object_cli
from asyncckpt.core.errors import CheckpointError
from asyncckpt.core.storage.backend import backend_for
from asyncckpt.core.storage.object_store import ObjectStoreError
from asyncckpt.core.loading.metadata_io import load_dcp_metadata
from asyncckpt.core.formats.names import DCP_METADATA_FILE

EXIT_OK, EXIT_PROBLEM, EXIT_INCOMPLETE = 0, 1, 2


# ---------------------------------------------------------------------------------------- helpers
def _human(nbytes: int) -> str:
    """Sizes for people (binary units); ``inspect`` also prints exact byte counts."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _shape(size) -> str:
    return "[" + ", ".join(str(d) for d in size) + "]"


# --------------------------------------------------------------------------------------------- ls
def cmd_ls(root: str) -> int:
    """One line per checkpoint of any kind (``checkpoint_kinds``): name, step, size, status, kind.
    Sorted by (step, time), like ``latest_checkpoint`` ranks them, so the last COMPLETE line is
    what a resume picks."""
    backend = backend_for(root)
    if backend.remote:
        return object_cli.cmd_ls(root, _human)
    try:
        entries = checkpoint_kinds.checkpoints_under(root)
    except OSError as e:
        print(f"asyncckpt ls: {root}: {e.strerror}", file=sys.stderr)
        return EXIT_PROBLEM
    rows = []
    finishing = {what: token for token, names_finishing in orphans.at_work(root).items() for what in names_finishing}
    for entry in entries:
        name = os.path.basename(entry.path)
        hidden = names.parse_hidden(name)
        if hidden is not None and hidden.name in finishing:  # its training process died after the save returned
            entry.note = f"being finished by the writer {finishing[hidden.name]} of a training process that died"
        record = commit.read_commit_record(entry.path) if entry.kind != "file" else None
        when = (record or {}).get("committed_at_ns") or os.lstat(entry.path).st_mtime_ns
        size = backend.used_bytes(entry.path) if os.path.isdir(entry.path) else os.path.getsize(entry.path)
        note = ", ".join(part for part in (
            entry.kind if entry.kind != "hidden" else "", entry.note, f"epoch {entry.epoch}" if entry.epoch is not None else "",
            "no checksums" if entry.status in ("COMPLETE", "NATIVE") and not entry.checksums else "") if part)
        rows.append(((entry.step if entry.step is not None else -1, when, name), name, entry.step, size, entry.status, note))
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
    if backend_for(path).remote:
        return object_cli.cmd_inspect(path)
    entry = checkpoint_kinds.classify(path) if os.path.exists(path) else None
    if entry is None:
        if os.path.isdir(path) and checkpoint_kinds.checkpoints_under(path):
            print(f"{path} holds checkpoints, and is none itself:")
            return cmd_ls(path)
        print(f"asyncckpt inspect: {path}: not a checkpoint this tool knows (a DCP directory, a directory of "
              f"native files, or a {'/'.join(checkpoint_kinds.NATIVE_FILE_SUFFIXES)} file)", file=sys.stderr)
        return EXIT_PROBLEM
    if entry.kind == "file":
        return _inspect_files(path, [path])
    if entry.kind == "directory":
        print(f"{path}: {entry.status}, step {'-' if entry.step is None else entry.step}")
        return _inspect_files(path, [os.path.join(path, n) for n in sorted(os.listdir(path)) if not n.startswith(".")])
    record = commit.read_commit_record(path) or {}
    status = "COMPLETE" if commit.is_complete(path) else "INCOMPLETE"
    print(f"{path}: {status}, step {record.get('step', '-')}, world size {record.get('world_size', '?')}, "
          f"save {record.get('save_id', '?')}")
    problems: list[str] = []
    sidecars = integrity.load_sidecars(path, integrity.sidecar_ranks(path), problems.append)
    for message in problems:
        print(f"warning: {message}", file=sys.stderr)
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
        rank, item = by_location.get((info.relative_path, info.offset), (integrity.rank_of_file(info.relative_path), None))
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
                    if rank is not None and integrity.rank_of_file(n) == rank)
        print(f"  rank {'?' if rank is None else rank}: {t['chunks']} tensor chunk(s) {t['tensor_bytes']} B, "
              f"{t['objects']} object(s) {t['object_bytes']} B, data files {files} B ({_human(files)})")
    return EXIT_OK


def _inspect_files(root: str, paths: list[str]) -> int:
    """Keys, dtypes and shapes of native files (safetensors headers; weights-only torch.save pickles)."""
    for path in paths:
        name = os.path.relpath(path, os.path.dirname(root) if path == root else root)
        print(f"{name}  {os.path.getsize(path)} B")
        if not path.endswith(checkpoint_kinds.NATIVE_FILE_SUFFIXES):
            continue
        tensors, note = checkpoint_kinds.describe_file(path)
        for key, dtype, shape in tensors:
            print(f"  {key}  {dtype}  {_shape(shape)}")
        if note:
            print(f"  ({note})")
    return EXIT_OK


# ----------------------------------------------------------------------------------------- verify
def cmd_verify(path: str, progress: bool = True) -> int:
    """Re-check everything a load relies on (``integrity``); report every problem, not just the first.
    A local directory holding checkpoints has each of them verified. (A progress bar for local
    checkpoints: a remote one is fetched whole before it is checked.)"""
    backend = backend_for(path)
    remote = backend.remote
    path = path.rstrip("/") if remote else path
    entry = checkpoint_kinds.classify(path, read_step=False) if not remote and os.path.exists(path) else None
    if entry is None and not remote and os.path.isdir(path) and checkpoint_kinds.checkpoints_under(path, read_step=False):
        found = [e for e in checkpoint_kinds.checkpoints_under(path, read_step=False) if e.kind != "hidden"]
        return max((cmd_verify(e.path, progress) for e in sorted(found, key=lambda e: e.path)), default=EXIT_OK)
    try:
        if entry is None and not remote:
            raise FileNotFoundError(path)
        with tqdm(total=0 if remote else integrity.total_bytes(path), unit="B", unit_scale=True, unit_divisor=1024,
                  desc="verify", file=sys.stderr, disable=not progress or remote, dynamic_ncols=True) as bar:
            report = integrity.check(path, on_problem=lambda m: tqdm.write(m, file=sys.stdout), progress=bar.update)
    except FileNotFoundError:
        print(f"asyncckpt verify: {path}: not a checkpoint this tool knows", file=sys.stderr)
        return EXIT_PROBLEM
    if report.status == "INCOMPLETE":
        print(f"{path}: INCOMPLETE: no commit record ({names.COMMIT_RECORD}) under a final name: the save that "
              "wrote it did not finish (crash, failure, still running). Not verified.")
        return EXIT_INCOMPLETE
    if report.problems:
        print(f"{path}: FAILED: {len(report.problems)} problem(s)")
        return EXIT_PROBLEM
    unverified = f"; without checksums (written natively or by an older asyncckpt): {', '.join(report.unverified)}" \
        if report.unverified else ""
    unverified += f"; changed since the commit: {', '.join(report.differences)}" if report.differences else ""
    print(f"{path}: OK: {report.checked_files} file(s), {report.checked_bytes} B verified by checksum{unverified}")
    return EXIT_OK


# ------------------------------------------------------------------------------------------ clean
def cmd_clean(root: str, min_age_s: float, dry_run: bool) -> int:
    """Delete what crashed or killed saves left under ROOT (``Backend.find_leftovers``): at once what
    a process that is gone left on this host; what was made on another host (whose writer this
    host cannot see) only once untouched for ``min_age_s``. Never anything a live writer still uses."""
    backend = backend_for(root)
    root = backend.normalize(root)
    try:
        found = backend.find_leftovers(root)
    except (OSError, ObjectStoreError) as e:
        print(f"asyncckpt clean: {e}", file=sys.stderr)
        return EXIT_PROBLEM
    freed = count = 0
    for leftover in found:
        name = leftover.path[len(root) + 1:]
        if not leftovers.removable(leftover, min_age_s):
            why = ("in use by a live writer" if leftover.alive else
                   f"its writer cannot be checked from this host; removed once untouched for {min_age_s:.0f} s")
            print(f"kept     {name}  ({why})")
            continue
        size = leftover.size if leftover.size is not None else backend.used_bytes(leftover.path)
        if not dry_run:
            backend.delete_leftover(leftover)
        freed, count = freed + size, count + 1
        print(f"{'would remove' if dry_run else 'removed'}  {name}  {_human(size)}  ({leftover.kind} of {leftover.belongs_to})")
    print(f"{'would free' if dry_run else 'freed'} {_human(freed)} in {count} entr{'y' if count == 1 else 'ies'}")
    return EXIT_OK


# ------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncckpt", description="Inspect and verify asyncckpt checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ls = commands.add_parser("ls", help="list the checkpoints under ROOT (every kind, leftovers too), newest last")
    ls.add_argument("root", metavar="ROOT")
    inspect = commands.add_parser("inspect", help="keys, shapes, dtypes, chunks and writing ranks of a checkpoint")
    inspect.add_argument("path", metavar="PATH")
    verify = commands.add_parser("verify", help="recheck a checkpoint, or every one under a directory (exit 0 good, "
                                                "1 damaged, 2 incomplete)")
    verify.add_argument("path", metavar="PATH")
    verify.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    clean = commands.add_parser("clean", help="delete what crashed saves left under ROOT (never what a live save uses)")
    clean.add_argument("root", metavar="ROOT")
    clean.add_argument("--min-age", type=float, default=3600.0, metavar="SECONDS",
                       help="leftovers whose writer cannot be checked from this host (another host) only once "
                            "untouched for this long (default 3600); those of a process that is gone go at once")
    clean.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    export_cli.add_parser(commands)
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
        if args.command == "export":
            return export_cli.run(args)
        return cmd_verify(args.path, progress=not args.no_progress)
    except BrokenPipeError:  # `asyncckpt inspect ... | head`: stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PROBLEM


if __name__ == "__main__":
    sys.exit(main())
