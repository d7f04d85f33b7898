"""The Transformers Trainer adapter, with the real Trainer (transformers 5.x, CPU).

Each case runs the same program with and without ``AsyncCheckpointCallback`` and compares what
the Trainer left behind: checkpoint folders, weights and optimizer state (bitwise), and
``trainer_state.json`` (modulo wall-clock fields).
"""
from __future__ import annotations

import functools
import gc
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.trainer_callback import ExportableState  # noqa: E402
from transformers.trainer_utils import get_last_checkpoint  # noqa: E402

from dist_helper import free_port  # noqa: E402
from program_end import DESTROY_PROCESS_GROUP  # noqa: E402
from writers import limit_file_size, writers_of  # noqa: E402
from toy import ON_PATH, Net, Toy  # noqa: E402
from zygote import Zygote  # noqa: E402

from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback  # noqa: E402
from asyncckpt.core import Checkpointer, CheckpointWriteError, is_complete  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "hf_trainer_min.py"
COMMIT_RECORD = ".asyncckpt-commit.json"
TIMING_KEYS = re.compile(r"(runtime|_per_second)$")


# ---------------------------------------------------------------------- the shared example (its data and model: toy.py)
class StopAt(TrainerCallback):
    """Ends training after ``step`` (an interruption with the same schedule as the full run)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


@pytest.fixture(scope="module")
def shared_checkpointer():
    """One writer process for the in-process runs (the default, one per training, is tested too)."""
    checkpointer = Checkpointer(max_in_flight=2)
    yield checkpointer
    checkpointer.close()


def _args(out, **overrides):
    base = dict(output_dir=str(out), per_device_train_batch_size=16, num_train_epochs=2, learning_rate=1e-2,
                save_strategy="steps", save_steps=10, save_total_limit=2, logging_steps=10, report_to=[],
                use_cpu=True, disable_tqdm=True)
    base.update(overrides)
    return TrainingArguments(**base)


def _train_toy(out, callbacks=(), resume=None, model=None, eval_dataset=None, **overrides):
    torch.manual_seed(0)
    trainer = Trainer(model=model or Net(), args=_args(out, **overrides), train_dataset=Toy(),
                      eval_dataset=eval_dataset, callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


# ---------------------------------------------------------------------- comparisons
def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _weights(checkpoint):
    return load_file(os.path.join(checkpoint, "model.safetensors"))


def _optimizer(checkpoint):
    return torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True)


def _assert_same_training_state(a, b):
    assert _equal(_weights(a), _weights(b)), f"weights differ: {a} vs {b}"
    assert _equal(_optimizer(a), _optimizer(b)), f"optimizer state differs: {a} vs {b}"
    for name in ("scheduler.pt", "rng_state.pth"):
        if os.path.exists(os.path.join(a, name)):
            assert _equal(torch.load(os.path.join(a, name), weights_only=False),
                          torch.load(os.path.join(b, name), weights_only=False)), name


def _trainer_state(checkpoint):
    """trainer_state.json without wall-clock fields; checkpoint paths reduced to their folder name."""
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        state = json.load(f)
    state["log_history"] = _strip_timing(state["log_history"])
    if state["best_model_checkpoint"] is not None:
        state["best_model_checkpoint"] = os.path.basename(state["best_model_checkpoint"])
    return state


def _checkpoints(out):
    return sorted((p for p in os.listdir(out) if p.startswith("checkpoint-")), key=lambda p: int(p.split("-")[1]))


def _files(checkpoint):
    return sorted(f for f in os.listdir(checkpoint) if f != COMMIT_RECORD)


def _assert_committed(out):
    for name in _checkpoints(out):
        assert is_complete(os.path.join(out, name)), f"{name} has no commit record"
    assert not [n for n in os.listdir(out) if n.startswith(".")], os.listdir(out)  # no staging left


def _run(cmd, cwd, timeout=240, env=None):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


# ---------------------------------------------------------------------- 1. the shared example, as a user runs it
def test_shared_example_runs_resumes_and_matches_native(tmp_path):
    source = EXAMPLE.read_text()
    plain = source.replace("\nfrom asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback",
                           "\n# from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback")
    plain = plain.replace("  callbacks=[AsyncCheckpointCallback()],", "  # callbacks=[AsyncCheckpointCallback()],")
    changed = [(a, b) for a, b in zip(source.splitlines(), plain.splitlines()) if a != b]
    assert len(changed) == 2 and len(source.splitlines()) == len(plain.splitlines())  # only the two lines differ
    def user_runs(name, text):  # python prog.py 2 && python prog.py 4
        workdir = tmp_path / name
        workdir.mkdir()
        (workdir / "prog.py").write_text(text)
        first = _run([sys.executable, "prog.py", "2"], workdir)
        assert get_last_checkpoint(str(workdir / "hfrun")).endswith("checkpoint-32")
        return workdir / "hfrun", first, _run([sys.executable, "prog.py", "4"], workdir)

    with ThreadPoolExecutor(2) as pool:  # the two programs side by side (they are mostly start-up time)
        futures = {name: pool.submit(user_runs, name, text) for name, text in (("async", source), ("native", plain))}
        runs = {name: future.result() for name, future in futures.items()}
    out, native_out = runs["async"][0], runs["native"][0]
    # the 2nd run resumed (same train_loss as native's resumed run: only the resumed steps are averaged)
    loss = lambda text: re.findall(r"'train_loss': '([^']+)'", text)  # noqa: E731
    assert loss(runs["async"][2]) == loss(runs["native"][2]) and loss(runs["async"][1]) == loss(runs["native"][1])
    assert _checkpoints(out) == _checkpoints(native_out) == ["checkpoint-60", "checkpoint-64"]
    _assert_committed(out)
    for name in _checkpoints(out):
        assert _files(out / name) == _files(native_out / name)
        _assert_same_training_state(out / name, native_out / name)
        assert _trainer_state(out / name) == _trainer_state(native_out / name)
        assert (out / name / "model.safetensors").read_bytes() == (native_out / name / "model.safetensors").read_bytes()


# ---------------------------------------------------------------------- 2. save_strategy="best" + load best + limit 1
@pytest.mark.parametrize("save_strategy", ["best", "steps"])
def test_best_checkpoint_bookkeeping_matches_native(tmp_path, shared_checkpointer, save_strategy):
    # constant lr 0.1 for 40 steps: eval loss is best at step 30, not at the last step (40)
    options = dict(max_steps=40, learning_rate=0.1, lr_scheduler_type="constant", eval_strategy="steps", eval_steps=5,
                   save_strategy=save_strategy, save_steps=5, metric_for_best_model="loss", greater_is_better=False,
                   load_best_model_at_end=True, save_total_limit=1, logging_steps=5)
    native = _train_toy(tmp_path / "native", eval_dataset=Toy(64), **options)
    callback = AsyncCheckpointCallback(checkpointer=shared_checkpointer)
    ours = _train_toy(tmp_path / "async", callbacks=[callback], eval_dataset=Toy(64), **options)

    assert [t["step"] for t in callback.metrics] == [s for s, _ in _save_steps(native)]  # every save went through us
    assert os.path.basename(ours.state.best_model_checkpoint) == os.path.basename(native.state.best_model_checkpoint) \
        == "checkpoint-30"
    assert _checkpoints(tmp_path / "async") == _checkpoints(tmp_path / "native") == ["checkpoint-30"]
    _assert_committed(tmp_path / "async")
    # load_best_model_at_end: the model in memory is the best checkpoint's, as natively
    assert _equal(ours.model.state_dict(), native.model.state_dict())
    assert _equal(ours.model.state_dict(), _weights(tmp_path / "async" / "checkpoint-30"))
    best_a, best_n = tmp_path / "async" / "checkpoint-30", tmp_path / "native" / "checkpoint-30"
    _assert_same_training_state(best_a, best_n)
    assert _trainer_state(best_a) == _trainer_state(best_n)
    assert _trainer_state(best_a)["best_global_step"] == 30
    assert _equal(_strip_timing(ours.state.log_history), _strip_timing(native.state.log_history))


def _save_steps(trainer):
    """Steps at which the native run saved (from the log: a save follows a best eval or save_steps)."""
    if trainer.args.save_strategy == "best":
        best, steps = None, []
        for entry in trainer.state.log_history:
            if "eval_loss" in entry and (best is None or entry["eval_loss"] < best):
                best = entry["eval_loss"]
                steps.append((entry["step"], 0))
        return steps
    return [(s, 0) for s in range(trainer.args.save_steps, trainer.state.global_step + 1, trainer.args.save_steps)]


def _strip_timing(history):
    """The log without wall-clock fields (each save's metrics, ``checkpoint_*``, never enter it: they go to the
    report_to integrations only, so a log with the callback equals the native one)."""
    return [{k: v for k, v in entry.items() if not TIMING_KEYS.search(k)} for entry in history]


def test_epoch_strategy_matches_native(tmp_path, shared_checkpointer):
    options = dict(save_strategy="epoch", save_total_limit=None, num_train_epochs=3)
    _train_toy(tmp_path / "native", **options)
    callback = AsyncCheckpointCallback(checkpointer=shared_checkpointer)
    _train_toy(tmp_path / "async", callbacks=[callback], **options)
    assert [t["step"] for t in callback.metrics] == [16, 32, 48]
    assert _checkpoints(tmp_path / "async") == _checkpoints(tmp_path / "native") == \
        ["checkpoint-16", "checkpoint-32", "checkpoint-48"]
    _assert_committed(tmp_path / "async")
    for name in _checkpoints(tmp_path / "async"):
        _assert_same_training_state(tmp_path / "async" / name, tmp_path / "native" / name)
        assert _trainer_state(tmp_path / "async" / name) == _trainer_state(tmp_path / "native" / name)


def test_two_pending_checkpoints_rotation_matches_native(tmp_path, shared_checkpointer):
    """max_in_flight=2: a save does not wait for the previous commit; rotation (limit 1) is still behind it."""
    options = dict(save_steps=5, save_total_limit=1, max_steps=30)
    _train_toy(tmp_path / "native", **options)
    callback = AsyncCheckpointCallback(checkpointer=shared_checkpointer)  # max_in_flight=2
    _train_toy(tmp_path / "async", callbacks=[callback], **options)
    assert _checkpoints(tmp_path / "async") == _checkpoints(tmp_path / "native") == ["checkpoint-30"]
    _assert_committed(tmp_path / "async")
    _assert_same_training_state(tmp_path / "async" / "checkpoint-30", tmp_path / "native" / "checkpoint-30")
    assert _trainer_state(tmp_path / "async" / "checkpoint-30") == _trainer_state(tmp_path / "native" / "checkpoint-30")


# ---------------------------------------------------------------------- 3. a PreTrainedModel (+ tokenizer, sharded weights)
def _tiny_gpt2_and_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(97)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=32, vocab_size=99, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)  # lm_head is tied to wte: save_pretrained drops the tied copy
    # several safetensors shards + model.safetensors.index.json, through the Trainer's own call
    model.save_pretrained = functools.partial(GPT2LMHeadModel.save_pretrained, model, max_shard_size="24KB")
    return model, tokenizer


class Tokens(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.randint(2, 99, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def test_pretrained_model_layout_and_from_pretrained(tmp_path, shared_checkpointer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def train(out, callbacks):
        model, tokenizer = _tiny_gpt2_and_tokenizer()
        trainer = Trainer(model=model, processing_class=tokenizer, train_dataset=Tokens(), callbacks=callbacks,
                          args=_args(out, per_device_train_batch_size=8, max_steps=12, save_steps=6, save_total_limit=None))
        trainer.train()
        return trainer

    class ReadAtOnce(TrainerCallback):  # e.g. an evaluation of each checkpoint as soon as it is saved
        def __init__(self):
            self.pending, self.same = [], []

        def on_save(self, args, state, control, model=None, **kwargs):
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            self.pending.append(folder in {h.path for h in shared_checkpointer.pending()})
            self.same.append(_equal(AutoModelForCausalLM.from_pretrained(folder).state_dict(), model.state_dict()))

    native = train(tmp_path / "native", [])
    reader = ReadAtOnce()
    ours = train(tmp_path / "async", [AsyncCheckpointCallback(checkpointer=shared_checkpointer), reader])
    assert reader.same == [True, True] and any(reader.pending)  # from_pretrained waited for the write in flight
    checkpoint, native_checkpoint = tmp_path / "async" / "checkpoint-12", tmp_path / "native" / "checkpoint-12"
    _assert_committed(tmp_path / "async")
    files = _files(checkpoint)
    assert files == _files(native_checkpoint)
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
            "training_args.bin"} <= set(files)
    shards = [f for f in files if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f)]
    assert len(shards) >= 2
    for name in shards + ["config.json", "generation_config.json", "model.safetensors.index.json",
                          "tokenizer.json", "tokenizer_config.json"]:  # byte for byte what native wrote
        assert (checkpoint / name).read_bytes() == (native_checkpoint / name).read_bytes(), name
    assert _equal(_optimizer(checkpoint), _optimizer(native_checkpoint))
    assert _trainer_state(checkpoint) == _trainer_state(native_checkpoint)
    args = torch.load(checkpoint / "training_args.bin", weights_only=False)
    assert isinstance(args, TrainingArguments) and args.output_dir == str(tmp_path / "async")

    reloaded = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    assert _equal(reloaded.state_dict(), ours.model.state_dict())
    assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()  # still tied
    assert AutoTokenizer.from_pretrained(str(checkpoint))("w1 w2 w3")["input_ids"] == [3, 4, 5]
    assert _equal(ours.model.state_dict(), native.model.state_dict())


# ---------------------------------------------------------------------- 4. resume fidelity
@pytest.mark.parametrize("overlap_optimizer", [True, False])  # the default, and every file snapshot in the save
def test_resume_fidelity_bitwise(tmp_path, overlap_optimizer):
    """N steps, killed-like stop, resume to 2N == 2N uninterrupted (weights, optimizer, schedule, RNG)."""
    options = dict(max_steps=20, save_steps=5, save_total_limit=None, logging_steps=5)
    checkpointer = Checkpointer(overlap_optimizer=overlap_optimizer)
    callback = lambda: AsyncCheckpointCallback(checkpointer=checkpointer)  # noqa: E731
    full = _train_toy(tmp_path / "full", callbacks=[callback()], **options)
    _train_toy(tmp_path / "split", callbacks=[callback(), StopAt(10)], **options)
    assert _checkpoints(tmp_path / "split") == ["checkpoint-5", "checkpoint-10"]
    resumed = _train_toy(tmp_path / "split", callbacks=[callback()], resume=True, **options)
    assert resumed.state.global_step == 20
    assert _equal(resumed.model.state_dict(), full.model.state_dict())
    assert _equal(resumed.optimizer.state_dict(), full.optimizer.state_dict())
    _assert_same_training_state(tmp_path / "split" / "checkpoint-20", tmp_path / "full" / "checkpoint-20")
    assert _trainer_state(tmp_path / "split" / "checkpoint-20") == _trainer_state(tmp_path / "full" / "checkpoint-20")
    checkpointer.close()


def test_overlapped_optimizer_snapshot_is_taken_before_the_next_step(tmp_path, shared_checkpointer,
                                                                    slow_overlapped_snapshots):
    """overlap_optimizer (the default): optimizer.pt is copied on a thread; the next optimizer.step() must wait for it.
    The thread is slowed down so that the next step always arrives first: a torn snapshot would hold the
    next step's Adam state and the resumed run would differ from the uninterrupted one."""
    options = dict(max_steps=20, save_steps=5, save_total_limit=None, logging_steps=5)
    overlapped = lambda: AsyncCheckpointCallback(checkpointer=shared_checkpointer)  # noqa: E731
    callback = overlapped()
    full = _train_toy(tmp_path / "full", callbacks=[callback], **options)
    waits = [t["snapshot_wait_s"] for t in callback.metrics[:-1]]  # the last save has no next step
    assert len(waits) == 3 and min(waits) > 0.1, callback.metrics  # the next step did wait for the snapshot
    native = _train_toy(tmp_path / "native", **options)
    for name in _checkpoints(tmp_path / "native"):
        _assert_same_training_state(tmp_path / "full" / name, tmp_path / "native" / name)
    _train_toy(tmp_path / "split", callbacks=[overlapped(), StopAt(10)], **options)
    resumed = _train_toy(tmp_path / "split", callbacks=[overlapped()], resume=True, **options)
    assert _equal(resumed.optimizer.state_dict(), full.optimizer.state_dict())
    assert _equal(resumed.model.state_dict(), native.model.state_dict())
    _assert_committed(tmp_path / "split")


