"""``asyncckpt``: look at and check checkpoints on disk without loading them.

More: docs/MODULES.md, core/cli/main.py.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from collections import defaultdict
from typing import Optional, Sequence

from torch.distributed.checkpoint.metadata import MetadataIndex
from tqdm import tqdm

from asyncckpt.core.verify import checkpoint_kinds
from asyncckpt.core.verify import integrity
from asyncckpt.core.storage import leftovers, orphans, sharing, spares
from asyncckpt.core import tier
from asyncckpt.core.formats import names
from asyncckpt.core.cli import export as export_cli
from asyncckpt.core.errors import CheckpointError
from asyncckpt.core.storage.backend import Backend, backend_for, basename, normalize
from asyncckpt.core.storage.contents import human_bytes, local_copy, used_bytes
from asyncckpt.core.storage.object_store import ObjectStoreError
from asyncckpt.core.loading.metadata_io import load_dcp_metadata
from asyncckpt.core.formats.names import DCP_METADATA_FILE

EXIT_OK, EXIT_PROBLEM, EXIT_INCOMPLETE = 0, 1, 2


# ---------------------------------------------------------------------------------------- helpers
def _trimmed(path: str) -> str:
    """``ckpt/step_10/`` or ``s3://b/run/`` named as ``ckpt/step_10`` / ``s3://b/run``."""
    return path.rstrip("/") or path


def _shape(size) -> str:
    return "[" + ", ".join(str(d) for d in size) + "]"


