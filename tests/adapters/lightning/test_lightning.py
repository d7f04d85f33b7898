"""AsyncCkptIO with the real ``lightning.Trainer`` (tiny models, CPU).

Most cases run the same program twice, with Lightning's own ``TorchCheckpointIO`` and with
``AsyncCkptIO``, and require the same files, the same bookkeeping and bitwise-equal contents.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import Callback, Checkpoint, ModelCheckpoint, OnExceptionCheckpoint  # noqa: E402

from asyncckpt.adapters.lightning import AsyncCkptIO, AsyncCkptSaveError  # noqa: E402
from program_end import DESTROY_PROCESS_GROUP  # noqa: E402
from toy import ON_PATH, QUIET, TinyModule, data  # noqa: E402
from zygote import Zygote  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
PYTHON = sys.executable
_SHARED: list = []


def shared_io() -> AsyncCkptIO:
    """One plugin for the in-process tests, passed to one Trainer after another (as a user may):
    its background writer starts once (a few seconds on a loaded 2-core machine)."""
    if not _SHARED:
        _SHARED.append(AsyncCkptIO())
    return _SHARED[0]


def stats_delta(before: dict) -> dict:
    """What the plugin's Checkpointer was asked to do since ``before`` (its ``stats``)."""
    return {k: v - before.get(k, 0) for k, v in shared_io().checkpointer.stats.items()}


def fit(root: Path, plugin: bool, ckpt_kwargs: dict, max_epochs: int, resume=None, callbacks=(), **trainer_kwargs):
    L.seed_everything(0, verbose=False)
    ckpt = ModelCheckpoint(dirpath=root, **ckpt_kwargs)
    trainer = L.Trainer(max_epochs=max_epochs, callbacks=[ckpt, *callbacks], plugins=[shared_io()] if plugin else None,
                        **QUIET, **trainer_kwargs)
    model = TinyModule()
    val = data(16) if ckpt_kwargs.get("monitor") == "val_loss" else None
    trainer.fit(model, data(), val_dataloaders=val, ckpt_path=resume)
    return trainer, ckpt, model


def listing(root: Path) -> dict:
    """Every entry: name -> symlink target name, or None for a file (temporary files included)."""
    return {p.name: (os.readlink(p) if p.is_symlink() else None) for p in sorted(root.iterdir())}