def test_optimizer_snapshot_is_not_overlapped_without_step_hooks(tmp_path):
    """Overlapping relies on torch's optimizer step pre-hook: an optimizer that is not a
    torch.optim.Optimizer (whose steps could not be made to wait) gets its snapshot in the save."""
    import types

    callback = AsyncCheckpointCallback()
    trainer = Trainer(model=Net(), args=_args(tmp_path / "run"), train_dataset=Toy(), callbacks=[callback])
    from asyncckpt.core.integration import saving

    saver = callback.saver
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)
    assert saving.overlaps_optimizer(callback.checkpointer, [trainer.optimizer])
    trainer.optimizer = types.SimpleNamespace(optimizer=types.SimpleNamespace(step=lambda: None))  # e.g. a wrapper
    with pytest.warns(RuntimeWarning, match="is not a torch.optim.Optimizer"):
        assert not saving.overlaps_optimizer(callback.checkpointer, [trainer.optimizer])
    assert not saving.overlaps_optimizer(AsyncCheckpointCallback(overlap_optimizer=False).checkpointer,
                                         [torch.optim.SGD(trainer.model.parameters(), lr=0.1)])
    del trainer, saver, callback  # never trained, never closed: its step hook must stay harmless
    gc.collect()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    optimizer.step()


# ---------------------------------------------------------------------- 5. added later with add_callback
def test_add_callback_before_train(tmp_path):
    native = _train_toy(tmp_path / "native")
    torch.manual_seed(0)
    trainer = Trainer(model=Net(), args=_args(tmp_path / "async"), train_dataset=Toy())
    callback = AsyncCheckpointCallback()  # default: its own writer process, closed when training ends
    assert not isinstance(callback, ExportableState)  # the Trainer re-creates those on resume
    trainer.add_callback(callback)
    assert "_save_checkpoint" not in trainer.__dict__  # nothing to hook before train()
    trainer.train()
    assert [t["step"] for t in callback.metrics] == [10, 20, 30, 32]
    assert callback.checkpointer.writer_pid() is None  # stopped at on_train_end
    assert "_save_checkpoint" not in trainer.__dict__  # and the Trainer is as it was
    assert _checkpoints(tmp_path / "async") == _checkpoints(tmp_path / "native") == ["checkpoint-30", "checkpoint-32"]
    _assert_committed(tmp_path / "async")
    for name in _checkpoints(tmp_path / "async"):
        _assert_same_training_state(tmp_path / "async" / name, tmp_path / "native" / name)
        assert _trainer_state(tmp_path / "async" / name) == _trainer_state(tmp_path / "native" / name)
    assert _equal(trainer.model.state_dict(), native.model.state_dict())


