"""Kill trials: a save that returned survives the trainer's death, many times over (the survival scenario's
``stress`` part; ``tests/survival/test_survival.py`` and ``tests/survival/test_interrupt.py`` run a few of each kind).

  core, 1 rank     ``tests/helpers/survival_child.py`` saves a base, then ``async_save``; SIGKILL as soon as it
                   printed that the call returned
  core, 2 ranks    the same in a gloo group of 2; every rank killed at once once both returned
  first save       the same, where that ``async_save`` is the process's first save, which starts its writer
                   (1 and 2 ranks; a local directory, and a bucket of moto's S3 server started here)
  after idle stop  the same, where the writer of the base save stopped when idle and ``async_save`` starts another
  snapshot         killed in the middle of its snapshot copy (1 and 2 ranks): nothing may commit
  lightning, accelerate, hf_trainer
                   the programs of ``tests/helpers/programs/`` (as ``tests/survival/test_interrupt.py`` runs them): SIGKILL from inside once the save returned
                   (the Trainer: once the next step ended, when its overlapped optimizer snapshot is complete)
  sigterm          SIGTERM to the trainer's process group while a 1 GiB save is in flight, SIGKILL after a
                   30 s grace period if it still runs

A trial *counts* only if the checkpoint was not yet visible when the trainer was dead (otherwise it proves
nothing, and the state of that kind grows x2 for its next trials). Every trial requires the checkpoint
committed, intact (``asyncckpt verify``'s checks) and loading equal to what was saved (a killed snapshot:
nothing but ``base`` left after ``clean``), and no writer process naming the dead trainer's pid left.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "tests" / "helpers"), str(REPO / "tests" / "survival")]

from harness.util import dying, log  # noqa: E402
from survival_child import TENSORS, values  # noqa: E402
import programs  # noqa: E402
from processes import Program  # noqa: E402
from s3_server import S3Server  # noqa: E402
from test_survival import CHILD, kill, start, writers_of  # noqa: E402

from asyncckpt import core  # noqa: E402
from asyncckpt.core.storage import leftovers, orphans  # noqa: E402
from asyncckpt.core.verify import integrity  # noqa: E402

CORE_ELEMENTS = 8 << 20  # per tensor, 8 tensors per rank: 256 MiB, as in tests/survival/test_survival.py
CORE_ELEMENTS_MAX = 64 << 20  # 2 GiB per rank
S3_ELEMENTS, S3_ELEMENTS_MAX = 2 << 20, 16 << 20  # 64 MiB, 512 MiB per rank (moto's server takes ~10 s for 512 MiB)
ADAPTER_WIDTH, ADAPTER_WIDTH_MAX = 65536, 262144  # model + Adam: ~0.4 GiB, ~1.6 GiB
SIGTERM_ELEMENTS = 32 << 20  # 1 GiB
GRACE_S = 30.0
# The checkpoint each adapter program hands over before it dies, relative to its root.
KEPT = {"lightning": "last.ckpt", "accelerate": "checkpoints/checkpoint_0", "hf_trainer": "checkpoint-1"}


class TrialFailed(AssertionError):
    pass


def check(condition: bool, what: str) -> None:
    if not condition:
        raise TrialFailed(what)


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def no_writer_left(procs: list[Program], timeout: float = 90) -> float:
    """Seconds until no writer process naming one of these trainers' pids runs (fails the trial past ``timeout``)."""
    t0 = time.monotonic()
    check(wait_until(lambda: not writers_of(*(p.pid for p in procs)), timeout),
          f"a writer of trainer(s) {[p.pid for p in procs]} still runs {timeout:.0f} s after the kill")
    return time.monotonic() - t0



def visible_when_dead(procs: list[Program], visible: Callable[[], bool],
                      timeout: float = 300) -> tuple[bool, float]:
    """Whether the checkpoint was visible at the moment every trainer had died (polled each ms), and
    that moment; then reap them. Waiting for the exit status instead would also wait for the kernel to
    free their memory, which takes up to a second for a few GiB while the writers go on."""
    deadline = time.monotonic() + timeout
    while not all(dying(proc.pid) for proc in procs):
        check(time.monotonic() < deadline, f"trainer(s) {[p.pid for p in procs]} still alive after {timeout:.0f} s")
        time.sleep(0.001)
    dead, seen = time.monotonic(), visible()
    for proc in procs:
        proc.wait(60)
    return seen, dead


def check_log(lines: list[str], name: str) -> None:
    """The orphans' log says nothing failed. It holds lines only where a writer learnt of its trainer's
    death (the kernel tells it once the trainer's memory is freed) before that save committed."""
    check(not any(f"not committed {name}" in line or "gave up" in line for line in lines), f"the orphans' log: {lines}")


