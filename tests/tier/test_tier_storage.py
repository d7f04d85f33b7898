"""The memory tier's place on a node (``tier``): which memory checkpoints a run directory holds,
retention, capacity, and run directories whose job is gone.

Real files under a memory root in ``tmp_path`` (``ASYNCCKPT_MEMORY_ROOT``, as a test "node" sets it), real
checkpoints written by the core into it, real processes for owners (killed with SIGKILL), and, where this
machine lets a test mount one, a real tmpfs for capacity.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncckpt import core
from asyncckpt.core.formats import names
from asyncckpt.core.storage import owners, removal, spares
from asyncckpt.core import tier
from asyncckpt.core.storage.backend import at_once
from processes import Program

MiB = 1 << 20
HOUR = 3600.0


def state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": {"weight": torch.randn(64, 32)}, "step": seed}


@pytest.fixture
def memory_root(tmp_path, monkeypatch) -> Path:
    """This test's "node": its memory root, as a launcher of several nodes on one machine sets it."""
    root = tmp_path / "shm"
    monkeypatch.setenv(tier.MEMORY_ROOT_ENV, str(root))
    return root


@pytest.fixture
def run(memory_root, tmp_path) -> Path:
    """The run directory of the durable root ``tmp_path/ckpt`` on this node."""
    return Path(tier.open_run(str(tmp_path / "ckpt")))


def backdate(directory: Path, seconds: float) -> None:
    """Make ``directory`` and everything directly in it look unchanged for ``seconds``: time passing."""
    then = time.time() - seconds
    for path in [directory, *directory.iterdir()]:
        os.utime(path, (then, then), follow_symlinks=False)


