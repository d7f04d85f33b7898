"""Export to Hugging Face safetensors from a 2-rank sharded checkpoint: asyncckpt against the peers.

The model: ~1 GiB of fp32 in ~8,000 tensors (4 of 64 MiB, the rest 2-128 KiB rows), each a DTensor sharded
by rows over 2 gloo ranks (FSDP2's layout), saved by ``Checkpointer.save``. Each exporter then runs in a
fresh process (wall time; peak RSS = the exporting process's ``VmHWM``): asyncckpt's export as the
background writer runs it (``Checkpointer.export``; the writer's own peak), ``asyncckpt export`` (the CLI),
``accelerate merge-weights`` (``merge_fsdp_weights``) and torch's ``dcp_to_torch_save`` followed by
``safetensors.torch.save_file``. Every output is checked to hold the same tensors as asyncckpt's. Last,
what an export in the background costs a training loop: a ``torch.mm`` loop's steps/s alone, while
``Checkpointer.export`` runs, and while another process writes the same bytes durably (the floor).
"""
from __future__ import annotations

import os
import shutil
import statistics

from harness import Option, Scenario
from harness.floors import RawWriter
from harness.ranks import on_ranks
from harness.report import arm_name, bars, fmt, table
from harness.util import median, now

KINDS = ("ours_writer", "ours_cli", "accelerate", "dcp_to_torch_save")
NAMES = {"ours_writer": "asyncckpt, as the background writer runs it (`Checkpointer.export`)",
         "ours_cli": "asyncckpt, `asyncckpt export`", "accelerate": "`accelerate merge-weights` (`merge_fsdp_weights`)",
         "dcp_to_torch_save": "torch `dcp_to_torch_save` + `safetensors.torch.save_file`"}


