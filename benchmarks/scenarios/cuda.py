"""Saves from GPU memory: how long training blocks, against the device-to-host copy any asynchronous save must
make, and against the synchronous and asynchronous saves users have today.

Needs a CUDA device (the project's own machine has none: it runs where one is lent). One process, one GPU,
the checkpoint on the machine's local disk. Two workloads on the GPU: ``large``, fp32 in 8 equal tensors (a
mid-sized model's weights), and ``adam``, 2,000 small parameters with Adam's two moments and a 0-dim step each
(6,000 tensors, ~24 MiB: the per-tensor cost). Back to back, each method's first rep reported apart: ``d2h``
(every tensor into held pinned host memory, synchronized: the stall's floor), ``torch`` (``torch.save`` +
fsync), ``dcp`` (``dcp.async_save`` as it comes: a thread, a blocking copy), ``dcp_best`` (DCP's strongest
configuration for GPU state: the PROCESS executor and a ``DefaultStager`` with pinned, shared memory, non-blocking
copies and asynchronous staging; its stall is until its staging completes, when training may change the state),
``ours`` (``Checkpointer.async_save``); then, for ``large``, a GPU matmul loop's steps/s alone, while our writer
writes a save, while it exports the checkpoint as Hugging Face safetensors, and while ``dcp_best`` writes one.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any, Callable, Optional

from harness import Option, Scenario
from harness.report import bars, fmt, side, table
from harness.util import MiB, free_port, median, now, remove

METHODS = ("d2h", "torch", "dcp", "dcp_best", "ours")


def gpu(large_mib: int, adam_params: int, reps: int, alone_s: float, methods: list[str]) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from asyncckpt.core import Checkpointer, ExportOptions
    from harness import peers as P

    def make_large() -> dict:
        per = large_mib * MiB // 8 // 4
        return {f"layer{i}.weight": torch.randn(per, device="cuda") for i in range(8)}

    def make_adam() -> dict:
        generator = torch.Generator(device="cuda").manual_seed(0)
        state: dict[str, Any] = {"model": {}, "optim": {}}
        for i in range(adam_params):
            shape = (1024,) if i % 2 else (32, 32)
            state["model"][f"p{i}"] = torch.randn(shape, device="cuda", generator=generator)
            state["optim"][f"p{i}"] = {"exp_avg": torch.randn(shape, device="cuda", generator=generator),
                                       "exp_avg_sq": torch.rand(shape, device="cuda", generator=generator),
                                       "step": torch.tensor(float(i), device="cuda")}
        return state

    def tensors(state: Any) -> list:
        if isinstance(state, torch.Tensor):
            return [state]
        return [t for value in state.values() for t in tensors(value)] if isinstance(state, dict) else []

    def timed_save(start: Callable[[str], Any], finish: Callable[[Any], None], path: str,
                   staged: Optional[Callable[[Any], None]] = None) -> dict:
        """``staged(token)``, where a save returns before its snapshot is taken, waits for the snapshot: the
        stall ends there."""
        torch.cuda.synchronize()
        t0 = now()
        token = start(path)
        returned = now() - t0
        if staged is not None:
            staged(token)
        stall = now() - t0
        finish(token)
        return {"stall_s": stall, "returned_s": returned, "durable_s": now() - t0}

    def fsync_tree(path: str) -> None:
        for directory, _, files in os.walk(path):
            for name in files:
                fd = os.open(os.path.join(directory, name), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

    root = tempfile.mkdtemp(prefix="cuda_bench_")
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "workloads": {}}
    checkpointer = Checkpointer()
    if "dcp_best" in methods:  # DCP's PROCESS executor needs a process group
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    # One stager for every save keeps its pinned buffers (its intended use); torch 2.11's DefaultStager breaks on
    # its second save (pytorch#183413, fixed in 2.12), so there each save gets a new one and pins anew.
    reusable = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 12)
    stager = P.shm_async_stager(pinned=True) if "dcp_best" in methods and reusable else None
    out["dcp_best_stager"] = "one for every save" if reusable else "a new one per save (pytorch#183413)"
    try:
        for name, build in (("large", make_large), ("adam", make_adam)):
            state = build()
            torch.cuda.synchronize()
            held = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors(state)]

            def d2h(path: str) -> None:
                for src, dst in zip(tensors(state), held):
                    dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()

            def torch_save(path: str) -> None:
                with open(path, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())

            def dcp_best(path: str) -> tuple:
                return path, P.dcp_async_save_staged(state, path, stager or P.shm_async_stager(pinned=True),
                                                     process=True)

            calls = {"d2h": (d2h, lambda _: None), "torch": (torch_save, lambda _: None),
                     "dcp": (lambda p: (p, dcp.async_save(state, checkpoint_id=p, no_dist=True)),
                             lambda t: (t[1].result(), fsync_tree(t[0]))),
                     "dcp_best": (dcp_best, lambda t: (t[1].upload_completion.result(), fsync_tree(t[0])),
                                  lambda t: t[1].staging_completion.result()),
                     "ours": (lambda p: checkpointer.async_save(state, p), lambda h: h.result())}
            entry: dict[str, Any] = {"bytes": sum(t.numel() * t.element_size() for t in tensors(state)),
                                     "tensors": len(tensors(state))}
            for method in methods:
                try:
                    reps_ = []
                    for rep in range(reps + 1):  # the first warms buffers and plans
                        path = os.path.join(root, f"{method}{rep}")
                        start, finish, *staged = calls[method]
                        reps_.append(timed_save(start, finish, path, *staged))
                        remove(path)
                    entry[method] = {"first": reps_[0], "reps": reps_[1:]}
                except Exception as error:  # noqa: BLE001 - a failing peer is a result
                    entry[method] = {"error": f"{type(error).__name__}: {error}"[:600]}
            if name == "large":
                dcp_write = (lambda p: dcp_best(p)[1]) if "dcp_best" in methods else None
                entry["training"] = training_loop(checkpointer, state, root, alone_s, ExportOptions, dcp_write)
            out["workloads"][name] = entry
            state = held = None  # freed before the next workload (the calls above read the names)
            torch.cuda.empty_cache()
    finally:
        checkpointer.close()
        if stager is not None:
            stager.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    return out


def training_loop(checkpointer, state: dict, root: str, alone_s: float, export_options,
                  dcp_write: Optional[Callable[[str], Any]]) -> dict:
    """Steps/s of a 4096x4096 bf16 matmul loop alone, while the writer writes a save, while it exports it, and
    while ``dcp_write`` (DCP's strongest configuration) writes one after its staging."""
    from harness.workloads import GpuMMLoop

    def rate(until: Callable[[float], bool]) -> float:
        """Matmuls per second while ``until(elapsed seconds)``."""
        loop, t0 = GpuMMLoop(), now()
        loop.step()  # at least one, as when the save is done before the loop starts
        steps, _ = loop.run_until(lambda: not until(now() - t0))
        return (steps + 1) * GpuMMLoop.MATMULS / (now() - t0)

    # The GPU's clocks up first: the H100 and H200 sittings timed the loop alone cold, and it then ran ~5% faster
    # during the writes after it.
    rate(lambda elapsed: elapsed < 1.0)
    alone = rate(lambda elapsed: elapsed < alone_s)
    handle = checkpointer.async_save(state, os.path.join(root, "during"))
    during = rate(lambda _: not handle.done())
    handle.result()
    t0 = now()
    export = checkpointer.export(os.path.join(root, "during"), export_options(directory=os.path.join(root, "exports")))
    during_export = rate(lambda _: not export.done())
    export.result()
    out = {"alone": alone, "during_write": during, "during_export": during_export, "export_s": now() - t0}
    if dcp_write is not None:
        try:
            response = dcp_write(os.path.join(root, "during_dcp"))
            response.staging_completion.result()
            out["during_dcp_write"] = rate(lambda _: not response.upload_completion.done())
            response.upload_completion.result()
        except Exception as error:  # noqa: BLE001 - a failing peer is a result
            out["dcp_write_error"] = f"{type(error).__name__}: {error}"[:600]
    return out


def measure(sitting) -> dict:
    o = sitting.o
    return {run.label: sitting.child("gpu", revision=run.revision, large_mib=o.large_mib, adam_params=o.adam_params,
                                     reps=o.reps, alone_s=o.alone_s,
                                     methods=list(METHODS) if run.revision is sitting.after else ["d2h", "ours"])
            for _, run in sitting.abba(sitting.runs(["asyncckpt"], {"asyncckpt"}), 1)}


def render(result: dict) -> str:
    lines = ["Stall: until the save returned, or, for `dcp_best`, until its staging completed (the state may change "
             "from then on; `call returned` is when its call returned). Medians of the reps after the first.", ""]
    stagers = {found.get("dcp_best_stager") for found in result["figures"].values()} - {None}
    if stagers:
        lines += [f"`dcp_best`'s DefaultStager: {', '.join(sorted(stagers))}.", ""]
    for label, found in result["figures"].items():
        for name, entry in found["workloads"].items():
            floor = median(r["stall_s"] for r in entry["d2h"].get("reps", []))
            rows = []
            for method in METHODS:
                row = entry.get(method)
                if row is None:
                    continue
                if "error" in row:
                    rows.append([method, f"error: {row['error'][:120]}", "", "", "", ""])
                    continue
                stall = median(r["stall_s"] for r in row["reps"])
                returned = median(r.get("returned_s", r["stall_s"]) for r in row["reps"])
                rows.append([method, fmt(stall), fmt(returned) if method == "dcp_best" else "",
                             fmt(median(r["durable_s"] for r in row["reps"])) if method != "d2h" else "",
                             f"{fmt(stall / floor if floor else None, '.2f')}x", fmt(row["first"]["stall_s"])])
            lines += [f"## {name}: {entry['bytes'] / MiB:.0f} MiB in {entry['tensors']} tensors ({found['device']}"
                      f"{', torch ' + found['torch'] if 'torch' in found else ''}{side(label, result)})", "",
                      *table(["method", "stall s", "call returned s", "durable s", "stall / d2h copy",
                              "first rep stall s"], rows)]
            t = entry.get("training")
            if t:
                lines += [f"GPU matmul loop: {t['alone']:.1f} steps/s alone, {t['during_write']:.1f} while our writer writes "
                          f"({1 - t['during_write'] / t['alone']:+.1%} slowdown), {t['during_export']:.1f} while it exports the "
                          f"checkpoint as safetensors ({t['export_s']:.2f} s; {1 - t['during_export'] / t['alone']:+.1%})"
                          + (f", {t['during_dcp_write']:.1f} while `dcp_best` writes "
                             f"({1 - t['during_dcp_write'] / t['alone']:+.1%})" if "during_dcp_write" in t else "")
                          + (f"; `dcp_best` failed: {t['dcp_write_error'][:160]}" if "dcp_write_error" in t else "")
                          + ".", ""]
    return "\n".join(lines)


def plot(result: dict, figure) -> None:
    found = result["figures"]["asyncckpt"]["workloads"]
    axes = figure.subplots(1, len(found), squeeze=False)[0]
    for ax, (name, entry) in zip(axes, found.items()):
        methods = [m for m in METHODS if "reps" in entry.get(m, {})]
        bars(ax, methods, [median(r["stall_s"] for r in entry[m]["reps"]) for m in methods], f"{name}: stall s")


SCENARIO = Scenario(
    title="Saves from GPU memory",
    question=__doc__.split("\n\n", 1)[0].replace("\n", " "),
    measure=measure, render=render, plot=plot,
    options={"large_mib": Option(2048, 64), "adam_params": Option(2000, 100), "alone_s": Option(3.0, 0.5)},
    reps=(4, 1),
    revisioned=True,
)
