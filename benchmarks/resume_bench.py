"""A cold-cache resume of 1 GiB of state, per adapter: the framework's own load, asyncckpt before and after.

    .venv/bin/python benchmarks/resume_bench.py [--adapters lightning,accelerate,hf_trainer] [--reps 5]
    # writes benchmarks/results/resume.json and docs/benchmarks_resume.md
    # (Lightning's sharded FSDP resume: --adapters lightning_sharded --json benchmarks/results/resume_sharded.json
    #  --markdown docs/benchmarks_resume_sharded.md)

Each adapter saves one checkpoint of a model with ~1 GiB of weights + AdamW state (5 Linear(4096, 4096)
and 200 Linear(128, 128), ~335 MiB of weights; one optimizer step) through asyncckpt, as a user's run
would: Lightning a ``.ckpt`` through ``AsyncCkptIO``, Accelerate a ``save_state()`` directory, the
Trainer a ``checkpoint-N`` directory. Then three processes per adapter load it, one rep each in
rotation, with the checkpoint's pages evicted from the page cache before every rep (``os.sync()``,
then ``posix_fadvise(DONTNEED)`` on each file; ``--drop-caches`` also writes
``/proc/sys/vm/drop_caches``, which empties every cache of the machine). Before each rep the
fraction of the checkpoint still resident is measured (``mincore``), and reported.

  native    the framework without asyncckpt: Lightning's ``TorchCheckpointIO().load_checkpoint``,
            Accelerate's ``load_state(dir)``, the Trainer's ``train(resume_from_checkpoint=dir)``
  before    the adapter as of ``--base-rev`` (check every file, then let the framework load it)
  after     the adapter as it is (``asyncckpt.core.integration.resume``: the framework loads the files its
            own way while a thread hashes them beside it, over the pages the load reads)
  disk      reading the checkpoint's files into a held buffer, 8 MiB at a time: the disk's part

The Trainer's figure is its ``train(resume_from_checkpoint=...)`` up to where its first step would
begin (a callback stops it there), which also sets up the optimizer and the accelerator; Lightning's
and Accelerate's are the load calls alone. Target: after <= 1.1x native.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from base_revision import revision_pythonpath  # noqa: E402
from harness import drop_caches, git_meta, log  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ADAPTERS = ("lightning", "accelerate", "hf_trainer")
MODES = ("native", "before", "after")
BIG, SMALL, N_SMALL = 4096, 128, 200
STEP = 1
_ANSWER = "resume_bench: "  # a child's answers, among whatever the frameworks print


# ------------------------------------------------------------------------------------------ the state
def build_model():
    import torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(BIG, BIG) for _ in range(5)] + [torch.nn.Linear(SMALL, SMALL) for _ in range(N_SMALL)]
    return torch.nn.ModuleList(layers)


def loss_of(model, torch):
    big = torch.ones(1, BIG)
    small = torch.ones(1, SMALL)
    return sum((layer(big if layer.in_features == BIG else small)).sum() for layer in model)


# ------------------------------------------------------------------------------------------ per adapter
class Lightning:
    def __init__(self, root: str, mode: str) -> None:
        import lightning as L
        import torch

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.layers = build_model()

            def training_step(self, batch, batch_idx):
                return loss_of(self.layers, torch)

            def configure_optimizers(self):
                return torch.optim.AdamW(self.parameters())

        self.L, self.torch, self.Module, self.root, self.mode = L, torch, Module, root, mode
        self.path = os.path.join(root, "resume.ckpt")

    def save(self) -> list[str]:
        from lightning.pytorch.callbacks import ModelCheckpoint

        from asyncckpt.adapters.lightning import AsyncCkptIO

        data = self.torch.utils.data.DataLoader(self.torch.utils.data.TensorDataset(self.torch.zeros(1, 1)))
        self.L.Trainer(max_steps=STEP, logger=False, enable_progress_bar=False, enable_model_summary=False,
                       accelerator="cpu", plugins=[AsyncCkptIO()],
                       callbacks=[ModelCheckpoint(dirpath=self.root, filename="resume")]).fit(self.Module(), data)
        return [self.path]

    def prepare(self) -> None:
        if self.mode == "native":
            from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

            self.io = TorchCheckpointIO()
        else:
            from asyncckpt.adapters.lightning import AsyncCkptIO

            self.io = AsyncCkptIO()

    def load(self) -> None:
        loaded = self.io.load_checkpoint(self.path)
        assert loaded["global_step"] == STEP


class Accelerate:
    def __init__(self, root: str, mode: str) -> None:
        self.root, self.mode = root, mode

    def _accelerator(self, adapter: bool):
        import torch
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState
        from accelerate.utils import ProjectConfiguration

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=self.root,
                                                                       automatic_checkpoint_naming=True))
        if adapter:
            from asyncckpt.adapters.accelerate import enable_async_checkpointing

            self.handle = enable_async_checkpointing(acc)
        model = build_model()
        optimizer = torch.optim.AdamW(model.parameters())
        self.model, self.optimizer = acc.prepare(model, optimizer)
        return acc

    def save(self) -> list[str]:
        import torch

        acc = self._accelerator(adapter=True)
        loss_of(self.model, torch).backward()
        self.optimizer.step()
        acc.save_state()
        self.handle.remove()
        directory = os.path.join(self.root, "checkpoints", "checkpoint_0")
        return [os.path.join(directory, name) for name in sorted(os.listdir(directory))]

    def prepare(self) -> None:
        self.acc = self._accelerator(adapter=self.mode != "native")
        self.directory = os.path.join(self.root, "checkpoints", "checkpoint_0")

    def load(self) -> None:
        self.acc.load_state(self.directory)
        assert len(self.optimizer.state_dict()["state"]) == len(list(self.model.parameters()))


class HfTrainer:
    def __init__(self, root: str, mode: str) -> None:
        self.root, self.mode = root, mode

    def _trainer(self, adapter: bool, stop_at_first_step: bool = False):
        import torch
        from transformers import Trainer, TrainerCallback, TrainingArguments

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = build_model()

            def forward(self, x, labels=None):
                return {"loss": loss_of(self.layers, torch) + 0 * x.sum()}

        class Data(torch.utils.data.Dataset):
            def __len__(self):
                return 64

            def __getitem__(self, i):
                return {"x": torch.zeros(1)}

        class StopAtFirstStep(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                raise Resumed(state.global_step)

        if not hasattr(self, "model"):
            self.model = Net()
        callbacks = [StopAtFirstStep()] if stop_at_first_step else []
        if adapter:
            from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback

            callbacks.append(AsyncCheckpointCallback())
        args = TrainingArguments(output_dir=self.root, max_steps=STEP + 1, save_steps=STEP, per_device_train_batch_size=1,
                                 report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="steps", logging_strategy="no")
        return Trainer(model=self.model, args=args, train_dataset=Data(), callbacks=callbacks)

    def save(self) -> list[str]:
        trainer = self._trainer(adapter=True)
        trainer.args.max_steps = STEP
        trainer.train()
        directory = os.path.join(self.root, f"checkpoint-{STEP}")
        return [os.path.join(directory, name) for name in sorted(os.listdir(directory))]

    def prepare(self) -> None:
        self.directory = os.path.join(self.root, f"checkpoint-{STEP}")
        self._trainer(adapter=self.mode != "native")  # the model, built once

    def load(self) -> None:
        """``train(resume_from_checkpoint=...)`` until its first step would run (every load done by then)."""
        trainer = self._trainer(adapter=self.mode != "native", stop_at_first_step=True)
        try:
            trainer.train(resume_from_checkpoint=self.directory)
        except Resumed as resumed:
            assert resumed.args[0] == STEP and len(trainer.optimizer.state_dict()["state"]) > 0
        else:
            raise AssertionError("the resumed run trained no step")


class Resumed(Exception):
    """Raised by the Trainer benchmark's callback where the first step after the resume would begin."""


