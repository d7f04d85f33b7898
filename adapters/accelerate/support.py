"""The Accelerate releases this adapter supports and the Accelerate functions it relies on
(see ``asyncckpt.core.integration.versions`` for the rule; ``tests/adapters/test_framework_contracts.py`` checks every
pin)."""
from asyncckpt.core.integration.versions import Called, Copied, Support

FSDP = "FSDP"

SUPPORT = Support(
    package="accelerate", extra="accelerate", oldest="1.13.0", newest="1.16.0",
    copied={
        "accelerate.accelerator:Accelerator.save_state": Copied(
            "adapters/accelerate/async_checkpointing.py", ("1891216aa55ef9e7",)),
        "accelerate.utils.other:save": Copied("adapters/accelerate/capture.py", ("f1f6e0f96d88c51e",)),
        # capture_fsdp_torch_save stages every torch.save these make on the process making it: that they
        # gate full state dicts to process 0 and name per-rank files (use_dcp=False) by process_index
        # (1.13/1.14's variants, before use_dcp existed, gate full state dicts the same way; 1.16's optimizer
        # saver unwraps the AcceleratedOptimizer before get_optimizer_state_dict, which the capture does not see)
        "accelerate.utils.fsdp_utils:save_fsdp_model": Copied(
            "adapters/accelerate/capture.py", ("63db39c6f9e30c58", "8199975e64bd3645"), feature=FSDP),
        "accelerate.utils.fsdp_utils:save_fsdp_optimizer": Copied(
            "adapters/accelerate/capture.py", ("d144e5dc00971c03", "c8342fe0c812357b", "f8660b3e1335bedd"),
            feature=FSDP),
    },
    relied_on={
        # the capture replaces the two globals it writes every file through (1.16 takes RNG state through
        # torch.accelerator, still saved with torch.save)
        "accelerate.checkpointing:save_accelerator_state": Called(
            "(output_dir, model_states, optimizers, schedulers, dataloaders, process_index, step, ...)",
            calls=("save", "torch.save")),
        "accelerate.accelerator:Accelerator.load_state": Called("(self, input_dir, load_kwargs, **load_model_func_kwargs)"),
        "accelerate.accelerator:Accelerator.end_training": Called("(self)"),
        "accelerate.utils.other:clean_state_dict_for_safetensors": Called("(state_dict)"),
        # docs/accelerate.md: use_dcp=False (accelerate 1.15+) is bound on these (and the two save functions)
        "accelerate.utils.fsdp_utils:load_fsdp_model": Called(
            "(fsdp_plugin, accelerator, model, input_dir, model_index, adapter_only, ...)", feature=FSDP),
        "accelerate.utils.fsdp_utils:load_fsdp_optimizer": Called(
            "(fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index, adapter_only, ...)", feature=FSDP),
        "safetensors.torch:save_file": Called("(tensors, filename, metadata)"),
    },
    features={FSDP: "FSDP checkpoints are saved and loaded synchronously, by Accelerate's own save_state and "
                    "load_state"},
)
