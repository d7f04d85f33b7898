"""asyncckpt adapter for Hugging Face Accelerate (docs/accelerate.md).

    from asyncckpt.adapters.accelerate import enable_async_checkpointing
    handle = enable_async_checkpointing(accelerator)   # save_state() is now asynchronous and crash-safe
"""
from .async_checkpointing import AsyncCheckpointing, enable_async_checkpointing

__all__ = ["enable_async_checkpointing", "AsyncCheckpointing"]
