"""``CheckpointOptions``: every option that means the same thing in the core and in every adapter, once.

A user who moves between Lightning, Accelerate, the Transformers Trainer and the core meets one set of
names, defaults and meanings: ``Checkpointer(**options)``, ``AsyncCkptIO(**options)``,
``enable_async_checkpointing(accelerator, **options)`` and ``AsyncCheckpointCallback(**options)`` all take
these fields as keyword arguments, or the object itself as ``options=``. What only one framework needs
stays in its adapter (documented there, with the reason). How each default was chosen, with the
measurements: docs/options.md.

``resolve`` is the one parser: an unknown name raises ``TypeError`` naming the accepted ones; a renamed
option is still accepted under its old name, with a ``FutureWarning``, for one release.
"""
from __future__ import annotations

import dataclasses
import inspect
import typing
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, TypeVar

from asyncckpt.core.api.commit_hooks import OnCommit
from asyncckpt.core.export.options import ExportOptions, as_options
from asyncckpt.core.storage.object_store import ObjectStoreOptions

#: old name -> new name, accepted with a FutureWarning until the release after 0.2
RENAMED = {"verify_on_resume": "verify", "max_pending": "max_in_flight"}


@dataclass(frozen=True)
class MemoryTier:
    """The memory tier (docs/memory_tier.md): each checkpoint is first committed to node-local memory (tmpfs), on
    its own node and on ``replicas`` other nodes, and every ``persist_every``-th (and the last of a run) is also
    written to the durable place, from memory.

    Args:
        replicas: copies of each node's shares on other nodes (0: a process restart is covered, a node loss is not).
        persist_every: every so many checkpoints, one is also written durably (1: every checkpoint).
        keep: memory checkpoints kept on each node (its own; replicas of other nodes' shares besides).
        root: the memory root on each node (default ``/dev/shm/asyncckpt``; ``ASYNCCKPT_MEMORY_ROOT`` overrides).
        max_bytes: the most memory the tier may use on a node; default: half of the memory root's filesystem. A
            run whose checkpoints would not fit saves durably only, with one warning saying what would fit.
        peer_timeout: seconds a save waits for another node that stops answering (each wait) before it commits
            without that node's replicas; the node is then left out for a while and said once in the log.
    """

    replicas: int = 1
    persist_every: int = 5
    keep: int = 2
    root: Optional[str] = None
    max_bytes: Optional[int] = None
    peer_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.persist_every < 1 or self.keep < 1 or not self.peer_timeout > 0:
            raise ValueError(f"{self}: replicas >= 0, persist_every >= 1, keep >= 1 and peer_timeout > 0")


