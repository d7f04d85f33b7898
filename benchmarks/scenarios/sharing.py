"""Checkpoints that share what did not change (issue 55): a model whose parameters are 80% frozen, saved 10 times
with Adam's state, on the local disk and on an S3 server; and one where everything changes. Bytes written per save,
stall, time to durable, storage used by the checkpoints, against the base revision (``--before``) in the same
sitting."""
from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import psutil

from harness import Option, Scenario
from harness.report import fmt, table
from harness.util import MiB, median, now
from scenarios.object_store import Server, client_env

TENSOR_MIB = 16
WORKLOADS = ("frozen", "changing")  # 80% of the parameters frozen; every tensor changing at every step


def _writer_bytes() -> int:
    """Bytes this process's children (its background writer) handed to write calls (files)."""
    return sum(child.io_counters().write_chars for child in psutil.Process().children(recursive=True))


def _stored(root: str, endpoint: str) -> int:
    """What the checkpoints under ``root`` take in their storage: blocks on disk (each file once, holes not
    counted), the objects' sizes in a bucket."""
    if root.startswith("s3://"):
        import boto3

        bucket, _, prefix = root[5:].partition("/")
        prefix += "/"  # not the warm-up save's run-warm/
        pages = boto3.client("s3", endpoint_url=endpoint).get_paginator("list_objects_v2")
        return sum(o["Size"] for page in pages.paginate(Bucket=bucket, Prefix=prefix) for o in page.get("Contents", []))
    return int(subprocess.run(["du", "-s", "--block-size=1", root], capture_output=True, text=True,
                              check=True).stdout.split()[0])


class _Received:
    """The request bodies an S3 server in this process receives, with when (moto's WSGI app, wrapped): the bytes a
    client sent it, whatever the client's process (socket sends are not in ``/proc/PID/io``)."""

    def __init__(self, app) -> None:
        self.app, self.events, self.lock = app, [], threading.Lock()

    def __call__(self, environ, start_response):
        with self.lock:
            self.events.append((time.time(), int(environ.get("CONTENT_LENGTH") or 0)))
        return self.app(environ, start_response)

    def between(self, start: float, end: float) -> int:
        with self.lock:
            return sum(size for at, size in self.events if start <= at <= end)