class LightningSharded:
    """Lightning's sharded FSDP resume as it reads a checkpoint directory: ``dcp.load(state,
    checkpoint_id=dir)`` into the model's and the optimizer's tensors, in place, then ``torch.load`` of its
    ``meta.pt`` (``FSDPStrategy.load_checkpoint``; the strategy needs a GPU, so its two reads are run here
    without it, on the same directory ``AsyncCkptIO.save_sharded`` writes)."""

    def __init__(self, root: str, mode: str) -> None:
        import torch

        self.torch, self.mode = torch, mode
        self.path = os.path.join(root, "resume.ckpt")

    def state(self) -> dict:
        model = build_model()
        optimizer = self.torch.optim.AdamW(model.parameters())
        loss_of(model, self.torch).backward()
        optimizer.step()
        return {"model": model.state_dict(), "optimizer_0": optimizer.state_dict()}

    def save(self) -> list[str]:
        import io

        from asyncckpt import core

        meta = io.BytesIO()
        self.torch.save({"global_step": STEP, "epoch": 0}, meta)
        core.save(self.state(), self.path, extra_files={"meta.pt": meta.getvalue()})
        return [os.path.join(self.path, name) for name in os.listdir(self.path)]

    def prepare(self) -> None:
        from asyncckpt import core

        self.target = self.state()
        self.checkpointer = core.Checkpointer() if self.mode != "native" else None

    def read(self) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(self.target, checkpoint_id=self.path)
        assert self.torch.load(os.path.join(self.path, "meta.pt"), weights_only=True)["global_step"] == STEP

    def load(self) -> None:
        if self.mode == "native":
            self.read()
        elif self.mode == "before":  # check, then load (the adapter's sharded resume until this change)
            self.checkpointer.require_intact(self.path)
            self.read()
        else:
            self.checkpointer.load_while_checking(self.path, self.read)


