"""Our fast flattening must produce exactly torch's keys (the load side uses torch's)."""
from __future__ import annotations

import argparse

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict as torch_flatten

from asyncckpt.core.snapshot.structure import describe, flatten_state_dict, tied_keys


def test_flatten_matches_torch_on_awkward_nesting():
    state = {
        "a": torch.ones(2),
        "b": {"c": [torch.ones(1), "x", {"d": 3}], "e": [1, 2, 3], "f": (torch.ones(1),), "g": [[1, 2], [torch.ones(1)]],
              "h": {}, "i": [{}], "j": []},
        3: "int key",
        "ns": argparse.Namespace(a=1),
        "optim": {"state": {0: {"exp_avg": torch.zeros(3), "step": torch.tensor(1.0)}},
                  "param_groups": [{"lr": 0.1, "params": [0]}]},
    }
    ours, our_paths = flatten_state_dict(state)
    theirs, their_paths = torch_flatten(state)
    assert list(ours) == list(theirs) and our_paths == their_paths
    assert all(ours[k] is theirs[k] for k in ours)


def test_description_tracks_shapes_dtypes_and_tied_tensors():
    weight = torch.randn(4, 3)
    tied = {"embed": weight, "head": weight.detach(), "square_t": torch.zeros(3, 3)}
    description = describe(tied)
    assert tied_keys(description) == {"head": "embed"}
    assert describe({"embed": weight, "head": weight.clone(), "square_t": torch.zeros(3, 3)}) != description
    square = torch.zeros(3, 3)
    assert tied_keys(describe({"a": square, "b": square.t()})) == {}  # same address, different view: not tied
    assert describe({"x": torch.zeros(2)}) != describe({"x": torch.zeros(2, dtype=torch.float16)})
    assert describe({"x": torch.zeros(2)}) == describe({"x": torch.ones(2)})
