"""FSDP2 checkpoints through the frameworks' own save functions, asynchronous, on 2 gloo ranks (CPU).

Accelerate's launcher refuses FSDP without GPUs: ``Accelerator(cpu=True)`` is ``MULTI_CPU`` (DDP),
and ``AcceleratorState`` picks FSDP only for GPU distributed types. So these tests wrap a model with
FSDP2's ``fully_shard`` themselves (it runs on CPU with gloo), register it with the Accelerator as
``prepare()`` would, set the distributed type to FSDP with a real ``FullyShardedDataParallelPlugin``,
and then call the framework's own ``save_state`` / ``load_state`` (which call ``save_fsdp_model``,
``save_fsdp_optimizer`` and their loaders) and the Trainer's own ``_save_checkpoint`` and resume
functions. ``tests/test_cuda.py`` runs the launchers' own FSDP paths where GPUs exist.

Checked: the async save writes what the framework's own synchronous save writes (file names, DCP
metadata keys, shapes and dtypes, the values); the framework's loader reads it; training continues
bit for bit after a resume; the shards merge to one process (resharding 2 -> 1) with Accelerate's
``merge_fsdp_weights``; a kill -9 in the middle of saves leaves only complete checkpoints visible.
Accelerate's ``use_dcp=False`` (per-rank ``torch.save`` shard files instead of DCP) likewise: every
rank's files in the one committed, checksummed directory.
"""
from __future__ import annotations

import os
import random
import time
from pathlib import Path

import numpy
import pytest
import torch

from dist_helper import run_on_ranks
from program_end import DESTROY_PROCESS_GROUP
from zygote import ForkedRun, Zygote

pytest.importorskip("accelerate")

STEPS_BEFORE, STEPS_AFTER = 3, 3


# ----------------------------------------------------------------------------- on every rank
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 8))


def fsdp_accelerator(state_dict_type: str, **accelerator_options):
    """An Accelerator in FSDP2 mode on CPU, with a fully_shard-ed model and its Adam (see the module docstring)."""
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import fully_shard

    accelerator = Accelerator(cpu=True, **accelerator_options)
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    accelerator._models.append(model)  # what prepare() registers
    accelerator._optimizers.append(AcceleratedOptimizer(optimizer, device_placement=False))
    accelerator.state.distributed_type = DistributedType.FSDP  # after AcceleratedOptimizer, whose state resets it
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=state_dict_type)
    return accelerator, model, optimizer


def train(model, optimizer, steps, rank) -> None:
    for step in steps:
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1000 * step + rank))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def local_state(model, optimizer) -> list[torch.Tensor]:
    """This rank's shards of the parameters and of Adam's moments."""
    tensors = [p.detach().to_local().clone() for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [v.to_local().clone() if hasattr(v, "to_local") else v.clone() for v in state.values()]
    return tensors


def listing(directory: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), directory) for d, _, files in os.walk(directory) for f in files)


def without_dcp() -> None:
    """Accelerate 1.15's ``use_dcp`` is a parameter of ``save_fsdp_model`` / ``save_fsdp_optimizer`` and their
    loaders only: ``save_state`` and ``load_state`` call them with the default (DCP). A user who wants the
    per-rank files binds ``use_dcp=False`` where ``accelerate.accelerator`` looks the four up, as here."""
    import functools

    import accelerate.accelerator as accelerator_module
    from accelerate.utils import fsdp_utils

    for name in ("save_fsdp_model", "save_fsdp_optimizer", "load_fsdp_model", "load_fsdp_optimizer"):
        setattr(accelerator_module, name, functools.partial(getattr(fsdp_utils, name), use_dcp=False))


def save_both_and_resume(rank, world, root, state_dict_type, use_dcp=True):
    """Accelerate's own save, ours of the same state, then a resume from ours. ``inline_bytes=0``: every
    file goes through a snapshot buffer, as a real model's would (these are tiny)."""
    from asyncckpt.adapters.accelerate import enable_async_checkpointing

    if not use_dcp:
        without_dcp()
    accelerator, model, optimizer = fsdp_accelerator(state_dict_type)
    train(model, optimizer, range(STEPS_BEFORE), rank)
    native, asynchronous = os.path.join(root, "native"), os.path.join(root, "async")
    accelerator.save_state(native)  # the framework's own synchronous save of the same state
    handle = enable_async_checkpointing(accelerator, inline_bytes=0)
    accelerator.save_state(asynchronous)
    train(model, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), rank)
    expected = local_state(model, optimizer)
    handle.wait()
    accelerator.load_state(asynchronous)  # load_fsdp_model / load_fsdp_optimizer, after our check
    train(model, optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), rank)
    resumed = local_state(model, optimizer)
    handle.remove()
    files = [name for name in listing(native) if name.endswith((".bin", ".pkl"))]
    return {"same_after_resume": len(expected) == len(resumed) and all(map(torch.equal, expected, resumed)),
            "async_files": listing(asynchronous), "native_files": listing(native),
            "same_files": {name: _same(*(torch.load(os.path.join(d, name), weights_only=False) for d in (asynchronous, native)))
                           for name in files}}


