"""The writer's torch-free ``.metadata`` pickle (``dcp_pickle``) loads as the Metadata torch builds."""
import os
import pickle
import subprocess
import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as m
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

from asyncckpt import core
from asyncckpt.core.formats import dcp_pickle
from asyncckpt.core.snapshot import dcp_metadata
from asyncckpt.core.loading.metadata_io import load_dcp_metadata
from asyncckpt.core.snapshot.dcp_metadata import attributes, dcp_classes, metadata_pickled_by_torch
from asyncckpt.core.storage.sidecar_io import read_sidecar


def _state(n_tensors: int, step: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    params = {f"layer{i}.weight": torch.randn(1 + i % 7, 3, generator=generator) for i in range(n_tensors)}
    params["half"] = torch.ones(2, 2, dtype=torch.bfloat16, requires_grad=True)
    return {
        "model": params,
        "extra": {"step": step, "name": "x" * step, "groups": [{"lr": 0.1 * step, "params": list(range(step))}],
                  "big": 1 << 40, "neg": -5},
    }


def _reference(sidecars, checkpoint_id: str, save_id: str) -> m.Metadata:
    """The Metadata torch's own constructors build from these sidecars (the writer's fallback)."""
    return pickle.loads(metadata_pickled_by_torch(sidecars, checkpoint_id, save_id))


def _same(a: m.Metadata, b: m.Metadata) -> None:
    assert a == b  # dataclass equality: every field, every entry
    keys_a = [(k.fqn, tuple(k.offset or ()), k.index) for k in a.storage_data]
    keys_b = [(k.fqn, tuple(k.offset or ()), k.index) for k in b.storage_data]
    assert keys_a == keys_b  # MetadataIndex equality ignores .index; the reader uses it
    assert list(a.state_dict_metadata) == list(b.state_dict_metadata)
    assert attributes(a) == attributes(b)  # also attributes that are not dataclass fields


def test_written_metadata_is_what_torch_builds_across_saves(tmp_path):
    # 1,200 tensors: more entries than one of the pickler's SETITEMS batches
    with core.Checkpointer() as checkpointer:
        for step in (1, 7, 30):  # objects change size between saves of one structure
            path = str(tmp_path / f"step{step}")
            checkpointer.save(_state(1200, step), path)
            written = load_dcp_metadata(path)  # our restricted unpickler admits it
            save_id = written.storage_meta.save_id
            _same(written, pickle.loads(pickle.dumps(_reference([read_sidecar(path, 0)], path, save_id))))
            _same(written, pickle.loads(open(os.path.join(path, ".metadata"), "rb").read()))
            target = _state(1200, 0)
            dcp.load(target, checkpoint_id=path)  # stock FileSystemReader: plain pickle.load
            expected = _state(1200, step)
            assert target["extra"] == expected["extra"]
            assert all(torch.equal(target["model"][k], v) for k, v in expected["model"].items())


def test_metadata_without_tensors_or_objects(tmp_path):
    for name, state in (("objects", {"only": {"objects": 3}}), ("tensors", {"w": torch.ones(2)})):
        path = str(tmp_path / name)
        core.save(state, path)
        written = load_dcp_metadata(path)
        _same(written, pickle.loads(pickle.dumps(_reference([read_sidecar(path, 0)], path, written.storage_meta.save_id))))


def test_emitter_writes_what_pickle_loads():
    values = [0, 255, 256, 65535, 65536, -1, -(1 << 31), 1 << 31, -(1 << 70), 1.5, "é\udcff", None, True, False,
              (), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), [], [1, [2]], {}, {"a": {"b": (1, "c")}}]
    for value in values:
        assert pickle.loads(dcp_pickle.dumps(value)) == value, value


def test_sharded_writer_does_not_import_torch(tmp_path):
    """The module the writer renders .metadata with imports no torch (a torch import is ~190 MiB per process)."""
    code = "import sys, asyncckpt.core.writer.shard_requests, asyncckpt.core.formats.dcp_pickle; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert dcp_classes().version == CURRENT_DCP_VERSION


def test_a_torch_whose_metadata_classes_changed_falls_back_to_its_own_pickle(tmp_path, monkeypatch, caplog):
    """If the writer's torch-free pickle does not match this torch (checked once per process), saves
    go on with a warning: rank 0's writer has a process with torch pickle torch's own objects instead
    (the writer itself still imports no torch), and loads are the same."""
    def changed():
        raise RuntimeError("its pickle of a sample loads as something else")

    monkeypatch.setattr(dcp_metadata, "_checked_dcp_classes", changed)
    dcp_classes.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="asyncckpt.core"):
            assert dcp_classes() is None
        assert "will have a process with torch pickle it" in caplog.text
        path = str(tmp_path / "fallback")
        core.save(_state(20, 3), path)
        with open(f"/proc/{core.default_checkpointer().writer_pid()}/maps") as maps:
            assert "libtorch" not in maps.read()  # a process of its own pickled it
        written = load_dcp_metadata(path)
        _same(written, _reference([read_sidecar(path, 0)], path, written.storage_meta.save_id))
        target = _state(20, 0)
        dcp.load(target, checkpoint_id=path)
        assert target["extra"] == _state(20, 3)["extra"]
    finally:
        dcp_classes.cache_clear()
