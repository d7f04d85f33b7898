"""A save that returned survives the training process's death (kill -9 at once after the call).

Real processes, real kills: each trial starts training processes (``survival_child.py``), kills
them with SIGKILL the moment the save call returned (or in the middle of the snapshot), and checks
what is on disk afterwards. A trial in which the checkpoint was already visible when the kill
landed proves nothing: it is counted apart, and each test needs trials that prove something.
Each kill test runs with the writer the save finds (``WRITERS``): running since an earlier save,
none (the process's first save starts it), and one stopped when idle (the save starts another).
``python benchmarks/run.py survival`` (its ``stress`` part) runs many more trials of the same kinds.
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time

import fsspec
import pytest
import torch

from asyncckpt import core
from asyncckpt.core.cli import main as cli
from asyncckpt.core.formats import names
from asyncckpt.core.storage import leftovers, orphans, owners
from asyncckpt.core.storage.backend import backend_for, is_url
from dist_helper import free_port
from processes import Program
from writers import writers_of
from survival_child import ELEMENTS, TENSORS, values

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers")
CHILD = os.path.join(HERE, "survival_child.py")


WRITERS = ["running", "none", "idle-stopped"]  # what the save finds: see survival_child.py


def start(logs: str, root: str, seed: int, mode: str, world: int = 1, env: dict | None = None,
          writer: str = "running") -> list[Program]:
    port = free_port()
    rank_args = [[]] if world == 1 else [[str(r), str(world), str(port)] for r in range(world)]
    env = {**os.environ, **(env or {}), "SURVIVAL_WRITER": writer}
    return [Program([sys.executable, CHILD, root, str(seed), mode, *args], logs, env=env) for args in rank_args]


def kill(procs: list[Program]) -> None:
    for proc in procs:
        proc.send_signal(signal.SIGKILL)
    for proc in procs:
        proc.wait(30)


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def expected(seed: int, world: int, elements: int = ELEMENTS) -> dict:
    return {f"r{rank}.t{i}": values(seed, i, rank, elements) for rank in range(world) for i in range(TENSORS)}


def assert_holds(path: str, seed: int, world: int, elements: int = ELEMENTS) -> None:
    wanted = expected(seed, world, elements)
    state = {key: torch.empty(elements) for key in wanted}
    core.load(state, path)
    for key, value in wanted.items():
        assert torch.equal(state[key], value), f"{path}: {key} differs from what the save call was given"


def no_writer_left(procs: list[Program]) -> None:
    wait_until(lambda: not writers_of(*(proc.pid for proc in procs)), 60, "an orphaned writer still runs after its work")


# An object store's trials write less (32 MiB a rank; moto's server takes ~10 s for 512 MiB): still not committed at the kill.
S3_ELEMENTS = {"SURVIVAL_ELEMENTS": str(1 << 20)}


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path) -> tuple[str, dict]:
    """Where the trials save: a local directory, or a bucket of the S3 server the tests start; and
    the environment of the training processes."""
    if request.param == "local":
        return str(tmp_path), {}
    return request.getfixturevalue("s3_root"), S3_ELEMENTS


def names_in(root: str) -> list[str]:
    """What is directly in ``root`` (nothing, where a prefix holds no object any more or no directory was made)."""
    try:
        return backend_for(root).names(root)
    except FileNotFoundError:
        return []


def no_leftovers(root: str) -> bool:
    return leftovers.find(root) == []


@pytest.mark.parametrize("writer", WRITERS)
def test_a_returned_save_is_committed_after_kill_9_single_and_multi_rank(place, writer, tmp_path):
    """kill -9 the training process(es) at once after the save call returned: the writer(s)
    commit that save, it holds what was saved, the orphan logs it, and nothing of ours remains;
    also where that save started the writer. Two ranks: the Store died with rank 0's process; the
    writers meet by their markers (files, or objects in the bucket)."""
    base, env = place
    local = not is_url(base)
    proving = 0
    worlds = [2] if writer == "idle-stopped" else [1, 2]
    # more rounds only while no trial proved anything (a loaded machine may let a writer commit before the kill
    # lands); every trial makes every check
    for trial, world in enumerate(worlds * 4):
        if proving and trial % len(worlds) == 0:
            break
        seed = random.randrange(10**6)
        print(f"trial {trial}: world {world}, seed {seed}, writer {writer}")
        root = os.path.join(base, f"trial{trial}")
        procs = start(str(tmp_path / "logs"), root, seed, "returned", world, env, writer)
        for proc in procs:
            proc.wait_for_line("returned")
        kill(procs)
        visible_at_kill = core.is_complete(os.path.join(root, "next"))
        if local:  # a restart while the orphan writes: it waits for the orphan, then resumes from its checkpoint
            wait_until(lambda: orphans.at_work(root) or core.is_complete(os.path.join(root, "next")), 60,
                       "the orphaned writer neither committed nor said it is at work")
        else:
            wait_until(lambda: core.is_complete(os.path.join(root, "next")), 90, "the orphaned writers did not commit")
        assert core.latest_checkpoint(root) == os.path.join(root, "next")
        assert_holds(os.path.join(root, "next"), seed, world, int(env.get("SURVIVAL_ELEMENTS", ELEMENTS)))
        no_writer_left(procs)
        # A trial proves the orphan at work where its writer said so (locally: its log). Not visible at the kill is
        # not enough: a writer already committing may land it a moment later without having seen its trainer die.
        logged = local and os.path.exists(orphans.log_path(root))
        if logged:
            with open(orphans.log_path(root)) as f:
                log = f.read()
            assert 1 <= log.count("finishing next") == log.count("committed next") <= world, log
        proving += logged if local else not visible_at_kill
        if local:
            assert orphans.at_work(root) == {}
        assert no_leftovers(root), "leftovers after the orphans' commit"
    assert proving >= 1, "no trial had an orphaned writer finish the checkpoint (and, locally, say so)"


@pytest.mark.parametrize("writer", ["running", "none"])
def test_a_kill_during_the_snapshot_commits_nothing(tmp_path, writer):
    """Killed halfway through its snapshot: nothing visible, nothing left after clean; ``base``, if
    there is one, stays latest."""
    root = str(tmp_path / "one")
    procs = start(str(tmp_path / "logs"), root, 7, "snapshot", writer=writer)
    procs[0].wait_for_line("copying")
    kill(procs)
    no_writer_left(procs)
    assert not os.path.exists(os.path.join(root, "next"))
    kept = ["base"] if writer == "running" else []
    assert core.latest_checkpoint(root) == (os.path.join(root, "base") if kept else None)
    leftovers.clean(root)
    assert sorted(set(names_in(root)) - {orphans.LOG_NAME}) == kept


@pytest.mark.parametrize("writer", ["running", "none"])
def test_one_rank_killed_in_its_snapshot_fails_the_save_everywhere_naming_it(place, writer, tmp_path):
    """Rank 1 dies during its snapshot: no rank commits, the surviving rank's error names rank 1
    within the save's timeout, and after clean nothing but ``base`` (if any) is there."""
    timeout = 5  # what the surviving rank's writer waits for rank 1
    root, env = os.path.join(place[0], "two"), {**os.environ, **place[1], "SURVIVAL_TIMEOUT": str(timeout),
                                                "SURVIVAL_WRITER": writer}
    procs = [Program([sys.executable, CHILD, root, "11", mode, str(rank), "2", str(port)], tmp_path / "logs", env=env)
             for port in [free_port()] for rank, mode in [(0, "returned"), (1, "snapshot")]]
    try:
        procs[1].wait_for_line("copying")
        procs[0].wait_for_line("returned")  # past the collectives of the save: only the snapshot of rank 1 is left
        procs[1].send_signal(signal.SIGKILL)
        started = time.monotonic()
        outcome = procs[0].next_line(timeout + 60).strip()
        assert outcome.startswith("failed:") and "rank" in outcome and "1" in outcome, outcome
        assert time.monotonic() - started < timeout + 30
    finally:
        kill(procs)
    no_writer_left(procs)
    assert not core.is_complete(os.path.join(root, "next"))
    kept = ["base"] if writer == "running" else []
    assert core.latest_checkpoint(root) == (os.path.join(root, "base") if kept else None)
    assert cli.main(["clean", root]) == cli.EXIT_OK
    assert [name for name in names_in(root) if name != orphans.LOG_NAME] == kept


