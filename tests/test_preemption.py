"""Preemption: the signals a scheduler or a shell sends, and each framework's own preemption path, end to end.

Real processes, real signals. The writer keeps every save handed to it whatever reaches it (SLURM's ``--signal``
and ``scancel --signal`` reach every process of a job step; a closed terminal sends SIGHUP), from its spawn on; the
training process keeps its own actions (here the default ones: SIGUSR1 kills it, and its orphaned writer commits).
Each signal lands while a large save is in flight: the processes it goes to are stopped (SIGSTOP) once the save
returned, the checkpoint is checked not to be visible yet, and the signal is delivered as they continue. Then the
frameworks' own paths, each as its scheduler runs it: Lightning's SLURM auto-requeue, the Trainer's
``enable_jit_checkpoint``, and Accelerate's documented handler under torchrun in a container of its own (Kubernetes).
"""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch

from asyncckpt import core
from programs import Program
from survival_child import ELEMENTS, TENSORS, values
from test_survival import CHILD, start, wait_until
from writers import wait_until_gone, writers_of

SIGNALS = [signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGCONT, signal.SIGTERM, signal.SIGINT,
           signal.SIGPIPE]
DEFAULT_KILLS = {signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGTERM}  # a Python process's default action


def signal_status(pid: int) -> tuple[int, int]:
    """The signals ``pid`` blocks and those pending for it (``/proc/PID/status``), as bit masks."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
    return int(fields["SigBlk"], 16), int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)


def holds(path: str, seed: int, world: int = 1, elements: int = ELEMENTS) -> bool:
    state = {f"r{rank}.t{i}": torch.empty(elements) for rank in range(world) for i in range(TENSORS)}
    core.load(state, path)
    return all(torch.equal(state[f"r{rank}.t{i}"], values(seed, i, rank, elements)) for rank in range(world)
               for i in range(TENSORS))


def in_flight_signal(pids: list[int], signum: int, path: str) -> bool:
    """Stop ``pids``, send them ``signum`` and let them continue: it is delivered as they do, while the save of
    ``path`` is in flight where it was not visible while they were stopped (returned: whether it was not)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        in_flight = not core.is_complete(path)
        for pid in pids:
            os.kill(pid, signum)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    return in_flight


def test_signals_to_the_writer_alone_lose_no_save_from_its_spawn_on(tmp_path):
    """Each signal, sent to the writer alone, during a large save: the same writer commits every save, each
    loading bit for bit. And at its spawn: every signal sent as soon as the writer's process runs (before its
    interpreter has set its actions, where they are still blocked and pending), and the save that started it
    commits."""
    logs = tmp_path / "logs"
    for attempt in range(3):  # an attempt whose signals came after the writer set its actions proves nothing
        root = str(tmp_path / f"spawn{attempt}")
        child = start(logs, root, 20 + attempt, "returned", writer="none")[0]
        try:
            deadline = time.monotonic() + 120
            while not writers_of(child.pid):
                assert time.monotonic() < deadline and child.poll() is None, child.error_output()[-3000:]
            writer = writers_of(child.pid)[0]
            for signum in SIGNALS:
                os.kill(writer, signum)
            blocked, pending = signal_status(writer)
            in_window = all(blocked & pending & (1 << (signum - 1)) for signum in SIGNALS if signum != signal.SIGCONT)
            child.wait_for_line("returned")
            child.wait_for_line("committed", timeout=120)
            assert writers_of(child.pid) == [writer]
            assert holds(os.path.join(root, "next"), 20 + attempt)
        finally:
            child.kill()
            child.wait(30)
        if in_window:
            break
    else:
        pytest.fail("no attempt signalled the writer before it had set its actions")

    root = str(tmp_path / "rounds")
    rounds = 2 * len(SIGNALS)
    child = start(logs, root, 40, "rounds", env={"SURVIVAL_ROUNDS": str(rounds)})[0]
    waiting = list(SIGNALS)  # each until it landed during a save in flight
    try:
        child.wait_for_line("returned 0")
        writer = writers_of(child.pid)
        assert len(writer) == 1, writer
        for round in range(rounds):
            if round:
                child.wait_for_line(f"returned {round}")
            if waiting and in_flight_signal(writer, waiting[0], os.path.join(root, f"next{round}")):
                print(f"round {round}: {waiting.pop(0).name} to the writer during the save")
            child.wait_for_line(f"committed {round}")
        assert not waiting, f"{waiting} never landed during a save"
        assert writers_of(child.pid) == writer, "the writer did not survive every signal"
    finally:
        child.kill()
        child.wait(30)
    wait_until_gone(child.pid)
    for round in range(rounds):
        assert holds(os.path.join(root, f"next{round}"), 40 + round), f"next{round}"


def test_signals_to_every_process_of_the_job_lose_no_save_that_returned(tmp_path):
    """Each signal to every process of the job, the training process included, during a large save that returned
    (SIGUSR1 also on 2 ranks): where the signal's default action kills the training process, its orphaned writer
    commits the save and exits; elsewhere the save commits as usual. Each loads bit for bit."""
    logs, elements = tmp_path / "logs", 2 << 20  # 64 MiB a rank: in flight while the processes are stopped
    jobs = [(signum, 1) for signum in SIGNALS] + [(signal.SIGUSR1, 2)]
    started = {(signum, world): start(logs, str(tmp_path / f"{signum.name}-{world}"), 60 + index, "returned", world,
                                      {"SURVIVAL_GO": str(tmp_path / f"go-{signum.name}-{world}"),
                                       "SURVIVAL_ELEMENTS": str(elements)})
               for index, (signum, world) in enumerate(jobs)}
    try:
        for (signum, world), procs in started.items():  # started at once, saving one after the other
            root = str(tmp_path / f"{signum.name}-{world}")
            for proc in procs:
                proc.wait_for_line("ready")
            (tmp_path / f"go-{signum.name}-{world}").touch()
            for proc in procs:
                proc.wait_for_line("returned")
            everyone = [proc.pid for proc in procs] + writers_of(*(proc.pid for proc in procs))
            assert len(everyone) == 2 * world, everyone
            assert in_flight_signal(everyone, signum, os.path.join(root, "next")), f"{signum.name}: committed before"
        for (signum, world), procs in started.items():
            root = str(tmp_path / f"{signum.name}-{world}")
            wait_until(lambda: core.is_complete(os.path.join(root, "next")), 120, f"{signum.name}: not committed")
            assert holds(os.path.join(root, "next"), 60 + jobs.index((signum, world)), world, elements), signum.name
            if signum in DEFAULT_KILLS:  # killed by its default action: the orphan finished the save
                for proc in procs:
                    proc.wait(60)
                    assert proc.returncode == -signum, (signum.name, proc.returncode, proc.error_output()[-3000:])
                wait_until_gone(*(proc.pid for proc in procs))
            elif signum == signal.SIGINT:  # KeyboardInterrupt: the exit drain waited for the save
                for proc in procs:
                    proc.wait(60)
                    assert "KeyboardInterrupt" in proc.error_output()
    finally:
        for procs in started.values():
            for proc in procs:
                proc.kill()
                proc.wait(30)
    wait_until_gone(*(proc.pid for procs in started.values() for proc in procs))
