"""What a framework's own test suite checks of a plugin: after a run ends nothing of ours keeps
running, the next run works, and the framework objects holding the adapter pickle and unpickle.

Each adapter, in-process, with the real framework: a run that saves; then no thread named
``asyncckpt-*`` and no background writer process; a second run in the same process saves again; a
pickled copy of the framework object checkpoints asynchronously too.
"""
from __future__ import annotations

import os
import pickle
import threading

import psutil
import pytest
import torch

from asyncckpt.core import is_complete


def threads_and_writers() -> tuple[list[str], list[int]]:
    """Threads named asyncckpt-* and writer processes of this process (running ones: a child of an earlier test
    that exited and is not reaped yet is a zombie, whose command line cannot be read)."""
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("asyncckpt"))
    return threads, sorted(p.pid for p in psutil.Process().children(recursive=True) if _is_writer(p))


def _is_writer(process: psutil.Process) -> bool:
    try:
        return any("asyncckpt.core.writer.process" in part for part in process.cmdline())
    except psutil.NoSuchProcess:  # exited meanwhile, or a zombie (psutil.ZombieProcess)
        return False


@pytest.fixture
def ours_running():
    """What of ours runs now, beyond what ran when the test began (Checkpointers that other tests in
    this process hold open, such as the module-level default one, may keep their writers)."""
    before_threads, before_writers = threads_and_writers()

    def since() -> tuple[list[str], list[int]]:
        threads, writers = threads_and_writers()
        for name in before_threads:
            if name in threads:
                threads.remove(name)
        return threads, [pid for pid in writers if pid not in before_writers]

    return since


# ---------------------------------------------------------------------- Lightning
def test_lightning_fit_leaves_nothing_running_and_the_plugin_pickles(tmp_path, ours_running):
    L = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from asyncckpt.adapters.lightning import AsyncCkptIO

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    x = torch.randn(64, 8)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    def fit(io, root):
        trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                            enable_model_summary=False, plugins=[io],
                            callbacks=[ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=4)])
        trainer.fit(Tiny(), data)
        return trainer

    io = AsyncCkptIO()
    fit(io, tmp_path / "a")
    assert ours_running() == ([], [])
    fit(io, tmp_path / "b")  # the next run starts the writer again
    assert ours_running() == ([], []) and io.checkpointer.stats["file"] >= 16

    copy = pickle.loads(pickle.dumps(io))
    assert isinstance(copy, AsyncCkptIO) and copy.checkpointer is not io.checkpointer
    fit(copy, tmp_path / "c")
    assert copy.checkpointer.stats["file"] >= 8  # the copy saved through its own Checkpointer
    assert torch.load(tmp_path / "c" / "last.ckpt", weights_only=False)["global_step"] == 16
    assert ours_running() == ([], [])


# ---------------------------------------------------------------------- Accelerate
def test_accelerate_end_training_leaves_nothing_running_and_the_accelerator_pickles(tmp_path, ours_running):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    from asyncckpt.adapters.accelerate import enable_async_checkpointing

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                                   automatic_checkpoint_naming=True))
    handle = enable_async_checkpointing(acc)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    first = acc.save_state()
    acc.end_training()
    assert is_complete(str(first)) and ours_running() == ([], [])

    copy = pickle.loads(pickle.dumps(acc))  # as Accelerate's own tests pickle a prepared Accelerator
    assert copy.state.__dict__ == acc.state.__dict__
    second = copy.save_state()
    copy.end_training()
    assert is_complete(str(second))  # published with a commit record: saved by the adapter, asynchronously
    assert os.path.basename(second) == "checkpoint_1" and ours_running() == ([], [])
    acc.project_configuration.iteration = 2  # the copy saved checkpoint_1
    third = acc.save_state()  # the original goes on too (its writer starts again)
    handle.remove()  # waits for it
    assert is_complete(str(third))
    assert ours_running() == ([], [])


# ---------------------------------------------------------------------- Transformers
def test_trainer_train_leaves_nothing_running_and_the_callbacks_pickle(tmp_path, ours_running):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback
    from toy import Net, Toy

    def train(out, callbacks):
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, max_steps=8, save_steps=4,
                                 report_to=[], use_cpu=True, disable_tqdm=True)
        trainer = Trainer(model=Net(), args=args, train_dataset=Toy(), callbacks=callbacks)
        trainer.train()
        return trainer

    trainer = train(tmp_path / "a", [AsyncCheckpointCallback()])
    assert ours_running() == ([], [])
    assert is_complete(str(tmp_path / "a" / "checkpoint-8"))
    trainer.train()  # again, same Trainer: its writer starts again
    assert ours_running() == ([], [])

    callbacks = pickle.loads(pickle.dumps(trainer.callback_handler.callbacks))
    ours = [c for c in callbacks if isinstance(c, AsyncCheckpointCallback)]
    assert len(ours) == 1 and ours[0].saver is None
    train(tmp_path / "b", [ours[0]])
    assert is_complete(str(tmp_path / "b" / "checkpoint-8")) and [t["step"] for t in ours[0].metrics] == [4, 8]
    assert ours_running() == ([], [])


