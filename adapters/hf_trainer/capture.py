"""Run the Trainer's own save code, but hand its files to a checkpoint transaction.

The Trainer's save methods (``save_model`` → ``save_pretrained`` / safetensors,
``_save_optimizer_and_scheduler``, ``_save_scaler``, ``_save_rng_state``) are called unchanged with
a private scratch directory as their output directory. While they run, the functions they write
data files with are replaced (``asyncckpt.core.integration.patching.patched``) by versions that, for a
path inside that scratch directory, give the object to the transaction instead: the core
snapshots it before returning and writes it in the background.

* ``torch.save``                                 → ``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``,
                                                    ``scaler.pt``, ``training_args.bin``
* ``safetensors.torch.save_file``                → ``model.safetensors`` of a plain ``nn.Module``
* ``transformers.modeling_utils.safe_save_file`` → ``model.safetensors`` / its shards (``save_pretrained``)
* ``peft.peft_model.safe_save_file``             → ``adapter_model.safetensors`` of a PEFT model (when peft is loaded)
* ``torch.distributed.checkpoint.save``          → FSDP's sharded ``pytorch_model_fsdp_0/``, ``optimizer_0/``
                                                    (``asyncckpt.core.integration.dcp_capture``)

Everything else the Trainer writes (``config.json``, the shard index, tokenizer files,
``trainer_state.json``; and any call we do not recognise, e.g. ``torch.save`` with extra options)
lands in the scratch directory as usual; it is small, and is handed to the transaction as bytes
when the block ends. Paths outside the scratch directory and file objects pass through untouched.

A Trainer subclass's own ``_save_checkpoint`` writes into the checkpoint folder itself (``checkpoint-N``,
by its final name): ``capture_into(tx, folder=...)`` captures those writes the same way, with that
folder standing in for the scratch directory (``saver.py``). Nested inside it, the Trainer's own
capture passes the paths that are not its own on to the outer one.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
from typing import Any, Callable, Iterator, Optional

import safetensors.torch
import torch
import transformers.modeling_utils as modeling_utils

from asyncckpt.core.integration import patching
from asyncckpt.core.integration import checksum
from asyncckpt.core.integration.dcp_capture import capturing_dcp_saves

# one save's captures at a time in a process (the Trainer saves from its main thread); reentrant: a subclass's
# capture of the checkpoint folder holds it while the Trainer's own capture runs inside
_lock = threading.RLock()


def _scratch_root() -> Optional[str]:
    """Memory-backed when available: the scratch files are read back a moment later."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


class Capture:
    """The scratch directory, and the files of it deferred for later (``defer(name)``)."""

    def __init__(self, tx: Any, scratch: str, defer: Optional[Callable[[str], bool]], collect: bool = True) -> None:
        self.tx, self.scratch, self.defer, self.collect = tx, scratch, defer, collect
        self.deferred: list[tuple] = []  # (obj, name, format, metadata): the caller snapshots them later
        self.written: list[str] = []  # names given to the transaction (or deferred), in order
        self.handed: dict[str, str] = {}  # name -> checksum of the content handed over (a file may be rewritten)

    def relative(self, target: Any) -> Optional[str]:
        if not isinstance(target, (str, os.PathLike)):
            return None
        path = os.path.realpath(os.fspath(target))
        return os.path.relpath(path, self.scratch) if path.startswith(self.scratch + os.sep) else None

    def save_file(self, obj: Any, name: str, format: str, metadata: Optional[dict] = None) -> None:
        self.written.append(name)
        if self.defer is not None and self.defer(name):
            self.deferred.append((obj, name, format, metadata))
        else:
            self.tx.save_file(obj, name, format=format, metadata=metadata)

    def torch_save(self, original: Callable) -> Callable:
        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            name = self.relative(f)
            if name is None or args or kwargs:  # not ours, or options we do not reproduce: written as usual
                return original(obj, f, *args, **kwargs)
            self.save_file(obj, name, "torch")
            return None

        return save

    def safetensors_save(self, original: Callable) -> Callable:
        def save_file(tensors: Any, filename: Any, metadata: Optional[dict] = None, *args: Any, **kwargs: Any) -> Any:
            name = self.relative(filename)
            if name is None or args or kwargs:
                return original(tensors, filename, metadata, *args, **kwargs)
            self.save_file(tensors, name, "safetensors", metadata)
            return None

        return save_file

    def hand_over_scratch(self) -> None:
        """Give the files written synchronously into the scratch directory to the transaction: those
        new or changed since the last call (with ``collect``; a folder that does not exist has none)."""
        if not self.collect:
            return
        for directory, _subdirs, files in os.walk(self.scratch):
            for file_name in sorted(files):
                path = os.path.join(directory, file_name)
                name = os.path.relpath(path, self.scratch)
                with open(path, "rb") as f:
                    data = f.read()
                digest = checksum(data)
                if self.handed.get(name) != digest:
                    self.tx.write_bytes(name, data)
                    self.handed[name] = digest
                    self.written.append(name)


def _safetensors_savers() -> list[tuple[Any, str]]:
    """The names safetensors files are written through: (module, attribute); PEFT's once it is loaded."""
    savers = [(safetensors.torch, "save_file"), (modeling_utils, "safe_save_file")]
    peft_model = sys.modules.get("peft.peft_model")
    if peft_model is not None:
        savers.append((peft_model, "safe_save_file"))
    return savers


@contextlib.contextmanager
def _log_lines_naming(scratch: str, final: str) -> Iterator[None]:
    """Log lines name the checkpoint folder, not the scratch directory ("Saving model checkpoint to ...")."""
    make_record = logging.getLogRecordFactory()

    def naming(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        if isinstance(record.msg, str):
            record.msg = record.msg.replace(scratch, final)
        return record

    logging.setLogRecordFactory(naming)
    try:
        yield
    finally:
        logging.setLogRecordFactory(make_record)


@contextlib.contextmanager
def capture_into(tx: Any, defer: Optional[Callable[[str], bool]] = None, folder: Optional[str] = None,
                 collect: bool = True) -> Iterator[Capture]:
    """``with capture_into(tx) as cap:`` call the Trainer's save methods with ``cap.scratch``.

    With ``folder``, that directory (which need not exist yet) is the scratch directory instead of a
    temporary one. ``collect=False``: files written into it by other
    means are not handed over (a process that does not save, whose folder is another process's)."""
    with contextlib.ExitStack() as stack:
        scratch = folder or stack.enter_context(tempfile.TemporaryDirectory(prefix="asyncckpt-hf-", dir=_scratch_root()))
        cap = Capture(tx, os.path.realpath(scratch), defer, collect)
        stack.enter_context(_lock)
        stack.enter_context(_log_lines_naming(cap.scratch, tx.final_dir))
        stack.enter_context(patching.patched(torch, "save", cap.torch_save(torch.save)))
        for module, name in _safetensors_savers():
            stack.enter_context(patching.patched(module, name, cap.safetensors_save(getattr(module, name))))
        stack.enter_context(capturing_dcp_saves(tx, root=cap.scratch))
        yield cap
        cap.hand_over_scratch()
