"""The adapter kit: what adapters use of the core beyond the public API (``asyncckpt.core.__all__``).

An adapter is translation: what its framework saves, under which name, and when to wait. Everything an
adapter would otherwise write for itself is here, once:

* options: ``CheckpointOptions`` (public) and ``resolve_options``, the one parser of an adapter's keyword
  arguments (unknown names, renamed ones);
* saving: ``capture`` (a framework's own save code run unchanged, its files handed to a checkpoint
  transaction), ``capturing_dcp_saves`` (its ``dcp.save`` calls made sharded snapshots), ``saving`` (the
  finish of a directory save: deferred snapshots, commit, removals after; whether an optimizer's snapshot may
  be overlapped), ``tensor_bytes``, ``checksum``;
* resuming: ``resume`` (the one resume sequence: wait, restore a mirrored checkpoint, candidates, the first
  intact one, checked as the framework reads it), ``wait_for_orphans``;
* reporting: ``SaveMetrics`` (each save's stall, time to durable and bytes, for the framework's logger) and
  ``Records`` (the list of them every adapter hands its user as ``metrics``);
* the framework itself: ``patching`` (reversible, contract-checked replacements of its functions, against the
  releases ``versions`` names), ``lifecycle`` (waiting for saves in flight, the exit drain), ``dist_env``
  (what the core asks torch.distributed), ``collectives`` (the collectives it runs, on a transport that carries
  CPU tensors whatever the training's backend), ``normalize_path`` and ``is_url`` (one rule for paths: the storage
  seam's).

Everything else under ``asyncckpt.core`` is private: its sub-packages (``api``, ``snapshot``, ``client``,
``writer``, ``export``, ``storage``, ``formats``, ``loading``, ``verify``, ``cli``) may change in any release; a test keeps
adapters to this module and the public API.
"""
from asyncckpt.core.api import lifecycle
from asyncckpt.core.api.options import resolve as resolve_options, taking_options
from asyncckpt.core.client.handles import SaveHandle
from asyncckpt.core.formats.checksum import checksum
from asyncckpt.core.integration import capture, patching, resume, saving, versions
from asyncckpt.core.integration.dcp_capture import capturing_dcp_saves
from asyncckpt.core.integration.metrics import Records, SaveMetrics
from asyncckpt.core.snapshot import collectives, dist_env
from asyncckpt.core.snapshot.file_snapshots import tensor_bytes
from asyncckpt.core.storage.backend import is_url, normalize as normalize_path
from asyncckpt.core.storage.orphans import wait_for_orphans

__all__ = [
    "Records", "SaveHandle", "SaveMetrics", "capture", "capturing_dcp_saves", "checksum", "collectives", "dist_env",
    "is_url",
    "lifecycle", "normalize_path", "patching", "resolve_options", "resume", "saving", "taking_options", "tensor_bytes",
    "versions", "wait_for_orphans",
]
