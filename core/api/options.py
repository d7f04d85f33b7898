"""``CheckpointOptions``: every option that means the same thing in the core and in every adapter, once.

More: docs/MODULES.md, core/api/options.py.
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

#: old name -> new name, accepted with a FutureWarning until the release after 0.2 (``overlap_staging``: the
#: Checkpointer's own option, until the next release)
RENAMED = {"verify_on_resume": "verify", "max_pending": "max_in_flight", "overlap_staging": "overlap_snapshot"}


@dataclass(frozen=True)
class MemoryTier:
    """The memory tier (docs/memory_tier.md): checkpoints committed to node-local memory first. Each field: docs/options.md.

    Args:
        replicas: copies of each node's shares on other nodes.
        persist_every: every so many checkpoints, one is also written durably.
        keep: memory checkpoints kept on each node.
        root: the memory root on each node (default ``/dev/shm/asyncckpt``).
        max_bytes: the most memory the tier may use on a node (default: half the memory root's filesystem).
        peer_timeout: seconds a save waits for a silent node before committing without its replicas.
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

    One line each here; what each means, its default and why: docs/options.md.

    Args:
        max_in_flight: checkpoints whose background write may be pending at once (each holds a snapshot buffer).
        timeout: bound, in seconds, on every wait (the writer, other ranks, the commit, back-pressure).
        direct_io: write with O_DIRECT where the filesystem supports it.
        io_threads: parallel write (and read) threads of each rank's background writer.
        verify: check checksums on every load, and a checkpoint before a framework resumes from it.
        resume_from_intact: resume from the newest intact checkpoint where the one a framework picked is damaged.
        overlap_optimizer: snapshot the optimizer's state after the save returns; ``optimizer.step()`` waits for it.
        mirror_to: an object-store URL each committed checkpoint is copied to in the background.
        export: ``"safetensors"`` or an ``ExportOptions``: export the model after each commit.
        on_commit: called with each checkpoint's path once it committed, off the training loop.
        log_metrics: report each save's costs to the framework's own logging.
        writer_idle_timeout: seconds after which an idle writer started by a save stops (None: at teardown).
        object_store: an ``ObjectStoreOptions``: how to reach an object store.
        memory_tier: ``True`` or a ``MemoryTier``: checkpoints first committed to node-local memory.
        cooperative_load: who reads the files every rank loads at a resume: ``"job"``, ``"node"`` or ``"off"``.
        share_unchanged: a save hard-links the items unchanged since the newest checkpoint instead of writing them.
        failures_per_day: how often the job fails, for the logged advice on the checkpoint interval.
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
                          f"{RENAMED[name]}=..." + (" (the same option in the core and every adapter)" if RENAMED[name] in NAMES else ""),
                          FutureWarning,
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
