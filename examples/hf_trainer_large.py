# python examples/hf_trainer_large.py [steps]
# A >= 500 MB-state model (a 53.5 M-parameter Llama built from a config + AdamW: 642 MB of tensors per
# checkpoint) trained twice with the Transformers Trainer, saving every 10 steps: once with the Trainer's own
# (synchronous) checkpointing, once with AsyncCheckpointCallback. Prints how long each save blocked training.
# The full measurement (slowdown, memcpy reference, JSON) is `python benchmarks/run.py hf_trainer`.
import shutil, sys, tempfile, time, torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback

class Tokens(Dataset):
    def __len__(self): return 10_000
    def __getitem__(self, i):
        ids = torch.randint(0, 1024, (16,), generator=torch.Generator().manual_seed(i)); return {"input_ids": ids, "labels": ids}

def train(callbacks, steps):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
                         num_key_value_heads=16, vocab_size=1024, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    out = tempfile.mkdtemp(prefix="hf_trainer_large_")
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=1, learning_rate=1e-5,
                             save_strategy="steps", save_steps=10, save_total_limit=2, report_to=[], use_cpu=True,
                             disable_tqdm=True, logging_steps=steps)
    trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=Tokens(), callbacks=callbacks)
    stalls, save = [], trainer._save_checkpoint        # time every checkpoint save the Trainer makes
    def timed(*a, **k):
        t0 = time.perf_counter(); save(*a, **k); stalls.append((trainer.state.global_step, time.perf_counter() - t0))
    trainer._save_checkpoint = timed
    t0 = time.perf_counter(); trainer.train(); total = time.perf_counter() - t0
    shutil.rmtree(out)
    return stalls, total

if __name__ == "__main__":
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    for name, callbacks in (("native Trainer", []), ("AsyncCheckpointCallback", [AsyncCheckpointCallback()])):
        stalls, total = train(callbacks, steps)
        print(f"{name:>24}: train() {total:6.1f} s; per-save stall (step: s) "
              + ", ".join(f"{step}: {s:.3f}" for step, s in stalls), flush=True)
