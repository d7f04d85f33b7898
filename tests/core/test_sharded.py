"""Sharded save and resharding load on real multi-process gloo groups."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from asyncckpt import core
from asyncckpt.core.storage.backend import backend_for, exists
from dist_helper import run_on_ranks


def full_tensor(name: str, shape=(8, 12)) -> torch.Tensor:
    """Deterministic reference values, the same on every rank and run."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g)


def sharded_state(world: int, placement, mesh_shape=None):
    mesh = init_device_mesh("cpu", mesh_shape or (world,))
    placements = placement if isinstance(placement, list) else [placement]
    return {
        "model": {
            "w": distribute_tensor(full_tensor("w"), mesh, placements),
            "b": distribute_tensor(full_tensor("b", (12,)), mesh, [Replicate()] * len(placements)),
        },
        "plain": full_tensor("plain", (5, 3)),
        "step": 7,
        "meta": {"name": "run", "lrs": [0.1, 0.2]},
    }


def empty_like_state(state):
    def blank(v):
        if isinstance(v, DTensor):
            return distribute_tensor(torch.zeros(v.shape, dtype=v.dtype), v.device_mesh, v.placements)
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: blank(x) for k, x in v.items()}
        return None
    return blank(state)


def assert_state_matches_reference(state):
    def full(v):
        return v.full_tensor() if isinstance(v, DTensor) else v
    assert torch.equal(full(state["model"]["w"]), full_tensor("w"))
    assert torch.equal(full(state["model"]["b"]), full_tensor("b", (12,)))
    assert torch.equal(state["plain"], full_tensor("plain", (5, 3)))
    assert state["step"] == 7 and state["meta"] == {"name": "run", "lrs": [0.1, 0.2]}


def plain_state():
    return {"model": {"w": full_tensor("w"), "b": full_tensor("b", (12,))}, "plain": full_tensor("plain", (5, 3)),
            "step": 7, "meta": {"name": "run", "lrs": [0.1, 0.2]}}


def _save(rank, world, path, placement):
    """Save the reference state: sharded by ``placement``, or as plain tensors where it is None."""
    core.save(plain_state() if placement is None else sharded_state(world, placement), path)
    core.default_checkpointer().close()
    return sorted(os.listdir(path))


def _load(rank, world, path, placement):
    target = empty_like_state(sharded_state(world, placement))
    core.load(target, path)
    assert_state_matches_reference(target)
    core.default_checkpointer().close()


def _run_steps(rank, world, steps):
    """Run (case, step, path, placement) steps in order on this group, naming the case that fails."""
    for case, step, path, placement in steps:
        try:
            step(rank, world, path, placement)
        except Exception as error:
            raise AssertionError(f"resharding case {case}: {step.__name__} on {world} rank(s) failed") from error


# case: (ranks that save, placement or None for plain tensors), (ranks that load, placement or None)
RESHARDING = {
    "1to2": ((1, None), (2, Shard(0))),
    "2to1": ((2, Shard(0)), (1, None)),
    "2to2-Shard0-to-Shard1": ((2, Shard(0)), (2, Shard(1))),
    "4to2": ((4, Shard(1)), (2, Shard(0))),
    "replicated-to-sharded": ((2, None), (2, Shard(1))),
}


def test_resharding_load(tmp_path):
    """Every case saves on one group size and loads on another; one launch per group size runs all its steps
    (each launch starts its ranks and process group once), the saves of a size before its loads."""
    paths = {case: str(tmp_path / case) for case in RESHARDING}
    saves = {world: [(case, _save, paths[case], placement)
                     for case, ((w, placement), _) in RESHARDING.items() if w == world] for world in (1, 2, 4)}
    loads = [(case, _load, paths[case], placement) for case, (_, (w, placement)) in RESHARDING.items() if w == 2]
    run_on_ranks(_run_steps, 1, saves[1])
    run_on_ranks(_run_steps, 4, saves[4])
    run_on_ranks(_run_steps, 2, saves[2] + loads)
    for case, path in paths.items():
        assert core.is_complete(path), case
    for case, (_, (load_world, _)) in RESHARDING.items():
        if load_world == 1:
            target = {"model": {"w": torch.zeros(8, 12), "b": torch.zeros(12)}, "plain": torch.zeros(5, 3),
                      "step": None, "meta": {"name": None, "lrs": None}}
            core.load(target, paths[case])
            assert_state_matches_reference(target)


def _save_replicated(rank, world, path, n_tensors, numel):
    state = {f"t{i}": full_tensor(f"t{i}", (numel,)) for i in range(n_tensors)}
    core.save(state, path)
    core.default_checkpointer().close()


def test_replicated_bytes_are_spread_across_ranks(tmp_path):
    path = str(tmp_path / "ckpt")
    run_on_ranks(_save_replicated, 2, path, 16, 1 << 18)  # 16 MiB replicated
    sizes = [os.path.getsize(os.path.join(path, f"__{r}_0.distcp")) for r in range(2)]
    total = sum(sizes)
    assert total >= 16 << 20
    assert all(0.4 < s / total < 0.6 for s in sizes), sizes
    target = {f"t{i}": torch.zeros(1 << 18) for i in range(16)}
    core.load(target, path)
    assert all(torch.equal(target[f"t{i}"], full_tensor(f"t{i}", (1 << 18,))) for i in range(16))


