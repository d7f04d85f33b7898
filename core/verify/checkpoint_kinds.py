"""Which kind of checkpoint a path is, and what a native file holds, without loading its tensors.

More: docs/MODULES.md, core/verify/checkpoint_kinds.py.
"""
from __future__ import annotations

import json
import os
import re
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, Optional

from asyncckpt.core.storage import commit, leftovers
from asyncckpt.core.formats import names
from asyncckpt.core.formats.names import step_from_name
from asyncckpt.core.storage.backend import Backend, backend_for, basename, exists, is_file, join
from asyncckpt.core.storage.leftovers import Leftover

NATIVE_FILE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl", ".safetensors")
_FRAMEWORK_FILES = re.compile(r"^(model(-\d+-of-\d+|_\d+)?\.safetensors|pytorch_model.*\.bin|optimizer(_\d+)?\.(bin|pt)|"
                              r"trainer_state\.json|random_states_\d+\.pkl|meta\.pt|scheduler(_\d+)?\.(bin|pt))$")
_EPOCH_IN_NAME = re.compile(r"epoch=(\d+)")


@dataclass
class Entry:
    """One checkpoint (or leftover) found under a root, or named."""

    path: str
    kind: str  # "sharded", "directory", "file", "hidden"
    status: str  # "COMPLETE", "INCOMPLETE", "NATIVE" (written by a framework without asyncckpt)
    step: Optional[int]
    epoch: Optional[int]
    note: str = ""
    checksums: bool = False  # carries checksums to verify it by (written by asyncckpt, since they exist)
    record: Optional[dict] = None  # its commit record
    size: Optional[int] = None  # bytes, where finding it measured them (else ``contents.used_bytes``)
    modified: float = 0.0  # seconds since the epoch: its commit, else its listing's time


def classify(path: str, *, read_step: bool = True) -> Optional[Entry]:
    """What ``path`` (a local path or a URL) is, or None if it is no checkpoint (any file named
    explicitly counts as one). ``read_step``: a local file whose name holds no step (Lightning's
    ``last.ckpt``) has it read from its content, which unpickles the file's whole structure (seconds
    for thousands of tensors): only for listings, not for checks."""
    backend = backend_for(path)
    name = basename(path)
    hidden = names.parse_hidden(name)
    if hidden is not None:
        return _hidden(backend, path, hidden)
    if is_file(backend, path):
        return _file(backend, path, name, backend.stat(path).size, 0.0, read_step)
    return _directory(backend, path, name, commit.read_commit_record(path), 0.0)


def checkpoints_under(root: str, *, read_step: bool = True) -> list[Entry]:
    """Every checkpoint directly under ``root`` (a directory or a URL), and every leftover of ours
    there (``leftovers.find``: kind ``hidden``). One listing of ``root`` and its commit
    records (``commit.committed_under``); a committed checkpoint is described from its record,
    without listing it. ``read_step``: see ``classify``. OSError if ``root`` cannot be listed."""
    backend = backend_for(root)
    listed = backend.listing(root)
    records = dict(commit.committed_under(root))
    left = {leftover.path: leftover for leftover in leftovers.find(root)}
    shown = {item.path for item in listed if names.parse_hidden(item.name) is None}
    found = [_leftover(backend, leftover) for path, leftover in left.items() if path not in shown]
    for item in listed:
        if item.path not in shown or item.name.startswith("."):
            continue  # ours are leftovers, above; other hidden names are nobody's checkpoint
        if not item.is_dir:
            dangling = item.link and not exists(backend, item.path)  # a link to a checkpoint that is gone
            if item.name.endswith(NATIVE_FILE_SUFFIXES) and not dangling:
                found.append(_file(backend, item.path, item.name, item.size, item.modified, read_step))
            continue
        entry = _directory(backend, item.path, item.name, records.get(item.path), item.modified)
        if entry is None and item.path in left:  # an object-store prefix a crashed save left, holding nothing known
            entry = _leftover(backend, left[item.path])
        if entry is not None:
            found.append(entry)
    return found


def _hidden(backend: Backend, path: str, hidden: names.HiddenName) -> Entry:
    aborted = exists(backend, join(path, names.ABORT_MARKER))
    return Entry(path, "hidden", "INCOMPLETE", step_from_name(hidden.name), None, "aborted" if aborted else hidden.kind)


def _leftover(backend: Backend, leftover: Leftover) -> Entry:
    """A leftover as a listing shows it: named by what it belongs to, and what it is."""
    hidden = names.parse_hidden(basename(leftover.path))
    entry = _hidden(backend, leftover.path, hidden) if hidden is not None else Entry(
        leftover.path, "hidden", "INCOMPLETE", step_from_name(leftover.belongs_to), None, leftover.kind)
    entry.size, entry.modified = leftover.size, leftover.modified
    return entry


