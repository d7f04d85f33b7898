"""The Lightning, Accelerate and Transformers training programs of the memory-tier tests (test_memory_tier_adapters.py:
one node, 2 ranks under torchrun; test_memory_tier_nodes.py: 2 nodes of one rank each): one text each, which a test
writes to a file and launches. Lightning's and Accelerate's take one argument, a JSON object:

* ``runs``: what to train, in order, each ``{"root": ..., "asyncckpt": bool, "resume": bool, "kill_at": step or
  null, "stop_at": step or null}``. ``kill_at``: every rank kills itself (kill -9) right after the optimizer step
  that follows the save of that step (its snapshot handed over). ``stop_at``: the save of that step committed on
  every rank, the program prints ``SAVED`` and sleeps, for the test to kill it. ``resume``: from the framework's
  last checkpoint;
* ``replicas``: the memory tier's replicas (``MemoryTier(persist_every=2, replicas=...)``);
* Lightning only: ``num_nodes``, ``devices``, ``max_steps``.

Each process prints ``PID <pid>`` and, for each run, ``RANK <rank> BEGINS AT <step>``; rank 0 saves the model's
final weights to ``<root>/final.pt``.

The Trainer's (``TRAINER``) takes ``root phase kill_at replicas``: phase ``first`` trains under ``root/async`` with
asyncckpt and every rank kills itself (kill -9) in the step after the save of ``kill_at``; phase ``second`` trains
uninterrupted without asyncckpt under ``root/native``, then resumes ``root/async``.

Accelerate: one run per process. A second DDP training in the same process meets a torch deadlock now and then
(the first run's DDP model, freed after ``end_training`` destroyed its process group, joins the group's gloo
threads holding the GIL, which one of them may be waiting for: pytorch#56297).
"""
from __future__ import annotations

import json
import textwrap

from program_end import DESTROY_PROCESS_GROUP
from toy import ON_PATH


def config(runs: list[dict], *, replicas: int, **options) -> str:
    """The program's argument: ``runs`` (each with the defaults filled in), ``replicas`` and ``options``."""
    defaults = {"asyncckpt": True, "resume": False, "kill_at": None, "stop_at": None}
    return json.dumps({"runs": [{**defaults, **run} for run in runs], "replicas": replicas, **options})


LIGHTNING = ON_PATH + textwrap.dedent("""
    import json, os, signal, sys, time, torch
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from asyncckpt.adapters.lightning import AsyncCkptIO
    from asyncckpt.core import MemoryTier
    import toy

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__(); self.body = toy.body(16, relu=True)
        def training_step(self, batch, batch_idx):
            x, y = batch; return torch.nn.functional.mse_loss(self.body(x), y)
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Control(Callback):
        def __init__(self, run):
            self.run = run
        def on_train_start(self, trainer, module):
            print(f"RANK {trainer.global_rank} BEGINS AT {trainer.global_step}", flush=True)
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if self.run["kill_at"] is not None and trainer.global_step == self.run["kill_at"] + 1:
                os.kill(os.getpid(), signal.SIGKILL)  # after the next optimizer step: the save was handed over
            if self.run["stop_at"] is not None and trainer.global_step == self.run["stop_at"] + 1:
                if isinstance(trainer.strategy.checkpoint_io, AsyncCkptIO):
                    trainer.strategy.checkpoint_io.wait()
                trainer.strategy.barrier()
                print("SAVED", flush=True)
                time.sleep(600)  # the test kills the job here

    def fit(run, options):
        root = run["root"]
        torch.manual_seed(0)
        data = toy.data(128, batch_size=4, seed=0)
        plugins = [AsyncCkptIO(memory_tier=MemoryTier(persist_every=2, replicas=options["replicas"]))] \\
            if run["asyncckpt"] else []
        trainer = L.Trainer(max_steps=options["max_steps"], accelerator="cpu", num_nodes=options["num_nodes"],
                            devices=options["devices"], strategy="ddp", plugins=plugins, logger=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                            callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), every_n_train_steps=5,
                                                       save_top_k=-1, save_last=True), Control(run)])
        model = Net()
        trainer.fit(model, data, ckpt_path="last" if run["resume"] else None)
        if trainer.global_rank == 0:
            torch.save(model.state_dict(), os.path.join(root, "final.pt"))

    options = json.loads(sys.argv[1])
    print(f"PID {os.getpid()}", flush=True)
    for run in options["runs"]:
        fit(run, options)
""") + DESTROY_PROCESS_GROUP


