"""Bad input and damaged checkpoints produce clear errors; nothing half-written is ever loaded."""
from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch

from asyncckpt import core
from asyncckpt.core.loading.metadata_io import load_dcp_metadata
from asyncckpt.core.snapshot.dcp_metadata import write_dcp_metadata
from asyncckpt.core.storage.sidecar_io import read_rank_sidecar


@pytest.fixture()
def saved(tmp_path):
    path = str(tmp_path / "ckpt")
    state = {"w": torch.arange(4096, dtype=torch.float32), "big": torch.randn(600, 1000), "n": 3}
    core.save(state, path)
    return path, state


def target():
    return {"w": torch.zeros(4096), "big": torch.zeros(600, 1000), "n": None}


def _sidecar_item(path, fqn):
    return next(i for i in read_rank_sidecar(path, 0)["items"] if i["fqn"] == fqn)


@pytest.mark.parametrize("fqn", ["w", "big"])  # coalesced small read and zero-copy direct read
def test_checksum_mismatch_names_file_and_key(saved, fqn):
    path, state = saved
    item = _sidecar_item(path, fqn)
    with open(os.path.join(path, item["file"]), "r+b") as f:
        f.seek(item["data_start"] + 17)
        byte = f.read(1)
        f.seek(item["data_start"] + 17)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(core.CorruptCheckpointError, match=rf"__0_0\.distcp: checksum mismatch for key '{fqn}'"):
        core.load(target(), path)
    loaded = target()
    core.load(loaded, path, verify=False)  # verification can be turned off (and then it loads the damage)
    assert not torch.equal(loaded[fqn], state[fqn])


def test_truncated_and_missing_data_files_are_named(saved):
    path, _ = saved
    data = os.path.join(path, "__0_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    with pytest.raises(core.CorruptCheckpointError, match=r"__0_0\.distcp: file is truncated"):
        core.load(target(), path)
    os.unlink(data)
    with pytest.raises(core.CorruptCheckpointError, match=r"__0_0\.distcp: data file is missing"):
        core.load(target(), path)


def test_incomplete_checkpoint_is_refused_and_skipped(saved, tmp_path):
    path, _ = saved
    torn = str(tmp_path / "ckpt_torn")
    shutil.copytree(path, torn)
    os.unlink(os.path.join(torn, ".asyncckpt-commit.json"))
    with pytest.raises(core.IncompleteCheckpointError, match="ckpt_torn is incomplete"):
        core.load(target(), torn)
    assert core.latest_checkpoint(str(tmp_path)) == path


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_malicious_metadata_is_not_unpickled(saved, tmp_path):
    path, _ = saved
    marker = str(tmp_path / "pwned")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump({"payload": _Exploit(marker)}, f)
    with pytest.raises(core.UnsafeMetadataError, match=r"refusing to load '(io|builtins).open'"):
        core.load(target(), path)
    assert not os.path.exists(marker)


def test_storage_paths_may_not_escape_the_checkpoint(saved):
    path, _ = saved
    metadata = load_dcp_metadata(path)
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    write_dcp_metadata(path, metadata)
    with pytest.raises(core.UnsafeMetadataError, match="points outside the checkpoint directory"):
        core.load(target(), path)


def test_saving_over_a_committed_checkpoint_replaces_it_atomically(saved):
    path, state = saved
    newer = {"w": state["w"] + 1, "big": state["big"] * 2, "n": 4}
    core.save(newer, path)
    loaded = target()
    core.load(loaded, path)
    assert torch.equal(loaded["w"], newer["w"]) and torch.equal(loaded["big"], newer["big"]) and loaded["n"] == 4
    core.wait()  # the replaced checkpoint is deleted after the commit is reported, before wait() returns
    leftovers = [n for n in os.listdir(os.path.dirname(path)) if n.startswith(".")]
    assert leftovers == []
