"""What checking a checkpoint on resume costs, per adapter layout, against the load it guards.

Each adapter checks a checkpoint against its checksums (``Checkpointer.require_intact``) before the
framework loads it. 1 GiB of state in (a) 16 large tensors and (b) ~8,000 tensors (a model and its Adam
state), written through the core the way each adapter writes it: ``lightning``, one ``torch.save`` file
loaded with ``torch.load``; ``accelerate``, a directory of ``model.safetensors`` and ``optimizer.bin``;
``hf_trainer``, the same with ``optimizer.pt``. In rotation, page cache warm: the cached read of the files
(the limit), the check, the framework's reads unchecked.
"""
from __future__ import annotations

import os
import shutil
import tempfile

from harness import Option, Scenario
from harness.floors import read_files
from harness.report import bars, fmt, side, table
from harness.util import now, spread
from harness.workloads import make_adam, make_large, n_tensors

WORKLOADS = {"a: 16 large tensors": make_large, "b: ~8,000 tensors": make_adam}


def flat(state: dict, prefix: str = "") -> dict:
    import torch

    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        elif isinstance(value, torch.Tensor):
            out[f"{prefix}{key}"] = value
    return out


def layouts(checkpointer, state: dict, root: str) -> dict[str, list[str]]:
    """The three adapters' layouts, written through the core; each one's files."""
    model = flat(state.get("model", state))
    rest = {k: v for k, v in state.items() if k != "model"} or {"step": 1}
    lightning = os.path.join(root, "last.ckpt")
    checkpointer.save_file({"state_dict": model, "optimizer_states": [rest], "global_step": 1}, lightning)
    out = {"lightning": [lightning]}
    for adapter, optimizer_name in (("accelerate", "optimizer.bin"), ("hf_trainer", "optimizer.pt")):
        directory = os.path.join(root, adapter)
        with checkpointer.begin_directory(directory) as tx:
            tx.save_file(model, "model.safetensors", format="safetensors", metadata={"format": "pt"})
            tx.save_file(rest, optimizer_name)
            tx.commit().result()
        out[adapter] = [os.path.join(directory, "model.safetensors"), os.path.join(directory, optimizer_name)]
    return out


def checks(size_mib: int, reps: int) -> dict:
    import torch
    from safetensors.torch import load_file

    from asyncckpt.core import Checkpointer

    def framework_load(files: list[str]) -> None:
        for path in files:
            load_file(path) if path.endswith(".safetensors") else torch.load(path, map_location="cpu", weights_only=False)

    out: dict = {}
    buffer = memoryview(bytearray(4 << 20))
    with Checkpointer() as checkpointer:
        for workload, make in WORKLOADS.items():
            state = make(size_mib << 20)
            root = tempfile.mkdtemp(prefix="verify_")
            for adapter, files in layouts(checkpointer, state, root).items():
                target = files[0] if adapter == "lightning" else os.path.dirname(files[0])
                rows = {"cached read": lambda: read_files(files, buffer), "verify": lambda: checkpointer.require_intact(target),
                        "load": lambda: framework_load(files)}
                times: dict[str, list[float]] = {row: [] for row in rows}
                for rep in range(reps + 1):  # rep 0 warms the page cache and is dropped
                    for row, call in rows.items():
                        t0 = now()
                        call()
                        if rep:
                            times[row].append(now() - t0)
                out.setdefault(workload, {})[adapter] = {"bytes": sum(os.path.getsize(f) for f in files),
                                                         "tensors": n_tensors(state),
                                                         "s": {row: spread(v) for row, v in times.items()}}
            shutil.rmtree(root, ignore_errors=True)
    return out


def measure(sitting) -> dict:
    return {run.label: sitting.child("checks", revision=run.revision, size_mib=sitting.o.size_mib, reps=sitting.o.reps)
            for _, run in sitting.abba(sitting.runs(["asyncckpt"], {"asyncckpt"}), 1)}


def render(result: dict) -> str:
    rows = []
    for label, workloads in result["figures"].items():
        for workload, per_adapter in workloads.items():
            if workload == "_child":
                continue
            for adapter, r in per_adapter.items():
                m = {k: v["median"] for k, v in r["s"].items()}
                target = max(0.10 * m["load"], 1.25 * m["cached read"])
                rows.append([f"{workload}{side(label, result)}", adapter,
                             f"{r['bytes'] / 2**20:.0f} MiB", fmt(m["cached read"]), fmt(m["verify"]), fmt(m["load"]),
                             f"{fmt(m['verify'] / m['cached read'], '.2f')}x", f"{100 * m['verify'] / m['load']:.0f}%",
                             "yes" if m["verify"] <= target else "**no**"])
    return "\n".join([f"{result['options']['size_mib']} MiB of state, {result['options']['reps']} reps in rotation, page "
                      "cache warm, medians. **verify** = `Checkpointer.require_intact` (what each adapter runs before the "
                      "framework loads); **load** = the framework's own reads of the same files, unchecked; **cached "
                      "read** = reading the files into held memory (the limit). Target: verify <= max(10% of load, 1.25x "
                      "cached read).", "",
                      *table(["workload", "layout", "bytes", "cached read s", "verify s", "load s",
                              "verify / cached read", "verify / load", "target met"], rows)])


def plot(result: dict, figure) -> None:
    workloads = result["figures"]["asyncckpt"]
    keys = [(w, a) for w in workloads if w != "_child" for a in workloads[w]]
    bars(figure.subplots(), [f"{w[0]}: {a}" for w, a in keys],
         [workloads[w][a]["s"]["verify"]["median"] / workloads[w][a]["s"]["cached read"]["median"] for w, a in keys],
         "verify / cached read", 1.25, "target 1.25x")


SCENARIO = Scenario(
    title="Checking a checkpoint on resume",
    question=__doc__.split("\n\n", 1)[1].strip().replace("\n", " "),
    measure=measure, render=render, plot=plot,
    options={"size_mib": Option(1024, 32)},
    reps=(5, 1),
    revisioned=True,
)
