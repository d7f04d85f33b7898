"""One product across frameworks: the same options (names, defaults, meanings) in the core and the three
adapters, and each save's metrics in each framework's own logging (Lightning's CSVLogger, an Accelerate tracker,
the Trainer's ``log``)."""
from __future__ import annotations

import csv
import dataclasses
import inspect
import typing
import warnings
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.tracking import GeneralTracker  # noqa: E402
from accelerate.utils import ProjectConfiguration, set_seed  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.utils.data import DataLoader, Dataset, TensorDataset  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from asyncckpt import core  # noqa: E402
from asyncckpt.adapters.accelerate import enable_async_checkpointing  # noqa: E402
from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback  # noqa: E402
from asyncckpt.adapters.lightning import AsyncCkptIO  # noqa: E402
from asyncckpt.core import CheckpointOptions  # noqa: E402

FIELDS = dataclasses.fields(CheckpointOptions)
HINTS = typing.get_type_hints(CheckpointOptions)
METRICS = ("stall_s", "waited_s", "durable_s", "bytes", "bytes_written", "bytes_shared", "snapshot_wait_s")


def _accelerator(project: Path, **kwargs) -> Accelerator:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(project),
                                                                     automatic_checkpoint_naming=True), **kwargs)


@pytest.fixture
def entry_points(tmp_path):
    """Every entry point, by name: a function of the options giving the object's Checkpointer."""
    made = []

    def accelerate(**options):
        handle = enable_async_checkpointing(_accelerator(tmp_path / f"acc{len(made)}"), **options)
        made.append(handle.remove)
        return handle.checkpointer

    def made_by(factory):
        def make(**options):
            checkpointer = factory(**options).checkpointer
            made.append(checkpointer.close)
            return checkpointer
        return make

    def checkpointer(**options):
        made.append((made_one := core.Checkpointer(**options)).close)
        return made_one

    yield {"Checkpointer": (core.Checkpointer.__init__, checkpointer),
           "AsyncCkptIO": (AsyncCkptIO.__init__, made_by(AsyncCkptIO)),
           "enable_async_checkpointing": (enable_async_checkpointing, accelerate),
           "AsyncCheckpointCallback": (AsyncCheckpointCallback.__init__, made_by(AsyncCheckpointCallback))}
    for close in made:
        close()


def test_every_entry_point_declares_every_option_with_the_core_default(entry_points):
    """The signature each framework's tools read (help, IDEs, LightningCLI's jsonargparse) names every option of
    CheckpointOptions with the same default and type: an adapter that drifts fails here."""
    for name, (function, _make) in entry_points.items():
        parameters = inspect.signature(function).parameters
        for field in FIELDS:
            assert field.name in parameters, f"{name} lacks {field.name}"
            assert parameters[field.name].default == field.default, (name, field.name)
            assert parameters[field.name].annotation == HINTS[field.name], (name, field.name)
            assert parameters[field.name].kind is inspect.Parameter.KEYWORD_ONLY, (name, field.name)


def test_every_entry_point_applies_every_option_the_same(entry_points, tmp_path):
    changed = dict(max_in_flight=3, timeout=123.0, direct_io=False, io_threads=3, verify=False, resume_from_intact=True,
                   overlap_optimizer=False, mirror_to="s3://bucket/run", export="safetensors", on_commit=print,
                   log_metrics=False, writer_idle_timeout=7.0)
    changed.update(memory_tier=core.MemoryTier(replicas=0, keep=3), failures_per_day=4.0, cooperative_load="node",
                   share_unchanged=False)
    assert set(changed) | {"object_store"} == {field.name for field in FIELDS}  # every option but one is tried here
    for name, (_function, make) in entry_points.items():
        assert make().options == CheckpointOptions(), name
        options = make(**changed).options
        for option, value in changed.items():
            if option != "export":  # Accelerate's exports go beside checkpoints/ (its own default directory)
                assert getattr(options, option) == value, (name, option)
        assert options.export is not None, name
        assert make(options=CheckpointOptions(max_in_flight=4)).options.max_in_flight == 4, name
        assert make(options=CheckpointOptions(max_in_flight=4), max_in_flight=5).options.max_in_flight == 5, name


def test_an_unknown_option_names_the_accepted_ones(entry_points):
    for name, (_function, make) in entry_points.items():
        with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_inflight'.*max_in_flight, timeout"):
            make(max_inflight=2)


def test_a_renamed_option_works_under_its_old_name_with_a_future_warning(entry_points):
    for name, (_function, make) in entry_points.items():
        with pytest.warns(FutureWarning, match=r"verify_on_resume=\.\.\.\) is deprecated .* use verify="):
            assert make(verify_on_resume=False).options.verify is False, name


def test_a_given_checkpointer_keeps_its_options():
    with core.Checkpointer(max_in_flight=3) as checkpointer:
        with pytest.raises(TypeError, match="takes its options from that Checkpointer"):
            AsyncCheckpointCallback(checkpointer=checkpointer, max_in_flight=1)
        assert AsyncCheckpointCallback(checkpointer=checkpointer).options.max_in_flight == 3


# ---------------------------------------------------------------------- metrics in each framework's logging
def _assert_records(records, saves):
    assert len(records) == saves, records
    for record in records:
        assert record["stall_s"] > 0 and record["durable_s"] > 0 and record["bytes"] > 1 << 20, record
        assert record["waited_s"] >= 0 and record["snapshot_wait_s"] >= 0, record
        assert record["bytes_written"] > 0 and record["bytes_shared"] >= 0, record  # this rank's writer's, shared


class _Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(512, 512)  # 1 MiB of weights, 3 MiB with Adam's state

    def training_step(self, batch, batch_idx):
        loss = self.net(batch[0]).pow(2).mean()
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters())


