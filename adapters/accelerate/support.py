"""The Accelerate releases this adapter supports and the Accelerate functions it relies on (see
``asyncckpt.core.versions`` for the rule; ``tests/test_framework_contracts.py`` checks every pin)."""
from asyncckpt.core.versions import Copied, Support

SUPPORT = Support(
    package="accelerate", extra="accelerate", oldest="1.10.0", newest="1.15.0",
    copied={
        "accelerate.accelerator:Accelerator.save_state": Copied(
            "adapters/accelerate/adapter.py", ("5a5c62cbfb58ea77",)),
        "accelerate.utils.other:save": Copied("adapters/accelerate/capture.py", ("1f945adbd193e3af",)),
    },
    relied_on={
        "accelerate.accelerator:Accelerator.load_state": "(self, input_dir, load_kwargs, **load_model_func_kwargs)",
        "accelerate.accelerator:Accelerator.end_training": "(self)",
        "accelerate.utils.other:clean_state_dict_for_safetensors": "(state_dict)",
        "safetensors.torch:save_file": "(tensors, filename, metadata)",
    },
)