def logged_commit(row: dict) -> bool:
    return any("committed " in line and "not committed" not in line for line in row.get("log", []))


def check_intact(path: str) -> None:
    report = integrity.check(path)
    check(report.status == "COMPLETE" and report.intact and not report.unverified and not report.differences,
          f"{path}: {report.status}, problems {report.problems}, unverified {report.unverified}, "
          f"differences {report.differences}")


def check_core_holds(path: str, seed: int, world: int, elements: int) -> None:
    expected = {f"r{rank}.t{i}": values(seed, i, rank, elements) for rank in range(world) for i in range(TENSORS)}
    state = {key: torch.empty(elements) for key in expected}
    core.load(state, path)
    for key, value in expected.items():
        check(torch.equal(state[key], value), f"{path}: {key} differs from what the save call was given")


def logged(root: str, name: str) -> list[str]:
    """The lines of the orphans' logs under ``root`` that name ``name``."""
    lines = []
    for parent, _, files in os.walk(root):
        if orphans.LOG_NAME in files:
            with open(os.path.join(parent, orphans.LOG_NAME)) as f:
                lines += [line.rstrip("\n") for line in f if name in line]
    return lines


# ------------------------------------------------------------------------------------------ trials
def core_returned(root: str, seed: int, world: int, elements: int, writer: str = "running", url: str = "") -> dict:
    """Trainers killed once ``async_save`` returned; ``writer``: what that save finds (``survival_child``).
    With ``url`` the checkpoints go there (an object store) instead of ``root``."""
    place = url or root
    procs = start(f"{root}.logs", place, seed, "returned", world, env={"SURVIVAL_ELEMENTS": str(elements)}, writer=writer)
    path = f"{place}/next" if url else os.path.join(place, "next")
    try:
        for proc in procs:
            proc.wait_for_line("returned")
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
        visible, t_dead = visible_when_dead(procs, lambda: core.is_complete(path))
    finally:
        kill(procs)
    check(wait_until(lambda: core.is_complete(path), 120), f"{path} not committed 120 s after the kill")
    commit_s = time.monotonic() - t_dead
    writers_s = no_writer_left(procs)
    check(core.latest_checkpoint(place) == path, f"latest_checkpoint is {core.latest_checkpoint(place)}, not {path}")
    check_intact(path)
    check_core_holds(path, seed, world, elements)
    log_lines = logged(place, "next") if not url else []  # an orphan logs beside local checkpoints only
    check_log(log_lines, "next")
    left = leftovers.find(place)
    check(not left, f"hidden leftovers after the commit: {left}")
    return {"visible_at_death": visible, "commit_after_death_s": commit_s, "writers_gone_s": writers_s,
            "gib": world * TENSORS * elements * 4 / 2**30, "log": log_lines}


def core_snapshot(root: str, seed: int, world: int, elements: int) -> dict:
    procs = start(f"{root}.logs", root, seed, "snapshot", world, env={"SURVIVAL_ELEMENTS": str(elements)})
    try:
        for proc in procs:
            proc.wait_for_line("copying")
    finally:
        kill(procs)
    writers_s = no_writer_left(procs)
    path = os.path.join(root, "next")
    check(not os.path.exists(path), f"{path} exists after a kill during its snapshot")
    check(core.latest_checkpoint(root) == os.path.join(root, "base"), f"latest_checkpoint is {core.latest_checkpoint(root)}")
    leftovers.clean(root)
    left = sorted(set(os.listdir(root)) - {orphans.LOG_NAME})
    check(left == ["base"], f"after clean: {left}")
    return {"visible_at_death": False, "committed": False, "writers_gone_s": writers_s,
            "gib": world * TENSORS * elements * 4 / 2**30}


def _tensors_equal(saved: Any, reference: Any, where: str) -> int:
    """Compare nested tensors; returns how many were compared."""
    if isinstance(reference, torch.Tensor):
        check(isinstance(saved, torch.Tensor) and torch.equal(saved, reference), f"{where} differs from what was saved")
        return 1
    if isinstance(reference, dict):
        check(isinstance(saved, dict) and set(saved) >= set(reference), f"{where}: keys {list(reference)} not all saved")
        return sum(_tensors_equal(saved[k], v, f"{where}.{k}") for k, v in reference.items())
    return 0


