"""``AsyncCkptIO``: a Lightning ``CheckpointIO`` whose saves return after a snapshot.

What Lightning calls → what we snapshot → what we hand the core → when we wait:

* ``save_checkpoint(checkpoint, path)`` (global rank 0; single device, DDP, FSDP "full"):
  ``Checkpointer.async_save_file(checkpoint, path, format="torch")`` takes the snapshot (the
  pickled structure and every tensor's bytes, copied into a reused shared-memory buffer laid out
  as ``torch.save``'s file) and returns; the core's writer process writes it to a temporary name,
  fsyncs and renames it. ``hpc_ckpt_*`` saves and saves made while an exception is being handled
  (``OnExceptionCheckpoint``, ``ModelCheckpoint(save_on_exception=True)``) wait for the write.
* ``remove_checkpoint(path)``: ``Checkpointer.async_remove([path])``, which runs after every save
  queued before it (top-k rotation never deletes, or races with, a checkpoint still being written).
* ``load_checkpoint(path)``: waits for every pending write (and link), then loads exactly like
  ``TorchCheckpointIO``.
* ``teardown()``: drains, frees the buffers and the writer, and raises a failed save.
* FSDP ``state_dict_type="sharded"`` / ``ModelParallelStrategy`` sharded saves, the ``-v1``
  version counter and ``save_last="link"`` are handled by the integration in ``_integration.py``.

A save that failed in the background raises at the next save (or remove, load, teardown) as
``AsyncCkptSaveError``, naming the path and the step.
"""
from __future__ import annotations

import fnmatch
import io
import os
import sys
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH

from asyncckpt.core import Checkpointer, CheckpointWriteError

from . import _integration

__all__ = ["AsyncCkptIO", "AsyncCkptSaveError"]


class AsyncCkptSaveError(CheckpointWriteError):
    """A checkpoint save (or removal) that ran in the background failed.

    Raised at the next save, remove, load or teardown after the failure; ``path`` and ``step``
    (Lightning's ``global_step`` at the time of the save) say which checkpoint is missing.
    """

    def __init__(self, message: str, path: str, step: Optional[int] = None, epoch: Optional[int] = None) -> None:
        super().__init__(message)
        self.path, self.step, self.epoch = path, step, epoch


class _Op:
    """One request handed to the core: a file save, a sharded save or a removal."""

    __slots__ = ("kind", "path", "handle", "step", "epoch")

    def __init__(self, kind: str, path: str, handle, step: Optional[int], epoch: Optional[int]) -> None:
        self.kind, self.path, self.handle, self.step, self.epoch = kind, path, handle, step, epoch

    def describe(self) -> str:
        what = {"save": "saving checkpoint", "sharded": "saving sharded checkpoint", "remove": "removing"}[self.kind]
        where = f" (epoch={self.epoch}, global_step={self.step})" if self.step is not None else ""
        return f"{what} {self.path}{where}"


