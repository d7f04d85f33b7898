"""A resume under DDP reads the checkpoint from storage once per job, through each framework's own resume path:
Lightning's ``fit(ckpt_path=...)`` from a local file and from a real S3 server (its GET bytes counted),
Accelerate's ``load_state()`` and the Trainer's ``resume_from_checkpoint``; on 2 and 4 ranks (processes with the
environment torchrun gives them, on two simulated nodes, one launch running the three frameworks in turn), each
equal bit for bit to the framework's own resume without asyncckpt. A damaged byte fails every rank naming the file; ranks that
load different files each read their own, saying so once."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from dist_helper import free_port
from program_end import DESTROY_PROCESS_GROUP

pytest.importorskip("lightning")
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

PROGRAM = textwrap.dedent('''
    import json, os, shutil, sys
    import torch, torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset, TensorDataset
    import lightning as L
    from accelerate import Accelerator
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from asyncckpt.adapters.accelerate import enable_async_checkpointing
    from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback
    from asyncckpt.adapters.lightning import AsyncCkptIO
    from asyncckpt.core import CorruptCheckpointError

    def read_calls():
        """What this process's read calls returned so far (from the disk or the page cache alike)."""
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("rchar:")).split()[1])

    def report(framework, label, rank, before, outcome, now=None):
        print("RESULT", json.dumps({"label": f"{framework} {label}", "rank": rank, "outcome": outcome,
                                    "read_calls": (now or read_calls()) - before}), flush=True)

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, 4096), torch.nn.Linear(4096, 256))  # 24 MiB with Adam

    def pairs():
        generator = torch.Generator().manual_seed(1)
        return TensorDataset(torch.randn(64, 256, generator=generator), torch.randn(64, 256, generator=generator))

    # ------------------------------------------------------------------ Lightning
    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()

        def training_step(self, batch, _index):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    def lightning(steps, plugins, devices):
        return L.Trainer(max_steps=steps, accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                         plugins=plugins, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)

    def lightning_save(targets):
        io = AsyncCkptIO()
        run = lightning(2, [io], 1)
        run.fit(Module(), DataLoader(pairs(), batch_size=4))
        for target in targets:
            run.save_checkpoint(target)
        io.teardown()

    def lightning_resumes(folder, phases, rank, world):
        for label, path in phases:
            path = path.format(rank=rank)
            dist.barrier()
            before, module = read_calls(), Module()
            try:
                lightning(4, [] if label == "native" else [AsyncCkptIO(timeout=60)], world).fit(
                    module, DataLoader(pairs(), batch_size=4), ckpt_path=path)
                outcome = "resumed"
            except CorruptCheckpointError as error:
                outcome = f"refused: {error}"
            report("lightning", label, rank, before, outcome)
            if rank == 0 and outcome == "resumed":
                torch.save(module.state_dict(), f"{folder}/lightning {label}.pt")

    # ------------------------------------------------------------------ Accelerate
    def accelerate_run(adapter):
        model = net()
        accelerator = Accelerator(cpu=True)
        model, optimizer, data = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3),
                                                     DataLoader(pairs(), batch_size=4))
        handle = enable_async_checkpointing(accelerator, timeout=60) if adapter else None
        return accelerator, model, optimizer, data, handle

    def accelerate_train(accelerator, model, optimizer, data, steps=2):
        for _step, (x, y) in zip(range(steps), data):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()

    def accelerate_resumes(folder, rank):
        checkpoint, damaged = f"{folder}/accelerate/checkpoint", f"{folder}/accelerate/damaged"
        accelerator, model, optimizer, data, handle = accelerate_run(adapter=True)
        accelerate_train(accelerator, model, optimizer, data)
        accelerator.save_state(checkpoint)
        handle.remove()
        if rank == 0:  # a copy with a flipped byte near the end of the model file
            shutil.copytree(checkpoint, damaged)
            with open(f"{damaged}/model.safetensors", "r+b") as f:
                f.seek(int(os.path.getsize(f.name) * 0.9))
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 1]))
        for label in ("native", "ours", "damaged"):
            accelerator, model, optimizer, data, handle = accelerate_run(adapter=label != "native")
            accelerator.wait_for_everyone()
            before = read_calls()
            try:
                accelerator.load_state(damaged if label == "damaged" else checkpoint)
                outcome = "resumed"
            except CorruptCheckpointError as error:
                outcome = f"refused: {error}"
            report("accelerate", label, rank, before, outcome)
            if outcome == "resumed":
                accelerate_train(accelerator, model, optimizer, data)
                if rank == 0:
                    torch.save(accelerator.unwrap_model(model).state_dict(), f"{folder}/accelerate {label}.pt")
            if handle is not None:
                handle.remove()

    # ------------------------------------------------------------------ the Transformers Trainer
    class Pairs(Dataset):
        def __init__(self):
            self.pairs = pairs()
        def __len__(self): return len(self.pairs)
        def __getitem__(self, i): return {"x": self.pairs[i][0], "labels": self.pairs[i][1]}

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = net()
        def forward(self, x, labels=None):
            out = self.body(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    class Measure(TrainerCallback):
        """What this process's read calls returned between the start of train() and its first step (the resume)."""
        def __init__(self):
            self.started, self.read = read_calls(), None
        def on_step_begin(self, args, state, control, **kwargs):
            if self.read is None:
                self.read = read_calls()

    def trainer_run(out, adapter, max_steps, resume):
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=max_steps, learning_rate=1e-3,
                                 save_strategy="steps", save_steps=2, report_to=[], use_cpu=True, disable_tqdm=True,
                                 ddp_find_unused_parameters=False)
        trainer = Trainer(model=Model(), args=args, train_dataset=Pairs(),
                          callbacks=[AsyncCheckpointCallback(timeout=60)] if adapter else [])
        measure = Measure()
        trainer.add_callback(measure)
        trainer.train(resume_from_checkpoint=resume)
        return trainer, measure.started, measure.read

    def trainer_resumes(folder, rank):
        for label in ("native", "ours"):
            out = os.path.join(folder, "trainer", label)
            trainer_run(out, label == "ours", 2, False)
            trainer, started, resumed = trainer_run(out, label == "ours", 4, True)
            report("trainer", label, rank, started, "resumed", now=resumed)
            if rank == 0:
                torch.save(trainer.model.state_dict(), f"{folder}/trainer {label}.pt")

    if __name__ == "__main__":
        if sys.argv[1] == "save":
            lightning_save(sys.argv[2:])
            sys.exit()
        folder, phases = sys.argv[2], json.loads(sys.argv[3])
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group("gloo")
        lightning_resumes(folder, phases, rank, world)
        accelerate_resumes(folder, rank)
        trainer_resumes(folder, rank)
