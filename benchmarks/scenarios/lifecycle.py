"""What stopping the background writer at the end of a run costs the next run, and where it goes.

``teardown()`` stops the writer process and every thread of asyncckpt when a framework's run ends, so the
next run starts them again. On a Checkpointer whose snapshot buffer and plan are warm (a later ``fit`` or
``train`` in the same process), in alternating reps: ``start()`` (the caller's part, a Popen), the
writer's readiness, ``teardown()``, and the first save after a teardown without ``start()`` (the writer
started inside it), with ``start()`` one training step earlier (as the adapters do at a run's start),
and with the writer running.
"""
from __future__ import annotations

import os
import shutil
import time

from harness import Option, Scenario
from harness.report import arm_name, bars, fmt, table
from harness.util import median, now
from harness.workloads import make_adam, n_tensors, state_bytes

KEYS = ("start_s", "ready_s", "teardown_s", "stall_lazy_s", "stall_started_s", "stall_warm_s", "durable_lazy_s",
        "durable_started_s", "durable_warm_s")


def cycles(size_mib: int, reps: int, step_s: float, root: str) -> dict:
    from asyncckpt.core import Checkpointer

    state = make_adam(size_mib << 20, 500 if size_mib >= 256 else None)
    rows: dict[str, list[float]] = {k: [] for k in KEYS}
    checkpointer = Checkpointer()
    checkpointer.save(state, os.path.join(root, "warmup"))  # plan and snapshot buffer: warm from here on
    counter = iter(range(1 << 30))

    def timed_save(kind: str) -> None:
        path = os.path.join(root, f"ck{next(counter)}")
        t0 = now()
        handle = checkpointer.async_save(state, path)
        rows[f"stall_{kind}_s"].append(now() - t0)
        handle.result()
        rows[f"durable_{kind}_s"].append(now() - t0)
        shutil.rmtree(path, ignore_errors=True)

    for _ in range(reps):
        timed_save("warm")
        t0 = now()
        checkpointer.teardown()
        rows["teardown_s"].append(now() - t0)
        timed_save("lazy")
        checkpointer.teardown()
        t0 = now()
        checkpointer.start()
        rows["start_s"].append(now() - t0)
        checkpointer.wait()  # answered once the writer has started
        rows["ready_s"].append(now() - t0)
        checkpointer.teardown()
        checkpointer.start()
        time.sleep(step_s)  # one training step
        timed_save("started")
    checkpointer.close()
    return {"state_bytes": state_bytes(state), "tensors": n_tensors(state), "reps": rows}


def measure(sitting) -> dict:
    out = {}
    for _, run in sitting.abba(sitting.runs(["asyncckpt"], {"asyncckpt"}), 2 if len(sitting.revisions) > 1 else 1):
        found = sitting.child("cycles", revision=run.revision, size_mib=sitting.o.size_mib, reps=sitting.o.reps,
                              step_s=sitting.o.step_s, root=sitting.directory(f"cycles_{run.label}"))
        entry = out.setdefault(run.label, {"state_bytes": found["state_bytes"], "tensors": found["tensors"],
                                           "reps": {k: [] for k in KEYS}})
        for key, values in found["reps"].items():
            entry["reps"][key] += values
    return out


ROWS = [("`start()`: the caller's part (a Popen)", "start_s"), ("from `start()` until the writer answers", "ready_s"),
        ("`teardown()`: drain, stop the writer and the threads", "teardown_s"),
        ("first save's stall after a teardown, no `start()`", "stall_lazy_s"),
        ("first save's stall, `start()` one step earlier", "stall_started_s"), ("a save's stall, writer running", "stall_warm_s"),
        ("time to durable, no `start()`", "durable_lazy_s"), ("time to durable, `start()` one step earlier", "durable_started_s"),
        ("time to durable, writer running", "durable_warm_s")]


def render(result: dict) -> str:
    figures = result["figures"]
    first = next(iter(figures.values()))
    labels = list(figures)
    return "\n".join([
        f"{first['state_bytes'] / 2**20:.0f} MiB in {first['tensors']} tensors, {result['options']['reps']} alternating reps, "
        f"medians in ms; one training step = {1000 * result['options']['step_s']:.0f} ms. The adapters call `start()` where "
        "the framework offers a moment before the first save (Lightning's `Strategy.setup_environment`, the Trainer's "
        "`on_train_begin`, `enable_async_checkpointing`), so the first save of a run stalls like one with the writer "
        "running.", "",
        *table(["what", *(arm_name(label, {"asyncckpt": "ms"}, result) for label in labels)],
               [[what, *(fmt(1000 * median(figures[label]["reps"][key]), ".1f") for label in labels)] for what, key in ROWS])])


def plot(result: dict, figure) -> None:
    label = "asyncckpt"
    reps = result["figures"][label]["reps"]
    bars(figure.subplots(), [key[:-2] for _, key in ROWS], [1000 * median(reps[key]) for _, key in ROWS], "ms (median)")


SCENARIO = Scenario(
    title="Restarting the background writer between runs",
    question=__doc__.split("\n\n", 1)[1].strip().replace("\n", " "),
    measure=measure, render=render, plot=plot,
    options={"size_mib": Option(256, 16), "step_s": Option(0.3, 0.05)},
    reps=(7, 1),
    revisioned=True,
)