ACCELERATE = ON_PATH + textwrap.dedent("""
    import json, os, signal, sys, time, torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from asyncckpt.adapters.accelerate import enable_async_checkpointing
    from asyncckpt.core import MemoryTier
    import toy

    options = json.loads(sys.argv[1])
    (run,) = options["runs"]  # one training per process (see this module's docstring)
    project = run["root"]
    print(f"PID {os.getpid()}", flush=True)
    set_seed(0)
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=project, total_limit=2,
                                                                    automatic_checkpoint_naming=True))
    handle = enable_async_checkpointing(acc, memory_tier=MemoryTier(persist_every=2, replicas=options["replicas"])) \\
        if run["asyncckpt"] else None
    model = toy.body(16, relu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dl = toy.data(64, batch_size=8, seed=0)
    model, opt, dl = acc.prepare(model, opt, dl)
    start = 0
    if run["resume"]:
        acc.load_state()
        start = acc.project_configuration.iteration
    print(f"RANK {acc.process_index} BEGINS AT {start}", flush=True)
    for epoch in range(start, 5):
        for i, (xb, yb) in enumerate(dl):
            loss = torch.nn.functional.mse_loss(model(xb), yb); acc.backward(loss); opt.step(); opt.zero_grad()
            if run["kill_at"] is not None and epoch == run["kill_at"] + 1 and i == 0:
                os.kill(os.getpid(), signal.SIGKILL)  # the optimizer step after the save: its snapshot handed over
        acc.save_state()
        if epoch == run["stop_at"]:  # committed on every rank, then the test kills the job
            handle.wait()
            acc.wait_for_everyone()
            print("SAVED", flush=True)
            time.sleep(600)
    acc.end_training()
    if acc.is_main_process:
        torch.save(acc.unwrap_model(model).state_dict(), os.path.join(project, "final.pt"))
    if handle is not None:
        handle.remove()
""")


TRAINER = ON_PATH + textwrap.dedent('''
    import os, signal, sys, torch
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback
    from asyncckpt.core import MemoryTier
    from toy import Net, Toy

    root, phase, kill_at, replicas = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

    class KillAt(TrainerCallback):  # after the next optimizer step: the overlapped snapshot of the save is handed over
        def on_step_end(self, args, state, control, **kwargs):
            if phase == "first" and state.global_step == kill_at + 1: os.kill(os.getpid(), signal.SIGKILL)
        def on_train_begin(self, args, state, control, **kwargs):
            print(f"RANK {args.process_index} BEGINS AT {state.global_step}", flush=True)

    def train(out, use_asyncckpt, resume):
        torch.manual_seed(0)
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=16, num_train_epochs=4, learning_rate=1e-2,
                                 save_strategy="steps", save_steps=5, save_total_limit=2, logging_steps=5, report_to=[],
                                 use_cpu=True, disable_tqdm=True, ddp_find_unused_parameters=False)
        callbacks = [KillAt()] + ([AsyncCheckpointCallback(memory_tier=MemoryTier(persist_every=2, replicas=replicas))]
                                  if use_asyncckpt else [])
        trainer = Trainer(model=Net(), args=args, train_dataset=Toy(), callbacks=callbacks)
        trainer.train(resume_from_checkpoint=resume)
        if args.process_index == 0:
            torch.save(trainer.model.state_dict(), os.path.join(out, "final.pt"))

    print(f"PID {os.getpid()}", flush=True)
    if phase == "first":  # killed in step KILL_AT + 1
        train(os.path.join(root, "async"), True, False)
    else:  # uninterrupted without asyncckpt, then the relaunch of the killed run
        train(os.path.join(root, "native"), False, False)
        train(os.path.join(root, "async"), True, True)
''') + DESTROY_PROCESS_GROUP