# ------------------------------------------------------------------------------------------- the place
def test_a_durable_root_has_one_run_directory_however_it_is_spelled(memory_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    directory = tier.open_run("ckpt/")

    assert tier.run_dir(str(tmp_path / "ckpt")) == directory == tier.open_run(str(tmp_path / "ckpt"))
    assert os.path.dirname(directory) == str(memory_root)
    assert tier.durable_root_of(directory) == str(tmp_path / "ckpt")
    assert tier.run_dir(str(tmp_path / "other" / "ckpt")) != directory
    assert [found.path for found in tier.runs(str(memory_root))] == [directory]


# ------------------------------------------------------------------------------------------- listing
def test_memory_checkpoints_are_the_committed_ones_newest_first(run):
    with core.Checkpointer() as checkpointer:
        for step in (10, 30, 20):
            checkpointer.save(state(step), run / f"step_{step:06d}", step=step)
        checkpointer.save_file(state(40), run / "epoch=0-step=40.ckpt")
        checkpointer.save(state(50), run / "step_000050", step=50)
    (run / "step_000050" / names.COMMIT_RECORD).unlink()  # a save that never committed
    shutil.copytree(run / "step_000050", names.staging_dir_for(str(run / "step_000060"), "0123abcd"))

    found = tier.memory_checkpoints(str(run))

    assert [(c.name, c.step) for c in found] == [("epoch=0-step=40.ckpt", 40), ("step_000030", 30),
                                                ("step_000020", 20), ("step_000010", 10)]
    assert all(c.complete for c in found)
    newest_directory = found[1]
    on_disk = sum(p.stat().st_size for p in (run / "step_000030").iterdir())
    assert newest_directory.bytes_here == on_disk and newest_directory.path == str(run / "step_000030")
    assert newest_directory.record["step"] == 30 and set(newest_directory.record["files"]) <= set(os.listdir(run / "step_000030"))
    assert found[0].record is None and found[0].checksum.size == found[0].bytes_here == (run / "epoch=0-step=40.ckpt").stat().st_size
    assert found[1].committed_at > found[3].committed_at


def test_a_node_holding_part_of_a_checkpoint_says_which_files_it_lacks(run):
    with core.Checkpointer() as checkpointer:
        checkpointer.save(state(10), run / "step_000010", step=10)
        checkpointer.save_file(state(20), run / "last.ckpt")
    (record,) = [c.record for c in tier.memory_checkpoints(str(run)) if c.name == "step_000010"]
    data, objects = names.data_file_name(0), names.objects_file_name(0)
    (run / "step_000010" / objects).unlink()
    with open(run / "step_000010" / data, "r+b") as f:
        f.truncate(record["files"][data] - 1)
    with open(run / "last.ckpt", "ab") as f:
        f.write(b"grown")

    by_name = {c.name: c for c in tier.memory_checkpoints(str(run))}

    assert by_name["step_000010"].missing == tuple(sorted((data, objects))) and not by_name["step_000010"].complete
    assert by_name["last.ckpt"].missing == ("last.ckpt",) and by_name["last.ckpt"].step is None


def test_a_run_directory_that_is_not_there_holds_nothing(memory_root):
    assert tier.memory_checkpoints(str(memory_root / "nothing")) == []
    assert tier.runs(str(memory_root)) == [] and tier.orphaned_runs(str(memory_root), 0) == []


# ------------------------------------------------------------------------------------------- retention
def test_retention_removes_all_but_the_newest_keep_with_the_removal_machinery(run):
    with core.Checkpointer() as checkpointer:
        for step in (1, 2, 3, 4):
            checkpointer.save(state(step), run / f"step_{step:06d}", step=step)

    assert tier.stale(str(run), 0) == tier.stale(str(run), 1)  # the newest stays, whatever keep says
    assert tier.stale(str(run), 10) == []
    removal.remove(tier.stale(str(run), 2), owners.owner_token(), at_once)

    assert [c.name for c in tier.memory_checkpoints(str(run))] == ["step_000004", "step_000003"]
    assert sorted(os.listdir(run)) == sorted([tier.RUN_RECORD, "step_000003", "step_000004"])


def test_retention_keeps_only_large_files_nobody_else_links_to_as_spares(run, tmp_path):
    """What the memory tier's retention drops (``spares.recycle``) leaves every listing at once; its large files
    become spares, its small ones and one that another name links to (someone kept it) are not written over."""
    dropped = run / "step_000001"
    (dropped / "sub").mkdir(parents=True)
    large, kept, small = os.urandom(spares.MIN_BYTES + 8192), os.urandom(spares.MIN_BYTES), b"x" * 100
    (dropped / "sub" / "large.bin").write_bytes(large)
    (dropped / "kept.bin").write_bytes(kept)
    (dropped / "small.bin").write_bytes(small)
    os.link(dropped / "kept.bin", run / "someone-kept-this.bin")
    spares.recycle([str(dropped)], str(run), owners.owner_token())

    assert not dropped.exists() and not [n for n in os.listdir(run) if names.is_hidden(n)]
    [spare] = os.listdir(run / spares.SPARES_DIR)
    assert (run / spares.SPARES_DIR / spare).read_bytes() == large
    assert (run / "someone-kept-this.bin").read_bytes() == kept and os.stat(run / "someone-kept-this.bin").st_nlink == 1
    assert spares.take(str(run / "next" / "data.bin"), spares.MIN_BYTES + 8193) is None  # none large enough
    (run / "next").mkdir()
    os.close(spares.take(str(run / "next" / "data.bin"), spares.MIN_BYTES + 4096))  # cut to its size
    assert (run / "next" / "data.bin").read_bytes() == large[:spares.MIN_BYTES + 4096]
    assert os.listdir(run / spares.SPARES_DIR) == []


# ------------------------------------------------------------------------------------------- capacity
@pytest.fixture
def small_tmpfs(tmp_path):
    """A mounter of real tmpfs file systems of a given size (root only, else the test is skipped)."""
    mounted = []

    def mount(size: int) -> Path:
        directory = tmp_path / f"tmpfs-{len(mounted)}"
        directory.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(directory)
        return directory

    yield mount
    for directory in mounted:
        subprocess.run(["umount", str(directory)], check=True)


def test_capacity_of_a_real_tmpfs_and_what_would_fit(small_tmpfs):
    root = small_tmpfs(64 * MiB) / "asyncckpt"
    run = Path(tier.open_run("/data/ckpt", str(root)))
    (run / "step_000001").mkdir()
    (run / "step_000001" / "__0_0.distcp").write_bytes(b"\0" * (8 * MiB))

    found = tier.capacity(str(root))

    assert found.filesystem == 64 * MiB and found.limit == 32 * MiB and not found.configured
    assert 8 * MiB <= found.used < 8 * MiB + 4096 and found.free == found.limit - found.used
    assert tier.fits(tier.needed_bytes(7 * MiB, 2), found)
    assert not tier.fits(tier.needed_bytes(10 * MiB, 2), found)

    fewer = tier.what_would_fit(10 * MiB, 2, found)
    assert fewer.endswith("; keep=1 would fit") and "needs 30.0 MiB" in fewer
    assert tier.fits(tier.needed_bytes(10 * MiB, 1), found)

    larger = tier.what_would_fit(40 * MiB, 2, found)
    size = re.search(r"; a ([\d.]+) MiB tmpfs would fit$", larger)
    assert size, larger
    assert tier.what_would_fit(7 * MiB, 2, found).endswith("; it fits")

    bigger_root = small_tmpfs(int(float(size.group(1)) * MiB)) / "asyncckpt"
    shutil.copytree(root, bigger_root)  # the same tier, on the file system the sentence asks for
    assert tier.fits(tier.needed_bytes(40 * MiB, 2), tier.capacity(str(bigger_root)))


def test_what_a_run_holds_already_is_room_for_its_own_next_checkpoints(small_tmpfs):
    """A restarted job finds its tier full of its own checkpoints: retention replaces them, so they are
    room for it, not use by others; another run's checkpoints are."""
    root = small_tmpfs(64 * MiB) / "asyncckpt"
    own, other = (Path(tier.open_run(f"/data/{name}", str(root))) for name in ("own", "other"))
    for run, size in ((own, 20 * MiB), (other, 4 * MiB)):
        (run / "step_000001").mkdir()
        (run / "step_000001" / "__0_0.distcp").write_bytes(b"\0" * size)

    everyone, for_own = tier.capacity(str(root)), tier.capacity(str(root), for_run=str(own))

    assert not tier.fits(tier.needed_bytes(10 * MiB, 1), everyone)
    assert tier.fits(tier.needed_bytes(10 * MiB, 1), for_own)
    assert 4 * MiB <= for_own.used < 4 * MiB + 4096 and 20 * MiB <= everyone.used - for_own.used < 20 * MiB + 4096
    assert for_own.available == everyone.available + everyone.used - for_own.used


def test_a_configured_limit_and_what_limit_would_fit(memory_root, run):
    (run / "step_000001").mkdir()
    (run / "step_000001" / "__0_0.distcp").write_bytes(b"\0" * MiB)

    found = tier.capacity(str(memory_root), 3 * MiB)

    assert found.configured and found.limit == 3 * MiB and MiB <= found.used < MiB + 4096
    assert found.free == found.limit - found.used  # this file system has far more room than the limit
    assert tier.fits(found.free, found) and not tier.fits(found.free + 1, found)
    sentence = tier.what_would_fit(2 * MiB, 1, found)
    limit = re.search(r"; max_bytes=(\d+) would fit$", sentence)
    assert limit, sentence
    assert tier.fits(tier.needed_bytes(2 * MiB, 1), tier.capacity(str(memory_root), int(limit.group(1))))


# ------------------------------------------------------------------------------------------- owners and orphans
def claiming_child(memory_root: Path, durable_root: Path, logs: Path) -> Program:
    """A process that opens the run of ``durable_root`` and claims it, then waits to be killed."""
    code = ("import sys, time; from asyncckpt.core import tier; "
            "tier.claim_run(tier.open_run(sys.argv[1])); print('claimed', flush=True); time.sleep(600)")
    child = Program([sys.executable, "-c", code, str(durable_root)], logs,
                    env={**os.environ, tier.MEMORY_ROOT_ENV: str(memory_root)})
    child.wait_for_line("claimed", timeout=60)
    return child


def kill(child: Program) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)


