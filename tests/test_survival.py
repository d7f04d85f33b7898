"""A save that returned survives the training process's death (kill -9 at once after the call).

Real processes, real kills: each trial starts training processes (``survival_child.py``), kills
them with SIGKILL the moment the save call returned (or in the middle of the snapshot), and checks
what is on disk afterwards. A trial in which the checkpoint was already visible when the kill
landed proves nothing: it is counted apart, and each test needs trials that prove something.
``benchmarks/stress_survival.py`` runs many more trials of the same kinds.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from asyncckpt import core
from asyncckpt.core.cli import main as cli
from asyncckpt.core.storage import leftovers, orphans
from asyncckpt.core.storage.backend import backend_for
from dist_helper import free_port
from writers import writers_of
from survival_child import ELEMENTS, TENSORS, values

HERE = os.path.dirname(__file__)
CHILD = os.path.join(HERE, "survival_child.py")


def start(root: str, seed: int, mode: str, world: int = 1, env: dict | None = None) -> list[subprocess.Popen]:
    port = free_port()
    rank_args = [[]] if world == 1 else [[str(r), str(world), str(port)] for r in range(world)]
    return [subprocess.Popen([sys.executable, CHILD, root, str(seed), mode, *args], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, **(env or {})}) for args in rank_args]


def wait_for_line(proc: subprocess.Popen, wanted: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if line.strip() == wanted:
            return
        assert time.monotonic() < deadline, f"no {wanted!r} from the training process"
    raise AssertionError(f"the training process ended without {wanted!r} (exit {proc.wait()})")


def kill(procs: list[subprocess.Popen]) -> None:
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


def no_writer_left(procs: list[subprocess.Popen]) -> None:
    wait_until(lambda: not writers_of(*(proc.pid for proc in procs)), 60, "an orphaned writer still runs after its work")


# An object store's trials write less (moto's server takes ~10 s for 512 MiB): still far from committed at the kill.
S3_ELEMENTS = {"SURVIVAL_ELEMENTS": str(2 << 20)}


@pytest.fixture(params=["local", "s3"])
def place(request, tmp_path) -> tuple[str, dict]:
    """Where the trials save: a local directory, or a bucket of the S3 server the tests start; and
    the environment of the training processes."""
    if request.param == "local":
        return str(tmp_path), {}
    return request.getfixturevalue("s3_root"), S3_ELEMENTS


def no_leftovers(root: str) -> bool:
    return backend_for(root).find_leftovers(root) == [] if "://" in root else leftovers.find(root) == []


def test_a_returned_save_is_committed_after_kill_9_single_and_multi_rank(place):
    """kill -9 the training process(es) at once after the save call returned: the writer(s)
    commit that save, it holds what was saved, the orphan logs it, and nothing of ours remains.
    Two ranks: the Store died with rank 0's process; the writers meet by their markers (files, or
    objects in the bucket)."""
    base, env = place
    local = "://" not in base
    proving = 0
    for trial, world in enumerate([1, 2, 1, 2] if local else [1, 2]):
        seed = random.randrange(10**6)
        print(f"trial {trial}: world {world}, seed {seed}")
        root = os.path.join(base, f"trial{trial}")
        procs = start(root, seed, "returned", world, env)
        for proc in procs:
            wait_for_line(proc, "returned")
        kill(procs)
        visible_at_kill = core.is_complete(os.path.join(root, "next"))
        proving += not visible_at_kill
        if local:  # a restart while the orphan writes: it waits for the orphan, then resumes from its checkpoint
            wait_until(lambda: orphans.at_work(root) or core.is_complete(os.path.join(root, "next")), 60,
                       "the orphaned writer neither committed nor said it is at work")
        else:
            wait_until(lambda: core.is_complete(os.path.join(root, "next")), 90, "the orphaned writers did not commit")
        assert core.latest_checkpoint(root) == os.path.join(root, "next")
        assert_holds(os.path.join(root, "next"), seed, world, int(env.get("SURVIVAL_ELEMENTS", ELEMENTS)))
        no_writer_left(procs)
        if local and not visible_at_kill:
            with open(orphans.log_path(root)) as f:
                log = f.read()
            assert "finishing next" in log and "committed next" in log, log
        if local:
            assert orphans.at_work(root) == {}
        assert no_leftovers(root), "leftovers after the orphans' commit"
    assert proving >= (2 if local else 1), "no trial killed the training process before its checkpoint was visible"


def test_a_kill_during_the_snapshot_commits_nothing(tmp_path):
    """Killed halfway through its snapshot: nothing visible, nothing left after clean, ``base`` stays latest."""
    root = str(tmp_path / "one")
    procs = start(root, 7, "snapshot")
    wait_for_line(procs[0], "copying")
    kill(procs)
    no_writer_left(procs)
    assert not os.path.exists(os.path.join(root, "next"))
    assert core.latest_checkpoint(root) == os.path.join(root, "base")
    leftovers.clean(root)
    assert sorted(os.listdir(root)) == ["base"] or sorted(os.listdir(root)) == [orphans.LOG_NAME, "base"]


def test_one_rank_killed_in_its_snapshot_fails_the_save_everywhere_naming_it(place):
    """Rank 1 dies during its snapshot: no rank commits, the surviving rank's error names rank 1
    within the save's timeout, and after clean nothing but ``base`` is there."""
    root, env = os.path.join(place[0], "two"), {**os.environ, **place[1], "SURVIVAL_TIMEOUT": "15"}
    procs = [subprocess.Popen([sys.executable, CHILD, root, "11", mode, str(rank), "2", str(port)],
                              stdout=subprocess.PIPE, text=True, env=env)
             for port in [free_port()] for rank, mode in [(0, "returned"), (1, "snapshot")]]
    try:
        wait_for_line(procs[1], "copying")
        wait_for_line(procs[0], "returned")  # past the collectives of the save: only the snapshot of rank 1 is left
        procs[1].send_signal(signal.SIGKILL)
        started = time.monotonic()
        outcome = procs[0].stdout.readline().strip()
        assert outcome.startswith("failed:") and "rank" in outcome and "1" in outcome, outcome
        assert time.monotonic() - started < 15 + 30
    finally:
        kill(procs)
    no_writer_left(procs)
    assert not core.is_complete(os.path.join(root, "next"))
    assert core.latest_checkpoint(root) == os.path.join(root, "base")
    assert cli.main(["clean", root]) == cli.EXIT_OK
    assert [name for name in backend_for(root).list_names(root) if name != orphans.LOG_NAME] == ["base"]


