"""The background writer's requests for single files: write one atomically, delete files or checkpoints.

Plain data the writer unpickles; kept apart from ``native_files`` (which renders the files'
images from tensors, with torch) so that the writer does not import torch.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from . import commit, diskio
from .fsio import fsync_dir
from .layout import RankLayout
from .storage import report_failure


@dataclass
class FileRequest:
    """Write a staged single file atomically: temporary name, fsync, rename, fsync the directory."""

    path: str
    size: int
    direct_io: bool = True
    io_threads: int = 2
    on_failure: Any = None  # a directory transaction's commit request, told about a failure

    def run(self, layout: RankLayout, image: memoryview) -> None:
        directory, name = os.path.split(os.path.abspath(self.path))
        temporary = os.path.join(directory, f".{name}.asyncckpt-tmp-{uuid.uuid4().hex[:8]}")
        try:
            os.makedirs(directory, exist_ok=True)
            diskio.write_image(temporary, image, self.size, direct=self.direct_io, threads=self.io_threads)
            os.replace(temporary, self.path)
            fsync_dir(directory)
        except BaseException as e:
            if os.path.exists(temporary):
                os.unlink(temporary)
            if self.on_failure is not None:
                report_failure(self.on_failure, e)
            raise


@dataclass
class RemoveRequest:
    """Delete files / checkpoint directories, in queue order (after the saves queued before it)."""

    paths: list
    only_if_complete: Optional[str] = None

    def run(self, layout: Optional[RankLayout], image: Optional[memoryview]) -> None:
        if self.only_if_complete is not None:
            newer = self.only_if_complete  # a directory needs its commit record; a file only exists complete
            if not (commit.is_complete(newer) if os.path.isdir(newer) else os.path.isfile(newer)):
                return
        for path in self.paths:
            if os.path.isdir(path) and not os.path.islink(path):
                commit.remove_checkpoint(path)
            elif os.path.lexists(path):
                os.unlink(path)
