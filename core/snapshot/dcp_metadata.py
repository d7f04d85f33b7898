"""Writing DCP's ``.metadata`` from the training process (``loading.metadata_io`` reads it).

``.metadata`` stays the pickled ``torch.distributed.checkpoint.metadata.Metadata`` that torch's own
reader expects. Our own saves' ``.metadata`` is written by the background writer without torch
(``formats.dcp_pickle``), from what ``dcp_classes`` tells it about this torch; saves through DCP's API
(``api.dcp_writer``) write torch's object here. For a torch whose classes ``dcp_pickle`` cannot write,
the writer runs this module as a child process (``metadata_command``), which pickles torch's own objects.
"""
from __future__ import annotations

import functools
import io
import logging
import os
import pickle
import sys
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo

from asyncckpt.core.formats import dcp_pickle
from asyncckpt.core.formats.dcp_pickle import DCP_METADATA_FILE, DcpClasses
from asyncckpt.core.storage.fsio import atomic_write_bytes
from asyncckpt.core.storage.sidecar_io import read_sidecar

logger = logging.getLogger("asyncckpt.core")


def attributes(value: Any) -> Any:
    """``value`` with every object replaced by its type and attributes, recursively: dataclass
    equality compares declared fields only, this also sees attributes missing or extra."""
    if isinstance(value, dict):
        return {key: attributes(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value), [attributes(item) for item in value]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return type(value), attributes(vars(value))
    return value


@functools.lru_cache(maxsize=None)
def dcp_classes() -> Optional[DcpClasses]:
    """What the writer needs to know of this torch's DCP metadata classes to pickle them without
    torch (see ``dcp_pickle``), checked once per process: a small ``.metadata`` written that way
    must load as exactly what pickling the objects torch's own constructors build loads as. If
    it does not (a torch whose classes changed), None, with a warning: the writer then has a child
    process pickle torch's own objects (``metadata_command``)."""
    try:
        return _checked_dcp_classes()
    except Exception as e:  # noqa: BLE001 - any difference means: do not trust the fast path
        logger.warning("asyncckpt: writing DCP .metadata without torch does not work with torch %s (%s); the "
                       "background writer will have a process with torch pickle it (torch is imported for every save)",
                       torch.__version__, e)
        return None


def _checked_dcp_classes() -> DcpClasses:
    def state_of(obj: Any) -> tuple:
        return tuple(obj.__reduce_ex__(2)[2].items())

    classes = DcpClasses(
        metadata_state=state_of(dcp_metadata.Metadata(state_dict_metadata={})),
        storage_meta_state=state_of(dcp_metadata.StorageMeta()),
        storage_info_state=state_of(_StorageInfo("", 0, 0)),
        version=CURRENT_DCP_VERSION,
    )
    written = dcp_pickle.dumps(dcp_pickle.metadata(
        classes,
        state_dict_metadata={"w": dcp_pickle.tensor_entry("bfloat16", True, (4, 2), [((0, 0), (2, 2)), ((2, 0), (2, 2))]),
                             "o": dcp_pickle.bytes_entry()},
        planner_data={"w": ("w",), "o": ("o", 0)},
        storage_data=dcp_pickle.entries([
            (dcp_pickle.storage_index("w", (2, 0), 1), dcp_pickle.storage_info(classes, "__0_0.distcp", 512, 64)),
            (dcp_pickle.storage_index("o"), dcp_pickle.storage_info(classes, "__0_0.distcp", 4096, 70000)),
        ]),
        storage_meta=dcp_pickle.storage_meta(classes, "/ckpt", "s"),
    ))
    chunks = [dcp_metadata.ChunkStorageMetadata(torch.Size(o), torch.Size((2, 2))) for o in ((0, 0), (2, 0))]
    expected = dcp_metadata.Metadata(
        state_dict_metadata={
            "w": dcp_metadata.TensorStorageMetadata(dcp_metadata.TensorProperties(dtype=torch.bfloat16, requires_grad=True),
                                                    torch.Size((4, 2)), chunks),
            "o": dcp_metadata.BytesStorageMetadata()},
        planner_data={"w": ("w",), "o": ("o", 0)},
        storage_data={dcp_metadata.MetadataIndex("w", (2, 0), 1): _StorageInfo("__0_0.distcp", 512, 64),
                      dcp_metadata.MetadataIndex("o"): _StorageInfo("__0_0.distcp", 4096, 70000)},
        storage_meta=dcp_metadata.StorageMeta(checkpoint_id="/ckpt", save_id="s"),
        version=CURRENT_DCP_VERSION,
    )
    loaded = pickle.loads(written)
    if loaded != expected or attributes(loaded) != attributes(pickle.loads(pickle.dumps(expected))):
        raise RuntimeError(f"its pickle of a sample loads as {loaded!r}, expected {expected!r}")
    return classes


def metadata_pickled_by_torch(sidecars: list, checkpoint_id: str, save_id: str) -> bytes:
    """``.metadata`` built with torch's own constructors from every rank's sidecar, and pickled:
    the slower path, for a torch whose classes ``dcp_pickle`` cannot write (``dcp_classes``)."""
    entries: dict[str, Any] = {}
    storage: dict = {}
    planner_data: dict[str, Any] = {}
    for sidecar in sidecars:
        t = sidecar.tensors
        shapes = [torch.Size(shape) for shape in t.shapes]
        for fqn, offsets, sizes, global_size, dtype, requires_grad, file, start, length in zip(
            t.fqn, t.chunk_offsets, t.chunk_sizes, t.global_size, t.dtype, t.requires_grad, t.item_files(), t.start,
            t.length
        ):
            entry = entries.setdefault(fqn, dcp_metadata.TensorStorageMetadata(
                dcp_metadata.TensorProperties(dtype=getattr(torch, dtype), requires_grad=requires_grad),
                shapes[global_size], []))
            if any(chunk.offsets == shapes[offsets] for chunk in entry.chunks):
                continue  # a replicated chunk (written by one rank) is recorded once
            index = dcp_metadata.MetadataIndex(fqn, shapes[offsets], len(entry.chunks))
            entry.chunks.append(dcp_metadata.ChunkStorageMetadata(shapes[offsets], shapes[sizes]))
            storage[index] = _StorageInfo(file, start, length)
        o = sidecar.objects
        for fqn, file, start, length in zip(o.fqn, o.item_files(), o.start, o.length):
            if fqn not in entries:
                entries[fqn] = dcp_metadata.BytesStorageMetadata()
                storage[dcp_metadata.MetadataIndex(fqn)] = _StorageInfo(file, start, length)
        for fqn, path in sidecar.planner_data().items():
            planner_data.setdefault(fqn, tuple(path))
    return pickle.dumps(dcp_metadata.Metadata(
        state_dict_metadata=entries, planner_data=planner_data, storage_data=storage,
        storage_meta=dcp_metadata.StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id), version=CURRENT_DCP_VERSION))


def metadata_command() -> list[str]:
    """The command the writer runs to have ``.metadata`` pickled by this torch (``metadata_pickled_by_torch``)
    without importing torch itself; it appends the checkpoint's staging directory, the world size, the
    checkpoint id, the save id and the file the pickle is written to (``_main``)."""
    return [sys.executable, "-m", __name__]


def write_dcp_metadata(directory: str, metadata: dcp_metadata.Metadata, file_name: str = DCP_METADATA_FILE) -> None:
    buffer = io.BytesIO()
    pickle.dump(metadata, buffer)
    atomic_write_bytes(os.path.join(directory, file_name), buffer.getvalue())


def _main(argv: list[str]) -> int:
    directory, world_size, checkpoint_id, save_id, out = argv
    sidecars = [read_sidecar(directory, rank) for rank in range(int(world_size))]
    with open(out, "wb") as f:
        f.write(metadata_pickled_by_torch(sidecars, checkpoint_id, save_id))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
