"""The Transformers Trainer: the stall of its checkpoint saves and the training slowdown, native against asyncckpt."""
from __future__ import annotations

import shutil
import tempfile

from harness import Option, Scenario, training
from harness.floors import checkpoint_tensors
from harness.util import now

ARMS = ("none", "native", "asyncckpt", "asyncckpt_sync", "raw_write")
NAMES = {"native": "the Trainer's own `_save_checkpoint` (synchronous)", "asyncckpt": "**`AsyncCheckpointCallback()`**",
         "asyncckpt_sync": "`AsyncCheckpointCallback(overlap_optimizer=False)`",
         "raw_write": "floor: a raw O_DIRECT write of the same bytes by another process"}


def train(mode: str, steps: int, every: int, hidden: int, mlp: int, layers: int, vocab: int, seq: int,
          batch: int) -> dict:
    """One run in this process: ``LlamaForCausalLM`` from a config (no download) + AdamW,
    ``save_steps=every, save_total_limit=2`` (rotation)."""
    import torch
    from torch.utils.data import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    log = training.StepLog(mode, every, steps)
    optimizer_started: list[float] = []

    class Tokens(Dataset):
        def __len__(self):
            return steps * batch

        def __getitem__(self, i):
            ids = torch.randint(0, vocab, (seq,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    class Clock(TrainerCallback):  # on_step_end runs before the Trainer's save of that step
        def on_step_begin(self, args, state, control, **kwargs):
            log.began(state.global_step + 1)

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            optimizer_started.append(now())

        def on_optimizer_step(self, args, state, control, **kwargs):
            log.optimizer(state.global_step + 1, now() - optimizer_started.pop())

        def on_step_end(self, args, state, control, **kwargs):
            log.ended(state.global_step)

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64, vocab_size=vocab, max_position_embeddings=max(64, seq),
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    workdir = tempfile.mkdtemp(prefix="hf_trainer_bench_")
    callbacks = [Clock()]
    if mode.startswith("asyncckpt"):
        from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback

        callbacks.append(AsyncCheckpointCallback(overlap_optimizer=mode != "asyncckpt_sync"))
    arguments = TrainingArguments(output_dir=workdir, max_steps=steps, per_device_train_batch_size=batch,
                                  learning_rate=1e-5, save_strategy="no" if mode == "none" else "steps",
                                  save_steps=every, save_total_limit=2, logging_steps=every, report_to=[], use_cpu=True,
                                  disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=model, args=arguments, train_dataset=Tokens(), callbacks=callbacks)
    save = trainer._save_checkpoint  # the callback's, once installed (on_init_end)
    trainer._save_checkpoint = lambda *a, **k: log.save(trainer.state.global_step, lambda: save(*a, **k),
                                                        checkpoint_tensors(trainer.model, trainer.optimizer), workdir)
    trainer.train()
    result = log.result(returned=now())
    shutil.rmtree(workdir, ignore_errors=True)
    return result


def measure(sitting) -> dict:
    o = sitting.o
    return training.measure(sitting, ARMS, {"asyncckpt", "asyncckpt_sync"}, steps=o.steps, every=o.every,
                            hidden=o.hidden, mlp=o.mlp, layers=o.layers, vocab=o.vocab, seq=o.seq, batch=o.batch)


SETUP = ("Model: `LlamaForCausalLM` from a config (hidden {hidden}, {layers} layers, MLP {mlp}, vocab {vocab}) + AdamW: "
         "the checkpoint holds **{state_mb:.0f} MB** of tensors ({tensors} tensors; model.safetensors, optimizer.pt, and "
         "the Trainer's small files). `save_strategy=\"steps\", save_steps={every}, save_total_limit=2`, {steps} steps of "
         "batch {batch} x {seq} tokens; the save at the last step and the wait for its write are the drain. The runs keep "
         "freed memory in glibc (`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`): this VM's fresh pages cost "
         "~0.3 GB/s to fault.")

SCENARIO = Scenario(
    title="Transformers Trainer: the save's stall and the training slowdown",
    question="What a Trainer run pays for its checkpoints with `AsyncCheckpointCallback`, against the Trainer's own "
             "saving, a run without checkpoints, and the floor: another process writing the same bytes durably (no "
             "snapshot, no checksums).",
    measure=measure,
    render=lambda result: training.render(result, NAMES, SETUP),
    plot=training.plot,
    options={"steps": Option(60, 18), "every": Option(10, 6), "hidden": Option(1024, 128), "mlp": Option(2816, 256),
             "layers": Option(4, 1), "vocab": Option(1024, 256), "seq": Option(16, 8), "batch": Option(1, 1)},
    reps=(2, 1),
    revisioned=True,
)
