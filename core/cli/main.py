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
from asyncckpt.core.verify import integrity
from asyncckpt.core.storage import leftovers, orphans
from asyncckpt.core.formats import names
from asyncckpt.core.cli import export as export_cli
from asyncckpt.core.errors import CheckpointError
from asyncckpt.core.storage.backend import Backend, backend_for, basename, normalize
from asyncckpt.core.storage.contents import local_copy, used_bytes
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


def _trimmed(path: str) -> str:
    """``ckpt/step_10/`` or ``s3://b/run/`` named as ``ckpt/step_10`` / ``s3://b/run``."""
    return path.rstrip("/") or path


def _shape(size) -> str:
    return "[" + ", ".join(str(d) for d in size) + "]"


# --------------------------------------------------------------------------------------------- ls
def cmd_ls(root: str) -> int:
    """One line per checkpoint of any kind, and per leftover (``checkpoint_kinds``): name, step,
    size, status, kind. Sorted by (step, time), like ``latest_checkpoint`` ranks them, so the last
    COMPLETE line is what a resume picks. The same for a directory and an object-store prefix."""
    try:
        entries = checkpoint_kinds.checkpoints_under(root)
    except (OSError, ObjectStoreError) as e:
        print(f"asyncckpt ls: {root}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return EXIT_PROBLEM
    rows = []
    finishing = {what: token for token, names_finishing in orphans.at_work(root).items() for what in names_finishing}
    for entry in entries:
        name = basename(entry.path)
        hidden = names.parse_hidden(name)
        if hidden is not None and hidden.name in finishing:  # its training process died after the save returned
            entry.note = f"being finished by the writer {finishing[hidden.name]} of a training process that died"
        size = entry.size if entry.size is not None else used_bytes(entry.path)
        note = ", ".join(part for part in (
            entry.kind if entry.kind != "hidden" else "", entry.note, f"epoch {entry.epoch}" if entry.epoch is not None else "",
            "no checksums" if entry.status in ("COMPLETE", "NATIVE") and not entry.checksums else "") if part)
        rows.append(((entry.step if entry.step is not None else -1, entry.modified, name), name, entry.step, size,
                     entry.status, note))
    rows.sort(key=lambda row: row[0])
    width = max((len(row[1]) for row in rows), default=0)
    for _key, name, step, size, status, note in rows:
        line = f"{name:<{width}}  {'-' if step is None else step:>8}  {_human(size):>10}  {status}"
        print(f"{line}  ({note})" if note else line)
    return EXIT_OK


# ---------------------------------------------------------------------------------------- inspect
def cmd_inspect(path: str) -> int:
    """Describe a checkpoint from ``.metadata`` (what a loader will read) plus the sidecars (who
    wrote what, exact data offsets); plain DCP checkpoints too (no sidecars). Reads only those
    small files and the listing, never the data: in an object store, a local copy of them."""
    backend = backend_for(path)
    entry = checkpoint_kinds.classify(path)
    if entry is None:
        try:
            holds_checkpoints = bool(checkpoint_kinds.checkpoints_under(path))
        except (OSError, ObjectStoreError):
            holds_checkpoints = False
        if holds_checkpoints:
            print(f"{path} holds checkpoints, and is none itself:")
            return cmd_ls(path)
        print(f"asyncckpt inspect: {path}: not a checkpoint this tool knows (a DCP directory, a directory of "
              f"native files, or a {'/'.join(checkpoint_kinds.NATIVE_FILE_SUFFIXES)} file)", file=sys.stderr)
        return EXIT_PROBLEM
    if entry.kind == "hidden":
        print(f"{path}: INCOMPLETE ({entry.note}): the save that wrote it did not finish, or is still running",
              file=sys.stderr)
        return EXIT_INCOMPLETE
    if entry.kind == "file":
        print(f"{path}: single file, {entry.size} B, {'checksum attached' if entry.checksums else 'no checksum'}")
        return _inspect_files(backend, [(basename(path), path, entry.size or 0)])
    listed = sorted(backend.listing(path), key=lambda item: item.name)
    if entry.kind == "directory":
        print(f"{path}: {entry.status}, step {'-' if entry.step is None else entry.step}")
        return _inspect_files(backend, [(item.name, item.path, item.size) for item in listed
                                              if not item.name.startswith(".") and not item.is_dir])
    record = entry.record or {}
    print(f"{path}: {entry.status}, step {record.get('step', entry.step if entry.step is not None else '-')}, "
          f"world size {record.get('world_size', '?')}, save {record.get('save_id', '?')}")
    described = [item.name for item in listed
                 if item.name in (names.DCP_METADATA_FILE, names.COMMIT_RECORD) or names.SIDECAR_PATTERN.match(item.name)]
    with local_copy(path, described) as local:
        shown = _inspect_sharded(path, local, {item.name: item.size for item in listed})
    return EXIT_INCOMPLETE if shown == EXIT_OK and entry.status == "INCOMPLETE" else shown


def _inspect_sharded(path: str, local: str, sizes: dict[str, int]) -> int:
    """The keys of a sharded checkpoint at ``path``, from its ``.metadata`` and sidecars at ``local``
    (the same directory, or a copy of those files); ``sizes``: every file's size."""
    problems: list[str] = []
    sidecars = integrity.load_sidecars(local, integrity.sidecar_ranks(local), problems.append)
    for message in problems:
        print(f"warning: {message}", file=sys.stderr)
    try:
        metadata = load_dcp_metadata(local)
    except FileNotFoundError:
        print(f"{path}: no {DCP_METADATA_FILE}: the save never reached its commit; nothing a loader could read",
              file=sys.stderr)
        return EXIT_INCOMPLETE
    except CheckpointError as e:
        print(f"asyncckpt inspect: {names.unhide(str(e)).replace(local, path)}", file=sys.stderr)
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
        files = sum(size for name, size in sizes.items() if rank is not None and integrity.rank_of_file(name) == rank)
        print(f"  rank {'?' if rank is None else rank}: {t['chunks']} tensor chunk(s) {t['tensor_bytes']} B, "
              f"{t['objects']} object(s) {t['object_bytes']} B, data files {files} B ({_human(files)})")
    return EXIT_OK


def _inspect_files(backend: Backend, files: list[tuple[str, str, int]]) -> int:
    """Keys, dtypes and shapes of native files ``(name, path, size)``: safetensors headers,
    weights-only torch.save pickles, memory-mapped. A remote file's tensors are not listed: that
    would download it."""
    for name, path, size in files:
        print(f"{name}  {size} B")
        if not path.endswith(checkpoint_kinds.NATIVE_FILE_SUFFIXES):
            continue
        if backend.remote:
            print("  (tensors not listed for a file in an object store: inspect a local copy)")
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
    A directory (or prefix) holding checkpoints has each of them verified. (A progress bar for local
    checkpoints: a remote one is fetched whole before it is checked.)"""
    backend = backend_for(path)
    entry = checkpoint_kinds.classify(path, read_step=False)
    if entry is None:
        try:
            found = [e for e in checkpoint_kinds.checkpoints_under(path, read_step=False) if e.kind != "hidden"]
        except (OSError, ObjectStoreError):
            found = []
        if found:
            return max((cmd_verify(e.path, progress) for e in sorted(found, key=lambda e: e.path)), default=EXIT_OK)
        print(f"asyncckpt verify: {path}: not a checkpoint this tool knows", file=sys.stderr)
        return EXIT_PROBLEM
    try:
        with tqdm(total=0 if backend.remote else integrity.total_bytes(path), unit="B", unit_scale=True,
                  unit_divisor=1024, desc="verify", file=sys.stderr, disable=not progress or backend.remote,
                  dynamic_ncols=True) as bar:
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
    """Delete what crashed or killed saves left under ROOT (``leftovers.find``): at once what
    a process that is gone left on this host; what was made on another host (whose writer this
    host cannot see) only once untouched for ``min_age_s``. Never anything a live writer still uses."""
    root = normalize(root)
    try:
        found = leftovers.find(root)
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
        size = leftover.size if leftover.size is not None else used_bytes(leftover.path)
        if not dry_run:
            leftovers.delete(leftover)
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
            return cmd_ls(_trimmed(args.root))
        if args.command == "inspect":
            return cmd_inspect(_trimmed(args.path))
        if args.command == "clean":
            return cmd_clean(args.root, args.min_age, args.dry_run)
        if args.command == "export":
            return export_cli.run(args)
        return cmd_verify(_trimmed(args.path), progress=not args.no_progress)
    except BrokenPipeError:  # `asyncckpt inspect ... | head`: stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PROBLEM


if __name__ == "__main__":
    sys.exit(main())
