"""Exporting a checkpoint's model weights as Hugging Face safetensors, committed like a checkpoint.

``ExportRequest`` runs in rank 0's background writer, queued behind the save of a checkpoint and
run only if it committed (``Checkpointer.export``; the ``export=`` option of the Checkpointer and
the adapters queues one per checkpoint). ``export_checkpoint`` is the same work in any process
(``asyncckpt export``).

The export reads each tensor's pieces from the checkpoint's files (``tensor_sources``: from the
sidecars of a sharded save, whatever its world size, or from safetensors files) and writes it once
(``assembly``: a buffer of fixed size, checksums checked), into files of at most
``max_shard_size`` plus the index (``hf_safetensors``), next to the files ``from_pretrained`` needs
(``config.json``, ``generation_config.json``, a PEFT ``adapter_config.json``) copied from the
checkpoint. Like a checkpoint, it is written under a hidden staging name, fsynced, given a commit
record listing every file's checksum (so ``asyncckpt verify`` checks it), and renamed into place:
visible only complete. A failure (a full disk, a damaged checkpoint) raises an error naming the
checkpoint; the checkpoint itself is only read. Exports are kept as long as their checkpoint
exists, or the newest ``keep_last``. A checkpoint in an object store is downloaded into a temporary
directory first (local space its size: the pieces are read with ``pread``), and an export for an object
store is written into one, then uploaded and committed there (``mirror``).

Kept free of torch for the checkpoints ``tensor_sources`` reads; a torch.save file or a stock DCP
checkpoint is read through ``core/loading/torch_sources.py`` (which imports torch).
"""
from __future__ import annotations

import importlib
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from asyncckpt.core.errors import CheckpointError, CheckpointWriteError
from asyncckpt.core.formats import names
from asyncckpt.core.formats.checksum import checksum_stream
from asyncckpt.core.formats.hf_safetensors import (FLOATING, OutputTensor, dtype_name, index_bytes, parse_size,
                                                   plan_shards)
from asyncckpt.core.storage import tensor_sources
from asyncckpt.core.storage.tensor_sources import Source, SourceTensor
from asyncckpt.core.storage import commit, owners, removal
from asyncckpt.core.storage.backend import at_once, backend_for, basename, exists, normalize
from asyncckpt.core.storage.fsio import fsync_dir
from asyncckpt.core.storage.staging import publish_checkpoint
from asyncckpt.core.writer.assembly import PieceReader, write_tensor
from asyncckpt.core.writer.mirror import restore, upload
from asyncckpt.core.writer.protocol import RequestContext

EXPORT_FORMAT = "hf-safetensors"
COPIED_FILES = ("config.json", "generation_config.json", "adapter_config.json")
_FILE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors")  # a single-file checkpoint's export is a directory


