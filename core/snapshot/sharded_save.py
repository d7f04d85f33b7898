"""The caller's part of a sharded (SPMD) save, before the copy: flatten, agree, plan, pick a buffer.

More: docs/MODULES.md, core/snapshot/sharded_save.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.utils import find_state_dict_object, find_tensor_shard

from asyncckpt.core.storage.backend import backend_for
from asyncckpt.core.storage.staging import staging_dir_for
from asyncckpt.core.writer.barrier import BarrierSpec
from asyncckpt.core.snapshot.buffer_pool import BufferPool, FileBuffers, Slot
from asyncckpt.core.snapshot.collectives import Collectives, dcp_ranks, own
from asyncckpt.core.snapshot.dist_env import rank_and_world
from asyncckpt.core.errors import CheckpointWriteError
from asyncckpt.core.snapshot.dcp_metadata import dcp_classes, metadata_command
from asyncckpt.core.snapshot.plan_cache import CachedPlan, PlanCache, agree_on_structure
from asyncckpt.core.snapshot.planner import (
    AsyncCkptSavePlanner,
    byte_items,
    layout_for_plan,
    planner_data_paths,
    tensor_items,
)
from asyncckpt.core.snapshot.shared_buffer import CopyInProgress, begin_copy, start_copy
from asyncckpt.core.tier.nodes import TierSave
from asyncckpt.core.writer.shard_requests import ShareRequest
from asyncckpt.core.snapshot.structure import describe, tied_keys
from asyncckpt.core.snapshot.tensor_copy import CopyThreads

_SPECULATION = "speculative copy"  # a buffer's user while a copy runs before the structure is confirmed


@dataclass
class PreparedSave:
    slot: Slot
    begin: Callable[[], CopyInProgress]  # starts (or returns the already started) copy
    request: ShareRequest


@dataclass
class SaveTarget:
    """Where and how one sharded save goes."""

    path: str
    agreement: Optional[Collectives]  # where its ranks agree on the structure and plan (None: they do not talk)
    collectives: bool
    rank: int
    world: int
    store: Any  # the torch.distributed Store the ranks meet in (None: they meet through files)
    step: Optional[int] = None
    extra_files: Optional[dict[str, bytes]] = None
    object_store: Any = None  # ObjectStoreOptions for a URL path
    # A part of a directory checkpoint (``DirectoryTransaction.save_sharded``): written into this
    # subdirectory of the directory's staging directory, and published with the directory.
    staging_dir: Optional[str] = None
    directory_barrier: Optional[BarrierSpec] = None
    tier: Optional[TierSave] = None  # a memory-tier save: the job's topology, and how this rank's part reaches the others
    file_buffers: Optional[FileBuffers] = None  # a memory-tier save's: its snapshot buffers are files of the tier

    def barrier_kind(self) -> str:
        """How its ranks meet: the Store whenever there is one to meet in; else markers where the
        checkpoint is written (files, or objects); one rank saving to a URL has nobody to meet."""
        if self.store is not None and self.collectives and self.world > 1:
            return "store"
        if backend_for(self.path).remote and self.world == 1:
            return "solo"
        return "files"


class ShardedSaves:
    def __init__(self, buffers: BufferPool, threads: CopyThreads, *, direct_io: bool, io_threads: int,
                 timeout: float, share_unchanged: bool) -> None:
        self.buffers, self.threads = buffers, threads
        self.direct_io, self.io_threads, self.timeout = direct_io, io_threads, timeout
        self.share_unchanged = share_unchanged
        self.plan_cache = PlanCache()
        self._objects = _ObjectSnapshots()
        self._counter = 0
        self._last_key = None  # plan-cache key of the last save
        self._agreements: dict[Any, Collectives] = {}  # per group

    def agreement(self, group: Optional[dist.ProcessGroup]) -> Collectives:
        """Where a save's structure agreement (and cold planning) runs (``own``): on the whole world, a
        group of our own, made at the first such save, so that it can run on the snapshot thread without
        interleaving with the caller's collectives; on a part of it, the caller's."""
        key = group if group is not None else dist.group.WORLD
        if key not in self._agreements:
            self._agreements[key] = own(group, self.timeout)
        return self._agreements[key]

    def target(self, path: str, group: Optional[dist.ProcessGroup], collectives: bool, store: Callable[[], Any],
               **details: Any) -> SaveTarget:
        """Where and how a save of ``path`` on ``group`` goes (``details``: the other ``SaveTarget`` fields)."""
        rank, world = rank_and_world(group)
        collectives = collectives and world > 1
        return SaveTarget(path, self.agreement(group) if collectives else None, collectives, rank, world,
                          store() if collectives else None, **details)

    def close(self) -> None:
        """Give up the agreement's group (its threads); the next save makes it again."""
        for agreement in self._agreements.values():
            agreement.close()
        self._agreements.clear()

    def prepare(self, state_dict: dict, target: SaveTarget, user: Any, *, speculate: bool,
                failed_here: Callable[[], bool], raise_failures: Callable[[], None],
                timings: dict[str, float]) -> PreparedSave:
        """Everything before the copy (see the module docstring). ``failed_here()`` says whether this
        rank holds a failure nobody has seen; ``raise_failures()`` raises it. ``timings`` gets
        ``plan_s`` (a cold plan) and ``buffer_s`` (taking, or allocating, a snapshot buffer)."""
        planner = AsyncCkptSavePlanner()
        planner.set_up_planner(_resolve_stateful(state_dict), is_coordinator=target.rank == 0)
        flat = planner.state_dict
        speculation = self._speculate(flat) if speculate else None
        try:
            description = describe(flat)
            key, save_id, failed_ranks = agree_on_structure(self.plan_cache.digest(description), target.agreement,
                                                            target.world, target.collectives, self._counter,
                                                            failed=failed_here())
            self._counter += 1
            raise_failures()
            if failed_ranks:  # another rank's earlier save failed: every rank stops here together
                raise CheckpointWriteError(f"rank {target.rank}: not saving: an earlier save failed on ranks {failed_ranks}")
            cached = self.plan_cache.get(key)
            if cached is None:
                started = time.perf_counter()
                cached = self._plan(planner, target, tied_keys(description))
                self.plan_cache.put(key, cached)
                timings["plan_s"] = time.perf_counter() - started
            self._last_key = key
            objects = [(item.index.fqn, self._objects.serialize(item.index.fqn, find_state_dict_object(flat, item.index)))
                       for item in cached.byte_items]
            if speculation is not None and speculation.key == key:
                slot, copy = speculation.slot, speculation.copy
                slot.user = user
                begin = lambda: copy  # noqa: E731
            else:
                if speculation is not None:
                    speculation.abandon()
                    speculation = None
                started = time.perf_counter()
                slot = self.buffers.take(key, cached.layout, user, files=target.file_buffers)
                timings["buffer_s"] = time.perf_counter() - started
                sources = _sources(flat, cached)
                begin = lambda: begin_copy(slot.buffer, sources, self.threads)  # noqa: E731
        except BaseException:
            if speculation is not None:
                speculation.abandon()
            raise
        staging_dir = target.staging_dir or staging_dir_for(target.path, save_id)
        coordinator = target.rank == 0
        kind = target.barrier_kind()
        classes = dcp_classes() if coordinator else None
        request = ShareRequest(
            save_id=save_id, final_path=target.path, staging_dir=staging_dir, rank=target.rank,
            world_size=target.world, coordinator=coordinator, structure_hash=str(key[0]), byte_items=objects,
            barrier=BarrierSpec(kind, save_id, target.world, staging_dir, target.path, self.timeout, target.object_store),
            direct_io=self.direct_io, io_threads=self.io_threads, step=target.step,
            extra_files=dict(target.extra_files or {}) if coordinator else {},
            dcp_classes=classes, metadata_command=metadata_command() if coordinator and classes is None else None,
            object_store=target.object_store,
            directory_barrier=target.directory_barrier, tier=target.tier, share_unchanged=self.share_unchanged,
        )
        return PreparedSave(slot, begin, request)

    def _plan(self, planner: AsyncCkptSavePlanner, target: SaveTarget, tied_to: dict[str, str]) -> CachedPlan:
        if target.collectives and target.world > 1 and dist.is_initialized():
            final = dcp_ranks(target.agreement).reduce_scatter(
                "plan", planner.create_local_plan, lambda plans: planner.create_global_plan(plans)[0])
        else:
            final = planner.create_global_plan([planner.create_local_plan()])[0][0]
        planner.finish_plan(final)
        layout = dataclasses.replace(layout_for_plan(final, target.rank, tied_to),
                                     planner_data=planner_data_paths(planner.mappings))
        items = tensor_items(final)
        sources = []
        for position in layout.unique_slots():
            item = items[position]
            plain = type(planner.state_dict[item.index.fqn]) in (torch.Tensor, torch.nn.Parameter)
            sources.append((item.index.fqn, None if plain else item))  # DTensors: look up the local shard
        return CachedPlan(final, layout, sources, byte_items(final))

    def _speculate(self, flat: dict) -> Optional["_SpeculativeCopy"]:
        """Start the copy with the last save's plan before the structure is confirmed: training
        saves the same structure over and over, so the copy (most of the stall) runs on the copy
        threads while this thread describes the structure, agrees on it and looks up the plan."""
        last = self._last_key
        cached = self.plan_cache.peek(last) if last is not None else None
        if cached is None:
            return None
        slot = self.buffers.take_free_of(last, _SPECULATION)
        if slot is None:
            return None
        try:
            sources = _sources(flat, cached)
            if any(source.is_cuda for source in sources):  # CUDA copies are issued from the caller's stream
                raise LookupError("no speculative copies from CUDA")
            return _SpeculativeCopy(self.buffers, last, slot, start_copy(slot.buffer, sources, self.threads))
        except Exception:  # a key gone, or now holding a non-tensor: the confirmed structure differs
            self.buffers.give_back(slot)
            return None


