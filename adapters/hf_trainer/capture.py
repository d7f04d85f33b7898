"""Run the Trainer's own save code, but hand its files to a checkpoint transaction.

The Trainer's save methods (``save_model`` → ``save_pretrained`` / ``safetensors``,
``_save_optimizer_and_scheduler``, ``_save_scaler``, ``_save_rng_state``) are called unchanged with
a private scratch directory as their output directory. While they run, the three functions they
write data files with are replaced by versions that, for a path inside that scratch directory,
give the object to the transaction instead: the core snapshots it before returning (tensor bytes
copied into a reused shared buffer, the structure pickled) and writes it in the background.

* ``torch.save``                                 → ``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``,
                                                    ``scaler.pt``, ``training_args.bin``
* ``safetensors.torch.save_file``                → ``model.safetensors`` of a plain ``nn.Module``
* ``transformers.modeling_utils.safe_save_file`` → ``model.safetensors`` / its shards (``save_pretrained``)

Everything else the Trainer writes (``config.json``, ``generation_config.json``, the shard index,
tokenizer files, ``trainer_state.json``; and any call we do not recognise, e.g. ``torch.save`` with
extra options) lands in the scratch directory as usual; it is small, and is handed to the
transaction as bytes when the block ends. Paths outside the scratch directory and file objects
are passed through untouched, so nothing else in the process is affected.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from typing import Any, Callable, Iterator, Optional

import safetensors.torch
import torch
import transformers.modeling_utils as modeling_utils

_lock = threading.Lock()


def _scratch_root() -> Optional[str]:
    """Memory-backed when available: the scratch files are read back a moment later."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


class Capture:
    """Collects the handles of everything given to the transaction (to report failures per folder)."""

    def __init__(self, tx, defer: Optional[Callable[[str], bool]] = None) -> None:
        self.tx = tx
        self.scratch = os.path.realpath(tempfile.mkdtemp(prefix="asyncckpt-hf-", dir=_scratch_root()))
        self.handles: list = []
        self.captured: list[str] = []
        self.defer = defer
        self.deferred: list[tuple] = []  # (obj, name, format, metadata): the caller snapshots them later

    def relative(self, target: Any) -> Optional[str]:
        if not isinstance(target, (str, os.PathLike)):
            return None
        path = os.path.realpath(os.fspath(target))
        if not path.startswith(self.scratch + os.sep):
            return None
        return os.path.relpath(path, self.scratch)

    def save_file(self, obj: Any, name: str, format: str, metadata: Optional[dict] = None) -> None:
        self.captured.append(name)
        if self.defer is not None and self.defer(name):
            self.deferred.append((obj, name, format, metadata))
        else:
            self.handles.append(self.tx.save_file(obj, name, format=format, metadata=metadata))

    def hand_over_scratch(self) -> None:
        """Give the files written synchronously into the scratch directory to the transaction."""
        for directory, _subdirs, files in os.walk(self.scratch):
            for file_name in sorted(files):
                path = os.path.join(directory, file_name)
                with open(path, "rb") as f:
                    data = f.read()
                self.handles.append(self.tx.write_bytes(os.path.relpath(path, self.scratch), data))

    def discard_scratch(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


@contextlib.contextmanager
def capture_into(tx, defer: Optional[Callable[[str], bool]] = None) -> Iterator[Capture]:
    """``with capture_into(tx) as cap:`` call the Trainer's save methods with ``cap.scratch``.

    Files whose name ``defer(name)`` accepts are not snapshot here but listed in ``cap.deferred``
    (live objects: the caller must snapshot them before anything changes them)."""
    cap = Capture(tx, defer)
    original_torch_save = torch.save
    original_st_save = safetensors.torch.save_file
    original_mu_save = modeling_utils.safe_save_file

    def torch_save(obj, f, *args, **kwargs):
        name = cap.relative(f)
        if name is None or args or kwargs:  # not ours, or options we do not reproduce: write it as usual
            return original_torch_save(obj, f, *args, **kwargs)
        cap.save_file(obj, name, "torch")

    def safetensors_save_file(tensors, filename, metadata=None, *args, **kwargs):
        name = cap.relative(filename)
        if name is None or args or kwargs:
            return original_st_save(tensors, filename, metadata, *args, **kwargs)
        cap.save_file(tensors, name, "safetensors", metadata)

    def modeling_save_file(tensors, filename, metadata=None, *args, **kwargs):
        name = cap.relative(filename)
        if name is None or args or kwargs:
            return original_mu_save(tensors, filename, metadata, *args, **kwargs)
        cap.save_file(tensors, name, "safetensors", metadata)

    with _lock:  # one capture at a time in a process (the Trainer saves from its main thread)
        torch.save = torch_save
        safetensors.torch.save_file = safetensors_save_file
        modeling_utils.safe_save_file = modeling_save_file
        try:
            yield cap
            cap.hand_over_scratch()
        finally:
            torch.save = original_torch_save
            safetensors.torch.save_file = original_st_save
            modeling_utils.safe_save_file = original_mu_save
            cap.discard_scratch()