# ---------------------------------------------------------------------- 6. a failed background write
def test_failed_background_save_raises_at_next_save_naming_the_folder(tmp_path):
    # A real I/O error in the writer: files above 3000 bytes fail with EFBIG (optimizer.pt, rng_state.pth).
    callback = AsyncCheckpointCallback(max_in_flight=1)  # the next save waits for the failing one
    limit_file_size(callback.checkpointer, 3000)
    with pytest.raises(CheckpointWriteError, match=r"saving checkpoint .*checkpoint-10 \(global step 10\) failed on rank 0: "
                                                   r".*(File too large|Invalid argument).*nothing was published under its name"):
        _train_toy(tmp_path / "out", callbacks=[callback], save_total_limit=None)
    assert [t["step"] for t in callback.metrics] == [10]  # the save at step 20 raised it
    assert _checkpoints(tmp_path / "out") == []  # nothing published
    callback.checkpointer.close()  # the error was reported once; the writer stops cleanly


# ---------------------------------------------------------------------- 7. two processes (torchrun, DDP on CPU)
DDP_PROGRAM = ON_PATH + textwrap.dedent('''
    # One torchrun launch, four trainings: native and async, each stopped at step 15 and resumed to 32.
    import os, sys, torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_utils import get_last_checkpoint
    from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback
    from asyncckpt.core import is_complete
    from toy import Net, Toy

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 15: control.should_training_stop = True

    def train(out, use_callback, first_part):
        torch.manual_seed(0)
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=16, num_train_epochs=4, learning_rate=1e-2,
                                 save_strategy="steps", save_steps=5, save_total_limit=2, logging_steps=5, report_to=[],
                                 use_cpu=True, disable_tqdm=True, ddp_find_unused_parameters=False)
        callbacks = ([AsyncCheckpointCallback()] if use_callback else []) + ([StopAt()] if first_part else [])
        trainer = Trainer(model=Net(), args=args, train_dataset=Toy(), callbacks=callbacks)
        trainer.train(resume_from_checkpoint=not first_part)
        last = get_last_checkpoint(out)
        # every rank returns from train() only once the last checkpoint is committed
        print(f"{'async' if use_callback else 'native'} RANK {trainer.args.process_index} world {trainer.args.world_size} "
              f"step {trainer.state.global_step} last {os.path.basename(last)} committed {is_complete(last)}", flush=True)

    if __name__ == "__main__":
        for name in ("native", "async"):
            train(os.path.join(sys.argv[1], name), name == "async", first_part=True)
            train(os.path.join(sys.argv[1], name), name == "async", first_part=False)
''') + DESTROY_PROCESS_GROUP