class AsyncCkptIO(CheckpointIO):
    """Asynchronous, crash-safe checkpoints for Lightning: ``Trainer(plugins=[AsyncCkptIO()])``.

    Args:
        max_in_flight: saves whose write may be pending at once. Each holds one staging buffer the
            size of the checkpoint file (allocated on first need, then reused). A save beyond it
            waits for the oldest write. The default 2 lets ``ModelCheckpoint(save_last=True)``'s two
            back-to-back saves (top-k file + ``last.ckpt``) both return after their snapshot; with
            ``save_last="link"`` or without ``save_last`` one buffer is used.
        timeout: bound, in seconds, on every wait for the background writer.
        direct_io: write with O_DIRECT where the filesystem supports it.
        io_threads: parallel write threads in the background writer.
        sync_patterns: file-name patterns (``fnmatch``) saved synchronously; default the SLURM
            requeue checkpoint ``hpc_ckpt_*`` (the job is requeued right after that save returns).
        sync_on_exception: save synchronously while an exception is being handled (Lightning's
            on-exception checkpoints), because the process is about to go down.
    """

    def __init__(
        self,
        *,
        max_in_flight: int = 2,
        timeout: float = 600.0,
        direct_io: bool = True,
        io_threads: int = 2,
        sync_patterns: tuple[str, ...] = ("hpc_ckpt_*",),
        sync_on_exception: bool = True,
    ) -> None:
        super().__init__()
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight
        self.timeout = timeout
        self.direct_io = direct_io
        self.io_threads = io_threads
        self.sync_patterns = tuple(sync_patterns)
        self.sync_on_exception = sync_on_exception
        self._init_runtime()

    # ------------------------------------------------------------------ pickling (ddp_spawn)
    def _init_runtime(self) -> None:
        self._checkpointer: Optional[Checkpointer] = None
        self._ops: list[_Op] = []
        self._links: dict[str, tuple[Future, str]] = {}  # link path -> (pending link job, target)
        self._link_pool: Optional[ThreadPoolExecutor] = None
        self.stats = {"async_saves": 0, "sync_saves": 0, "sharded_saves": 0, "removes": 0, "links": 0,
                      "deferred_links": 0, "removes_behind_saves": 0, "drains": 0}
        _live.add(self)
        _integration.install()
        _register_exit_drain()

    def __getstate__(self) -> dict:
        state = {k: v for k, v in self.__dict__.items()
                 if k not in ("_checkpointer", "_ops", "_links", "_link_pool", "stats")}
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def __repr__(self) -> str:
        return (f"AsyncCkptIO(max_in_flight={self.max_in_flight}, direct_io={self.direct_io}, "
                f"io_threads={self.io_threads}, pending={len(self.pending())})")

    # ------------------------------------------------------------------ CheckpointIO API
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        """Snapshot ``checkpoint`` and return; the file appears at ``path`` complete, or not at all."""
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
                f" is not supported for `{self.__class__.__name__}`. Please implement your custom `CheckpointIO`"
                " to define how you'd like to use `storage_options`."
            )
        self.raise_failures()
        if not _is_local(path):  # fsspec URL: not ours to write; keep the order, then write as Lightning does
            self.wait()
            TorchCheckpointIO().save_checkpoint(checkpoint, path)
            self.stats["sync_saves"] += 1
            return
        path = os.path.abspath(os.fspath(path))
        if os.path.isdir(path) and not os.path.islink(path):
            raise IsADirectoryError(f"The checkpoint path exists and is a directory: {path}")
        self._settle_links_touching(path)
        step, epoch = _step_and_epoch(checkpoint)
        handle = self._call_core(lambda c: c.async_save_file(checkpoint, path, format="torch"), path, step, epoch)
        op = _Op("save", path, handle, step, epoch)
        self._ops.append(op)
        if self._must_be_synchronous(path):
            self.stats["sync_saves"] += 1
            self._settle(op)
        else:
            self.stats["async_saves"] += 1

    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Optional[Callable] = lambda storage, loc: storage,
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Wait for pending writes (on every rank under DDP), then load like ``TorchCheckpointIO``."""
        self._drain_everywhere()
        return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove ``path`` after every save queued before this call."""
        self.raise_failures()
        if not _is_local(path):
            self.wait()
            TorchCheckpointIO().remove_checkpoint(path)
            return
        path = os.path.abspath(os.fspath(path))
        self._settle_links_touching(path)
        self.stats["removes"] += 1
        if self._checkpointer is None:  # nothing was ever queued in this process: nothing to order behind
            _remove_now(path)
            return
        if self.pending():
            self.stats["removes_behind_saves"] += 1
        handle = self._call_core(lambda c: c.async_remove([path]), path, None, None)
        self._ops.append(_Op("remove", path, handle, None, None))

    def teardown(self) -> None:
        """Drain every pending save and raise a failed one (end of fit/validate/test/predict).

        The background writer and its staging buffers are kept for the next save of this process
        (a later ``fit`` or a manual ``trainer.save_checkpoint``); ``close()`` releases them, and
        they are released at exit."""
        self._drain_everywhere()

    def close(self) -> None:
        """Drain, raise a failed save, then stop the background writer and free the staging buffers."""
        try:
            self.wait()
        finally:
            self._close()

    # ------------------------------------------------------------------ public helpers
    def wait(self) -> None:
        """Block until every queued save, removal and link of this process is done; raise the first failure."""
        first: Optional[BaseException] = None
        for op in list(self._ops):
            try:
                self._settle(op)
            except BaseException as e:  # keep draining: later saves may still succeed
                first = first or e
        for linkpath in list(self._links):
            try:
                self._settle_link(linkpath)
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def pending(self) -> list[str]:
        """Paths with a save or removal not finished yet (in submission order)."""
        return [op.path for op in self._ops if not op.handle.done()]

    def raise_failures(self) -> None:
        """Raise (once) the first background save or removal that failed, naming path and step."""
        for op in list(self._ops):
            if op.handle.done():
                self._ops.remove(op)
                try:
                    op.handle.result(0)
                except BaseException as e:
                    raise self._failure(op, e) from e

    # ------------------------------------------------------------------ internals
    def _core(self) -> Checkpointer:
        if self._checkpointer is None:
            self._checkpointer = Checkpointer(max_in_flight=self.max_in_flight, timeout=self.timeout,
                                              direct_io=self.direct_io, io_threads=self.io_threads)
        return self._checkpointer

    def _call_core(self, submit: Callable[[Checkpointer], Any], path: str, step, epoch):
        """Run a core call; a failure the core raises there (an earlier save's, or this snapshot's) is
        re-raised naming the checkpoint it belongs to."""
        try:
            return submit(self._core())
        except CheckpointWriteError as e:
            for op in self._ops:
                if op.handle.done() and op.handle.exception() is e:
                    self._ops.remove(op)
                    try:
                        op.handle.result(0)  # marks it seen: the core will not raise it again
                    except BaseException:
                        pass
                    raise self._failure(op, e) from e
            raise self._failure(_Op("save", path, _DoneHandle(), step, epoch), e) from e

    def _failure(self, op: _Op, error: BaseException) -> AsyncCkptSaveError:
        if isinstance(error, AsyncCkptSaveError):
            return error
        return AsyncCkptSaveError(f"asyncckpt: {op.describe()} failed in the background: {error}",
                                  op.path, op.step, op.epoch)

    def _settle(self, op: _Op) -> None:
        """Wait for one request; raise its failure naming path and step."""
        try:
            op.handle.result()
        except BaseException as e:
            if op in self._ops:
                self._ops.remove(op)
            raise self._failure(op, e) from e
        if op in self._ops:
            self._ops.remove(op)

    def _must_be_synchronous(self, path: str) -> bool:
        name = os.path.basename(path)
        if any(fnmatch.fnmatch(name, pattern) for pattern in self.sync_patterns):
            return True
        return self.sync_on_exception and sys.exc_info()[1] is not None

    def _drain_everywhere(self) -> None:
        """Drain this rank; under torch.distributed also agree with the other ranks, so that (a) no
        rank reads a checkpoint rank 0 is still writing, and (b) a failure raises on every rank."""
        self.stats["drains"] += 1
        error: Optional[BaseException] = None
        try:
            self.wait()
        except BaseException as e:
            error = e
        failed_elsewhere = _any_rank(error is not None)
        if error is not None:
            raise error
        if failed_elsewhere:
            raise AsyncCkptSaveError("asyncckpt: a checkpoint save failed on another rank (see its error)", "")

    def _close(self) -> None:
        checkpointer, self._checkpointer = self._checkpointer, None
        pool, self._link_pool = self._link_pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if checkpointer is not None:
            checkpointer.close()  # failures already raised through our records are not raised again

    # ------------------------------------------------------------------ ordering helpers (integration)
    def virtually_exists(self, path: str) -> Optional[bool]:
        """Whether ``path`` will exist once the queue has run (None: no pending request for it).

        Used by ``ModelCheckpoint.file_exists`` so the ``-v1`` version counter sees a checkpoint
        that is still being written, exactly as it would see it without the plugin."""
        path = os.path.abspath(os.fspath(path))
        if path in self._links and not self._links[path][0].done():
            return True
        for op in reversed(self._ops):
            if op.path == path and not op.handle.done():
                return op.kind != "remove"
        return None

    def link(self, target: str, linkpath: str) -> None:
        """Point ``linkpath`` at ``target`` (relative symlink, replaced atomically) once the pending
        save of ``target`` is complete; the caller does not wait for it."""
        self.raise_failures()
        target, linkpath = os.path.abspath(target), os.path.abspath(linkpath)
        self._settle_links_touching(linkpath)
        for op in [op for op in self._ops if op.path == linkpath]:
            self._settle(op)  # a queued save/remove of the link's own name must land first
        if os.path.isdir(linkpath) and not os.path.islink(linkpath):
            _remove_now(linkpath)
        saving = [op for op in self._ops if op.path == target and op.kind != "remove" and not op.handle.done()]
        self.stats["links"] += 1
        if not saving:
            _atomic_symlink(target, linkpath)
            return
        self.stats["deferred_links"] += 1
        if self._link_pool is None:
            self._link_pool = ThreadPoolExecutor(1, thread_name_prefix="asyncckpt-link")
        self._links[linkpath] = (self._link_pool.submit(_link_when_saved, saving[-1].handle, target, linkpath), target)

    def _settle_link(self, linkpath: str) -> None:
        entry = self._links.pop(linkpath, None)
        if entry is not None:
            entry[0].result()

    def _settle_links_touching(self, path: str) -> None:
        for linkpath, (_, target) in list(self._links.items()):
            if path in (linkpath, target):
                try:
                    self._settle_link(linkpath)
                except BaseException:
                    self.raise_failures()  # the target's save failed: raise that, naming it
                    raise

    def settle_path(self, path: str) -> None:
        """Wait for every queued request and link touching ``path``."""
        path = os.path.abspath(os.fspath(path))
        self._settle_links_touching(path)
        for op in [op for op in self._ops if op.path == path]:
            self._settle(op)

    def save_sharded(self, strategy, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any],
                     model_key: str) -> None:
        """The sharded branch of ``FSDPStrategy`` / ``ModelParallelStrategy.save_checkpoint``, made
        asynchronous: every rank hands its shards to ``Checkpointer.async_save``; rank 0 adds
        Lightning's ``meta.pt`` as an extra file, so it lands in the directory before the commit
        (the directory appears under its final name complete, ``meta.pt`` included)."""
        if storage_options is not None:
            raise TypeError(
                f"`{type(strategy).__name__}.save_checkpoint(..., storage_options=...)` is not supported because"
                f" `{type(strategy).__name__}` does not use the `CheckpointIO`."
            )
        # a failure seen on any rank raises on every rank, before the next collective save
        error: Optional[BaseException] = None
        try:
            self.raise_failures()
        except BaseException as e:
            error = e
        if _any_rank(error is not None):
            if error is None:
                try:
                    self.wait()
                except BaseException as e:
                    error = e
            raise error or AsyncCkptSaveError("asyncckpt: a sharded checkpoint save failed on another rank", "")
        path = Path(strategy.broadcast(filepath)).absolute()
        self.settle_path(str(path))
        if strategy.global_rank == 0 and (path.is_file() or path.is_symlink()):
            path.unlink()
        converted = {model_key: checkpoint.pop("state_dict")}
        converted.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        extra = None
        if strategy.global_rank == 0:
            meta = io.BytesIO()
            torch.save(checkpoint, meta)  # what Lightning writes to meta.pt, taken now (a snapshot)
            extra = {"meta.pt": meta.getvalue()}
        step, epoch = _step_and_epoch(checkpoint)
        handle = self._call_core(lambda c: c.async_save(converted, str(path), step=step, extra_files=extra),
                                 str(path), step, epoch)
        op = _Op("sharded", str(path), handle, step, epoch)
        self._ops.append(op)
        if self._must_be_synchronous(str(path)):
            self.stats["sync_saves"] += 1
            self._settle(op)
        else:
            self.stats["sharded_saves"] += 1

    def drain_collectively(self) -> None:
        """Used before FSDP/ModelParallel loads: every rank drains, failures raise everywhere."""
        self._drain_everywhere()


