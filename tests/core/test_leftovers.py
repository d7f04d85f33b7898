"""What crashed saves leave, for every naming the adapters and the core use: recognised as ours,
judged by whether its writer lives (not by age), removed by the next save into the same directory
and by ``asyncckpt clean``, never while its writer lives.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncckpt import core
from asyncckpt.core.storage import leftovers, owners
from asyncckpt.core.formats import names

# (what crashed, hidden entry it left): every naming the adapters and the core save under
CRASHED = {
    "save_state(dir)": (".step_12.asyncckpt-staging-{id}", "dir"),  # Accelerate, explicit output_dir
    "checkpoint_N": (".checkpoint_3.asyncckpt-staging-{id}", "dir"),  # Accelerate, automatic naming
    "checkpoint-N": (".checkpoint-40.asyncckpt-staging-{id}", "dir"),  # the Trainer
    "sharded dir": (".last.ckpt.asyncckpt-staging-{id}", "dir"),  # Lightning FSDP/ModelParallel, core.save
    ".ckpt file": (".epoch=0-step=10.ckpt.asyncckpt-tmp-{token}", "file"),  # Lightning, single files
    "symlink": (".last.ckpt.asyncckpt-link-{token}", "link"),  # Lightning save_last="link"
    "removal": (".checkpoint-30.asyncckpt-removing-{token}", "dir"),  # a rotation's deletion
}


def _token_of_a_process_that_exited() -> str:
    return subprocess.run([sys.executable, "-c", "from asyncckpt.core.storage.owners import owner_token; print(owner_token())"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _leave(parent: Path, pattern: str, shape: str, token: str) -> Path:
    path = parent / pattern.format(id="d7-ab12cd34", token=token)
    if shape == "dir":
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"\0" * 100)  # half written
        if "staging" in path.name:
            (path / names.owner_marker_name(0)).write_text(token)
    elif shape == "file":
        path.write_bytes(b"PK\3\4 half of a torch.save file")
    else:
        os.symlink("epoch=0-step=10.ckpt", path)
    return path


@pytest.fixture(scope="module")
def dead_token() -> str:
    return _token_of_a_process_that_exited()


@pytest.mark.parametrize("crashed", list(CRASHED))
def test_the_next_save_into_the_directory_removes_a_dead_writers_leftover(tmp_path, dead_token, crashed):
    pattern, shape = CRASHED[crashed]
    leftover = _leave(tmp_path, pattern, shape, dead_token)
    live = _leave(tmp_path, ".step_13.asyncckpt-staging-{id}", "dir", owners.owner_token())  # this process: alive
    assert [e.alive for e in leftovers.find(str(tmp_path))] == [False, True]
    with core.Checkpointer() as checkpointer:
        if shape == "dir":
            with checkpointer.begin_directory(tmp_path / "checkpoint-41") as tx:
                tx.write_bytes("trainer_state.json", b"{}")
                tx.commit().result()
        else:
            checkpointer.save_file({"w": torch.ones(3)}, tmp_path / "epoch=0-step=20.ckpt")
        checkpointer.wait()  # the writer tidies after its replies
    assert not os.path.lexists(leftover), os.listdir(tmp_path)
    assert live.is_dir()  # a live writer's staging directory is never taken, however old


def test_clean_removes_every_kind_of_dead_leftover_at_once_and_keeps_live_ones(tmp_path, dead_token):
    for pattern, shape in CRASHED.values():
        _leave(tmp_path, pattern, shape, dead_token)
    live = _leave(tmp_path, ".step_13.asyncckpt-staging-{id}", "dir", owners.owner_token())
    os.utime(live, (1, 1))  # ancient, but its writer lives
    result = subprocess.run([sys.executable, "-m", "asyncckpt.core.cli.main", "clean", str(tmp_path)], capture_output=True,
                            text=True, check=True)
    assert sorted(os.listdir(tmp_path)) == [live.name], result.stdout
    assert f"in {len(CRASHED)} entries" in result.stdout and "in use by a live writer" in result.stdout