# ----------------------------------------------------------------------------- the tests
def _metadata(directory: Path) -> dict:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return {key: (tuple(value.size), value.properties.dtype) if isinstance(value, TensorStorageMetadata) else "bytes"
            for key, value in metadata.items()}


def _data_files_by_kind(directory: Path, ours: list[str], native: list[str]) -> None:
    """The DCP data files of our subdirectories are DCP's own ``__{rank}_0.distcp``, holding only
    tensors, plus a ``__{rank}_1.distcp`` of the non-tensor values for each rank that writes some
    (DCP's writer puts both into ``__{rank}_0.distcp``): what the adapters' pages say."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    data = lambda files: {name for name in files if name.endswith(".distcp")}  # noqa: E731
    assert data(native) <= data(ours)
    assert {name.rsplit("_", 1)[1] for name in data(ours) - data(native)} == {"1.distcp"}  # some, and only those
    for part in {name.split("/")[0] for name in data(ours)}:
        metadata = FileSystemReader(str(directory / part)).read_metadata()
        for index, info in metadata.storage_data.items():
            kind = TensorStorageMetadata if info.relative_path.endswith("_0.distcp") else BytesStorageMetadata
            assert isinstance(metadata.state_dict_metadata[index.fqn], kind), (part, index.fqn, info.relative_path)


def _merged(directory: Path, out: Path) -> dict:
    """Accelerate's own merge of FSDP shards into one file, in this single process (resharding 2 -> 1)."""
    from accelerate.utils import merge_fsdp_weights

    merge_fsdp_weights(str(directory), str(out), safe_serialization=False)
    return torch.load(out / "pytorch_model.bin", weights_only=True)


def test_accelerate_fsdp2_sharded_state_is_saved_asynchronously_as_dcp(tmp_path):
    from asyncckpt.core import is_complete
    from asyncckpt.core.verify import integrity

    results = run_on_ranks(save_both_and_resume, 2, str(tmp_path), "SHARDED_STATE_DICT", timeout=300)

    native, asynchronous = tmp_path / "native", tmp_path / "async"
    assert all(result["same_after_resume"] for result in results)  # bit for bit, on each rank
    ours_only = {".asyncckpt-commit.json", "pytorch_model_fsdp_0/__0.asyncckpt.json", "pytorch_model_fsdp_0/__1.asyncckpt.json",
                 "optimizer_0/__0.asyncckpt.json", "optimizer_0/__1.asyncckpt.json"}  # commit record, rank sidecars
    not_data = lambda files: {name for name in files if not name.endswith(".distcp")}  # noqa: E731 (DCP names them per writer)
    assert not_data(results[0]["async_files"]) == not_data(results[0]["native_files"]) | ours_only
    assert {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata", "random_states_1.pkl"} <= ours_only ^ not_data(
        results[0]["async_files"])
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert _metadata(asynchronous / part) == _metadata(native / part)
    _data_files_by_kind(asynchronous, results[0]["async_files"], results[0]["native_files"])
    assert is_complete(str(asynchronous))
    report = integrity.check(str(asynchronous))
    assert report.intact and report.checked_files >= 4 and not report.unverified, report
    merged, reference = _merged(asynchronous / "pytorch_model_fsdp_0", tmp_path / "m1"), \
        _merged(native / "pytorch_model_fsdp_0", tmp_path / "m2")
    assert merged.keys() == reference.keys() and all(torch.equal(merged[k], reference[k]) for k in merged)
    assert {tuple(v.shape) for v in merged.values()} >= {(64, 32), (8, 64)}  # whole tensors, from 2 ranks' shards


