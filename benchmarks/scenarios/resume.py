"""A cold-cache resume of ~1 GiB of state per adapter: the framework's own load, checked by asyncckpt or not.

Each adapter saves one checkpoint of a model with ~1 GiB of weights + AdamW state through asyncckpt, as a
user's run would (Lightning a ``.ckpt`` through ``AsyncCkptIO``, Accelerate a ``save_state()`` directory,
the Trainer a ``checkpoint-N`` directory; ``lightning_sharded``: the directory ``AsyncCkptIO.save_sharded``
writes, read as FSDP's strategy reads it). Then one process per arm loads it, one rep each in rotation,
the checkpoint's pages evicted from the page cache before every rep:

  native           the framework without asyncckpt
  check_then_load  check every file, then the framework's load: two reads of each file
  asyncckpt        the adapter: the framework loads the files its own way while a thread hashes them
                   beside it, over the pages the load reads (``Checkpointer.load_while_checking``)
  disk             reading the checkpoint's files into a held 8 MiB buffer: the disk's part
"""
from __future__ import annotations

import os
import resource
import shutil
import tempfile

from harness import Option, Scenario
from harness.floors import read_files
from harness.machine import drop_caches, evict, resident_fraction, touch_memory
from harness.report import arm_name, bars, fmt, table
from harness.util import now, spread

ARMS = ("native", "check_then_load", "asyncckpt")
NAMES = {"native": "native", "check_then_load": "check, then load", "asyncckpt": "**asyncckpt**", "disk": "disk"}
TIMED = {"lightning": "`load_checkpoint` of the `.ckpt`", "accelerate": "`load_state(dir)`",
         "hf_trainer": "`train(resume_from_checkpoint=dir)` to its first step",
         "lightning_sharded": "FSDP's sharded load: `dcp.load` of the directory in place, then `meta.pt`"}
STEP = 1