def marked(root: str, name: str) -> bool:
    """Whether a save under ``root`` has the barrier marker ``name`` (in a staging directory, or an
    object store's barrier prefix)."""
    fs, path = fsspec.core.url_to_fs(root)
    fs.invalidate_cache()
    return any(found.endswith(f"/{name}") for found in fs.find(path, withdirs=False))


def stop_once_marked(writer: int, root: str) -> bool:
    """Stop rank 1's writer once its liveness marker is there (it runs in steps of 20 ms until then);
    False if its share was durable first."""
    os.kill(writer, signal.SIGSTOP)
    deadline = time.monotonic() + 60
    while not marked(root, names.alive_marker_name(1)):
        assert time.monotonic() < deadline, "rank 1's writer showed no liveness marker"
        if marked(root, names.done_marker_name(1)) or core.is_complete(os.path.join(root, "next")):
            return False
        os.kill(writer, signal.SIGCONT)
        time.sleep(0.02)
        os.kill(writer, signal.SIGSTOP)
    return not marked(root, names.done_marker_name(1))


@pytest.mark.parametrize("how, where", [("exited", "local"), ("exited", "s3"), ("silent", "local")])
def test_an_orphan_gives_up_on_a_rank_whose_writer_is_gone(tmp_path, request, how, where):
    """Two ranks' saves returned, both training processes die, and so does rank 1's writer before its
    share is durable (killed: gone from this host; or frozen: its liveness marker goes stale). Rank
    0's writer does not wait out the save's timeout: it gives up naming rank 1 (at once, or after
    ``barrier.silence_limit``), logs it, leaves only hidden leftovers, keeps ``base`` latest, and exits."""
    from asyncckpt.core.writer.barrier import silence_limit

    timeout = 80 if how == "exited" else 20  # silence_limit: 20 s, 5 s
    base = str(tmp_path) if where == "local" else request.getfixturevalue("s3_root")
    env = {"SURVIVAL_TIMEOUT": str(timeout), **({} if where == "local" else S3_ELEMENTS)}
    for attempt in range(3):  # an attempt in which rank 1's share was durable before its writer stopped proves nothing
        root = os.path.join(base, f"attempt{attempt}")
        procs = start(str(tmp_path / "logs"), root, 13, "returned", 2, env)
        for proc in procs:
            proc.wait_for_line("returned")
        rank1_writer = writers_of(procs[1].pid)
        assert len(rank1_writer) == 1, rank1_writer
        stopped = stop_once_marked(rank1_writer[0], root)
        kill(procs)
        if stopped:
            break
        os.kill(rank1_writer[0], signal.SIGKILL)
        no_writer_left(procs)
    else:
        pytest.fail("rank 1's share was durable before its writer could be stopped, in every attempt")
    try:
        if how == "exited":
            os.kill(rank1_writer[0], signal.SIGKILL)
        gone = time.monotonic()
        wait_until(lambda: not writers_of(procs[0].pid), timeout, "rank 0's writer waited out the save's timeout")
        waited = time.monotonic() - gone
        print(f"rank 0's writer exited {waited:.1f} s after rank 1's writer {how}")
        # its own share durable first (seconds to moto's server), then: at once, or after the silence limit
        assert waited < silence_limit(timeout) * (1 if how == "exited" else 2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank1_writer[0], signal.SIGKILL)
    no_writer_left(procs)
    assert not core.is_complete(os.path.join(root, "next"))
    assert core.latest_checkpoint(root) == os.path.join(root, "base")
    elements = int(env.get("SURVIVAL_ELEMENTS", ELEMENTS))
    kept = {f"r{rank}.t{i}": torch.ones(elements) for rank in range(2) for i in range(TENSORS)}
    core.load(kept, os.path.join(root, "base"))
    assert all(int(value.count_nonzero()) == 0 for value in kept.values()), "base does not hold what was saved"
    if where == "local":
        with open(orphans.log_path(root)) as f:
            log = f.read()
        assert "not committed next" in log and "rank 1" in log, log
        assert ("is gone" if how == "exited" else "no sign of life") in log, log
        assert orphans.at_work(root) == {}
        assert leftovers.find(root), "the failed save's staging directory"
        visible = [name for name in names_in(root) if not name.startswith(".")]
        assert visible == ["base"], visible
    else:  # its objects stay under its own name, uncommitted: no checkpoint to any reader
        uncommitted = [found.path for found in leftovers.find(root) if found.kind == "uncommitted"]
        assert uncommitted == [f"{root}/next"], uncommitted
    assert cli.main(["clean", root]) == cli.EXIT_OK
    assert [name for name in names_in(root) if name != orphans.LOG_NAME] == ["base"]