def test_a_killed_owner_leaves_an_orphan_removed_after_the_bound_not_before(memory_root, tmp_path):
    child = claiming_child(memory_root, tmp_path / "ckpt", tmp_path / "logs")
    directory = Path(tier.run_dir(str(tmp_path / "ckpt")))
    with core.Checkpointer() as checkpointer:
        checkpointer.save(state(1), directory / "step_000001", step=1)
    kill(child)
    root = str(memory_root)

    assert [(run.alive, len(run.owners)) for run in tier.runs(root)] == [(False, 1)]
    assert tier.orphaned_runs(root) == [] and tier.remove_orphans(root) == []  # a restart finds its tier
    backdate(directory, tier.ORPHAN_AFTER_S / 2)
    assert tier.remove_orphans(root) == [] and tier.memory_checkpoints(str(directory))

    backdate(directory, tier.ORPHAN_AFTER_S + 60)
    assert tier.orphaned_runs(root) == [str(directory)]
    assert tier.remove_orphans(root) == [str(directory)]
    assert os.listdir(root) == []  # nothing left aside either


def test_a_live_owners_run_is_never_removed(memory_root, tmp_path):
    child = claiming_child(memory_root, tmp_path / "ckpt", tmp_path / "logs")
    try:
        directory = Path(tier.run_dir(str(tmp_path / "ckpt")))
        backdate(directory, 10 * HOUR)

        assert [run.alive for run in tier.runs(str(memory_root))] == [True]
        assert tier.orphaned_runs(str(memory_root), 0) == [] and tier.remove_orphans(str(memory_root), 0) == []
        assert directory.is_dir()
    finally:
        kill(child)
    assert tier.orphaned_runs(str(memory_root)) == [str(directory)]  # unchanged for 10 hours, owner gone