# ---------------------------------------------------------------------- the writer's life and the exit status
# Each script saves at its last line, into argv[1]; with argv[2], its writer's files fail beyond that many bytes.
EXITS_AFTER_A_SAVE = {
    "core": """
        import torch
        from asyncckpt import core
        limited(core.default_checkpointer())
        core.async_save({"w": torch.ones(4 << 20)}, sys.argv[1])
    """,
    "fabric": """
        import torch
        from lightning.fabric import Fabric
        from asyncckpt.adapters.lightning import AsyncCkptIO
        io = AsyncCkptIO()
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
        limited(io.checkpointer)
        fabric.save(sys.argv[1], {"w": torch.ones(4 << 20)})
    """,
    "accelerate": """
        import torch
        from accelerate import Accelerator
        from asyncckpt.adapters.accelerate import enable_async_checkpointing
        acc = Accelerator(cpu=True)
        limited(enable_async_checkpointing(acc).checkpointer)
        net = acc.prepare(torch.nn.Linear(2048, 2048))
        acc.save_state(sys.argv[1])  # and no end_training()
    """,
}


@pytest.mark.parametrize("program", sorted(EXITS_AFTER_A_SAVE))
def test_a_save_that_fails_at_exit_makes_the_exit_status_non_zero(tmp_path, program):
    """A script whose last line is a save, on a full disk (a real write error in the writer): the
    exit drain reports the failure naming the checkpoint and the process exits with status 1, as
    it would with the framework's own synchronous save. The same script on a working disk exits 0."""
    import subprocess
    import sys
    import textwrap

    pytest.importorskip({"fabric": "lightning"}.get(program, "torch" if program == "core" else program))
    script = tmp_path / "last_line_saves.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")!r})
        from writers import limit_file_size

        def limited(checkpointer):
            if len(sys.argv) > 2:
                limit_file_size(checkpointer, int(sys.argv[2]))
    """) + textwrap.dedent(EXITS_AFTER_A_SAVE[program]))
    for limit, status in [([str(1 << 20)], 1), ([], 0)]:  # writes over 1 MiB fail with EFBIG, as on a full disk
        target = tmp_path / f"ckpt-{status}"
        done = subprocess.run([sys.executable, str(script), str(target), *limit], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == status, done.stderr[-3000:]
        if status:
            assert "asyncckpt: at exit:" in done.stderr and "ckpt-1" in done.stderr, done.stderr[-3000:]
        else:
            assert "asyncckpt: at exit" not in done.stderr, done.stderr[-3000:]


def test_an_idle_writer_stops_and_the_next_save_starts_one(tmp_path, ours_running):
    """With nothing to do for ``writer_idle_timeout`` seconds the writer process and the thread that
    hears it exit (saves made outside a framework's run leave no process idling; the copy threads,
    like the snapshot buffers, stay with the Checkpointer until it is closed); the next save starts
    a new writer and commits as before."""
    import time

    from asyncckpt.core import Checkpointer

    checkpointer = Checkpointer(writer_idle_timeout=0.5)
    try:
        checkpointer.save({"w": torch.ones(1024)}, tmp_path / "a")
        deadline = time.monotonic() + 30
        while ours_running()[1] or any(name.startswith("asyncckpt-writer") for name in ours_running()[0]):
            assert time.monotonic() < deadline, ours_running()
            time.sleep(0.05)
        checkpointer.save({"w": torch.full((1024,), 2.0)}, tmp_path / "b")
        assert is_complete(str(tmp_path / "b"))
        loaded = {"w": torch.zeros(1024)}
        checkpointer.load(loaded, tmp_path / "b")
        assert torch.equal(loaded["w"], torch.full((1024,), 2.0))
    finally:
        checkpointer.close()
    assert ours_running() == ([], [])


def test_a_removal_with_nothing_pending_starts_no_writer(tmp_path, ours_running):
    """Lightning's main process after ``ddp_spawn`` removes a temporary file through the plugin and
    saves nothing: the removal is done at once, and no writer (nor thread) of ours starts for it."""
    from asyncckpt.core import Checkpointer

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f.bin").write_bytes(b"x" * 100)
    (tmp_path / "weights.ckpt").write_bytes(b"y")
    checkpointer = Checkpointer()
    try:
        handle = checkpointer.remove([tmp_path / "d", tmp_path / "weights.ckpt"])
        assert handle.done() and handle.exception() is None
        assert ours_running() == ([], [])
        assert sorted(os.listdir(tmp_path)) == []
    finally:
        checkpointer.close()


def test_a_writer_started_for_a_run_is_kept_until_teardown(tmp_path, ours_running):
    """``start()`` (what an adapter calls when a framework's run begins) keeps the writer through idle
    stretches, so that a run's saves never wait for its restart; ``teardown()`` stops it."""
    import time

    from asyncckpt.core import Checkpointer

    checkpointer = Checkpointer(writer_idle_timeout=0.2)
    try:
        checkpointer.start()
        checkpointer.save({"w": torch.ones(16)}, tmp_path / "a")
        pid = checkpointer.writer_pid()
        time.sleep(1.5)  # several idle timeouts
        assert checkpointer.writer_pid() == pid
        checkpointer.teardown()
        assert ours_running()[1] == []
    finally:
        checkpointer.close()
