"""The places Lightning does not route through ``CheckpointIO``, wired to ``AsyncCkptIO``.

A ``CheckpointIO`` gets no reference to its trainer or strategy, and Lightning bypasses it for
sharded saves, for the ``-v1`` version check and for ``save_last="link"``. So that a user adds
only ``plugins=[AsyncCkptIO()]``, the first ``AsyncCkptIO`` wraps these methods once per process.
Every wrapper first checks that the strategy's ``checkpoint_io`` is an ``AsyncCkptIO`` and
otherwise calls the original unchanged, so trainers without the plugin behave exactly as before.

=========================================================  =========================================
wrapped                                                    with the plugin
=========================================================  =========================================
``ModelCheckpoint.file_exists``                            a checkpoint still queued counts as
                                                           existing, one queued for removal as gone
                                                           (the ``-v1`` counter as without plugin)
``ModelCheckpoint._link_checkpoint``                       ``save_last="link"``: the symlink is made
                                                           (atomically) once its target is complete
``FSDPStrategy`` / ``ModelParallelStrategy``               sharded saves go through
``.save_checkpoint``                                       ``Checkpointer.async_save`` (+ ``meta.pt``)
``FSDPStrategy`` / ``ModelParallelStrategy``               drain (all ranks) before loading
``.load_checkpoint``
``FSDPStrategy`` / ``ModelParallelStrategy.teardown``      also calls ``checkpoint_io.teardown()``
                                                           (drain + raise), as other strategies do
=========================================================  =========================================
"""
from __future__ import annotations

import functools
import importlib
from typing import Any, Optional

_installed = False
ORIGINALS: dict[str, Any] = {}


def plugin_of(strategy) -> Optional[Any]:
    """The strategy's ``AsyncCkptIO``, or None (without touching the lazy ``checkpoint_io`` getter)."""
    from .checkpoint_io import AsyncCkptIO

    io = getattr(strategy, "_checkpoint_io", None)
    return io if isinstance(io, AsyncCkptIO) else None


def install() -> None:
    """Wrap the methods listed above (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    from lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint

    _wrap(ModelCheckpoint, "file_exists", _file_exists)
    original_link = ModelCheckpoint.__dict__["_link_checkpoint"].__func__
    ORIGINALS["ModelCheckpoint._link_checkpoint"] = original_link

    @functools.wraps(original_link)
    def link_checkpoint(trainer, filepath, linkpath):
        return _link_checkpoint(original_link, trainer, filepath, linkpath)

    link_checkpoint.__asyncckpt_wrapped__ = original_link
    ModelCheckpoint._link_checkpoint = staticmethod(link_checkpoint)

    for module_name, class_name, model_key, is_sharded in (
        ("lightning.pytorch.strategies.fsdp", "FSDPStrategy", "model",
         lambda s: getattr(s, "_state_dict_type", None) == "sharded"),
        ("lightning.pytorch.strategies.model_parallel", "ModelParallelStrategy", "state_dict",
         lambda s: bool(getattr(s, "_save_distributed_checkpoint", False))),
    ):
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):  # pragma: no cover - older/newer Lightning
            continue
        _wrap(cls, "save_checkpoint", _make_save(model_key, is_sharded))
        _wrap(cls, "load_checkpoint", _strategy_load)
        _wrap(cls, "teardown", _strategy_teardown)


def _wrap(cls, name: str, impl) -> None:
    original = cls.__dict__[name]
    ORIGINALS[f"{cls.__name__}.{name}"] = original

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        return impl(original, self, *args, **kwargs)

    method.__asyncckpt_wrapped__ = original
    setattr(cls, name, method)


# ---------------------------------------------------------------------- ModelCheckpoint
def _file_exists(original, self, filepath, trainer) -> bool:
    io = plugin_of(trainer.strategy)
    if io is None:
        return original(self, filepath, trainer)
    local = False
    if trainer.is_global_zero:
        queued = io.virtually_exists(filepath)
        local = self._fs.exists(filepath) if queued is None else queued
    return trainer.strategy.reduce_boolean_decision(local, all=False)


def _link_checkpoint(original, trainer, filepath: str, linkpath: str) -> None:
    io = plugin_of(trainer.strategy)
    if io is None:
        return original(trainer, filepath, linkpath)
    import os

    if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
        io.link(filepath, linkpath)
    trainer.strategy.barrier()


# ---------------------------------------------------------------------- FSDP / ModelParallel
def _make_save(model_key: str, is_sharded):
    def _strategy_save(original, self, checkpoint, filepath, storage_options=None):
        io = plugin_of(self)
        if io is None:
            return original(self, checkpoint, filepath, storage_options=storage_options)
        if not is_sharded(self):
            io.settle_path(str(filepath))  # the original may rmtree a sharded dir at this path
            return original(self, checkpoint, filepath, storage_options=storage_options)
        return io.save_sharded(self, checkpoint, filepath, storage_options, model_key)

    return _strategy_save


def _strategy_load(original, self, checkpoint_path, weights_only=None):
    io = plugin_of(self)
    if io is not None:
        io.drain_collectively()
    return original(self, checkpoint_path, weights_only=weights_only)


def _strategy_teardown(original, self) -> None:
    io = plugin_of(self)
    try:
        if io is not None:
            io.teardown()
    finally:
        original(self)
