"""What the core asks of torch.distributed besides collectives (``collectives``): ranks, the Store."""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch.distributed as dist

logger = logging.getLogger("asyncckpt.core")


def dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_and_world(group: Optional[dist.ProcessGroup] = None) -> tuple[int, int]:
    """This rank and the world size: from the process group, else from the launcher's env vars
    (so ``use_collectives=False`` works in jobs that never initialise torch.distributed)."""
    if dist_ready():
        return dist.get_rank(group), dist.get_world_size(group)
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


_warned_no_store = False


def default_store() -> Optional[Any]:
    """The Store of the default process group (the rendezvous store every process group has), or
    None without one. torch exposes it only through a private accessor; if that ever goes away,
    the ranks meet through the filesystem instead (with a warning)."""
    global _warned_no_store
    if not dist_ready():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError) as e:
        if not _warned_no_store:
            _warned_no_store = True
            logger.warning("asyncckpt: cannot reach torch.distributed's Store (%s); ranks meet through marker "
                           "files on the checkpoint's filesystem instead", e)
        return None


_warned_alone = False


def warn_if_launched_as_many(framework_world_size: int, framework: str, hint: str) -> None:
    """A launcher started several processes (``WORLD_SIZE`` > 1) but the framework runs this one as
    if it were alone: every process then writes the same checkpoints. Warn once."""
    global _warned_alone
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched > 1 and framework_world_size == 1 and not _warned_alone:
        _warned_alone = True
        logger.warning("asyncckpt: this process is one of %d a launcher started (WORLD_SIZE=%d), but %s runs it as a "
                       "single process: every process writes the same checkpoints. %s", launched, launched, framework, hint)
