"""Reading and writing ranks' sidecars (``formats.sidecar``) where a checkpoint lives.

Kept free of torch: the background writer reads the sidecars at the commit.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from asyncckpt.core.formats.checksum import FileChecksum
from asyncckpt.core.formats.names import files_record_name, sidecar_name
from asyncckpt.core.formats.sidecar import ShareRecord, Sidecar, encode_sidecar, parse_sidecar
from asyncckpt.core.storage.backend import backend_for, join, read_bytes
from asyncckpt.core.storage.fsio import atomic_write_bytes


def read_sidecar(directory: str, rank: int) -> Sidecar:
    """Parse and check the sidecar of ``rank`` under ``directory`` (a local directory or an
    object-store prefix). FileNotFoundError if absent."""
    path = join(directory, sidecar_name(rank))
    return parse_sidecar(path, read_bytes(backend_for(directory), path))


def read_rank_sidecar(directory: str, rank: int) -> dict:
    """The sidecar of ``rank`` as a version-1 document (a dict per item), whatever its version."""
    return read_sidecar(directory, rank).as_v1()


def write_rank_sidecar(directory: str, record: ShareRecord) -> None:
    """Durably publish one rank's sidecar in the local ``directory`` (tmp + fsync + rename): the
    rank's share is complete."""
    atomic_write_bytes(os.path.join(directory, sidecar_name(record.rank)), encode_sidecar(record))


# ------------------------------------------------------------------------------------- files records
def write_files_record(directory: str, rank: int, files: Mapping[str, FileChecksum],
                       holders: Optional[Mapping[str, Sequence[str]]] = None) -> str:
    """Leave in the staging ``directory`` the files ``rank`` wrote into a save, each with its size and xxh3 and,
    on several nodes (the memory tier), the nodes that hold it (``tier.nodes``): the commit gathers every
    rank's (``take_files_records``). Returns the record's name."""
    name = files_record_name(rank)
    with open(os.path.join(directory, name), "w") as f:  # not fsynced: it lives only until the commit gathers it
        json.dump({file: [checksum.size, checksum.xxh3, list(holders[file]) if holders is not None else None,
                          checksum.content_id] for file, checksum in files.items()}, f)
    return name


@dataclass(frozen=True)
class RecordedFile:
    """A file of a save, as its rank's files record left it: its checksum, the nodes that hold it (none recorded on
    one node), the rank that wrote it."""

    checksum: FileChecksum
    holders: tuple[str, ...]
    rank: int


def take_files_records(directory: str, world_size: int) -> dict[str, RecordedFile]:
    """Every rank's files record in the staging ``directory`` (``write_files_record``), which then go (they are
    the coordination of the writers, not the checkpoint's), by file name."""
    files: dict[str, RecordedFile] = {}
    for rank in range(world_size):
        path = os.path.join(directory, files_record_name(rank))
        with open(path) as f:
            for file, (size, xxh3, holders, content_id) in json.load(f).items():
                files[file] = RecordedFile(FileChecksum(size, xxh3, content_id), tuple(holders or ()), rank)
        os.unlink(path)
    return files