def test_two_processes_ddp(tmp_path):
    (tmp_path / "ddp.py").write_text(DDP_PROGRAM)
    text = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "ddp.py",
                 str(tmp_path)], tmp_path)
    for rank in (0, 1):
        for step in (15, 32):  # after the stop at 15 and after the resumed run
            assert f"async RANK {rank} world 2 step {step} last checkpoint-{step} committed True" in text, text
            assert f"native RANK {rank} world 2 step {step} last checkpoint-{step}" in text, text
    out, native_out = tmp_path / "async", tmp_path / "native"
    assert _checkpoints(out) == _checkpoints(native_out) == ["checkpoint-30", "checkpoint-32"]
    _assert_committed(out)
    for name in _checkpoints(out):
        files = _files(out / name)
        assert files == _files(native_out / name)
        assert "rng_state_0.pth" in files and "rng_state_1.pth" in files and "rng_state.pth" not in files
        _assert_same_training_state(out / name, native_out / name)
        for rank in (0, 1):
            a = torch.load(out / name / f"rng_state_{rank}.pth", weights_only=False)
            b = torch.load(native_out / name / f"rng_state_{rank}.pth", weights_only=False)
            assert _equal(a, b), f"rng_state_{rank}.pth differs"
        assert _trainer_state(out / name) == _trainer_state(native_out / name)


