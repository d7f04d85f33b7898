"""A DDP resume on 1, 2 and 4 ranks: the bytes read from storage and the load time, from a cold disk and from S3.

Under DDP every rank loads the whole checkpoint (Lightning's ``load_checkpoint`` of the ``.ckpt`` on every rank).
A ~1 GiB ``.ckpt`` written by ``AsyncCkptIO``, on the local disk and in a bucket of moto's S3 server (started
here, every GET's bytes counted; or SeaweedFS's, ``--set server=weed``, which serves 1 GiB to four ranks at once
where moto's one Python process cannot, its bytes not counted); on each rank count, the ranks (spawned processes in a gloo group) load it the
way Lightning's DDP strategy does, one rep of each arm in rotation, the file's pages evicted before each:

  native     Lightning's own ``TorchCheckpointIO.load_checkpoint`` on every rank (a URL through fsspec)
  per_rank   ``AsyncCkptIO(cooperative_load="off")``: each rank fetches and checks the file by itself (before
             issue 36)
  asyncckpt  ``AsyncCkptIO()``: each byte read once per job (``loading.cooperative``): from the bucket, split
             across the ranks into the node's memory, shared; a local file on this one node is left to the page
             cache, which already reads it once for every rank
  broadcast  (a floor, not a load) a gloo broadcast of the checkpoint's bytes from one rank to the others: what
             the disk goal adds to one rank's cold read

Timed: from a barrier to the last rank's loaded checkpoint. Bytes: the processes' ``read_bytes`` (disk), the S3
server's GET bytes (S3).
"""
from __future__ import annotations

import os
import time

from harness import Option, Scenario
from harness.machine import evict
from harness.ranks import on_ranks
from harness.report import fmt, table
from harness.util import spread

ARMS = ("native", "per_rank", "asyncckpt")
NAMES = {"native": "Lightning's own load", "per_rank": "asyncckpt, each rank by itself",
         "asyncckpt": "**asyncckpt, once per job**"}
SOURCES = ("disk", "s3")
BUCKET = "resume-ranks"


def checkpoint(mib: int) -> dict:
    """What Lightning's ``.ckpt`` holds, at ``mib`` MiB of tensors (in 64 MiB pieces)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    pieces = max(1, mib // 64)
    return {"state_dict": {f"layer{i}.weight": torch.randn(mib * 2**20 // 4 // pieces, generator=generator)
                           for i in range(pieces)}, "global_step": 1, "epoch": 0}


def loads(rank: int, world: int, paths: dict, reps: int, served) -> list[dict]:
    """On each rank: every arm loads every source ``reps`` times (arms in rotation), after a warm-up load of each."""
    import torch.distributed as dist
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    from asyncckpt.adapters.lightning import AsyncCkptIO

    ios = {"native": TorchCheckpointIO(), "per_rank": AsyncCkptIO(cooperative_load="off"), "asyncckpt": AsyncCkptIO()}
    for arm in ARMS:
        for source in SOURCES:
            ios[arm].load_checkpoint(paths[f"{source}_small"])  # first-use work (imports, clients) out of the way
    rows = []
    for rep in range(reps):
        for source in SOURCES:
            for arm in ARMS[rep % len(ARMS):] + ARMS[:rep % len(ARMS)]:
                if rank == 0 and source == "disk":
                    evict([paths["disk"]])
                dist.barrier()
                read, downloaded, started = _read_bytes(), served.value if served else 0, time.perf_counter()
                error = None
                with _Peak() as peak:
                    try:
                        ios[arm].load_checkpoint(paths[source])
                    except Exception as e:  # noqa: BLE001 - a load that fails (moto's server too slow for it) is a result
                        error = f"{type(e).__name__}: {e}"[:300]
                own = time.perf_counter() - started
                dist.barrier()
                rows.append({"rep": rep, "source": source, "arm": arm, "s": time.perf_counter() - started, "own_s": own,
                             "read": _read_bytes() - read,
                             "downloaded": served.value - downloaded if served else None,
                             "rss": peak.rss, "shmem": peak.shmem, "error": error})
    for io in ios.values():
        if isinstance(io, AsyncCkptIO):
            io.teardown()
    if world > 1:  # the floor the disk goal adds to one rank's cold read: the checkpoint's bytes from one rank to all
        import torch

        bytes_ = torch.empty(os.path.getsize(paths["disk"]), dtype=torch.uint8)
        for rep in range(reps):
            dist.barrier()
            started = time.perf_counter()
            dist.broadcast(bytes_, src=0)
            dist.barrier()
            rows.append({"rep": rep, "source": "disk", "arm": "broadcast", "s": time.perf_counter() - started,
                         "own_s": 0.0, "read": 0, "downloaded": 0, "rss": 0, "shmem": 0, "error": None})
        del bytes_
    return rows


class _Peak:
    """While the block runs (sampled every 5 ms): the most this process held resident above what it held before
    (``rss``), and the most the node's copies of a cooperative load held in tmpfs (``shmem``)."""

    def __enter__(self) -> "_Peak":
        import threading

        from asyncckpt.core import tier

        self.loads = tier.memory_root() + "-loads"  # where ``loading.cooperative`` keeps a node's copy
        self.rss, self.shmem, self._base = 0, 0, _status("VmRSS")
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.rss = max(self.rss, _status("VmRSS") - self._base)
            self.shmem = max(self.shmem, _stored(self.loads))

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) << 10