def same(a, b) -> bool:
    """Bitwise equality of nested checkpoint contents."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def contents(path: Path) -> dict:
    ckpt = torch.load(path, weights_only=False)
    return {k: ckpt[k] for k in ("state_dict", "optimizer_states", "lr_schedulers", "global_step", "epoch",
                                 "hyper_parameters", "loops")}


# ---------------------------------------------------------------------- ModelCheckpoint, sync vs async
CASES = {
    # top-k rotation (removes ordered behind pending saves) + last.ckpt overwritten every step
    "topk_last": dict(monitor="loss", save_top_k=2, save_last=True, every_n_train_steps=1),
    # save_last="link": last.ckpt is a symlink made once its target is complete
    "topk_link": dict(monitor="loss", mode="max", save_top_k=2, save_last="link", every_n_train_steps=1),
    "every_epoch_keep_all": dict(save_top_k=-1, every_n_epochs=1),
    # one file name for every save: the -v1, -v2 ... version counter must see the queued saves
    "version_counter": dict(filename="fixed", monitor="loss", save_top_k=-1, every_n_train_steps=3, save_last=True),
    # same name reused and the previous best removed each time
    "none_monitor_top1": dict(filename="fixed", save_top_k=1, every_n_train_steps=1),
    # saves from the validation loop (on_validation_end)
    "val_monitor": dict(monitor="val_loss", save_top_k=1, save_last=True, filename="{epoch}-{val_loss:.4f}"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_model_checkpoint_same_as_without_plugin(tmp_path, case):
    kwargs = CASES[case]
    before = dict(shared_io().checkpointer.stats)
    runs = {}
    for plugin in (False, True):
        root = tmp_path / ("async" if plugin else "sync")
        trainer, ckpt, _ = fit(root, plugin, kwargs, max_epochs=3)
        if case in ("topk_last", "topk_link"):  # and resume from "last", keep rotating
            trainer, ckpt, _ = fit(root, plugin, kwargs, max_epochs=5, resume="last")
            assert trainer.global_step == 40
        runs[plugin] = (root, trainer, ckpt)
    (sroot, _, sckpt), (aroot, atrainer, ackpt) = runs[False], runs[True]
    io = atrainer.strategy.checkpoint_io
    assert isinstance(io, AsyncCkptIO)
    delta = stats_delta(before)
    assert delta["file"] > 0
    if case in ("topk_last", "topk_link"):  # rotation did run behind queued saves
        assert delta["remove"] > 0 and delta["remove_behind_pending"] > 0, delta
    assert listing(aroot) == listing(sroot), "different files (orphans, missing or temporary files)"
    for attr in ("best_model_path", "last_model_path", "kth_best_model_path"):
        assert os.path.basename(getattr(ackpt, attr)) == os.path.basename(getattr(sckpt, attr)), attr
    assert {os.path.basename(k) for k in ackpt.best_k_models} == {os.path.basename(k) for k in sckpt.best_k_models}
    for name in listing(sroot):
        assert same(contents(aroot / name), contents(sroot / name)), name
    if case == "version_counter":
        assert "fixed-v1.ckpt" in listing(aroot) and "fixed-v2.ckpt" in listing(aroot)
    if case == "topk_link":
        assert os.path.islink(aroot / "last.ckpt") and os.path.exists(aroot / "last.ckpt")
        assert delta["link_behind_pending"] > 0  # some links waited for their target's write


def test_resume_best_and_load_from_checkpoint(tmp_path):
    kwargs = dict(monitor="loss", save_top_k=1, every_n_train_steps=4)
    trainer, ckpt, _ = fit(tmp_path, True, kwargs, max_epochs=2)
    best = ckpt.best_model_path
    best_step = torch.load(best, weights_only=False)["global_step"]
    model = TinyModule.load_from_checkpoint(best)  # Lightning's own loader, no plugin involved
    assert same(model.state_dict(), torch.load(best, weights_only=False)["state_dict"])
    trainer2 = L.Trainer(max_epochs=3, callbacks=[ModelCheckpoint(dirpath=tmp_path, **kwargs)],
                         plugins=[shared_io()], **QUIET)
    trainer2.fit(TinyModule(), data(), ckpt_path=best)
    assert trainer2.global_step == 24 and best_step > 0


def test_a_manual_save_read_at_once_waits_for_its_write(tmp_path):
    """``trainer.save_checkpoint(p)`` then Lightning's own readers of ``p`` at once (``load_from_checkpoint``,
    ``trainer.validate(ckpt_path=p)``): the save is still being written, and each read waits for it."""
    plugin = AsyncCkptIO()
    trainer = L.Trainer(max_steps=2, plugins=[plugin], default_root_dir=tmp_path, **QUIET)
    trainer.fit(TinyModule(ballast=16 << 20), data())  # 64 MiB of ballast: its write takes a while
    path = tmp_path / "manual.ckpt"
    trainer.save_checkpoint(path)
    in_flight = [h.path for h in plugin.checkpointer.pending()]
    model = TinyModule.load_from_checkpoint(path)
    assert in_flight == [str(path)]  # the read came while the write was pending
    assert same(model.state_dict(), trainer.lightning_module.state_dict())
    trainer.save_checkpoint(tmp_path / "again.ckpt")
    trainer.validate(TinyModule(ballast=16 << 20), data(16), ckpt_path=tmp_path / "again.ckpt", verbose=False)
    plugin.teardown()


def test_a_resume_waits_for_a_save_another_trainer_has_in_flight(tmp_path):
    """One Trainer saves, another (with a plugin of its own) resumes from that path at once, in the same
    process: the load waits for the other plugin's write instead of finding no file."""
    first = AsyncCkptIO()
    trainer = L.Trainer(max_steps=2, plugins=[first], default_root_dir=tmp_path, **QUIET)
    trainer.fit(TinyModule(ballast=16 << 20), data())
    path = tmp_path / "handed_over.ckpt"
    trainer.save_checkpoint(path)
    in_flight = [h.path for h in first.checkpointer.pending()]
    second = L.Trainer(max_steps=4, plugins=[AsyncCkptIO()], default_root_dir=tmp_path, **QUIET)
    second.fit(TinyModule(ballast=16 << 20), data(), ckpt_path=path)
    assert in_flight == [str(path)]  # the resume came while the write was pending
    assert second.global_step == 4
    first.teardown()


