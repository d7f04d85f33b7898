"""The memory tier's place on a node: where a checkpoint lives in node-local memory, and whose it is.

With the ``memory_tier`` option, a checkpoint is first committed to memory on its node (tmpfs, by default under
``/dev/shm``, so that it outlives the training process and its writer, not the machine), and only every
``persist_every``-th to the durable place. The memory copy of the checkpoint whose durable path is
``<root>/<name>`` is ``<memory root>/<run>/<name>``, where ``<run>`` is named after the durable root
(``run_dir``): a restart that resumes from ``<root>`` finds it there, whatever process wrote it. Its layout is
a checkpoint's (staging directory, commit record, a single file with its checksum record), so everything that
reads a checkpoint reads a memory one.

Which node this is, and where its memory root lies, come from the launcher, and two environment variables
override both, for tests and unusual launchers that run several "nodes" on one machine:

* ``ASYNCCKPT_NODE``, else torchrun's ``GROUP_RANK``, else SLURM's ``SLURM_NODEID``, else the host name;
* ``ASYNCCKPT_MEMORY_ROOT``, else the ``MemoryTier(root=...)`` given, else ``/dev/shm/asyncckpt``.

Kept free of torch: the background writer and the CLI use it.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from typing import Optional

from asyncckpt.core.formats import names
from asyncckpt.core.storage import commit, fsio, orphans, owners
from asyncckpt.core.storage.backend import backend_for

NODE_ENV, MEMORY_ROOT_ENV = "ASYNCCKPT_NODE", "ASYNCCKPT_MEMORY_ROOT"
DEFAULT_MEMORY_ROOT = "/dev/shm/asyncckpt"
RUN_RECORD = ".asyncckpt-tier.json"  # in a run directory: the durable root it holds memory copies of


def node_id() -> str:
    """This node's name among the job's nodes (the launcher's, or ``ASYNCCKPT_NODE``)."""
    for variable in (NODE_ENV, "GROUP_RANK", "SLURM_NODEID"):
        value = os.environ.get(variable)
        if value:
            return value
    return socket.gethostname()


def memory_root(configured: Optional[str] = None) -> str:
    """Where this node keeps memory checkpoints: ``ASYNCCKPT_MEMORY_ROOT``, else ``configured``, else
    ``/dev/shm/asyncckpt``."""
    return os.path.abspath(os.environ.get(MEMORY_ROOT_ENV) or configured or DEFAULT_MEMORY_ROOT)


def run_name(durable_root: str) -> str:
    """The name of the run directory holding the memory copies of the checkpoints under ``durable_root``:
    readable, and unique per root (two runs with the same last path component do not share one)."""
    durable_root = durable_root.rstrip("/")
    digest = hashlib.blake2b(durable_root.encode(), digest_size=6).hexdigest()
    return f"{os.path.basename(durable_root) or 'root'}-{digest}"


def run_dir(durable_root: str, root: Optional[str] = None) -> str:
    """The run directory of ``durable_root`` under this node's memory root."""
    return os.path.join(memory_root(root), run_name(durable_root))


def memory_path(durable_path: str, root: Optional[str] = None) -> str:
    """Where the memory copy of the checkpoint ``durable_path`` lives on this node."""
    durable_path = durable_path.rstrip("/")
    return os.path.join(run_dir(os.path.dirname(durable_path), root), os.path.basename(durable_path))


def open_run(durable_root: str, root: Optional[str] = None) -> str:
    """The run directory of ``durable_root``, created (with its record) if it is not there; returns it."""
    directory = run_dir(durable_root, root)
    record = os.path.join(directory, RUN_RECORD)
    if not os.path.exists(record):
        os.makedirs(directory, exist_ok=True)
        fsio.atomic_write_bytes(record, json.dumps({"durable_root": durable_root.rstrip("/"), "node": node_id(),
                                                    "created_ns": time.time_ns()}).encode())
    return directory


def durable_root_of(directory: str) -> Optional[str]:
    """The durable root whose memory copies the run directory ``directory`` holds (None: not a run directory)."""
    try:
        with open(os.path.join(directory, RUN_RECORD)) as f:
            return json.load(f)["durable_root"]
    except (OSError, ValueError, KeyError):
        return None


def remove_run(directory: str) -> None:
    """Delete a run directory: out of sight first (renamed to a hidden name), then its contents."""
    if not os.path.isdir(directory):
        return
    hidden = names.hidden_path(directory, "removing", owners.owner_token())
    os.rename(directory, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


def latest_checkpoint(root: str, *, orphan_timeout: float = 600.0, memory_root: Optional[str] = None) -> Optional[str]:
    """The newest complete checkpoint of ``root`` in any tier of this node (by step, then commit time), or None:
    directly under ``root`` (``commit.latest_checkpoint``), or in its memory run directory (under ``memory_root``,
    else the environment's or the default), whose copy is the nearer where both hold the same step. A writer of a
    previous run still finishing a checkpoint in either is waited for first, up to ``orphan_timeout`` seconds."""
    best_key, best_path = None, None
    for place, nearness in ((root, 0), (run_dir(root, memory_root), 1)):
        if nearness and not os.path.isdir(place):
            continue
        if not backend_for(place).remote:
            orphans.wait_for_orphans(place, orphan_timeout)
        for path, record in commit.committed_under(place):
            if record is None:
                continue
            step = record.get("step")
            key = (step if step is not None else -1, nearness, record.get("committed_at_ns", 0))
            if best_key is None or key > best_key:
                best_key, best_path = key, path
    return best_path
