"""kill -9 in the middle of saving: the previous checkpoint stays loadable, no orphan writer."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch

from asyncckpt import core
from processes import Program
from writers import wait_until_gone

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")


def _run_and_kill(root: str, mode: str, kill_after_submitted: int) -> int:
    proc = Program([sys.executable, os.path.join(HERE, "crash_writer.py"), root, mode], f"{root}.logs")
    try:
        proc.wait_for_line(f"submitted {kill_after_submitted}", timeout=300)  # 3 x 192 MiB: minutes on a loaded disk
        time.sleep(0.15)  # inside the next save: snapshot taken, writer busy
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    return proc.pid


def _assert_consistent(path: str) -> int:
    state = {f"layer{i}.weight": torch.empty(4 << 20) for i in range(12)}
    state["step"] = None
    core.load(state, path)
    step = state["step"]
    for i in range(12):
        values = state[f"layer{i}.weight"]
        assert torch.all(values == float(step)), f"{path}: layer{i} holds {values.unique()[:4]} at step {step}"
    return step


def _assert_no_orphan(pid: int) -> None:
    wait_until_gone(pid, timeout=10, what="background writer survived its killed parent")


def test_kill_mid_save_keeps_last_complete_checkpoint(tmp_path):
    root = str(tmp_path)
    pid = _run_and_kill(root, "steps", kill_after_submitted=3)
    _assert_no_orphan(pid)
    latest = core.latest_checkpoint(root)
    assert latest is not None
    step = _assert_consistent(latest)
    assert latest.endswith(f"step_{step:06d}")
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if core.is_complete(path):
            _assert_consistent(path)
        else:  # the torn save: never picked by latest_checkpoint, refused by load
            with pytest.raises((core.IncompleteCheckpointError, FileNotFoundError)):
                core.load({"step": None}, path)


def test_kill_while_overwriting_same_path_keeps_old_checkpoint(tmp_path):
    root = str(tmp_path)
    pid = _run_and_kill(root, "same", kill_after_submitted=3)
    _assert_no_orphan(pid)
    path = os.path.join(root, "ckpt")
    assert core.is_complete(path)
    assert _assert_consistent(path) >= 1