def test_accelerate_fsdp2_full_state_is_written_asynchronously_by_the_main_process(tmp_path):
    results = run_on_ranks(save_both_and_resume, 2, str(tmp_path), "FULL_STATE_DICT", timeout=300)

    for result in results:
        assert result["same_after_resume"]
    native = set(results[0]["native_files"])
    assert native == {"pytorch_model_fsdp.bin", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl"}
    assert set(results[0]["async_files"]) == native | {".asyncckpt-commit.json"}
    assert all(result["same_files"] == dict.fromkeys(native, True) for result in results)


def test_accelerate_fsdp2_per_rank_files_without_dcp_are_saved_asynchronously_by_each_rank(tmp_path):
    """``use_dcp=False``: each rank ``torch.save``s its shard; here each rank's writer writes its own
    file into the one checkpoint, whose commit record lists both ranks' files."""
    import inspect

    from accelerate.utils import fsdp_utils

    from asyncckpt.core.verify import integrity

    if "use_dcp" not in inspect.signature(fsdp_utils.save_fsdp_model).parameters:
        pytest.skip("use_dcp is new in accelerate 1.15")

    results = run_on_ranks(save_both_and_resume, 2, str(tmp_path), "SHARDED_STATE_DICT", False, timeout=300)

    native = {f"{prefix}_0_rank{rank}.bin" for prefix in ("pytorch_model_fsdp", "optimizer") for rank in (0, 1)} | {
        "random_states_0.pkl", "random_states_1.pkl"}
    assert set(results[0]["native_files"]) == native
    assert set(results[0]["async_files"]) == native | {".asyncckpt-commit.json"}
    for result in results:
        assert result["same_after_resume"]
        assert result["same_files"] == dict.fromkeys(native, True)  # read on each rank: DTensor shards, Adam state
    report = integrity.check(str(tmp_path / "async"))
    assert report.intact and report.checked_files == len(native) and not report.unverified, report


def _same(a, b) -> bool:
    if hasattr(a, "to_local"):  # a DTensor in a per-rank file: its place in the whole, and the shard it holds
        return type(a) is type(b) and a.shape == b.shape and a.placements == b.placements and _same(a.to_local(), b.to_local())
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, numpy.ndarray):  # numpy's RNG state
        return isinstance(b, numpy.ndarray) and a.dtype == b.dtype and numpy.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


# ----------------------------------------------------------------------------- the Trainer
def trainer_save_and_resume(rank, world, root, state_dict_type):
    """The Trainer's own ``_save_checkpoint`` (ours with the callback) and its own FSDP resume
    functions, on an FSDP2 model set up as in ``fsdp_accelerator``."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import fully_shard
    from transformers import Trainer, TrainingArguments

    from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback

    def fsdp_trainer(output_dir, callbacks):
        model = _model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        args = TrainingArguments(output_dir=output_dir, use_cpu=True, report_to=[], save_strategy="steps",
                                 learning_rate=1e-2, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, callbacks=callbacks)
        trainer.accelerator.state.distributed_type = DistributedType.FSDP
        trainer.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2,
                                                                               state_dict_type=state_dict_type)
        trainer.is_fsdp_enabled = True
        trainer.create_optimizer_and_scheduler(num_training_steps=100)
        trainer.model_wrapped = model
        return trainer

    callback = AsyncCheckpointCallback()
    ours, theirs = fsdp_trainer(os.path.join(root, "async"), [callback]), fsdp_trainer(os.path.join(root, "native"), [])
    for trainer in (ours, theirs):
        train(trainer.model, trainer.optimizer, range(STEPS_BEFORE), rank)
        trainer.state.global_step = STEPS_BEFORE
        trainer._save_checkpoint(trainer.model, trial=None)
    checkpoint = os.path.join(root, "async", f"checkpoint-{STEPS_BEFORE}")
    train(ours.model, ours.optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), rank)
    expected = local_state(ours.model, ours.optimizer)
    callback.checkpointer.wait(everywhere=True)
    ours._load_from_checkpoint(checkpoint)  # load_fsdp_model
    ours._load_optimizer_and_scheduler(checkpoint)  # load_fsdp_optimizer
    train(ours.model, ours.optimizer, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), rank)
    resumed = local_state(ours.model, ours.optimizer)
    callback.checkpointer.close()
    return {"same_after_resume": all(map(torch.equal, expected, resumed)) and len(expected) == len(resumed),
            "async_files": listing(checkpoint),
            "native_files": listing(os.path.join(root, "native", f"checkpoint-{STEPS_BEFORE}")),
            "saved_through_us": [t["step"] for t in callback.metrics]}


def test_trainer_fsdp2_sharded_checkpoint_is_saved_asynchronously(tmp_path):
    pytest.importorskip("transformers")
    from asyncckpt.core.verify import integrity

    results = run_on_ranks(trainer_save_and_resume, 2, str(tmp_path), "SHARDED_STATE_DICT", timeout=300)

    assert all(result["same_after_resume"] and result["saved_through_us"] == [STEPS_BEFORE] for result in results)
    ours, theirs = set(results[0]["async_files"]), set(results[0]["native_files"])
    assert {name for name in ours if not name.endswith((".distcp", ".asyncckpt.json")) and not name.startswith(".")} \
        == {name for name in theirs if not name.endswith(".distcp")}
    assert {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata", "scheduler.pt", "trainer_state.json"} <= ours
    checkpoint = tmp_path / "async" / f"checkpoint-{STEPS_BEFORE}"
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert _metadata(checkpoint / part) == _metadata(tmp_path / "native" / f"checkpoint-{STEPS_BEFORE}" / part)
    _data_files_by_kind(checkpoint, results[0]["async_files"], results[0]["native_files"])
    report = integrity.check(str(checkpoint))
    assert report.intact and not report.unverified, report


# ----------------------------------------------------------------------------- kill -9
KILL_TRIALS = 4
KILL_PROGRAM = """
import os, sys
sys.path[:0] = [{tests!r}, {helpers!r}]
from accelerate.utils import ProjectConfiguration
from test_fsdp import fsdp_accelerator, train
from asyncckpt.adapters.accelerate import enable_async_checkpointing
mode, root = sys.argv[1], sys.argv[2]
accelerator, model, optimizer = fsdp_accelerator("SHARDED_STATE_DICT", project_config=ProjectConfiguration(
    project_dir=root, automatic_checkpoint_naming=True, total_limit=2))