class _DoneHandle:
    def done(self) -> bool:
        return True


# ---------------------------------------------------------------------- helpers
def _step_and_epoch(checkpoint: Any) -> tuple[Optional[int], Optional[int]]:
    if isinstance(checkpoint, dict):
        return checkpoint.get("global_step"), checkpoint.get("epoch")
    return None, None


def _is_local(path: _PATH) -> bool:
    return "://" not in str(os.fspath(path))


def _remove_now(path: str) -> None:
    import shutil

    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _atomic_symlink(target: str, linkpath: str) -> None:
    directory = os.path.dirname(linkpath)
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, f".{os.path.basename(linkpath)}.asyncckpt-link-{uuid.uuid4().hex[:8]}")
    os.symlink(os.path.relpath(target, directory), temporary)
    try:
        os.replace(temporary, linkpath)
    except BaseException:
        os.unlink(temporary)
        raise


def _link_when_saved(handle, target: str, linkpath: str) -> None:
    handle.result()  # a failed save raises here: no link to a missing file (the save's error is raised by the plugin)
    _atomic_symlink(target, linkpath)


def _any_rank(flag: bool) -> bool:
    """All-reduce ``flag`` (any) over the default group; also a barrier. No-op without torch.distributed,
    or while an exception is being handled (the other ranks may never arrive)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False
    if sys.exc_info()[1] is not None:
        return False
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


_live: "weakref.WeakSet[AsyncCkptIO]" = weakref.WeakSet()
_exit_drain_pid: Optional[int] = None
_drained_pid: Optional[int] = None


def _register_exit_drain() -> None:
    """Drain at exit: ``atexit`` (runs before the core's own exit drain, so failures are reported
    with their path and step), and a ``multiprocessing.util`` finalizer for ``multiprocessing``
    children (``ddp_spawn``), which skip ``atexit`` handlers."""
    global _exit_drain_pid
    if _exit_drain_pid == os.getpid():
        return
    _exit_drain_pid = os.getpid()
    import atexit
    from multiprocessing import util

    atexit.register(_drain_at_exit)
    util.Finalize(None, _drain_at_exit, exitpriority=100)


def _drain_at_exit() -> None:
    global _drained_pid
    if _drained_pid == os.getpid():
        return
    _drained_pid = os.getpid()
    for plugin in list(_live):
        try:
            plugin.wait()
        except BaseException as e:  # nothing to raise to at exit: report it
            print(f"asyncckpt: a checkpoint save failed during exit: {e}", file=sys.stderr)
        finally:
            try:
                plugin._close()
            except BaseException as e:
                print(f"asyncckpt: {e}", file=sys.stderr)
