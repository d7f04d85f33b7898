"""The Accelerate releases this adapter supports and the Accelerate functions it relies on (see
``asyncckpt.core.integration.versions`` for the rule; ``tests/test_framework_contracts.py`` checks every pin)."""
from asyncckpt.core.integration.versions import Copied, Support

SUPPORT = Support(
    package="accelerate", extra="accelerate", oldest="1.13.0", newest="1.16.0",
    copied={
        "accelerate.accelerator:Accelerator.save_state": Copied(
            "adapters/accelerate/async_checkpointing.py", ("5a5c62cbfb58ea77",)),
        "accelerate.utils.other:save": Copied("adapters/accelerate/capture.py", ("1f945adbd193e3af",)),
        # capture_fsdp_torch_save stages every torch.save these make on the process making it: that they
        # gate full state dicts to process 0 and name per-rank files (use_dcp=False) by process_index
        # (1.13/1.14's variants, before use_dcp existed, gate full state dicts the same way)
        "accelerate.utils.fsdp_utils:save_fsdp_model": Copied(
            "adapters/accelerate/capture.py", ("0ad60b659f961a60", "75a8de7f7825930c")),
        "accelerate.utils.fsdp_utils:save_fsdp_optimizer": Copied(
            "adapters/accelerate/capture.py", ("bce300993fe7cb06", "68cfcfd2d36c59ff", "d417249cd2ab952b")),
    },
    relied_on={
        "accelerate.accelerator:Accelerator.load_state": "(self, input_dir, load_kwargs, **load_model_func_kwargs)",
        "accelerate.accelerator:Accelerator.end_training": "(self)",
        "accelerate.utils.other:clean_state_dict_for_safetensors": "(state_dict)",
        # docs/accelerate.md: use_dcp=False (accelerate 1.15+) is bound on these (and the two save functions)
        "accelerate.utils.fsdp_utils:load_fsdp_model":
            "(fsdp_plugin, accelerator, model, input_dir, model_index, adapter_only, ...)",
        "accelerate.utils.fsdp_utils:load_fsdp_optimizer":
            "(fsdp_plugin, accelerator, optimizer, model, input_dir, optimizer_index, adapter_only, ...)",
        "safetensors.torch:save_file": "(tensors, filename, metadata)",
    },
)
