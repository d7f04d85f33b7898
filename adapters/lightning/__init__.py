"""asyncckpt adapter for Lightning: ``Trainer(plugins=[AsyncCkptIO()])`` or ``Fabric(plugins=[AsyncCkptIO()])``
(see docs/lightning.md)."""
from .checkpoint_io import AsyncCkptIO, AsyncCkptSaveError

__all__ = ["AsyncCkptIO", "AsyncCkptSaveError"]