KINDS = {"lightning": Lightning, "accelerate": Accelerate, "hf_trainer": HfTrainer,
         "lightning_sharded": LightningSharded}


# ------------------------------------------------------------------------------------------ the page cache
def touch_memory(nbytes: int) -> None:
    """Touch ``nbytes`` of fresh memory and free it, just before a rep: this VM hands memory freed a few
    seconds ago back to its host, and touching it again costs ~3 s per GiB (/work/shared/research/machine.md,
    1a), which hit a rep's allocations and page cache at random (the same work took 0.7 to 2.6 s of CPU).
    Touched now, the memory the rep's process and its cold read allocate is the guest's, whatever the mode."""
    if nbytes:
        block = bytearray(nbytes)
        view = memoryview(block)
        for start in range(0, nbytes, 1 << 26):
            view[start:start + (1 << 26)] = bytes(min(1 << 26, nbytes - start))  # every page written
        del view, block


def evict(paths: list[str]) -> None:
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


def resident_fraction(paths: list[str]) -> float:
    """The fraction of the files' pages in the page cache (``mincore`` of a mapping; reads nothing)."""
    page = mmap.PAGESIZE
    resident = total = 0
    for path in paths:
        size = os.path.getsize(path)
        if not size:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            pages = (size + page - 1) // page
            vector = ctypes.create_string_buffer(pages)
            if _libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            resident += sum(byte & 1 for byte in vector.raw)
            total += pages
            _libc.munmap(address, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


def disk_read(paths: list[str], buffer: bytearray) -> None:
    view = memoryview(buffer)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


# ------------------------------------------------------------------------------------------ processes
def child(adapter: str, mode: str, root: str) -> int:
    """Load on each line ``go`` from the parent, answering with the seconds it took."""
    kind = KINDS[adapter](root, mode)
    if mode == "save":
        print(_ANSWER + json.dumps({"files": kind.save()}), flush=True)
        return 0
    kind.prepare()
    print(_ANSWER + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        started, cpu = time.perf_counter(), cpu_seconds()
        kind.load()
        print(_ANSWER + json.dumps({"seconds": time.perf_counter() - started, "cpu_seconds": cpu_seconds() - cpu}),
              flush=True)
    return 0


def cpu_seconds() -> float:
    """CPU time of this process so far, every thread (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def spawn(adapter: str, mode: str, root: str, base_path: str) -> subprocess.Popen:
    env = dict(os.environ)
    if mode == "before":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (base_path, env.get("PYTHONPATH")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return subprocess.Popen([sys.executable, __file__, "--child", adapter, mode, root], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def answer(process: subprocess.Popen) -> dict:
    for line in process.stdout:
        if line.startswith(_ANSWER):
            return json.loads(line[len(_ANSWER):])
    raise RuntimeError(f"child exited with {process.wait()}")


def run_adapter(adapter: str, args, base_path: str) -> dict:
    root = tempfile.mkdtemp(prefix=f"resume_bench_{adapter}_", dir=args.dir)
    try:
        saver = spawn(adapter, "save", root, base_path)
        files = answer(saver)["files"]
        saver.wait()
        nbytes = sum(os.path.getsize(f) for f in files)
        log(f"{adapter}: {nbytes / 2**20:.0f} MiB in {len(files)} file(s)")
        children = {mode: spawn(adapter, mode, root, base_path) for mode in MODES}
        for process in children.values():
            answer(process)  # ready
        rows: dict[str, list[float]] = {mode: [] for mode in (*MODES, "disk")}
        cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
        resident: list[float] = []
        buffer = bytearray(8 << 20)
        for rep in range(args.reps + 1):  # rep 0 warms each process (first-use work) and is dropped
            order = list(MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]) + ["disk"]
            for mode in order:
                evict(files)
                if args.drop_caches:
                    drop_caches()
                touch_memory(int(args.touch_gib * 2**30))
                if rep:
                    resident.append(resident_fraction(files))
                started = time.perf_counter()
                if mode == "disk":
                    disk_read(files, buffer)
                    seconds = time.perf_counter() - started
                else:
                    children[mode].stdin.write("go\n")
                    children[mode].stdin.flush()
                    answered = answer(children[mode])
                    seconds = answered["seconds"]
                    if rep:
                        cpu[mode].append(answered["cpu_seconds"])
                if rep:
                    rows[mode].append(seconds)
            if rep:
                log(f"{adapter} rep {rep}: " + ", ".join(f"{m} {rows[m][-1]:.3f}" for m in rows))
        for process in children.values():
            process.stdin.close()
            process.wait()
        median = {mode: statistics.median(values) for mode, values in rows.items()}
        return {"bytes": nbytes, "files": [os.path.relpath(f, root) for f in files], "reps": rows, "median": median,
                "cpu_reps": cpu, "cpu_median": {mode: statistics.median(values) for mode, values in cpu.items()},
                "min": {mode: min(values) for mode, values in rows.items()},
                "resident_before_rep_max": max(resident),
                "after_over_native": median["after"] / median["native"],
                "before_over_native": median["before"] / median["native"],
                "met": median["after"] <= 1.1 * median["native"]}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def write_markdown(result: dict, path: str) -> None:
    meta, args = result["meta"], result["args"]
    lines = ["# A cold-cache resume", "",
             f"`benchmarks/resume_bench.py` ({args['reps']} reps per mode in rotation, medians (min); load average "
             f"{meta['loadavg_before'][0]:.2f} before, {meta['loadavg_after'][0]:.2f} after, on 2 shared vCPUs; "
             f"`before` = asyncckpt at {args['base_rev']}, `after` = {meta['git_commit'][:12]}"
             f"{' + uncommitted changes' if meta['core_dirty'] else ''}). Before every rep the checkpoint's pages "
             f"were evicted ({'drop_caches + ' if args['drop_caches'] else ''}`posix_fadvise(DONTNEED)`); at most "
             f"{100 * max(r['resident_before_rep_max'] for r in result['results'].values()):.1f}% of them were "
             f"still cached at the start of a rep (`mincore`), and {args.get('touch_gib', 0):g} GiB of memory were touched "
             "and freed (this VM returns freed memory to its host, and touching it again costs ~3 s per GiB, "
             "which hit the reps' allocations at random: `touch_memory`). **native** = the framework's own load without "
             "asyncckpt; **before** = check every file, then the framework's load; **after** = the framework's load "
             "with the check beside it, on a thread, over the same pages (`asyncckpt.core.integration.resume`); **disk** = reading the files "
             "into a held buffer. Target: after <= 1.1x native.", "",
             "| adapter | what is timed | bytes | disk s | native s | before s | after s | before / native | after / native "
             "| before / native, min | after / native, min | target met (medians) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    timed = {"lightning": "`load_checkpoint` of the `.ckpt`", "accelerate": "`load_state(dir)`",
             "lightning_sharded": "FSDP's sharded load: `dcp.load` of the directory in place, then `meta.pt`",
             "hf_trainer": "`train(resume_from_checkpoint=dir)` to its first step"}
    for adapter, r in result["results"].items():
        m, low = r["median"], r["min"]
        cell = {mode: f"{m[mode]:.3f} ({low[mode]:.3f})" for mode in m}
        lines.append(f"| {adapter} | {timed[adapter]} | {r['bytes'] / 2**20:.0f} MiB | {cell['disk']} | {cell['native']} | "
                     f"{cell['before']} | {cell['after']} | {r['before_over_native']:.2f}x | {r['after_over_native']:.2f}x | "
                     f"{low['before'] / low['native']:.2f}x | {low['after'] / low['native']:.2f}x | "
                     f"{'yes' if r['met'] else '**no**'} |")
    lines += ["", "CPU time of the loading process (user + system, every thread), median (min): what the load itself costs, "
              "which the machine's other tenants disturb less than the wall time above (though a VM's stolen time still "
              "shows in it).", "",
              "| adapter | native CPU s | before CPU s | after CPU s | after - native (min) |", "|---|---|---|---|---|"]
    for adapter, r in result["results"].items():
        c = r["cpu_median"]
        low = {mode: min(values) for mode, values in r["cpu_reps"].items()}
        lines.append(f"| {adapter} | {c['native']:.3f} ({low['native']:.3f}) | {c['before']:.3f} ({low['before']:.3f}) | "
                     f"{c['after']:.3f} ({low['after']:.3f}) | {low['after'] - low['native']:+.3f} s |")
    lines += ["", "Notes. The machine is shared with other work (the load averages above, on 2 vCPUs): reps of one mode "
              "differ by up to 3x in wall time, the disk's included, so a median of a few reps says little and the "
              "`min` columns (the least disturbed rep of each mode) say more. What the change does shows in both: "
              "`before` read every file for the check and then let the framework read it again, the disk's time "
              "not overlapped with the load's work; `after` lets the framework load the files its own way while a "
              "thread of ours hashes them beside it (xxh3-64 in 16 MiB pieces, which releases the GIL: the other "
              "core): one disk read, whichever of the two touches a page first bringing it in for the other, so "
              "the hash thread also reads ahead for the load, which can make `after` faster than `native`. What "
              "it costs is the hash's CPU time (the `after - native` column), on the core the load leaves idle.", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=3, metavar=("ADAPTER", "MODE", "ROOT"), help=argparse.SUPPRESS)
    parser.add_argument("--adapters", default=",".join(ADAPTERS))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--base-rev", default="120899b")
    parser.add_argument("--drop-caches", action="store_true")
    parser.add_argument("--dir", default=None)
    parser.add_argument("--touch-gib", type=float, default=3.0, help="memory touched and freed before every rep (0: none)")
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "resume.json"))
    parser.add_argument("--markdown", default=str(REPO / "docs" / "benchmarks_resume.md"))
    parser.add_argument("--markdown-only", action="store_true", help="rewrite the markdown from --json, measuring nothing")
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    if args.markdown_only:
        with open(args.json) as f:
            write_markdown(json.load(f), args.markdown)
        return 0
    load_before = os.getloadavg()
    base_path = revision_pythonpath(args.base_rev)
    results = {adapter: run_adapter(adapter, args, base_path) for adapter in args.adapters.split(",")}
    import torch

    result = {"meta": {**git_meta(), "python": platform.python_version(), "torch": torch.__version__,
                       "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
              "args": vars(args), "results": results}
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    write_markdown(result, args.markdown)
    print(open(args.markdown).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
