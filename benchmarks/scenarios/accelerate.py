"""Accelerate: the stall of ``save_state()`` and the training slowdown, native against asyncckpt."""
from __future__ import annotations

import shutil
import tempfile

from harness import Option, Scenario, training
from harness.floors import checkpoint_tensors
from harness.util import now

ARMS = ("none", "native", "asyncckpt", "asyncckpt_overlap", "raw_write")
NAMES = {"native": "Accelerate's own `save_state()` (synchronous, no fsync)",
         "asyncckpt": "`enable_async_checkpointing(overlap_optimizer=False)`",
         "asyncckpt_overlap": "**`enable_async_checkpointing(overlap_optimizer=True)`** (the default since 0.2)",
         "raw_write": "floor: a raw O_DIRECT write of the same bytes by another process"}


def train(mode: str, steps: int, every: int, hidden: int, layers: int, batch: int) -> dict:
    """One run in this process: an MLP of ``layers`` x Linear(``hidden``) + AdamW + StepLR, ``save_state()``
    every ``every`` steps with ``total_limit=2`` (rotation), and once after the last step (the drain)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed

    set_seed(0)
    log = training.StepLog(mode, every, steps)
    workdir = tempfile.mkdtemp(prefix="accelerate_bench_")
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=workdir, automatic_checkpoint_naming=True, total_limit=2))
    handle = None
    if mode.startswith("asyncckpt"):
        from asyncckpt.adapters.accelerate import enable_async_checkpointing

        # explicit in both arms: the default changed (docs/options.md), and a before/after sitting runs both revisions
        handle = enable_async_checkpointing(accelerator, overlap_optimizer=mode == "asyncckpt_overlap")
    modules = []
    for _ in range(layers):
        modules += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*modules[:-1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    data = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        log.began(step)
        accelerator.backward(model(torch.randn(batch, hidden, generator=data)).square().mean())
        t0 = now()
        optimizer.step()  # with overlap_optimizer, waits for the last save's optimizer snapshot
        log.optimizer(step, now() - t0)
        scheduler.step()
        optimizer.zero_grad(set_to_none=False)
        log.ended(step)
        if mode != "none" and (step % every == 0 or step == steps):
            log.save(step, accelerator.save_state, checkpoint_tensors(accelerator.unwrap_model(model), optimizer.optimizer),
                     workdir)
    if handle is not None:
        handle.wait()
    result = log.result(returned=now())
    accelerator.end_training()
    shutil.rmtree(workdir, ignore_errors=True)
    return result


def measure(sitting) -> dict:
    o = sitting.o
    return training.measure(sitting, ARMS, {"asyncckpt", "asyncckpt_overlap"}, steps=o.steps, every=o.every,
                            hidden=o.hidden, layers=o.layers, batch=o.batch)


SETUP = ("Model: an MLP of {layers} x Linear({hidden}, {hidden}) + AdamW + StepLR: `save_state()` writes **{state_mb:.0f} "
         "MB** of tensors ({tensors} tensors: model.safetensors, optimizer.bin, scheduler.bin, random_states_0.pkl). "
         "`ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)`, {steps} steps of batch {batch}; the "
         "save after the last step and the wait for its write are the drain. The runs keep freed memory in glibc "
         "(`MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`): this VM's fresh pages cost ~0.3 GB/s to fault.")

SCENARIO = Scenario(
    title="Accelerate: the save's stall and the training slowdown",
    question="What an Accelerate run pays for `save_state()` with `enable_async_checkpointing`, against Accelerate's own "
             "`save_state()`, a run without checkpoints, and the floor: another process writing the same bytes durably "
             "(no snapshot, no checksums).",
    measure=measure,
    render=lambda result: training.render(result, NAMES, SETUP),
    plot=training.plot,
    options={"steps": Option(60, 18), "every": Option(10, 6), "hidden": Option(2048, 256), "layers": Option(10, 2),
             "batch": Option(16, 4)},
    reps=(2, 1),
    revisioned=True,
)
