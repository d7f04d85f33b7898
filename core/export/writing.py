"""Exporting a checkpoint's model weights as Hugging Face safetensors, committed like a checkpoint.

``export_checkpoint`` does the work in any process: in rank 0's background writer, behind the save of
a checkpoint (``request.ExportRequest``), and offline (``asyncckpt export``).

More: docs/MODULES.md, core/export/writing.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from typing import Callable, Optional

from asyncckpt.core.errors import CheckpointError, CheckpointWriteError
from asyncckpt.core.export import sources
from asyncckpt.core.export.assembly import PieceReader, write_tensor
from asyncckpt.core.export.options import EXPORT_FORMAT, ExportOptions
from asyncckpt.core.export.sources import Source, SourceTensor
from asyncckpt.core.formats import names
from asyncckpt.core.formats.checksum import checksum_stream
from asyncckpt.core.formats.hf_safetensors import FLOATING, OutputTensor, index_bytes, plan_shards
from asyncckpt.core.storage import commit, owners
from asyncckpt.core.storage.backend import at_once, backend_for, basename, exists, normalize
from asyncckpt.core.storage.staging import publish_checkpoint
from asyncckpt.core.storage.fsio import fsync_dir
from asyncckpt.core.writer.mirror import copy, restore

COPIED_FILES = ("config.json", "generation_config.json", "adapter_config.json")

#: Gives the tensors of a local checkpoint for an export with these options, or None where this
#: process cannot read them (``read_without_torch``: only torch can).
Reader = Callable[[str, ExportOptions], Optional[Source]]
Progress = Callable[[int], None]


def read_without_torch(checkpoint: str, options: ExportOptions) -> Optional[Source]:
    """The tensors of ``checkpoint`` where ``sources`` reads its kind and no merge is asked for; None
    where torch is needed (a ``torch.save`` file, a stock DCP directory, a PEFT adapter to merge:
    the merge is torch's arithmetic, as peft's)."""
    source = sources.find(checkpoint)
    return None if source is None or merges_adapter(source, options) else source


def merges_adapter(source: Source, options: ExportOptions) -> bool:
    """Whether the export of ``source`` is its PEFT adapter merged into the base model."""
    return source.stem == "adapter_model" and options.peft == "merged"


def _selected(source: Source, options: ExportOptions) -> list[tuple[OutputTensor, SourceTensor]]:
    prefix = source.model_prefix if options.keys is None else options.keys
    chosen = []
    for key, tensor in source.tensors.items():
        if not key.startswith(prefix):
            continue
        dtype = options.dtype if options.dtype is not None and tensor.dtype in FLOATING else tensor.dtype
        chosen.append((OutputTensor(options.add_prefix + key[len(prefix):], dtype, tensor.shape), tensor))
    if not chosen:
        raise CheckpointWriteError(f"no tensor key of {source.path} starts with {prefix!r}: nothing to export "
                                   f"(keys: {', '.join(list(source.tensors)[:5])}{', ...' if len(source.tensors) > 5 else ''})",
                                   path=source.path)
    return chosen


class _Output:
    """A file being written in order: every byte hashed on its way (for the commit record)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.digest, self.size = checksum_stream(), 0

    def write(self, data: memoryview) -> None:
        self.digest.update(data)
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(self.fd, view):]
        self.size += len(data)

    def close(self) -> dict:
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
        return {"size": self.size, "xxh3": self.digest.hexdigest()}


def _write_file(path: str, data: bytes) -> dict:
    out = _Output(path)
    try:
        out.write(memoryview(data))
    finally:
        checksum = out.close()
    return checksum


def total_bytes(checkpoint: str, options: ExportOptions, read: Reader = read_without_torch) -> Optional[int]:
    """What an export of ``checkpoint`` reads (for a progress bar); None for one in an object store
    (known once it is downloaded) or one ``read`` cannot read."""
    if backend_for(checkpoint).remote:
        return None
    source = read(checkpoint, options)
    if source is None:
        return None
    return sum(piece.nbytes for _out, tensor in _selected(source, options) for piece in tensor.pieces)


def export_checkpoint(checkpoint: str, target: str, options: ExportOptions, *, read: Reader = read_without_torch,
                      token: Optional[str] = None, progress: Optional[Progress] = None) -> str:
    """Write the export of ``checkpoint`` to ``target`` (replacing an older one there), committed;
    returns ``target``. Either may be an object-store URL. ``read`` gives the tensors of the (local)
    checkpoint; where it cannot, a child process with torch writes the export (``export_local``).
    Raises ``CheckpointWriteError`` naming the checkpoint."""
    source, destination = backend_for(checkpoint), backend_for(target)
    checkpoint, target = normalize(checkpoint), normalize(target)
    token = token or owners.owner_token()
    try:
        if not source.remote and not destination.remote:
            export_local(checkpoint, target, options, read=read, token=token, progress=progress, export_of=checkpoint)
            return target
        with tempfile.TemporaryDirectory(prefix="asyncckpt-export-") as scratch:
            local = restore(checkpoint, os.path.join(scratch, "checkpoint", basename(checkpoint))) \
                if source.remote else checkpoint
            staged = os.path.join(scratch, "export", basename(target)) if destination.remote else target
            export_local(local, staged, options, read=read, token=token, progress=progress, export_of=checkpoint)
            if destination.remote:
                copy(staged, target, token)
    except BaseException as e:
        if not isinstance(e, Exception) or (isinstance(e, CheckpointError) and checkpoint in str(e)):
            raise
        cause = str(e) if isinstance(e, _ChildFailed) else f"{type(e).__name__}: {e}"
        raise CheckpointWriteError(f"exporting checkpoint {checkpoint} to {target} failed: {names.unhide(cause)}; "
                                   "the checkpoint is not affected", path=checkpoint) from e
    return target


