"""Surviving the trainer's death: the exposure window, the first save of a process, and kill trials.

The exposure window: after the save call returned, for how long the trainer's death (kill -9, the OOM
killer, a crash, SIGKILL at the end of a preemption's grace period) still loses the save. A synchronous save
has none once it returned, but the call itself takes T; an asynchronous save whose writer dies with its
trainer has ``durable - stall``; one whose writer finishes and commits what it was handed has none. Parts:

  timing      a warm ``async_save`` of 1 GiB (16 tensors; ~8,000 tensors): stall and time to durable, and
              ``torch.save`` + fsync (the synchronous save) after each, in the same processes
  kills       the trainer SIGKILLs itself the moment ``async_save`` returned: was the checkpoint visible
              then, is it committed afterwards, does it load equal to what was saved, is any writer left
  restart     saves 1.5 s apart with ``writer_idle_timeout=0.5`` (the writer stopped, started again inside the
              call) against the default (the writer still runs), each in a process of its own
  first_save  a process's first ``async_save`` (it starts the writer) and its second, each rep a fresh process;
              and the process killed at the first save's return
  stress      the kill trials of ``scenarios/_kill_trials.py``, many kinds, many times
  preemption  each framework's own preemption path, as its scheduler runs it, with asyncckpt and with the
              framework's own synchronous save of the same state (``tests/survival/test_preemption.py`` drives each):
              Lightning's SLURM auto-requeue (SIGUSR1, then the requeue's SIGTERM), the Trainer's JIT checkpoint
              (SIGTERM), Accelerate's documented handler under torchrun in a pod (SIGTERM to torchrun alone)
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from harness import Option, Scenario, report_now
from harness.report import arm_name, bars, each, fmt, table
from harness.util import GiB, dying, log, median, now
from harness.workloads import make_adam, make_large, same_state, zeros_like_state

GRACE_S = 30.0
RESTART_GAP_S, IDLE_TIMEOUT_S = 1.5, 0.5
PREEMPTIONS = {  # path: how its scheduler stops it, and what the trial's two figures time
    "lightning": "Lightning's SLURM auto-requeue: SIGUSR1 to every process right after a save returned; the save: "
                 "until `hpc_ckpt_1.ckpt` is complete; then the requeue's SIGTERM to every process; the end: from "
                 "that SIGTERM until the job's last process is gone",
    "hf_trainer": "the Trainer's `enable_jit_checkpoint=True`: SIGTERM to every process; the save: until the JIT "
                  "`checkpoint-N` is complete (the Trainer waits 3 s before it saves); the end: until the job's last "
                  "process is gone",
    "accelerate": "Accelerate with the handler docs/accelerate.md shows, 2 processes under torchrun, the first process "
                  "of a pod (a PID namespace): SIGTERM to torchrun alone; the save and the end: until the pod ended "
                  "(its last checkpoint durable then; asyncckpt's with the memory tier on)",
}


def make(workload: str, gib: float) -> dict:
    return make_large(int(gib * GiB), 16) if workload == "16 tensors" else make_adam(int(gib * GiB))


def flipped(state: Any) -> Any:
    """The state the killed save holds: every tensor negated in place (the warm-up save held the original)."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.neg_()
    for value in state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else []:
        flipped(value)
    return state