# ---------------------------------------------------------------------- 8. kill -9 during a save
KILL_PROGRAM = ON_PATH + textwrap.dedent('''
    import os, sys, torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback
    from toy import Endless, Net, body

    class Report(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs): print(f"BEGIN {state.global_step}", flush=True)
        def on_save(self, args, state, control, **kwargs): print(f"SAVED {state.global_step}", flush=True)

    if __name__ == "__main__":
        torch.manual_seed(0)
        args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=4, max_steps=int(sys.argv[2]),
                                 learning_rate=1e-4, save_strategy="steps", save_steps=2, save_total_limit=2,
                                 report_to=[], use_cpu=True, disable_tqdm=True)
        big = Net(body(2048, 2048, relu=True))  # ~4.2M parameters: ~50 MB per checkpoint with Adam's state
        trainer = Trainer(model=big, args=args, train_dataset=Endless(), callbacks=[AsyncCheckpointCallback(), Report()])
        trainer.train(resume_from_checkpoint=len(sys.argv) > 3)
        print("DONE", trainer.state.global_step, flush=True)
''') + DESTROY_PROCESS_GROUP


def test_kill9_during_save_then_resume_from_last_complete(tmp_path):
    script, out = tmp_path / "kill.py", tmp_path / "out"
    script.write_text(KILL_PROGRAM)
    # both runs are forks of one process that imported transformers once: fresh processes, without the imports
    with Zygote(["torch", "transformers.trainer", "asyncckpt.adapters.hf_trainer"],
                {**os.environ, "OMP_NUM_THREADS": "1"}, tmp_path) as zygote:
        run = zygote.run(script, out, "200")
        caught = None
        try:
            while (line := run.read_line(timeout=300)) is not None:  # after each save returns, catch the writer
                match = re.match(r"SAVED (\d+)", line)                # with that folder half written
                if not match or int(match.group(1)) < 4:
                    continue
                step, writer = int(match.group(1)), next(iter(writers_of(run.pid)), None)
                final, deadline = out / f"checkpoint-{step}", time.monotonic() + 5
                while time.monotonic() < deadline and not final.exists():
                    staged = [n for n in os.listdir(out) if n.startswith(f".checkpoint-{step}.asyncckpt-staging-")]
                    if staged and os.path.exists(out / staged[0] / "model.safetensors"):
                        os.kill(writer, signal.SIGSTOP)  # model written, optimizer.pt not yet: freeze right here
                        if not final.exists():
                            caught = (step, staged[0], sorted(os.listdir(out / staged[0])))
                        break
                    time.sleep(0.001)
                if caught:
                    break
                if writer is not None:
                    os.kill(writer, signal.SIGCONT)
            assert caught, "never caught a save in the middle of its write"
        finally:
            if caught:  # the frozen writer too: a writer outlives its training process and would finish
                os.kill(writer, signal.SIGKILL)  # the save (this is the loss of both, as when a node goes down)
            run.kill()
            run.wait()
        step, staging, staged_files = caught
        assert "model.safetensors" in staged_files and COMMIT_RECORD not in staged_files  # caught half written
        assert not (out / f"checkpoint-{step}").exists()
        last = get_last_checkpoint(str(out))  # the Trainer's own discovery: the last complete checkpoint
        assert os.path.basename(last) == f"checkpoint-{step - 2}" and is_complete(last)
        assert _files(Path(last)) == ["model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt",
                                      "trainer_state.json", "training_args.bin"]

        resumed = zygote.run(script, out, step + 4, "resume")
        lines = resumed.remaining_lines()
    assert resumed.returncode == 0, resumed.stderr()[-6000:]
    assert f"BEGIN {step - 2}" in lines and f"DONE {step + 4}" in lines, lines
    assert _checkpoints(out) == [f"checkpoint-{step + 2}", f"checkpoint-{step + 4}"]
    _assert_committed(out)  # the killed run's staging folder was cleaned up at train begin


