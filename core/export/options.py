"""How checkpoints are exported (``ExportOptions``, public as ``asyncckpt.core.ExportOptions``).

Plain data: the training process fills it in, the background writer unpickles it with an
``ExportRequest``, and a child that exports with torch (``asyncckpt.core.export.__main__``) reads it
as JSON. Kept free of torch: the writer imports it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from asyncckpt.core.formats.hf_safetensors import dtype_name, parse_size
from asyncckpt.core.storage.backend import normalize

EXPORT_FORMAT = "hf-safetensors"
_FILE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".safetensors")  # a single-file checkpoint's export is a directory


@dataclass
class ExportOptions:
    """How checkpoints are exported. Each field, its default and meaning: docs/options.md.

    Args:
        directory: where exports go (default: ``exports`` beside the checkpoint).
        max_shard_size: bytes of tensor data per file at most (``"5GB"``, ``"500MB"``, or an int).
        dtype: write floating tensors in this dtype (default: as saved).
        keys: export the tensors whose key starts with this, without it (default: the checkpoint's model).
        add_prefix: put before every exported name.
        keep_last: keep only the newest so many exports (None: an export goes with its checkpoint).
        buffer_bytes: the fixed buffer an export reads and writes through.
        peft: a PEFT LoRA checkpoint exported as ``"adapter"`` or ``"merged"`` (into its base model).
        base_model: for ``peft="merged"``: the base model's directory or Hub id (default: the adapter config's).
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


def as_options(export: "ExportOptions | str | dict | None") -> Optional[ExportOptions]:
    """``export="safetensors"`` (the defaults), an ``ExportOptions`` (or its fields), or None (no export)."""
    if export is None or isinstance(export, ExportOptions):
        return export
    if isinstance(export, dict):  # as dataclasses.asdict left it (a pickled adapter's options, the export child's)
        return ExportOptions(**export)
    if export in ("safetensors", EXPORT_FORMAT):
        return ExportOptions()
    raise ValueError(f"export={export!r}: use 'safetensors' or an asyncckpt.core.ExportOptions")
