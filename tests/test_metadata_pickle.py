"""The per-structure ``.metadata`` template gives the same Metadata as pickling it whole."""
import os
import pickle

import torch
import torch.distributed.checkpoint as dcp

from asyncckpt import core
from asyncckpt.core.metadata_io import build_dcp_metadata, dcp_metadata_bytes, load_dcp_metadata
from asyncckpt.core.sidecar import read_sidecar


def _state(n_tensors: int, step: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    params = {f"layer{i}.weight": torch.randn(1 + i % 7, 3, generator=generator) for i in range(n_tensors)}
    return {
        "model": params,
        "extra": {"step": step, "name": "x" * step, "groups": [{"lr": 0.1 * step, "params": list(range(step))}]},
    }


def _same(a, b) -> None:
    assert a == b  # dataclass equality: every field, every entry
    keys_a = [(k.fqn, tuple(k.offset or ()), k.index) for k in a.storage_data]
    keys_b = [(k.fqn, tuple(k.offset or ()), k.index) for k in b.storage_data]
    assert keys_a == keys_b  # MetadataIndex equality ignores .index; the reader uses it
    assert list(a.state_dict_metadata) == list(b.state_dict_metadata)


def test_template_matches_whole_pickle_across_saves(tmp_path):
    # 1,200 tensors: the dicts cross the pickler's 1,000-entry SETITEMS batches
    with core.Checkpointer() as checkpointer:
        for step in (1, 7, 30):  # objects change size between saves of one structure
            path = str(tmp_path / f"step{step}")
            checkpointer.save(_state(1200, step), path)
            sidecars = [read_sidecar(path, 0)]
            reference = build_dcp_metadata(sidecars, path, "save-id")
            data = dcp_metadata_bytes(sidecars, path, "save-id")
            _same(pickle.loads(data), reference)
            _same(pickle.loads(data), pickle.loads(pickle.dumps(reference)))
            # what the checkpoint holds is what torch's reader and ours read back
            _same(load_dcp_metadata(path), pickle.loads(open(os.path.join(path, ".metadata"), "rb").read()))
            target = _state(1200, 0)
            dcp.load(target, checkpoint_id=path)  # stock FileSystemReader: plain pickle.load
            expected = _state(1200, step)
            assert target["extra"] == expected["extra"]
            assert all(torch.equal(target["model"][k], v) for k, v in expected["model"].items())


def test_template_without_tensors_or_objects(tmp_path):
    for state in ({"only": {"objects": 3}}, {"w": torch.ones(2)}):
        path = str(tmp_path / f"case{len(state)}{next(iter(state))}")
        core.save(state, path)
        sidecars = [read_sidecar(path, 0)]
        _same(pickle.loads(dcp_metadata_bytes(sidecars, path, "s")), build_dcp_metadata(sidecars, path, "s"))
