"""Reading and writing ranks' sidecars (``formats.sidecar``) where a checkpoint lives.

Kept free of torch: the background writer reads the sidecars at the commit.
"""
from __future__ import annotations

import os

from asyncckpt.core.formats.names import sidecar_name
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