# ------------------------------------------------------------------------------------------ in a child
def saves(workload: str, root: str, frozen_mib: int, trained_mib: int, count: int, endpoint: str = "") -> dict:
    """``count`` saves of the model, a training step before each: per save the stall, the time to durable, the bytes
    the writer wrote, and the storage the checkpoints use after it."""
    import torch

    from asyncckpt import core

    if endpoint:
        os.environ.update(client_env(endpoint))
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=root[5:].partition("/")[0])
    generator = torch.Generator().manual_seed(0)
    frozen = [torch.randn(TENSOR_MIB * MiB // 4, generator=generator) for _ in range(frozen_mib // TENSOR_MIB)]
    trained = [torch.nn.Parameter(torch.randn(TENSOR_MIB * MiB // 4, generator=generator))
               for _ in range(trained_mib // TENSOR_MIB)]
    optimizer = torch.optim.Adam(trained, lr=1e-3)

    def step() -> None:
        for parameter in trained:
            parameter.grad = torch.randn(parameter.shape, generator=generator)
        optimizer.step()
        if workload == "changing":
            for tensor in frozen:
                tensor.add_(1e-3)

    def state() -> dict:
        return {"frozen": {f"f{i}": t for i, t in enumerate(frozen)},
                "trained": {f"t{i}": t for i, t in enumerate(trained)}, "optim": optimizer.state_dict()}

    out: dict = {"stall_s": [], "durable_s": [], "written": [], "stored": [], "windows": []}
    step()
    with core.Checkpointer() as checkpointer:
        checkpointer.save(state(), f"{root}-warm")  # the writer started, the plan made, the buffers taken
        for index in range(count):
            step()
            written, began = _writer_bytes(), time.time()
            t0 = now()
            handle = checkpointer.async_save(state(), f"{root}/step_{index:03d}", step=index)
            t1 = now()
            handle.result()
            t2 = now()
            out["stall_s"].append(t1 - t0)
            out["durable_s"].append(t2 - t1)
            out["written"].append(_writer_bytes() - written)
            out["windows"].append((began, time.time()))
            out["stored"].append(_stored(root, endpoint))
    out["checkpoint_bytes"] = sum(t.numel() * 4 for t in frozen) + 3 * sum(t.numel() * 4 for t in trained)
    out["changed_bytes"] = 3 * sum(t.numel() * 4 for t in trained) + (
        sum(t.numel() * 4 for t in frozen) if workload == "changing" else 0)
    if not endpoint:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(f"{root}-warm", ignore_errors=True)
    return out


# ------------------------------------------------------------------------------------------ the sitting
def measure(sitting) -> dict:
    o = sitting.o
    out: dict = {}
    server = Server("moto", sitting.scratch) if o.s3 else None
    if server is not None:
        server.moto._server.app = received = _Received(server.moto._server.app)
    try:
        places = ["local"] + (["s3"] if server else [])  # (``only``: one of them and one workload)
        for place in places:
            scale = 1 if place == "local" else o.s3_scale
            for workload in WORKLOADS:
                if o.only and f"{place}/{workload}" != o.only:
                    continue
                rows: dict[str, list] = {}
                with sitting.phase(f"{place} {workload}"):
                    for rep, run in sitting.abba(sitting.runs(["asyncckpt"], {"asyncckpt"}), o.reps):
                        name = f"{place}-{workload}-{run.label.replace('@', '-')}-{rep}"
                        root = f"s3://{name.lower()}/run" if place == "s3" else os.path.join(sitting.directory(name), "run")
                        found = sitting.child("saves", revision=run.revision, workload=workload, root=root,
                                              frozen_mib=int(o.frozen_mib * scale), trained_mib=int(o.trained_mib * scale),
                                              count=o.saves, endpoint=server.endpoint if place == "s3" else "")
                        if place == "s3":  # what the client sent during each save, as the server received it
                            found["written"] = [received.between(*window) for window in found["windows"]]
                        rows.setdefault(run.label, []).append(found)
                        sitting.log(f"{place} {workload} {run.label}: written {[round(w / MiB) for w in found['written']]} "
                                    f"MiB, stored {round(found['stored'][-1] / MiB)} MiB")
                out[f"{place}/{workload}"] = rows
    finally:
        if server is not None:
            server.stop()
    return out


def _summary(reps: list[dict]) -> dict:
    """Medians over the reps of: bytes written by the first save and per save after it, stall and time to durable
    per save after the first, storage after the last save."""
    return {"first_written": median(r["written"][0] for r in reps),
            "written": median(median(r["written"][1:]) for r in reps),
            "stall_s": median(median(r["stall_s"][1:]) for r in reps),
            "durable_s": median(median(r["durable_s"][1:]) for r in reps),
            "stored": median(r["stored"][-1] for r in reps),
            "changed": reps[0]["changed_bytes"], "checkpoint": reps[0]["checkpoint_bytes"], "saves": len(reps[0]["stored"])}


def render(result: dict) -> str:
    o, figures = result["options"], result["figures"]
    lines = [f"A model of {o['frozen_mib']} MiB of frozen float32 parameters and {o['trained_mib']} MiB trained with "
             f"Adam (its two moments: {2 * o['trained_mib']} MiB), in tensors of {TENSOR_MIB} MiB: the frozen part is "
             f"{o['frozen_mib'] / (o['frozen_mib'] + o['trained_mib']):.0%} of the parameters, as in the issue's 1 GiB "
             f"and 256 MiB scaled by {o['trained_mib'] / 256:.2g} for this 2-core, 24 GiB machine (on the S3 server, "
             f"moto in the sitting's process, by {o['s3_scale']:g} more: it keeps every object in memory). Saved "
             f"{o['saves']} times with `async_save`, an optimizer step before each; `changing`: the same model with "
             "every frozen tensor changed too before each save. Each arm in a fresh process per rep, alternating "
             "(ABBA), after an unmeasured save elsewhere (the writer's start). *Written*: the bytes the writer process "
             "handed to write calls (`/proc/PID/io` `wchar`), on S3 the request bodies the server received during the save, "
             "per save after the first (median); "
             "*stored*: what the checkpoints take after the last save (blocks on disk, each file once: `du`; the "
             "objects' sizes in the bucket); stall and time to durable: medians of the saves after the first. "
             "Targets: with the frozen part, written within 1.05x of the bytes that changed plus metadata; everything "
             "changing, stall and time to durable unchanged within noise.", ""]
    for key, rows in figures.items():
        place, workload = key.split("/")
        body = []
        for label, reps in rows.items():
            s = _summary(reps)
            body.append([label, fmt(s["first_written"] / MiB, ".0f"), fmt(s["written"] / MiB, ".0f"),
                         fmt(s["written"] / s["changed"], ".3f"), fmt(s["stall_s"], ".3f"), fmt(s["durable_s"], ".2f"),
                         fmt(s["stored"] / MiB, ".0f"), fmt(s["stored"] / (s["saves"] * s["checkpoint"]), ".2f")])
        s = _summary(next(iter(rows.values())))
        lines += [f"## {place}, {workload}", "",
                  f"Bytes that change per save: {s['changed'] / MiB:.0f} MiB of a {s['checkpoint'] / MiB:.0f} MiB "
                  "checkpoint.", "",
                  *table(["revision", "first save written MiB", "written MiB per save", "written / changed",
                          "stall s", "time to durable s", f"stored after {s['saves']} MiB", "stored / (saves x size)"],
                         body), ""]
    return "\n".join(lines)


def plot(result: dict, figure) -> None:
    keys = list(result["figures"])
    axes = figure.subplots(1, len(keys))
    for ax, key in zip(axes if len(keys) > 1 else [axes], keys):
        for label, reps in result["figures"][key].items():
            stored = [median(r["stored"][i] for r in reps) / 2 ** 30 for i in range(len(reps[0]["stored"]))]
            ax.plot(range(1, len(stored) + 1), stored, marker="o", label=label)
        ax.set_xlabel("saves")
        ax.set_ylabel("storage used, GiB")
        ax.set_title(key, fontsize=9)
        ax.legend(fontsize=7)


SCENARIO = Scenario(
    title="Sharing what did not change: bytes written and storage used by repeated saves",
    question="How many bytes each save writes, how long it stalls and takes to become durable, and how much storage "
             "10 checkpoints use, when 80% of a model's parameters are frozen (and when everything changes), on the "
             "local disk and on an S3 server, against the base revision.",
    measure=measure, render=render, plot=plot,
    options={"frozen_mib": Option(256, 32), "trained_mib": Option(64, 16), "saves": Option(10, 3),
             "s3": Option(True), "s3_scale": Option(0.5, 1.0),
             "only": Option("", help="one place/workload (s3/changing, say): a sitting of that alone")},
    reps=(2, 1),
    revisioned=True,
)
