"""The framework functions the adapters rely on, pinned: an upgrade that changes one fails here, by name.

Two kinds of pins:

* **copied**: the adapter reproduces the function's behaviour (the Trainer's ``_save_checkpoint``
  and ``rotate_checkpoints``, Accelerate's naming and ``total_limit`` in ``save_state``, the sharded
  branch of Lightning's FSDP/ModelParallel ``save_checkpoint``...). Its source is pinned by digest:
  when it changes, read the new version against the adapter's copy (the module named in the
  failure), update the copy, then the digest.
* **relied on**: the adapter replaces or calls it, so its signature (or attribute) must stay.

Also: each adapter's supported version range is the one ``pyproject.toml`` declares for its extra,
and an adapter refuses a framework version outside it at construction, saying which.
"""
from __future__ import annotations

import hashlib
import inspect
import re
from importlib.metadata import requires
from pathlib import Path

import pytest

from asyncckpt.core import UnsupportedVersionError, versions

REPO = Path(__file__).resolve().parents[1]


def _original(owner, name):
    """``owner.name`` as the framework defines it (not an adapter's replacement)."""
    value = vars(owner)[name] if name in vars(owner) else getattr(owner, name)
    value = getattr(value, "__func__", value)  # staticmethod / classmethod
    return getattr(value, "__asyncckpt_original__", value)


def _digest(function) -> str:
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


def _import(path: str):
    module, _, attribute = path.rpartition(":")
    owner = __import__(module, fromlist=["_"])
    for part in attribute.split(".")[:-1]:
        owner = getattr(owner, part)
    return owner, attribute.split(".")[-1]


COPIED = {  # framework function -> (source digest, the adapter module that copies its behaviour)
    "lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint.file_exists": (
        "122bf349e529a6bf", "adapters/lightning/integration.py"),
    "lightning.pytorch.callbacks.model_checkpoint:ModelCheckpoint._link_checkpoint": (
        "e95d990a0117dae0", "adapters/lightning/integration.py"),
    "lightning.pytorch.strategies.fsdp:FSDPStrategy.save_checkpoint": (
        "100f8654b7672f52", "adapters/lightning/checkpoint_io.py (save_sharded)"),
    "lightning.pytorch.strategies.model_parallel:ModelParallelStrategy.save_checkpoint": (
        "e2b5a459fe87a28c", "adapters/lightning/checkpoint_io.py (save_sharded)"),
    "accelerate.accelerator:Accelerator.save_state": ("5a5c62cbfb58ea77", "adapters/accelerate/adapter.py"),
    "accelerate.utils.other:save": ("1f945adbd193e3af", "adapters/accelerate/capture.py"),
    "transformers.trainer:Trainer._save_checkpoint": ("a9111e30faa99339", "adapters/hf_trainer/saver.py"),
    "transformers.trainer_utils:rotate_checkpoints": ("4aac03e039844595", "adapters/hf_trainer/saver.py (_rotation)"),
    "transformers.trainer:Trainer._finalize_training": ("6d6d83d6a2715f2a", "adapters/hf_trainer/saver.py (_finalize)"),
}

RELIED_ON = {  # framework function -> the parameters the adapters pass or accept
    "lightning.pytorch.strategies.strategy:Strategy.setup_environment": "(self)",
    "lightning.pytorch.strategies.fsdp:FSDPStrategy.load_checkpoint": "(self, checkpoint_path, weights_only)",
    "lightning.pytorch.strategies.model_parallel:ModelParallelStrategy.load_checkpoint": "(self, checkpoint_path, weights_only)",
    "lightning.pytorch.strategies.fsdp:FSDPStrategy.teardown": "(self)",
    "lightning.pytorch.trainer.connectors.checkpoint_connector:_CheckpointConnector._parse_ckpt_path": (
        "(self, state_fn, ckpt_path, model_provided, model_connected)"),
    "lightning.pytorch.core.saving:pl_load": "(path_or_url, map_location, weights_only)",
    "lightning.pytorch.strategies.model_parallel:ModelParallelStrategy.teardown": "(self)",
    "accelerate.accelerator:Accelerator.load_state": "(self, input_dir, load_kwargs, **load_model_func_kwargs)",
    "accelerate.accelerator:Accelerator.end_training": "(self)",
    "accelerate.utils.other:clean_state_dict_for_safetensors": "(state_dict)",
    # a subclass's super()._save_checkpoint(model, trial) is ours while its override runs (hf_trainer/subclass.py)
    "transformers.trainer:Trainer._save_checkpoint": "(self, model, trial)",
    "transformers.trainer:Trainer._save_optimizer_and_scheduler": "(self, output_dir)",
    "transformers.trainer:Trainer._save_scaler": "(self, output_dir)",
    "transformers.trainer:Trainer._save_rng_state": "(self, output_dir)",
    "transformers.trainer:Trainer._get_output_dir": "(self, trial)",
    "transformers.trainer:Trainer.store_flos": "(self)",
    "transformers.trainer:Trainer.train": "(self, resume_from_checkpoint, trial, ignore_keys_for_eval)",
    "transformers.trainer:Trainer._push_from_checkpoint": "(self, checkpoint_folder)",
    "transformers.trainer_utils:sort_checkpoints": "(output_dir, checkpoint_prefix, use_mtime, best_model_checkpoint)",
    "transformers.modeling_utils:safe_save_file": "(tensors, filename, metadata)",
    "safetensors.torch:save_file": "(tensors, filename, metadata)",
    "peft.peft_model:safe_save_file": "(tensors, filename, metadata)",  # a PEFT model's adapter_model.safetensors
}


