"""The files of one ``save_state()`` call, captured as Accelerate writes them and snapshot into a transaction.

``save_state`` writes every file through two names in ``accelerate.checkpointing``: ``save`` (models,
optimizers, schedulers, samplers, custom objects) and ``torch.save`` (RNG, GradScaler, stateful
dataloaders); under FSDP, ``accelerate.utils.fsdp_utils`` writes sharded state with
``torch.distributed.checkpoint.save`` (or, with ``use_dcp=False``, one ``torch.save`` file per
process) and full state dicts with ``torch.save``. For the duration of
the call these are replaced (``asyncckpt.core.integration.patching.patched``, ``asyncckpt.core.integration.dcp_capture``)
by functions that, for a path inside the transaction's staging directory, snapshot the object now
(any other path is passed to the original): large states into the core's reused shared-memory
buffers (``tx.save_file``, ``tx.save_sharded``), small ones serialised on the spot
(``tx.write_bytes``). Which process writes what is Accelerate's own rule, except that under DDP the
large replicated files can be spread over the processes (``Options.spread_writes``).
"""
from __future__ import annotations

import contextlib
import io
import os
import re
from collections import OrderedDict
from typing import Any, Callable, Iterator, Optional

import accelerate.checkpointing as accelerate_checkpointing
import accelerate.utils.fsdp_utils as fsdp_utils
import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from accelerate.utils.other import clean_state_dict_for_safetensors

from asyncckpt.core.integration import patching
from asyncckpt.core.integration.dcp_capture import capturing_dcp_saves
from asyncckpt.core.integration import tensor_bytes

from .options import Options

_RNG_PREFIX = "random_states_"
# Distributed types in which every process holds a full replica of the model and optimizer state (DDP).
_REPLICATED = {getattr(DistributedType, n) for n in ("MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA",
                                                     "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON")
               if hasattr(DistributedType, n)}