ALONE_PROGRAM = """
import os, sys, torch
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments
from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback
class Toy(Dataset):
    def __len__(self): return 8
    def __getitem__(self, i):
        x = torch.randn(4, generator=torch.Generator().manual_seed(i)); return {"x": x, "labels": x.sum(0, keepdim=True)}
class Net(torch.nn.Module):
    def __init__(self): super().__init__(); self.lin = torch.nn.Linear(4, 1)
    def forward(self, x, labels=None):
        out = self.lin(x); return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}
args = TrainingArguments(output_dir=sys.argv[1], max_steps=1, save_steps=1, report_to=[], disable_tqdm=True)
with open(os.path.join(sys.argv[2], "world-" + os.environ["RANK"]), "w") as f:  # not stdout: lines interleave
    f.write(str(args.world_size))
Trainer(model=Net(), args=args, train_dataset=Toy(), callbacks=[AsyncCheckpointCallback()]).train()
""" + DESTROY_PROCESS_GROUP


@pytest.mark.skipif(torch.cuda.is_available(), reason="with GPUs, torchrun's processes train together")
def test_processes_that_each_train_alone_are_warned_once(tmp_path):
    """torchrun without --use_cpu on a machine without GPUs: every Trainer process believes it is
    alone, so all of them write the same checkpoints. Each says so, once."""
    script = tmp_path / "train.py"
    script.write_text(ALONE_PROGRAM)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(script), str(tmp_path / "run"), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [(tmp_path / f"world-{rank}").read_text() for rank in (0, 1)] == ["1", "1"]  # each process alone
    warning = "but the Trainer runs it as a single process: every process writes the same checkpoints"
    assert proc.stderr.count(warning) == 2, proc.stderr[-3000:]  # once per process
    assert "--use_cpu" in proc.stderr