def model_shapes(total: int, big: int, n_small: int, seed: int = 0) -> dict[str, tuple[int, int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    shapes = {f"layers.{i}.weight": (big, big) for i in range(4)}
    left = total - 4 * big * big * 4
    sizes = torch.randint(1, 129, (n_small,), generator=generator).float()
    sizes = (sizes / sizes.sum() * left / 4 / 256).floor().clamp(min=2).long()  # rows of 256 fp32
    shapes.update({f"blocks.{i}.weight": (int(rows), 256) for i, rows in enumerate(sizes.tolist())})
    return shapes


def _save_rank(rank: int, world: int, path: str, shapes: dict) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from asyncckpt.core import Checkpointer

    mesh = init_device_mesh("cpu", (world,))
    generator = torch.Generator().manual_seed(1)
    model = {key: distribute_tensor(torch.randn(shape, generator=generator), mesh, [Shard(0)])
             for key, shape in shapes.items()}
    with Checkpointer() as checkpointer:
        checkpointer.save({"model": model}, path)


def save(path: str, total_mib: int, big: int, n_small: int) -> dict:
    shapes = model_shapes(total_mib << 20, big, n_small)
    on_ranks(_save_rank, 2, path, {k: list(v) for k, v in shapes.items()})
    return {"tensors": len(shapes), "bytes": sum(r * c * 4 for r, c in shapes.values())}


def _vm_hwm_mib(pid: str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("VmHWM:"))) / 1024


def exporter(kind: str, source: str, out: str) -> dict:
    """One export in this process: seconds of work and the exporting process's peak RSS."""
    started = now()
    if kind == "ours_writer":  # the export runs in the writer process: its peak, read before it stops
        import psutil

        from asyncckpt.core import Checkpointer, ExportOptions

        with Checkpointer() as checkpointer:
            checkpointer.start()
            checkpointer.wait()
            started = now()
            checkpointer.export(source, ExportOptions(directory=out)).result()
            work = now() - started
            peak = max(_vm_hwm_mib(str(p.pid)) for p in psutil.Process().children(recursive=True))
        return {"work_s": work, "peak_rss_mib": peak, "output": os.path.join(out, os.path.basename(source))}
    if kind == "ours_cli":
        from importlib.metadata import entry_points

        (script,) = entry_points(group="console_scripts", name="asyncckpt")
        assert script.load()(["export", source, out, "--no-progress"]) == 0
    elif kind == "accelerate":
        from accelerate.utils import merge_fsdp_weights

        merge_fsdp_weights(source, out, safe_serialization=True)
    else:
        import torch
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        os.makedirs(out)
        dcp_to_torch_save(source, out + "/full.pt")
        save_file(torch.load(out + "/full.pt", weights_only=True)["model"], out + "/model.safetensors")
        os.unlink(out + "/full.pt")
        os.sync()
    return {"work_s": now() - started, "peak_rss_mib": _vm_hwm_mib(), "output": out}


def same_tensors(ours: str, theirs: str) -> dict:
    import torch
    from safetensors import safe_open

    def tensors(directory: str) -> dict:
        found = {}
        for name in sorted(n for n in os.listdir(directory) if n.endswith(".safetensors")):
            with safe_open(os.path.join(directory, name), "pt") as f:
                found.update({key.removeprefix("model."): (os.path.join(directory, name), key) for key in f.keys()})
        return found

    a, b = tensors(ours), tensors(theirs)
    if sorted(a) != sorted(b):
        return {"equal": False}
    for key, (path, name) in a.items():
        with safe_open(path, "pt") as f, safe_open(b[key][0], "pt") as g:
            if not torch.equal(f.get_tensor(name), g.get_tensor(b[key][1])):
                return {"equal": False}
    return {"equal": True}


def slowdown(checkpoint: str, scratch: str, export_bytes: int, rounds: int, alone_s: float) -> dict:
    """steps/s of a 512x512 matmul loop alone, while the background writer exports, and while another process
    writes the export's bytes durably, ``rounds`` times in turn; with the loop on every core (torch's default)
    and on one (a GPU trainer's main thread)."""
    import torch

    from asyncckpt.core import Checkpointer, ExportOptions

    a = torch.randn(512, 512)

    def rate(until) -> float:
        steps, started = 0, now()
        while until(now() - started):
            a.mm(a)
            steps += 1
        return steps / (now() - started)

    os.makedirs(os.path.join(scratch, "floor"), exist_ok=True)
    floor, results, default_threads = RawWriter(export_bytes, os.path.join(scratch, "floor"), keep=1), {}, torch.get_num_threads()
    try:
        with Checkpointer() as checkpointer:
            checkpointer.start()
            checkpointer.wait()
            for threads in sorted({default_threads, 1}, reverse=True):
                torch.set_num_threads(threads)
                alone, during, during_raw, export_s = [], [], [], []
                for _ in range(rounds):
                    alone.append(rate(lambda elapsed: elapsed < alone_s))
                    shutil.rmtree(os.path.join(scratch, "export"), ignore_errors=True)
                    started = now()
                    handle = checkpointer.export(checkpoint, ExportOptions(directory=os.path.join(scratch, "export")))
                    during.append(rate(lambda elapsed: not handle.done()))
                    export_s.append(now() - started)
                    handle.result()
                    floor.start()
                    during_raw.append(rate(lambda elapsed: not floor.done()))
                    floor.wait()
                results[str(threads)] = {
                    "alone": alone, "during_export": during, "during_raw_write": during_raw, "export_s": export_s,
                    "raw_write_s": floor.seconds[-rounds:],
                    "slowdown": [1 - d / x for x, d in zip(alone, during)],
                    "raw_write_slowdown": [1 - d / x for x, d in zip(alone, during_raw)]}
    finally:
        torch.set_num_threads(default_threads)
        floor.close()
    return results


def measure(sitting) -> dict:
    o = sitting.o
    scratch = sitting.scratch
    checkpoint = os.path.join(scratch, "ckpt")
    model = sitting.child("save", path=checkpoint, total_mib=o.total_mib, big=o.big, n_small=o.n_small)
    runs = sitting.runs(KINDS, {"ours_writer", "ours_cli"})
    found: dict[str, list] = {run.label: [] for run in runs}
    reference = None  # the first export's output: every other is compared with it
    with sitting.phase("exporters"):
        for rep, run in sitting.abba(runs, o.reps):
            out = os.path.join(scratch, f"{run.label}-{rep}")
            found[run.label].append(sitting.child("exporter", revision=run.revision, kind=run.arm, source=checkpoint,
                                                  out=out))
            sitting.log(f"{run.label}: {found[run.label][-1]['work_s']:.2f} s")
            if reference is None:
                reference = found[run.label][-1]["output"]
                continue
            found[run.label][-1]["equal"] = sitting.child("same_tensors", ours=reference,
                                                          theirs=found[run.label][-1]["output"])["equal"]
            shutil.rmtree(out)
    with sitting.phase("training loop during an export"):
        loop = sitting.child("slowdown", checkpoint=checkpoint, scratch=sitting.directory("during"),
                             export_bytes=model["bytes"], rounds=o.rounds, alone_s=o.alone_s)
    return {"model": {k: v for k, v in model.items() if k != "_child"}, "exporters": found, "loop": loop}


def render(result: dict) -> str:
    f = result["figures"]
    ex = {label: {"work_s": median(r["work_s"] for r in reps), "wall_s": median(r["_child"]["wall_s"] for r in reps),
                  "peak": max(r["peak_rss_mib"] for r in reps), "equal": all(r.get("equal", True) for r in reps)}
          for label, reps in f["exporters"].items()}
    theirs = [v for k, v in ex.items() if not k.startswith("ours")]
    lines = [
        f"The model: {f['model']['bytes'] / 2**30:.2f} GiB of fp32 in {f['model']['tensors']} tensors, sharded by rows "
        f"over 2 ranks. Each exporter in a fresh process, {result['options']['reps']} rep(s), medians; peak RSS is the "
        "exporting process's `VmHWM` (the highest of the reps); \"work\" excludes the interpreter's start and imports, "
        "\"wall\" includes them. Targets: memory at least 3x less than the peers', at least as fast.", "",
        *table(["exporter", "work s", "wall s", "peak RSS MiB", "same tensors as asyncckpt's"],
               [[arm_name(k, NAMES, result), fmt(v["work_s"], ".2f"), fmt(v["wall_s"], ".2f"), fmt(v["peak"], ".0f"),
                 "yes" if v["equal"] else "**NO**"] for k, v in ex.items()])]
    if theirs:
        for ours in ("ours_writer", "ours_cli"):
            lines.append(f"- {NAMES[ours]}: {min(v['peak'] for v in theirs) / ex[ours]['peak']:.1f}x less memory than the "
                         f"leaner peer, {min(v['work_s'] for v in theirs) / ex[ours]['work_s']:.1f}x the faster peer's speed.")
        lines.append("")
    lines += ["## The training loop while a background export runs", "",
              f"A `torch.mm` 512x512 loop's steps/s alone ({result['options']['alone_s']:g} s), while `Checkpointer.export` "
              "of this checkpoint runs in the background writer, and while another process writes the same number of "
              "bytes durably (the floor of any background work that writes them here); medians of the rounds, alone and "
              "during in turn. Target: at most 5% slower.", "",
              *table(["loop on", "steps/s alone", "during the export", "slowdown (rounds)", "export s",
                      "slowdown while the same bytes are written by another process (rounds)"],
                     [[f"{threads} thread(s)", fmt(median(v["alone"]), ".1f"), fmt(median(v["during_export"]), ".1f"),
                       f"{100 * median(v['slowdown']):.1f}% ({', '.join(f'{100 * x:.1f}' for x in v['slowdown'])})",
                       fmt(median(v["export_s"]), ".2f"),
                       f"{100 * median(v['raw_write_slowdown']):.1f}% "
                       f"({', '.join(f'{100 * x:.1f}' for x in v['raw_write_slowdown'])})"]
                      for threads, v in f["loop"].items() if threads != "_child"])]
    return "\n".join(lines)


def plot(result: dict, figure) -> None:
    left, right = figure.subplots(1, 2)
    reps = result["figures"]["exporters"]
    bars(left, list(reps), [max(r["peak_rss_mib"] for r in v) for v in reps.values()], "peak RSS MiB")
    bars(right, list(reps), [statistics.median(r["work_s"] for r in v) for v in reps.values()], "work s")


SCENARIO = Scenario(
    title="Export to Hugging Face safetensors",
    question=__doc__.split("\n\n", 1)[1].strip().replace("\n", " "),
    measure=measure, render=render, plot=plot,
    options={"total_mib": Option(1024, 24), "big": Option(4096, 512), "n_small": Option(7996, 100),
             "rounds": Option(3, 1), "alone_s": Option(4.0, 0.5)},
    reps=(3, 1),
    revisioned=True,
)
