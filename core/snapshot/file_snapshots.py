"""Snapshots of single native files (``torch.save`` / safetensors) into reused snapshot buffers.

The caller's part of a single-file save: render the file's image (the structure pickled now,
the tensors' places in the file) and copy it into a free file buffer. The writer then writes
the buffer out (``file_requests.FileRequest``). Used by ``Checkpointer.async_save_file`` and by
directory transactions.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from asyncckpt.core.snapshot.buffer_pool import BufferPool, Slot
from asyncckpt.core.snapshot.file_images import FileImage, safetensors_image, stage_image
from asyncckpt.core.snapshot.shared_buffer import CopyInProgress
from asyncckpt.core.snapshot.tensor_copy import CopyThreads
from asyncckpt.core.snapshot.torch_file_images import TorchFileTemplates, plain_image


_CONTAINERS = (torch.Tensor, dict, list, tuple)


def tensor_bytes(obj: Any, stop_at: Optional[int] = None) -> int:
    """Bytes of tensor storage reachable through dicts/lists/tuples (what torch.save would write);
    with ``stop_at``, counting ends once that many are found (enough to choose how to save). A
    wrapper subclass (``DTensor``: a rank's shard in a per-rank file) has no storage of its own;
    its inner tensors (the local shard) are what torch.save writes."""
    seen: set = set()
    total = 0
    pending = [(obj, 0)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value):
            pending.extend((getattr(value, name), depth) for name in value.__tensor_flatten__()[0])
        elif isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            key = (storage.data_ptr(), storage.device)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
                if stop_at is not None and total >= stop_at:
                    return total
        elif depth <= 8:
            values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
            pending.extend((v, depth + 1) for v in values if isinstance(v, _CONTAINERS))  # skip scalars fast
    return total


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

    def render(self, obj: Any, format: str, metadata: Optional[dict[str, str]]) -> bytes:
        """The file's bytes, now: for a small file, cheaper than a snapshot buffer's round trip (and a
        small ``torch.save`` file is simply what ``torch.save`` writes)."""
        if format == "torch":
            return plain_image(obj).pieces[0][1]
        image = self.image(obj, format, metadata)
        target = bytearray(image.size)
        stage_image(image, torch.frombuffer(target, dtype=torch.uint8), self.threads)
        return bytes(target)

    def stage(self, image: FileImage, slot: Slot) -> CopyInProgress:
        """Copy ``image`` into ``slot`` (complete on return); the framing of a torch file is
        written only when the buffer's last file had another structure."""
        in_place = image.framing is not None and slot.framing is image.framing
        slot.framing = None  # until this copy is complete
        stage_image(image, slot.buffer.bytes, self.threads, framing_in_place=in_place)
        slot.framing = image.framing
        return CopyInProgress(None, [])
