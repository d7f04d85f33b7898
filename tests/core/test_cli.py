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
import time
from pathlib import Path

import pytest
import torch

from asyncckpt import core
from asyncckpt.core.cli.main import main
from asyncckpt.core.storage import owners
from asyncckpt.core import tier
from asyncckpt.core.storage.owners import owner_token
from asyncckpt.core.formats import names
from asyncckpt.core.formats.names import COMMIT_RECORD
from asyncckpt.core.storage.local import LocalBackend
from asyncckpt.core.storage.sidecar_io import read_rank_sidecar
from asyncckpt.core.storage.staging import publish_checkpoint
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
    node = _memory_node(good, tmp_path_factory.mktemp("node"))  # this "node"'s ASYNCCKPT_MEMORY_ROOT: node / "shm"
    cleaning_memory = {kind: _memory_to_clean(good, tmp_path_factory.mktemp(kind))
                       for kind in ("clean_tiered", "clean_memory", "clean_memory_older_than")}

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
        "ls_tiered": ("ls", node / "tiered"),
        "ls_tiered_elsewhere": ("ls", node / "tiered", "--memory-root", node / "empty"),
        "ls_memory_only": ("ls", node / "not_yet_durable"),
        "ls_memory": ("ls", "--memory"),
        "ls_nothing": ("ls",),
        **{f"clean_{name}": ("clean", cleaning_memory["clean_tiered"] / name,
                             "--memory-root", cleaning_memory["clean_tiered"] / "shm") for name in ("tiered", "live")},
        "clean_memory": ("clean", "--memory", "--memory-root", cleaning_memory["clean_memory"] / "shm"),
        "clean_memory_older_than": ("clean", "--memory", "--older-than", "60",
                                    "--memory-root", cleaning_memory["clean_memory_older_than"] / "shm"),
    }
    # what the CLI imports, not the CLI itself (``-m`` of an imported module warns)
    with Zygote(["torch.distributed.checkpoint", "asyncckpt.core", "tqdm"],
                {**os.environ, tier.MEMORY_ROOT_ENV: str(node / "shm")}, tmp_path_factory.mktemp("cli")) as zygote:
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


def _backdate(directory: Path, seconds: float) -> None:
    """``directory`` and what is directly in it unchanged for ``seconds``: time passing."""
    then = time.time() - seconds
    for path in [directory, *directory.iterdir()]:
        os.utime(path, (then, then), follow_symlinks=False)


def _memory_node(good: Path, node: Path) -> Path:
    """One node's memory root (``node/shm``) beside durable roots. ``tiered``: step 10 durable and in
    memory; in memory only, step 20 whole and step 30 of which this node holds part (its record says
    which node holds the rest), and a save being staged; its run is owned by this (live) process.
    ``not_yet_durable``: a checkpoint in memory only, its durable root not made yet. ``gone``: the
    tier of a job nobody owns, unchanged for two hours."""
    memory_root = node / "shm"
    (node / "empty").mkdir()
    durable = node / "tiered"
    copy(good, durable / "step_000010")
    run = Path(tier.open_run(str(durable), str(memory_root)))
    tier.claim_run(str(run))
    copy(good, run / "step_000010")
    core.save(state_dict(), run / "step_000020", step=20)
    core.save(state_dict(), node / "whole", step=30)
    record = tier.memory_checkpoints(str(node))[0].record
    staging = copy(node / "whole", Path(names.staging_dir_for(str(run / "step_000030"), "0123abcd")))
    for name in (COMMIT_RECORD, names.objects_file_name(0)):
        (staging / name).unlink()
    publish_checkpoint(LocalBackend(), str(staging), str(run / "step_000030"),
                       {**record, "tier": {"holders": {names.objects_file_name(0): ["node-b"]}}})
    (copy(good, Path(names.staging_dir_for(str(run / "step_000040"), "4567cdef"))) / COMMIT_RECORD).unlink()
    core.save(state_dict(), Path(tier.open_run(str(node / "not_yet_durable"), str(memory_root))) / "step_000005", step=5)
    gone = Path(tier.open_run(str(node / "gone"), str(memory_root)))
    copy(good, gone / "step_000010")
    _backdate(gone, 7200)
    return node


