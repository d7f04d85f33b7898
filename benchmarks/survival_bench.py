#!/usr/bin/env python
"""The exposure window: how long after a save call returned the trainer's death still loses that save.

    .venv/bin/python benchmarks/survival_bench.py --base-python /tmp/survbench_base/venv/bin/python
    # writes benchmarks/results/survival.json and docs/benchmarks_survival.md

``--base-python`` is a Python whose ``asyncckpt`` is the revision before issue 26 (2edd814: the writer
died with its trainer), set up as this worktree's ``.venv`` is (a venv with a .pth to the main venv's
site-packages and a .pth to a folder holding ``asyncckpt/core`` and ``asyncckpt/adapters/*`` symlinks
into a checkout of that revision). Everything runs in one sitting, the two revisions alternating
(ABBA), each in its own process, for 1 GiB in 16 tensors and in ~8,000 tensors (``harness.make_large``,
``harness.make_adam``):

  timing    a Checkpointer's warm async_save: stall (until it returned) and time to durable
            (``result()``: committed and fsynced), each revision; ``torch.save`` + fsync, the
            native synchronous save, for reference (safe once it returned, after taking T), after
            each of them in both revisions' processes (it leaves the disk and the page cache in the
            same state before every save of either)
  kill      the trainer SIGKILLs itself the moment async_save returned (a warm Checkpointer, a
            save of values the parent can rebuild); was the checkpoint visible then, is it
            committed afterwards, and does it load equal to what was saved
  restart   (this revision) a save 1.5 s after the previous one with ``writer_idle_timeout=0.5``
            (the writer stopped and is started again inside the call) vs the default 30 s
            (the writer still runs): stall and time to durable

The exposure window is durable - stall where the save dies with its trainer (before), and 0 where
the kill trials commit every save (after). The share of a 30 s SIGTERM grace period a save needs is
T for the synchronous save and the stall for ours (the writer goes on through the grace period and
after it; its time to durable is given beside it).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    GiB, git_meta, log, make_adam, make_large, n_tensors, same_state, state_bytes, write_report, zeros_like_state,
)
from peers import torch_save_fsync  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BASE_REVISION = "2edd814"
WORKLOADS = {"16 tensors": lambda: make_large(GiB, 16), "8000 tensors": lambda: make_adam(GiB)}
WRITER_ARGV = (b"asyncckpt.core.writer.process", b"asyncckpt.core.worker")  # this revision's, the base's
PF_EXITING = 0x4  # /proc/PID/stat flags: the process is exiting
GRACE_S = 30.0
RESTART_GAP_S, IDLE_TIMEOUT_S = 1.5, 0.5


def flipped(state: Any) -> Any:
    """The state the killed save holds: every tensor negated in place (the warm-up save held the original)."""
    if isinstance(state, torch.Tensor):
        return state.neg_()
    if isinstance(state, dict):
        for value in state.values():
            flipped(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            flipped(value)
    return state


# ------------------------------------------------------------------------------------------ children
def child_timing(workload: str, reps: int, directory: str, native: bool) -> dict:
    from asyncckpt.core import Checkpointer

    state = WORKLOADS[workload]()
    checkpointer = Checkpointer()
    checkpointer.save(state, os.path.join(directory, "warm"))  # plan and staging buffer: warm from here on
    out: dict[str, list[float]] = {"stall_s": [], "durable_s": [], "native_s": []}
    for rep in range(reps):
        path = os.path.join(directory, f"rep{rep}")
        t0 = time.perf_counter()
        handle = checkpointer.async_save(state, path)
        t1 = time.perf_counter()
        handle.result()
        t2 = time.perf_counter()
        out["stall_s"].append(t1 - t0)
        out["durable_s"].append(t2 - t0)
        shutil.rmtree(path)
        if native:
            path = os.path.join(directory, f"native{rep}.pt")
            t0 = time.perf_counter()
            torch_save_fsync(state, path)
            out["native_s"].append(time.perf_counter() - t0)
            os.unlink(path)
    checkpointer.close()
    return out


def child_kill(workload: str, directory: str) -> None:
    from asyncckpt.core import Checkpointer

    state = WORKLOADS[workload]()
    checkpointer = Checkpointer()
    checkpointer.save(state, os.path.join(directory, "warm"))
    flipped(state)
    t0 = time.perf_counter()
    checkpointer.async_save(state, os.path.join(directory, "next"))
    print(json.dumps({"stall_s": time.perf_counter() - t0}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # from inside: no scheduling delay between the return and the death


def child_restart(workload: str, reps: int, directory: str) -> dict:
    from asyncckpt.core import Checkpointer

    state = WORKLOADS[workload]()
    checkpointers = {"restart": Checkpointer(writer_idle_timeout=IDLE_TIMEOUT_S), "warm": Checkpointer()}
    out: dict[str, list] = {"stall_restart_s": [], "durable_restart_s": [], "stall_warm_s": [], "durable_warm_s": [],
                            "writer_ran_before_restart": [], "writer_ran_before_warm": []}
    for kind, checkpointer in checkpointers.items():
        checkpointer.save(state, os.path.join(directory, f"warm_{kind}"))
    for rep in range(reps):
        for kind, checkpointer in checkpointers.items():
            time.sleep(RESTART_GAP_S)  # a training interval: the idle writer stops within it
            out[f"writer_ran_before_{kind}"].append(checkpointer.ledger.queue.running)
            path = os.path.join(directory, f"{kind}{rep}")
            t0 = time.perf_counter()
            handle = checkpointer.async_save(state, path)
            t1 = time.perf_counter()
            handle.result()
            out[f"stall_{kind}_s"].append(t1 - t0)
            out[f"durable_{kind}_s"].append(time.perf_counter() - t0)
            shutil.rmtree(path)
    for checkpointer in checkpointers.values():
        checkpointer.close()
    return out


# ------------------------------------------------------------------------------------------ parent
def writers_of(pids: list[int]) -> list[int]:
    """Writer processes (either revision's) whose argv names one of ``pids``."""
    wanted, found = {str(pid).encode() for pid in pids}, []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(name in argv for name in WRITER_ARGV) and wanted & set(argv):
            found.append(int(entry))
    return found


def dying(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return True
    return fields[0] in "ZX" or bool(int(fields[6]) & PF_EXITING)


def run_child(python: str, *args: str, timeout: float = 600) -> dict:
    proc = subprocess.run([python, __file__, "--child", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def kill_trial(python: str, workload: str, expected: dict, directory: str) -> dict:
    """One kill at return; ``expected`` is the workload's state as the killed save held it."""
    from asyncckpt import core

    os.makedirs(directory)
    path = os.path.join(directory, "next")
    proc = subprocess.Popen([python, __file__, "--child", "kill", workload, directory], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
    while not dying(proc.pid):
        time.sleep(0.001)
    t_dead, visible = time.monotonic(), core.is_complete(path)
    committed_at, deadline = None, t_dead + 120
    while committed_at is None and time.monotonic() < deadline:  # until committed, or no writer is left to commit
        if core.is_complete(path):
            committed_at = time.monotonic()
        elif proc.poll() is not None and not writers_of([proc.pid]):
            break
        time.sleep(0.01)
    proc.wait(120)
    out, err = proc.communicate(timeout=60)
    if proc.returncode != -signal.SIGKILL or not out.strip():
        raise RuntimeError(f"kill child exited {proc.returncode} before the save returned: {err[-3000:]}")
    stall = json.loads(out.strip().splitlines()[-1])["stall_s"]
    while writers_of([proc.pid]) and time.monotonic() < deadline:
        time.sleep(0.05)
    writers_left = len(writers_of([proc.pid]))
    committed, equal = committed_at is not None, None
    if committed:
        target = zeros_like_state(expected)
        core.load(target, path)
        equal = same_state(target, expected)
    return {"stall_s": stall, "visible_at_death": visible, "committed": committed, "loads_equal": equal,
            "commit_after_death_s": committed_at - t_dead if committed else None, "writers_left": writers_left,
            "log": _log_of(directory)}


def _log_of(directory: str) -> list[str]:
    try:
        with open(os.path.join(directory, ".asyncckpt-writer.log")) as f:
            return f.read().splitlines()
    except OSError:
        return []


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def median(values: list) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--base-python", default="/tmp/survbench_base/venv/bin/python")
    parser.add_argument("--reps", type=int, default=3, help="timed saves per child; 2 children per revision (ABBA)")
    parser.add_argument("--kills", type=int, default=5, help="kill trials per workload, this revision")
    parser.add_argument("--base-kills", type=int, default=2, help="kill trials per workload, the base revision")
    parser.add_argument("--restart-reps", type=int, default=5)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "survival.json"))
    parser.add_argument("--markdown", default=str(REPO / "docs" / "benchmarks_survival.md"))
    parser.add_argument("--from-json", action="store_true", help="only render --json into --markdown again")
    args = parser.parse_args()
    if args.from_json:
        with open(args.json) as f:
            markdown = render(json.load(f))
        with open(args.markdown, "w") as f:
            f.write(markdown)
        return 0
    if args.child:
        mode, workload, *rest = args.child
        if mode == "kill":
            child_kill(workload, rest[0])
            return 0
        out = (child_timing(workload, int(rest[0]), rest[1], rest[2] == "native") if mode == "timing"
               else child_restart(workload, int(rest[0]), rest[1]))
        print(json.dumps(out))
        return 0

    pythons = {"before": args.base_python, "after": sys.executable}
    meta = {**git_meta(), "base_revision": BASE_REVISION, "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
    result: dict[str, Any] = {"meta": meta, "args": vars(args), "workloads": {}}
    root = tempfile.mkdtemp(prefix="survival_bench_", dir=args.dir)
    try:
        for workload in args.workloads.split(","):
            state = WORKLOADS[workload]()
            res: dict[str, Any] = {"bytes": state_bytes(state), "tensors": n_tensors(state), "uptime": {}}
            result["workloads"][workload] = res
            log(f"{workload}: {state_bytes(state) / GiB:.3f} GiB in {n_tensors(state)} tensors")

            res["uptime"]["timing"] = uptime()
            timing = {revision: {"stall_s": [], "durable_s": [], "native_s": []} for revision in pythons}
            for revision in ("before", "after", "after", "before"):  # ABBA: drift hits both alike
                directory = tempfile.mkdtemp(dir=root)
                out = run_child(pythons[revision], "timing", workload, str(args.reps), directory, "native")
                shutil.rmtree(directory, ignore_errors=True)
                for key, values in out.items():
                    timing[revision][key] += values
                log(f"  {revision}: stall {[round(v, 3) for v in out['stall_s']]}, durable {[round(v, 3) for v in out['durable_s']]}"
                    f"{', native ' + str([round(v, 3) for v in out['native_s']]) if out['native_s'] else ''}")
            res["timing"] = timing
            res["uptime"]["timing_end"] = uptime()

            res["uptime"]["kill"] = uptime()
            expected = flipped(state)
            res["kill"] = {}
            for revision, count in (("after", args.kills), ("before", args.base_kills)):
                trials = []
                for index in range(count):
                    trial = kill_trial(pythons[revision], workload, expected, os.path.join(root, f"kill_{revision}_{index}"))
                    shutil.rmtree(os.path.join(root, f"kill_{revision}_{index}"), ignore_errors=True)
                    log(f"  kill {revision} {index}: stall {trial['stall_s']:.3f} s, visible at death {trial['visible_at_death']}, "
                        f"committed {trial['committed']}, loads equal {trial['loads_equal']}, writers left {trial['writers_left']}")
                    trials.append(trial)
                res["kill"][revision] = trials
            del expected, state

            res["uptime"]["restart"] = uptime()
            directory = tempfile.mkdtemp(dir=root)
            res["restart"] = run_child(pythons["after"], "restart", workload, str(args.restart_reps), directory)
            shutil.rmtree(directory, ignore_errors=True)
            log(f"  restart: {json.dumps(res['restart'])}")
            res["uptime"]["end"] = uptime()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    write_report(result, args.json, args.markdown, render(result))
    return 0


def render(result: dict) -> str:
    meta = result["meta"]
    lines = [
        "# Surviving the trainer's death: the exposure window",
        "",
        f"`benchmarks/survival_bench.py` at {meta['git_commit'][:7]} against {meta['base_revision']} (the revision before "
        f"issue 26, whose writer died with its trainer), one sitting, {meta['started']}; 2 vCPUs shared with other jobs "
        "(the load average is given with each block). Medians, seconds.",
        "",
        "The exposure window: after the save call returned, for how long the trainer's death (kill -9, the OOM",
        "killer, a crash, SIGKILL at the end of a preemption's grace period) still loses the save. A synchronous",
        "save has none once it returned, but the call itself takes T. Before issue 26 the background writer died",
        "with its trainer, so the window was the time to durable less the stall; now the writer finishes and",
        "commits what it was handed, and the window is 0, checked by killing the trainer (SIGKILL from inside)",
        "the moment `async_save` returned.",
        "",
    ]
    stress = REPO / "benchmarks" / "results" / "survival_stress.json"
    if stress.is_file():
        with open(stress) as f:
            trials = json.load(f)
        kinds, smeta = trials["kinds"], trials["meta"]
        lines += [
            f"Kill trials (`benchmarks/stress_survival.py`, [results](../benchmarks/results/survival_stress.md), at "
            f"{smeta['git_commit'][:7]}, load average {smeta['loadavg_before'][0]:.1f} → {smeta['loadavg_after'][0]:.1f}): "
            f"{sum(k['trials'] for k in kinds.values())} trials, {sum(k['ok'] for k in kinds.values())} passed, "
            f"{sum(k['counted'] for k in kinds.values())} counted (the checkpoint not yet visible when the trainer was dead): "
            + ", ".join(f"{name} {k['counted']}/{k['trials']}" for name, k in kinds.items())
            + f"; no writer left more than {max(k.get('writers_gone_s_max', 0) for k in kinds.values()):.1f} s after "
            "its save committed.",
            "",
        ]
    first = REPO / "benchmarks" / "results" / "first_save.json"
    if first.is_file():  # benchmarks/first_save_bench.py
        with open(first) as f:
            first_save = json.load(f)
        after, before = (first_save["timings"][rev] for rev in ("this", first_save["meta"]["base_rev"]))
        kills = {rev: sum(r["committed"] and r["loads_equal"] for r in rows) for rev, rows in first_save["kills"].items()}
        lines += [
            "**The first save of a process** (issue 33): the save that starts the writer, and a save after the writer "
            "stopped when idle. A writer whose trainer died while it started exited without reading what was in its "
            f"socket: a first save killed at its return was lost ({kills[first_save['meta']['base_rev']]} of "
            f"{len(first_save['kills']['this'])} committed at {first_save['meta']['base_rev']}), and is committed now "
            f"({kills['this']} of {len(first_save['kills']['this'])}), at no cost to the call (1 GiB: blocks "
            f"{median([r['first_stall'] for r in after]):.3f} s against {median([r['first_stall'] for r in before]):.3f} s, "
            f"the writer's start included; the next save {median([r['second_stall'] for r in after]):.3f} s against "
            f"{median([r['second_stall'] for r in before]):.3f} s): [benchmarks_first_save.md](benchmarks_first_save.md). "
            "The kill trials of the first save and of a save after an idle stop (local and S3) are in the stress "
            "results above.",
            "",
        ]
    for workload, res in result["workloads"].items():
        timing, kill = res["timing"], res["kill"]
        before, after = timing["before"], timing["after"]
        stall_b, durable_b = median(before["stall_s"]), median(before["durable_s"])
        stall_a, durable_a = median(after["stall_s"]), median(after["durable_s"])
        native = median(before["native_s"] + after["native_s"])
        kills_a, kills_b = kill["after"], kill["before"]
        counted_a = [t for t in kills_a if not t["visible_at_death"]]
        ok_a = [t for t in counted_a if t["committed"] and t["loads_equal"] and not t["writers_left"]]
        lost_b = [t for t in kills_b if not t["visible_at_death"] and not t["committed"]]
        lines += [
            f"## 1 GiB in {res['tensors']} tensors",
            "",
            f"Timing: {len(after['stall_s'])} saves per revision (ABBA); `uptime`: {res['uptime']['timing']} → "
            f"{res['uptime']['timing_end']}.",
            "",
            "| save | the call blocks | durable after the call | exposure window after it returned |",
            "|---|---|---|---|",
            f"| `torch.save` + fsync (synchronous) | {native:.2f} | = | 0 |",
            f"| asyncckpt {meta['base_revision']} (before) | {stall_b:.3f} | {durable_b:.2f} | **{durable_b - stall_b:.2f}** "
            f"(durable − stall) |",
            f"| asyncckpt {meta['git_commit'][:7]} (after) | {stall_a:.3f} | {durable_a:.2f} | **0** "
            f"({len(ok_a)}/{len(counted_a)} kills at return committed) |",
            "",
            f"Stall {stall_b:.3f} → {stall_a:.3f} s, time to durable {durable_b:.2f} → {durable_a:.2f} s "
            f"(each rep: stall before {_fmt(before['stall_s'])}, after {_fmt(after['stall_s'])}; durable before "
            f"{_fmt(before['durable_s'])}, after {_fmt(after['durable_s'])}).",
            "",
            f"Kill at return (`uptime`: {res['uptime']['kill']}): after, {len(kills_a)} trials, {len(counted_a)} with the "
            f"checkpoint not yet visible when the trainer was dead, {len(ok_a)} of them committed, loading equal to what was "
            f"saved, no writer left (committed {_fmt([t['commit_after_death_s'] for t in counted_a if t['committed']])} s after "
            f"the death; alive, durable − stall was {durable_a - stall_a:.2f} s); before, {len(kills_b)} trials, {len(lost_b)} lost the save "
            f"(committed: {[t['committed'] for t in kills_b]}).",
            "",
            f"A 30 s SIGTERM grace period: the synchronous save needs {native:.1f} s of it ({100 * native / GRACE_S:.0f}%) "
            f"before training can stop; ours needs the stall, {stall_a:.2f} s ({100 * stall_a / GRACE_S:.1f}%), and the "
            f"writer then commits within {durable_a:.1f} s of the call, through the grace period and past the trainer's "
            f"exit (the writer ignores the SIGTERM; the SIGKILL at the end of the grace period, which a container runtime or SLURM sends to every process of the job, comes long after the commit).",
            "",
        ]
        restart = res["restart"]
        lines += [
            f"Writer restart (`uptime`: {res['uptime']['restart']}): a save {RESTART_GAP_S} s after the previous one, "
            f"{len(restart['stall_warm_s'])} alternating reps; with `writer_idle_timeout={IDLE_TIMEOUT_S}` the writer "
            f"had stopped before {restart['writer_ran_before_restart'].count(False)}/"
            f"{len(restart['writer_ran_before_restart'])} of them (started again inside the call), with the default 30 s it "
            f"ran before {restart['writer_ran_before_warm'].count(True)}/{len(restart['writer_ran_before_warm'])}.",
            "",
            "| writer | stall | durable |",
            "|---|---|---|",
            f"| running (default idle timeout) | {median(restart['stall_warm_s']):.3f} | {median(restart['durable_warm_s']):.2f} |",
            f"| stopped after {IDLE_TIMEOUT_S} s idle, restarted | {median(restart['stall_restart_s']):.3f} | "
            f"{median(restart['durable_restart_s']):.2f} |",
            "",
        ]
    lines += [
        "## Notes",
        "",
        "- The commit after a death is timed from the moment the trainer was exiting (its PF_EXITING flag, polled",
        "  every millisecond) until the checkpoint was complete (polled every 10 ms); with the trainer alive the same",
        "  save would have taken durable − stall after the call returned. The orphaned writer's log",
        "  (`.asyncckpt-writer.log`) says `finishing`, `committed` and `exiting` where it learnt of the death (the",
        "  kernel tells it once the trainer's memory is freed) before it committed.",
        "- A writer restart costs every save made longer than `writer_idle_timeout` (30 s by default) after the",
        "  writer's last work, inside a framework's run too: in a run that checkpoints every few minutes, every save.",
        "  It shows in the time to durable, more with ~8,000 tensors: the new writer's interpreter start-up, then the",
        "  per-layout state a writer keeps between saves (such as the sidecar text cache) built again; not profiled",
        "  further. The call hands the staging buffer and its layout to the new writer again.",
        "- Before issue 26 the writer died with its trainer: the saves killed at return in the base revision were not",
        "  committed. Stall and time to durable did not regress: the differences between the revisions above are",
        "  within the rep-to-rep spread on this shared machine (each rep listed).",
        "",
    ]
    return "\n".join(lines)


def _fmt(values: list) -> str:
    return ", ".join(f"{v:.2f}" for v in values) if values else "-"


if __name__ == "__main__":
    sys.exit(main())
