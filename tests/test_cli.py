"""The ``asyncckpt`` command line, run as users run it: a process of its own on real checkpoints.

Every CLI process imports torch (seconds), so the module prepares all scenarios once (checkpoints
written with ``asyncckpt.core.save``, then copied and damaged), runs all the commands, each a
fork of one process that imported torch once (``zygote.py``), and each test asserts on its own
command's output and exit code.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncckpt import core
from asyncckpt.core.storage.owners import owner_token
from asyncckpt.core.formats import names
from asyncckpt.core.formats.names import COMMIT_RECORD
from asyncckpt.core.storage.sidecars import read_rank_sidecar
from zygote import Zygote

STAGING_NAME = ".step_000020.asyncckpt-staging-0123abcd"


def state_dict() -> dict:
    torch.manual_seed(0)
    return {
        "model": {"weight": torch.randn(16, 8), "bias": torch.zeros(8, dtype=torch.bfloat16)},
        "optim": {"step": torch.tensor(7, dtype=torch.int64), "lr": 0.01},
        "epoch": 3,
    }


def cli(zygote: Zygote, *args: str | os.PathLike) -> subprocess.CompletedProcess:
    """``python -m asyncckpt.core.cli.main *args`` as a fresh process forked from ``zygote``, which imported
    the CLI (and torch) once for all the runs."""
    command = [sys.executable, "-m", "asyncckpt.core.cli.main", *map(str, args)]
    run = zygote.run(None, *command[3:], module=command[2], timeout=120)
    stdout = "".join(line + "\n" for line in run.remaining_lines(timeout=120))
    return subprocess.CompletedProcess(command, run.returncode, stdout, run.stderr())


def sidecar_item(checkpoint: Path, fqn: str) -> dict:
    items = read_rank_sidecar(str(checkpoint), 0)["items"]  # one dict per item, whatever the format version
    (item,) = [i for i in items if i["fqn"] == fqn]
    return item


def copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A pristine checkpoint with its step in the commit record, next to checkpoint-3, which has
    none (``ls`` must take that step from the name). Tests only ever damage copies."""
    pristine = tmp_path_factory.mktemp("pristine")
    core.save(state_dict(), pristine / "step_000010", step=10)
    core.save(state_dict(), pristine / "checkpoint-3")
    return pristine / "step_000010"


