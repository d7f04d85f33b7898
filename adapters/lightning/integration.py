"""The places Lightning does not route through ``CheckpointIO``, wired to ``AsyncCkptIO``.

A ``CheckpointIO`` gets no reference to its trainer or strategy, and Lightning bypasses it for
sharded saves, for the ``-v1`` version check and for ``save_last="link"``. So that a user adds
only ``plugins=[AsyncCkptIO()]``, these methods are replaced once per process (through
``asyncckpt.core.integration.patching``). Each replacement first checks that the strategy's ``checkpoint_io``
is an ``AsyncCkptIO`` and otherwise calls the original unchanged, so trainers without the
plugin behave exactly as before.

=========================================================  =========================================
replaced                                                   with the plugin
=========================================================  =========================================
``Strategy.setup_environment``                             also starts the background writer (its
                                                           start-up overlaps the run's set-up)
``ModelCheckpoint.file_exists``                            a checkpoint still queued counts as
                                                           existing, one queued for removal as gone
                                                           (the ``-v1`` counter as without plugin)
``ModelCheckpoint._link_checkpoint``                       ``save_last="link"``: the symlink is made
                                                           (atomically) once its target committed
``FSDPStrategy`` / ``ModelParallelStrategy``               sharded saves go through
``.save_checkpoint``                                       ``Checkpointer.async_save`` (+ ``meta.pt``)
``FSDPStrategy`` / ``ModelParallelStrategy``               wait (all ranks), check a sharded
``.load_checkpoint``                                       checkpoint (each rank its share), load
``_CheckpointConnector._parse_ckpt_path``                  note which checkpoint Lightning picked
                                                           ("last", "best"): ``resume_from_intact``
``ModelCheckpoint._find_last_checkpoints``                 a ``dirpath`` URL: the candidates keep its
                                                           scheme (Lightning drops it, and then finds
                                                           no ``last.ckpt`` in object storage)
``FSDPStrategy`` / ``ModelParallelStrategy.teardown``      also calls ``checkpoint_io.teardown()``,
                                                           as other strategies do
``lightning.pytorch.core.saving.pl_load``                  ``load_from_checkpoint`` of a path still
                                                           being saved in this process waits for it
=========================================================  =========================================
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

from lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint
from lightning.pytorch.core import saving
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from asyncckpt.core.integration import lifecycle
from asyncckpt.core.integration import patching, resume, wait_for_orphans


_plugin_type: Optional[type] = None  # AsyncCkptIO, handed over by ``install`` (importing it here would be a cycle)


def plugin_of(strategy: Any) -> Optional[Any]:
    """The strategy's ``AsyncCkptIO``, or None (without touching the lazy ``checkpoint_io`` getter)."""
    io = getattr(strategy, "_checkpoint_io", None)
    return io if _plugin_type is not None and isinstance(io, _plugin_type) else None


def install(plugin_type: type) -> None:
    """Replace the methods listed above (idempotent), for strategies whose ``checkpoint_io`` is a
    ``plugin_type`` (the plugin installs them as its first instance is made or unpickled)."""
    global _plugin_type
    _plugin_type = plugin_type
    patching.install(Strategy, "setup_environment", _with_plugin(_start_writer))
    patching.install(ModelCheckpoint, "file_exists", _file_exists)
    patching.install(ModelCheckpoint, "_link_checkpoint", _link_checkpoint)
    patching.install(saving, "pl_load", lifecycle.waiting_reader)
    patching.install(_CheckpointConnector, "_parse_ckpt_path", _noting_the_pick)
    patching.install(ModelCheckpoint, "_find_last_checkpoints", _last_checkpoints_as_urls)
    for strategy, model_key, sharded in ((FSDPStrategy, "model", lambda s: s._state_dict_type == "sharded"),
                                         (ModelParallelStrategy, "state_dict", lambda s: s._save_distributed_checkpoint)):
        patching.install(strategy, "save_checkpoint", _sharded_save(model_key, sharded))
        patching.install(strategy, "load_checkpoint", _sharded_load)
        patching.install(strategy, "teardown", _teardown)


def _with_plugin(before: Callable[[Any], None]) -> Callable:
    """A replacement that runs ``before(plugin)`` on strategies with the plugin, then the original."""
    def make(original: Callable) -> Callable:
        def method(self, *args: Any, **kwargs: Any) -> Any:
            io = plugin_of(self)
            if io is not None:
                before(io)
            return original(self, *args, **kwargs)

        return method

    return make


