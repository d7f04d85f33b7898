"""AsyncCkptIO with Lightning Fabric: ``Fabric(plugins=[AsyncCkptIO()])``, ``fabric.save`` / ``fabric.load`` (CPU).

Fabric sends single-file saves and loads through its strategy's ``CheckpointIO`` (single device, DDP),
so the plugin needs nothing Fabric-specific; what Fabric lacks is an end-of-run event, so a run ends
with ``io.teardown()`` (docs/lightning.md, "Fabric"). Checked with the real Fabric: a resume from our
checkpoint continues bit for bit as one from Fabric's own save of the same state, whose file it
matches; ``fabric.load`` waits for the save in flight; a damaged file is refused; a save that fails in
the background raises, naming it, at the next save, load or teardown, and the checkpoint before it
stays loadable; after ``io.teardown()`` nothing of ours runs; the same on 2 DDP processes (gloo).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
from lightning.fabric import Fabric  # noqa: E402

from asyncckpt.adapters.lightning import AsyncCkptIO, AsyncCkptSaveError  # noqa: E402
from asyncckpt.core import CorruptCheckpointError  # noqa: E402
from dist_helper import run_on_ranks  # noqa: E402
from test_lifecycle import ours_running, threads_and_writers  # noqa: E402, F401 - the fixture
from test_lightning import same  # noqa: E402
from test_resume_verified import damage  # noqa: E402

STEPS_BEFORE, STEPS_AFTER = 3, 3


def cpu_fabric(*plugins, **options) -> Fabric:
    return Fabric(accelerator="cpu", devices=options.pop("devices", 1), plugins=list(plugins), **options)


def setup(fabric: Fabric):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-2))


def train(fabric: Fabric, model, optimizer, steps, rank: int = 0) -> None:
    for step in steps:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
        fabric.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()


def tensors(model, optimizer) -> list[torch.Tensor]:
    """The parameters and Adam's moments, copied."""
    found = [p.detach().clone() for p in model.parameters()]
    for state in optimizer.state.values():
        found += [v.clone() for v in state.values()]
    return found


def resumed_training(fabric: Fabric, path: Path, rank: int = 0) -> list[torch.Tensor]:
    """Fresh objects, ``fabric.load(path)`` into them, then the steps after the save."""
    model, optimizer = setup(fabric)
    remainder = fabric.load(path, {"model": model, "optimizer": optimizer})
    assert remainder == {"step": STEPS_BEFORE}
    train(fabric, model, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), rank)
    return tensors(model, optimizer)


def bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(map(torch.equal, a, b))


def test_save_and_load_continue_as_from_fabrics_own_save(tmp_path, ours_running):
    io = AsyncCkptIO()
    fabric, native = cpu_fabric(io), cpu_fabric()  # native: Fabric's own TorchCheckpointIO
    model, optimizer = setup(fabric)
    train(fabric, model, optimizer, range(STEPS_BEFORE))
    ours, theirs = tmp_path / "async" / "step.ckpt", tmp_path / "native" / "step.ckpt"
    fabric.save(ours, {"model": model, "optimizer": optimizer, "step": STEPS_BEFORE})
    native.save(theirs, {"model": model, "optimizer": optimizer, "step": STEPS_BEFORE})

    assert same(fabric.load(ours), torch.load(theirs, weights_only=True))  # the load waits for the write
    assert os.listdir(ours.parent) == os.listdir(theirs.parent) == ["step.ckpt"]
    train(fabric, model, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER))
    uninterrupted = tensors(model, optimizer)
    from_ours, from_theirs = resumed_training(fabric, ours), resumed_training(native, theirs)
    assert bitwise(from_ours, uninterrupted) and bitwise(from_ours, from_theirs)

    io.teardown()  # the end of the run
    assert ours_running() == ([], [])


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_checkpoint_is_refused(tmp_path, how):
    io = AsyncCkptIO()
    fabric = cpu_fabric(io)
    model, optimizer = setup(fabric)
    path = tmp_path / "step.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    io.wait()
    said = damage(path, how)
    with pytest.raises(CorruptCheckpointError, match=rf"checkpoint {path} is damaged: step.ckpt: {said}"):
        fabric.load(path, {"model": model, "optimizer": optimizer})
    io.teardown()