@dataclass(frozen=True)
class CheckpointOptions:
    """The options of every asyncckpt entry point (the core's ``Checkpointer`` and the three adapters).

    Args:
        max_in_flight: checkpoints whose background write may be pending at once (a directory of files counts
            once). A save beyond it first waits for the oldest. Each pending checkpoint holds a staging copy of
            its data in shared memory, allocated when first needed and then reused: the second is only
            allocated when a save comes while the previous one is still being written (Lightning's
            ``save_last=True`` makes two saves back to back; a burst of saves), which would otherwise block
            training for that write.
        timeout: bound, in seconds, on every wait: the writer, other ranks, the commit, back-pressure; also on
            what a background writer still does after its training process died.
        direct_io: write with O_DIRECT where the filesystem supports it.
        io_threads: parallel write (and read) threads of each rank's background writer.
        verify: check checksums on every load, and check a checkpoint before a framework resumes from it; a
            damaged one raises ``CorruptCheckpointError`` naming the file (and, in a sharded checkpoint, the
            key). Files written without asyncckpt load unchecked.
        resume_from_intact: when the framework picks the newest checkpoint itself (Lightning ``ckpt_path="last"``,
            Accelerate ``load_state()``, the Trainer's ``resume_from_checkpoint=True``) and it is damaged, resume
            from the newest one that checks out, with a warning naming the one skipped.
        overlap_optimizer: the optimizer's state (two thirds of an Adam checkpoint) may be snapshot after the
            save returns, while the next forward and backward run; every ``optimizer.step()`` first waits for
            it. Safe because a torch optimizer's state tensors change only in ``step()``; off by itself for an
            optimizer that is not a ``torch.optim.Optimizer`` (with a warning). Applies where the framework writes
            the optimizer state to a file of its own (Accelerate's ``optimizer.bin``, the Trainer's
            ``optimizer.pt``); the core's ``async_save`` snapshots what it is given (see ``overlap_staging``).
        mirror_to: an object-store URL (``s3://bucket/run``): each committed checkpoint is copied there in the
            background, and a resume that finds no local checkpoint restores the newest from there first.
        export: ``"safetensors"`` or an ``ExportOptions``: after each commit, rank 0's writer exports the model
            as Hugging Face safetensors (docs/DESIGN.md, "Export").
        on_commit: called with each checkpoint's path once it committed (on each rank that saved it), on a
            thread of its own, in commit order, off the training loop; what it raises fails like a save, at the
            next sync point.
        log_metrics: report each save's stall, time to durable and bytes to the framework's own logging
            (Lightning's loggers, Accelerate's trackers, the Trainer's ``log``), from the training process.
        writer_idle_timeout: a writer started by a save (not by a framework's run) stops after this many
            seconds with nothing to do (None: only when torn down); the next save starts it again.
        object_store: how to reach an object store for ``s3://...`` (any fsspec URL) paths: ``storage_options``,
            multipart part size, parallel requests. Default: ``object_store.configure``'s, else fsspec's defaults.
        memory_tier: ``True`` (the defaults) or a ``MemoryTier``: checkpoints first committed to node-local memory
            and replicated to other nodes, every ``persist_every``-th also written durably; a restart loads from the
            nearest intact copy (docs/memory_tier.md). Off by default.
        cooperative_load: who reads from storage the files every rank of a job loads at a resume (Lightning's
            ``.ckpt`` under DDP, Accelerate's and the Trainer's model and optimizer files): ``"job"``, each byte once
            per job, split across the ranks, then shared over the process group; ``"node"``, split across one rank
            per node (where the network between nodes is slower than the storage); ``"off"``, every rank reads
            everything (``loading.cooperative``; docs/benchmarks/resume.md).
        share_unchanged: a save does not write again the items (tensors, objects) whose bytes equal those of the
            same items in the newest committed checkpoint beside it: it shares them (hard links; each checkpoint
            stays complete on its own, and loads alone after every other is deleted: docs/FORMAT.md). Off: every
            save writes everything.
        failures_per_day: how often the job fails (any cause), for the one log line at the first durable save
            that gives the checkpoint interval losing the least work at this run's measured costs (Young/Daly,
            ``api.interval``; docs/memory_tier.md). One a day by default.
    """

    max_in_flight: int = 2
    timeout: float = 600.0
    direct_io: bool = True
    io_threads: int = 2
    verify: bool = True
    resume_from_intact: bool = False
    overlap_optimizer: bool = True
    mirror_to: Optional[str] = None
    export: Optional[ExportOptions | str] = None
    on_commit: Optional[OnCommit] = None
    log_metrics: bool = True
    writer_idle_timeout: Optional[float] = 30.0
    object_store: Optional[ObjectStoreOptions] = None
    memory_tier: Optional[MemoryTier | bool] = None
    cooperative_load: Literal["job", "node", "off"] = "job"
    failures_per_day: float = 1.0
    share_unchanged: bool = True

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight={self.max_in_flight}: must be >= 1")
        if self.io_threads < 1:
            raise ValueError(f"io_threads={self.io_threads}: must be >= 1")
        if self.cooperative_load not in ("job", "node", "off"):
            raise ValueError(f"cooperative_load={self.cooperative_load!r}: one of 'job', 'node', 'off'")
        if self.timeout <= 0:
            raise ValueError(f"timeout={self.timeout}: must be > 0")
        object.__setattr__(self, "export", as_options(self.export))
        if not isinstance(self.memory_tier, (MemoryTier, type(None))):
            object.__setattr__(self, "memory_tier", MemoryTier() if self.memory_tier else None)

    def replace(self, **changes: Any) -> "CheckpointOptions":
        return dataclasses.replace(self, **changes)


NAMES = tuple(field.name for field in dataclasses.fields(CheckpointOptions))
F = TypeVar("F", bound=Callable[..., Any])


def taking_options(function: F) -> F:
    """Declare ``function(..., **kwargs)``'s keyword arguments as the ``CheckpointOptions`` fields (names,
    defaults, types) in its signature, for ``help()``, IDEs and signature-driven configuration (LightningCLI's
    jsonargparse builds a plugin from its ``init_args``), without repeating the fields in each entry point."""
    signature = inspect.signature(function)
    hints = typing.get_type_hints(CheckpointOptions)
    parameters = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    parameters += [inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default,
                                     annotation=hints[field.name]) for field in dataclasses.fields(CheckpointOptions)]
    function.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    return function


def resolve(owner: str, options: Optional[CheckpointOptions], given: dict[str, Any], *,
            own: tuple[str, ...] = ()) -> tuple[CheckpointOptions, dict[str, Any]]:
    """``owner``'s keyword arguments ``given`` (and its ``options=`` object, which they override) split into
    the shared ``CheckpointOptions`` and the options only ``owner`` has (named in ``own``). Renamed options are
    accepted under their old names with a ``FutureWarning``; any other name raises ``TypeError`` naming the
    accepted ones."""
    shared: dict[str, Any] = {}
    specific: dict[str, Any] = {}
    for name, value in given.items():
        if name in RENAMED and RENAMED[name] not in given:
            warnings.warn(f"{owner}({name}=...) is deprecated and will be removed in the next release: use "
                          f"{RENAMED[name]}=... (the same option in the core and every adapter)", FutureWarning,
                          stacklevel=3)
            name = RENAMED[name]
        if name in NAMES:
            shared[name] = value
        elif name in own:
            specific[name] = value
        else:
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}; it accepts the options of "
                            f"asyncckpt.core.CheckpointOptions ({', '.join(NAMES)})"
                            + (f" and its own ({', '.join(own)})" if own else ""))
    if options is not None and not isinstance(options, CheckpointOptions):
        raise TypeError(f"{owner}(options=...) takes an asyncckpt.core.CheckpointOptions, not {type(options).__name__}")
    base = options or CheckpointOptions()
    return (base.replace(**shared) if shared else base), specific