@pytest.mark.parametrize("writer", ["running", "none"])
def test_sigterm_to_every_process_during_a_large_save_commits_it_within_the_grace_period(tmp_path, writer):
    """A preemption: SIGTERM reaches every process of the job (the training process and its writer,
    as a container runtime or SLURM sends it), SIGKILL follows after a 30 s grace period. The
    training process dies of the SIGTERM; the writer ignores it, commits the save that returned and
    exits before the SIGKILL would come."""
    root = str(tmp_path / "preempted")
    procs = start(str(tmp_path / "logs"), root, 5, "returned", writer=writer)
    procs[0].wait_for_line("returned")
    writers = writers_of(*(proc.pid for proc in procs))
    assert writers, "no writer of the training process found"
    terminated = time.monotonic()
    for pid in [procs[0].pid, *writers]:
        os.kill(pid, signal.SIGTERM)
    procs[0].wait(30)
    assert procs[0].returncode == -signal.SIGTERM
    wait_until(lambda: not writers_of(*(proc.pid for proc in procs)), 30, "the writer outlived the 30 s grace period")
    assert time.monotonic() - terminated < 30
    assert core.is_complete(os.path.join(root, "next"))
    assert_holds(os.path.join(root, "next"), 5, 1)


def test_ls_shows_a_checkpoint_an_orphaned_writer_is_finishing(tmp_path):
    """``asyncckpt ls`` names the writer finishing a checkpoint whose training process died (from its
    log line, while that writer lives: here this test process plays the live writer)."""
    token = owners.owner_token()
    (tmp_path / names.hidden_name("checkpoint-7", "staging", token)).mkdir()
    orphans.note(str(tmp_path), token, "finishing checkpoint-7 (training process 1 died)")
    listed = subprocess.run([sys.executable, "-m", "asyncckpt.core.cli", "ls", str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert f"being finished by the writer {token}" in listed.stdout, listed.stdout
    orphans.note(str(tmp_path), token, "exiting")
    listed = subprocess.run([sys.executable, "-m", "asyncckpt.core.cli", "ls", str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    assert "being finished" not in listed.stdout, listed.stdout


@pytest.mark.parametrize("writer", WRITERS)
def test_replies_that_cannot_be_sent_do_not_stop_the_writer(tmp_path, writer):
    """The training process's end of the socket is closed before the writer learns of its exit (a dying
    process closes its files before its parent is told: the window a kill -9 under load hits): the
    writer's replies fail, and it still commits the save, runs the removal queued behind it, and exits
    without a traceback."""
    root = str(tmp_path / "closed")
    proc = start(str(tmp_path / "logs"), root, 5, "closed", writer=writer)[0]
    try:
        proc.wait_for_line("closed")
        wait_until(lambda: core.is_complete(os.path.join(root, "next")) and not os.path.exists(os.path.join(root, "base")),
                   60, "the save and the removal queued behind it did not both happen")
        no_writer_left([proc])
    finally:
        kill([proc])
    assert "Traceback" not in proc.error_output(), proc.error_output()[-3000:]
    assert_holds(os.path.join(root, "next"), 5, 1)
