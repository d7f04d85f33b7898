"""The places Lightning does not route through ``CheckpointIO``, wired to ``AsyncCkptIO``.

More: docs/MODULES.md, adapters/lightning/integration.py.
"""
from __future__ import annotations

import os
import re
import urllib.parse
from typing import Any, Callable, Optional

from lightning.pytorch.callbacks.model_checkpoint import ModelCheckpoint
from lightning.pytorch.core import saving
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

from asyncckpt.core.integration import dist_env, is_url, lifecycle, normalize_path, patching, resume, versions

from .support import FSDP, MODEL_PARALLEL


_plugin_type: Optional[type] = None  # AsyncCkptIO, handed over by ``install`` (importing it here would be a cycle)


def plugin_of(strategy: Any) -> Optional[Any]:
    """The strategy's ``AsyncCkptIO``, or None (without touching the lazy ``checkpoint_io`` getter)."""
    io = getattr(strategy, "_checkpoint_io", None)
    return io if _plugin_type is not None and isinstance(io, _plugin_type) else None


def install(plugin_type: type, release: versions.Release) -> None:
    """Replace the methods listed above (idempotent), for strategies whose ``checkpoint_io`` is a
    ``plugin_type`` (the plugin installs them as its first instance is made or unpickled); a strategy
    whose feature the installed ``release`` refuses keeps its own sharded saves and loads."""
    global _plugin_type
    _plugin_type = plugin_type
    patching.install_on_subclasses((Strategy,), "setup_environment", _after_with_plugin(_start_writer))
    patching.install(ModelCheckpoint, "file_exists", _file_exists)
    patching.install(ModelCheckpoint, "_link_checkpoint", _link_checkpoint)
    patching.install(saving, "pl_load", lifecycle.waiting_reader)
    patching.install(_CheckpointConnector, "_parse_ckpt_path", _noting_the_pick)
    patching.install(ModelCheckpoint, "_find_last_checkpoints", _last_checkpoints)
    patching.install(ModelCheckpoint, "setup", _expecting_replicas)
    for strategy, feature, model_key, sharded in (
            (FSDPStrategy, FSDP, "model", lambda s: s._state_dict_type == "sharded"),
            (ModelParallelStrategy, MODEL_PARALLEL, "state_dict", lambda s: s._save_distributed_checkpoint)):
        if release.allows(feature):
            patching.install(strategy, "save_checkpoint", _sharded_save(model_key, sharded))
            patching.install(strategy, "load_checkpoint", _sharded_load)
        patching.install(strategy, "teardown", _teardown)  # they do not call checkpoint_io.teardown()


