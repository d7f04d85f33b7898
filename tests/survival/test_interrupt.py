"""kill -9 and Ctrl-C during training, in each adapter's own training program (``programs/train_*.py``).

Rotation: each trial runs a program that saves at every step with rotation on (every save deletes an older
checkpoint), kills it after a random delay, and then looks at what the framework would see: every checkpoint under
the framework's own names must be complete (its commit record and all its files, loadable). Whatever a kill
interrupts (a save, a deletion) may leave only a hidden leftover, which the next run's first save removes. 7 trials
per adapter; the delays are random but seeded, so a failure can be replayed.

Ctrl-C: a terminal's Ctrl-C sends SIGINT to the whole foreground process group. The program runs in a process
group of its own (as under a terminal), saves at every step and prints ``SAVED <name>`` each time a save call
returns; SIGINT goes to the group at a random moment. The background writer does not receive it (a session of its
own), so every save that returned before the interrupt is committed when the process has exited, as natively every
completed save is on disk; the process exits as it would without the adapter; and the next run resumes from the
newest checkpoint.

kill -9 right after a save returned: the save is committed by the orphaned writer and the next run resumes from it.

Every run but the one killed from inside (a fresh interpreter, as its writer must outlive it) is a fresh process
forked from one zygote per adapter, which imported the framework once (``zygote.py``) and serves all of that
adapter's tests: what a kill leaves does not depend on how the process started, and the imports would cost more
than the runs.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

import programs
from asyncckpt.core import is_complete
from asyncckpt.core.formats import names
from processes import Program
from writers import wait_until_gone
from zygote import Zygote

TRIALS = 7
KEEP = {"hf_trainer": "1", "accelerate": "2", "lightning": "2"}  # rotation: every save removes an older checkpoint
# What each program imports: its zygote imports them once, and every run is a fork of it.
IMPORTS = {
    "hf_trainer": ["transformers.trainer", "asyncckpt.adapters.hf_trainer"],
    "accelerate": ["accelerate", "asyncckpt.adapters.accelerate"],
    "lightning": ["lightning", "asyncckpt.adapters.lightning"],
}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.fixture(scope="module", params=["lightning", "accelerate", "hf_trainer"])
def adapter(request) -> str:
    """Each adapter in turn: pytest runs every test of one before the next, so one zygote lives at a time."""
    pytest.importorskip({"hf_trainer": "transformers"}.get(request.param, request.param))
    return request.param


@pytest.fixture(scope="module")
def zygote(adapter, tmp_path_factory):
    with Zygote(["torch", *IMPORTS[adapter]], ENV, tmp_path_factory.mktemp(f"zygote-{adapter}")) as zygote:
        yield zygote


# ----------------------------------------------------------------------------- kill -9 during rotation
def _framework_sees(adapter: str, root: Path) -> list[Path]:
    """What the framework lists as checkpoints."""
    if adapter == "hf_trainer":
        return sorted(p for p in root.glob("checkpoint-*"))
    if adapter == "accelerate":
        return sorted((root / "checkpoints").iterdir()) if (root / "checkpoints").is_dir() else []
    return sorted(root.glob("*.ckpt"))


def _assert_complete(adapter: str, checkpoint: Path) -> None:
    if adapter == "lightning":  # single files: written under a hidden name, renamed when durable
        assert torch.load(checkpoint, weights_only=False)["state_dict"], checkpoint
        return
    assert is_complete(str(checkpoint)), f"{checkpoint} visible without its commit record: {os.listdir(checkpoint)}"
    expected = {"model.safetensors", "optimizer.bin" if adapter == "accelerate" else "optimizer.pt"}
    assert expected <= set(os.listdir(checkpoint)), (checkpoint, os.listdir(checkpoint))


def _hidden_parents(adapter: str, root: Path) -> list[Path]:
    """Where a kill can leave hidden entries: beside the checkpoints."""
    return [root, root / "checkpoints"] if adapter == "accelerate" else [root]


def test_kill9_at_random_moments_during_rotation_leaves_only_complete_checkpoints(tmp_path, adapter, zygote):
    script, root = programs.path(adapter), tmp_path / "run"
    settings = ["WIDTHS=1024,1024", f"KEEP={KEEP[adapter]}"]  # ~13 MB with Adam
    delays = random.Random(f"{adapter}-kill").sample(range(0, 2500, 50), TRIALS)
    for delay_ms in delays:
        run = zygote.run(script, "run", root, *settings)
        try:
            run.wait_for_line("READY")
            time.sleep(delay_ms / 1000)
        finally:
            run.kill()
        assert run.wait() == -9, f"the program ended on its own (exit {run.returncode}) before the kill"
        seen = _framework_sees(adapter, root)
        assert seen, f"nothing visible after a kill {delay_ms} ms into rotation"
        for checkpoint in seen:
            _assert_complete(adapter, checkpoint)
    # what the kills left is hidden, and the next run's save removes it (its writers are gone: the zygote
    # reaped them, as it reaps every process a run started before it reports the run's exit)
    once = zygote.run(script, "once", root, *settings)
    assert once.wait() == 0, once.stderr()[-3000:]
    hidden = [entry for parent in _hidden_parents(adapter, root) if parent.is_dir() for entry in os.listdir(parent)
              if names.parse_hidden(entry)]
    assert hidden == [], hidden
    for checkpoint in _framework_sees(adapter, root):
        _assert_complete(adapter, checkpoint)


# ----------------------------------------------------------------------------- Ctrl-C, kill -9 after a save
NATIVE_EXIT = {"lightning": 1, "accelerate": -signal.SIGINT, "hf_trainer": -signal.SIGINT}  # Lightning: sys.exit(1)


def _checkpoint(adapter: str, root: Path, name: str) -> Path:
    return root / "checkpoints" / name if adapter == "accelerate" else root / name


def _complete(adapter: str, path: Path) -> bool:
    if adapter == "lightning":
        return path.is_file() and "state_dict" in torch.load(path, weights_only=False)
    return is_complete(str(path))


def test_ctrl_c_keeps_every_save_that_returned_and_resume_continues(tmp_path, adapter, zygote):
    script, root = programs.path(adapter), tmp_path / "run"
    run = zygote.run(script, "run", root, new_session=True)  # its own process group
    saved = []
    try:
        while len(saved) < 3 and (line := run.read_line(timeout=300)) is not None:
            if line.startswith("SAVED "):
                saved.append(line.split()[1])
        time.sleep(random.Random(adapter).uniform(0.0, 0.4))
        os.killpg(run.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        out, deadline = [], time.monotonic() + 120  # a run the interrupt did not stop must not save on and on
        while time.monotonic() < deadline and (line := run.read_line(timeout=120)) is not None:
            out.append(line)
    finally:
        if run.returncode is None:
            run.kill()  # its process group
            run.wait()
    err = run.stderr()
    saved += [line.split()[1] for line in out if line.startswith("SAVED ")]
    assert run.returncode == NATIVE_EXIT[adapter], err[-3000:]
    assert "KeyboardInterrupt" in err or adapter == "lightning"
    # No failed save (every message of ours starts "asyncckpt: ", a writer's failure included: the training
    # process reports it; the one advice line aside: this toy run saves far more often than it need) and no
    # traceback of a writer (it runs as ``python -m``: runpy would be in its frames).
    ours = [line for line in err.splitlines() if "asyncckpt: " in line and "loses the least work" not in line]
    assert not ours and "runpy" not in err, err[-3000:]
    for name in saved:  # every save that returned before the interrupt is committed
        assert _complete(adapter, _checkpoint(adapter, root, name)), (name, saved)
    parents = [root, root / "checkpoints"]  # where staging directories and temporary files are
    assert not [e for p in parents if p.is_dir() for e in os.listdir(p) if names.parse_hidden(e)]

    resumed = zygote.run(script, "resume", root)
    out = resumed.remaining_lines(timeout=180)
    assert resumed.returncode == 0, resumed.stderr()[-3000:]
    start = int(next(line.split()[1] for line in out if line.startswith("START ")))
    assert start > 0  # not from scratch


def test_kill_9_after_a_save_returned_keeps_it_and_resume_continues_from_it(tmp_path, adapter, zygote):
    """SIGKILL to the training process right after a save call returned (Lightning), or once the
    next step began (Accelerate, the Trainer: their optimizer state is snapshot while the next
    forward and backward run, and the guarantee starts when that is complete): the background
    writer finishes and commits that save, no writer remains, and the next run resumes from it."""
    script, root = programs.path(adapter), tmp_path / "run"
    env = {**ENV, "WIDTHS": "65536,512",  # ~0.4 GiB saves
           "KILL_AT": "saved" if adapter == "lightning" else "next step"}
    proc = Program([sys.executable, str(script), "run", str(root)], tmp_path / "logs", env=env, start_new_session=True)
    try:
        proc.wait(300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    kept = _checkpoint(adapter, root, "last.ckpt" if adapter == "lightning" else "checkpoint_0" if adapter == "accelerate"
                       else "checkpoint-1")  # the save that returned before the kill (Lightning resumes from last.ckpt)
    print(f"{adapter}: {kept.name} visible when the trainer died: {_complete(adapter, kept)}")
    saved = [line.split()[1] for line in proc.lines() if line.startswith("SAVED ")]
    assert kept.name in saved, (saved, proc.error_output()[-3000:])
    wait_until_gone(proc.pid, timeout=120, what="the orphaned writer still runs")
    assert _complete(adapter, kept), f"{kept.name} was handed over before the kill and is not committed"

    resumed = zygote.run(script, "resume", root, f"WIDTHS={env['WIDTHS']}")
    out = resumed.remaining_lines(timeout=300)
    assert resumed.returncode == 0, resumed.stderr()[-3000:]
    start = int(next(line.split()[1] for line in out if line.startswith("START ")))
    step_of = {"lightning": lambda name: int(name.split("=")[1].split(".")[0]),
               "accelerate": lambda name: int(name.split("_")[1]) + 1,  # checkpoint_i is saved after step i+1
               "hf_trainer": lambda name: int(name.split("-")[1])}[adapter]
    assert start >= step_of(saved[0]), (start, saved)