@pytest.fixture(scope="module")
def runs(good, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Scenario name -> the finished CLI run on it."""

    # ls: two committed checkpoints, a save in progress (staging name), one that crashed before its
    # commit record, and a directory that is not a checkpoint at all.
    listing = tmp_path_factory.mktemp("listing")
    copy(good, listing / "step_000010")
    copy(good.parent / "checkpoint-3", listing / "checkpoint-3")
    (copy(good, listing / STAGING_NAME) / COMMIT_RECORD).unlink()
    (copy(good, listing / "step_000030") / COMMIT_RECORD).unlink()
    (listing / "logs").mkdir()

    damaged = tmp_path_factory.mktemp("damaged")
    flipped = copy(good, damaged / "flipped")
    flip_byte(flipped / "__0_0.distcp", sidecar_item(flipped, "model.weight")["data_start"] + 100)
    truncated = copy(good, damaged / "truncated")
    os.truncate(truncated / "__0_0.distcp", sidecar_item(truncated, "model.bias")["data_start"] + 2)
    (truncated / "__0_1.distcp").unlink()  # the pickled objects
    incomplete = copy(good, damaged / "incomplete")
    (incomplete / COMMIT_RECORD).unlink()

    cleaning = {kind: _leftovers(good, tmp_path_factory.mktemp(kind)) for kind in ("clean", "clean_dry_run")}
    native = _native_kinds(tmp_path_factory.mktemp("native"))

    commands = {
        "clean": ("clean", cleaning["clean"]),
        "clean_dry_run": ("clean", cleaning["clean_dry_run"], "--dry-run"),
        "ls": ("ls", listing),
        "inspect": ("inspect", good),
        "verify_good": ("verify", good),
        "verify_flipped": ("verify", flipped, "--no-progress"),
        "verify_truncated": ("verify", truncated, "--no-progress"),
        "verify_incomplete": ("verify", incomplete),
        "ls_native": ("ls", native),
        "inspect_file": ("inspect", native / "epoch=1-step=15.ckpt"),
        "inspect_directory": ("inspect", native / "checkpoint_2"),
        "inspect_root": ("inspect", native),
        "verify_native_root": ("verify", native, "--no-progress"),
        "verify_flipped_file": ("verify", native / "damaged" / "epoch=0-step=5.ckpt", "--no-progress"),
        "verify_damaged_directory": ("verify", native / "damaged" / "checkpoint_1", "--no-progress"),
    }
    # what the CLI imports, not the CLI itself (``-m`` of an imported module warns)
    with Zygote(["torch.distributed.checkpoint", "asyncckpt.core", "tqdm"], dict(os.environ),
                tmp_path_factory.mktemp("cli")) as zygote:
        return {name: cli(zygote, *args) for name, args in commands.items()}


def _native_kinds(root: Path) -> Path:
    """What the adapters write, through the same core calls: a Lightning ``.ckpt`` file, an
    Accelerate ``checkpoint_N`` directory; a directory a framework wrote without asyncckpt; and, in
    ``damaged/``, a file and a directory with a flipped byte."""
    state = state_dict()
    with core.Checkpointer() as checkpointer:
        for directory in (root, root / "damaged"):
            directory.mkdir(exist_ok=True)
            checkpointer.save_file({"state_dict": state["model"], "global_step": 15, "epoch": 1},
                                   directory / ("epoch=1-step=15.ckpt" if directory == root else "epoch=0-step=5.ckpt"))
            with checkpointer.begin_directory(directory / ("checkpoint_2" if directory == root else "checkpoint_1"),
                                              step=2) as tx:
                tx.save_file(state["model"], "model.safetensors", format="safetensors", metadata={"format": "pt"})
                tx.save_file(state["optim"], "optimizer.bin")
                tx.commit().result()
    (root / "native_run").mkdir()
    torch.save(state["optim"], root / "native_run" / "optimizer.bin")  # e.g. Accelerate without the adapter
    flip_byte(root / "damaged" / "epoch=0-step=5.ckpt", os.path.getsize(root / "damaged" / "epoch=0-step=5.ckpt") // 2)
    flip_byte(root / "damaged" / "checkpoint_1" / "optimizer.bin", 100)
    return root


def test_ls_lists_every_kind_and_marks_those_without_checksums(runs):
    result = runs["ls_native"]

    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines()}
    assert set(rows) == {"epoch=1-step=15.ckpt", "checkpoint_2", "native_run"}
    assert rows["epoch=1-step=15.ckpt"].split()[1] == "15" and "(file, epoch 1)" in rows["epoch=1-step=15.ckpt"]
    assert " COMPLETE  (directory)" in rows["checkpoint_2"]
    assert " NATIVE " in rows["native_run"] and "no checksums" in rows["native_run"]


def test_inspect_lists_keys_of_native_files_and_of_a_root(runs):
    file, directory, root = runs["inspect_file"], runs["inspect_directory"], runs["inspect_root"]

    assert file.returncode == 0, file.stderr
    assert "  state_dict.weight  float32  [16, 8]" in file.stdout and "  state_dict.bias  bfloat16  [8]" in file.stdout
    assert directory.returncode == 0, directory.stderr
    assert "model.safetensors" in directory.stdout and "  weight  F32  [16, 8]" in directory.stdout
    assert "  step  int64  []" in directory.stdout  # optimizer.bin, a weights-only pickle
    assert root.returncode == 0 and "holds checkpoints, and is none itself" in root.stdout
    assert "INCOMPLETE" not in root.stdout


def test_verify_checks_native_files_by_checksum(runs):
    good, file, directory = runs["verify_native_root"], runs["verify_flipped_file"], runs["verify_damaged_directory"]

    assert good.returncode == 0, good.stdout + good.stderr
    assert "checkpoint_2: OK: 2 file(s)" in good.stdout and "epoch=1-step=15.ckpt: OK: 1 file(s)" in good.stdout
    assert "native_run: OK: 0 file(s), 0 B verified by checksum; without checksums" in good.stdout
    assert file.returncode == 1 and "epoch=0-step=5.ckpt: checksum mismatch: expected xxh3 " in file.stdout
    assert directory.returncode == 1 and "optimizer.bin: checksum mismatch" in directory.stdout


OLD_STAGING = ".step_000020.asyncckpt-staging-0ld"
FRESH_STAGING = ".step_000030.asyncckpt-staging-fresh"
OLD_REPLACED = ".step_000010.asyncckpt-replaced-0ld"
DEAD_OWNER = ".step_000040.asyncckpt-staging-dead"
LIVE_OWNER = ".step_000050.asyncckpt-staging-live"


def _dead_token() -> str:
    """The owner token of a process that has exited."""
    return subprocess.run([sys.executable, "-c", "from asyncckpt.core.storage.owners import owner_token; print(owner_token())"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _leftovers(good: Path, root: Path) -> Path:
    """A committed checkpoint plus what crashes leave: without owner markers (an older version, or
    another host), a staging dir untouched for 2 hours and one touched just now; a swapped-out old
    checkpoint; a fresh staging dir whose writer is gone; an old one whose writer (this process) lives."""
    copy(good, root / "step_000010")
    two_hours_ago = os.path.getmtime(good) - 7200
    owners = {DEAD_OWNER: _dead_token(), LIVE_OWNER: owner_token()}
    for name, keep_record in ((OLD_STAGING, False), (OLD_REPLACED, True), (FRESH_STAGING, False),
                              (DEAD_OWNER, False), (LIVE_OWNER, False)):
        directory = copy(good, root / name)
        if not keep_record:
            (directory / COMMIT_RECORD).unlink()
        if name in owners:
            (directory / names.owner_marker_name(0)).write_text(owners[name])
        if name not in (FRESH_STAGING, DEAD_OWNER):
            for path in [directory, *directory.iterdir()]:
                os.utime(path, (two_hours_ago, two_hours_ago))
    return root


def test_clean_removes_leftovers_of_dead_writers_and_spares_live_saves(runs):
    """Owner markers decide, not age: a fresh leftover of a writer that is gone goes at once, an
    old directory a live writer uses stays; without markers (another host) only age can tell."""
    result = runs["clean"]

    assert result.returncode == 0, result.stderr
    root = Path(result.args[-1])
    assert sorted(os.listdir(root)) == sorted([FRESH_STAGING, LIVE_OWNER, "step_000010"])
    for name in (OLD_STAGING, OLD_REPLACED, DEAD_OWNER):
        assert f"removed  {name}" in result.stdout
    assert f"kept     {FRESH_STAGING}" in result.stdout and f"kept     {LIVE_OWNER}" in result.stdout
    assert "in 3 entries" in result.stdout
    assert core.latest_checkpoint(root) == str(root / "step_000010")


def test_clean_dry_run_only_lists(runs):
    result = runs["clean_dry_run"]

    assert result.returncode == 0, result.stderr
    root = Path(result.args[-2])
    assert len(os.listdir(root)) == 6
    assert result.stdout.count("would remove") == 3


def test_ls_lists_complete_incomplete_and_staging_newest_last(runs):
    result = runs["ls"]

    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()]
    assert [row[0] for row in rows] == ["checkpoint-3", "step_000010", STAGING_NAME, "step_000030"]
    assert [row[1] for row in rows] == ["3", "10", "20", "30"]
    assert [row[3] for row in rows] == ["KiB"] * 4  # total size, e.g. "10.1 KiB"
    assert [row[4] for row in rows] == ["COMPLETE", "COMPLETE", "INCOMPLETE", "INCOMPLETE"]
    assert [" ".join(row[5:]) for row in rows] == ["(sharded)", "(sharded)", "(staging)", "(sharded, no commit record)"]


def test_inspect_shows_keys_shapes_dtypes_chunks_and_ranks(runs, good):
    result = runs["inspect"]

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "COMPLETE, step 10, world size 1" in lines[0]
    weight = sidecar_item(good, "model.weight")
    assert "model.weight  tensor  float32  [16, 8]  512 B  1 chunk(s)" in lines
    assert (f"    chunk at [0, 0] size [16, 8]: rank 0, 512 B data in __0_0.distcp "
            f"[{weight['data_start']}, {weight['data_start'] + 512}), container {weight['length']} B") in lines
    assert "model.bias  tensor  bfloat16  [8]  16 B  1 chunk(s)" in lines
    assert "optim.step  tensor  int64  []  8 B  1 chunk(s)" in lines
    assert {line.split()[0] for line in lines if "  object  " in line} == {"optim.lr", "epoch"}
    assert any(line.startswith("  rank 0: 3 tensor chunk(s) 536 B, 2 object(s)") for line in lines)


def test_verify_passes_on_a_good_checkpoint(runs, good):
    result = runs["verify_good"]

    items = read_rank_sidecar(str(good), 0)["items"]
    checksummed = sum(item["nbytes"] for item in items)  # tensors' bytes and objects' pickles
    files = len({item["file"] for item in items})
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().endswith(f": OK: {files} file(s), {checksummed} B verified by checksum")
    assert "verify: 100%" in result.stderr  # the tqdm progress bar goes to stderr only


def test_verify_names_file_key_and_byte_range_of_a_flipped_byte(runs, good):
    result = runs["verify_flipped"]

    assert result.returncode == 1, result.stdout + result.stderr
    item = sidecar_item(good, "model.weight")
    first, end = item["data_start"], item["data_start"] + item["nbytes"]
    assert (f"__0_0.distcp: key 'model.weight' (rank 0) bytes [{first}, {end}): checksum mismatch: "
            f"expected xxh3 {item['xxh3']}, found ") in result.stdout
    assert "model.bias" not in result.stdout  # only the damaged item is reported
    assert "FAILED: 1 problem(s)" in result.stdout


def test_verify_reports_truncated_and_missing_data_files(runs, good):
    result = runs["verify_truncated"]

    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    cut = sidecar_item(good, "model.bias")["data_start"] + 2
    full_size = (good / "__0_0.distcp").stat().st_size
    assert f"__0_0.distcp: truncated: {cut} B on disk, the commit record says {full_size} B" in out
    assert "__0_0.distcp: key 'model.bias' (rank 0) bytes [" in out and "beyond the end of the file" in out
    assert "key 'model.weight'" not in out  # it lies before the cut: intact
    assert "__0_1.distcp: missing data file (holds 2 item(s): epoch, optim.lr)" in out


def test_verify_refuses_an_incomplete_checkpoint_with_exit_2(runs):
    result = runs["verify_incomplete"]

    assert result.returncode == 2, result.stdout + result.stderr
    assert "INCOMPLETE" in result.stdout and COMMIT_RECORD in result.stdout
