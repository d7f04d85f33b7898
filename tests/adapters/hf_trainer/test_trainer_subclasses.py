"""Trainer subclasses with ``AsyncCheckpointCallback``: their own ``_save_checkpoint`` runs, and what it
writes lands where it would natively.

TRL's trainers (the real ones: ``SFTTrainer`` with and without a PEFT LoRA adapter, ``RewardTrainer``) write
their model card in ``_save_checkpoint`` before calling the Trainer's; users' subclasses add files inside and
outside ``checkpoint-N``. Each case trains a tiny model, built from a config in code (nothing is downloaded),
natively and with the callback, in the same ``output_dir`` one after the other (so that the paths recorded in
files agree), in two ``train()`` calls (the second resumes from the first's newest checkpoint), and compares
every file the two runs left: the same names, the same bytes (torch pickles: the same objects; trainer state:
without wall-clock fields).
"""
from __future__ import annotations

import io
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("trl")
pytest.importorskip("peft")

from datasets import Dataset  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification,  # noqa: E402
                          PreTrainedTokenizerFast, Trainer, TrainerCallback, TrainingArguments)

from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback  # noqa: E402
from asyncckpt.core import Checkpointer, is_complete  # noqa: E402

COMMIT_RECORD = ".asyncckpt-commit.json"
WORDS = 60


@pytest.fixture(scope="module")
def checkpointer():
    """One writer process for the module's runs."""
    checkpointer = Checkpointer()
    yield checkpointer
    checkpointer.close()


# ---------------------------------------------------------------------- tiny models and data, made here
def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "[PAD]": 1, "</s>": 2, "<s>": 3, **{f"w{i}": i + 4 for i in range(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", eos_token="</s>",
                                   bos_token="<s>")


def _llama(model_class=LlamaForCausalLM, **config):
    torch.manual_seed(0)
    return model_class(LlamaConfig(vocab_size=WORDS + 4, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=1, eos_token_id=2, bos_token_id=3, **config))


def _sentences(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [" ".join(f"w{int(i)}" for i in torch.randint(0, WORDS, (10,), generator=g)) for _ in range(n)]


def _token_ids() -> Dataset:
    ids = [[int(i) + 4 for i in torch.randint(0, WORDS, (12,), generator=torch.Generator().manual_seed(k))]
           for k in range(32)]
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


# ---------------------------------------------------------------------- runs and their comparison
def _native_and_async(tmp_path: Path, make_trainer, checkpointer, steps=(2, 4)) -> dict:
    """The same training natively and with the callback, each as ``train()`` to ``steps[0]``, then
    ``train(resume_from_checkpoint=True)`` to ``steps[1]``; both in ``tmp_path/run``, then moved to
    ``tmp_path/native`` and ``tmp_path/async``. Returns the last Trainer of each."""
    trainers = {}
    for name in ("native", "async"):
        for part, max_steps in enumerate(steps):
            callbacks = [AsyncCheckpointCallback(checkpointer=checkpointer)] if name == "async" else []
            trainers[name] = make_trainer(tmp_path / "run", callbacks, max_steps)
            trainers[name].train(resume_from_checkpoint=part > 0)
        (tmp_path / "run").rename(tmp_path / name)
    return trainers


def _files(run: Path) -> list[str]:
    """Every file the run left, relative to its folder (hidden leftovers included), without commit records."""
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and p.name != COMMIT_RECORD)


def _contents(path: Path):
    """What must be equal between a native and an asynchronous run: a torch pickle's objects (re-serialised:
    the archive's layout may differ), trainer_state.json without wall-clock fields, any other file's bytes."""
    if path.suffix in (".pt", ".pth", ".bin"):
        canonical = io.BytesIO()
        torch.save(torch.load(path, weights_only=False), canonical)
        return canonical.getvalue()
    if path.name == "trainer_state.json":
        state = json.loads(path.read_text())
        state["log_history"] = [{k: v for k, v in entry.items() if not k.endswith(("runtime", "_per_second"))}
                                for entry in state["log_history"]]
        return state
    return path.read_bytes()


def _assert_same_runs(tmp_path: Path) -> list[str]:
    """The asynchronous run left the native run's files, each the same, and every checkpoint committed."""
    native, ours = tmp_path / "native", tmp_path / "async"
    files = _files(ours)
    assert files == _files(native)
    for name in files:
        assert _contents(ours / name) == _contents(native / name), name
    checkpoints = sorted(p for p in ours.iterdir() if p.name.startswith("checkpoint-"))
    assert checkpoints and all(is_complete(str(p)) for p in checkpoints)
    return files


def _assert_same_weights(a, b) -> None:
    a, b = a.state_dict(), b.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _our_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("asyncckpt:")]