# --------------------------------------------------------------------------------------------- ls
def cmd_ls(root: str, memory_root: Optional[str] = None) -> int:
    """One line per checkpoint of any kind, and per leftover (``checkpoint_kinds``): name, step,
    size, status, kind. Then, beside them, the memory checkpoints of ROOT's run directory under this
    node's ``memory_root`` (default: ``tier.memory_root()``), marked ``memory``: the bytes this node holds, COMPLETE if every file is
    here, else PARTIAL and which are missing (on which nodes they are), and whether ROOT holds a
    durable copy. Sorted by (step, time), like ``latest_checkpoint`` ranks them, so the last
    COMPLETE line is what a resume picks. The same for a directory and an object-store prefix."""
    run = os.path.join(memory_root or tier.memory_root(), tier.run_name(root))
    memory_rows = _memory_rows(run)
    try:
        entries = checkpoint_kinds.checkpoints_under(root)
    except (OSError, ObjectStoreError) as e:
        print(f"asyncckpt ls: {root}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        if not memory_rows:
            return EXIT_PROBLEM
        entries = []  # nothing durable yet: the memory tier is all there is
    rows = []
    finishing = {what: token for token, names_finishing in orphans.at_work(root).items() for what in names_finishing}
    for entry in entries:
        name = basename(entry.path)
        hidden = names.parse_hidden(name)
        if hidden is not None and hidden.name in finishing:  # its training process died after the save returned
            entry.note = f"being finished by the writer {finishing[hidden.name]} of a training process that died"
        size = entry.size if entry.size is not None else used_bytes(entry.path)
        shared = sharing.shared_bytes(entry.path) if entry.status == "COMPLETE" and os.path.isdir(entry.path) else 0
        note = ", ".join(part for part in (
            entry.kind if entry.kind != "hidden" else "", entry.note, f"epoch {entry.epoch}" if entry.epoch is not None else "",
            f"shares {human_bytes(shared)} with other checkpoints" if shared else "",
            "no checksums" if entry.status in ("COMPLETE", "NATIVE") and not entry.checksums else "") if part)
        rows.append(((entry.step if entry.step is not None else -1, entry.modified, name), name, entry.step, size,
                     entry.status, note))
    durable = {basename(entry.path) for entry in entries if entry.status in ("COMPLETE", "NATIVE")}
    for key, name, step, size, status, note in memory_rows:
        if status != "INCOMPLETE":  # a committed memory checkpoint: is it also durable?
            copy = "memory, durable copy too" if name in durable else "memory only"
            note = f"{copy}, {note}" if note else copy
        rows.append((key, name, step, size, status, note))
    rows.sort(key=lambda row: row[0])
    width = max((len(row[1]) for row in rows), default=0)
    for _key, name, step, size, status, note in rows:
        line = f"{name:<{width}}  {'-' if step is None else step:>8}  {human_bytes(size):>10}  {status}"
        print(f"{line}  ({note})" if note else line)
    return EXIT_OK


def _memory_rows(run: str) -> list[tuple]:
    """The rows of ``cmd_ls`` for the run directory ``run``: its memory checkpoints, and the saves
    being staged there (or left by a crash)."""
    rows = []
    for checkpoint in tier.memory_checkpoints(run):
        status = "COMPLETE" if checkpoint.complete else "PARTIAL"
        note = "" if checkpoint.complete else _missing(checkpoint)
        rows.append(((-1 if checkpoint.step is None else checkpoint.step, checkpoint.committed_at, checkpoint.name),
                     checkpoint.name, checkpoint.step, checkpoint.bytes_here, status, note))
    for leftover in leftovers.find(run):
        name = basename(leftover.path)
        step = names.step_from_name(leftover.belongs_to)
        size = leftover.size if leftover.size is not None else used_bytes(leftover.path)
        rows.append(((-1 if step is None else step, leftover.modified, name), name, step, size, "INCOMPLETE",
                     f"memory, {leftover.kind}"))
    return rows


def _missing(checkpoint: tier.MemoryCheckpoint, shown: int = 3) -> str:
    """Which files of a memory checkpoint this node lacks, and the nodes its commit record says hold
    them (``"tier": {"holders": {file: [node, ...]}}``)."""
    section = (checkpoint.record or {}).get("tier")
    holders = section.get("holders") if isinstance(section, dict) else None
    holders = holders if isinstance(holders, dict) else {}
    named = [f"{file} (on {', '.join(map(str, holders[file]))})" if holders.get(file) else file
             for file in checkpoint.missing[:shown]]
    more = f" and {len(checkpoint.missing) - shown} more" if len(checkpoint.missing) > shown else ""
    return f"missing here: {', '.join(named)}{more}"


def cmd_ls_memory(memory_root: str) -> int:
    """Every run directory under this node's ``memory_root``: the durable root it is the memory
    tier of, whether a live process owns it (else how long it has been unchanged, and whether
    ``clean --memory`` removes it now), its checkpoints and bytes (its spares among them); then each
    of its checkpoints."""
    runs = tier.runs(memory_root)
    if not runs:
        print(f"no memory tier under {memory_root}")
        return EXIT_OK
    for run in runs:
        checkpoints = tier.memory_checkpoints(run.path)
        owner = "in use" if run.alive else (
            f"no live owner, unchanged for {_duration(run.idle_s)}"
            f"{'; orphaned' if run.orphaned() else f'; orphaned after {_duration(tier.ORPHAN_AFTER_S)}'}")
        spare = used_bytes(os.path.join(run.path, spares.SPARES_DIR))
        print(f"{basename(run.path)}  {run.durable_root}  ({owner})  {len(checkpoints)} checkpoint(s)  "
              f"{human_bytes(tier.stored_bytes(run.path))}"
              + (f" (of which {human_bytes(spare)} spare files, for the next save to write over)" if spare else ""))
        for checkpoint in checkpoints:
            state = "COMPLETE" if checkpoint.complete else f"PARTIAL ({_missing(checkpoint)})"
            print(f"  {checkpoint.name}  {'-' if checkpoint.step is None else checkpoint.step}  "
                  f"{human_bytes(checkpoint.bytes_here)}  {state}")
    return EXIT_OK


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


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
              f"{t['objects']} object(s) {t['object_bytes']} B, data files {files} B ({human_bytes(files)})")
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
def cmd_clean(root: Optional[str], min_age_s: float, dry_run: bool, memory_root: str, older_than_s: float) -> int:
    """Delete what crashed or killed saves left under ROOT (``leftovers.find``): at once what
    a process that is gone left on this host; what was made on another host (whose writer this
    host cannot see) only once untouched for ``min_age_s``. Never anything a live writer still uses.
    Then the same in ROOT's memory tier on this node, and the tier itself if no live process owns
    it and nothing changed in it for ``older_than_s`` (``tier.Run.orphaned``). The checkpoints' shared files give back
    what none of them uses (``sharing.compact``: after checkpoints were deleted by hand). Without ROOT: every
    memory tier of this node that is orphaned so (and what dead cleaners left beside them), and the node copies
    that killed cooperative loads and the scratch folders that killed saves left beside the memory root
    (``tier.dead_loads``, ``tier.dead_captures``), and the folders holding them once empty."""
    freed = count = 0
    try:
        if root is not None:
            root = normalize(root)
            freed, count = _clean_leftovers(root, "", min_age_s, dry_run)
            if not dry_run and not backend_for(root).remote:  # what the checkpoints' shared files hold for none of them
                sharing.compact(root)
            run = os.path.join(memory_root, tier.run_name(root))
            selected = [found for found in tier.runs(memory_root) if found.path == run]
            if selected:
                more_freed, more = _clean_leftovers(run, "memory ", min_age_s, dry_run)
                freed, count = freed + more_freed, count + more
        else:
            freed, count = _clean_leftovers(memory_root, "memory ", min_age_s, dry_run)
            selected = tier.runs(memory_root)
            dead = [("load", copy, "a node copy of a load whose process is gone")
                    for copy in tier.dead_loads(tier.loads_dir(memory_root))]
            dead += [("capture", scratch, "a save's scratch folder whose process is gone")
                     for scratch in tier.dead_captures(tier.captures_dir(memory_root))]
            for kind, path, why in dead:
                size = used_bytes(path)
                if not dry_run:
                    shutil.rmtree(path)
                freed, count = freed + size, count + 1
                print(f"{'would remove' if dry_run else 'removed'}  {kind} {basename(path)}  {human_bytes(size)}  ({why})")
            for parent in () if dry_run else (tier.loads_dir(memory_root), tier.captures_dir(memory_root)):
                with contextlib.suppress(OSError):  # not there, or a live load's or save's folder is in it
                    os.rmdir(parent)
    except (OSError, ObjectStoreError) as e:
        print(f"asyncckpt clean: {e}", file=sys.stderr)
        return EXIT_PROBLEM
    for run in selected:
        name = f"memory {basename(run.path)}"
        if not run.orphaned(older_than_s):
            why = "in use by a live process" if run.alive else (
                f"no live owner, changed {_duration(run.idle_s)} ago; removed once unchanged for {_duration(older_than_s)}")
            print(f"kept     {name}  (memory tier of {run.durable_root}: {why})")
            continue
        size = tier.stored_bytes(run.path)
        if not dry_run and not tier.remove_orphan(run.path):
            print(f"kept     {name}  (memory tier of {run.durable_root}: claimed by a process just now)")
            continue
        freed, count = freed + size, count + 1
        print(f"{'would remove' if dry_run else 'removed'}  {name}  {human_bytes(size)}  (memory tier of "
              f"{run.durable_root}: no live owner, unchanged for {_duration(run.idle_s)})")
    print(f"{'would free' if dry_run else 'freed'} {human_bytes(freed)} in {count} entr{'y' if count == 1 else 'ies'}")
    return EXIT_OK


