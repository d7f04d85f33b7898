"""Which step-named durable checkpoints to delete (``CheckpointManager``'s ``keep_last`` / ``keep_every``), and the
request that deletes them in the background writer (a memory tier's retention: ``tier.requests``).

Kept apart from ``manager`` (which needs the ``Checkpointer``, hence torch) because the writer
unpickles ``RetentionRequest`` and must not import torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from asyncckpt.core.storage import commit
from asyncckpt.core.storage.backend import basename
from asyncckpt.core.writer.file_requests import RemoveRequest
from asyncckpt.core.writer.protocol import RequestContext


def select_deletions(committed_steps: list[int], keep_last: Optional[int], keep_every: Optional[int]) -> list[int]:
    """Steps to delete: all but the newest ``keep_last`` and multiples of ``keep_every``; never the newest."""
    steps = sorted(committed_steps)
    if not steps:
        return []
    keep = set(steps[-keep_last:]) if keep_last else set(steps)
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    keep.add(steps[-1])
    return [s for s in steps if s not in keep]


@dataclass
class RetentionRequest:
    """Applied by the background writer right after the save of the newest checkpoint, and only
    if it committed (``protocol.Job.after``): deletions are atomic (``removal``)."""

    root: str
    pattern: str
    keep_last: Optional[int]
    keep_every: Optional[int]
    object_store: Any = None  # ObjectStoreOptions, for a URL root

    def run(self, context: RequestContext) -> None:
        committed = committed_steps(self.root, re.compile(self.pattern), self.object_store)
        doomed = [committed[step] for step in select_deletions(list(committed), self.keep_last, self.keep_every)]
        RemoveRequest(doomed, object_store=self.object_store).run(context)


def committed_steps(root: str, pattern: re.Pattern, options: Any = None) -> dict[int, str]:
    """step -> path of every committed checkpoint under ``root`` whose name matches ``pattern``
    (``commit.committed_under``: for a URL, the commit objects of one delimited listing)."""
    found = {}
    for path, record in commit.committed_under(root, options):
        match = pattern.match(basename(path))
        if match and record is not None:
            found[int(match.group(1))] = path
    return found