@dataclass
class ExportOptions:
    """How checkpoints are exported.

    Args:
        directory: where exports go: the export of checkpoint ``.../NAME`` is ``directory/NAME``.
            Default: ``exports`` beside the checkpoint (``run/checkpoint-500`` → ``run/exports/checkpoint-500``).
        max_shard_size: bytes of tensor data per file at most (``"5GB"``, ``"500MB"``, or an int), as
            ``save_pretrained(max_shard_size=...)``; one file is ``model.safetensors``, several get an index.
        dtype: write floating tensors in this dtype (``"bf16"``, ``"float16"``, ...); default: as saved.
        keys: export the tensors whose key starts with this, without it (``"model."``: the model of a
            state dict ``{"model": ..., "optim": ...}``). Default: the checkpoint's model (``"model."``,
            or Lightning's ``"state_dict."``, where its keys have it, else every tensor).
        add_prefix: put before every exported name (e.g. ``"model."`` for a wrapped Transformers model).
        keep_last: keep only the newest so many exports in ``directory``; default (None): an export is
            removed once its checkpoint is gone (it follows the checkpoints' retention).
        buffer_bytes: the fixed buffer an export reads and writes through (its memory).
        peft: a PEFT LoRA checkpoint (``adapter_model.safetensors``) is exported as ``"adapter"`` (alone, for
            ``PeftModel.from_pretrained``) or ``"merged"`` (its base model with the adapter merged in, as
            ``merge_and_unload`` gives it, for ``AutoModel*.from_pretrained``; reads the base model from
            ``base_model`` or the adapter config's ``base_model_name_or_path``, a local directory; needs torch).
        base_model: the base model's directory, for ``peft="merged"``.

    The training process fills in ``read_with_torch`` and ``merge_with_torch`` (``loading.torch_sources``):
    ``ImportedOnCall`` functions, named rather than pickled by reference (unpickling a reference imports its
    module, and with it torch), so that the writer imports torch only for a checkpoint only torch reads (a
    ``torch.save`` file, a stock DCP directory) or a PEFT merge.
    """

    directory: Optional[str] = None
    max_shard_size: int | str = "5GB"
    dtype: Optional[str] = None
    keys: Optional[str] = None
    add_prefix: str = ""
    keep_last: Optional[int] = None
    buffer_bytes: int = 64 << 20
    peft: str = "adapter"
    base_model: Optional[str] = None
    read_with_torch: Optional[Callable[[str], Source]] = None
    merge_with_torch: Optional[Callable[[Source, Optional[str]], Source]] = None

    def __post_init__(self) -> None:
        self.max_shard_size = parse_size(self.max_shard_size)
        if self.dtype is not None:
            self.dtype = dtype_name(self.dtype)
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        if self.buffer_bytes < 4096:
            raise ValueError("buffer_bytes must be at least 4096")
        if self.peft not in ("adapter", "merged"):
            raise ValueError(f"peft={self.peft!r}: 'adapter' or 'merged'")

    def target_for(self, checkpoint: str) -> str:
        """Where the export of ``checkpoint`` goes."""
        checkpoint = normalize(checkpoint)
        root = self.directory or os.path.join(os.path.dirname(checkpoint), "exports")  # os.path: '/' in URLs too
        name, suffix = os.path.splitext(os.path.basename(checkpoint))
        return os.path.join(normalize(root), name if suffix in _FILE_SUFFIXES else name + suffix)


@dataclass(frozen=True)
class ImportedOnCall:
    """The function ``name`` of the module ``module``, imported when first called."""

    module: str
    name: str

    def __call__(self, *args: Any) -> Any:
        return getattr(importlib.import_module(self.module), self.name)(*args)


def as_options(export: "ExportOptions | str | dict | None") -> Optional[ExportOptions]:
    """``export="safetensors"`` (the defaults), an ``ExportOptions`` (or its fields), or None (no export)."""
    if export is None or isinstance(export, ExportOptions):
        return export
    if isinstance(export, dict):  # as dataclasses.asdict left it (a pickled adapter's options)
        return ExportOptions(**export)
    if export in ("safetensors", EXPORT_FORMAT):
        return ExportOptions()
    raise ValueError(f"export={export!r}: use 'safetensors' or an asyncckpt.core.ExportOptions")


def read_source(checkpoint: str, options: ExportOptions) -> Source:
    """The tensors of ``checkpoint``: torch-free where ``tensor_sources`` knows its kind, else through torch."""
    source = tensor_sources.find(checkpoint)
    if source is None:  # a torch.save file or a stock DCP directory
        if options.read_with_torch is None:
            raise CheckpointWriteError(f"{checkpoint}: only torch reads this checkpoint: export it with torch "
                                       "(asyncckpt export, or a Checkpointer)")
        return options.read_with_torch(checkpoint)
    if source.stem == "adapter_model" and options.peft == "merged":  # the merge is torch's arithmetic, as peft's
        if options.merge_with_torch is None:
            raise CheckpointWriteError(f"{checkpoint}: merging a PEFT adapter needs torch: export it with torch")
        return options.merge_with_torch(source, options.base_model)
    return source


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


def total_bytes(checkpoint: str, options: ExportOptions) -> Optional[int]:
    """What an export of ``checkpoint`` reads (for a progress bar); None for one in an object store
    (known once it is downloaded)."""
    if backend_for(checkpoint).remote:
        return None
    return sum(piece.nbytes for _out, tensor in _selected(read_source(checkpoint, options), options)
               for piece in tensor.pieces)


