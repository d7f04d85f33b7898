"""Loading without DCP's planner (``direct_load``) when nothing needs resharding, and falling back
to ``dcp.load`` when something does: same results, same errors, on real checkpoints."""
from __future__ import annotations

import base64
import json
import os
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from asyncckpt import core
from asyncckpt.core.cli import main
from asyncckpt.core.storage import commit
from asyncckpt.core.formats import names
from asyncckpt.core.loading.direct_load import plan_direct_load
from asyncckpt.core.formats.names import sidecar_name
from asyncckpt.core.storage.sidecar_io import read_rank_sidecar
from dist_helper import run_on_ranks


def mixed_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "big": torch.randn(700, 800, generator=g),  # read in pieces
            "small": torch.randn(5, 7, generator=g),  # batched reads
            "half": torch.randn(33, generator=g).to(torch.bfloat16),  # a dtype numpy cannot show
            "ids": torch.arange(10, dtype=torch.int64),
            "empty": torch.zeros(0, 4),
            "scale": torch.tensor(2.5),
        },
        "optim": {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.randn(5, 7, generator=g)}},
                  "param_groups": [{"lr": 0.01, "betas": (0.9, 0.99), "params": [0]}]},
        "step": 12,
        "name": "run-1",
    }


def blank(value):
    """Same nesting; tensors zeroed, other leaves None (so a load has to fill them)."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: blank(v) for k, v in value.items()}
    if isinstance(value, list):
        return [blank(v) for v in value]
    return None


def assert_same(loaded, expected) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(loaded, torch.Tensor) and loaded.dtype == expected.dtype and torch.equal(loaded, expected)
    elif isinstance(expected, dict):
        assert loaded.keys() == expected.keys()
        for key in expected:
            assert_same(loaded[key], expected[key])
    elif isinstance(expected, list):
        assert len(loaded) == len(expected)
        for a, b in zip(loaded, expected):
            assert_same(a, b)
    else:
        assert loaded == expected


def plan_for(target: dict, path: str, strict: bool = True, rank: int = 0):
    return plan_direct_load(target, path, commit.require_complete(path), rank=rank, strict=strict, verify=True)


@pytest.fixture()
def saved(tmp_path):
    path = str(tmp_path / "ckpt")
    state = mixed_state()
    core.save(state, path)
    return path, state


def test_plain_tensors_saved_whole_load_from_the_sidecars(saved):
    path, state = saved
    target = blank(state)
    target["model"]["big"] = torch.nn.Parameter(target["model"]["big"])  # a parameter that requires grad
    assert plan_for(blank(state), path) is not None
    version = target["model"]["big"]._version
    kept = target["model"]["small"]
    core.load(target, path)
    assert_same(target, state)
    assert target["model"]["small"] is kept  # tensors are filled in place
    assert target["model"]["big"]._version > version  # autograd sees the in-place write
    assert target["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)  # objects replaced as dcp.load does


def test_partial_load_takes_the_direct_path_and_strict_errors_come_from_dcp(saved):
    path, state = saved
    subset = {"model": {"small": torch.zeros(5, 7)}, "step": None}
    assert plan_for(subset, path) is not None
    core.load(subset, path)
    assert torch.equal(subset["model"]["small"], state["model"]["small"]) and subset["step"] == 12
    extra = {"model": {"small": torch.zeros(5, 7), "gone": torch.zeros(2)}}
    assert plan_for(extra, path) is None
    with pytest.raises(core.StateDictMismatchError, match=r"missing.*\['model.gone'\]"):
        core.load(extra, path)
    core.load(extra, path, strict=False)
    assert torch.equal(extra["model"]["small"], state["model"]["small"])


@pytest.mark.parametrize("case", ["transposed", "dtype", "shape", "object-for-tensor"])
def test_targets_the_direct_path_cannot_fill_go_through_dcp(saved, case):
    path, state = saved
    target = blank(state)
    if case == "transposed":  # not contiguous: dcp.load copies into the view
        target["model"]["small"] = torch.zeros(7, 5).t()
        assert plan_for(target, path) is None
        core.load(target, path)
        assert_same(target, state)
        return
    if case == "dtype":
        target["model"]["small"] = torch.zeros(5, 7, dtype=torch.float64)
        message = r"'model.small': checkpoint dtype torch.float32 vs state dict dtype torch.float64"
    elif case == "shape":
        target["model"]["small"] = torch.zeros(7, 5)
        message = r"'model.small': checkpoint shape \(5, 7\) vs state dict shape \(7, 5\)"
    else:
        target["step"] = torch.zeros(1)
        message = r"'step': checkpoint holds an object, state dict expects a tensor"
    assert plan_for(target, path) is None
    before = target["model"]["big"].clone()
    with pytest.raises(core.StateDictMismatchError, match=message):
        core.load(target, path)
    assert torch.equal(target["model"]["big"], before)  # a refused load writes nothing


def test_tied_weights_load_once_and_stay_tied(tmp_path):
    path = str(tmp_path / "ckpt")
    embed = torch.randn(50, 8)
    core.save({"embed.weight": embed, "lm_head.weight": embed, "bias": torch.randn(8)}, path)
    shared = torch.zeros(50, 8)
    target = {"embed.weight": shared, "lm_head.weight": shared, "bias": torch.zeros(8)}
    assert plan_for(target, path) is not None
    core.load(target, path)
    assert target["embed.weight"] is shared and torch.equal(shared, embed)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_tied_targets_from_untied_values_keep_dcp_semantics(tmp_path):
    path = str(tmp_path / "ckpt")
    core.save({"a": torch.full((64,), 1.0), "b": torch.full((64,), 2.0)}, path)
    shared = torch.zeros(64)
    target = {"a": shared, "b": shared}
    assert plan_for(target, path) is None  # parallel reads would race: dcp.load decides, key by key
    core.load(target, path)
    reference = torch.zeros(64)
    dcp.load({"a": reference, "b": reference}, checkpoint_id=path, no_dist=True)
    assert torch.equal(shared, reference)


class Counter:
    """A Stateful value (DCP's protocol): its state is asked for, then given back."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.restored = False

    def state_dict(self) -> dict:
        return {"count": self.count, "weights": torch.full((3,), float(self.count))}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.restored = state["count"], True
        assert torch.equal(state["weights"], torch.full((3,), float(self.count)))


def test_stateful_values_are_given_back_through_load_state_dict(tmp_path):
    path = str(tmp_path / "ckpt")
    core.save({"counter": Counter(7), "w": torch.ones(4)}, path)
    counter = Counter(0)
    target = {"counter": counter, "w": torch.zeros(4)}
    core.load(target, path)
    assert counter.restored and counter.count == 7 and target["counter"] is counter
    assert torch.equal(target["w"], torch.ones(4))


def _older_sidecar(path: str, version: int) -> dict:
    """Rank 0's sidecar as ``version`` wrote it: 1, an object per item; 2, columns of JSON numbers and dtype names
    (docs/FORMAT.md §3, where version 3 packs them)."""
    if version == 1:
        document = read_rank_sidecar(path, 0)
    else:
        with open(os.path.join(path, sidecar_name(0))) as f:
            document = json.load(f)
        for columns in (document["tensors"], document["objects"]):
            for field, value in list(columns.items()):
                if field != "file" and isinstance(value, str):  # a packed column: little-endian int64s
                    raw = base64.b64decode(value)
                    columns[field] = list(struct.unpack(f"<{len(raw) // 8}q", raw))
        tensors = document["tensors"]
        tensors["dtype"] = [tensors["dtypes"][index] for index in tensors["dtype"]]
        del tensors["dtypes"]
    document["version"] = version
    return document


@pytest.mark.parametrize("version", [1, 2])
def test_older_sidecars_still_load_and_verify(saved, version):
    path, state = saved
    item = next(i for i in read_rank_sidecar(path, 0)["items"] if i["fqn"] == "model.small")
    older = _older_sidecar(path, version)
    with open(os.path.join(path, sidecar_name(0)), "w") as f:
        json.dump(older, f)
    with open(os.path.join(path, names.COMMIT_RECORD)) as f:
        record = json.load(f)
    record["files"][sidecar_name(0)] = os.path.getsize(os.path.join(path, sidecar_name(0)))
    with open(os.path.join(path, names.COMMIT_RECORD), "w") as f:
        json.dump(record, f)  # as if that save had written the older sidecar
    assert read_rank_sidecar(path, 0)["version"] == version
    target = blank(state)
    assert plan_for(target, path) is not None
    core.load(target, path)
    assert_same(target, state)
    assert main.main(["verify", path, "--no-progress"]) == main.EXIT_OK
    with open(os.path.join(path, item["file"]), "r+b") as f:
        f.seek(item["data_start"] + 3)
        f.write(b"\xff")
    with pytest.raises(core.CorruptCheckpointError, match=r"__0_0\.distcp: checksum mismatch for key 'model.small'"):
        core.load(blank(state), path)


@pytest.mark.parametrize("damage", ["start", "shapes", "lengths"])
def test_a_malformed_sidecar_is_named(saved, damage):
    path, state = saved
    name = os.path.join(path, sidecar_name(0))
    with open(name) as f:
        document = json.load(f)
    tensors = document["tensors"]
    if damage == "start":
        tensors["start"] = tensors["start"][:-4]  # no longer whole int64s
    elif damage == "shapes":  # the first chunk's size: an index past the shapes table
        raw = base64.b64decode(tensors["chunk_sizes"])
        tensors["chunk_sizes"] = base64.b64encode(struct.pack("<q", len(tensors["shapes"])) + raw[8:]).decode()
    else:
        tensors["xxh3"].pop()
    with open(name, "w") as f:
        json.dump(document, f)
    with pytest.raises(core.CorruptCheckpointError, match=rf"{sidecar_name(0)}: malformed sidecar"):
        core.load(blank(state), path)


def test_a_replaced_metadata_file_is_not_trusted_blindly(saved):
    """The sidecars stand in for ``.metadata`` only when it is the one the commit record lists."""
    path, state = saved
    with open(os.path.join(path, ".metadata"), "ab") as f:
        f.write(b"\0")
    assert plan_for(blank(state), path) is None  # so the restricted unpickler reads it (and copes)
    target = blank(state)
    core.load(target, path)
    assert_same(target, state)


def _load_on_ranks(rank, world, path, damaged):
    """Each rank loads its own half of the keys (a partial load), so only one rank reads a given key."""
    state = {f"t{i}": torch.zeros(1 << 16) for i in range(6) if i % 2 == rank}
    if damaged is not None:
        with pytest.raises(core.CorruptCheckpointError, match=rf"__1_0\.distcp: checksum mismatch for key '{damaged}'"):
            core.load(state, path)
    else:
        assert plan_for(state, path, rank=rank) is not None
        core.load(state, path)
        assert all(torch.equal(value, torch.full((1 << 16,), float(key[1:]))) for key, value in state.items())
    core.default_checkpointer().close()


def _save_on_ranks(rank, world, path):
    core.save({f"t{i}": torch.full((1 << 16,), float(i)) for i in range(6)}, path)
    core.default_checkpointer().close()


def test_two_ranks_load_directly_and_a_damaged_share_fails_every_rank(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_save_on_ranks, 2, path)  # replicated: each rank writes about half of the tensors
    run_on_ranks(_load_on_ranks, 2, path, None)
    item = read_rank_sidecar(path, 1)["items"][0]
    with open(os.path.join(path, item["file"]), "r+b") as f:
        f.seek(item["data_start"])
        f.write(b"\x01\x02\x03")
    run_on_ranks(_load_on_ranks, 2, path, item["fqn"])  # one rank reads the damage; both raise it


def _save_own_keys(rank, world, path):
    core.save({f"rank{rank}.t{i}": torch.full((1 << 12,), float(10 * rank + i)) for i in range(3)}, path)
    core.default_checkpointer().close()


def _load_own_keys(rank, world, path):
    state = {f"rank{rank}.t{i}": torch.zeros(1 << 12) for i in range(3)}
    if rank == 1:
        with pytest.raises(core.CorruptCheckpointError, match=rf"{sidecar_name(1)}: unreadable sidecar"):
            core.load(state, path, use_collectives=False)
    else:
        assert plan_for(state, path, rank=rank) is not None
        core.load(state, path, use_collectives=False)
        assert all(torch.equal(value, torch.full((1 << 12,), float(10 * rank + int(key[-1])))) for key, value in state.items())
    core.default_checkpointer().close()


def test_a_rank_that_saved_its_own_keys_reads_its_own_sidecar_alone(tmp_path):
    """A restart of rank-local state: each rank's keys are in its own sidecar, so the other ranks' are not parsed
    (rank 0 loads while rank 1's sidecar is unreadable; rank 1's load names it)."""
    path = str(tmp_path / "ckpt")
    run_on_ranks(_save_own_keys, 2, path)
    with open(os.path.join(path, sidecar_name(1)), "r+b") as f:
        f.write(b"\x00")
    run_on_ranks(_load_own_keys, 2, path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_our_storage_reader_under_stock_dcp_load(saved, tmp_path):
    """``dcp.load(storage_reader=AsyncCkptStorageReader(path))``: whole chunks read in place,
    narrowed or non-contiguous targets through temporaries, checksums verified, and plain DCP
    checkpoints (no sidecars) read through ``torch.load``."""
    path, state = saved
    target = blank(state)
    target["model"]["small"] = torch.zeros(7, 5).t()  # staged: copied from a temporary
    dcp.load(target, storage_reader=core.AsyncCkptStorageReader(path), no_dist=True)
    assert_same(target, state)

    item = next(i for i in read_rank_sidecar(path, 0)["items"] if i["fqn"] == "model.big")
    with open(os.path.join(path, item["file"]), "r+b") as f:
        f.seek(item["data_start"] + 1000)
        f.write(b"\x00\x01")
    with pytest.raises(CheckpointException, match=r"__0_0\.distcp: checksum mismatch for key 'model.big'"):
        dcp.load(blank(state), storage_reader=core.AsyncCkptStorageReader(path), no_dist=True)

    plain = str(tmp_path / "plain_dcp")
    dcp.save(state, checkpoint_id=plain, no_dist=True)  # torch's FileSystemWriter: no sidecars, no commit record
    target = blank(state)
    target["model"]["small"] = torch.zeros(7, 5).t()
    dcp.load(target, storage_reader=core.AsyncCkptStorageReader(plain, require_commit=False), no_dist=True)
    assert_same(target, state)
