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

import concurrent.futures
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from asyncckpt import core
from dist_helper import free_port
from processes import Program
from survival_child import TENSORS, values
from test_survival import start, wait_until
from toy import ON_PATH
from writers import wait_until_gone, writers_of

SIGNALS = [signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGCONT, signal.SIGTERM, signal.SIGINT,
           signal.SIGPIPE]
DEFAULT_KILLS = {signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGTERM}  # a Python process's default action
ELEMENTS = 2 << 20  # 64 MiB a rank (8 tensors): a save still in flight when its processes are stopped


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
    """Each signal, sent to the writer alone, during a save in flight: the same writer commits every save, each
    loading bit for bit. And at its spawn: every signal sent as soon as the writer's process runs (before its
    interpreter has set its actions, where they are still blocked and pending), and the save that started it
    commits."""
    logs = tmp_path / "logs"
    for attempt in range(3):  # an attempt whose signals came after the writer set its actions proves nothing
        root = str(tmp_path / f"spawn{attempt}")
        child = start(logs, root, 20 + attempt, "returned", env={"SURVIVAL_ELEMENTS": str(ELEMENTS)}, writer="none")[0]
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
        wait_until_gone(child.pid)
        if in_window:
            break
    else:
        pytest.fail("no attempt signalled the writer before it had set its actions")

    root = str(tmp_path / "rounds")
    rounds = len(SIGNALS) + 3
    child = start(logs, root, 40, "rounds", env={"SURVIVAL_ROUNDS": str(rounds), "SURVIVAL_ELEMENTS": str(ELEMENTS)})[0]
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


def test_a_handler_that_saves_while_a_save_hands_its_buffer_to_the_writer_loses_neither(tmp_path, monkeypatch):
    """Lightning's SLURM requeue handler saves wherever SIGUSR1 lands, in the middle of another save too: here between
    the message that hands a snapshot buffer to the writer and that buffer's descriptors. Both saves commit."""
    from asyncckpt.core.client import writer_queue

    nested, sent = [], writer_queue.send_handle
    checkpointer = core.Checkpointer()

    def send_handle(conn, fd, pid):  # the signal comes as the first descriptor goes
        sent(conn, fd, pid)
        if not nested:
            nested.append(None)
            os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, lambda *_: nested.append(
        checkpointer.async_save({"w": torch.ones(1000)}, str(tmp_path / "hpc"))))
    monkeypatch.setattr(writer_queue, "send_handle", send_handle)
    try:
        outer = checkpointer.async_save({"w": torch.arange(1000.0)}, str(tmp_path / "outer"))
        outer.result()
        assert len(nested) == 2, "the handler did not run"
        nested[1].result()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        checkpointer.close()
    for name, value in (("outer", torch.arange(1000.0)), ("hpc", torch.ones(1000))):
        state = {"w": torch.zeros(1000)}
        core.load(state, str(tmp_path / name))
        assert torch.equal(state["w"], value), name