_OPTIMIZER_FILE = re.compile(r"^optimizer(_\d+)?\.bin$")
_SPREADABLE_FILE = re.compile(r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin|optimizer(_\d+)?\.bin)$")
class _TorchSavingInto:
    """Stands in for the ``torch`` module inside ``accelerate.checkpointing`` (RNG, GradScaler,
    dataloader state) and ``accelerate.utils.fsdp_utils`` (FSDP's full state dicts, gathered on the
    main process) during a save, and only there: other code keeps the real one."""

    def __init__(self, real: Any, save: Callable) -> None:
        self._real, self.save = real, save

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class Capture:
    """Turns the writes of one ``save_state()`` call into files of one transaction."""

    def __init__(self, tx: Any, options: Options, *, save_on_each_node: bool, overlap_optimizer: bool) -> None:
        self.tx, self.options = tx, options
        self.save_on_each_node = save_on_each_node  # the project configuration's
        self.overlap_optimizer = overlap_optimizer  # asked for, and every optimizer steps through the pre-hook
        self.state = PartialState()
        self.written: list[str] = []  # names this process staged
        self.spread: list[tuple[str, Any, str, int]] = []  # large replicated files, assigned at the end
        self.overlapped: list[tuple[str, Any, str]] = []  # optimizer files, snapshot after the call
        self.real_save: Callable = accelerate_checkpointing.save
        self.real_torch_save: Callable = torch.save

    @contextlib.contextmanager
    def installed(self) -> Iterator["Capture"]:
        with patching.patched(accelerate_checkpointing, "save", self.capture_save), \
                patching.patched(accelerate_checkpointing, "torch",
                                 _TorchSavingInto(accelerate_checkpointing.torch, self.capture_torch_save)), \
                patching.patched(fsdp_utils, "torch", _TorchSavingInto(fsdp_utils.torch, self.capture_fsdp_torch_save)), \
                capturing_dcp_saves(self.tx):
            yield self

    # ---- which process writes what
    def _name(self, f: Any) -> Optional[str]:
        """``f``'s name inside the staging directory, or None (then it is not ours to capture)."""
        if not isinstance(f, (str, os.PathLike)):
            return None
        path, root = os.path.abspath(os.fspath(f)), self.tx.staging_dir
        return os.path.relpath(path, root) if path.startswith(root + os.sep) else None

    def _writes_here(self, save_on_each_node: bool) -> bool:
        """Accelerate's own gating in ``accelerate.utils.other.save``."""
        return self.state.is_local_main_process if save_on_each_node else self.state.is_main_process

    def _spreadable(self, name: str, save_on_each_node: bool) -> bool:
        return (self.options.spread_writes and not save_on_each_node and self.state.num_processes > 1
                and self.state.distributed_type in _REPLICATED and _SPREADABLE_FILE.match(name) is not None)

    # ---- the two capture functions
    def capture_save(self, obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
        """Replaces ``accelerate.utils.other.save`` (as bound in ``accelerate.checkpointing``)."""
        name = self._name(f)
        if name is None:
            return self.real_save(obj, f, save_on_each_node=save_on_each_node, safe_serialization=safe_serialization)
        fmt = "safetensors" if safe_serialization else "torch"
        if self._spreadable(name, save_on_each_node):
            size = tensor_bytes(obj)
            if size >= self.options.inline_bytes:
                self.spread.append((name, obj, fmt, size))
                return None
        if self._writes_here(save_on_each_node):
            self.stage(name, obj, fmt)
        return None

    def capture_torch_save(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        """Replaces ``torch.save`` inside ``accelerate.checkpointing`` (RNG, GradScaler, dataloader state).
        Accelerate calls it on every process; each writes its own RNG file, the main process the shared ones."""
        name = self._name(f)
        if name is None:
            return self.real_torch_save(obj, f, *args, **kwargs)
        per_process = os.path.basename(name).startswith(_RNG_PREFIX)
        if per_process or self._writes_here(self.save_on_each_node):
            self._stage_torch_save(name, obj, args, kwargs)
        return None

    def capture_fsdp_torch_save(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        """Replaces ``torch.save`` inside ``accelerate.utils.fsdp_utils``, which calls it only on the
        process that writes the file: the main process for full state dicts, every process for its own
        shard file (``pytorch_model_fsdp_0_rank{i}.bin``, ``optimizer_0_rank{i}.bin`` with ``use_dcp=False``),
        which its own background writer writes into the same checkpoint."""
        name = self._name(f)
        if name is None:
            return self.real_torch_save(obj, f, *args, **kwargs)
        self._stage_torch_save(name, obj, args, kwargs)
        return None

    def _stage_torch_save(self, name: str, obj: Any, args: tuple, kwargs: dict) -> None:
        if args or kwargs:  # unusual torch.save options: serialise exactly as asked, now
            buffer = io.BytesIO()
            self.real_torch_save(obj, buffer, *args, **kwargs)
            self.tx.write_bytes(name, buffer.getvalue())
            self.written.append(name)
        else:
            self.stage(name, obj, "torch")

    # ---- snapshots into the transaction
    def stage(self, name: str, obj: Any, fmt: str) -> None:
        """Snapshot ``obj`` as the file Accelerate would have written: now, or for an optimizer file
        with ``overlap_optimizer``, on the staging thread after the call."""
        if fmt == "torch" and _OPTIMIZER_FILE.match(name) and self.overlap_optimizer \
                and not self._small(obj):
            self.overlapped.append((name, obj, fmt))
        else:
            self.snapshot(name, obj, fmt)
        self.written.append(name)

    def _small(self, obj: Any) -> bool:
        return tensor_bytes(obj, stop_at=self.options.inline_bytes) < self.options.inline_bytes

    def snapshot(self, name: str, obj: Any, fmt: str) -> None:
        if fmt == "safetensors" and isinstance(obj, OrderedDict):
            obj = clean_state_dict_for_safetensors(obj)  # before the snapshot: tied weights stay one tensor
        self.tx.save_file(obj, name, format=fmt, metadata={"format": "pt"} if fmt == "safetensors" else None,
                          inline_below=self.options.inline_bytes)

    def stage_spread(self) -> None:
        """Large replicated files (DDP): the largest first, each to the least-loaded process. Every process
        computes the same assignment from the same sizes, without communicating."""
        load = [0] * self.state.num_processes
        for name, obj, fmt, size in sorted(self.spread, key=lambda item: -item[3]):
            writer = min(range(len(load)), key=lambda rank: (load[rank], rank))
            load[writer] += size
            if writer == self.state.process_index:
                self.stage(name, obj, fmt)
        self.spread = []

    def stage_overlapped(self) -> None:
        """On the staging thread: the optimizer files left for after the call."""
        overlapped, self.overlapped = self.overlapped, []
        for name, obj, fmt in overlapped:
            self.snapshot(name, obj, fmt)