def _start_writer(io: Any) -> None:
    io.checkpointer.start()


def _file_exists(original: Callable) -> Callable:
    def file_exists(self, filepath, trainer) -> bool:
        io = plugin_of(trainer.strategy)
        if io is None:
            return original(self, filepath, trainer)
        local = trainer.is_global_zero and io.checkpointer.will_exist(filepath)
        return trainer.strategy.reduce_boolean_decision(local, all=False)

    return file_exists


def _link_checkpoint(original: Callable) -> Callable:
    def link_checkpoint(trainer, filepath: str, linkpath: str) -> None:
        io = plugin_of(trainer.strategy)
        if io is None:
            return original(trainer, filepath, linkpath)
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            io.link(filepath, linkpath)
        trainer.strategy.barrier()

    return link_checkpoint


def _sharded_save(model_key: str, is_sharded: Callable[[Any], bool]) -> Callable:
    def make(original: Callable) -> Callable:
        def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
            io = plugin_of(self)
            if io is None or storage_options is not None or not is_sharded(self):
                if io is not None:  # the original may delete a sharded directory at this path
                    io.checkpointer.wait_for(os.path.abspath(os.fspath(filepath)))
                return original(self, checkpoint, filepath, storage_options=storage_options)
            io.save_sharded(self, checkpoint, filepath, model_key)

        return save_checkpoint

    return make


def _sharded_load(original: Callable) -> Callable:
    def load_checkpoint(self, checkpoint_path, *args: Any, **kwargs: Any) -> Any:
        io = plugin_of(self)
        if io is None:
            return original(self, checkpoint_path, *args, **kwargs)
        io.checkpointer.wait(everywhere=True)
        resume.wait_for_saves(os.path.abspath(os.fspath(checkpoint_path)))  # another plugin's, or an orphaned writer's
        if not (io.verify_on_resume and os.path.isdir(checkpoint_path)):  # a single file: the plugin's load checks it
            return original(self, checkpoint_path, *args, **kwargs)
        return io.checkpointer.load_while_checking(os.path.abspath(os.fspath(checkpoint_path)),
                                     lambda: original(self, checkpoint_path, *args, **kwargs), everywhere=True)

    return load_checkpoint


def _noting_the_pick(original: Callable) -> Callable:
    """Which checkpoint Lightning chose itself ("last", "best", "hpc"): only then may a damaged one
    be replaced by an older intact one (``resume_from_intact``). Before Lightning looks (a keyword,
    or None, where a SLURM requeue resumes its ``hpc_ckpt``), a writer of the previous run still
    finishing a checkpoint in the checkpoint directories is waited for, so the pick includes it."""
    def parse_ckpt_path(self, state_fn, ckpt_path, *args: Any, **kwargs: Any) -> Any:
        io = plugin_of(self.trainer.strategy)
        if io is not None and (ckpt_path is None or ckpt_path in ("last", "best", "hpc")):
            folders = {self.trainer.default_root_dir} | {cb.dirpath for cb in self.trainer.checkpoint_callbacks
                                                         if getattr(cb, "dirpath", None)}
            for folder in sorted(map(str, folders)):
                if "://" not in folder:
                    wait_for_orphans(os.path.abspath(folder), io.timeout)
        resolved = original(self, state_fn, ckpt_path, *args, **kwargs)
        if io is not None:
            picked = ckpt_path in ("last", "best", "hpc", "registry") and resolved
            io.picked_by_lightning = os.path.abspath(os.fspath(resolved)) if picked else None
        return resolved

    return parse_ckpt_path


def _last_checkpoints_as_urls(original: Callable) -> Callable:
    def find_last_checkpoints(self, trainer) -> set[str]:
        found = original(self, trainer)
        scheme = str(self.dirpath).split("://", 1)[0] if "://" in str(self.dirpath) else None
        if plugin_of(trainer.strategy) is None or scheme is None:
            return found
        return {path if "://" in path else f"{scheme}://{path}" for path in found}

    return find_last_checkpoints


def _teardown(original: Callable) -> Callable:
    def teardown(self) -> None:
        io = plugin_of(self)
        try:
            if io is not None:
                io.teardown()
        finally:
            original(self)

    return teardown