def _memory_to_clean(good: Path, node: Path) -> Path:
    """A node's memory root (``node/shm``) holding the tiers of four jobs, and what a cleaner that died
    left: ``tiered`` (its durable root beside) and ``other``, both of jobs gone two hours ago; ``recent``,
    of a job gone two minutes ago; ``live``, of a job alive (this process) but idle for two hours, with
    a save in it that a writer now gone left."""
    memory_root, dead = node / "shm", _dead_token()
    copy(good, node / "tiered" / "step_000010")
    for name, idle in (("tiered", 7200), ("other", 7200), ("recent", 120), ("live", 7200)):
        run = Path(tier.open_run(str(node / name), str(memory_root)))
        copy(good, run / "step_000010")
        (run / (tier.OWNER_MARKER_PREFIX + (owner_token() if name == "live" else dead))).touch()
        if name == "live":
            (copy(good, Path(names.staging_dir_for(str(run / "step_000020"), dead))) / COMMIT_RECORD).unlink()
        _backdate(run, idle)
    half_removed = Path(tier.open_run(str(node / "half_removed"), str(memory_root)))
    os.rename(half_removed, names.hidden_path(str(half_removed), "removing", dead))
    for pid in (_dead_pid(), os.getpid()):  # node copies of two cooperative loads: one killed, one running
        copy_of_load = Path(tier.loads_dir(str(memory_root))) / f"0123456789ab-{pid}"
        copy_of_load.mkdir(parents=True)
        (copy_of_load / "0-model.ckpt").write_bytes(bytes(3000))
    for token in (dead, owner_token()):  # the scratch folders of two saves being captured: one killed, one running
        scratch = Path(tier.captures_dir(str(memory_root))) / token
        scratch.mkdir(parents=True)
        (scratch / "trainer_state.json").write_text("{}")
    return node


def test_ls_shows_the_memory_tier_of_a_root_beside_its_durable_checkpoints(runs):
    result = runs["ls_tiered"]

    assert result.returncode == 0, result.stderr
    rows = [(line.split()[0], line.split()[1], line.split()[4], line.split("(", 1)[1]) for line in result.stdout.splitlines()]
    assert sorted(rows[:2]) == [("step_000010", "10", "COMPLETE", "memory, durable copy too)"),
                                ("step_000010", "10", "COMPLETE", "sharded)")]
    assert rows[2:] == [("step_000020", "20", "COMPLETE", "memory only)"),
                        ("step_000030", "30", "PARTIAL", f"memory only, missing here: {names.objects_file_name(0)} (on node-b))"),
                        (".step_000040.asyncckpt-staging-4567cdef", "40", "INCOMPLETE", "memory, staging)")]


def test_ls_memory_root_names_another_node_memory(runs):
    result = runs["ls_tiered_elsewhere"]

    assert result.returncode == 0, result.stderr
    assert [line.split()[0] for line in result.stdout.splitlines()] == ["step_000010"]
    assert "memory" not in result.stdout


def test_ls_shows_a_memory_tier_before_anything_is_durable(runs):
    result = runs["ls_memory_only"]

    assert result.returncode == 0, result.stderr
    assert [line.split()[:5:4] + [line.split("(")[1]] for line in result.stdout.splitlines()] == [
        ["step_000005", "COMPLETE", "memory only)"]]
    assert "not_yet_durable" in result.stderr  # said once: nothing there yet


def test_ls_memory_lists_every_tier_of_the_node(runs):
    result = runs["ls_memory"]

    assert result.returncode == 0, result.stderr
    tiers = {line.split()[1].rsplit("/", 1)[1]: line for line in result.stdout.splitlines() if not line.startswith(" ")}
    assert set(tiers) == {"tiered", "not_yet_durable", "gone"}
    assert "(in use)  3 checkpoint(s)" in tiers["tiered"]  # a save being staged is none
    assert "(no live owner, unchanged for 2.0 h; orphaned)  1 checkpoint(s)" in tiers["gone"]
    assert "no live owner" in tiers["not_yet_durable"] and "orphaned after 60 min" in tiers["not_yet_durable"]
    assert "  step_000030  30  " in result.stdout and f"PARTIAL (missing here: {names.objects_file_name(0)} (on node-b))" in result.stdout