def _file(backend: Backend, path: str, name: str, size: int, modified: float, read_step: bool) -> Entry:
    """A single native file. Its content is read for a step only in place (never downloaded)."""
    note = f"-> {os.readlink(path)}" if os.path.islink(path) else ""
    step_and_epoch = _step_and_epoch_of_file(path, name, read_step and not backend.remote)
    return Entry(path, "file", "COMPLETE", *step_and_epoch, note, backend.read_checksum_record(path) is not None,
                 size=size, modified=modified)


def _directory(backend: Backend, path: str, name: str, record: Optional[dict], modified: float) -> Optional[Entry]:
    """A directory or prefix: by its commit record (whose ``files`` name what it holds), else by
    what it holds. In an object store a save writes under the final name: owner markers without a
    commit object are a save in flight or a crashed one."""
    files = record.get("files") if record is not None else None
    if isinstance(files, dict) and files:
        entries = set(files)
    else:
        try:
            entries = set(backend.names(path))
        except OSError:  # nothing there, not a directory, not readable
            return None
    step = record.get("step") if record and isinstance(record.get("step"), int) else step_from_name(name)
    sharded = names.DCP_METADATA_FILE in entries or any(map(names.SIDECAR_PATTERN.match, entries))
    if record is not None:
        size = sum(files.values()) if isinstance(files, dict) and files else None
        return Entry(path, "sharded" if sharded else "directory", "COMPLETE", step, None,
                     checksums=sharded or "checksums" in record, record=record, size=size,
                     modified=(record.get("committed_at_ns") or 0) / 1e9 or modified)
    if sharded or any(map(names.OWNER_MARKER_PATTERN.match, entries)):
        complete = names.DCP_METADATA_FILE in entries and not any(
            names.SIDECAR_PATTERN.match(e) or names.OWNER_MARKER_PATTERN.match(e) for e in entries)
        return Entry(path, "sharded", "NATIVE" if complete else "INCOMPLETE", step, None,
                     "" if complete else "no commit record", modified=modified)
    if any(map(_FRAMEWORK_FILES.match, entries)):
        return Entry(path, "directory", "NATIVE", step, None, "written without asyncckpt: completeness unknown",
                     modified=modified)
    return None


def _step_and_epoch_of_file(path: str, name: str, read_content: bool) -> tuple[Optional[int], Optional[int]]:
    step, epoch = step_from_name(name), _EPOCH_IN_NAME.search(name)
    if step is not None or not read_content:
        return step, int(epoch.group(1)) if epoch else None
    content = load_weights_only(path)  # e.g. last.ckpt: Lightning records them inside
    if isinstance(content, dict):
        return content.get("global_step"), content.get("epoch")
    return None, None


# ------------------------------------------------------------------------------------ native files
def load_weights_only(path: str) -> Any:
    """The file's content with its tensors memory-mapped, or None if it is no weights-only
    ``torch.save`` file (then it is not unpickled)."""
    import torch

    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal means: not describable without running its pickle
        return None


def describe_file(path: str) -> tuple[list[tuple[str, str, tuple[int, ...]]], Optional[str]]:
    """(key, dtype, shape) of every tensor in a native file, and a note when they cannot be listed."""
    if path.endswith(".safetensors"):
        header, problem = safetensors_header(path)
        if header is None:
            return [], problem
        return [(key, entry["dtype"], tuple(entry["shape"])) for key, entry in header.items() if key != "__metadata__"], None
    content = load_weights_only(path)
    if content is None:
        return [], "a pickle of more than tensors and plain values: its keys are not listed (not unpickled)"
    return list(_tensors(content, "")), None


def _tensors(value: Any, prefix: str):
    import torch

    if isinstance(value, torch.Tensor):
        yield prefix or "(tensor)", str(value.dtype).removeprefix("torch."), tuple(value.shape)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{prefix}.{index}" if prefix else str(index))


def safetensors_header(path: str) -> tuple[Optional[dict], Optional[str]]:
    """The header of a safetensors file and, when it is damaged, what is wrong."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return None, f"truncated: {size} B, not even a header length"
        (length,) = struct.unpack("<Q", prefix)
        if 8 + length > size:
            return None, f"truncated: the header says {length} B, the file has {size} B"
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            return None, f"damaged header: {e}"
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if 8 + length + end != size:
        return None, f"{'truncated' if 8 + length + end > size else 'grown'}: {size} B, the header describes {8 + length + end} B"
    return header, None


def check_file(path: str) -> Optional[str]:
    """What is structurally wrong with a native file (None: nothing found). A ``torch.save`` zip
    must have its central directory and every record inside the file; a safetensors file must
    match its header."""
    if path.endswith(".safetensors"):
        return safetensors_header(path)[1]
    if path.endswith(".json"):
        try:
            with open(path, "rb") as f:
                json.load(f)
        except ValueError as e:
            return f"not valid JSON: {e}"
        return None
    size = os.path.getsize(path)
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                if info.header_offset + info.compress_size > size:
                    return f"truncated: record {info.filename} ends beyond the file ({size} B)"
    except zipfile.BadZipFile as e:
        return f"not a complete torch.save file (damaged or truncated zip: {e})"
    return None
