"""A resume under DDP reads the checkpoint from storage once per job, through each framework's own resume path:
Lightning's ``fit(ckpt_path=...)`` from a local file and from a real S3 server (its GET bytes counted),
Accelerate's ``load_state()`` and the Trainer's ``resume_from_checkpoint``; on 2 and 4 ranks (processes with
the environment torchrun gives them), each equal bit for bit to the framework's own resume without asyncckpt. A
damaged byte fails every rank naming the file; ranks that load different files each read their own."""
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

pytest.importorskip("lightning")

EVICT = textwrap.dedent("""
    def evict(path):
        for parent, _dirs, names in os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [], [os.path.basename(path)])]:
            for name in names:
                with open(os.path.join(parent, name), "rb") as f:
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def read_bytes():
        with open("/proc/self/io") as f:
            return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])
""")

LIGHTNING = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    from asyncckpt.adapters.lightning import AsyncCkptIO
    from asyncckpt.core import CorruptCheckpointError
    """) + EVICT + textwrap.dedent("""
    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.Linear(2048, 256))  # 12 MiB with Adam

        def training_step(self, batch, _index):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    def loader():
        generator = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(64, 256, generator=generator),
                                        torch.randn(64, 256, generator=generator)), batch_size=4)

    def trainer(steps, plugins, devices):
        return L.Trainer(max_steps=steps, accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                         plugins=plugins, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)

    mode, folder = sys.argv[1], sys.argv[2]
    if mode == "save":
        io = AsyncCkptIO()
        run = trainer(2, [io], 1)
        run.fit(Net(), loader())
        for target in sys.argv[3:]:
            run.save_checkpoint(target)
        io.teardown()
        sys.exit()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    for label, path in json.loads(sys.argv[3]):
        path = path.format(rank=rank)
        if "://" not in path:
            evict(path)
        dist.barrier()
        before, model = read_bytes(), Net()
        try:
            trainer(4, [] if label == "native" else [AsyncCkptIO(timeout=60)], world).fit(model, loader(), ckpt_path=path)
            outcome = "resumed"
        except CorruptCheckpointError as error:
            outcome = f"refused: {error}"
        print(json.dumps({"label": label, "rank": rank, "read": read_bytes() - before, "outcome": outcome}), flush=True)
        if rank == 0 and outcome == "resumed":
            torch.save(model.state_dict(), f"{folder}/{label}.pt")
""")


def launch(script: Path, world: int, cwd: Path, *args: str, timeout: float = 300) -> list[dict]:
    """``world`` processes of ``script`` with the environment torchrun gives its workers on one node; each one's
    JSON lines (it must exit 0), its stderr under ``cwd``."""
    port, procs = str(free_port()), []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    for rank in range(world):
        with open(cwd / f"rank{rank}.out", "w") as out, open(cwd / f"rank{rank}.err", "w") as err:
            procs.append(subprocess.Popen(
                [sys.executable, str(script), *args], cwd=cwd, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
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
    return [json.loads(line) for rank in range(world) for line in (cwd / f"rank{rank}.out").read_text().splitlines()
            if line.startswith("{")]


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


@pytest.mark.parametrize("world", [2, 4])
def test_lightning_ddp_resume_reads_the_checkpoint_once_from_disk_and_from_s3(tmp_path, s3_server, s3_root, world):
    script = tmp_path / "program.py"
    script.write_text(LIGHTNING)
    local, url = tmp_path / "ckpt" / "last.ckpt", f"{s3_root}/run/last.ckpt"
    local.parent.mkdir()
    subprocess.run([sys.executable, str(script), "save", str(tmp_path), str(local), url], cwd=tmp_path, check=True,
                   capture_output=True, timeout=300)
    for rank in range(world):
        shutil.copy2(local, local.parent / f"own-{rank}.ckpt")
    flip_a_byte(local, local.parent / "damaged.ckpt", 0.9)  # in the last rank's part
    phases = [["native", str(local)], ["local", str(local)], ["s3", url], ["different", str(local.parent / "own-{rank}.ckpt")],
              ["damaged", str(local.parent / "damaged.ckpt")]]
    downloaded = s3_server.get_bytes
    results = by_label(launch(script, world, tmp_path, "resume", str(tmp_path), json.dumps(phases)))
    downloaded = s3_server.get_bytes - downloaded
    size = local.stat().st_size

    assert size <= downloaded <= 1.05 * size, (downloaded, size)  # once per job, not once per rank
    read = [record["read"] for record in results["local"]]
    assert sum(read) <= 1.05 * size, (read, size)  # the pages were evicted first: once per job (each rank's part:
    #                                               test_cooperative_load.py)
    for label in ("local", "s3", "different"):
        assert [record["outcome"] for record in results[label]] == ["resumed"] * world
        same_tensors(tmp_path / f"{label}.pt", tmp_path / "native.pt")  # as Lightning's own resume, bit for bit
    for record in results["damaged"]:  # found by the rank that read it, and by every other: the file named
        assert record["outcome"].startswith("refused:") and "damaged.ckpt: checksum mismatch" in record["outcome"]
    for rank in range(world):
        said = [line for line in (tmp_path / f"rank{rank}.err").read_text().splitlines() if "each rank loads" in line]
        assert len(said) == 1 and "the ranks load different files" in said[0], said
