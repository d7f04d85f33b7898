"""Every torch.distributed collective asyncckpt runs, and the transport that carries it.

More: docs/MODULES.md, core/snapshot/collectives.py.
"""
from __future__ import annotations

import contextlib
import datetime
import sys
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.utils import _DistWrapper

from asyncckpt.core.snapshot.dist_env import dist_ready

#: A made group's timeout where the collective gives none (torch's default for a gloo group): each collective that
#: can wait for a rank that never comes bounds its own wait (``timeout``).
_GROUP_TIMEOUT = datetime.timedelta(minutes=30)


def carries_cpu(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether ``group`` (None: the default group) carries CPU tensors (its backend has one for the CPU)."""
    backend = str(dist.get_backend(group))
    if ":" in backend:  # "cuda:gloo", "cpu:gloo,cuda:nccl": a backend per device type
        return any(pair.split(":")[0] == "cpu" for pair in backend.split(","))
    return "cpu" in dist.Backend.backend_capability.get(backend, ["cpu"])


class Collectives:
    """The collectives asyncckpt runs over the ranks of one group (the training's; None: the world), each on the
    group that carries them (``carrier``). Ranks are the group's (``src``, ``dst``, what ``gather`` orders by)."""

    def __init__(self, group: Optional[dist.ProcessGroup], *, own: bool = False,
                 timeout: datetime.timedelta = _GROUP_TIMEOUT) -> None:
        self.group = group
        self.ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        self.world = len(self.ranks)
        self._whole = self.world == dist.get_world_size()  # made by every rank of the world: made again at will
        self._timeout = timeout
        self.own = own and self._whole and self.world > 1  # a group of its own, even where ``group`` carries CPU
        self._carrier: Optional[dist.ProcessGroup] = None  # a group of ours, once made
        self._among: dict[tuple[int, ...], Optional[Collectives]] = {}
        if self.own:
            self.carrier()  # now, on the caller's thread

    def carrier(self) -> Optional[dist.ProcessGroup]:
        """The group these collectives run on (where it is one of ours, made at the first call: a collective)."""
        if self._carrier is None:
            if carries_cpu(self.group) and not self.own:
                return self.group
            if sorted(self.ranks) != self.ranks:
                raise ValueError(f"asyncckpt: the process group of ranks {self.ranks} carries no CPU tensors and "
                                 "lists its ranks out of order: pass a group whose ranks ascend, or a gloo group")
            self._carrier = _made(self.ranks, self._whole, self._timeout)
        return self._carrier

    def among(self, ranks: Sequence[int]) -> Optional[Collectives]:
        """The collectives of ``ranks`` (of this group) alone, on a gloo group of theirs: a collective of every
        rank of this group, members or not; None on the others."""
        ranks = tuple(sorted(ranks))
        if len(ranks) == self.world:
            return self
        if ranks not in self._among:
            members = [self.ranks[r] for r in ranks]
            made = _made(members, self._whole, self._timeout, member=dist.get_rank() in members)
            self._among[ranks] = Collectives(made) if made is not None else None
        return self._among[ranks]

    def close(self) -> None:
        """Give up the groups made for these collectives, but those torch cannot make twice (made again where
        needed)."""
        if not self._whole:
            return
        for made in self._among.values():
            if made is not None:
                _destroy(made.group)
        self._among.clear()
        _destroy(self._carrier)
        self._carrier = None

    def _global(self, rank: int) -> int:
        return self.ranks[rank]

    # ------------------------------------------------------------------ coordination
    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank. False while an exception is being handled (the other ranks may
        never come), and on one rank."""
        if self.world < 2 or sys.exc_info()[1] is not None:
            return False
        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.carrier())
        return bool(value.item())

    def gather_ints(self, values: Sequence[int], timeout: Optional[float] = None) -> list[list[int]]:
        """Every rank's ``values`` (the same count on each; int64), by rank: one all_gather."""
        local = torch.tensor(list(values), dtype=torch.int64)
        everyone = [torch.empty_like(local) for _ in range(self.world)]
        _wait(dist.all_gather(everyone, local, group=self.carrier(), async_op=True), timeout)
        return [tensor.tolist() for tensor in everyone]

    def gather(self, value: Any) -> list:
        """Every rank's ``value`` (pickled), by rank."""
        gathered: list = [None] * self.world
        dist.all_gather_object(gathered, value, group=self.carrier())
        return gathered

    def broadcast(self, value: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``value`` (pickled), on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=self._global(src), group=self.carrier())
        return box[0]

    def barrier(self, timeout: Optional[float] = None) -> None:
        _wait(dist.barrier(group=self.carrier(), async_op=True), timeout)

    # ------------------------------------------------------------------ bytes (CPU tensors); each returns its Work
    def broadcast_bytes(self, tensor: torch.Tensor, src: int) -> dist.Work:
        return dist.broadcast(tensor, src=self._global(src), group=self.carrier(), async_op=True)

    def send_bytes(self, tensor: torch.Tensor, dst: int) -> dist.Work:
        return dist.isend(tensor, dst=self._global(dst), group=self.carrier())

    def receive_bytes(self, tensor: torch.Tensor, src: int) -> dist.Work:
        return dist.irecv(tensor, src=self._global(src), group=self.carrier())


_over: dict[Any, Collectives] = {}
_world: Any = None  # the default group ``_over``'s entries belong to


def over(group: Optional[dist.ProcessGroup]) -> Collectives:
    """The collectives of the caller's thread over ``group``'s ranks (None: the world): one per group in this
    process, its transport decided once. Needs torch.distributed initialised."""
    global _world
    if dist.group.WORLD is not _world:  # a new default group: torch destroyed every group of the old one
        _over.clear()
        _world = dist.group.WORLD
    key = group if group is not None else dist.group.WORLD
    if key not in _over:
        _over[key] = Collectives(group)
    return _over[key]


def any_rank(flag: bool, group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether ``flag`` is set on any rank of ``group`` (a collective: every rank calls it). False without
    torch.distributed (this rank's answer alone), and while an exception is being handled."""
    return dist_ready() and over(group).any_rank(flag)


def own(group: Optional[dist.ProcessGroup], timeout: float) -> Collectives:
    """Collectives over ``group``'s ranks for a thread of their own (made now, on the caller's thread; the owner
    ``close``s them): on a gloo group of their own where ``group`` is the world; elsewhere the caller's
    (``over``), which such a thread must then not use while the caller may (``Collectives.own`` is False)."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    if len(ranks) != dist.get_world_size():
        return over(group)
    return Collectives(group, own=True, timeout=datetime.timedelta(seconds=timeout))


def dcp_ranks(collectives: Optional[Collectives]) -> _DistWrapper:
    """DCP's wrapper of its own collectives (a plan gathered, reduced and scattered; every rank's failure), over
    the transport of ``collectives``; None: one process's, which talks to nobody."""
    if collectives is None:
        return _DistWrapper(None, False, 0)
    return _DistWrapper(collectives.carrier(), True, 0)


def release() -> None:
    """Give up the groups ``over`` made (a Checkpointer's teardown); the next collective makes them again."""
    for collectives in _over.values():
        collectives.close()


def _made(ranks: list[int], every_rank: bool, timeout: datetime.timedelta, *, member: bool = True
          ) -> Optional[dist.ProcessGroup]:
    """A gloo group of ``ranks`` (global): made by every rank of the world where ``every_rank`` (then None on the
    others), else by ``ranks`` alone (only members call)."""
    if every_rank:
        made = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        return made if member else None
    if not member:
        return None
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=True)


def _destroy(group: Optional[dist.ProcessGroup]) -> None:
    if group is not None and dist_ready():
        with contextlib.suppress(ValueError, RuntimeError):  # torch destroyed it with the default group
            dist.destroy_process_group(group)


def _wait(work: dist.Work, timeout: Optional[float]) -> None:
    """``work`` done, within ``timeout`` seconds if given (else the group's)."""
    if timeout is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=timeout))
