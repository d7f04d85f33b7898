"""The memory tier through each framework's own save and resume, on 2 ranks (torchrun, CPU): checkpoints in node
memory, every second one durable; every process killed (kill -9) right after a memory-only save returned; the
relaunched job resumes from that memory checkpoint (newer than the last durable one) and ends bit for bit as an
uninterrupted run without asyncckpt; after a run that ends normally, nothing of ours is left in memory, nor any
process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from programs import tier as tier_programs
from writers import wait_until_gone, writers_of

REPO = Path(__file__).resolve().parents[2]
KILL_AT = 15  # every rank kills itself in the step after this save: saves at 5 (memory), 10 (durable too), 15 (memory)


def _torchrun(program: Path, cwd: Path, *args: str, memory_root: Path, expect_killed: bool = False) -> str:
    """``torchrun --standalone --nproc-per-node 2 program args`` with its output in files; its text. A killed job
    returns once its orphaned writers finished what its trainers handed them (a durable copy may be under way when
    the trainers die: what the test then finds on storage is what the orphans left)."""
    out, err = cwd / f"{program.stem}.out", cwd / f"{program.stem}.err"
    env = {**os.environ, "ASYNCCKPT_MEMORY_ROOT": str(memory_root), "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    with open(out, "a") as stdout, open(err, "a") as stderr:
        launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                     "2", str(program), *args], cwd=cwd, env=env, stdout=stdout, stderr=stderr,
                                    start_new_session=True)
        try:
            returncode = launcher.wait(600)
        except subprocess.TimeoutExpired:  # a hung job: every process of it goes (its workers outlive torchrun's kill)
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
            raise
    text = out.read_text()
    if expect_killed:
        assert returncode != 0, text
        wait_until_gone(*_pids(text), timeout=120)
    else:
        assert returncode == 0, f"{text}\n{err.read_text()[-5000:]}"
    return text


def _pids(text: str) -> list[int]:
    return [int(line.split()[-1]) for line in text.splitlines() if line.startswith("PID ")]


def _no_process_left(text: str) -> None:
    pids = _pids(text)
    assert pids and all(writers_of(pid) == [] for pid in pids), text


def test_trainer_resumes_from_memory_after_every_process_was_killed(tmp_path):
    program = tmp_path / "trainer.py"
    program.write_text(tier_programs.TRAINER)
    memory = tmp_path / "memory"
    first = _torchrun(program, tmp_path, str(tmp_path), "first", str(KILL_AT), "0", memory_root=memory,
                      expect_killed=True)
    durable = sorted(name for name in os.listdir(tmp_path / "async") if name.startswith("checkpoint-"))
    assert durable == ["checkpoint-10"], durable  # 15 is in memory only
    second = _torchrun(program, tmp_path, str(tmp_path), "second", str(KILL_AT), "0", memory_root=memory)
    assert "RANK 0 BEGINS AT 15" in second and "RANK 1 BEGINS AT 15" in second, second  # from memory
    a, b = (torch.load(tmp_path / name / "final.pt", weights_only=True) for name in ("async", "native"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [entry for entry in os.scandir(memory) if not entry.name.startswith(".")] == []  # nothing left in memory
    _no_process_left(first + second)


def test_accelerate_resumes_from_memory_after_every_process_was_killed(tmp_path):
    program = tmp_path / "accelerate_run.py"
    program.write_text(tier_programs.ACCELERATE)
    memory = tmp_path / "memory"

    def run(**run):  # one training per process (programs/tier.py)
        return tier_programs.config([run], replicas=0)

    first = _torchrun(program, tmp_path, run(root=str(tmp_path / "async"), kill_at=2), memory_root=memory,
                      expect_killed=True)
    assert sorted(os.listdir(tmp_path / "async" / "checkpoints")) == ["checkpoint_1"]  # 0 and 2: in memory only
    _torchrun(program, tmp_path, run(root=str(tmp_path / "native"), asyncckpt=False), memory_root=memory)
    second = _torchrun(program, tmp_path, run(root=str(tmp_path / "async"), resume=True), memory_root=memory)
    assert "RANK 0 BEGINS AT 3" in second and "RANK 1 BEGINS AT 3" in second, second  # from checkpoint_2, in memory
    a, b = (torch.load(tmp_path / name / "final.pt", weights_only=True) for name in ("async", "native"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [entry for entry in os.scandir(memory) if not entry.name.startswith(".")] == []
    _no_process_left(first + second)


def test_lightning_resumes_from_memory_after_every_process_was_killed(tmp_path):
    """Against the same kill and resume without asyncckpt (Lightning's own resume from a mid-epoch last.ckpt is
    what an uninterrupted run is not, with a dataloader that is not resumable)."""
    program = tmp_path / "lightning_run.py"
    program.write_text(tier_programs.LIGHTNING)
    memory = tmp_path / "memory"

    def runs(*runs):
        return tier_programs.config(list(runs), replicas=0, num_nodes=1, devices=2, max_steps=32)

    native, asynchronous = {"root": str(tmp_path / "native"), "asyncckpt": False}, {"root": str(tmp_path / "async")}
    _torchrun(program, tmp_path, runs({**native, "kill_at": KILL_AT}), memory_root=memory, expect_killed=True)
    first = _torchrun(program, tmp_path, runs({**asynchronous, "kill_at": KILL_AT}), memory_root=memory,
                      expect_killed=True)
    durable = sorted(os.listdir(tmp_path / "async" / "ckpts"))
    assert durable == ["epoch=0-step=10.ckpt", "last.ckpt"], durable  # step 10's: the 2nd checkpoint; 5 and 15: memory
    # each killed run relaunched: without asyncckpt (Lightning's own resume), and with it
    second = _torchrun(program, tmp_path, runs({**native, "resume": True}, {**asynchronous, "resume": True}),
                       memory_root=memory)
    assert second.count("RANK 0 BEGINS AT 15") == 2 and second.count("RANK 1 BEGINS AT 15") == 2, second  # async: memory
    a, b = (torch.load(tmp_path / name / "final.pt", weights_only=True) for name in ("async", "native"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [entry for entry in os.scandir(memory) if not entry.name.startswith(".")] == []
    _no_process_left(first + second)