class WriterRunning(L.Callback):
    """Whether the plugin's background writer runs when training starts (a resume's restore done) and after each of
    the first steps."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.seen.append(shared_io().checkpointer.writer_pid() is not None)

    def on_train_batch_end(self, trainer, *_) -> None:
        if len(self.seen) < 3:
            self.seen.append(shared_io().checkpointer.writer_pid() is not None)


def test_resume_fidelity_bitwise(tmp_path):
    """N steps + resume to 2N with the plugin == 2N uninterrupted: weights and optimizer state. The resume's
    restore runs before the writer starts (at the first step: its start-up would share the cores with the load)."""
    kwargs = dict(save_last=True, every_n_epochs=1, save_top_k=0)
    fit(tmp_path / "a", True, kwargs, max_epochs=2)
    writer = WriterRunning()
    resumed, *_ = fit(tmp_path / "a", True, kwargs, max_epochs=4, resume="last", callbacks=[writer])
    assert writer.seen == [False, True, True]
    straight, *_ = fit(tmp_path / "b", False, kwargs, max_epochs=4)
    assert resumed.global_step == straight.global_step == 32
    assert same(resumed.lightning_module.state_dict(), straight.lightning_module.state_dict())
    assert same(resumed.optimizers[0].state_dict(), straight.optimizers[0].state_dict())
    assert same(contents(tmp_path / "a" / "last.ckpt"), contents(tmp_path / "b" / "last.ckpt"))


# ---------------------------------------------------------------------- sync points, errors, safety
def test_save_after_fit_then_test_and_options(tmp_path):
    trainer = L.Trainer(max_epochs=1, enable_checkpointing=False, plugins=[shared_io()], **QUIET)
    model = TinyModule()
    trainer.fit(model, data())
    path = tmp_path / "manual" / "x.ckpt"
    trainer.save_checkpoint(path)  # after fit: no teardown will drain it; test() must wait for it
    results = trainer.test(model, data(), ckpt_path=str(path), verbose=False)
    assert results and "test_loss" in results[0]
    io = trainer.strategy.checkpoint_io
    assert not io.pending()
    loaded = io.load_checkpoint(path, weights_only=True)
    assert loaded["global_step"] == 8
    with pytest.raises(Exception):  # weights_only=True refuses arbitrary pickled objects, as torch.load does
        torch.save({"obj": Callback()}, tmp_path / "obj.pt")
        io.load_checkpoint(tmp_path / "obj.pt", weights_only=True)
    with pytest.raises(TypeError, match="storage_options"):
        trainer.save_checkpoint(tmp_path / "y.ckpt", storage_options={"a": 1})
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")


class _SavedWhenExceptionHandled(Checkpoint):
    """Runs after OnExceptionCheckpoint (Lightning runs checkpoint callbacks last, in their given
    order): its file must be complete already."""

    def __init__(self, path: Path):
        self.path, self.seen = path, None

    def on_exception(self, trainer, pl_module, exception):
        io = trainer.strategy.checkpoint_io
        self.seen = (os.path.isfile(self.path), io.pending())


def test_hpc_and_on_exception_saves_are_synchronous(tmp_path):
    class Boom(TinyModule):
        def training_step(self, batch, batch_idx):
            if self.global_step == 5:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    io = shared_io()
    check = _SavedWhenExceptionHandled(tmp_path / "on_exception.ckpt")
    trainer = L.Trainer(max_epochs=2, plugins=[io], callbacks=[OnExceptionCheckpoint(tmp_path), check], **QUIET)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Boom(), data())
    assert check.seen == (True, [])  # written before the next callback ran, nothing pending
    assert torch.load(tmp_path / "on_exception.ckpt", weights_only=False)["global_step"] == 5

    trainer = L.Trainer(max_epochs=1, plugins=[io], enable_checkpointing=False, **QUIET)
    trainer.fit(TinyModule(), data())
    trainer.save_checkpoint(tmp_path / "hpc_ckpt_3.ckpt")  # asynchronous by default: its writer outlives a requeue's kill
    io.wait()
    assert torch.load(tmp_path / "hpc_ckpt_3.ckpt", weights_only=False)["global_step"] == trainer.global_step
    io.sync_patterns = ("hpc_ckpt_*",)  # the option still makes a pattern synchronous
    try:
        trainer.save_checkpoint(tmp_path / "hpc_ckpt_4.ckpt")
        assert os.path.isfile(tmp_path / "hpc_ckpt_4.ckpt") and not io.pending()
    finally:
        io.sync_patterns = ()


def test_failed_background_save_raises_at_next_save(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file where the checkpoint directory should be created")
    dirpath = blocker / "ckpts"
    trainer = L.Trainer(max_epochs=2, plugins=[shared_io()],
                        callbacks=[ModelCheckpoint(dirpath=dirpath, save_top_k=-1, every_n_train_steps=3)], **QUIET)
    with pytest.raises(AsyncCkptSaveError) as info:
        trainer.fit(TinyModule(), data())
    error = info.value
    assert str(dirpath / "epoch=0-step=3.ckpt") in str(error) and "global_step=3" in str(error)
    assert error.step == 3 and error.path == str(dirpath / "epoch=0-step=3.ckpt")
    # raised by a later save's call once the writer reported it; at the latest by the save whose
    # back-pressure waits for it (max_in_flight=2: the second save after it)
    assert trainer.global_step in (3, 6, 9)

    # a failure with no further save still raises, at teardown (the end of fit)
    trainer = L.Trainer(max_epochs=1, plugins=[shared_io()],
                        callbacks=[ModelCheckpoint(dirpath=dirpath, save_top_k=-1, every_n_epochs=1)], **QUIET)
    with pytest.raises(AsyncCkptSaveError, match="global_step=8"):
        trainer.fit(TinyModule(), data())


def test_snapshot_is_taken_before_save_returns(tmp_path):
    """Weights and optimizer state changed right after the save returns do not leak into the file;
    a queued save / removal counts as done for ModelCheckpoint's version counter."""
    trainer = L.Trainer(max_epochs=1, enable_checkpointing=False, plugins=[shared_io()], **QUIET)
    model = TinyModule(ballast=1 << 23)  # 32 MiB: the write is still pending when we mutate
    trainer.fit(model, data())
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = trainer.optimizers[0].state_dict()["state"][0]["exp_avg"].clone()
    io = trainer.strategy.checkpoint_io
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    pending_at_mutation = bool(io.pending())
    with torch.no_grad():
        for tensor in list(model.state_dict().values()):
            tensor.fill_(-7)
        for state in trainer.optimizers[0].state.values():
            state["exp_avg"].fill_(-7)
    # while it is queued, ModelCheckpoint's version counter sees it (as it would see a written file)
    assert ModelCheckpoint(dirpath=tmp_path).file_exists(str(tmp_path / "m.ckpt"), trainer)
    io.wait()
    saved = torch.load(tmp_path / "m.ckpt", weights_only=False)
    assert same(saved["state_dict"], expected)
    assert torch.equal(saved["optimizer_states"][0]["state"][0]["exp_avg"], exp_avg)
    assert pending_at_mutation, "the write finished before the mutation: the case did not test anything"

    trainer.save_checkpoint(tmp_path / "n.ckpt")
    io.remove_checkpoint(tmp_path / "n.ckpt")  # queued behind the save: counts as gone already
    assert io.pending() and not ModelCheckpoint(dirpath=tmp_path).file_exists(str(tmp_path / "n.ckpt"), trainer)
    io.wait()
    assert not os.path.exists(tmp_path / "n.ckpt")


