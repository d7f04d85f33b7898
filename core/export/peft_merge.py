"""The merged weights of a PEFT LoRA checkpoint, as export pieces: base weight + its adapter's delta.

More: docs/MODULES.md, core/export/peft_merge.py.
"""
from __future__ import annotations

import json
import math
import os

import torch

from asyncckpt.core.errors import CheckpointWriteError
from asyncckpt.core.export import sources
from asyncckpt.core.export.sources import Piece, Source, SourceTensor

_PEFT_PREFIX = "base_model.model."


def _tensor(source: Source, key: str) -> torch.Tensor:
    """One whole tensor of a safetensors source, read into memory."""
    (piece,) = source.tensors[key].pieces
    with open(piece.file, "rb") as f:
        f.seek(piece.data_start)
        data = bytearray(f.read(piece.nbytes))
    tensor = source.tensors[key]
    return torch.frombuffer(data, dtype=getattr(torch, tensor.dtype)).reshape(tensor.shape) if data else \
        torch.empty(tensor.shape, dtype=getattr(torch, tensor.dtype))


def _base_model_dir(adapter: Source, name: str) -> str:
    """The base model's directory: ``name`` itself, or a Hugging Face Hub id (``org/model``, what adapter configs
    hold) fetched into the Hub's cache as ``from_pretrained`` would (its safetensors and JSON files; the environment's
    token, ``HF_HUB_OFFLINE``, ``HF_HOME``)."""
    if os.path.isdir(name):
        return name
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name, allow_patterns=["*.safetensors", "*.json"])
    except Exception as error:  # noqa: BLE001 - said with the way out
        raise CheckpointWriteError(f"{adapter.path}: its base model {name!r} is neither a local directory nor a model "
                                   f"the Hugging Face Hub gave ({type(error).__name__}: {error}): give "
                                   "ExportOptions(base_model=<the base model's directory>) to merge",
                                   path=adapter.path) from error


def merged(adapter: Source, base_model: str | None) -> Source:
    """The base model's tensors, with every LoRA-targeted weight merged (names as the base model's)."""
    with open(os.path.join(adapter.files_dir, "adapter_config.json")) as f:
        config = json.load(f)
    base_path = base_model or config.get("base_model_name_or_path")
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("rank_pattern") \
            or config.get("alpha_pattern"):
        raise CheckpointWriteError(f"{adapter.path}: merging is supported for plain LoRA adapters (this one: "
                                   f"{config.get('peft_type')}, use_dora={config.get('use_dora')}, rank_pattern="
                                   f"{config.get('rank_pattern')}, alpha_pattern={config.get('alpha_pattern')}); export "
                                   "the adapter alone (peft='adapter')", path=adapter.path)
    base = sources.find(_base_model_dir(adapter, base_path)) if base_path else None
    if base is None:
        raise CheckpointWriteError(f"{adapter.path}: its base model {base_path!r} is not a directory of safetensors "
                                   "files: give ExportOptions(base_model=...) to merge", path=adapter.path)
    rank, alpha = config["r"], config["lora_alpha"]
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = dict(base.tensors)
    for key in adapter.tensors:
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removeprefix(_PEFT_PREFIX).removesuffix(".lora_A.weight")
        weight = f"{module}.weight"
        if weight not in tensors:
            raise CheckpointWriteError(f"{adapter.path}: adapter weight {key!r} targets {weight!r}, which the base "
                                       f"model {base_path} does not have", path=adapter.path)
        lora_a, lora_b = key, key.replace(".lora_A.", ".lora_B.")
        original = tensors[weight]

        def load(weight=weight, lora_a=lora_a, lora_b=lora_b) -> memoryview:
            base_weight = _tensor(base, weight).clone()
            a, b = _tensor(adapter, lora_a), _tensor(adapter, lora_b)
            half = b.dtype in (torch.float16, torch.bfloat16)
            delta = (b.float() @ a.float()) if half else b @ a
            delta = (delta.T if config.get("fan_in_fan_out") else delta) * scaling
            base_weight += delta.to(b.dtype) if half else delta
            return memoryview(base_weight.reshape(-1).view(torch.uint8).numpy())

        tensors[weight] = SourceTensor(weight, original.dtype, original.shape,
                                       [Piece((0,) * len(original.shape), original.shape,
                                              original.pieces[0].nbytes, load=load)])
    return Source(adapter.path, tensors, "", files_dir=base.files_dir)