def writers_of(pid: int) -> list[int]:
    """asyncckpt processes (writers, of either revision) whose command line names ``pid``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if str(pid).encode() in argv and any(a.startswith(b"asyncckpt.") for a in argv):
            found.append(int(entry))
    return found



# ------------------------------------------------------------------------------------------ children
def timing(workload: str, gib: float, reps: int, root: str) -> dict:
    import shutil

    from asyncckpt.core import Checkpointer
    from harness.peers import torch_save_fsync

    state = make(workload, gib)
    checkpointer = Checkpointer()
    checkpointer.save(state, os.path.join(root, "warm"))  # plan and snapshot buffer: warm from here on
    out: dict[str, list[float]] = {"stall_s": [], "durable_s": [], "native_s": []}
    for rep in range(reps):
        path = os.path.join(root, f"rep{rep}")
        t0 = now()
        handle = checkpointer.async_save(state, path)
        out["stall_s"].append(now() - t0)
        handle.result()
        out["durable_s"].append(now() - t0)
        shutil.rmtree(path)
        t0 = now()
        torch_save_fsync(state, os.path.join(root, "native.pt"))  # leaves the disk and page cache as a save does
        out["native_s"].append(now() - t0)
        os.unlink(os.path.join(root, "native.pt"))
    checkpointer.close()
    return out


def killed_at_return(workload: str, gib: float, root: str, first: bool) -> None:
    """Save (unless ``first``), then ``async_save`` of the flipped state and SIGKILL at once from inside."""
    from asyncckpt import core

    state = make(workload, gib)
    checkpointer = core.Checkpointer()
    if not first:
        checkpointer.save(state, os.path.join(root, "warm"))
    flipped(state)
    t0 = now()
    checkpointer.async_save(state, os.path.join(root, "next"))
    report_now({"stall_s": now() - t0, "visible_at_death": core.is_complete(os.path.join(root, "next"))})
    os.kill(os.getpid(), signal.SIGKILL)  # no scheduling delay between the return and the death


def restart(workload: str, gib: float, reps: int, root: str, idle_timeout: float) -> dict:
    """Saves ``RESTART_GAP_S`` apart on a Checkpointer whose writer stops after ``idle_timeout`` s idle (0: the
    default, it runs on); whether the writer still ran before each (the process's only child)."""
    import shutil

    import psutil

    from asyncckpt.core import Checkpointer

    state = make(workload, gib)
    checkpointer = Checkpointer(writer_idle_timeout=idle_timeout) if idle_timeout else Checkpointer()
    checkpointer.save(state, os.path.join(root, "warm"))
    out: dict[str, list] = {"stall_s": [], "durable_s": [], "writer_ran": []}
    for rep in range(reps):
        time.sleep(RESTART_GAP_S)  # a training interval: an idle writer stops within it
        out["writer_ran"].append(any(p.status() != psutil.STATUS_ZOMBIE for p in psutil.Process().children()))
        path = os.path.join(root, f"rep{rep}")
        t0 = now()
        handle = checkpointer.async_save(state, path)
        out["stall_s"].append(now() - t0)
        handle.result()
        out["durable_s"].append(now() - t0)
        shutil.rmtree(path)
    checkpointer.close()
    return out


def first_save(gib: float, root: str) -> dict:
    from asyncckpt import core

    state = make("16 tensors", gib)
    checkpointer = core.Checkpointer()
    out = {}
    for which in ("first", "second"):
        t0 = now()
        handle = checkpointer.async_save(state, os.path.join(root, which))
        out[f"{which}_stall_s"] = now() - t0
        handle.result()
        out[f"{which}_durable_s"] = now() - t0
    checkpointer.close()
    return out


def preemption(path: str, plugin: str, gib: float, root: str) -> dict:
    """One preemption through ``path``'s own handler (``PREEMPTIONS``), its state (a model and Adam) of ``gib`` GiB,
    saved by asyncckpt (``plugin="async"``, with the memory tier for Accelerate) or by the framework itself."""
    sys.path[:0] = [str(Path(__file__).resolve().parents[2] / "tests" / folder) for folder in ("helpers", "survival")]
    import test_preemption as trial

    width, tmp = max(1024, int(gib * GiB / 120)), Path(root)  # Linear(8, w) + Linear(w, 1), Adam: 3 x 4 B x 10 w
    if path == "lightning":
        found = trial.lightning_requeue(tmp, width, plugin, resume=False)
        saved_s, gone_s = found["hpc_s"], found["exited_s"]
        ok = found["requeued"].split() == ["requeue", trial.JOB_ID] and (tmp / "run" / "step=3.ckpt").exists()
    elif path == "hf_trainer":
        found = trial.trainer_jit(tmp, width, plugin, resume=False)
        saved_s, gone_s, ok = found["committed_s"], found["exited_s"], found["returncode"] == 0
    else:
        found = trial.accelerate_in_a_pod(tmp, width, plugin, resume=False)
        preempted = [line.split()[1] for line in found["lines"] if line.startswith("PREEMPTED")]
        saved_s = gone_s = found["ended_s"]
        ok = bool(preempted) and found["durable"][-1:] == preempted[:1]
    return {"saved_s": saved_s, "gone_s": gone_s, "ok": bool(ok and gone_s < trial.GRACE_S)}


def stress(seed: int, scale: float, only: str, root: str) -> dict:
    from scenarios import _kill_trials

    return _kill_trials.trials(seed, scale, only, root)


# ------------------------------------------------------------------------------------------ the sitting
def kill_trial(sitting, revision, workload: str, gib: float, expected: dict, first: bool) -> dict:
    """One kill at return; ``expected``: the state the killed save held."""
    from asyncckpt import core

    root = sitting.directory(f"kill{time.monotonic_ns()}")
    path = os.path.join(root, "next")
    child = sitting.spawn("killed_at_return", revision=revision, workload=workload, gib=gib, root=root, first=first)
    while not dying(child.pid):
        time.sleep(0.001)
    t_dead, visible_now = time.monotonic(), core.is_complete(path)
    committed_at, deadline = None, t_dead + 120
    while committed_at is None and time.monotonic() < deadline:  # until committed, or no writer is left to commit
        if core.is_complete(path):
            committed_at = time.monotonic()
        elif child.process.poll() is not None and not writers_of(child.pid):
            break
        time.sleep(0.01)
    child.process.wait(120)
    reported = child.report()
    if child.process.returncode != -signal.SIGKILL or reported is None:
        raise RuntimeError(f"the kill child exited {child.process.returncode} before its save returned: {child.log_tail()}")
    while writers_of(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    equal = None
    if committed_at is not None:
        target = zeros_like_state(expected)
        core.load(target, path)
        equal = same_state(target, expected)
    return {"stall_s": reported["stall_s"], "visible_at_death": reported["visible_at_death"] or visible_now,
            "committed": committed_at is not None, "loads_equal": equal,
            "commit_after_death_s": None if committed_at is None else committed_at - t_dead,
            "writers_left": len(writers_of(child.pid))}


def measure(sitting) -> dict:
    o = sitting.o
    parts = o.parts.split(",")
    out: dict = {"workloads": {}}
    comparing = len(sitting.revisions) > 1
    for workload in o.workloads.split(","):
        res = out["workloads"][workload] = {}
        if "timing" in parts:
            with sitting.phase(f"timing, {workload}"):
                for _, run in sitting.abba(sitting.runs(["asyncckpt"], {"asyncckpt"}), 2):
                    found = sitting.child("timing", revision=run.revision, workload=workload, gib=o.gib, reps=o.reps,
                                          root=sitting.directory(f"timing{time.monotonic_ns()}"))
                    entry = res.setdefault("timing", {}).setdefault(run.label, {"stall_s": [], "durable_s": [], "native_s": []})
                    for key in entry:
                        entry[key] += found[key]
                    log(f"  {run.label}: stall {each(found['stall_s'])}, durable {each(found['durable_s'])}")
        if "kills" in parts:
            expected = flipped(make(workload, o.gib))
            with sitting.phase(f"kills, {workload}"):
                for run in sitting.runs(["asyncckpt"], {"asyncckpt"}):
                    res.setdefault("kills", {})[run.label] = trials = []
                    for _ in range(o.kills if run.revision is sitting.after else o.base_kills):
                        trials.append(kill_trial(sitting, run.revision, workload, o.gib, expected, first=False))
                        log(f"  kill {run.label}: {trials[-1]}")
            del expected
        if "restart" in parts:
            with sitting.phase(f"restart, {workload}"):
                res["restart"] = {kind: sitting.child("restart", workload=workload, gib=o.gib, reps=o.reps,
                                                      root=sitting.directory(f"restart{time.monotonic_ns()}"),
                                                      idle_timeout=timeout)
                                  for kind, timeout in (("warm", 0.0), ("restart", IDLE_TIMEOUT_S))}
    if "first_save" in parts:
        runs = sitting.runs(["asyncckpt"], {"asyncckpt"})
        first = out["first_save"] = {"timing": {r.label: [] for r in runs}, "kills": {r.label: [] for r in runs}}
        expected = flipped(make("16 tensors", o.gib))
        with sitting.phase("first save"):
            for _, run in sitting.abba(runs, o.reps if comparing else 1):
                first["timing"][run.label].append(sitting.child("first_save", revision=run.revision, gib=o.gib,
                                                                root=sitting.directory(f"first{time.monotonic_ns()}")))
            for _, run in sitting.abba(runs, o.kills):
                first["kills"][run.label].append(kill_trial(sitting, run.revision, "16 tensors", o.gib, expected, True))
                time.sleep(1)
    if "preemption" in parts:
        out["preemption"] = found = {path: {"native": [], "async": []} for path in o.preemptions.split(",")}
        with sitting.phase("preemption"):
            for _, (path, plugin) in sitting.abba([(p, a) for p in found for a in ("native", "async")], o.reps):
                found[path][plugin].append(sitting.child("preemption", path=path, plugin=plugin, gib=o.gib,
                                                         root=sitting.directory(f"preempt{time.monotonic_ns()}")))
                log(f"  {path} {plugin}: {found[path][plugin][-1]}")
    if "stress" in parts:
        with sitting.phase("kill trials"):
            out["stress"] = sitting.child("stress", seed=o.seed, scale=o.stress_scale, only=o.stress_kinds,
                                          root=sitting.directory("stress"), timeout=6 * 3600)
    return out


# ------------------------------------------------------------------------------------------ the page
def render(result: dict) -> str:
    f, o = result["figures"], result["options"]
    lines: list[str] = []
    for workload, res in f["workloads"].items():
        if not res:
            continue
        lines += [f"## {o['gib']:g} GiB in {workload}", ""]
        timing = res.get("timing", {})
        if timing:
            native = median(v for t in timing.values() for v in t["native_s"])
            rows = [["`torch.save` + fsync (synchronous)", fmt(native, ".2f"), "=", "0"]]
            for label, t in timing.items():
                stall, durable = median(t["stall_s"]), median(t["durable_s"])
                kills = res.get("kills", {}).get(label, [])
                counted = [k for k in kills if not k["visible_at_death"]]
                ok = [k for k in counted if k["committed"] and k["loads_equal"] and not k["writers_left"]]
                window = "**0**" if counted and len(ok) == len(counted) else f"**{durable - stall:.2f}** (durable − stall)"
                rows.append([arm_name(label, {"asyncckpt": "asyncckpt `async_save`"}, result), fmt(stall), fmt(durable, ".2f"),
                             f"{window} ({len(ok)}/{len(counted)} kills at return committed)"])
            lines += [f"{len(next(iter(timing.values()))['stall_s'])} saves per revision in two processes (ABBA); seconds, "
                      "medians.", "", *table(["save", "the call blocks", "durable after the call",
                                              "exposure window after it returned"], rows)]
            for label, t in timing.items():
                lines.append(f"- {label}: stall {each(t['stall_s'])}; durable {each(t['durable_s'], '.2f')}.")
            stall = median(timing.get("asyncckpt", {}).get("stall_s", []))
            durable = median(timing.get("asyncckpt", {}).get("durable_s", []))
            if stall is not None:
                lines += ["", f"A {GRACE_S:.0f} s SIGTERM grace period: the synchronous save needs {native:.1f} s of it "
                          f"({100 * native / GRACE_S:.0f}%) before training can stop; asyncckpt needs the stall, {stall:.2f} s "
                          f"({100 * stall / GRACE_S:.1f}%), and its writer commits within {durable:.1f} s of the call, "
                          "through the grace period and past the trainer's exit.", ""]
        for label, kills in res.get("kills", {}).items():
            counted = [k for k in kills if not k["visible_at_death"]]
            lines.append(f"Kill at return, {arm_name(label, {'asyncckpt': 'asyncckpt'}, result)}: {len(kills)} trials, "
                         f"{len(counted)} with the checkpoint not yet visible when the trainer was dead, "
                         f"{sum(bool(k['committed'] and k['loads_equal']) for k in counted)} of them committed and loading "
                         f"equal (committed {each([k['commit_after_death_s'] for k in counted if k['committed']], '.2f')} s "
                         f"after the death), writers left: {sum(k['writers_left'] for k in kills)}.")
        if res.get("kills"):
            lines.append("")
        r = res.get("restart")
        if r:
            lines += [f"Writer restart: saves {RESTART_GAP_S} s apart, {len(r['warm']['stall_s'])} per process; with "
                      f"`writer_idle_timeout={IDLE_TIMEOUT_S}` the writer had stopped before "
                      f"{r['restart']['writer_ran'].count(False)}/{len(r['restart']['writer_ran'])} of them (started again "
                      f"inside the call), with the default before {r['warm']['writer_ran'].count(False)}.", "",
                      *table(["writer", "stall s", "durable s"],
                             [["running (the default idle timeout)", fmt(median(r["warm"]["stall_s"])),
                               fmt(median(r["warm"]["durable_s"]), ".2f")],
                              [f"stopped after {IDLE_TIMEOUT_S} s idle, started again", fmt(median(r["restart"]["stall_s"])),
                               fmt(median(r["restart"]["durable_s"]), ".2f")]])]
    first = f.get("first_save")
    if first:
        lines += ["## The first save of a process", "",
                  f"Each rep a fresh process with {o['gib']:g} GiB in 16 tensors; its first `async_save` starts the writer. "
                  "Killed at the first save's return: committed within 120 s and loading equal?", "",
                  *table(["asyncckpt", "first save blocks s", "durable s", "second save blocks s", "durable s",
                          "kills at return: committed / trials"],
                         [[arm_name(label, {"asyncckpt": "asyncckpt"}, result),
                           *(fmt(median(r[k] for r in rows)) for k in ("first_stall_s", "first_durable_s", "second_stall_s",
                                                                      "second_durable_s")),
                           f"{sum(bool(k['committed'] and k['loads_equal']) for k in first['kills'][label])} / "
                           f"{len(first['kills'][label])}"] for label, rows in first["timing"].items()])]
    preempted = f.get("preemption")
    if preempted:
        lines += ["## Preemption through each framework's own path", "",
                  f"{o['gib']:g} GiB of state (a model and Adam), a {GRACE_S:.0f} s grace period; the framework's "
                  "own synchronous save of the same state against asyncckpt's; `tests/survival/test_preemption.py` drives each "
                  "trial. Seconds from the signal: medians (each trial). Every trial had its checkpoint complete and "
                  "the job gone within the grace period, unless said.", "",
                  *(f"- {path}: {how}" for path, how in PREEMPTIONS.items() if path in preempted), "",
                  *table(["path", "save", "the save s", "the end s"],
                         [[path, "native (synchronous)" if plugin == "native" else "asyncckpt",
                           f"{fmt(median(t['saved_s'] for t in trials), '.1f')} "
                           f"({each([t['saved_s'] for t in trials], '.1f')})",
                           f"{fmt(median(t['gone_s'] for t in trials), '.1f')} "
                           f"({each([t['gone_s'] for t in trials], '.1f')})"
                           + "".join(f"; **{n} failed**" for n in [sum(not t["ok"] for t in trials)] if n)]
                          for path, arms in preempted.items() for plugin, trials in arms.items()])]
    stress = f.get("stress")
    if stress:
        kinds = stress["kinds"]
        lines += ["## Kill trials", "", "Real processes, real kills (the kinds: `benchmarks/scenarios/_kill_trials.py`). "
                  "A trial counts only if the checkpoint was not yet visible when the trainer was dead (else that kind's "
                  "state grows for its next trials). Every trial requires the checkpoint committed, intact by `asyncckpt "
                  "verify`'s checks and loading equal to what was saved (a kill during the snapshot: nothing committed), "
                  "and no writer process naming the dead trainer's pid left.", "",
                  f"Seed {stress['seed']}; {sum(k['trials'] for k in kinds.values())} trials, "
                  f"{sum(k['ok'] for k in kinds.values())} passed, {sum(k['counted'] for k in kinds.values())} counted.", "",
                  *table(["kind", "trials", "passed", "counted", "visible at death", "sizes", "max commit after death s",
                          "max until no writer s"],
                         [[name, k["trials"], k["ok"], k["counted"], k["visible_at_death"], each(k["sizes"], "d"),
                           fmt(k.get("commit_after_death_s_max", k.get("committed_after_sigterm_s_max")), ".1f"),
                           fmt(k.get("writers_gone_s_max"), ".1f")] for name, k in kinds.items()])]
        failed = [f"- {name} trial {x['trial']} (seed {x['seed']}): {x['error']}" for name, k in kinds.items() for x in k["failed"]]
        lines += [f"Failures: {len(failed)}{':' if failed else '.'}", *failed, ""]
    return "\n".join(lines)


def plot(result: dict, figure) -> None:
    rows = [(f"{w[:5]} {label}", t) for w, res in result["figures"]["workloads"].items()
            for label, t in res.get("timing", {}).items()]
    left, right = figure.subplots(1, 2)
    bars(left, [r[0] for r in rows], [median(t["stall_s"]) for _, t in rows], "stall s")
    bars(right, [r[0] for r in rows], [median(t["durable_s"]) - median(t["stall_s"]) for _, t in rows],
         "durable − stall s (the window if the writer died)")


SCENARIO = Scenario(
    title="Surviving the trainer's death",
    question=__doc__.split("\n\n", 2)[1].replace("\n", " "),
    measure=measure, render=render, plot=plot,
    options={"workloads": Option("16 tensors,8000 tensors", "16 tensors"), "gib": Option(1.0, 0.03),
             "kills": Option(5, 1), "base_kills": Option(2, 1), "parts": Option("timing,kills,restart,first_save,stress"),
             "seed": Option(0), "stress_scale": Option(1.0, 0.01),
             "preemptions": Option(",".join(PREEMPTIONS), help="comma-separated paths of the preemption part"),
             "stress_kinds": Option("", "core 1 rank,snapshot", "comma-separated kinds of the kill trials (default: all)")},
    reps=(3, 1),
    revisioned=True,
)