# ---------------------------------------------------------------------- multi-process strategies
def test_ddp_spawn_two_processes(tmp_path):
    """DDP with 2 CPU processes: rank 0 saves in the background; every rank's load waits for it; the
    ddp_spawn hand-off (save in the child, load + remove in the parent) survives the child's exit."""
    kwargs = dict(monitor="loss", save_top_k=2, every_n_train_steps=2, save_last=True)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_epochs=2, strategy="ddp_spawn", callbacks=[ModelCheckpoint(dirpath=tmp_path, **kwargs)],
                        plugins=[AsyncCkptIO()], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=2)
    model = TinyModule(ballast=1 << 20)
    trainer.fit(model, data())
    names = set(os.listdir(tmp_path))
    assert len(names) == 3 and "last.ckpt" in names, names  # top-2 + last, no temporary files
    last = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert last["global_step"] == 8
    # the parent got the final weights through the plugin (saved by rank 0's child, loaded here)
    assert same(model.state_dict(), last["state_dict"])


MODEL_PARALLEL_SCRIPT = ON_PATH + textwrap.dedent('''
    import os, sys, torch, lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    from lightning.pytorch.strategies import ModelParallelStrategy
    from lightning.pytorch.callbacks import ModelCheckpoint
    from asyncckpt.adapters.lightning import AsyncCkptIO
    from toy import body

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = body(16, relu=True)
        def configure_model(self):
            from torch.distributed.fsdp import fully_shard
            mesh = self.device_mesh["data_parallel"]
            for m in self.net:
                if isinstance(m, torch.nn.Linear):
                    fully_shard(m, mesh=mesh)
            fully_shard(self.net, mesh=mesh)
        def training_step(self, b, i):
            x, y = b
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    def run(root, steps, plugin, resume=None):
        L.seed_everything(0, verbose=False)
        x = torch.randn(64, 8)
        ds = TensorDataset(x, x.sum(1, keepdim=True))
        ck = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=2, monitor="loss", save_last=True)
        tr = L.Trainer(max_steps=steps, accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, callbacks=[ck], plugins=[AsyncCkptIO()] if plugin else None,
                       strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
        model = M()
        tr.fit(model, DataLoader(ds, batch_size=8), ckpt_path=resume)
        from torch.distributed.checkpoint.state_dict import get_state_dict, StateDictOptions
        msd, osd = get_state_dict(model, tr.optimizers[0],
                                  options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return tr, msd, osd

    if __name__ == "__main__":
        out = sys.argv[1]
        tr1, _, _ = run(out + "/async", 8, True)
        io1 = tr1.strategy.checkpoint_io
        pending_after_fit = (io1.pending(), (io1.checkpointer.writer_pid() is not None))  # teardown drained, stopped
        tr2, m2, o2 = run(out + "/async", 16, True, resume="last")
        tr3, m3, o3 = run(out + "/sync", 16, False)
        if tr1.global_rank == 0:
            torch.save({"async": (m2, o2), "sync": (m3, o3), "steps": [tr2.global_step, tr3.global_step],
                        "pending_after_fit": pending_after_fit,
                        "stats": [dict(tr1.strategy.checkpoint_io.checkpointer.stats),
                                  dict(tr2.strategy.checkpoint_io.checkpointer.stats)]},
                       out + "/result.pt")
''') + DESTROY_PROCESS_GROUP


