"""Snapshots of single native files (``torch.save`` / safetensors) into reused staging buffers.

The caller's part of a single-file save: render the file's image (the structure pickled now,
the tensors' places in the file) and copy it into a free file buffer. The writer then writes
the buffer out (``file_requests.FileRequest``). Used by ``Checkpointer.async_save_file`` and by
directory transactions.
"""
from __future__ import annotations

from typing import Any, Optional

from .buffers import BufferPool, Slot
from .native_files import FileImage, safetensors_image, stage_image
from .staging import CopyInProgress
from .tensor_copy import CopyThreads
from .torch_file import TorchFileTemplates


class FileSnapshots:
    def __init__(self, buffers: BufferPool, threads: CopyThreads) -> None:
        self.buffers, self.threads = buffers, threads
        self.torch_files = TorchFileTemplates()  # framing cached per structure

    def image(self, obj: Any, format: str, metadata: Optional[dict[str, str]]) -> FileImage:
        """``format="torch"``: what ``torch.save(obj)`` writes; ``"safetensors"``: what
        ``safetensors.torch.save_file(obj, metadata=...)`` writes."""
        if format == "torch":
            return self.torch_files.image(obj)
        if format == "safetensors":
            return safetensors_image(obj, metadata)
        raise ValueError(f"unknown file format {format!r} (expected 'torch' or 'safetensors')")

    def stage(self, image: FileImage, slot: Slot) -> CopyInProgress:
        """Copy ``image`` into ``slot`` (complete on return); the framing of a torch file is
        written only when the buffer's last file had another structure."""
        in_place = image.framing is not None and slot.framing is image.framing
        slot.framing = None  # until this copy is complete
        stage_image(image, slot.buffer.bytes, self.threads, framing_in_place=in_place)
        slot.framing = image.framing
        return CopyInProgress(None, [])