def export_local(checkpoint: str, target: str, options: ExportOptions, *, read: Reader, token: str,
                 progress: Optional[Progress], export_of: str) -> None:
    """``export_checkpoint`` from a local checkpoint to a local target (``export_of``: the checkpoint
    as the commit record names it). A checkpoint ``read`` cannot read is exported by a child process
    that reads it with torch (``python -m asyncckpt.core.export``); its progress is not reported."""
    source = read(checkpoint, options)
    if source is None:
        _export_in_child_with_torch(checkpoint, target, options, export_of)
        return
    chosen = _selected(source, options)
    record = commit.read_commit_record(checkpoint) if os.path.isdir(checkpoint) else None
    staging = names.staging_dir_for(target, token)
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.makedirs(staging)
        checksums = _write_export(source, chosen, staging, options, progress)
        replaced = publish_checkpoint(backend_for(target), staging, target, {
            "save_id": token, "world_size": 1, "step": (record or {}).get("step"), "checksums": checksums,
            "export_of": export_of, "export_format": EXPORT_FORMAT})
    except BaseException:
        if os.path.lexists(staging):
            backend_for(staging).remove_tree(staging, token, later=at_once)
        raise
    if replaced is not None:
        backend_for(replaced).remove_tree(replaced, token, later=at_once)


def _export_in_child_with_torch(checkpoint: str, target: str, options: ExportOptions, export_of: str) -> None:
    """``export_local`` in ``python -m asyncckpt.core.export``: a process of its own that imports torch
    and exits (started with ``sys.executable``, the environment, the scheduling policy and the session
    of the caller: an export in the writer stays on idle CPU). The export it writes is its own (its
    hidden names carry its owner token); its failure is raised here, as its last line says it."""
    done = subprocess.run([sys.executable, "-m", "asyncckpt.core.export", checkpoint, target, export_of,
                           json.dumps(dataclasses.asdict(options))],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise _ChildFailed(lines[-1] if lines else f"the export process exited with status {done.returncode}")


class _ChildFailed(Exception):
    """What failed in the export's child process: ``TypeName: message``, as it reported it (``__main__``)."""


def _write_export(source: Source, chosen: list[tuple[OutputTensor, SourceTensor]], staging: str,
                  options: ExportOptions, progress: Optional[Progress]) -> dict[str, dict]:
    outputs = {out.name: tensor for out, tensor in chosen}
    shards = plan_shards([out for out, _tensor in chosen], options.max_shard_size, stem=source.stem)
    buffer = memoryview(bytearray(options.buffer_bytes))
    reader = PieceReader()
    checksums: dict[str, dict] = {}
    try:
        for shard in shards:
            out = _Output(os.path.join(staging, shard.file_name))
            try:
                out.write(memoryview(shard.header))
                for tensor in shard.tensors:
                    write_tensor(outputs[tensor.name], tensor.dtype, reader, buffer, out.write, progress)
            finally:
                checksums[shard.file_name] = out.close()
    finally:
        reader.close()
    index = index_bytes(shards, stem=source.stem)
    if index is not None:
        checksums[index[0]] = _write_file(os.path.join(staging, index[0]), index[1])
    for name in COPIED_FILES:
        copied = os.path.join(source.files_dir or "", name)
        if source.files_dir and os.path.isfile(copied):
            with open(copied, "rb") as f:
                checksums[name] = _write_file(os.path.join(staging, name), f.read())
    fsync_dir(staging)
    return checksums


def stale_exports(root: str, keep_last: Optional[int]) -> list[str]:
    """The committed exports under ``root`` to delete: beyond the newest ``keep_last``, or (without
    ``keep_last``) those whose checkpoint no longer exists. Never the newest."""
    exports = []
    for path, record in commit.committed_under(root):
        if record is not None and record.get("export_format") == EXPORT_FORMAT:
            step = record.get("step")
            exports.append(((step if isinstance(step, int) else -1, record.get("committed_at_ns", 0)), path, record))
    exports.sort(key=lambda item: item[0])
    candidates = exports[:-1]
    if keep_last is not None:
        return [path for _key, path, _record in exports[:-keep_last]]
    return [path for _key, path, record in candidates
            if not exists(backend_for(str(record.get("export_of"))), str(record.get("export_of")))]