def adapter_holds(adapter: str, path: Path, reference: dict) -> int:
    """The adapter's checkpoint at ``path`` holds the reference's model and optimizer tensors."""
    if adapter == "lightning":
        checkpoint = torch.load(path, weights_only=False)
        model, optimizer = checkpoint["state_dict"], checkpoint["optimizer_states"][0]
    else:
        from safetensors.torch import load_file

        model = load_file(path / "model.safetensors")
        optimizer = torch.load(path / ("optimizer.bin" if adapter == "accelerate" else "optimizer.pt"), weights_only=False)
    compared = _tensors_equal(model, reference["model"], f"{path} model")
    compared += _tensors_equal(optimizer["state"], reference["optimizer"]["state"], f"{path} optimizer state")
    check(compared >= 2 * len(reference["model"]), f"{path}: only {compared} tensors compared")
    return compared


def adapter_trial(root: str, seed: int, adapter: str, width: int) -> dict:
    os.makedirs(root)
    script, run, reference = programs.path(adapter), Path(root) / "run", Path(root) / "reference.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "WIDTHS": f"{width},512", "SEED": str(seed),
           "KILL_AT": "next step" if adapter == "hf_trainer" else "saved", "REFERENCE": str(reference)}
    proc = Program([sys.executable, str(script), "run", str(run)], f"{root}.logs", env=env, start_new_session=True)
    kept = run / KEPT[adapter]
    committed = (lambda: kept.is_file()) if adapter == "lightning" else (lambda: core.is_complete(str(kept)))
    try:  # it kills itself
        visible, t_dead = visible_when_dead([proc], committed)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    check(proc.returncode == -signal.SIGKILL, f"the program exited {proc.returncode}, not by SIGKILL")
    saved = [line.split()[1] for line in proc.lines() if line.startswith("SAVED ")]
    check(kept.name in saved, f"{kept.name} was not handed over before the kill (saved {saved}): "
                              f"{proc.error_output()[-2000:]}")
    check(wait_until(committed, 120), f"{kept} was handed over before the kill and is not committed")
    commit_s = time.monotonic() - t_dead
    writers_s = no_writer_left([proc])
    check_intact(str(kept))
    compared = adapter_holds(adapter, kept, torch.load(reference, weights_only=False))
    state_gib = os.path.getsize(reference) / 2**30
    log_lines = logged(str(run), kept.name)
    check_log(log_lines, kept.name)
    return {"visible_at_death": visible, "commit_after_death_s": commit_s, "writers_gone_s": writers_s,
            "tensors_compared": compared, "reference_gib": state_gib, "log": log_lines}


def sigterm_trial(root: str, seed: int, elements: int) -> dict:
    """SIGTERM to the trainer's process group while the save is in flight; SIGKILL after the grace period."""
    path = os.path.join(root, "next")
    proc = Program([sys.executable, CHILD, root, str(seed), "returned"], f"{root}.logs",
                   env={**os.environ, "SURVIVAL_ELEMENTS": str(elements)}, start_new_session=True)
    try:
        proc.wait_for_line("returned")
        os.killpg(proc.pid, signal.SIGTERM)  # what a scheduler's preemption sends
        t_term = time.monotonic()
        try:
            visible, t_dead = visible_when_dead([proc], lambda: core.is_complete(path), timeout=GRACE_S)
            needed_kill = False
        except TrialFailed:  # alive past the grace period
            os.killpg(proc.pid, signal.SIGKILL)
            visible, t_dead = visible_when_dead([proc], lambda: core.is_complete(path))
            needed_kill = True
        dead_s = t_dead - t_term
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    check(wait_until(lambda: core.is_complete(path), 120), f"{path} not committed after SIGTERM")
    committed_s = time.monotonic() - t_term
    writers_s = no_writer_left([proc])
    check_intact(path)
    check_core_holds(path, seed, 1, elements)
    log_lines = logged(root, "next")
    check_log(log_lines, "next")
    return {"log": log_lines, "visible_at_death": visible, "trainer_dead_s": dead_s, "trainer_returncode": proc.returncode,
            "sigkill_needed": needed_kill, "committed_after_sigterm_s": committed_s,
            "within_grace": committed_s <= GRACE_S, "writers_gone_s": writers_s, "gib": TENSORS * elements * 4 / 2**30}