def test_a_released_run_is_kept_for_a_restart_then_removed(memory_root, run):
    token = tier.claim_run(str(run))
    assert tier.runs(str(memory_root))[0].alive
    tier.release_run(str(run), token)

    assert [(r.alive, r.owners) for r in tier.runs(str(memory_root))] == [(False, ())]
    assert tier.orphaned_runs(str(memory_root)) == []
    backdate(run, 2 * HOUR)
    assert tier.remove_orphans(str(memory_root)) == [str(run)] and not run.exists()


def test_owners_of_another_boot_or_host_count_as_gone(memory_root, run):
    """A tmpfs does not outlive a reboot, and a memory root is one node's: a marker made on another boot,
    or by a process of another host, names no process that uses this run now (even with a pid alive here)."""
    live = owners.owner_token()  # this process: its pid lives
    other_boot = live[:6] + format(int(live[6:12], 16) ^ 1, "06x") + live[12:]
    other_host = format(int(live[:6], 16) ^ 1, "06x") + live[6:]
    for token in (other_boot, other_host):
        (run / (tier.OWNER_MARKER_PREFIX + token)).touch()
    backdate(run, 2 * HOUR)

    assert [(r.alive, len(r.owners)) for r in tier.runs(str(memory_root))] == [(False, 2)]
    assert tier.orphaned_runs(str(memory_root)) == [str(run)]


def test_a_run_claimed_as_it_is_judged_orphaned_is_put_back(memory_root, run):
    with core.Checkpointer() as checkpointer:
        checkpointer.save(state(1), run / "step_000001", step=1)
    backdate(run, 2 * HOUR)
    assert tier.orphaned_runs(str(memory_root)) == [str(run)]
    token = tier.claim_run(str(run))  # a restarted job, between the judgement and the removal

    assert tier.remove_orphan(str(run)) is False
    assert [c.name for c in tier.memory_checkpoints(str(run))] == ["step_000001"]
    assert tier.runs(str(memory_root))[0].owners == (token,)


def test_what_a_dead_cleaner_left_goes_with_the_next_cleaning(memory_root, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "from asyncckpt.core.storage.owners import owner_token; print(owner_token())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    half_removed = Path(tier.open_run(str(tmp_path / "old")))
    os.rename(half_removed, names.hidden_path(str(half_removed), "removing", dead))
    kept = tier.open_run(str(tmp_path / "ckpt"))

    assert tier.remove_orphans(str(memory_root)) == []
    assert os.listdir(memory_root) == [os.path.basename(kept)]


def test_remove_run_deletes_a_run_at_once(memory_root, run):
    tier.claim_run(str(run))
    tier.remove_run(str(run))
    tier.remove_run(str(run))  # gone already: nothing to do

    assert os.listdir(memory_root) == []
