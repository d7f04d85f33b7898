"""``enable_async_checkpointing(accelerator)``: the whole ``Accelerator.save_state()`` becomes asynchronous.

Reads top to bottom as:

1. **What Accelerate calls.** The user keeps calling ``accelerator.save_state()`` / ``load_state()`` /
   ``end_training()``. We shadow those three on the *instance* (the class is untouched) and register
   Accelerate's save/load-state pre-hooks.
2. **What we snapshot.** ``save_state`` writes every file through two module globals of
   ``accelerate.checkpointing``: ``save`` (models, optimizers, schedulers, samplers, custom objects) and
   ``torch.save`` (RNG, GradScaler, stateful dataloaders). During our call both are swapped for capture
   functions that snapshot the object *now*: large states into the core's reused shared-memory buffers
   (``tx.save_file``), small ones serialised on the spot (``tx.write_bytes``). File names and formats
   are Accelerate's own, so ``load_state()`` reads them with or without the adapter.
3. **What we hand the core.** One ``DirectoryTransaction`` per save. Accelerate is pointed at the
   transaction's staging directory (automatic naming is turned off for the duration of the call; we do
   its naming, ``total_limit`` counting and "already exists" check ourselves, as Accelerate does). The
   staging directory lives *next to* ``checkpoints/``, never in it, and ``checkpoint_N`` appears under its
   final name only complete (commit record + atomic rename). ``total_limit`` deletions are queued behind
   the commit and skipped unless it succeeded.
4. **When we wait.** ``load_state()``, ``end_training()``, the next ``save_state()`` once ``max_in_flight``
   saves are pending, ``handle.wait()`` / ``remove()`` and interpreter exit; with ``overlap_optimizer``,
   every ``optimizer.step()`` waits for the optimizer snapshot left to the staging thread. A failed
   background save raises ``CheckpointWriteError`` naming its directory at the next ``save_state()`` (or
   ``wait()``).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import io
import logging
import os
import re
import shutil
import sys
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import accelerate.checkpointing as _acc_checkpointing
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from accelerate.utils.other import clean_state_dict_for_safetensors

from asyncckpt.core import Checkpointer, CheckpointWriteError
from asyncckpt.core.checkpointer import wait_before_every_step
from asyncckpt.core.errors import CheckpointError
from asyncckpt.core.storage import report_failure

logger = logging.getLogger("asyncckpt.accelerate")

_CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d+)$")
_ACCELERATE_NUMBER = re.compile(r"[\/]?([0-9]+)(?=[^\/]*$)")  # Accelerate's own sort key for checkpoints/
_OUR_STAGING = re.compile(r"^\.checkpoint_\d+\.asyncckpt-(staging|replaced)-[0-9a-zA-Z_-]+$")
_RNG_PREFIX = "random_states_"
# Distributed types in which every process holds a full replica of the model and optimizer state (DDP).
_REPLICATED = {getattr(DistributedType, n) for n in ("MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA",
                                                     "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON")
               if hasattr(DistributedType, n)}
_OPTIMIZER_FILE = re.compile(r"^optimizer(_\d+)?\.bin$")
_SPREADABLE_FILE = re.compile(r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|optimizer(_\d+)?\.bin)$")
_UNSET = object()
_enabled: "weakref.WeakKeyDictionary[Any, AsyncCheckpointing]" = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Options:
    """What ``enable_async_checkpointing(accelerator, **options)`` accepts.

    max_in_flight: saves whose background write may be pending at once; ``save_state()`` waits for the
        oldest beyond that. Each pending save holds one staging copy of the state in memory.
    timeout: bound (s) on every wait: the writer, other processes, the commit.
    direct_io / io_threads: passed to the core writer (O_DIRECT where possible; threads per process).
    spread_writes: under DDP (every process holds a replica), write the large files (``model*.safetensors``,
        ``optimizer*.bin``) from different processes instead of all from the main process.
    inline_bytes: files holding fewer tensor bytes than this are serialised at call time (no staging buffer).
    overlap_optimizer: take the snapshot of the optimizer files (``optimizer*.bin``: two thirds of an Adam
        checkpoint) on a background thread once ``save_state()`` has returned, while the next forward and
        backward run; every ``optimizer.step()`` first waits for it. Safe because a torch optimizer's state
        tensors change only in ``step()`` (``optimizer.state_dict()`` captured the parameter groups at the
        call). Off if your code changes them otherwise before the next step; never used with an optimizer
        that is not a ``torch.optim.Optimizer`` (no step hooks). Off by default: on CPU-only training
        (benchmarks/accelerate_bench.py, 2 cores) it cut the stall to ~0.5x a memcpy but the copy during the
        next step cost more than it saved (within-run slowdown +10-13% against +8-9%); where the state lives
        on a GPU and the CPU idles during forward/backward, turn it on.
    fix_iteration: the load hook restores ``project_configuration.iteration`` (accelerate #3306).
    cleanup_stale: remove staging directories left next to ``checkpoints/`` by a killed run (main process,
        when enabled).
    """

    max_in_flight: int = 1
    timeout: float = 600.0
    direct_io: bool = True
    io_threads: int = 2
    spread_writes: bool = True
    inline_bytes: int = 1 << 20
    overlap_optimizer: bool = False
    fix_iteration: bool = True
    cleanup_stale: bool = True


def enable_async_checkpointing(accelerator, **options: Any) -> "AsyncCheckpointing":
    """Make ``accelerator.save_state()`` asynchronous (see the module docstring); returns the handle
    (``.wait()``, ``.remove()``). Call it once, on every process, after creating the Accelerator."""
    if accelerator in _enabled:
        raise RuntimeError("asyncckpt: async checkpointing is already enabled on this Accelerator "
                           "(use the handle it returned; handle.remove() undoes it)")
    handle = AsyncCheckpointing(accelerator, Options(**options))
    _enabled[accelerator] = handle
    return handle


# ------------------------------------------------------------------------------------------ one save
@dataclass
class _Save:
    """One ``save_state()`` in flight: its transaction, its handles, the deletions queued behind it."""

    final_dir: str
    tx: Any
    removals: list = field(default_factory=list)
    handles: list = field(default_factory=list)  # file handles, then the commit handle
    commit: Any = None
    remove: Any = None
    reported: bool = False  # the failure already reached the user (save_state raised)
    deferred: list = field(default_factory=list)  # large objects, staged at the end of the call
    overlapped: list = field(default_factory=list)  # optimizer files, staged after the call (overlap_optimizer)
    written: list = field(default_factory=list)  # names this process staged

    def done(self) -> bool:
        return self.commit is not None and self.commit.done() and (self.remove is None or self.remove.done())


_CONTAINERS = (torch.Tensor, dict, list, tuple)


def _tensor_bytes(obj: Any, stop_at: Optional[int] = None) -> int:
    """Bytes of tensor storage reachable through dicts/lists/tuples (what torch.save would write);
    with ``stop_at``, counting ends once that many are found (enough to choose how to save)."""
    seen: set = set()
    total = 0
    pending = [(obj, 0)]
    while pending:
        value, depth = pending.pop()
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            key = (storage.data_ptr(), storage.device)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
                if stop_at is not None and total >= stop_at:
                    return total
        elif depth <= 8:
            values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
            pending.extend((v, depth + 1) for v in values if isinstance(v, _CONTAINERS))  # skip scalars fast
    return total


def _small(obj: Any, inline_bytes: int) -> bool:
    """Fewer tensor bytes than ``inline_bytes``: serialised at call time rather than staged."""
    return _tensor_bytes(obj, stop_at=inline_bytes) < inline_bytes


class _TorchWithCapturedSave:
    """Stands in for the ``torch`` module inside ``accelerate.checkpointing`` during a save: everything
    is torch's, except ``save``."""

    def __init__(self, real, save: Callable) -> None:
        self._real, self.save = real, save

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _Capture:
    """Turns the writes of one ``save_state()`` call into files of one transaction."""

    def __init__(self, owner: "AsyncCheckpointing", save: _Save) -> None:
        self.owner, self.save_record, self.tx = owner, save, save.tx
        self.state = PartialState()
        self.real_save = self.real_torch_save = None

    @contextlib.contextmanager
    def installed(self):
        real_save, real_torch = _acc_checkpointing.save, _acc_checkpointing.torch
        self.real_save, self.real_torch_save = real_save, real_torch.save
        _acc_checkpointing.save = self.capture_save
        _acc_checkpointing.torch = _TorchWithCapturedSave(real_torch, self.capture_torch_save)
        self.owner._capture = self
        try:
            yield self
        finally:
            _acc_checkpointing.save, _acc_checkpointing.torch = real_save, real_torch
            self.owner._capture = None

    # ---- which process writes what
    def _name(self, f: Any) -> Optional[str]:
        """``f``'s name inside the staging directory, or None (then it is not ours to capture)."""
        if not isinstance(f, (str, os.PathLike)):
            return None
        path, root = os.path.abspath(os.fspath(f)), self.tx.staging_dir
        return os.path.relpath(path, root) if path.startswith(root + os.sep) else None

    def _writes_here(self, save_on_each_node: bool) -> bool:
        """Accelerate's own gating in ``accelerate.utils.other.save``."""
        if save_on_each_node:
            return self.state.is_local_main_process
        return self.state.is_main_process

    def _spreadable(self, name: str, save_on_each_node: bool) -> bool:
        return (self.owner.options.spread_writes and not save_on_each_node and self.state.num_processes > 1
                and self.state.distributed_type in _REPLICATED and _SPREADABLE_FILE.match(name) is not None)

    # ---- the two capture functions
    def capture_save(self, obj, f, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
        """Replaces ``accelerate.utils.other.save`` (as bound in ``accelerate.checkpointing``)."""
        name = self._name(f)
        if name is None:
            return self.real_save(obj, f, save_on_each_node=save_on_each_node, safe_serialization=safe_serialization)
        fmt = "safetensors" if safe_serialization else "torch"
        if self._spreadable(name, save_on_each_node):
            size = _tensor_bytes(obj)
            if size >= self.owner.options.inline_bytes:
                self.save_record.deferred.append((name, obj, fmt, size))  # assigned to a process at the end
                return
        if self._writes_here(save_on_each_node):
            self.stage(name, obj, fmt)

    def capture_torch_save(self, obj, f, *args, **kwargs) -> None:
        """Replaces ``torch.save`` inside ``accelerate.checkpointing`` (RNG, GradScaler, dataloader state)."""
        name = self._name(f)
        if name is None:
            return self.real_torch_save(obj, f, *args, **kwargs)
        if os.path.basename(name).startswith(_RNG_PREFIX):
            here = True  # per-process file: every process writes its own
        else:  # the same name on every process (scaler.pt, dl_state_dict.bin): once, like save()
            here = self._writes_here(self.owner.accelerator.project_configuration.save_on_each_node)
        if not here:
            return None
        if args or kwargs:  # unusual torch.save options: serialise exactly as asked, now
            buffer = io.BytesIO()
            self.real_torch_save(obj, buffer, *args, **kwargs)
            self.save_record.handles.append(self.tx.write_bytes(name, buffer.getvalue()))
            self.save_record.written.append(name)
            return None
        self.stage(name, obj, "torch")

    # ---- snapshot into the transaction
    def stage(self, name: str, obj: Any, fmt: str) -> None:
        """Snapshot ``obj`` as the file Accelerate would have written: now, or for an optimizer file
        with ``overlap_optimizer``, on the staging thread after the call."""
        if fmt == "torch" and _OPTIMIZER_FILE.match(name) and self.owner.may_overlap_optimizer() \
                and not _small(obj, self.owner.options.inline_bytes):
            self.save_record.overlapped.append((name, obj, fmt))
        else:
            self.save_record.handles.append(self.snapshot(name, obj, fmt))
        self.save_record.written.append(name)

    def snapshot(self, name: str, obj: Any, fmt: str):
        """Snapshot ``obj`` into the transaction as ``name``; returns the file's handle."""
        tx, inline = self.tx, self.owner.options.inline_bytes
        if fmt == "safetensors":
            if isinstance(obj, OrderedDict):
                obj = clean_state_dict_for_safetensors(obj)  # before the snapshot: tied weights stay one tensor
            if _small(obj, inline):
                from safetensors.torch import save as safetensors_bytes

                return tx.write_bytes(name, safetensors_bytes(obj, metadata={"format": "pt"}))
            return tx.save_file(obj, name, format="safetensors", metadata={"format": "pt"})
        if _small(obj, inline):
            buffer = io.BytesIO()
            self.real_torch_save(obj, buffer)  # the exact bytes torch.save writes: that is the snapshot
            return tx.write_bytes(name, buffer.getvalue())
        return tx.save_file(obj, name, format="torch")

    def stage_deferred(self) -> None:
        """Large replicated files (DDP): the largest first, each to the least-loaded process. Every process
        computes the same assignment from the same sizes, without communicating."""
        deferred = sorted(self.save_record.deferred, key=lambda item: -item[3])
        self.save_record.deferred = []
        load = [0] * self.state.num_processes
        for name, obj, fmt, size in deferred:
            writer = min(range(len(load)), key=lambda rank: (load[rank], rank))
            load[writer] += size
            if writer == self.state.process_index:
                self.stage(name, obj, fmt)


# ------------------------------------------------------------------------------------------ the handle
class AsyncCheckpointing:
    """Returned by ``enable_async_checkpointing``. ``wait()`` drains pending saves (raising the first
    failure); ``remove()`` drains and restores Accelerate's native behaviour."""

    def __init__(self, accelerator, options: Options) -> None:
        if options.max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.accelerator, self.options = accelerator, options
        # The core's own back-pressure counts files; we count whole saves (below), so it never binds.
        self._checkpointer = Checkpointer(max_in_flight=1 << 20, timeout=options.timeout,
                                           direct_io=options.direct_io, io_threads=options.io_threads)
        self._pending: list[_Save] = []
        self._deferred_errors: list[CheckpointWriteError] = []
        self._capture: Optional[_Capture] = None
        self._removed = False
        self._warned_sync = False
        self.last_written: list[str] = []  # files this process staged in its latest save_state()
        self._hooks = [accelerator.register_save_state_pre_hook(self._save_hook),
                       accelerator.register_load_state_pre_hook(self._load_hook)]
        self._overlap_running = False  # a save's optimizer snapshot and commit run on the staging thread
        if options.overlap_optimizer:
            self._hooks.append(wait_before_every_step(self._join_overlap))
        self._originals: dict[str, Callable] = {}
        self._previous: dict[str, Any] = {}
        for name, wrapper in (("save_state", self._save_state), ("load_state", self._load_state),
                              ("end_training", self._end_training)):
            original = getattr(accelerator, name)
            self._originals[name] = original
            self._previous[name] = accelerator.__dict__.get(name, _UNSET)
            setattr(accelerator, name, _shadow(wrapper, original))
        if options.cleanup_stale:
            self._remove_stale_staging()
        self._checkpointer.start()  # the writer starts now, not at the first save
        _live_handles.add(self)

    # ------------------------------------------------------------------ public
    @property
    def pending(self) -> list[str]:
        """Final directories of the saves not yet committed (or whose deletions are still queued)."""
        return [s.final_dir for s in self._pending if not s.done()]

    def wait(self) -> None:
        """Wait for every pending save (and its total_limit deletions); raise the first failure."""
        errors = self._deferred_errors
        self._deferred_errors = []
        while self._pending:
            error = self._settle(self._pending[0])
            if error is not None:
                errors.append(error)
        if errors:
            raise errors[0]
        self._checkpointer.wait()  # and the deletion of the checkpoints those saves replaced

    def remove(self) -> None:
        """Drain, then undo everything: hooks, the shadowed methods, the background writer."""
        if self._removed:
            return
        try:
            self.wait()
        finally:
            self._removed = True
            for hook in self._hooks:
                hook.remove()
            for name, previous in self._previous.items():
                if getattr(self.accelerator.__dict__.get(name), "__asyncckpt_owner__", None) is not self:
                    continue  # someone shadowed it again after us: leave theirs alone
                if previous is _UNSET:
                    del self.accelerator.__dict__[name]
                else:
                    setattr(self.accelerator, name, previous)
            _enabled.pop(self.accelerator, None)
            _live_handles.discard(self)
            try:
                self._checkpointer.close()
            except CheckpointError as e:  # already reported through wait()
                logger.debug("asyncckpt: close after remove(): %s", e)

    # ------------------------------------------------------------------ save_state
    def _save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs: Any):
        pc = self.accelerator.project_configuration
        self._join_overlap()
        self._raise_finished_failures()
        self._apply_back_pressure()
        automatic = pc.automatic_checkpoint_naming
        if automatic:
            final_dir, removals, staging_parent = self._automatic_target()
        elif output_dir is None:  # Accelerate raises its own error for this
            return self._originals["save_state"](output_dir, safe_serialization=safe_serialization, **kwargs)
        else:
            final_dir, removals, staging_parent = os.path.abspath(os.path.expanduser(os.fspath(output_dir))), [], None
            self._wait_for(final_dir)
            if not _replaceable(final_dir):
                return self._native_save(output_dir, safe_serialization, kwargs)
            os.makedirs(os.path.dirname(final_dir), exist_ok=True)

        # staged outside checkpoints/, where Accelerate counts every entry for total_limit
        tx = self._checkpointer.begin_directory(final_dir, step=pc.iteration if automatic else None,
                                                staging_parent=staging_parent)
        save = _Save(final_dir, tx, removals)
        capture = _Capture(self, save)
        try:
            with capture.installed():
                pc.automatic_checkpoint_naming = False  # we named the directory; Accelerate writes into staging
                try:
                    self._originals["save_state"](tx.staging_dir, safe_serialization=safe_serialization, **kwargs)
                finally:
                    pc.automatic_checkpoint_naming = automatic
            capture.stage_deferred()
        except BaseException as error:
            self._abandon(save, error)
            raise self._earlier_failure(error) from error
        self.last_written = sorted(save.written)
        self._pending.append(save)
        if save.overlapped:  # the optimizer snapshot, then the commit, while the next forward/backward runs
            self._overlap_running = True
            self._checkpointer.run_staged(functools.partial(self._finish_overlapped, save, capture))
        else:
            self._commit(save)
        return Path(final_dir)

    def _commit(self, save: _Save) -> None:
        """Publish once every file is durable; then (only if that worked) the total_limit deletions."""
        save.commit = save.tx.commit()
        save.handles.append(save.commit)
        if save.removals:
            save.remove = self._checkpointer.async_remove(save.removals, only_if_complete=save.final_dir)

    def _finish_overlapped(self, save: _Save, capture: "_Capture") -> None:
        """On the staging thread: the optimizer files' snapshots, then the commit. A failure fails the
        save on every process; it is raised, naming the directory, at the next sync point."""
        try:
            for name, obj, fmt in save.overlapped:
                save.handles.append(capture.snapshot(name, obj, fmt))
            save.overlapped = []
            self._commit(save)
        except BaseException as error:  # noqa: BLE001 - reported through the save's handles
            save.overlapped = []
            self._fail_everywhere(save, error)

    def may_overlap_optimizer(self) -> bool:
        """Whether optimizer files may be snapshot after the call: asked for, and every optimizer's
        step passes the step pre-hook (torch optimizers; Accelerate's wrapper calls the wrapped one's)."""
        return self.options.overlap_optimizer and all(
            isinstance(getattr(opt, "optimizer", opt), torch.optim.Optimizer) for opt in self.accelerator._optimizers)

    def _join_overlap(self) -> None:
        """Wait for a save's background optimizer snapshot and commit call (before anything else uses the
        checkpointer, and before the optimizer changes the state it copies)."""
        if self._overlap_running:
            self._checkpointer.wait_staged()
            self._overlap_running = False

    def _automatic_target(self) -> tuple[str, list, Optional[str]]:
        """What Accelerate's save_state does with automatic naming, with in-flight saves counted as
        present and queued deletions as gone: the ``total_limit`` victims (main process) and the name."""
        acc, pc = self.accelerator, self.accelerator.project_configuration
        root = os.path.abspath(os.path.join(acc.project_dir, "checkpoints"))
        os.makedirs(root, exist_ok=True)
        queued = {path for s in self._pending for path in s.removals if not (s.remove and s.remove.done())}
        in_flight = [s.final_dir for s in self._pending if os.path.dirname(s.final_dir) == root]
        entries = [os.path.join(root, name) for name in os.listdir(root)]
        entries = [p for p in entries if p not in queued] + [d for d in in_flight if d not in entries]
        removals = []
        if pc.total_limit is not None and len(entries) + 1 > pc.total_limit and acc.is_main_process:
            numbered = sorted((int(m[0]), p) for p in entries if (m := _ACCELERATE_NUMBER.findall(p)))
            removals = [p for _, p in numbered[: len(entries) + 1 - pc.total_limit]]
            logger.info("asyncckpt: deleting %s once checkpoint_%d is committed (total_limit=%d)",
                        [os.path.basename(p) for p in removals], pc.iteration, pc.total_limit)
        final_dir = os.path.join(root, f"checkpoint_{pc.iteration}")
        if os.path.exists(final_dir) or final_dir in in_flight:
            raise ValueError(f"Checkpoint directory {final_dir} ({pc.iteration}) already exists. Please manually "
                             "override `self.save_iteration` with what iteration to start with.")
        acc.wait_for_everyone()
        parent = os.path.dirname(root)
        same_fs = os.stat(parent).st_dev == os.stat(root).st_dev
        return final_dir, removals, parent if same_fs else None

    def _native_save(self, output_dir, safe_serialization: bool, kwargs: dict):
        """``output_dir`` already holds something that is not an asyncckpt checkpoint (e.g. the user's own
        files): replacing it as a whole could lose them, so this save is Accelerate's own, synchronous."""
        if not self._warned_sync:
            self._warned_sync = True
            logger.warning("asyncckpt: %s already exists and is not an asyncckpt checkpoint; saving into it "
                           "synchronously (Accelerate's own save_state)", output_dir)
        self.wait()
        return self._originals["save_state"](output_dir, safe_serialization=safe_serialization, **kwargs)

    def _abandon(self, save: _Save, error: BaseException) -> None:
        """save_state raised half-way (a hook, a pickling error...): fail the save everywhere; the caller
        raises the error itself."""
        save.deferred = []
        save.reported = True
        if self._fail_everywhere(save, error):
            self._pending.append(save)

    def _fail_everywhere(self, save: _Save, error: BaseException) -> bool:
        """Tell every process's writer that this save failed, so nothing is published and no process
        waits for it until the timeout. False if the writer itself is gone."""
        try:
            report_failure(save.tx._commit_request, error)
            save.commit = save.tx.commit()
            save.handles.append(save.commit)
            return True
        except Exception as e:  # the writer itself is gone: nothing more to tell it
            logger.debug("asyncckpt: could not abandon %s: %s", save.final_dir, e)
            return False

    def _earlier_failure(self, error: BaseException) -> BaseException:
        """A core error raised inside save_state may be an *earlier* save's failure: name its directory."""
        if isinstance(error, CheckpointError):
            for save in list(self._pending):
                if save.done() and not save.reported:
                    failure = self._settle(save)
                    if failure is not None:
                        return failure
        return error

    # ------------------------------------------------------------------ waiting
    def _settle(self, save: _Save) -> Optional[CheckpointWriteError]:
        """Wait for one save; return its failure (naming the directory), None if it was committed."""
        self._join_overlap()
        errors = []
        for handle in save.handles:
            try:
                handle.result()
            except CheckpointError as e:
                errors.append(e)
        if save.remove is not None:
            try:
                save.remove.result()
            except CheckpointError as e:
                logger.warning("asyncckpt: deleting old checkpoints %s after %s failed: %s",
                               save.removals, save.final_dir, e)
        if save in self._pending:
            self._pending.remove(save)
        try:  # forget what we just consumed (core: wait()/close() would re-raise it)
            self._checkpointer._raise_unreported()
        except CheckpointError:
            pass  # another save's failure: we hold its handles and report it when we settle that save
        if not errors or save.reported:
            return None
        causes = "; ".join(dict.fromkeys(str(e) for e in errors))
        return CheckpointWriteError(f"asyncckpt: background save of checkpoint directory {save.final_dir} failed; "
                                    f"it was not published (older checkpoints are kept): {causes}")

    def _raise_finished_failures(self) -> None:
        errors, self._deferred_errors = self._deferred_errors, []
        for save in [s for s in self._pending if s.done()]:
            error = self._settle(save)
            if error is not None:
                errors.append(error)
        if errors:
            raise errors[0]

    def _apply_back_pressure(self) -> None:
        while len(self._pending) >= self.options.max_in_flight:
            error = self._settle(self._pending[0])
            if error is not None:
                raise error

    def _wait_for(self, final_dir: str) -> None:
        for save in [s for s in self._pending if s.final_dir == final_dir]:
            error = self._settle(save)
            if error is not None:
                raise error

    def _drain_deferring_errors(self) -> None:
        """Wait for everything; keep failures for the next save_state() / wait()."""
        while self._pending:
            error = self._settle(self._pending[0])
            if error is not None:
                logger.error("%s", error)
                self._deferred_errors.append(error)

    # ------------------------------------------------------------------ load_state, end_training, hooks
    def _load_state(self, input_dir: Optional[str] = None, load_kwargs: Optional[dict] = None, **kwargs: Any):
        # Before Accelerate picks the newest checkpoint_N: this process's saves, also through other
        # Accelerators (a new run in the same process), must be visible and complete.
        for handle in [self, *(h for h in list(_live_handles) if h is not self)]:
            handle._drain_deferring_errors()
        return self._originals["load_state"](input_dir, load_kwargs, **kwargs)

    def _end_training(self, *args: Any, **kwargs: Any):
        try:
            self.wait()
        finally:
            self._originals["end_training"](*args, **kwargs)

    def _save_hook(self, models: list, weights: list, output_dir: str) -> None:
        """Inside our save_state: nothing to do (``output_dir`` is the staging directory, so files a
        user's hook writes there are committed with the rest). Called any other way (e.g. through the
        class), the save is native and synchronous: order it behind our pending saves and deletions."""
        if self._capture is None:
            self._drain_deferring_errors()

    def _load_hook(self, models: list, input_dir: str) -> None:
        """Sync point, and the fix for accelerate #3306: ``load_state`` does not restore
        ``project_configuration.iteration``, so a resumed run would count from 0 again, delete newer
        checkpoints under total_limit and then fail with "already exists". Set it past the loaded
        checkpoint and every existing ``checkpoint_N``; a value the user set by hand that is higher
        is kept (and the usual ``iteration = N + 1`` after load_state agrees with ours)."""
        self._drain_deferring_errors()
        acc, pc = self.accelerator, self.accelerator.project_configuration
        if not (self.options.fix_iteration and pc.automatic_checkpoint_naming and acc.project_dir):
            return
        root = os.path.abspath(os.path.join(acc.project_dir, "checkpoints"))
        names = os.listdir(root) if os.path.isdir(root) else []
        loaded = os.path.abspath(input_dir)
        if os.path.dirname(loaded) == root:
            names.append(os.path.basename(loaded))
        numbers = [int(m[1]) for m in map(_CHECKPOINT_NAME.match, names) if m]
        if numbers and pc.iteration <= max(numbers):
            pc.iteration = max(numbers) + 1

    def _remove_stale_staging(self) -> None:
        """Staging directories of saves that never committed (the process was killed): never visible as
        checkpoints, only wasted space. Removed by the main process when the adapter is enabled."""
        acc = self.accelerator
        project_dir = acc.project_dir
        if acc.is_main_process and project_dir and os.path.isdir(project_dir):
            for name in os.listdir(project_dir):
                if _OUR_STAGING.match(name):
                    shutil.rmtree(os.path.join(project_dir, name), ignore_errors=True)
        if acc.num_processes > 1:
            acc.wait_for_everyone()


def _shadow(method: Callable, original: Callable) -> Callable:
    """A plain function standing in for ``original`` on the instance (keeps its name and docstring)."""

    @functools.wraps(original)
    def shadow(*args: Any, **kwargs: Any):
        return method(*args, **kwargs)

    shadow.__asyncckpt_owner__ = method.__self__
    return shadow


def _replaceable(final_dir: str) -> bool:
    """Can a save to an explicit ``output_dir`` publish by replacing what is there? Yes if nothing is
    there, an empty directory, or one of our committed checkpoints."""
    from asyncckpt.core import is_complete

    if not os.path.lexists(final_dir):
        return True
    if os.path.isdir(final_dir) and not os.path.islink(final_dir):
        return not os.listdir(final_dir) or is_complete(final_dir)
    return False


_live_handles: "weakref.WeakSet[AsyncCheckpointing]" = weakref.WeakSet()


@atexit.register
def _drain_at_exit() -> None:
    """Registered after the core's exit drain, so it runs first: report failures by directory."""
    for handle in list(_live_handles):
        try:
            handle.wait()
        except BaseException as e:
            print(f"asyncckpt: {e}", file=sys.stderr)