def test_signals_to_every_process_of_the_job_lose_no_save_that_returned(tmp_path):
    """Each signal to every process of the job, the training process included, during a large save that returned
    (SIGUSR1 also on 2 ranks): where the signal's default action kills the training process, its orphaned writer
    commits the save and exits; elsewhere the save commits as usual. Each loads bit for bit."""
    logs = tmp_path / "logs"
    jobs = [(signum, 1) for signum in SIGNALS] + [(signal.SIGUSR1, 2)]
    started = {(signum, world): start(logs, str(tmp_path / f"{signum.name}-{world}"), 60 + index, "returned", world,
                                      {"SURVIVAL_GO": str(tmp_path / f"go-{signum.name}-{world}"),
                                       "SURVIVAL_ELEMENTS": str(ELEMENTS)}, writer="none")  # the save starts it
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
            assert holds(os.path.join(root, "next"), 60 + jobs.index((signum, world)), world), signum.name
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


# ------------------------------------------------------------------------------------------ Lightning on SLURM
GRACE_S = 30.0  # SLURM's KillWait and Kubernetes' terminationGracePeriodSeconds, by default
JOB_ID = "4242"
SCONTROL = """#!/bin/sh
echo "$@" >> "$SCONTROL_CALLS"
"""
LIGHTNING_SLURM = ON_PATH + """
import os, sys, torch
import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.environments import SLURMEnvironment
from torch.utils.data import DataLoader, TensorDataset
from asyncckpt.adapters.lightning import AsyncCkptIO
from toy import body
root, width, plugin, references, signalled_after = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
torch.manual_seed(0)
class Lit(L.LightningModule):
    def __init__(self):
        super().__init__(); self.net = body(width)
    def training_step(self, batch, batch_idx):
        x, y = batch; return torch.nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self): return torch.optim.Adam(self.parameters())
def state(trainer):
    return {"state_dict": trainer.lightning_module.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
            "global_step": trainer.global_step}
class Report(Callback):
    def on_train_start(self, trainer, module):
        if trainer.global_step:  # the requeued job, resumed: what it holds, for the test to compare
            torch.save(state(trainer), os.path.join(references, "resumed.pt"))
            print(f"RESUMED {trainer.global_step}", flush=True); trainer.should_stop = True
class Saved(ModelCheckpoint):  # every step up to the one the signal follows
    def _save_checkpoint(self, trainer, filepath):
        name = os.path.basename(filepath)
        if trainer.global_step > int(signalled_after[len("step="):-len(".ckpt")]): return
        if name == signalled_after: torch.save(state(trainer), os.path.join(references, name))
        super()._save_checkpoint(trainer, filepath); print(f"SAVED {name}", flush=True)
class ReferenceIO(AsyncCkptIO):  # what Lightning's requeue handler saves, also kept by torch.save
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if os.path.basename(path).startswith("hpc_ckpt"):
            torch.save({"state_dict": checkpoint["state_dict"], "optimizer": checkpoint["optimizer_states"][0],
                        "global_step": checkpoint["global_step"]}, os.path.join(references, os.path.basename(path)))
        super().save_checkpoint(checkpoint, path, storage_options)
x = torch.randn(4096, 8)
trainer = L.Trainer(max_steps=100000, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, default_root_dir=root,
                    plugins=[SLURMEnvironment(auto_requeue=True)] + ([ReferenceIO()] if plugin == "async" else []),
                    callbacks=[Report(), Saved(dirpath=root, every_n_train_steps=1, save_top_k=-1, filename="{step}")])
trainer.fit(Lit(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2))
"""


def signal_job(job: Program, signum: int) -> None:
    """``signum`` to every process of the job: its training process and the writers (as SLURM signals a step)."""
    for pid in [job.pid, *writers_of(job.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def gone_within_grace(job: Program, since: float) -> float:
    """Seconds from ``since`` until the training process exited, waiting at most until the grace period ends."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        job.wait(max(0.0, since + GRACE_S - time.monotonic()))
    return time.monotonic() - since


def end_of_grace(job: Program) -> None:
    """SIGKILL to every process of the job left (the end of the grace period: the writers, which must have committed
    by then, too), and wait until none is left."""
    signal_job(job, signal.SIGKILL)
    job.wait(30)
    wait_until_gone(job.pid)


def slurm_environment(tmp_path, restarts: int = 0) -> dict:
    """A SLURM job step of one task, as ``srun`` starts it, with a stand-in ``scontrol`` that records its calls."""
    bin = tmp_path / "bin"
    if not bin.exists():
        bin.mkdir()
        (bin / "scontrol").write_text(SCONTROL)
        (bin / "scontrol").chmod(0o755)
    return {**os.environ, "PATH": f"{bin}:{os.environ['PATH']}", "SCONTROL_CALLS": str(tmp_path / "scontrol-calls"),
            "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_NNODES": "1", "SLURM_NODELIST": "127.0.0.1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
            "SLURM_NODEID": "0", "SLURM_RESTART_COUNT": str(restarts), "MASTER_PORT": str(free_port()),
            "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def lightning_requeue(tmp_path, width: int, plugin: str = "async", resume: bool = True) -> dict:
    """Lightning's SLURM auto-requeue as SLURM runs it: SIGUSR1 to every process of the job right after a save
    returned (``step=3.ckpt``); Lightning's handler saves ``hpc_ckpt_1.ckpt`` and calls ``scontrol requeue``; the
    requeue ends the job: SIGTERM to every process, SIGKILL to what is left after the grace period. Returns the
    figures (seconds from the SIGUSR1 to the hpc checkpoint on disk, from the SIGTERM to the training process's exit)
    and what is on disk; then (``resume``) the requeued job. ``plugin="native"``: Lightning's own synchronous save, for
    comparison (``python benchmarks/run.py survival --set parts=preemption``)."""
    root, references = tmp_path / "run", tmp_path / "references"
    references.mkdir(parents=True)
    script = tmp_path / "train.py"
    script.write_text(LIGHTNING_SLURM)
    argv = [sys.executable, str(script), str(root), str(width), plugin, str(references), "step=3.ckpt"]
    job = Program(argv, tmp_path / "logs", env=slurm_environment(tmp_path))
    calls, hpc = tmp_path / "scontrol-calls", root / "hpc_ckpt_1.ckpt"
    try:
        job.wait_for_line("SAVED step=3.ckpt", timeout=600)
        everyone = [job.pid, *writers_of(job.pid)]
        in_flight = in_flight_signal(everyone, signal.SIGUSR1, str(root / "step=3.ckpt"))
        signalled = time.monotonic()
        wait_until(lambda: calls.exists() and hpc.exists(), 120, "no requeue and hpc checkpoint after SIGUSR1")
        hpc_s, requeued = time.monotonic() - signalled, calls.read_text()
        killed = time.monotonic()  # the requeue ends the job
        signal_job(job, signal.SIGTERM)
        exited_s = gone_within_grace(job, killed)
    finally:
        end_of_grace(job)
    found = {"hpc_s": hpc_s, "exited_s": exited_s, "in_flight": in_flight, "requeued": requeued,
             "returncode": job.returncode, "error_output": job.error_output(), "references": references, "root": root}
    if resume:
        requeued_job = Program(argv, tmp_path / "logs", env=slurm_environment(tmp_path, restarts=1))
        found["resumed"] = requeued_job.next_line(timeout=600)
        requeued_job.wait(120)
    return found


def complaints(error_output: str) -> list[str]:
    """asyncckpt's failures and warnings in a program's stderr (its INFO lines aside)."""
    return [line for line in error_output.splitlines() if "asyncckpt" in line and any(
        word in line for word in ("failed", "Error", "Warning", "synchronously"))]


def same(reference: dict, found: dict) -> bool:
    """Whether two states (nested dicts and lists of tensors and values) are equal, bit for bit."""
    if isinstance(reference, torch.Tensor):
        return isinstance(found, torch.Tensor) and reference.dtype == found.dtype and torch.equal(reference, found)
    if isinstance(reference, dict):
        return isinstance(found, dict) and reference.keys() == found.keys() and all(
            same(value, found[key]) for key, value in reference.items())
    if isinstance(reference, (list, tuple)):
        return len(reference) == len(found) and all(same(a, b) for a, b in zip(reference, found))
    return reference == found


def test_lightning_slurm_auto_requeue_saves_requeues_and_resumes_bit_for_bit(tmp_path):
    """``SLURMEnvironment(auto_requeue=True)``, SIGUSR1 to every process right after ``step=3.ckpt``'s save returned:
    Lightning's handler saves ``hpc_ckpt_1.ckpt`` through the plugin and calls ``scontrol requeue`` with the job's id;
    the requeue's SIGTERM ends the run through Lightning's own path within the grace period, every save committed
    (``step=3.ckpt`` holding what it was given); the requeued job resumes from ``hpc_ckpt_1.ckpt``, bit for bit."""
    found = lightning_requeue(tmp_path, width=1 << 20)
    print({key: found[key] for key in ("hpc_s", "exited_s", "in_flight", "returncode")})
    assert found["in_flight"], "step=3.ckpt was on disk before the SIGUSR1: it proves nothing"
    assert found["requeued"].split() == ["requeue", JOB_ID]
    assert found["exited_s"] < GRACE_S, "the run did not end within the grace period"
    assert not complaints(found["error_output"]), found["error_output"][-3000:]
    root, references = found["root"], found["references"]
    for name in ("step=3.ckpt", "hpc_ckpt_1.ckpt"):
        saved = torch.load(root / name, weights_only=False)
        kept = {"state_dict": saved["state_dict"], "optimizer": saved["optimizer_states"][0],
                "global_step": saved["global_step"]}
        assert same(torch.load(references / name, weights_only=False), kept), name
    hpc = torch.load(references / "hpc_ckpt_1.ckpt", weights_only=False)
    assert found["resumed"] == f"RESUMED {hpc['global_step']}"
    assert same(hpc, torch.load(references / "resumed.pt", weights_only=False))


# ------------------------------------------------------------------------------------------ the Trainer's JIT checkpoint
TRAINER_JIT = ON_PATH + """
import os, sys, torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from asyncckpt.adapters.hf_trainer import AsyncCheckpointCallback
from toy import Endless, Net, body
root, width, plugin, references, mode, kind = sys.argv[1:7]
torch.manual_seed(0)
def keep(name, state, model, optimizer):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "global_step": state.global_step},
               os.path.join(references, name))
class Report(TrainerCallback):  # after the Trainer's JIT callback: it sees the JIT save just made
    saved = False
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if mode == "resume":
            keep("resumed.pt", state, model, optimizer); print(f"RESUMED {state.global_step}", flush=True)
            control.should_training_stop = True
    def _after_jit_save(self, state, control, model, optimizer):
        if mode == "run" and control.should_training_stop and not self.saved:
            self.saved = True; keep("jit.pt", state, model, optimizer); print(f"JIT checkpoint-{state.global_step}", flush=True)
    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._after_jit_save(state, control, model, optimizer)
    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._after_jit_save(state, control, model, optimizer)
    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._after_jit_save(state, control, model, optimizer)
        if state.global_step == 3: print("TRAINING", flush=True)
class OwnSave(Trainer):  # as TRL's trainers: a _save_checkpoint of its own, calling the Trainer's
    def _save_checkpoint(self, model, trial): super()._save_checkpoint(model, trial)
args = TrainingArguments(output_dir=root, per_device_train_batch_size=2, max_steps=100000, save_strategy="no",
                         enable_jit_checkpoint=True, report_to=[], use_cpu=True, disable_tqdm=True, logging_strategy="no")
callbacks = ([AsyncCheckpointCallback()] if plugin == "async" else []) + [Report()]
trainer = (OwnSave if kind == "subclass" else Trainer)(model=Net(body(int(width))), args=args,
                                                    train_dataset=Endless(), callbacks=callbacks)
trainer.train(resume_from_checkpoint=mode == "resume")
"""


def trainer_jit(tmp_path, width: int, plugin: str = "async", kind: str = "trainer", resume: bool = True) -> dict:
    """``TrainingArguments(enable_jit_checkpoint=True)``: SIGTERM to every process of the job while it trains
    (SLURM's ``--signal=TERM@<s>`` and ``scancel``; under Kubernetes the training process alone, the first of its
    container); the Trainer saves ``checkpoint-N`` at its next step (3 s after the signal, its ``kill_wait``) and
    stops; SIGKILL to what is left after the grace period. Then (``resume``) ``train(resume_from_checkpoint=True)``.
    Returns the figures (seconds from the SIGTERM to the checkpoint on disk and to the exit) and what is on disk."""
    root, references = tmp_path / "run", tmp_path / "references"
    references.mkdir(parents=True)
    script = tmp_path / "train.py"
    script.write_text(TRAINER_JIT)
    argv = [sys.executable, str(script), str(root), str(width), plugin, str(references)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    job = Program([*argv, "run", kind], tmp_path / "logs", env=env)
    try:
        job.wait_for_line("TRAINING", timeout=600)
        terminated = time.monotonic()
        signal_job(job, signal.SIGTERM)
        saved = job.next_line(timeout=GRACE_S)  # "JIT checkpoint-N", once its save returned
        path = root / saved.split()[-1]
        wait_until(lambda: path.exists() or job.poll() is not None, GRACE_S, "no JIT checkpoint within the grace period")
        committed_s = time.monotonic() - terminated if path.exists() else None
        exited_s = gone_within_grace(job, terminated)
    finally:
        end_of_grace(job)
    found = {"committed_s": committed_s, "exited_s": exited_s, "path": path, "returncode": job.returncode,
             "error_output": job.error_output(), "references": references}
    if resume:
        resumed = Program([*argv, "resume", kind], tmp_path / "logs", env=env)
        resumed.wait(600)
        found["resumed"] = resumed.lines()[0] if resumed.lines() else resumed.error_output()[-3000:]
    return found


def test_trainer_jit_checkpoint_on_sigterm_commits_within_the_grace_period_and_resumes_bit_for_bit(tmp_path):
    """``enable_jit_checkpoint=True`` with the callback, SIGTERM to every process: the JIT save is asynchronous (an
    asyncckpt checkpoint, committed), also where the Trainer's class has its own ``_save_checkpoint`` (TRL's); the
    run ends within the grace period with it committed, and resumes from it bit for bit."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both jobs at once
        runs = {kind: pool.submit(trainer_jit, tmp_path / kind, 65536, kind=kind, resume=kind == "trainer")
                for kind in ("trainer", "subclass")}
        found = {kind: run.result() for kind, run in runs.items()}
    for kind, run in found.items():
        print(kind, {key: run[key] for key in ("committed_s", "exited_s", "returncode")})
        assert run["returncode"] == 0 and run["exited_s"] < GRACE_S, (kind, run["error_output"][-3000:])
        assert not complaints(run["error_output"]), (kind, run["error_output"][-3000:])  # no failure, no fallback
        assert core.is_complete(str(run["path"])), kind  # committed by asyncckpt: not Transformers' own save
        assert os.listdir(run["path"]) and "checkpoint-is-incomplete.txt" not in os.listdir(run["path"])
    trainer = found["trainer"]
    saved = torch.load(trainer["references"] / "jit.pt", weights_only=False)
    assert trainer["resumed"] == f"RESUMED {saved['global_step']}" == f"RESUMED {trainer['path'].name.split('-')[1]}"
    assert same(saved, torch.load(trainer["references"] / "resumed.pt", weights_only=False))


# ------------------------------------------------------------------------------------------ Accelerate on Kubernetes
ACCELERATE_PREEMPTED = ON_PATH + """
import os, signal, sys, torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from asyncckpt.adapters.accelerate import enable_async_checkpointing
from toy import body
root, width, plugin, references, mode = sys.argv[1:6]
accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True))
if plugin == "async":
    enable_async_checkpointing(accelerator, memory_tier=True)
torch.manual_seed(0)
model = body(int(width))
optimizer = torch.optim.Adam(model.parameters())
model, optimizer = accelerator.prepare(model, optimizer)
def keep(name):
    if accelerator.is_main_process:
        torch.save({"model": accelerator.unwrap_model(model).state_dict(), "optimizer": optimizer.state_dict()},
                   os.path.join(references, name))
if mode == "resume":
    accelerator.load_state(); keep("resumed.pt")
    print(f"RESUMED checkpoint_{accelerator.project_configuration.iteration - 1}", flush=True); sys.exit()
if mode == "handler":  # docs/accelerate.md, Preemption
    signal.signal(signal.SIGTERM, lambda *_: accelerator.set_trigger())
for step in range(1, 100000):
    accelerator.backward(model(torch.randn(4, 8)).square().mean()); optimizer.step(); optimizer.zero_grad()
    if mode == "handler" and accelerator.check_trigger():
        keep("preempted.pt"); name = os.path.basename(accelerator.save_state())
        print(f"PREEMPTED {name}", flush=True)
        break
    if step % 2 == 0:
        name = os.path.basename(accelerator.save_state())
        if accelerator.is_main_process: print(f"SAVED {name}", flush=True)
accelerator.end_training()
"""


def descendants(pid: int) -> list[int]:
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    return []


def accelerate_in_a_pod(tmp_path, width: int, plugin: str = "async", mode: str = "handler",
                        resume: bool = True) -> dict:
    """A Kubernetes pod, as its runtime stops it: torchrun (2 processes) is the first process of a PID namespace of
    its own (its exit ends every process of the pod); SIGTERM goes to torchrun alone, which passes it to its workers'
    process groups (not to their writers); SIGKILL to every process after the grace period. The pod is then replaced:
    its memory root (``/dev/shm``) is gone, and the new one (torchrun again) resumes with ``load_state()``. ``mode``:
    "handler", the program does what docs/accelerate.md says (``set_trigger`` on SIGTERM, ``save_state`` and
    ``end_training``); "none", it keeps the default action. Returns the figures (seconds from the SIGTERM to the
    pod's end) and what is on disk."""
    root, references = tmp_path / "run", tmp_path / "references"
    references.mkdir(parents=True)
    memory = tempfile.mkdtemp(prefix="pod-", dir="/dev/shm" if os.path.isdir("/dev/shm") else tmp_path)
    script = tmp_path / "train.py"
    script.write_text(ACCELERATE_PREEMPTED)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "ASYNCCKPT_MEMORY_ROOT": memory}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    argv = [str(script), str(root), str(width), plugin, str(references)]
    pod = Program(["unshare", "--pid", "--fork", "--kill-child", *torchrun, str(free_port()), *argv, mode],
                  tmp_path / "logs", env=env)
    try:
        for _ in range(3):  # three saves, in memory only (every fifth is written durably)
            line = pod.next_line(timeout=600)
            assert line.startswith("SAVED"), (line, pod.error_output()[-3000:])
        first = descendants(pod.pid)[0]  # torchrun: PID 1 of the pod
        terminated = time.monotonic()
        os.kill(first, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            pod.wait(GRACE_S)
        ended_s = time.monotonic() - terminated
    finally:
        for pid in [*descendants(pod.pid), pod.pid]:  # the end of the grace period
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        pod.wait(30)
    lines = pod.lines()
    complete = core.is_complete if plugin == "async" else os.path.isdir  # (Accelerate's own: no commit record)
    durable = sorted((name for name in os.listdir(root / "checkpoints") if complete(str(root / "checkpoints" / name))),
                     key=lambda name: int(name.split("_")[1]))
    found = {"ended_s": ended_s, "lines": lines, "durable": durable, "error_output": pod.error_output(),
             "references": references}
    shutil.rmtree(memory)  # the new pod's /dev/shm
    if resume:
        os.mkdir(memory)
        try:
            resumed = Program([*torchrun, str(free_port()), *argv, "resume"], tmp_path / "logs", env=env)
            resumed.wait(600)
        finally:
            shutil.rmtree(memory)
        found["resumed"] = [line for line in resumed.lines() if line.startswith("RESUMED")] or \
            resumed.error_output()[-3000:]
    return found


def test_accelerate_under_torchrun_in_a_pod_keeps_its_newest_checkpoint_through_the_pods_replacement(tmp_path):
    """Kubernetes, with the memory tier: SIGTERM to the pod's first process (torchrun) alone; the program does what
    docs/accelerate.md says, so its last checkpoint, saved at the signal, is durable when the pod ends, within the
    grace period; the replaced pod, without the old one's memory, resumes from it bit for bit."""
    found = accelerate_in_a_pod(tmp_path, 65536)
    print({key: found[key] for key in ("ended_s", "durable", "resumed", "lines")})
    assert found["ended_s"] < GRACE_S, found["error_output"][-3000:]
    preempted = [line.split()[1] for line in found["lines"] if line.startswith("PREEMPTED")]
    assert len(set(preempted)) == 1, (found["lines"], found["error_output"][-3000:])  # both ranks, the same save
    assert found["durable"][-1] == preempted[0], found["durable"]
    assert set(found["resumed"]) == {f"RESUMED {preempted[0]}"}, found["resumed"]
    assert same(torch.load(found["references"] / "preempted.pt", weights_only=False),
                torch.load(found["references"] / "resumed.pt", weights_only=False))