def _clean_leftovers(directory: str, label: str, min_age_s: float, dry_run: bool) -> tuple[int, int]:
    """``cmd_clean``'s work on the leftovers directly in ``directory``; returns (bytes, entries) freed."""
    freed = count = 0
    for leftover in leftovers.find(directory):
        name = label + leftover.path[len(directory) + 1:]
        if not leftovers.removable(leftover, min_age_s):
            why = ("in use by a live writer" if leftover.alive else
                   f"its writer cannot be checked from this host; removed once untouched for {min_age_s:.0f} s")
            print(f"kept     {name}  ({why})")
            continue
        size = leftover.size if leftover.size is not None else used_bytes(leftover.path)
        if not dry_run:
            leftovers.delete(leftover)
        freed, count = freed + size, count + 1
        print(f"{'would remove' if dry_run else 'removed'}  {name}  {human_bytes(size)}  ({leftover.kind} of {leftover.belongs_to})")
    return freed, count


# ------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncckpt", description="Inspect and verify asyncckpt checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ls = commands.add_parser("ls", help="list the checkpoints under ROOT (every kind, leftovers too, and its memory "
                                        "tier on this node), newest last; with --memory, every memory tier of this node")
    ls.add_argument("root", metavar="ROOT", nargs="?")
    inspect = commands.add_parser("inspect", help="keys, shapes, dtypes, chunks and writing ranks of a checkpoint")
    inspect.add_argument("path", metavar="PATH")
    verify = commands.add_parser("verify", help="recheck a checkpoint, or every one under a directory (exit 0 good, "
                                                "1 damaged, 2 incomplete)")
    verify.add_argument("path", metavar="PATH")
    verify.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    clean = commands.add_parser("clean", help="delete what crashed saves left under ROOT (never what a live save uses), "
                                              "and its memory tier on this node once its job is gone; with --memory, "
                                              "every memory tier of this node whose job is gone")
    clean.add_argument("root", metavar="ROOT", nargs="?")
    clean.add_argument("--min-age", type=float, default=3600.0, metavar="SECONDS",
                       help="leftovers whose writer cannot be checked from this host (another host) only once "
                            "untouched for this long (default 3600); those of a process that is gone go at once")
    clean.add_argument("--older-than", type=float, default=tier.ORPHAN_AFTER_S, metavar="SECONDS",
                       help="a memory tier no live process owns only once unchanged for this long (default "
                            f"{tier.ORPHAN_AFTER_S:.0f}: a restarted job finds its tier until then)")
    clean.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    for command in (ls, clean):
        command.add_argument("--memory", action="store_true", help="every memory tier of this node (give no ROOT)")
        command.add_argument("--memory-root", metavar="DIR",
                             help=f"this node's memory root (default: ${tier.MEMORY_ROOT_ENV}, else {tier.DEFAULT_MEMORY_ROOT})")
    export_cli.add_parser(commands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command in ("ls", "clean"):
        memory_root = os.path.abspath(args.memory_root) if args.memory_root else tier.memory_root()
        every_tier = args.memory or (args.command == "ls" and args.memory_root is not None and args.root is None)
        if (args.root is None) != every_tier:
            parser.error(f"{args.command}: give ROOT, or --memory (every memory tier of this node), not both")
    try:
        if args.command == "ls":
            return cmd_ls_memory(memory_root) if every_tier else cmd_ls(_trimmed(args.root), memory_root)
        if args.command == "inspect":
            return cmd_inspect(_trimmed(args.path))
        if args.command == "clean":
            return cmd_clean(args.root, args.min_age, args.dry_run, memory_root, args.older_than)
        if args.command == "export":
            return export_cli.run(args)
        return cmd_verify(_trimmed(args.path), progress=not args.no_progress)
    except BrokenPipeError:  # `asyncckpt inspect ... | head`: stop quietly, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PROBLEM


if __name__ == "__main__":
    sys.exit(main())
