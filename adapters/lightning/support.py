"""The Lightning releases this adapter supports and the Lightning functions it relies on (see
``asyncckpt.core.integration.versions`` for the rule; ``tests/test_framework_contracts.py`` checks every pin)."""
from asyncckpt.core.integration.versions import Copied, Support

SUPPORT = Support(
    package="lightning", extra="lightning", oldest="2.6.0", newest="2.6.6",
    copied={
        "lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint.file_exists": Copied(
            "adapters/lightning/integration.py", ("122bf349e529a6bf",)),
        "lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint._link_checkpoint": Copied(
            "adapters/lightning/integration.py", ("e95d990a0117dae0",)),
        "lightning.pytorch.strategies.fsdp:FSDPStrategy.save_checkpoint": Copied(
            "adapters/lightning/checkpoint_io.py (save_sharded)", ("100f8654b7672f52",)),
        "lightning.pytorch.strategies.model_parallel:ModelParallelStrategy.save_checkpoint": Copied(
            "adapters/lightning/checkpoint_io.py (save_sharded)", ("e2b5a459fe87a28c",)),
    },
    relied_on={
        "lightning.pytorch.strategies.strategy:Strategy.setup_environment": "(self)",
        "lightning.pytorch.strategies.fsdp:FSDPStrategy.load_checkpoint": "(self, checkpoint_path, weights_only)",
        "lightning.pytorch.strategies.model_parallel:ModelParallelStrategy.load_checkpoint":
            "(self, checkpoint_path, weights_only)",
        "lightning.pytorch.strategies.fsdp:FSDPStrategy.teardown": "(self)",
        "lightning.pytorch.strategies.model_parallel:ModelParallelStrategy.teardown": "(self)",
        "lightning.pytorch.trainer.connectors.checkpoint_connector:_CheckpointConnector._parse_ckpt_path":
            "(self, state_fn, ckpt_path, model_provided, model_connected)",
        "lightning.pytorch.core.saving:pl_load": "(path_or_url, map_location, weights_only)",
    },
)