def test_model_parallel_sharded_saves_are_async(tmp_path):
    """ModelParallelStrategy (FSDP2) on 2 CPU processes: sharded saves go through the core's
    async_save, Lightning's directory layout with meta.pt; resume fidelity vs an uninterrupted run."""
    script = tmp_path / "mp_script.py"
    script.write_text(MODEL_PARALLEL_SCRIPT)
    proc = subprocess.run([PYTHON, str(script), str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert result["steps"] == [16, 16]
    assert result["pending_after_fit"] == ([], False)
    assert result["stats"][0]["save"] >= 4 and result["stats"][0].get("file", 0) == 0
    assert result["stats"][1]["remove"] >= 1
    (m2, o2), (m3, o3) = result["async"], result["sync"]
    assert same(m2, m3) and same(o2, o3)
    from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint

    names = sorted(os.listdir(tmp_path / "async"))
    assert len(names) == 3 and "last.ckpt" in names, names  # no staging directories left behind
    for name in names:
        path = tmp_path / "async" / name
        assert _is_sharded_checkpoint(path)
        meta = torch.load(path / "meta.pt", weights_only=False)
        assert "state_dict" not in meta and "loops" in meta
        import torch.distributed.checkpoint as dcp  # stock DCP reads our directory

        from torch.distributed.checkpoint.metadata import Metadata
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        assert isinstance(metadata, Metadata) and any(k.startswith("state_dict.") for k in metadata.state_dict_metadata)


def test_fsdp_sharded_code_path_without_gpu(tmp_path):
    """FSDP (FSDP1) refuses CPU in Lightning 2.6.6 and in torch; run its sharded save branch with the
    plugin as far as a single CPU process allows, and check Lightning's own sharded-checkpoint test."""
    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        L.Trainer(strategy="fsdp", accelerator="cpu", devices=2)

    strategy = FSDPStrategy(state_dict_type="sharded")
    io = AsyncCkptIO()
    strategy.checkpoint_io = io
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": 7,
                  "epoch": 1, "loops": {"x": 1}}
    path = tmp_path / "sharded.ckpt"
    strategy.save_checkpoint(checkpoint, path)
    assert io.checkpointer.stats["save"] == 1
    io.wait()
    from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint

    assert _is_sharded_checkpoint(path)
    assert sorted(os.listdir(path)) == [".asyncckpt-commit.json", ".metadata", "__0.asyncckpt.json",
                                        "__0_0.distcp", "__0_1.distcp", "meta.pt"]  # docs/lightning.md: DCP's, ours, meta.pt
    assert torch.load(path / "meta.pt", weights_only=False) == {"global_step": 7, "epoch": 1, "loops": {"x": 1}}
    import torch.distributed.checkpoint as dcp

    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    assert same(target["model"], model.state_dict())


# ---------------------------------------------------------------------- the shared example
def _example_variants(tmp_path: Path) -> dict[str, Path]:
    source = (REPO / "examples" / "lightning_min.py").read_text()
    assert "plugins=[AsyncCkptIO()]" in source
    dump = ('\nimport torch as _t\n_t.save({"model": trainer.lightning_module.state_dict(), '
            '"optim": trainer.optimizers[0].state_dict(), "step": trainer.global_step}, "final.pt")\n')
    plain = re.sub(r"^from asyncckpt\.adapters\.lightning import AsyncCkptIO", "# \\g<0>", source, flags=re.M)
    plain = re.sub(r"^(\s*)(plugins=\[AsyncCkptIO\(\)\],)", r"\1# \2", plain, flags=re.M)
    assert plain != source and "AsyncCkptIO()]," in plain
    variants = {}
    for name, text in (("async", source), ("sync", plain)):
        (tmp_path / name).mkdir()
        variants[name] = tmp_path / name / "lightning_min.py"
        variants[name].write_text(text + dump)
    return variants


def test_shared_example_twice_bitwise(tmp_path):
    """examples/lightning_min.py (the shared example, two lines enabled): run 2 epochs, then 4 resuming
    from last.ckpt; end bitwise equal to the same program without the plugin."""
    for name, script in _example_variants(tmp_path).items():
        for epochs in ("2", "4"):
            proc = subprocess.run([PYTHON, script.name, epochs], cwd=script.parent, capture_output=True, text=True,
                                  timeout=120)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert "done at global_step %d" % (16 * int(epochs)) in proc.stdout, proc.stdout
    a = torch.load(tmp_path / "async" / "final.pt", weights_only=False)
    s = torch.load(tmp_path / "sync" / "final.pt", weights_only=False)
    assert a["step"] == s["step"] == 64
    assert same(a, s)
    assert listing(tmp_path / "async" / "ckpts") == listing(tmp_path / "sync" / "ckpts")
    for name in listing(tmp_path / "sync" / "ckpts"):
        assert same(contents(tmp_path / "async" / "ckpts" / name), contents(tmp_path / "sync" / "ckpts" / name))


# ---------------------------------------------------------------------- LightningCLI
CLI_SCRIPT = textwrap.dedent('''
    import sys, torch, lightning as L
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel, BoringDataModule

    class Report(Callback):
        def on_fit_end(self, trainer, module):
            io = trainer.strategy.checkpoint_io
            print(f"PLUGIN {type(io).__module__}.{type(io).__name__} max_in_flight={io.options.max_in_flight}")

    if __name__ == "__main__":
        defaults = {"max_steps": 2, "accelerator": "cpu", "enable_progress_bar": False, "callbacks": [Report()],
                    "default_root_dir": sys.argv[1]}
        if "--spec-default" in sys.argv:  # the documented form: a class_path/init_args spec, not an instance
            sys.argv.remove("--spec-default")
            defaults["plugins"] = [{"class_path": "asyncckpt.adapters.lightning.AsyncCkptIO",
                                    "init_args": {"max_in_flight": 3}}]
        LightningCLI(BoringModel, BoringDataModule, trainer_defaults=defaults, args=sys.argv[2:])
''')


def test_lightning_cli_config_records_the_plugin_and_reads_it_back(tmp_path):
    """LightningCLI writes the plugin into config.yaml as its class and init arguments, and a run
    from that config gets the same plugin; ``--trainer.plugins=...`` selects it on the command line."""
    pytest.importorskip("jsonargparse")
    script = tmp_path / "cli.py"
    script.write_text(CLI_SCRIPT)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with Zygote(["lightning.pytorch.cli", "lightning.pytorch.demos.boring_classes", "asyncckpt.adapters.lightning"],
                env, tmp_path) as zygote:  # the three runs are forks of one process that imported Lightning once
        def run(*args):
            proc = zygote.run(script, str(tmp_path / "run"), *args, cwd=tmp_path)
            stdout = "\n".join(proc.remaining_lines(timeout=180))
            assert proc.returncode == 0, proc.stderr()[-3000:]
            assert "Unable to serialize" not in proc.stderr() + stdout
            return stdout

        assert "PLUGIN asyncckpt.adapters.lightning.checkpoint_io.AsyncCkptIO max_in_flight=3" in run("fit", "--spec-default")
        configs = list((tmp_path / "run").rglob("config.yaml"))
        assert len(configs) == 1
        text = configs[0].read_text()
        assert "class_path: asyncckpt.adapters.lightning.AsyncCkptIO" in text and "max_in_flight: 3" in text
        assert "max_in_flight=3" in run("fit", "--config", str(configs[0]), "--trainer.default_root_dir",
                                        str(tmp_path / "again"))
        assert "max_in_flight=2" in run("fit", "--trainer.plugins=asyncckpt.adapters.lightning.AsyncCkptIO",
                                        "--trainer.default_root_dir", str(tmp_path / "cli"))