def _after_with_plugin(after: Callable[[Any, Any], None]) -> Callable:
    """A replacement that runs the original, then ``after(strategy, plugin)`` on strategies with the plugin."""
    def make(original: Callable) -> Callable:
        def method(self, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            io = plugin_of(self)
            if io is not None:
                after(self, io)
            return result

        return method

    return make


def _start_writer(strategy: Any, io: Any) -> None:
    """Run by the base ``Strategy.setup_environment`` and again once a subclass's own is done (its process group
    up: on several nodes the memory tier finds the job's nodes then, on every rank, not only on the rank that
    saves). The writer itself starts at the first optimizer step (``Checkpointer.start``): after a resume's
    restore, whose cores its start-up would share."""
    io.checkpointer.start(at_first_step=True)
    io.trainer = getattr(strategy.lightning_module, "_trainer", None) if strategy.lightning_module else None


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
        if trainer.is_global_zero and normalize_path(filepath) != normalize_path(linkpath):
            io.link(filepath, linkpath)
        trainer.strategy.barrier()

    return link_checkpoint


def _sharded_save(model_key: str, is_sharded: Callable[[Any], bool]) -> Callable:
    def make(original: Callable) -> Callable:
        def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
            io = plugin_of(self)
            if io is None or storage_options is not None or not is_sharded(self):
                if io is not None:  # the original may delete a sharded directory at this path
                    io.checkpointer.wait_for(filepath)
                return original(self, checkpoint, filepath, storage_options=storage_options)
            io.save_sharded(self, checkpoint, filepath, model_key)

        return save_checkpoint

    return make


def _sharded_load(original: Callable) -> Callable:
    def load_checkpoint(self, checkpoint_path, *args: Any, **kwargs: Any) -> Any:
        io = plugin_of(self)
        path = normalize_path(checkpoint_path)
        if io is None or not os.path.isdir(path):  # a single file: the plugin's own load checks it
            if io is not None:
                resume.prepare(io.checkpointer, path)
            return original(self, checkpoint_path, *args, **kwargs)
        return resume.resume(io.checkpointer, lambda _path: original(self, checkpoint_path, *args, **kwargs),
                             reads="directory", path=path)

    return load_checkpoint


def _noting_the_pick(original: Callable) -> Callable:
    """Which checkpoint Lightning chose itself ("last", "best", "hpc"): only then may a damaged one
    be replaced by an older intact one (``resume_from_intact``). Before Lightning looks (a keyword,
    or None, where a SLURM requeue resumes its ``hpc_ckpt``), the checkpoint directories are made ready
    (``resume.prepare``: saves in flight, a writer of the previous run still finishing a checkpoint, and with
    ``mirror_to`` a ``last.ckpt`` that is not here restored), so that the pick includes them."""
    def parse_ckpt_path(self, state_fn, ckpt_path, *args: Any, **kwargs: Any) -> Any:
        io = plugin_of(self.trainer.strategy)
        if io is not None and (ckpt_path is None or ckpt_path in ("last", "best", "hpc")):
            if ckpt_path == "last" and io.checkpointer.memory_tier_active and self.trainer.num_nodes > 1 and not dist_env.dist_ready():
                self.trainer.strategy.setup_environment()  # the nodes meet before Lightning picks (it skips it later)
            folders = {self.trainer.default_root_dir} | {cb.dirpath for cb in self.trainer.checkpoint_callbacks
                                                         if getattr(cb, "dirpath", None)}
            for folder in sorted(map(str, folders)):
                resume.prepare(io.checkpointer, normalize_path(folder),
                               mirrored_name=ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION
                               if ckpt_path == "last" else None)
            if ckpt_path == "last":  # with the memory tier on several nodes: the same last*.ckpt on every node
                for callback in self.trainer.checkpoint_callbacks:
                    dirpath = getattr(callback, "dirpath", None)
                    if isinstance(callback, ModelCheckpoint) and dirpath is not None and not is_url(str(dirpath)):
                        io.checkpointer.assemble_from_memory(normalize_path(str(dirpath)),
                                                             single_files=_last_name(callback).match)
        resolved = original(self, state_fn, ckpt_path, *args, **kwargs)
        if io is not None:
            picked = ckpt_path in ("last", "best", "hpc", "registry") and resolved
            io.picked_by_lightning = normalize_path(resolved) if picked else None
        return resolved

    return parse_ckpt_path


def _last_checkpoints(original: Callable) -> Callable:
    def find_last_checkpoints(self, trainer) -> set[str]:
        found = original(self, trainer)
        io = plugin_of(trainer.strategy)
        if io is None or self.dirpath is None:
            return found
        if is_url(str(self.dirpath)):
            scheme = urllib.parse.urlsplit(str(self.dirpath)).scheme
            found = {path if is_url(path) else f"{scheme}://{path}" for path in found}
        last = _last_name(self)
        for folder in resume.places(io.checkpointer, normalize_path(str(self.dirpath)))[1:]:  # in memory
            usable = io.checkpointer.usable_in_memory(folder)  # on several nodes: what every node holds (none before a load)
            found |= {os.path.join(folder, name) for name in os.listdir(folder)
                      if last.match(name) and (usable is None or name in usable)} if os.path.isdir(folder) else set()
        return found

    return find_last_checkpoints


def _last_name(callback: ModelCheckpoint) -> re.Pattern:
    """The names of the ``last*.ckpt`` files ``callback`` saves (``last.ckpt``, ``last-v1.ckpt``)."""
    return re.compile(rf"^{re.escape(callback.CHECKPOINT_NAME_LAST)}(-\d+)?{re.escape(callback.FILE_EXTENSION)}$")


def _expecting_replicas(original: Callable) -> Callable:
    def setup(self, trainer, *args: Any, **kwargs: Any) -> None:
        original(self, trainer, *args, **kwargs)
        io = plugin_of(trainer.strategy)
        if io is not None and self.dirpath is not None:
            io.checkpointer.expect_replicas(normalize_path(str(self.dirpath)))

    return setup


def _teardown(original: Callable) -> Callable:
    def teardown(self, *args: Any, **kwargs: Any) -> None:
        io = plugin_of(self)
        try:
            if io is not None:
                io.teardown()
        finally:
            original(self, *args, **kwargs)

    return teardown