def test_ls_without_root_or_memory_is_a_usage_error(runs):
    result = runs["ls_nothing"]

    assert result.returncode == 2 and "give ROOT, or --memory" in result.stderr


def test_clean_root_cleans_its_memory_tier_and_no_other(runs):
    """ROOT's own tier, if orphaned, goes whole; a live one only loses what dead writers left in it."""
    tiered, live = runs["clean_tiered"], runs["clean_live"]

    assert tiered.returncode == 0 and live.returncode == 0, tiered.stderr + live.stderr
    node = Path(tiered.args[4]).parent
    left = {tier.durable_root_of(run.path): run.path for run in tier.runs(str(node / "shm"))}
    assert set(left) == {str(node / name) for name in ("other", "recent", "live")}
    assert f"memory tier of {node / 'tiered'}: no live owner, unchanged for 2.0 h" in tiered.stdout
    assert sorted(os.listdir(node / "tiered")) == ["step_000010"]  # its durable checkpoint stays
    assert "removed  memory .step_000020.asyncckpt-staging-" in live.stdout
    assert "kept     memory live-" in live.stdout and "in use by a live process" in live.stdout
    assert [c.name for c in tier.memory_checkpoints(left[str(node / "live")])] == ["step_000010"]
    assert not [name for name in os.listdir(left[str(node / "live")]) if names.is_hidden(name)]


def test_clean_memory_removes_every_orphaned_tier_of_the_node_never_a_live_one(runs):
    result = runs["clean_memory"]

    assert result.returncode == 0, result.stderr
    memory_root = Path(result.args[-1])
    node = memory_root.parent
    left = {tier.durable_root_of(run.path) for run in tier.runs(str(memory_root))}
    assert left == {str(node / "recent"), str(node / "live")}
    assert len(os.listdir(memory_root)) == 2  # what the dead cleaner left went too
    assert "(memory tier of " + str(node / "live") + ": in use by a live process)" in result.stdout
    assert "removed once unchanged for 60 min" in result.stdout
    assert os.listdir(tier.loads_dir(str(memory_root))) == [f"0123456789ab-{os.getpid()}"]  # the running load's kept
    assert "(a node copy of a load whose process is gone)" in result.stdout
    [kept] = os.listdir(tier.captures_dir(str(memory_root)))  # the running save's scratch folder
    assert owners.same_process(kept, owner_token()) and "(a save's scratch folder whose process is gone)" in result.stdout
    assert "in 5 entries" in result.stdout


def test_clean_memory_removes_the_folders_of_loads_and_captures_once_nothing_is_left_in_them(tmp_path, capsys):
    """What killed loads and saves left beside the memory root goes, and the folders that held it with it once empty
    (``--dry-run`` removes neither)."""
    memory_root = tmp_path / "shm"
    left = [Path(tier.loads_dir(str(memory_root))) / f"0123456789ab-{_dead_pid()}",
            Path(tier.captures_dir(str(memory_root))) / _dead_token()]
    for folder in left:
        folder.mkdir(parents=True)
        (folder / "piece").write_bytes(bytes(100))
    assert main(["clean", "--memory", "--memory-root", str(memory_root), "--dry-run"]) == 0
    assert all(folder.exists() for folder in left)
    assert main(["clean", "--memory", "--memory-root", str(memory_root)]) == 0
    assert "in 2 entries" in capsys.readouterr().out
    assert not any(folder.parent.exists() for folder in left)


def test_clean_memory_older_than_shortens_the_bound(runs):
    result = runs["clean_memory_older_than"]

    assert result.returncode == 0, result.stderr
    memory_root = Path(result.args[-1])
    assert {tier.durable_root_of(run.path) for run in tier.runs(str(memory_root))} == {str(memory_root.parent / "live")}


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


def _dead_pid() -> int:
    """The pid of a process that has exited."""
    process = subprocess.Popen([sys.executable, "-c", ""])
    process.wait()
    return process.pid


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