def test_sigterm_to_every_process_during_a_large_save_commits_it_within_the_grace_period(tmp_path):
    """A preemption: SIGTERM reaches every process of the job (the training process and its writer,
    as a container runtime or SLURM sends it), SIGKILL follows after a 30 s grace period. The
    training process dies of the SIGTERM; the writer ignores it, commits the save that returned and
    exits before the SIGKILL would come."""
    root = str(tmp_path / "preempted")
    procs = start(root, 5, "returned")
    wait_for_line(procs[0], "returned")
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
    from asyncckpt.core.formats import names

    token = leftovers.owner_token()
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


def test_replies_that_cannot_be_sent_do_not_stop_the_writer(tmp_path):
    """The training process's end of the socket is closed before the writer learns of its exit (a dying
    process closes its files before its parent is told: the window a kill -9 under load hits): the
    writer's replies fail, and it still commits the save, runs the removal queued behind it, and exits
    without a traceback."""
    root = str(tmp_path / "closed")
    proc = subprocess.Popen([sys.executable, CHILD, root, "5", "closed"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_line(proc, "closed")
        wait_until(lambda: core.is_complete(os.path.join(root, "next")) and not os.path.exists(os.path.join(root, "base")),
                   60, "the save and the removal queued behind it did not both happen")
        no_writer_left([proc])
    finally:
        kill([proc])
    _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, err[-3000:]
    assert_holds(os.path.join(root, "next"), 5, 1)
