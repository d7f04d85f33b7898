"""Loading a committed checkpoint into a state dict in place, resharding as needed.

Checkpoints written by asyncckpt whose tensors need no resharding (plain CPU tensors, each saved
whole) are read straight from the sidecars (``direct_load``); where every rank loads the same tensors
(replicated state), each reads its share and the ranks broadcast the rest (``cooperative.share_spans``);
anything else goes through ``dcp.load`` with torch's resharding and our verified reader, which shares the
whole chunks several ranks read (HSDP's replica groups, tensors kept whole). With collectives, every rank takes
the same path, and a failure on any rank is raised on every rank (as ``dcp.load`` does).
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from asyncckpt.core.loading import cooperative
from asyncckpt.core.storage import commit
from asyncckpt.core.storage.backend import backend_for
from asyncckpt.core.loading.dcp_reader import AsyncCkptStorageReader
from asyncckpt.core.loading.direct_load import paused_gc, plan_direct_load
from asyncckpt.core.snapshot.collectives import dcp_ranks, over
from asyncckpt.core.snapshot.dist_env import dist_ready, rank_and_world
from asyncckpt.core.errors import CheckpointError, CheckpointTimeoutError
from asyncckpt.core.loading.metadata_io import load_dcp_metadata
from asyncckpt.core.snapshot.planner import AsyncCkptLoadPlanner


def load_checkpoint(state_dict: dict, path: str, *, group: Optional[dist.ProcessGroup], collectives: bool,
                    strict: bool, verify: bool, io_threads: int, timeout: float, readers: cooperative.Readers) -> None:
    record = commit.require_complete(path)  # DCP would hide these errors behind a generic one: check first
    use_dist = collectives and dist_ready() and rank_and_world(group)[1] > 1  # one rank talks to nobody
    ranks = dcp_ranks(over(group) if use_dist else None)  # DCP's collectives too, on a transport that carries CPU
    planned: list = []

    def plan() -> bool:
        planned.append(plan_direct_load(state_dict, path, record, rank=rank_and_world(group)[0], strict=strict,
                                         verify=verify))
        return planned[0] is not None

    try:
        with paused_gc():
            if all(ranks.all_gather("plan", plan)):
                load = planned[0]
                shared = cooperative.share_spans(load.files, group, timeout=timeout, readers=readers,
                                                 remote=backend_for(path).remote) \
                    if use_dist else None  # replicated state (every rank reads the same): each byte read once
                read = functools.partial(load.read, io_threads)
                ranks.all_gather("read", lambda: shared.load(read) if shared is not None else read())
                ranks.all_gather("place", load.place)
                planned.clear()  # its ~10 objects per key go before the GC is back on
                return
            reader = AsyncCkptStorageReader(path, verify=verify, io_threads=io_threads, metadata=load_dcp_metadata(path),
                                            group=group, timeout=timeout, readers=readers if use_dist else "off")
            with warnings.catch_warnings():  # DCP warns that a no-collectives load is "single process"
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state_dict, storage_reader=reader, planner=AsyncCkptLoadPlanner(strict=strict),
                         process_group=ranks.group, no_dist=not use_dist)
    except CheckpointException as e:
        raise _unwrap(e) from None


def _unwrap(error: CheckpointException) -> BaseException:
    """DCP wraps per-rank failures; surface ours (they already name path, key and rank)."""
    ours = [exception for _rank, (exception, _traceback) in sorted(error.failures.items())
            if isinstance(exception, CheckpointError)]
    ours.sort(key=lambda e: isinstance(e, CheckpointTimeoutError))  # a rank's own failure before others' waits for it
    return ours[0] if ours else error