def test_resume_from_nothing_raises_the_trainers_own_errors(tmp_path):
    """Users and tools match on these messages (Transformers' own test_can_resume_training does)."""
    callback = AsyncCheckpointCallback()
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at"):
        _train_toy(tmp_path / "run", callbacks=[callback], resume=str(tmp_path / "run" / "checkpoint-9999"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"No valid checkpoint found in output directory"):
        _train_toy(tmp_path / "empty", callbacks=[AsyncCheckpointCallback()], resume=True)


def test_max_pending_is_a_deprecated_name_of_max_in_flight():
    with pytest.warns(FutureWarning, match="use max_in_flight"):
        callback = AsyncCheckpointCallback(max_pending=3)
    assert callback.options.max_in_flight == 3 and callback.checkpointer.options.max_in_flight == 3


def test_the_rotation_lists_again_when_the_writer_removes_a_checkpoint_meanwhile(tmp_path, monkeypatch):
    """The writer removes the checkpoints a rotation dropped while training goes on: one can go between the listing
    and the reading of its mtime (a clean-clone run under load failed so at a resume). The rotation lists again."""
    import shutil

    from asyncckpt.adapters.hf_trainer.saver import checkpoints_on_disk

    for step in (10, 20, 30):
        (tmp_path / f"checkpoint-{step}").mkdir()
        os.utime(tmp_path / f"checkpoint-{step}", (step, step))
    getmtime = os.path.getmtime

    def removed_as_it_is_read(path):  # the writer's removal lands right then, once
        if path.endswith("checkpoint-20") and os.path.isdir(path):
            shutil.rmtree(path)
        return getmtime(path)

    monkeypatch.setattr(os.path, "getmtime", removed_as_it_is_read)
    assert checkpoints_on_disk(str(tmp_path)) == [str(tmp_path / "checkpoint-10"), str(tmp_path / "checkpoint-30")]


def test_a_save_captured_leaves_no_scratch_folder_and_removes_the_one_a_killed_save_left(tmp_path, monkeypatch,
                                                                                       shared_checkpointer):
    """The Trainer's files are captured in a scratch folder beside the memory root, named after its process: gone
    when the capture ends; the one of a process killed mid-capture goes at the next capture (and with ``asyncckpt
    clean --memory``: test_cli.py), nothing else there; the folder above goes with the node's last capture."""
    import subprocess
    import sys

    from asyncckpt.core import tier

    memory_root = tmp_path / "shm" / "asyncckpt"
    monkeypatch.setenv("ASYNCCKPT_MEMORY_ROOT", str(memory_root))
    captures = Path(tier.captures_dir(str(memory_root)))
    dead = subprocess.run([sys.executable, "-c", "from asyncckpt.core.storage.owners import owner_token; "
                           "print(owner_token())"], capture_output=True, text=True, check=True).stdout.strip()
    (captures / dead).mkdir(parents=True)
    (captures / dead / "trainer_state.json").write_text("{}")
    (captures / "not-ours").mkdir()
    _train_toy(tmp_path / "async", callbacks=[AsyncCheckpointCallback(checkpointer=shared_checkpointer)],
               max_steps=4, save_steps=2)
    shared_checkpointer.wait()
    assert sorted(os.listdir(tmp_path / "async")) == ["checkpoint-2", "checkpoint-4"]
    assert os.listdir(captures) == ["not-ours"]
    (captures / "not-ours").rmdir()
    _train_toy(tmp_path / "again", callbacks=[AsyncCheckpointCallback(checkpointer=shared_checkpointer)],
               max_steps=2, save_steps=2)
    shared_checkpointer.wait()
    assert os.listdir(tmp_path / "again") == ["checkpoint-2"]
    assert not captures.exists() and os.listdir(memory_root.parent) == []