# ------------------------------------------------------------------------------------------ driver
def run_trials(plan: list[tuple[str, Callable[[str, int, int], dict], int, int, int]], base: str,
               rng: random.Random) -> list[dict]:
    """Run each kind's trials; a kind whose checkpoint was visible at the kill grows its state (x2)."""
    results = []
    for kind, trial, count, size, size_max in plan:
        for index in range(count):
            seed = rng.randrange(10**6)
            root = os.path.join(base, f"{kind}-{index}")
            log(f"{kind} trial {index}: seed {seed}, size {size}")
            t0 = time.monotonic()
            row: dict[str, Any] = {"kind": kind, "trial": index, "seed": seed, "size": size}
            try:
                row.update(trial(root, seed, size))
                row["ok"] = True
            except Exception as e:
                row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-3000:])
            row["wall_s"] = time.monotonic() - t0
            row["counted"] = row["ok"] and not row.get("visible_at_death", True) if kind != "snapshot" else row["ok"]
            log(f"  {'ok' if row['ok'] else 'FAILED: ' + row['error']}; visible at death: {row.get('visible_at_death')}; "
                f"{row['wall_s']:.1f} s")
            results.append(row)
            shutil.rmtree(root, ignore_errors=True)
            shutil.rmtree(f"{root}.logs", ignore_errors=True)
            if row.get("visible_at_death") and size < size_max:
                size = min(size * 2, size_max)
    return results


def summarize(rows: list[dict]) -> dict:
    kinds: dict[str, dict] = {}
    for row in rows:
        k = kinds.setdefault(row["kind"], {"trials": 0, "ok": 0, "counted": 0, "visible_at_death": 0, "logged": 0,
                                           "failed": [], "sizes": []})
        k["logged"] += row["counted"] and logged_commit(row)
        k["trials"] += 1
        k["ok"] += row["ok"]
        k["counted"] += row["counted"]
        k["visible_at_death"] += bool(row.get("visible_at_death"))
        if row["size"] not in k["sizes"]:
            k["sizes"].append(row["size"])
        if not row["ok"]:
            k["failed"].append({"trial": row["trial"], "seed": row["seed"], "error": row["error"]})
        for key in ("commit_after_death_s", "writers_gone_s", "committed_after_sigterm_s"):
            if key in row:
                k.setdefault(key + "_max", 0.0)
                k[key + "_max"] = max(k[key + "_max"], row[key])
    return kinds


def trials(seed: int, scale: float, only: str, root: str) -> dict:
    """Every kind's trials (``only``: a comma-separated subset), ``scale`` x each kind's count; the trials'
    seeds drawn from ``seed``. The rows and each kind's summary."""
    rng = random.Random(seed)

    def n(count: int) -> int:
        return max(1, round(count * scale))

    s3: list[str] = []  # a bucket of the S3 server, started when a kind needs it

    def bucket() -> str:
        if not s3:
            server = S3Server()
            os.environ.update(server.env())
            s3.append(f"s3://{server.new_bucket()}")
        return s3[0]

    def core_kind(world: int, writer: str = "running", on_s3: bool = False):
        def trial(place: str, trial_seed: int, size: int) -> dict:
            return core_returned(place, trial_seed, world, size, writer,
                                 f"{bucket()}/{os.path.basename(place)}" if on_s3 else "")
        return trial

    plan = [
        ("core 1 rank", core_kind(1), n(8), CORE_ELEMENTS, CORE_ELEMENTS_MAX),
        ("core 2 ranks", core_kind(2), n(6), CORE_ELEMENTS, CORE_ELEMENTS_MAX),
        ("first save 1 rank", core_kind(1, "none"), n(20), CORE_ELEMENTS, CORE_ELEMENTS_MAX),
        ("first save 2 ranks", core_kind(2, "none"), n(20), CORE_ELEMENTS, CORE_ELEMENTS_MAX),
        ("first save 1 rank s3", core_kind(1, "none", True), n(20), S3_ELEMENTS, S3_ELEMENTS_MAX),
        ("first save 2 ranks s3", core_kind(2, "none", True), n(20), S3_ELEMENTS, S3_ELEMENTS_MAX),
        ("after idle stop 1 rank", core_kind(1, "idle-stopped"), n(5), CORE_ELEMENTS, CORE_ELEMENTS_MAX),
        ("after idle stop 2 ranks", core_kind(2, "idle-stopped"), n(5), CORE_ELEMENTS, CORE_ELEMENTS_MAX),
        ("snapshot", lambda place, trial_seed, size: core_snapshot(place, trial_seed, 1 + trial_seed % 2, size), n(5),
         CORE_ELEMENTS, CORE_ELEMENTS),
        *[(name, lambda place, trial_seed, width, name=name: adapter_trial(place, trial_seed, name, width), n(4),
           ADAPTER_WIDTH, ADAPTER_WIDTH_MAX) for name in ("lightning", "accelerate", "hf_trainer")],
        ("sigterm", sigterm_trial, n(2), SIGTERM_ELEMENTS, SIGTERM_ELEMENTS),
    ]
    if only:
        plan = [p for p in plan if p[0] in only.split(",")]
    rows = run_trials(plan, root, rng)
    return {"seed": seed, "kinds": summarize(rows), "trials": rows}