def build_model(big: int, small: int, n_small: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.ModuleList([torch.nn.Linear(big, big) for _ in range(5)] +
                               [torch.nn.Linear(small, small) for _ in range(n_small)])


def loss_of(model):
    import torch

    return sum(layer(torch.ones(1, layer.in_features)).sum() for layer in model)


class Resumed(Exception):
    """Raised by the Trainer's callback where the first step after the resume would begin."""


def adapter_kit(adapter: str, root: str, mode: str, sizes: dict):
    """(save, prepare, load) for one adapter: ``save()`` returns the checkpoint's files."""
    import torch

    from asyncckpt import core

    checkpointer = core.Checkpointer() if mode != "native" else None

    def check_first(path: str) -> None:
        if mode == "check_then_load":
            checkpointer.require_intact(path)

    if adapter == "lightning":
        import lightning as L
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
        from lightning.pytorch.callbacks import ModelCheckpoint

        path = os.path.join(root, "resume.ckpt")

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.layers = build_model(**sizes)

            def training_step(self, batch, batch_idx):
                return loss_of(self.layers)

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters())

        def save() -> list[str]:
            from asyncckpt.adapters.lightning import AsyncCkptIO

            data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(1, 1)))
            L.Trainer(max_steps=STEP, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu", plugins=[AsyncCkptIO()],
                      callbacks=[ModelCheckpoint(dirpath=root, filename="resume")]).fit(Module(), data)
            return [path]

        box: dict = {}

        def prepare() -> None:
            from asyncckpt.adapters.lightning import AsyncCkptIO

            box["io"] = AsyncCkptIO() if mode == "asyncckpt" else TorchCheckpointIO()

        def load() -> None:
            check_first(path)
            assert box["io"].load_checkpoint(path)["global_step"] == STEP
        return save, prepare, load
    if adapter == "accelerate":
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState
        from accelerate.utils import ProjectConfiguration

        directory = os.path.join(root, "checkpoints", "checkpoint_0")
        box: dict = {}

        def accelerator(adapter_on: bool):
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
            acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=root,
                                                                           automatic_checkpoint_naming=True))
            if adapter_on:
                from asyncckpt.adapters.accelerate import enable_async_checkpointing

                box["handle"] = enable_async_checkpointing(acc)
            model = build_model(**sizes)
            box["model"], box["optimizer"] = acc.prepare(model, torch.optim.AdamW(model.parameters()))
            return acc

        def save() -> list[str]:
            acc = accelerator(True)
            loss_of(box["model"]).backward()
            box["optimizer"].step()
            acc.save_state()
            box["handle"].remove()
            return [os.path.join(directory, name) for name in sorted(os.listdir(directory))]

        def prepare() -> None:  # the adapter checks inside load_state; check_then_load checks first
            box["acc"] = accelerator(mode == "asyncckpt")

        def load() -> None:
            check_first(directory)
            box["acc"].load_state(directory)
            assert len(box["optimizer"].state_dict()["state"]) == len(list(box["model"].parameters()))
        return save, prepare, load
    if adapter == "hf_trainer":
        from transformers import Trainer, TrainerCallback, TrainingArguments

        directory = os.path.join(root, f"checkpoint-{STEP}")

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = build_model(**sizes)

            def forward(self, x, labels=None):
                return {"loss": loss_of(self.layers) + 0 * x.sum()}

        class Data(torch.utils.data.Dataset):
            def __len__(self):
                return 64

            def __getitem__(self, i):
                return {"x": torch.zeros(1)}

        class StopAtFirstStep(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                raise Resumed(state.global_step)

        net = Net()

        def trainer(adapter_on: bool, stop: bool, max_steps: int):
            from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback

            callbacks = ([StopAtFirstStep()] if stop else []) + ([AsyncCheckpointCallback()] if adapter_on else [])
            args = TrainingArguments(output_dir=root, max_steps=max_steps, save_steps=STEP, per_device_train_batch_size=1,
                                     report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="steps",
                                     logging_strategy="no")
            return Trainer(model=net, args=args, train_dataset=Data(), callbacks=callbacks)

        def save() -> list[str]:
            trainer(True, False, STEP).train()
            return [os.path.join(directory, name) for name in sorted(os.listdir(directory))]

        def load() -> None:
            check_first(directory)
            resumed = trainer(mode == "asyncckpt", True, STEP + 1)
            try:
                resumed.train(resume_from_checkpoint=directory)
            except Resumed as stopped:
                assert stopped.args[0] == STEP and len(resumed.optimizer.state_dict()["state"]) > 0
            else:
                raise AssertionError("the resumed run trained no step")
        return save, lambda: None, load
    # lightning_sharded: the two reads of Lightning's FSDPStrategy.load_checkpoint, without the strategy
    # (it needs a GPU), on the directory AsyncCkptIO.save_sharded writes
    import io

    import torch.distributed.checkpoint as dcp

    path, box = os.path.join(root, "resume.ckpt"), {}

    def state() -> dict:
        model = build_model(**sizes)
        optimizer = torch.optim.AdamW(model.parameters())
        loss_of(model).backward()
        optimizer.step()
        return {"model": model.state_dict(), "optimizer_0": optimizer.state_dict()}

    def save() -> list[str]:
        from asyncckpt import core

        meta = io.BytesIO()
        torch.save({"global_step": STEP, "epoch": 0}, meta)
        core.save(state(), path, extra_files={"meta.pt": meta.getvalue()})
        return [os.path.join(path, name) for name in os.listdir(path)]

    def read() -> None:
        dcp.load(box["target"], checkpoint_id=path)
        assert torch.load(os.path.join(path, "meta.pt"), weights_only=True)["global_step"] == STEP

    def load() -> None:
        check_first(path)
        checkpointer.load_while_checking(path, read) if mode == "asyncckpt" else read()

    return save, lambda: box.update(target=state()), load


# ------------------------------------------------------------------------------------------ children
def save(adapter: str, root: str, sizes: dict) -> dict:
    return {"files": adapter_kit(adapter, root, "asyncckpt", sizes)[0]()}


def loader(adapter: str, mode: str, root: str, sizes: dict):
    """Served: ready once prepared; then one timed load per ask."""
    _, prepare, load = adapter_kit(adapter, root, mode, sizes)
    prepare()
    yield {"ready": True}
    while True:
        usage, t0 = resource.getrusage(resource.RUSAGE_SELF), now()
        load()
        seconds, after = now() - t0, resource.getrusage(resource.RUSAGE_SELF)
        yield {"s": seconds, "cpu_s": after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime}


# ------------------------------------------------------------------------------------------ the sitting
def measure(sitting) -> dict:
    o = sitting.o
    sizes = {"big": o.big, "small": o.small, "n_small": o.n_small}
    out = {}
    for adapter in o.adapters.split(","):
        root = tempfile.mkdtemp(prefix=f"resume_{adapter}_", dir=sitting.scratch)
        with sitting.phase(adapter):
            files = sitting.child("save", adapter=adapter, root=root, sizes=sizes)["files"]
            nbytes = sum(os.path.getsize(f) for f in files)
            sitting.log(f"{adapter}: {nbytes / 2**20:.0f} MiB in {len(files)} file(s)")
            runs = sitting.runs(ARMS, {"asyncckpt"})
            served = {run.label: sitting.serve("loader", revision=run.revision, adapter=adapter, mode=run.arm,
                                               root=root, sizes=sizes) for run in runs}
            reps: dict[str, list] = {label: [] for label in [*served, "disk"]}
            resident, buffer = [], memoryview(bytearray(8 << 20))
            labels = list(served)
            for rep in range(o.reps + 1):  # rep 0 warms each process (first-use work) and is dropped
                for label in labels[rep % len(labels):] + labels[:rep % len(labels)] + ["disk"]:
                    evict(files)
                    if o.drop_caches:
                        drop_caches()
                    touch_memory(int(o.touch_gib * 2**30))
                    if rep:
                        resident.append(resident_fraction(files))
                    answer = {"s": read_files(files, buffer)["s"]} if label == "disk" else served[label].ask()
                    if rep:
                        reps[label].append(answer)
                if rep:
                    sitting.log(f"{adapter} rep {rep}: " + ", ".join(f"{k} {v[-1]['s']:.3f}" for k, v in reps.items()))
            for child in served.values():
                child.close()
        shutil.rmtree(root, ignore_errors=True)
        out[adapter] = {"bytes": nbytes, "files": [os.path.relpath(f, root) for f in files], "resident_max": max(resident),
                        "s": {k: spread(r["s"] for r in v) for k, v in reps.items()},
                        "cpu_s": {k: spread(r.get("cpu_s") for r in v) for k, v in reps.items() if k != "disk"},
                        "reps": reps}
    return out


def render(result: dict) -> str:
    o, figures = result["options"], result["figures"]
    lines = [f"{o['reps']} reps per arm in rotation, medians (min). Before every rep the checkpoint's pages were evicted "
             f"({'drop_caches + ' if o['drop_caches'] else ''}`posix_fadvise(DONTNEED)`; at most "
             f"{100 * max(r['resident_max'] for r in figures.values()):.1f}% of them still cached at a rep's start, by "
             f"`mincore`) and {o['touch_gib']:g} GiB of memory touched and freed (this VM returns freed memory to its "
             "host, and touching it again costs ~3 s/GiB, which would hit the reps' allocations at random). **native** = "
             "the framework's own load; **check, then load** = every file checked, then the framework's load; "
             "**asyncckpt** = the framework's load with the check beside it, on a thread, over the same pages; **disk** = "
             "reading the files into a held buffer. Target: asyncckpt <= 1.1x native.", ""]
    labels = [label for label in next(iter(figures.values()))["s"] if label != "disk"]
    rows, cpu_rows = [], []
    for adapter, r in figures.items():
        s, native = r["s"], r["s"]["native"]
        rows.append([adapter, TIMED[adapter], f"{r['bytes'] / 2**20:.0f} MiB", *(f"{fmt(s[k]['median'])} ({fmt(s[k]['min'])})"
                                                                                 for k in ["disk", *labels]),
                     *(f"{fmt(s[k]['median'] / native['median'], '.2f')}x ({fmt(s[k]['min'] / native['min'], '.2f')}x)"
                       for k in labels if k != "native"),
                     "yes" if s["asyncckpt"]["median"] <= 1.1 * native["median"] else "**no**"])
        c = r["cpu_s"]
        cpu_rows.append([adapter, *(f"{fmt(c[k]['median'])} ({fmt(c[k]['min'])})" for k in labels),
                         f"{c['asyncckpt']['min'] - c['native']['min']:+.3f}"])
    names = [arm_name(k, NAMES, result) for k in labels]
    lines += table(["adapter", "what is timed", "bytes", "disk s", *(f"{n} s" for n in names),
                    *(f"{n} / native (min)" for n, k in zip(names, labels) if k != "native"), "target met"], rows)
    lines += ["CPU time of the loading process (user + system, every thread), median (min): what the load itself costs, "
              "which the machine's other tenants disturb less than the wall time.", "",
              *table(["adapter", *(f"{n} CPU s" for n in names), "asyncckpt - native (min)"], cpu_rows)]
    return "\n".join(lines)


def plot(result: dict, figure) -> None:
    figures = result["figures"]
    axes = figure.subplots(1, len(figures), squeeze=False)[0]
    for ax, (adapter, r) in zip(axes, figures.items()):
        bars(ax, list(r["s"]), [v["median"] for v in r["s"].values()], f"{adapter}: seconds")


SCENARIO = Scenario(
    title="A cold-cache resume",
    question="What checking a checkpoint costs a resume from a cold page cache: each adapter's resume with asyncckpt "
             "against the framework's own load, checking first and loading after, and the disk's read of the same files.",
    measure=measure, render=render, plot=plot,
    options={"adapters": Option("lightning,accelerate,hf_trainer", help="and lightning_sharded"),
             "big": Option(4096, 512), "small": Option(128, 64), "n_small": Option(200, 20),
             "touch_gib": Option(3.0, 0.0), "drop_caches": Option(False)},
    reps=(5, 1),
    revisioned=True,
)