def _save_and_load_without_torch_dedup(rank, world, path):
    import logging

    from asyncckpt.core.snapshot import planner

    planner.dedup_save_plans = None  # as in a torch that moved its private dedup: the public planner's is used
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("asyncckpt").addHandler(handler)
    _save(rank, world, path, Shard(0))
    _load(rank, world, path, Shard(1))
    _stock_dcp_load(rank, world, path)  # torch's own reader agrees
    return messages


def test_sharded_save_falls_back_to_the_public_planner_where_torch_moved_its_dedup(tmp_path):
    messages = run_on_ranks(_save_and_load_without_torch_dedup, 2, str(tmp_path / "ckpt"))
    assert any("DefaultSavePlanner" in m for m in messages[0]), messages  # rank 0 plans globally


def _stock_dcp_load(rank, world, path):
    target = empty_like_state(sharded_state(world, Shard(0)))
    dcp.load(target, checkpoint_id=path)  # torch's own FileSystemReader
    assert_state_matches_reference(target)


def _save_then_stock_dcp_load(rank, world, path):
    _save(rank, world, path, Shard(1))
    _stock_dcp_load(rank, world, path)


def test_stock_dcp_reader_loads_our_sharded_checkpoint(tmp_path):
    run_on_ranks(_save_then_stock_dcp_load, 2, str(tmp_path / "ckpt"))


def _plan_cache_scenario(rank, world, root):
    ckpt = core.Checkpointer()
    base = {"a": torch.full((64,), float(rank)), "b": torch.arange(10)}
    ckpt.save(base, f"{root}/s0")
    ckpt.save(base, f"{root}/s1")
    warm_hits = ckpt._parts.sharded.plan_cache.hits
    # Only rank 1 changes its structure: every rank must re-plan, nobody may reuse a stale plan.
    changed = dict(base, extra=torch.ones(3)) if rank == 1 else dict(base, a=base["a"].clone())
    ckpt.save(changed, f"{root}/s2")
    hits_after_change = ckpt._parts.sharded.plan_cache.hits
    ckpt.close()
    return warm_hits, hits_after_change


def test_plan_cache_is_reused_and_invalidated_on_all_ranks(tmp_path):
    outcome = run_on_ranks(_plan_cache_scenario, 2, str(tmp_path), timeout=120)
    assert outcome == [(1, 1), (1, 1)]  # one warm hit each; the one-rank change missed on both ranks
    target = {"a": torch.zeros(64), "b": torch.zeros(10, dtype=torch.int64), "extra": torch.zeros(3)}
    core.load(target, str(tmp_path / "s2"))
    assert torch.equal(target["extra"], torch.ones(3)) and torch.equal(target["b"], torch.arange(10))


def _no_collectives(rank, world, path):
    assert not dist.is_initialized()
    core.save({"w": full_tensor("w"), "step": 3}, path, use_collectives=False)
    target = {"w": torch.zeros(8, 12), "step": None}
    core.load(target, path, use_collectives=False)
    assert torch.equal(target["w"], full_tensor("w")) and target["step"] == 3
    core.default_checkpointer().close()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_use_collectives_false_needs_no_process_group(tmp_path, where, request):
    """The ranks meet by markers: files in the staging directory, or objects in the bucket."""
    root = str(tmp_path) if where == "local" else request.getfixturevalue("s3_root")
    path = f"{root}/ckpt"
    run_on_ranks(_no_collectives, 2, path, init_process_group=False)
    assert core.is_complete(path)
    assert exists(backend_for(path), f"{path}/__1.asyncckpt.json")
    left = [name for name in backend_for(path).names(path)
            if name.startswith(".asyncckpt-") and name != ".asyncckpt-commit.json" or name.endswith(".done")]
    assert left == [], left  # no marker (or owner marker) left behind


def test_partial_and_strict_load(tmp_path):
    path = str(tmp_path / "ckpt")
    core.save({"a": torch.arange(6.0), "b": torch.ones(2, 2), "n": 4}, path)
    subset = {"a": torch.zeros(6)}
    core.load(subset, path)
    assert torch.equal(subset["a"], torch.arange(6.0))
    with pytest.raises(core.StateDictMismatchError, match=r"missing.*\['x', 'y'\]"):
        core.load({"a": torch.zeros(6), "x": torch.zeros(1), "y": 1}, path)
    relaxed = {"a": torch.zeros(6), "x": torch.zeros(1)}
    core.load(relaxed, path, strict=False)
    assert torch.equal(relaxed["a"], torch.arange(6.0)) and torch.equal(relaxed["x"], torch.zeros(1))
    with pytest.raises(core.StateDictMismatchError, match=r"'b': checkpoint shape \(2, 2\) vs state dict shape \(4,\)"):
        core.load({"b": torch.zeros(4)}, path)
    with pytest.raises(core.StateDictMismatchError, match=r"'b': checkpoint dtype torch.float32 vs state dict dtype torch.float16"):
        core.load({"b": torch.zeros(2, 2, dtype=torch.float16)}, path)