def _stored(root: str) -> int:
    """The bytes the files under ``root`` take (their pages, not their sizes)."""
    total = 0
    for parent, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(parent, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


def measure(sitting) -> dict:
    import multiprocessing

    import boto3

    from asyncckpt.adapters.lightning import AsyncCkptIO
    from scenarios.object_store import Server

    o = sitting.o
    server = Server(o.server, sitting.directory("s3"))
    served = None  # SeaweedFS's bytes served are not counted (its own components talk over sockets too)
    if o.server == "moto":
        served = multiprocessing.get_context("spawn").Value("q", 0, lock=False)  # every GET's bytes, read by the ranks
        app = server.moto._server.app  # moto keeps its werkzeug server private; the WSGI app on it is public

        def counted(environ, start_response):
            for chunk in app(environ, start_response):
                if environ["REQUEST_METHOD"] == "GET":
                    served.value += len(chunk)
                yield chunk

        server.moto._server.app = counted
    try:
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        folder = sitting.directory("checkpoints")
        paths = {"disk": os.path.join(folder, "last.ckpt"), "s3": f"s3://{BUCKET}/run/last.ckpt",
                 "disk_small": os.path.join(folder, "small.ckpt"), "s3_small": f"s3://{BUCKET}/run/small.ckpt"}
        io = AsyncCkptIO()
        for source in SOURCES:
            io.save_checkpoint(checkpoint(o.size_mib), paths[source])
            io.save_checkpoint(checkpoint(1), paths[f"{source}_small"])
        io.teardown()
        size = os.path.getsize(paths["disk"])
        out = {"bytes": size, "ranks": {}}
        for world in o.ranks:
            with sitting.phase(f"{world} ranks"):
                rows = on_ranks(loads, world, paths, o.reps, served, timeout=3600)
            out["ranks"][str(world)] = {
                f"{source} {arm}": {
                    "s": spread(max(rank_rows[i]["s"] for rank_rows in rows) for i, r in enumerate(rows[0])
                                if (r["source"], r["arm"]) == (source, arm)
                                and not any(rank_rows[i]["error"] for rank_rows in rows)),
                    "errors": sorted({rank_rows[i]["error"] for rank_rows in rows for i, r in enumerate(rows[0])
                                      if (r["source"], r["arm"]) == (source, arm) and rank_rows[i]["error"]}),
                    "read": max(sum(rank_rows[i]["read"] for rank_rows in rows)
                                for i, r in enumerate(rows[0]) if (r["source"], r["arm"]) == (source, arm)),
                    "downloaded": max((r["downloaded"] for r in rows[0] if (r["source"], r["arm"]) == (source, arm)
                                       and r["downloaded"] is not None), default=None),
                    "rss": max(r["rss"] for rank_rows in rows for r in rank_rows if (r["source"], r["arm"]) == (source, arm)),
                    "shmem": max(r["shmem"] for r in rows[0] if (r["source"], r["arm"]) == (source, arm))}
                for source in SOURCES for arm in ARMS}
            broadcasts = [r["s"] for r in rows[0] if r["arm"] == "broadcast"]
            out["ranks"][str(world)]["broadcast"] = {"s": spread(broadcasts) if broadcasts else {"median": 0.0, "n": 0}}
            sitting.log(f"{world} ranks: " + ", ".join(f"{k} {fmt(v['s']['median'], '.2f')} s" for k, v in
                                                        out["ranks"][str(world)].items()))
        return out
    finally:
        server.stop()


def render(result: dict) -> str:
    o, figures = result["options"], result["figures"]
    server = o.get("server", "moto")
    size = figures["bytes"]
    lines = [f"A {size / 2**30:.2f} GiB `.ckpt`; {o['reps']} reps per arm in rotation, medians (min-max), each the "
             "job's time (from a barrier to the last rank's loaded checkpoint). Bytes read from storage: the ranks' "
             "`read_bytes` (disk; the file's pages evicted before each rep), the S3 server's GET bytes (S3; moto's, not counted "
             "with SeaweedFS), as a "
             "multiple of the checkpoint's size (on this one node, a local file is left to the page cache by asyncckpt too: "
             "it already reads each byte once for every rank; the split and the node copy apply from a bucket and across "
             "nodes). Memory: the largest resident set of any rank during its load "
             "above its resident set before the load (sampled every 5 ms; the loaded checkpoint itself is 1x; pages of the "
             "node's copy a rank touched count in its RSS too), and the most the node's copy held in tmpfs (one per "
             "node, shared by its ranks, where the page cache held the file before). All ranks are on this one machine (one node): the page cache here "
             "serves the disk's bytes to every rank that reads them after the first, which hides the per-rank reads "
             "on disk that separate nodes would each make; the S3 column shows them.", ""]
    for source in SOURCES:
        rows = []
        for world, arms in figures["ranks"].items():
            for arm in ARMS:
                entry = arms[f"{source} {arm}"]
                moved = entry["read"] if source == "disk" else entry["downloaded"]
                counted = moved is not None
                s = entry["s"]
                timing = f"{fmt(s['median'], '.2f')} ({fmt(s['min'], '.2f')}-{fmt(s['max'], '.2f')})" if s.get("n") else ""
                if entry["errors"]:
                    timing += f" failed: {'; '.join(entry['errors'])[:160]}"
                rows.append([world, NAMES[arm], timing, f"{moved / 2**20:.0f} MiB" if counted else "not counted",
                             f"{moved / size:.2f}x" if counted else "–", f"{entry['rss'] / 2**20:.0f} MiB",
                             f"{entry['shmem'] / 2**20:.0f} MiB"])
        lines += [f"## From {'the local disk, cold' if source == 'disk' else f'the S3 server ({server})'}", "",
                  *table(["ranks", "load", "s", "read from storage", "/ checkpoint", "a rank's peak RSS, added",
                          "the node's copy, peak"], rows)]
        if source == "disk":
            lines += ["", "The broadcast the disk goal allows for (a gloo broadcast of the checkpoint's bytes from one rank "
                      "to the others, barrier to barrier): " + ", ".join(
                          f"{world} ranks {fmt(arms['broadcast']['s']['median'], '.2f')} s"
                          for world, arms in figures["ranks"].items() if arms.get("broadcast", {}).get("s", {}).get("n")), ""]
    lines += _goals(figures)
    return "\n".join(lines)


def _goals(figures: dict) -> list[str]:
    size, ranks = figures["bytes"], figures["ranks"]
    most = max(ranks, key=int)
    at = ranks[most]
    ours_s3, before_s3, native_s3 = (at[f"s3 {arm}"]["s"]["median"] or float("inf")
                                     for arm in ("asyncckpt", "per_rank", "native"))  # failed: slower than any
    one = ranks.get("1", at)
    goals = [
        ("bytes read 1x at any rank count (asyncckpt; disk and S3)" if at["s3 asyncckpt"]["downloaded"] is not None
         else "bytes read 1x at any rank count (asyncckpt; disk: SeaweedFS's are not counted)",
         max(max(arms[f"{source} asyncckpt"]["read" if source == "disk" else "downloaded"] or 0 for source in SOURCES)
             for arms in ranks.values()) / size, 1.05, "<="),
        (f"from S3 at {most} ranks, at most half of each rank by itself", ours_s3 / before_s3, 0.5, "<="),
        (f"from S3 at {most} ranks, at most half of Lightning's own", ours_s3 / native_s3, 0.5, "<="),
        (f"from disk at {most} ranks, no slower than one rank's cold load (Lightning's own) plus a broadcast of the "
         f"checkpoint to {most} ranks", at["disk asyncckpt"]["s"]["median"]
         / (one["disk native"]["s"]["median"] + at.get("broadcast", {"s": {"median": 0.0}})["s"]["median"]), 1.0, "<="),
    ]
    failed = {arm: bool(at[f"s3 {arm}"]["errors"]) and not at[f"s3 {arm}"]["s"].get("n") for arm in ARMS}
    rows = [[name, f"{value:.2f}", f"{op} {bound}", "yes" if (value <= bound if op == "<=" else value >= bound) else "**no**"]
            for name, value, bound, op in goals]
    for row, arm in ((rows[1], "per_rank"), (rows[2], "native")):
        if failed[arm]:  # no time to compare with: the arm's every load failed (see the S3 table)
            row[1], row[3] = "0 (its loads failed)", "yes, the other arm failed"
    return ["## Goals", "", *table(["goal", "measured", "target", "met"], rows)]


def plot(result: dict, figure) -> None:
    figures = result["figures"]
    size, ranks = figures["bytes"], figures["ranks"]
    worlds = sorted(ranks, key=int)
    axes = figure.subplots(2, 2, squeeze=False)
    for column, source in enumerate(SOURCES):
        for arm in ARMS:
            entries = [ranks[w][f"{source} {arm}"] for w in worlds]
            label = NAMES[arm].strip("*")
            axes[0][column].plot([int(w) for w in worlds], [e["s"]["median"] if e["s"].get("n") else float("nan")
                                                            for e in entries], marker="o", label=label)
            axes[1][column].set_ylim(bottom=0)
            axes[1][column].plot([int(w) for w in worlds],
                                 [((e["read"] if source == "disk" else e["downloaded"]) or float("nan")) / size
                                  for e in entries],
                                 marker="o", label=label)
        axes[0][column].set_title(f"{'local disk, cold' if source == 'disk' else 'S3'}: load time")
        axes[0][column].set_ylabel("seconds")
        axes[1][column].set_title("bytes read from storage")
        axes[1][column].set_ylabel("x the checkpoint")
        for row in axes:
            row[column].set_xlabel("ranks")
            row[column].set_xticks([int(w) for w in worlds])
    axes[0][0].legend(fontsize="small")


SCENARIO = Scenario(
    title="A DDP resume on several ranks",
    question="What a resume under DDP reads from storage, and how long it takes, on 1, 2 and 4 ranks, from a cold "
             "local disk and from S3: each byte once per job (asyncckpt), each rank by itself (asyncckpt before issue "
             "36), and Lightning's own load on every rank.",
    measure=measure, render=render, plot=plot,
    options={"size_mib": Option(1024, 64), "ranks": Option((1, 2, 4), (1, 2)), "reps": Option(2, 1),
             "server": Option("moto", "moto", "moto (threaded, in this process: GET bytes counted; it cannot serve 1 GiB "
                                              "to 4 ranks at once) or weed (SeaweedFS, if installed: bytes not counted)")},
    reps=(2, 1),
)