class _SpeculativeCopy:
    def __init__(self, buffers: BufferPool, key, slot: Slot, copy: CopyInProgress) -> None:
        self.buffers, self.key, self.slot, self.copy = buffers, key, slot, copy

    def abandon(self) -> None:
        """Wait for the copy threads to leave the buffer, then free it for other saves."""
        with contextlib.suppress(Exception):  # a copy for a structure that changed may fail; it is discarded
            self.copy.wait()
        self.buffers.give_back(self.slot)


def _sources(flat: dict, cached: CachedPlan) -> list[torch.Tensor]:
    """The tensors to copy, in the order of the plan's unique slots (DTensors: the local shard)."""
    return [flat[key] if item is None else find_tensor_shard(flat[key], item.index) for key, item in cached.sources]


def _resolve_stateful(state_dict: dict) -> dict:
    """Top-level values with ``state_dict()``/``load_state_dict()`` (DCP's Stateful protocol) are
    replaced by their state dict. (torch's own helper logs every element, which costs per key.)"""
    def is_stateful(value) -> bool:
        if isinstance(value, torch.Tensor):
            return False
        kind = type(value)
        return callable(getattr(kind, "state_dict", None)) and callable(getattr(kind, "load_state_dict", None))

    return {key: value.state_dict() if is_stateful(value) else value for key, value in state_dict.items()}


class _ObjectSnapshots:
    """Non-tensor values are snapshotted by pickling them at call time, in ``torch.save``'s format
    (what DCP's reader ``torch.load``s). ``torch.save`` costs a hundred times a plain pickle per value
    even for an int (zip framing; docs/DESIGN.md, Measured), and the container is a function of the
    pickle: so a value that pickles to the same bytes as at the last save reuses its container."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[bytes, bytes]] = {}

    def serialize(self, fqn: str, value: Any) -> bytes:
        try:
            pickled = pickle.dumps(value, protocol=2)
        except Exception:  # torch.save may still manage (it pickles storages its own way)
            pickled = None
        last = self._last.get(fqn)
        if pickled is not None and last is not None and last[0] == pickled:
            return last[1]
        buffer = io.BytesIO()
        torch.save(value, buffer)
        data = buffer.getvalue()
        if pickled is not None:
            self._last[fqn] = (pickled, data)
        return data