@pytest.mark.parametrize("log_metrics", [True, False])
def test_lightning_loggers_receive_each_saves_metrics(tmp_path, log_metrics):
    logger = CSVLogger(tmp_path / "logs", name="run")
    trainer = L.Trainer(max_steps=6, accelerator="cpu", logger=logger, log_every_n_steps=1, enable_progress_bar=False,
                        enable_model_summary=False, plugins=[AsyncCkptIO(log_metrics=log_metrics)],
                        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)])
    trainer.fit(_Module(), DataLoader(TensorDataset(torch.randn(48, 512)), batch_size=8))
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("checkpoint/stall_s")]
    if not log_metrics:
        assert rows == [] and (Path(logger.log_dir) / "metrics.csv").stat().st_size > 0  # the loss is there
        return
    _assert_records([{name: float(row[f"checkpoint/{name}"]) for name in METRICS} for row in rows], saves=3)
    assert sorted(int(row["step"]) for row in rows) == [int(row["step"]) for row in rows]  # at the step it was known


class _Tracker(GeneralTracker):
    """An in-memory Accelerate tracker: what ``accelerator.log`` gives every tracker."""
    name, requires_logging_directory, main_process_only = "memory", False, True

    def __init__(self):
        super().__init__()
        self.logged: list[dict] = []

    @property
    def tracker(self):
        return self.logged

    def store_init_configuration(self, values):
        pass

    def log(self, values, step=None, **kwargs):
        self.logged.append(dict(values))


def test_accelerate_trackers_receive_each_saves_metrics(tmp_path):
    tracker = _Tracker()
    acc = _accelerator(tmp_path / "p", log_with=tracker)
    acc.init_trackers("run")
    handle = enable_async_checkpointing(acc)
    set_seed(0)
    model, opt = acc.prepare(*(lambda m: (m, torch.optim.Adam(m.parameters())))(torch.nn.Linear(512, 512)))
    for _ in range(3):
        model(torch.randn(4, 512)).pow(2).mean().backward()
        opt.step()
        acc.save_state()
    acc.end_training()  # the last save's record too, before the trackers end
    records = [{name: entry[f"checkpoint/{name}"] for name in METRICS} for entry in tracker.logged
               if "checkpoint/stall_s" in entry]
    _assert_records(records, saves=3)
    handle.remove()


class _Squares(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = torch.full((512,), float(i) / 64)
        return {"x": x, "labels": x}


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(512, 512)

    def forward(self, x, labels=None):
        y = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(y, labels), "logits": y}


def test_the_trainers_report_to_integrations_receive_each_saves_metrics_and_its_own_state_does_not(tmp_path,
                                                                                                    monkeypatch):
    """The metrics reach TensorBoard (a report_to integration, for real) as ``train/checkpoint_*``, but not the Trainer's
    ``state.log_history`` (kept in every ``trainer_state.json``; a resumed run must reproduce it) nor the other
    callbacks' ``on_log``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import TrainerCallback

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=6, save_steps=2, per_device_train_batch_size=8,
                             report_to="tensorboard", use_cpu=True, logging_steps=100, save_total_limit=None)
    callback, logged = AsyncCheckpointCallback(), []
    listener = type("Listener", (TrainerCallback,), {"on_log": lambda self, a, s, c, logs=None, **k: logged.append(logs)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=_Net(), args=args, train_dataset=_Squares(), callbacks=[callback, listener()])
        trainer.train()
    _assert_records([{name: record[name] for name in METRICS} for record in callback.metrics], saves=3)
    assert [record["step"] for record in callback.metrics] == [2, 4, 6]
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    for name in ("step", *METRICS):
        values = [event.value for event in events.Scalars(f"train/checkpoint_{name}")]
        assert values == pytest.approx([record[name] for record in callback.metrics], rel=1e-6), name
    assert not any(key.startswith("checkpoint_") for entry in trainer.state.log_history + logged for key in entry)


def test_every_adapter_speaks_one_handle_vocabulary_and_close_frees_the_staging_buffers(tmp_path):
    """``wait()``, ``pending()``, ``metrics`` (a list) and ``close()`` on the three adapters' objects; ``close()`` frees
    the snapshot buffers (pinned host memory the end of a run keeps) and a later save allocates them again; the old
    spellings (``metrics.history``, Accelerate's ``pending`` as a property) still work, with a FutureWarning."""
    io = AsyncCkptIO()
    accelerator = _accelerator(tmp_path / "acc")
    handle = enable_async_checkpointing(accelerator)
    callback = AsyncCheckpointCallback()
    model = torch.nn.Linear(1024, 512)  # 2 MiB: more than Accelerate's inline_bytes, so it is staged
    accelerator.prepare(model)

    def save(which, n):
        if which is io:
            io.save_checkpoint({"w": model.weight}, str(tmp_path / f"io{n}.ckpt"))
        elif which is handle:
            accelerator.save_state()
        else:
            callback.checkpointer.save_file({"w": model.weight}, str(tmp_path / f"cb{n}.pt"))

    for adapter in (io, handle, callback):
        save(adapter, 1)
        assert isinstance(adapter.pending(), list) and isinstance(adapter.metrics, list)
        adapter.wait()
        assert adapter.pending() == [] and adapter.checkpointer._parts.buffers.slots()
        adapter.close()
        assert adapter.checkpointer._parts.buffers.slots() == []
        save(adapter, 2)
        adapter.wait()
        assert adapter.checkpointer._parts.buffers.slots()
        adapter.close()
    with pytest.warns(FutureWarning, match="metrics.history is deprecated"):
        assert io.metrics.history == io.metrics
    with pytest.warns(FutureWarning, match="pending is a method now"):
        assert list(handle.pending) == []
    handle.remove()
