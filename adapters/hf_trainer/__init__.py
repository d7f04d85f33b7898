"""asyncckpt adapter for the Hugging Face Transformers ``Trainer`` (see docs/hf_trainer.md).

    from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback
    trainer = Trainer(..., callbacks=[AsyncCheckpointCallback()])
"""
from .callback import AsyncCheckpointCallback
from .saver import AsyncCheckpointSaver

__all__ = ["AsyncCheckpointCallback", "AsyncCheckpointSaver"]