# ---------------------------------------------------------------------- TRL's trainers
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sft_trainer_model_card_files_and_resume_match_native(tmp_path, checkpointer, lora):
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    def make(out, callbacks, max_steps):
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM") \
            if lora else None
        args = SFTConfig(output_dir=str(out), max_steps=max_steps, save_steps=2, per_device_train_batch_size=4,
                         max_length=16, logging_steps=2, report_to=[], use_cpu=True, disable_tqdm=True)
        return SFTTrainer(model=_llama(), args=args, train_dataset=Dataset.from_dict({"text": _sentences(32, 0)}),
                          processing_class=_tokenizer(), peft_config=peft_config, callbacks=callbacks)

    trainers = _native_and_async(tmp_path, make, checkpointer)
    files = _assert_same_runs(tmp_path)
    assert "README.md" in files  # TRL's model card, written by SFTTrainer._save_checkpoint into output_dir
    assert ("checkpoint-4/adapter_model.safetensors" in files) == ("checkpoint-4/README.md" in files) == lora  # PEFT's
    assert {f.split("/")[0] for f in files if "/" in f} == {"checkpoint-2", "checkpoint-4"}
    _assert_same_weights(trainers["async"].model, trainers["native"].model)  # resumed from our checkpoint-2


def test_reward_trainer_model_card_and_files_match_native(tmp_path, checkpointer):
    from trl import RewardConfig, RewardTrainer

    def make(out, callbacks, max_steps):
        data = Dataset.from_dict({"chosen": _sentences(32, 1), "rejected": _sentences(32, 2)})
        args = RewardConfig(output_dir=str(out), max_steps=max_steps, save_steps=2, per_device_train_batch_size=4,
                            max_length=16, logging_steps=2, report_to=[], use_cpu=True, disable_tqdm=True)
        return RewardTrainer(model=_llama(LlamaForSequenceClassification, num_labels=1), args=args, train_dataset=data,
                             processing_class=_tokenizer(), callbacks=callbacks)

    trainers = _native_and_async(tmp_path, make, checkpointer)
    assert "README.md" in _assert_same_runs(tmp_path)
    _assert_same_weights(trainers["async"].model, trainers["native"].model)


# ---------------------------------------------------------------------- users' subclasses
def _trainer_args(out, max_steps):
    return TrainingArguments(output_dir=str(out), max_steps=max_steps, save_steps=2, per_device_train_batch_size=4,
                             logging_steps=2, report_to=[], use_cpu=True, disable_tqdm=True)


class ExtraFiles(Trainer):
    """Before the Trainer's save: a line in ``output_dir/saves.log`` (outside the checkpoint) and
    ``rollout_state.json`` inside it (creating the folder, as TRL's asynchronous GRPO trainer does); after
    it: ``ema.safetensors`` inside it. Notes whether the Trainer's files were on disk when its save returned."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_disk_after_super: list[bool] = []

    def _save_checkpoint(self, model, trial):
        folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        with open(os.path.join(self.args.output_dir, "saves.log"), "a") as f:
            f.write(f"saving step {self.state.global_step}\n")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "rollout_state.json"), "w") as f:
            json.dump({"prompt_index": 4 * self.state.global_step}, f)
        super()._save_checkpoint(model, trial)
        self.on_disk_after_super.append(os.path.exists(os.path.join(folder, "trainer_state.json")))
        save_file({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(folder, "ema.safetensors"))


class SeenAtSave(TrainerCallback):
    """Right after each save returns: the checkpoint folder is absent, or committed with the subclass's files."""

    def __init__(self):
        self.seen: list[bool] = []

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.seen.append(not os.path.exists(folder) or (
            is_complete(folder) and {"ema.safetensors", "rollout_state.json"} <= set(os.listdir(folder))))


