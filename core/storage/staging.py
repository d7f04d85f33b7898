"""Where a checkpoint's files go until it is published, and publishing it: written once over the
storage primitives, for every store.

More: docs/MODULES.md, core/storage/staging.py.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

from asyncckpt.core.errors import CheckpointWriteError
from asyncckpt.core.formats import commit_record
from asyncckpt.core.formats import names
from asyncckpt.core.storage import commit
from asyncckpt.core.storage.backend import Backend, at_once, backend_for, join
from asyncckpt.core.storage.contents import published_files
from asyncckpt.core.storage.object_store import ObjectStoreOptions


def staging_dir_for(final_path: str, save_id: str) -> str:
    """Where a sharded save of ``final_path`` writes its files until it is published: a hidden
    sibling, or (an object store: nothing to rename) the final prefix itself."""
    return final_path if backend_for(final_path).remote else names.staging_dir_for(final_path, save_id)


def publish_checkpoint(backend: Backend, staging_dir: str, final_path: str, record: dict) -> Optional[str]:
    """Coordinator: make the checkpoint written in ``staging_dir`` visible under ``final_path``
    with its commit record (``record`` and every file and size it holds, those in subdirectories
    by their relative paths; a ``files`` of ``record``'s own wins), then drop the writers' owner
    markers (until then they tell any cleaner that the staging is in use). Returns where a
    checkpoint it replaced now is, for ``Backend.remove_tree`` once the commit is reported."""
    files, coordination = published_files(backend, staging_dir, descend="files" not in record)
    try:
        replaced = backend.publish(staging_dir, final_path, commit_record.encode({"files": files, **record}))
    except FileExistsError:
        raise CheckpointWriteError(f"{final_path} was committed by another save meanwhile (another job writing the "
                                   "same checkpoint?); this save is not published") from None
    backend.delete([join(final_path, name) for name in coordination if names.OWNER_MARKER_PATTERN.match(name)],
                   durable=False)
    return replaced


def remove_coordination_files(directory: str) -> None:
    """What the ranks met by (file barrier, files records, owner markers), once nobody needs it any more."""
    for entry in os.listdir(directory):
        if names.COORDINATION_FILE_PATTERN.match(entry):
            os.unlink(os.path.join(directory, entry))


@dataclass
class Staging:
    """Where the files of one sharded save go (``directory``), and how the save becomes visible
    under ``final_path``. ``coordinator``: the rank that publishes it."""

    directory: str
    final_path: str
    options: Optional[ObjectStoreOptions] = None  # for a URL
    coordinator: bool = False
    direct_io: bool = True
    io_threads: int = 2

    @property
    def backend(self) -> Backend:
        return backend_for(self.directory, self.options)

    def claim(self, rank: int, token: str) -> None:
        """This rank's writer uses it now: its owner marker (creating the directory), so that no
        cleaner takes it for a leftover. Written in place (an object store), an older checkpoint
        there stops being one before anything of it changes."""
        if self.directory == self.final_path and self.coordinator:
            commit.uncommit(self.final_path, self.options)
        self.backend.write_marker(join(self.directory, names.owner_marker_name(rank)), f"{token}\n".encode(), append=True)

    def tidy_parent(self) -> Optional[str]:
        """The local directory whose dead writers' leftovers go after the reply (None in an object
        store: listing a bucket per save is not free; ``asyncckpt clean`` does)."""
        return None if self.backend.remote else os.path.dirname(self.directory)

    def write_image(self, name: str, image: memoryview, size: int,
                    wait_ready: Optional[Callable[[float], float]]) -> None:
        """Durably write ``image[:size]`` as ``name`` (see ``diskio.write_image``)."""
        self.backend.write(join(self.directory, name), image, size, wait_ready=wait_ready, direct_io=self.direct_io,
                           io_threads=self.io_threads)

    def write_bytes(self, name: str, data: bytes, *, atomic: bool = False) -> None:
        """Durably write small bytes as ``name``; ``atomic``: readers see all of it or nothing."""
        self.backend.write(join(self.directory, name), data, atomic=atomic)

    def publish(self, record: dict) -> Optional[str]:
        """Coordinator: make the checkpoint visible with its commit record (``publish_checkpoint``)."""
        return publish_checkpoint(self.backend, self.directory, self.final_path, record)

    def delete(self, replaced: str, token: str) -> None:
        """What a publish replaced, once the commit is reported."""
        self.backend.remove_tree(replaced, token, later=at_once)