handle = enable_async_checkpointing(accelerator)
rank = accelerator.process_index
if mode == "once":
    accelerator.load_state()  # the newest, checked first
for step in range(100000 if mode == "loop" else 1):
    train(model, optimizer, [step], rank)
    accelerator.save_state()
    if step == 2 and rank == 0:
        print("READY", flush=True)  # rotation has started
handle.remove()
""" + DESTROY_PROCESS_GROUP


def _torchrun(zygote: Zygote, script: Path, *args: str) -> ForkedRun:
    """``torchrun --nproc_per_node 2 script *args`` in a process group of its own, forked from ``zygote``
    (torchrun's own torch import is paid once; its ranks are fresh processes, as torchrun starts them)."""
    from dist_helper import free_port

    return zygote.run(None, "--nproc_per_node", "2", "--master_port", str(free_port()), str(script), *args,
                      module="torch.distributed.run", new_session=True)


def _assert_loadable(checkpoint: Path, scratch: Path) -> None:
    from asyncckpt.core import is_complete
    from asyncckpt.core.verify import integrity

    assert is_complete(str(checkpoint)), f"{checkpoint} visible without its commit record: {os.listdir(checkpoint)}"
    report = integrity.check(str(checkpoint))
    assert report.intact, (checkpoint, report.problems)
    assert _merged(checkpoint / "pytorch_model_fsdp_0", scratch)  # Accelerate's own reader takes it


def test_kill9_during_fsdp_saves_leaves_only_complete_checkpoints(tmp_path):
    from asyncckpt.core.formats import names

    script, root = tmp_path / "train.py", tmp_path / "run"
    script.write_text(KILL_PROGRAM.format(tests=str(Path(__file__).parent), helpers=str(Path(__file__).parents[1] / "helpers")))
    delays = random.Random("fsdp-kill").sample(range(0, 1500, 50), KILL_TRIALS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    # a job counts as ended once torchrun, its ranks and their writers have all ended (the zygote reaps them)
    with Zygote(["torch.distributed.launcher.api", "torch.distributed.elastic.multiprocessing"], env,
                tmp_path) as zygote:
        for trial, delay_ms in enumerate(delays):
            job = _torchrun(zygote, script, "loop", str(root))
            try:
                job.wait_for_line("READY")
                time.sleep(delay_ms / 1000)
            finally:
                job.kill()  # its process group: torchrun and both ranks
                job.wait()
            visible = sorted((root / "checkpoints").iterdir())
            assert visible, f"nothing visible after a kill {delay_ms} ms into rotation"
            for checkpoint in visible:
                _assert_loadable(checkpoint, tmp_path / f"merged-{trial}-{checkpoint.name}")
        resumed = _torchrun(zygote, script, "once", str(root))
        assert resumed.wait(timeout=240) == 0, resumed.stderr()[-3000:]
    leftovers = [entry for parent in (root, root / "checkpoints") for entry in os.listdir(parent) if names.parse_hidden(entry)]
    assert leftovers == [], leftovers