def export_checkpoint(checkpoint: str, target: str, options: ExportOptions, *, token: Optional[str] = None,
                      progress: Optional[Callable[[int], None]] = None) -> str:
    """Write the export of ``checkpoint`` to ``target`` (replacing an older one there), committed;
    returns ``target``. Either may be an object-store URL. Raises ``CheckpointWriteError`` naming the
    checkpoint."""
    source, destination = backend_for(checkpoint), backend_for(target)
    checkpoint, target = normalize(checkpoint), normalize(target)
    token = token or owners.owner_token()
    try:
        if not source.remote and not destination.remote:
            _export(checkpoint, target, options, token, progress, export_of=checkpoint)
            return target
        with tempfile.TemporaryDirectory(prefix="asyncckpt-export-") as scratch:
            local = restore(checkpoint, os.path.join(scratch, "checkpoint", basename(checkpoint))) \
                if source.remote else checkpoint
            staged = os.path.join(scratch, "export", basename(target)) if destination.remote else target
            _export(local, staged, options, token, progress, export_of=checkpoint)
            if destination.remote:
                upload(staged, target, token)
    except BaseException as e:
        if not isinstance(e, Exception) or (isinstance(e, CheckpointError) and checkpoint in str(e)):
            raise
        raise CheckpointWriteError(f"exporting checkpoint {checkpoint} to {target} failed: {type(e).__name__}: "
                                   f"{names.unhide(str(e))}; the checkpoint is not affected", path=checkpoint) from e
    return target


def _export(checkpoint: str, target: str, options: ExportOptions, token: str,
            progress: Optional[Callable[[int], None]], export_of: str) -> None:
    """``export_checkpoint`` from a local checkpoint to a local target."""
    staging = names.staging_dir_for(target, token)
    try:
        record = commit.read_commit_record(checkpoint) if os.path.isdir(checkpoint) else None
        source = read_source(checkpoint, options)
        chosen = _selected(source, options)
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


def _write_export(source: Source, chosen: list[tuple[OutputTensor, SourceTensor]], staging: str,
                  options: ExportOptions, progress: Optional[Callable[[int], None]]) -> dict[str, dict]:
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


@dataclass
class ExportRequest:
    """Export the committed checkpoint ``checkpoint`` to ``target``, then apply the exports' retention."""

    checkpoint: str
    target: str
    options: ExportOptions

    def run(self, context: RequestContext) -> None:
        root = os.path.dirname(self.target)
        if not backend_for(root).remote:
            context.tidy(root)  # a killed export's staging directory
        on_idle_cpu(lambda: export_checkpoint(self.checkpoint, self.target, self.options, token=context.token()))
        removal.remove(stale_exports(root, self.options.keep_last), context.token(), context.after_reply)


def on_idle_cpu(work: Callable[[], object]) -> None:
    """Run ``work`` in a thread of its own scheduled ``SCHED_IDLE``: the export takes the CPU time the
    training loop leaves, rather than competing with it (docs/benchmarks_export.md). A thread of its
    own, because an unprivileged thread cannot leave ``SCHED_IDLE`` again; where the policy is refused,
    it runs as usual. The writer has a session of its own, and with it (where the kernel groups by
    session: ``sched_autogroup_enabled``) a scheduling group of its own, which competes with the training
    process's group as an equal whatever its threads' policies: the group is niced to 19 meanwhile (the
    export took 2 s and slowed a 2-thread training loop by 64% without it). What ``work`` raises is raised here."""
    failure: list[BaseException] = []

    def idle() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
        except (OSError, AttributeError):
            pass
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - raised in the calling thread
            failure.append(e)

    previous = _set_group_nice(19)
    try:
        thread = threading.Thread(target=idle, name="asyncckpt-export")
        thread.start()
        thread.join()
    finally:
        if previous is not None:
            _set_group_nice(previous)
    if failure:
        raise failure[0]


_AUTOGROUP = "/proc/self/autogroup"


def _set_group_nice(nice: int) -> Optional[int]:
    """Set the nice value of this process's scheduling group; the one it had (None: no such group here)."""
    try:
        with open(_AUTOGROUP) as f:
            previous = int(f.read().rsplit("nice", 1)[1])
        with open(_AUTOGROUP, "w") as f:
            f.write(str(nice))
    except (OSError, ValueError, IndexError):
        return None
    return previous


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

