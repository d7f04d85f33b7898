"""The Lightning releases this adapter supports and the Lightning functions it relies on
(see ``asyncckpt.core.integration.versions`` for the rule; ``tests/adapters/test_framework_contracts.py`` checks every
pin)."""
from asyncckpt.core.integration.versions import Called, Copied, Support

FSDP, MODEL_PARALLEL = "FSDP", "ModelParallel"

SUPPORT = Support(
    package="lightning", extra="lightning", oldest="2.6.0", newest="2.6.6",
    copied={
        "lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint.file_exists": Copied(
            "adapters/lightning/integration.py", ("20bb83d5ab352ca1",)),
        "lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint._link_checkpoint": Copied(
            "adapters/lightning/integration.py", ("4d5493816193f3ff",)),
        "lightning.pytorch.strategies.fsdp:FSDPStrategy.save_checkpoint": Copied(
            "adapters/lightning/checkpoint_io.py (save_sharded)", ("43fac83c91fac34f",), feature=FSDP),
        "lightning.pytorch.strategies.model_parallel:ModelParallelStrategy.save_checkpoint": Copied(
            "adapters/lightning/checkpoint_io.py (save_sharded)", ("995e953fcabd0503",), feature=MODEL_PARALLEL),
    },
    relied_on={
        "lightning.pytorch.strategies.strategy:Strategy.setup_environment": Called("(self)"),
        "lightning.pytorch.strategies.fsdp:FSDPStrategy.load_checkpoint": Called(
            "(self, checkpoint_path, weights_only)", feature=FSDP),
        "lightning.pytorch.strategies.model_parallel:ModelParallelStrategy.load_checkpoint": Called(
            "(self, checkpoint_path, weights_only)", feature=MODEL_PARALLEL),
        "lightning.pytorch.trainer.connectors.checkpoint_connector:_CheckpointConnector._parse_ckpt_path": Called(
            "(self, state_fn, ckpt_path, model_provided, model_connected)"),
        "lightning.pytorch.core.saving:pl_load": Called("(path_or_url, map_location, weights_only)"),
    },
    features={feature: f"sharded {feature} checkpoints are saved and loaded synchronously, by the strategy's own "
                       "save_checkpoint and load_checkpoint" for feature in (FSDP, MODEL_PARALLEL)},
)
