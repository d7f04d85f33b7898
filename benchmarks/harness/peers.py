"""The checkpointers asyncckpt is measured against, one function each: what a peer's row times.

Each row's call is named here and can be read on its own, without the timing around it. Lightning and
DCP's ``DefaultStager`` are imported inside their functions: a peer that cannot be imported fails its
own row only.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from .util import fsync_path
from .workloads import copy_into_state, flat_tensors


# ---------------------------------------------------------------------------------------- saves
def torch_save_fsync(sd: dict, path: str) -> None:
    """``torch.save`` into one file, then fsync: durable, as ours is when it returns."""
    with open(path, "wb") as f:
        torch.save(sd, f)
        f.flush()
        os.fsync(f.fileno())


def safetensors_save_fsync(flat: dict, path: str) -> None:
    """``safetensors.torch.save_file`` of the flattened tensors (it holds tensors only), then fsync."""
    save_file(flat, path)
    fsync_path(path)


def dcp_save(sd: dict, path: str, storage_writer: Any = None) -> None:
    """``dcp.save`` in one process (no_dist); ``storage_writer`` None is DCP's own FileSystemWriter."""
    dcp.save(sd, checkpoint_id=path, storage_writer=storage_writer, no_dist=True)


# ---------------------------------------------------------------------------------------- loads
# Each loads into ``target``, a preallocated state of the saved structure, as ``load_state_dict`` would.
def torch_load_into(target: dict, path: str) -> None:
    """``torch.load(weights_only=True)``, then a copy into ``target``'s tensors and its param_groups."""
    loaded = torch.load(path, weights_only=True)
    copy_into_state(target, flat_tensors(loaded))
    if "optim" in target:
        target["optim"]["param_groups"] = loaded["optim"]["param_groups"]


def safetensors_load_into(target: dict, path: str, saved: dict) -> None:
    """``safetensors.torch.load_file``, then a copy into ``target``'s tensors; the param_groups, which a
    safetensors file cannot hold, are taken from ``saved`` (the state that was saved)."""
    copy_into_state(target, load_file(path))
    if "optim" in target:
        target["optim"]["param_groups"] = saved["optim"]["param_groups"]


def dcp_load(target: dict, path: str) -> None:
    """``dcp.load`` in one process (no_dist) with DCP's own FileSystemReader, in place into ``target``."""
    dcp.load(target, checkpoint_id=path, no_dist=True)


# ---------------------------------------------------------------------------------------- async saves
# Each returns what the caller waits on: the section times the call (the stall), then the wait.
def dcp_async_save_thread(sd: dict, path: str):
    """``dcp.async_save`` THREAD mode, default stager (a deep copy in the caller), no_dist: a Future."""
    return dcp.async_save(sd, checkpoint_id=path, no_dist=True)


def dcp_async_save_process(sd: dict, path: str):
    """``dcp.async_save`` PROCESS mode, default stager; needs a process group: a Future."""
    return dcp.async_save(sd, checkpoint_id=path, async_checkpointer_type=AsyncCheckpointerType.PROCESS)


def shm_async_stager(pinned: bool = False):
    """A DCP ``DefaultStager`` staging into shared memory, asynchronously; reused across saves, then closed.
    ``pinned``: also pinned host memory and non-blocking copies (its configuration for GPU state)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=True, use_async_staging=True,
                                        use_non_blocking_copy=pinned))


def dcp_async_save_staged(sd: dict, path: str, stager, process: bool = False):
    """``dcp.async_save`` through ``stager``: a response whose ``staging_completion`` resolves when the snapshot
    is taken and ``upload_completion`` when the write is done. THREAD mode with no_dist; ``process``: PROCESS
    mode (the write in DCP's own background process; needs a process group)."""
    if process:
        return dcp.async_save(sd, checkpoint_id=path, async_stager=stager,
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    return dcp.async_save(sd, checkpoint_id=path, async_stager=stager, no_dist=True)


def lightning_async_io():
    """Lightning's ``AsyncCheckpointIO(TorchCheckpointIO())``: a clone in the caller, ``torch.save`` in a
    thread, no fsync. ``save_checkpoint(sd, path)`` starts a save; ``teardown()`` waits for the writes."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    return AsyncCheckpointIO(TorchCheckpointIO())


def lightning_async_io_signalling(sd: dict) -> tuple[Callable[[str], threading.Event], Any]:
    """The same, for a loop that computes while the write is in flight and must know when it is done,
    which ``AsyncCheckpointIO`` does not say per save: ``(start, io)``, where ``start(path)`` saves ``sd``
    and returns an event set once that save's ``torch.save`` has returned; ``io.teardown()`` waits."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    class SignallingCheckpointIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint, path, storage_options=None):
            super().save_checkpoint(checkpoint, path, storage_options)
            self.done_event.set()

    inner = SignallingCheckpointIO()
    io_ = AsyncCheckpointIO(inner)

    def start(path: str) -> threading.Event:
        inner.done_event = threading.Event()
        io_.save_checkpoint(sd, path)
        return inner.done_event

    return start, io_