''') + DESTROY_PROCESS_GROUP


def launch(script: Path, world: int, cwd: Path, *args: str, timeout: float = 300) -> list[dict]:
    """``world`` processes of ``script`` with the environment torchrun gives its workers, on two simulated nodes
    (``ASYNCCKPT_NODE``, a memory root each: on one node, local files are left to the page cache); what each
    printed as ``RESULT {json}`` lines (it must exit 0), its stderr under ``cwd``."""
    port, procs = str(free_port()), []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    for rank in range(world):
        with open(cwd / f"rank{rank}.out", "w") as out, open(cwd / f"rank{rank}.err", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, str(script), *args], cwd=cwd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                     "ASYNCCKPT_NODE": f"n{rank * 2 // world}", "ASYNCCKPT_MEMORY_ROOT": str(cwd / f"node{rank * 2 // world}"),
                     "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                     "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "ACCELERATE_USE_CPU": "true"}))
    try:
        for proc in procs:
            proc.wait(timeout=timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank}: exit {proc.returncode}\n{(cwd / f'rank{rank}.err').read_text()[-4000:]}"
    return [json.loads(line.removeprefix("RESULT ")) for rank in range(world)
            for line in (cwd / f"rank{rank}.out").read_text().splitlines() if line.startswith("RESULT ")]


def by_label(records: list[dict]) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for record in records:
        found.setdefault(record["label"], []).append(record)
    return found


def same_tensors(a: Path, b: Path) -> None:
    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key


def flip_a_byte(source: Path, target: Path, at: float) -> None:
    shutil.copy2(source, target)  # with its checksum record (an extended attribute)
    data = bytearray(target.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    with open(target, "r+b") as f:
        f.write(data)


def files_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


@pytest.mark.parametrize("world", [2, 4])
def test_each_frameworks_ddp_resume_reads_the_checkpoint_once_per_job(tmp_path, s3_server, s3_root, world):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    local, url = tmp_path / "ckpt" / "last.ckpt", f"{s3_root}/run/last.ckpt"
    local.parent.mkdir()
    saved = subprocess.run([sys.executable, str(script), "save", str(local), url], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert saved.returncode == 0, saved.stderr[-4000:]
    for rank in range(world):
        shutil.copy2(local, local.parent / f"own-{rank}.ckpt")
    flip_a_byte(local, local.parent / "damaged.ckpt", 0.9)  # in the last rank's part
    phases = [["native", str(local)], ["local", str(local)], ["s3", url],
              ["different", str(local.parent / "own-{rank}.ckpt")], ["damaged", str(local.parent / "damaged.ckpt")]]
    downloaded = s3_server.get_bytes
    results = by_label(launch(script, world, tmp_path, "resume", str(tmp_path), json.dumps(phases)))
    downloaded = s3_server.get_bytes - downloaded

    # Lightning: downloaded once per job, not once per rank (each rank's part of a file: test_cooperative_load.py)
    size = local.stat().st_size
    assert size <= downloaded <= 1.05 * size, (downloaded, size)
    for label in ("local", "s3", "different"):
        assert [record["outcome"] for record in results[f"lightning {label}"]] == ["resumed"] * world
        same_tensors(tmp_path / f"lightning {label}.pt", tmp_path / "lightning native.pt")  # bit for bit
    for record in results["lightning damaged"]:  # found by every rank, whichever read the byte: the file named
        assert record["outcome"].startswith("refused:") and "damaged.ckpt: checksum mismatch" in record["outcome"]
    for rank in range(world):
        said = [line for line in (tmp_path / f"rank{rank}.err").read_text().splitlines() if "each rank loads" in line]
        assert len(said) == 1 and "the ranks load different files" in said[0], said

    # Accelerate's load_state: what the ranks' read calls returned, together, once the checkpoint (a rank loading by
    # itself reads the optimizer file whole: the ranks would read it once each). From disk rather than from the page
    # cache is the benchmark's to say, on a quiet machine (here other jobs' memory pressure adds page faults).
    size = files_bytes(tmp_path / "accelerate" / "checkpoint")
    calls = [record["read_calls"] for record in results["accelerate ours"]]
    assert sum(calls) <= 1.05 * size, (calls, size)
    assert [record["outcome"] for record in results["accelerate ours"]] == ["resumed"] * world
    same_tensors(tmp_path / "accelerate ours.pt", tmp_path / "accelerate native.pt")
    for record in results["accelerate damaged"]:
        assert record["outcome"].startswith("refused:") and "model.safetensors: checksum mismatch" in record["outcome"]

    # the Trainer's resume_from_checkpoint
    size = files_bytes(tmp_path / "trainer" / "ours" / "checkpoint-2")
    calls = [record["read_calls"] for record in results["trainer ours"]]
    assert sum(calls) <= 1.05 * size, (calls, size)
    same_tensors(tmp_path / "trainer ours.pt", tmp_path / "trainer native.pt")
