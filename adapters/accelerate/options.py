"""``Options``: what ``enable_async_checkpointing(accelerator, **options)`` accepts (its own module: the
``AsyncCheckpointing`` of ``async_checkpointing`` and the ``Capture`` of one save both read it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Options:
    """What ``enable_async_checkpointing(accelerator, **options)`` accepts.

    max_in_flight: checkpoints whose background write may be pending at once; ``save_state()`` waits for the
        oldest beyond that. Each pending checkpoint holds one staging copy of the state in memory.
    timeout: bound (s) on every wait: the writer, other processes, the commit.
    direct_io / io_threads: passed to the core writer (O_DIRECT where possible; threads per process).
    spread_writes: under DDP (every process holds a replica), write the large files (``model*.safetensors``,
        ``optimizer*.bin``) from different processes instead of all from the main process.
    inline_bytes: files holding fewer tensor bytes than this are serialised at call time (no staging buffer).
    overlap_optimizer: take the snapshot of the optimizer files (``optimizer*.bin``: two thirds of an Adam
        checkpoint) on a background thread once ``save_state()`` has returned, while the next forward and
        backward run; every ``optimizer.step()`` first waits for it. Safe because a torch optimizer's state
        tensors change only in ``step()``. Off by default: on CPU-only training the copy during the next step
        costs more than it saves (docs/benchmarks_accelerate.md); where the state lives on a GPU and the CPU
        idles during forward/backward, turn it on.
    fix_iteration: ``load_state`` restores ``project_configuration.iteration`` (accelerate #3306).
    verify_on_resume: ``load_state`` checks the checkpoint against its checksums before loading anything
        (``asyncckpt.core.verify.integrity``); a damaged one raises ``CorruptCheckpointError`` naming the file.
        Checkpoints written without asyncckpt load unchecked.
    resume_from_intact: when ``load_state()`` picks the newest ``checkpoint_N`` itself and it is damaged, load
        the newest one that checks out instead, with a warning naming the one skipped.
    mirror_to: an object-store URL (``s3://bucket/run``): the main process copies each committed ``checkpoint_N``
        there in the background (``Checkpointer.mirror``), and ``load_state()`` with no local ``checkpoint_N``
        restores the newest from there first (docs/object_store.md).
    export: ``"safetensors"`` or an ``asyncckpt.core.ExportOptions``: after each commit, the main process's
        writer exports the model as Hugging Face safetensors (with the model's ``config.json`` when it saved one),
        by default to ``project_dir/exports/checkpoint_N`` (docs/accelerate.md).
    on_commit: called with each ``checkpoint_N``'s path once it committed, on every process, off the training
        loop (``Checkpointer(on_commit=...)``); what it raises fails like a save.
    """

    max_in_flight: int = 1
    timeout: float = 600.0
    direct_io: bool = True
    io_threads: int = 2
    spread_writes: bool = True
    inline_bytes: int = 1 << 20
    overlap_optimizer: bool = False
    fix_iteration: bool = True
    verify_on_resume: bool = True
    resume_from_intact: bool = False
    mirror_to: Optional[str] = None
    export: Any = None
    on_commit: Optional[Callable[[str], Any]] = None