def test_user_subclass_files_inside_and_outside_the_checkpoint(tmp_path, checkpointer):
    seen = SeenAtSave()

    def make(out, callbacks, max_steps):
        return ExtraFiles(model=_llama(), args=_trainer_args(out, max_steps), train_dataset=_token_ids(),
                          callbacks=callbacks + ([seen] if callbacks else []))

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainers = _native_and_async(tmp_path, make, checkpointer)
    assert not _our_warnings(record)  # all asynchronous
    files = _assert_same_runs(tmp_path)
    for step in (2, 4):
        assert {f"checkpoint-{step}/ema.safetensors", f"checkpoint-{step}/rollout_state.json"} <= set(files)
    assert (tmp_path / "async" / "saves.log").read_text().count("saving step") == 2
    assert trainers["native"].on_disk_after_super == [True]  # the second train() call's one save
    assert trainers["async"].on_disk_after_super == [False]  # still being written: committed after the override
    assert seen.seen == [True, True]
    _assert_same_weights(trainers["async"].model, trainers["native"].model)


class CopiesState(Trainer):
    """Reads the checkpoint back after the Trainer's save: ``trainer_state.json`` copied to ``output_dir``."""

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        shutil.copy(os.path.join(folder, "trainer_state.json"), os.path.join(self.args.output_dir, "last_state.json"))


def test_subclass_reading_the_checkpoint_back_saves_synchronously_warned_once(tmp_path, checkpointer):
    def make(out, callbacks, max_steps):
        return CopiesState(model=_llama(), args=_trainer_args(out, max_steps), train_dataset=_token_ids(),
                           callbacks=callbacks)

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _native_and_async(tmp_path, make, checkpointer, steps=(4,))
    ours = _our_warnings(record)
    assert len(ours) == 1 and "synchronously" in ours[0] and "CopiesState" in ours[0], ours
    native, ours_dir = tmp_path / "native", tmp_path / "async"
    assert _files(ours_dir) == _files(native)
    for name in _files(native):
        assert _contents(ours_dir / name) == _contents(native / name), name
    assert "last_state.json" in _files(ours_dir)


def test_subclass_saving_into_an_existing_folder_saves_synchronously_warned_once(tmp_path, checkpointer):
    """A second run in the same output_dir: checkpoint-N exists when the override starts, and it may write
    into it; its save runs as it is."""
    def make(out, callbacks, max_steps):
        return ExtraFiles(model=_llama(), args=_trainer_args(out, max_steps), train_dataset=_token_ids(),
                          callbacks=callbacks)

    out = tmp_path / "run"
    make(out, [], 4).train()
    first = {name: _contents(out / name) for name in _files(out)}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make(out, [AsyncCheckpointCallback(checkpointer=checkpointer)], 4).train()
    ours = _our_warnings(record)
    assert len(ours) == 1 and "exists already" in ours[0], ours
    again = {name: _contents(out / name) for name in _files(out)}
    assert again.pop("saves.log") == first.pop("saves.log") * 2
    assert again == first


def test_subclass_that_saves_nothing_publishes_nothing(tmp_path, checkpointer):
    class NoCheckpoints(Trainer):
        def _save_checkpoint(self, model, trial):
            pass

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        NoCheckpoints(model=_llama(), args=_trainer_args(tmp_path / "run", 4), train_dataset=_token_ids(),
                      callbacks=[AsyncCheckpointCallback(checkpointer=checkpointer)]).train()
    assert not _our_warnings(record)
    assert _files(tmp_path / "run") == [] and os.listdir(tmp_path / "run") == []
