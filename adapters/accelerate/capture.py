"""Accelerate's own writes during one ``save_state()``, into a checkpoint transaction.

More: docs/MODULES.md, adapters/accelerate/capture.py.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
from collections import OrderedDict
from typing import Any, Callable, Iterator

import accelerate.checkpointing as accelerate_checkpointing
import accelerate.utils.fsdp_utils as fsdp_utils
import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from accelerate.utils.other import clean_state_dict_for_safetensors

from asyncckpt.core.integration import capture, capturing_dcp_saves, patching, tensor_bytes

_RNG_PREFIX = "random_states_"
# Distributed types in which every process holds a full replica of the model and optimizer state (DDP).
_REPLICATED = {getattr(DistributedType, n) for n in ("MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA",
                                                     "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU", "MULTI_NEURON")
               if hasattr(DistributedType, n)}
OPTIMIZER_FILE = re.compile(r"^optimizer(_\d+)?\.bin$")
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

    def __init__(self, tx: Any, files: capture.FileCapture, *, save_on_each_node: bool, spread_writes: bool) -> None:
        self.tx, self.files = tx, files
        self.save_on_each_node = save_on_each_node  # the project configuration's
        self.spread_writes = spread_writes
        self.state = PartialState()
        self.spread: list[tuple[str, Any, str, int]] = []  # large replicated files, assigned at the end
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

    def _writes_here(self, save_on_each_node: bool) -> bool:
        """Accelerate's own gating in ``accelerate.utils.other.save``."""
        return self.state.is_local_main_process if save_on_each_node else self.state.is_main_process

    def _spreadable(self, name: str, save_on_each_node: bool) -> bool:
        return (self.spread_writes and not save_on_each_node and self.state.num_processes > 1
                and self.state.distributed_type in _REPLICATED and _SPREADABLE_FILE.match(name) is not None)

    # ---- the capture functions
    def capture_save(self, obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
        """Replaces ``accelerate.utils.other.save`` (as bound in ``accelerate.checkpointing``)."""
        name = self.files.name_of(f)
        if name is None:
            return self.real_save(obj, f, save_on_each_node=save_on_each_node, safe_serialization=safe_serialization)
        fmt = "safetensors" if safe_serialization else "torch"
        if fmt == "safetensors" and isinstance(obj, OrderedDict):
            obj = clean_state_dict_for_safetensors(obj)  # before the snapshot: tied weights stay one tensor
        if self._spreadable(name, save_on_each_node):
            size = tensor_bytes(obj)
            if size >= self.files.inline_bytes:
                self.spread.append((name, obj, fmt, size))
                return None
        if self._writes_here(save_on_each_node):
            self._save(obj, name, fmt)
        return None

    def capture_torch_save(self, obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        """Replaces ``torch.save`` inside ``accelerate.checkpointing`` (RNG, GradScaler, dataloader state).
        Accelerate calls it on every process; each writes its own RNG file, the main process the shared ones."""
        name = self.files.name_of(f)
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
        name = self.files.name_of(f)
        if name is None:
            return self.real_torch_save(obj, f, *args, **kwargs)
        self._stage_torch_save(name, obj, args, kwargs)
        return None

    def _stage_torch_save(self, name: str, obj: Any, args: tuple, kwargs: dict) -> None:
        if args or kwargs:  # unusual torch.save options: serialise exactly as asked, now
            buffer = io.BytesIO()
            self.real_torch_save(obj, buffer, *args, **kwargs)
            self.tx.write_bytes(name, buffer.getvalue())
            self.files.written.append(name)
        else:
            self._save(obj, name, "torch")

    def _save(self, obj: Any, name: str, fmt: str) -> None:
        self.files.save(obj, name, fmt, {"format": "pt"} if fmt == "safetensors" else None)

    def stage_spread(self) -> None:
        """Large replicated files (DDP): the largest first, each to the least-loaded process. Every process
        computes the same assignment from the same sizes, without communicating."""
        load = [0] * self.state.num_processes
        for name, obj, fmt, size in sorted(self.spread, key=lambda item: -item[3]):
            writer = min(range(len(load)), key=lambda rank: (load[rank], rank))
            load[writer] += size
            if writer == self.state.process_index:
                self._save(obj, name, fmt)
        self.spread = []
