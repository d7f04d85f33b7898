"""A framework's own save code, run unchanged, with the files it writes handed to a checkpoint transaction.

More: docs/MODULES.md, core/integration/capture.py.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from asyncckpt.core.formats.checksum import checksum
import asyncckpt.core.integration.patching as patching
from asyncckpt.core.integration.dcp_capture import capturing_dcp_saves
from asyncckpt.core.snapshot.file_snapshots import tensor_bytes
from asyncckpt.core.storage import owners
from asyncckpt.core import tier

# one capture at a time in a process (frameworks save from their main thread); reentrant: an outer capture (a
# Trainer subclass's own writes into its checkpoint folder) holds it while the framework's own runs inside
_lock = threading.RLock()

Saver = tuple[Any, str]  # (module, attribute): a function with safetensors' save_file signature


def path_in(root: str, target: Any) -> Optional[str]:
    """``target``'s name relative to ``root`` if it is a path under ``root``, else None (one rule for every
    capture: absolute paths, symbolic links not followed)."""
    if not isinstance(target, (str, os.PathLike)):
        return None
    path = os.path.abspath(os.fspath(target))
    return os.path.relpath(path, root) if path.startswith(root + os.sep) else None


class FileCapture:
    """The files a framework writes under ``root`` during one save, as files of ``tx``."""

    def __init__(self, tx: Any, root: str, *, defer: Optional[Callable[[str], bool]] = None, inline_bytes: int = 0,
                 collect: bool = False) -> None:
        self.tx, self.root = tx, os.path.abspath(root)
        self.defer, self.inline_bytes, self.collect = defer, inline_bytes, collect
        self.written: list[str] = []  # names given to the transaction (or deferred), in order
        self.deferred: list[tuple[Any, str, str, Optional[dict]]] = []  # snapshots left to stage_deferred
        self._handed: dict[str, str] = {}  # name -> checksum of the bytes handed over (a file may be rewritten)

    def name_of(self, target: Any) -> Optional[str]:
        return path_in(self.root, target)

    def about(self, error: OSError) -> bool:
        """Whether ``error`` names ``root`` or a path under it (the framework's code looked for a file there)."""
        return any(os.path.abspath(os.fspath(path)) == self.root or self.name_of(path) is not None
                   for path in (error.filename, error.filename2) if isinstance(path, (str, os.PathLike)))

    def save(self, obj: Any, name: str, format: str = "torch", metadata: Optional[dict] = None) -> None:
        """``obj`` as the file ``name``: snapshot now, or left to ``stage_deferred`` (``defer``, unless small)."""
        self.written.append(name)
        if self.defer is not None and self.defer(name) and not self._small(obj):
            self.deferred.append((obj, name, format, metadata))
        else:
            self._snapshot(obj, name, format, metadata)

    def stage_deferred(self) -> None:
        """The snapshots ``save`` left for later (on the snapshot thread, before the next optimizer step)."""
        deferred, self.deferred = self.deferred, []
        for obj, name, format, metadata in deferred:
            self._snapshot(obj, name, format, metadata)

    def _small(self, obj: Any) -> bool:
        return bool(self.inline_bytes) and tensor_bytes(obj, stop_at=self.inline_bytes) < self.inline_bytes

    def _snapshot(self, obj: Any, name: str, format: str, metadata: Optional[dict]) -> None:
        self.tx.save_file(obj, name, format=format, metadata=metadata, inline_below=self.inline_bytes)

    # ---- the replacements of the framework's writers
    def torch_save(self, original: Callable) -> Callable:
        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            name = self.name_of(f)
            if name is None or args or kwargs:  # not ours, or options we do not reproduce: written as usual
                return original(obj, f, *args, **kwargs)
            self.save(obj, name, "torch")
            return None

        return save

    def safetensors_save(self, original: Callable) -> Callable:
        def save_file(tensors: Any, filename: Any, metadata: Optional[dict] = None, *args: Any, **kwargs: Any) -> Any:
            name = self.name_of(filename)
            if name is None or args or kwargs:
                return original(tensors, filename, metadata, *args, **kwargs)
            self.save(tensors, name, "safetensors", metadata)
            return None

        return save_file

    def hand_over(self) -> None:
        """Give the files written into ``root`` by other means to the transaction as bytes: those new or changed
        since the last call (with ``collect``; a ``root`` that does not exist has none)."""
        if not self.collect:
            return
        for directory, _subdirs, files in os.walk(self.root):
            for file_name in sorted(files):
                path = os.path.join(directory, file_name)
                name = os.path.relpath(path, self.root)
                with open(path, "rb") as f:
                    data = f.read()
                digest = checksum(data)
                if self._handed.get(name) != digest:
                    self.tx.write_bytes(name, data)
                    self._handed[name] = digest
                    self.written.append(name)


@contextlib.contextmanager
def capturing(tx: Any, *, root: Optional[str] = None, safetensors_savers: Iterable[Saver] = (),
              defer: Optional[Callable[[str], bool]] = None, inline_bytes: int = 0,
              collect: bool = True) -> Iterator[FileCapture]:
    """``with capturing(tx) as capture:`` run the framework's save code with ``capture.root`` as its output.

    ``root``: the directory it writes into (which need not exist yet); default: a scratch directory of our
    own (in memory beside the memory root, ``/dev/shm`` by default: its files are read back a moment later;
    ``_scratch``), whose other files are handed over at the end (``collect``). ``torch.save`` and ``dcp.save`` are
    captured, safetensors files through ``safetensors_savers``."""
    with contextlib.ExitStack() as stack:
        if root is None:
            root = stack.enter_context(_scratch())
        capture = FileCapture(tx, root, defer=defer, inline_bytes=inline_bytes, collect=collect)
        stack.enter_context(_lock)
        stack.enter_context(_log_lines_naming(capture.root, tx.final_dir))
        stack.enter_context(patching.patched(torch, "save", capture.torch_save(torch.save)))
        for module, name in safetensors_savers:
            stack.enter_context(patching.patched(module, name, capture.safetensors_save(getattr(module, name))))
        stack.enter_context(capturing_dcp_saves(tx, root=capture.root))
        yield capture
        capture.hand_over()


@contextlib.contextmanager
def _scratch() -> Iterator[str]:
    """A capture's scratch folder, under ``tier.captures_dir`` (in the temporary directory where that cannot be
    made), named after this process: the one a save killed mid-capture leaves goes at the next capture on the node
    (and with ``asyncckpt clean --memory``); its own goes when the capture ends, and the folder above it with the
    node's last capture (as a cooperative load's node copies do)."""
    path = _own_folder(tier.captures_dir(tier.memory_root()))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):  # another process's capture is still there
            os.rmdir(os.path.dirname(path))


def _own_folder(captures: str) -> str:
    """This process's folder under ``captures``, made, once the folders of dead processes there are removed."""
    while True:
        try:
            os.makedirs(captures, exist_ok=True)
        except OSError:
            captures = os.path.join(tempfile.gettempdir(), os.path.basename(captures))
            os.makedirs(captures, exist_ok=True)
        for dead in tier.dead_captures(captures):
            shutil.rmtree(dead, ignore_errors=True)
        path = os.path.join(captures, owners.owner_token())
        try:
            os.mkdir(path, 0o700)
            return path
        except FileNotFoundError:  # the last capture of another process removed ``captures`` meanwhile: again
            continue


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
