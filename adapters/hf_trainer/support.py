"""The Transformers releases this adapter supports and the Trainer functions it relies on
(see ``asyncckpt.core.integration.versions`` for the rule; ``tests/adapters/test_framework_contracts.py`` checks every
pin)."""
from asyncckpt.core.integration.versions import Called, Copied, Support

FROM_PRETRAINED = "from_pretrained"
# the path must stay the first argument
_FROM_PRETRAINED = Called("(cls, pretrained_model_name_or_path, ...)", feature=FROM_PRETRAINED)

SUPPORT = Support(
    package="transformers", extra="transformers", oldest="5.18.0", newest="5.25.0",
    copied={
        "transformers.trainer:Trainer._save_checkpoint": Copied("adapters/hf_trainer/saver.py", ("5d2ad2e0f2e5e5af",)),
        "transformers.trainer_utils:rotate_checkpoints": Copied(
            "adapters/hf_trainer/saver.py (_rotation)", ("c14ef64d3989cb9e",)),
        # wrapped, not copied: 532e0576... (5.19-5.25) differs only in the train-loss metrics it reports
        "transformers.trainer:Trainer._finalize_training": Copied(
            "adapters/hf_trainer/saver.py (_finalize)", ("17b7b20f1201358e", "532e05767538f522")),
    },
    relied_on={
        # a subclass's super()._save_checkpoint(model, trial) is ours while its override runs (hf_trainer/subclass.py)
        "transformers.trainer:Trainer._save_checkpoint": Called("(self, model, trial)"),
        "transformers.trainer:Trainer._save_optimizer_and_scheduler": Called("(self, output_dir)"),
        "transformers.trainer:Trainer._save_scaler": Called("(self, output_dir)"),
        "transformers.trainer:Trainer._save_rng_state": Called("(self, output_dir)"),
        "transformers.trainer:Trainer._get_output_dir": Called("(self, trial)"),
        "transformers.trainer:Trainer.store_flos": Called("(self)"),
        "transformers.trainer:Trainer.train": Called("(self, resume_from_checkpoint, trial, ignore_keys_for_eval)"),
        "transformers.trainer:Trainer._push_from_checkpoint": Called("(self, checkpoint_folder)"),
        # the save metrics go to the report_to integrations' on_log, as Trainer.log sends them (saver._log_metrics)
        "transformers.trainer_callback:CallbackHandler.on_log": Called("(self, args, state, control, logs, **kwargs)"),
        "transformers.trainer_utils:sort_checkpoints": Called("(output_dir, checkpoint_prefix, use_mtime, best_model_checkpoint)"),
        "transformers.modeling_utils:safe_save_file": Called("(tensors, filename, metadata)"),
        "safetensors.torch:save_file": Called("(tensors, filename, metadata)"),
        "peft.peft_model:safe_save_file": Called("(tensors, filename, metadata)"),  # a PEFT model's adapter_model.safetensors
        # made to wait for a checkpoint-N in flight (lifecycle.waiting_reader reads the path)
        "transformers.modeling_utils:PreTrainedModel.from_pretrained": _FROM_PRETRAINED,
        "transformers.configuration_utils:PreTrainedConfig.from_pretrained": _FROM_PRETRAINED,
        "transformers.tokenization_utils_base:PreTrainedTokenizerBase.from_pretrained": _FROM_PRETRAINED,
        "transformers.models.auto.auto_factory:_BaseAutoModelClass.from_pretrained": _FROM_PRETRAINED,
        # each auto class has its own copy (callback._auto_model_classes patches them all)
        "transformers.models.auto.modeling_auto:AutoModelForCausalLM.from_pretrained": _FROM_PRETRAINED,
        "transformers.models.auto.configuration_auto:AutoConfig.from_pretrained": _FROM_PRETRAINED,
        "transformers.models.auto.tokenization_auto:AutoTokenizer.from_pretrained": _FROM_PRETRAINED,
        "transformers.models.auto.processing_auto:AutoProcessor.from_pretrained": _FROM_PRETRAINED,
    },
    features={FROM_PRETRAINED: "from_pretrained of a checkpoint-N being written no longer waits for it (call "
                               "callback.wait() before loading one)"},
)