def _parameters(function) -> str:
    parts = []
    for parameter in inspect.signature(function).parameters.values():
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(parameter.kind, "")
        parts.append(prefix + parameter.name)
    return f"({', '.join(parts)})"


@pytest.mark.parametrize("target", list(COPIED))
def test_copied_framework_function_is_unchanged(target):
    framework = target.split(".")[0]
    pytest.importorskip(framework)
    expected, copy = COPIED[target]
    actual = _digest(_original(*_import(target)))
    assert actual == expected, (
        f"{target} changed in this {framework} version (source digest {actual}, pinned {expected}): "
        f"{copy} reproduces its behaviour; read the new version against it, update it, then the pin")


@pytest.mark.parametrize("target", list(RELIED_ON))
def test_framework_function_the_adapters_call_keeps_its_parameters(target):
    pytest.importorskip(target.split(".")[0])
    assert _parameters(_original(*_import(target))) == RELIED_ON[target], target


def test_framework_attributes_the_adapters_read():
    pytest.importorskip("lightning")
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    assert FSDPStrategy(state_dict_type="sharded")._state_dict_type == "sharded"
    assert ModelParallelStrategy()._save_distributed_checkpoint is True
    assert SingleDeviceStrategy("cpu")._checkpoint_io is None  # read without the lazy default getter
    assert hasattr(ModelCheckpoint(), "_fs")
    assert Accelerator(cpu=True)._optimizers == []
    import accelerate.checkpointing as checkpointing  # the two globals save_state writes files through

    assert callable(checkpointing.save) and checkpointing.torch.save is not None


@pytest.mark.parametrize("adapter,module,constant", [
    ("lightning", "asyncckpt.adapters.lightning.checkpoint_io", "SUPPORTED_LIGHTNING"),
    ("accelerate", "asyncckpt.adapters.accelerate.adapter", "SUPPORTED_ACCELERATE"),
    ("transformers", "asyncckpt.adapters.hf_trainer.callback", "SUPPORTED_TRANSFORMERS"),
])
def test_supported_range_is_the_one_pyproject_declares(adapter, module, constant):
    pytest.importorskip(adapter)
    supported = getattr(__import__(module, fromlist=["_"]), constant)
    declared = [r for r in requires("asyncckpt") if r.startswith(f"{adapter}") and f'extra == "{adapter}"' in r]
    assert declared, f"pyproject.toml declares no {adapter} extra"
    specifier = re.match(rf"{adapter}\s*([^;]*)", declared[0])[1].strip()
    assert sorted(specifier.split(",")) == sorted(supported.split(","))


def test_an_unsupported_framework_version_is_refused_at_construction(monkeypatch):
    pytest.importorskip("lightning")
    from asyncckpt.adapters.lightning import AsyncCkptIO
    from asyncckpt.adapters.lightning import checkpoint_io

    monkeypatch.setattr(checkpoint_io, "SUPPORTED_LIGHTNING", ">=9.0")
    with pytest.raises(UnsupportedVersionError, match=r"lightning adapter supports lightning >=9\.0; lightning 2\.\d+\.\d+ "
                                                      r"is installed"):
        AsyncCkptIO()
    with pytest.raises(UnsupportedVersionError, match="not installed"):
        versions.require("no-such-framework", ">=1", "lightning")


FROM_PRETRAINED_READERS = [  # made to wait for a checkpoint-N in flight: the path must stay their first argument
    "transformers.modeling_utils:PreTrainedModel.from_pretrained",
    "transformers.configuration_utils:PreTrainedConfig.from_pretrained",
    "transformers.tokenization_utils_base:PreTrainedTokenizerBase.from_pretrained",
    "transformers.models.auto.auto_factory:_BaseAutoModelClass.from_pretrained",
    "transformers.models.auto.modeling_auto:AutoModelForCausalLM.from_pretrained",  # each auto class has its own copy
    "transformers.models.auto.configuration_auto:AutoConfig.from_pretrained",
    "transformers.models.auto.tokenization_auto:AutoTokenizer.from_pretrained",
    "transformers.models.auto.processing_auto:AutoProcessor.from_pretrained",
]


@pytest.mark.parametrize("target", FROM_PRETRAINED_READERS)
def test_from_pretrained_takes_the_path_first(target):
    pytest.importorskip("transformers")
    owner, name = _import(target)
    assert isinstance(vars(owner)[name], classmethod), target
    function = _original(owner, name)  # the auto classes' copies say they wrap the base's bound method: not followed
    assert list(inspect.signature(function, follow_wrapped=False).parameters)[:2] == ["cls", "pretrained_model_name_or_path"]