@pytest.mark.parametrize("raised_by", ["next save", "load", "teardown"])
def test_a_failed_save_raises_naming_it_and_the_checkpoint_before_stays_loadable(tmp_path, raised_by, ours_running):
    io = AsyncCkptIO(max_in_flight=1)  # the next save first waits for the failing one: its outcome is known then
    fabric = cpu_fabric(io)
    model, optimizer = setup(fabric)
    good, not_a_directory = tmp_path / "good.ckpt", tmp_path / "not-a-directory"
    not_a_directory.write_text("a file where the checkpoint's directory should be")
    fabric.save(good, {"model": model, "optimizer": optimizer, "step": 1})
    before = tensors(model, optimizer)
    train(fabric, model, optimizer, range(2))
    fabric.save(not_a_directory / "bad.ckpt", {"model": model, "optimizer": optimizer, "step": 2})  # fails in the writer

    with pytest.raises(AsyncCkptSaveError, match=rf"saving checkpoint {not_a_directory / 'bad.ckpt'} failed: "
                                                 r".*nothing was published under its name"):
        if raised_by == "next save":
            fabric.save(tmp_path / "next.ckpt", {"model": model, "optimizer": optimizer, "step": 3})
        elif raised_by == "load":
            fabric.load(good, {"model": model, "optimizer": optimizer})
        else:
            io.teardown()
    assert fabric.load(good, {"model": model, "optimizer": optimizer}) == {"step": 1}
    assert bitwise(tensors(model, optimizer), before)
    assert sorted(os.listdir(tmp_path)) == ["good.ckpt", "not-a-directory"]
    io.teardown()  # raised once: nothing more to raise
    assert ours_running() == ([], [])


# ----------------------------------------------------------------------------- DDP, 2 processes
def ddp_save_and_resume(rank, world, root):
    """``strategy="ddp"`` on gloo: rank 0 writes, every rank's ``fabric.load`` waits for it and reads
    it; each rank's ``io.teardown()`` leaves nothing of ours running in its process."""
    io = AsyncCkptIO()
    fabric = cpu_fabric(io, devices=world, strategy="ddp")
    fabric.launch()  # the processes exist already (LOCAL_RANK is set): this joins them
    model, optimizer = setup(fabric)
    train(fabric, model, optimizer, range(STEPS_BEFORE), rank)
    path = os.path.join(root, "step.ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": STEPS_BEFORE})
    train(fabric, model, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), rank)
    uninterrupted = tensors(model, optimizer)
    resumed = resumed_training(fabric, path, rank)
    io.teardown()
    return {"bitwise": bitwise(resumed, uninterrupted), "ours_running": threads_and_writers(), "files": os.listdir(root)}


def test_ddp_two_processes(tmp_path):
    results = run_on_ranks(ddp_save_and_resume, 2, str(tmp_path), init_process_group=False, timeout=240)
    for result in results:
        assert result["bitwise"] and result["ours_running"] == ([], []) and result["files"] == ["step.ckpt"]


FABRIC_FIRST_SAVE = '''
import os, signal, sys
import torch
import xxhash


def digest(state) -> str:
    """Every tensor's bytes, in key order."""
    h = xxhash.xxh3_64()

    def walk(value):
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif isinstance(value, torch.Tensor):
            h.update(value.detach().contiguous().numpy().tobytes())
    walk(state)
    return h.hexdigest()


mode, path = sys.argv[1], sys.argv[2]
if mode == "digest":
    print("DIGEST", digest(torch.load(path, weights_only=False)), flush=True)
    sys.exit(0)
from lightning.fabric import Fabric
from asyncckpt.adapters.lightning import AsyncCkptIO

fabric = Fabric(accelerator="cpu", devices=1, plugins=[AsyncCkptIO()])
torch.manual_seed(0)
model = torch.nn.Linear(2048, 2048)
optimizer = torch.optim.Adam(model.parameters())
model, optimizer = fabric.setup(model, optimizer)
fabric.backward(model(torch.randn(8, 2048)).square().mean())
optimizer.step()  # ~50 MB of model and Adam state
print("DIGEST", digest({"model": model.state_dict(), "optimizer": optimizer.state_dict()}), flush=True)
fabric.save(path, {"model": model, "optimizer": optimizer, "step": 7})  # the process's first save: it starts the writer
print("VISIBLE", os.path.exists(path), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
'''


def test_the_first_fabric_save_survives_a_kill_9_at_once(tmp_path):
    """Issue 33's case: ``fabric.save`` is the process's first save, so the call starts the writer, and
    the process is SIGKILLed the instant it returned: the writer still commits the file, whole, and
    exits; it loads with ``torch.load`` holding what was saved."""
    import signal
    import sys

    from processes import Program
    from writers import wait_until_gone

    script, path = tmp_path / "fabric_save.py", tmp_path / "ckpts" / "step7.ckpt"
    script.write_text(FABRIC_FIRST_SAVE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    saver = Program([sys.executable, str(script), "save", str(path)], tmp_path / "logs", env=env)
    saver.wait(300)
    assert saver.returncode == -signal.SIGKILL, saver.error_output()[-3000:]
    printed = dict(line.split(" ", 1) for line in saver.lines())
    assert printed["VISIBLE"] == "False", "the file was committed before the kill: the trial proves nothing"
    wait_until_gone(saver.pid, timeout=60, what="the orphaned writer still runs")
    assert path.is_file(), "the save that returned before the kill is not committed"
    assert [p.name for p in path.parent.iterdir() if p.name != ".asyncckpt-writer.log"] == ["step7.ckpt"]
    reader = Program([sys.executable, str(script), "digest", str(path)], tmp_path / "logs", env=env)
    assert reader.wait(300) == 0, reader.error_output()[-3000:]
    assert reader.lines() == [f"DIGEST {printed['DIGEST']}"]
