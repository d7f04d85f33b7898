#!/usr/bin/env python
"""One-run benchmark of asyncckpt.core against this machine's limits and the peers.

    .venv/bin/python benchmarks/core_bench.py --out docs/benchmarks.json --md docs/benchmarks.md

Sections (all in one run, results in one JSON + one markdown report):

  limits    memcpy into a held buffer; O_DIRECT write + fsync; buffered write + fsync;
            cold (after drop_caches) and cached sequential reads.
  workloads (a) "large": 16 big fp32 tensors; (b) "adam": 1 GiB in ~8,000 tensors (5 large +
            2000 small params, Adam exp_avg / exp_avg_sq / 0-dim step per param). Saves:
            torch.save(+fsync), safetensors save_file(+fsync), dcp.save(no_dist), ours
            (core.save, AsyncCkptStorageWriter via dcp.save); loads: torch.load / safetensors
            (+copy into the preallocated state), dcp.load, ours (verify on/off).
  ranks2    2 gloo ranks (spawned), replicated state, core.save (dedup: each writes ~half).
  planning  10,000 small tensors: first vs warm Checkpointer.async_save, and the isolated
            planning steps (flatten, structure_hash, agree_on_structure, _plan).
  stall     time blocked in async_save vs a held memcpy of the same bytes, total to durable,
            vs dcp.async_save (THREAD, PROCESS, DefaultStager) and Lightning AsyncCheckpointIO;
            peak extra memory (system used, process-tree RSS) per path.
  slowdown  a torch.mm 512x512 loop's steps/s alone vs while a save is in flight.

Every figure is a median of --reps back-to-back reps; saves also get one rep after --settle-s
idle seconds (this VM returns freed memory to its host; touching it again is ~10x slower, see
/work/shared/research/machine.md). A failing peer is recorded as an error string, not a crash.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import mmap
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

import psutil
import torch

from raw_writer import CHUNK, RawWriter, write_file

GiB = 1 << 30
MiB = 1 << 20
STALL_REPS = 7  # reps of our own async stalls: one slow rep in 3 (the machine's, not ours) moved the median
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------- utils
def now() -> float:
    return time.perf_counter()


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


def err_str(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) < 600 else text[:600] + "..."


def gbps(nbytes: int, seconds: Optional[float]) -> Optional[float]:
    if not seconds or seconds <= 0:
        return None
    return nbytes / seconds / 1e9


def med(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def rnd(x, n=4):
    if isinstance(x, float):
        return round(x, n)
    if isinstance(x, dict):
        return {k: rnd(v, n) for k, v in x.items()}
    if isinstance(x, list):
        return [rnd(v, n) for v in x]
    return x


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def remove_glob(directory: str, prefix: str) -> None:
    """Remove every entry of ``directory`` starting with ``prefix`` (also our hidden staging dirs)."""
    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        if name.startswith(prefix) or name.startswith("." + prefix):
            remove(os.path.join(directory, name))


def sync_quiet() -> None:
    os.sync()


def drop_caches() -> Optional[str]:
    """Drop the page cache (root only). Returns None on success, else why not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return err_str(e)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
    return total


def guarded(results: dict, key: str, fn: Callable, *args, **kwargs):
    """Run ``fn``; store its result (or an error string) under ``results[key]``."""
    try:
        results[key] = fn(*args, **kwargs)
    except BaseException as e:  # a failing peer must not stop the run
        if isinstance(e, KeyboardInterrupt):
            raise
        results[key] = {"error": err_str(e), "traceback": traceback.format_exc()[-2000:]}
        log(f"  {key}: ERROR {err_str(e)}")
    return results[key]


def guarded_into(results: dict, key: str, fn: Callable) -> None:
    """Run ``fn`` (which stores its own results); if it raises before storing ``key``, store the error there."""
    try:
        fn()
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):
            raise
        if not isinstance(results.get(key), dict) or "median" not in results[key]:
            results[key] = {"error": err_str(e), "traceback": traceback.format_exc()[-2000:]}
        log(f"  {key}: ERROR {err_str(e)}")


class MemSampler:
    """Peak system used memory (total - available) and process-tree RSS, sampled in a thread."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval = interval
        self.proc = psutil.Process()
        self._procs: list = [self.proc]
        self._n = 0
        self._stop = threading.Event()
        self.base_used = self.base_rss = 0
        self.peak_used = self.peak_rss = 0

    def _sample(self) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        rss = 0
        if self._n % 10 == 0:  # scanning /proc for children is the costly part: every 0.5 s
            with contextlib.suppress(psutil.Error):
                self._procs = [self.proc] + self.proc.children(recursive=True)
        self._n += 1
        for p in self._procs:
            try:
                rss += p.memory_info().rss
            except psutil.Error:
                pass
        return vm.total - vm.available, rss

    def _run(self) -> None:
        while not self._stop.is_set():
            used, rss = self._sample()
            self.peak_used, self.peak_rss = max(self.peak_used, used), max(self.peak_rss, rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> "MemSampler":
        self.base_used, self.base_rss = self._sample()
        self.peak_used, self.peak_rss = self.base_used, self.base_rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        used, rss = self._sample()
        self.peak_used, self.peak_rss = max(self.peak_used, used), max(self.peak_rss, rss)

    def result(self) -> dict:
        return {
            "extra_used_gib": (self.peak_used - self.base_used) / GiB,
            "extra_tree_rss_gib": (self.peak_rss - self.base_rss) / GiB,
            "base_used_gib": self.base_used / GiB,
            "base_tree_rss_gib": self.base_rss / GiB,
        }


class CpuMonitor:
    """CPU used by processes outside this benchmark's process tree (other jobs on the machine),
    sampled once a second; reported per section so interference is visible in the results."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self._stop = threading.Event()
        self.samples: list[tuple[float, float, float]] = []  # (time, system busy cores, our cores)
        self._lock = threading.Lock()
        self._last: dict[int, float] = {}

    def _ours(self) -> float:
        """CPU seconds our process tree used since the last call (per-pid deltas: children come and go)."""
        delta = 0.0
        seen = {}
        with contextlib.suppress(psutil.Error):
            for p in [self.proc] + self.proc.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    total = t.user + t.system
                    seen[p.pid] = total
                    delta += total - self._last.get(p.pid, 0.0)
        self._last = seen
        return delta

    @staticmethod
    def _busy() -> float:
        t = psutil.cpu_times()
        return sum(t) - t.idle - getattr(t, "iowait", 0.0)

    def _run(self) -> None:
        self._ours()
        last_t, last_busy = now(), self._busy()
        while not self._stop.wait(1.0):
            t, busy, ours = now(), self._busy(), self._ours()
            dt = t - last_t
            if dt > 0:
                with self._lock:
                    self.samples.append((t, (busy - last_busy) / dt, max(0.0, ours / dt)))
            last_t, last_busy = t, busy

    def start(self) -> "CpuMonitor":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def window(self, t0: float, t1: float) -> dict:
        with self._lock:
            rows = [r for r in self.samples if t0 <= r[0] <= t1 + 1.0]
        if not rows:
            return {}
        foreign = [max(0.0, b - o) for _, b, o in rows]
        return {"foreign_cpu_cores_mean": sum(foreign) / len(foreign), "foreign_cpu_cores_max": max(foreign),
                "our_cpu_cores_mean": sum(o for *_, o in rows) / len(rows), "seconds": len(rows)}


def wait_quiet(max_wait_s: float, threshold_pct: float = 15.0, quiet_for_s: float = 20.0) -> dict:
    """Wait (at most ``max_wait_s``) until the whole machine has been nearly idle for ``quiet_for_s``."""
    t0 = now()
    quiet_since = None
    while now() - t0 < max_wait_s:
        busy = psutil.cpu_percent(interval=2.0)
        if busy < threshold_pct:
            quiet_since = quiet_since or now()
            if now() - quiet_since >= quiet_for_s:
                return {"waited_s": now() - t0, "quiet": True}
        else:
            quiet_since = None
    return {"waited_s": now() - t0, "quiet": max_wait_s <= 0}


def run_peer(fn: Callable[[str], dict], *, reps: int, settle_s: float, first: bool = True,
             prepare: Optional[Callable[[], None]] = None, settle: bool = True) -> dict:
    """``first`` call (recorded apart), ``reps`` back-to-back reps, then one rep after ``settle_s`` idle.

    ``fn(tag)`` returns a dict of timings; ``prepare()`` runs untimed before every call.
    """
    out: dict[str, Any] = {"reps": []}
    prepare = prepare or (lambda: None)
    if first:
        prepare()
        out["first"] = fn("first")
    for i in range(reps):
        prepare()
        out["reps"].append(fn(f"r{i}"))
    if settle and settle_s > 0:
        prepare()
        time.sleep(settle_s)
        out["settle"] = fn("settle")
    keys = sorted({k for r in out["reps"] for k, v in r.items() if isinstance(v, (int, float))})
    out["median"] = {k: med([r.get(k) for r in out["reps"]]) for k in keys}
    out["min"] = {k: min(r[k] for r in out["reps"] if r.get(k) is not None) for k in keys
                  if any(r.get(k) is not None for r in out["reps"])}
    out["max"] = {k: max(r[k] for r in out["reps"] if r.get(k) is not None) for k in keys
                  if any(r.get(k) is not None for r in out["reps"])}
    return out


# ---------------------------------------------------------------------------------------- states
def make_large(total_bytes: int, n: int = 16, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    each = total_bytes // n // 4
    return {f"layer{i}.weight": torch.empty(each).uniform_(-1, 1, generator=gen) for i in range(n)}


def make_adam(total_bytes: int, n_small: int = 2000, seed: int = 1) -> dict:
    """Params (4 large + 1 remainder + n_small log-uniform 1-128 KiB) and Adam-like state per param.

    Total fp32 bytes of params + exp_avg + exp_avg_sq + steps = ``total_bytes``.
    """
    gen = torch.Generator().manual_seed(seed)
    n_params = 5 + n_small
    param_bytes = (total_bytes - 4 * n_params) // 3
    large_each = total_bytes // 16
    lo, hi = math.log(256), math.log(32768)  # elements: 1 KiB .. 128 KiB of fp32
    small = [int(math.exp(lo + (hi - lo) * u)) for u in torch.rand(n_small, generator=gen).tolist()]
    remainder = param_bytes // 4 - 4 * (large_each // 4) - sum(small)
    if remainder <= 0:
        raise ValueError("state too small for 4 large tensors + the small ones")
    sizes = [large_each // 4] * 4 + [remainder] + small
    model, state = {}, {}
    for i, numel in enumerate(sizes):
        p = torch.empty(numel).uniform_(-1, 1, generator=gen)
        model[f"block{i}.weight"] = p
        state[i] = {
            "step": torch.tensor(float(100 + i)),
            "exp_avg": torch.empty(numel).uniform_(-1e-3, 1e-3, generator=gen),
            "exp_avg_sq": torch.empty(numel).uniform_(0, 1e-6, generator=gen),
        }
    param_groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                     "params": list(range(len(sizes)))}]
    return {"model": model, "optim": {"state": state, "param_groups": param_groups}}


def iter_tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{prefix}.{i}" if prefix else str(i))


def state_bytes(sd) -> int:
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(sd))


def n_tensors(sd) -> int:
    return sum(1 for _ in iter_tensors(sd))


def flat_tensors(sd) -> dict:
    return {k: t for k, t in iter_tensors(sd)}


def zeros_like_state(sd):
    """Same structure, zero tensors (pre-faulted), non-tensor leaves altered so a load must restore them."""
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: zeros_like_state(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [zeros_like_state(v) for v in sd]
    if isinstance(sd, tuple):
        return tuple(zeros_like_state(v) for v in sd)
    if isinstance(sd, float):
        return -1.0
    return sd


def same_state(a, b) -> bool:
    ta, tb = flat_tensors(a), flat_tensors(b)
    if ta.keys() != tb.keys():
        return False
    return all(torch.equal(ta[k], tb[k]) for k in ta)


def non_tensors_equal(a, b) -> bool:
    try:
        return a["optim"]["param_groups"] == b["optim"]["param_groups"]
    except (KeyError, TypeError):
        return True


def copy_into_state(target, flat: dict, prefix="") -> None:
    for k, t in iter_tensors(target):
        t.copy_(flat[k])


def fill_zero(target) -> None:
    for _, t in iter_tensors(target):
        t.zero_()


# ---------------------------------------------------------------------------------------- 1. limits
class AlignedBuffer:
    """Anonymous page-aligned memory, pre-faulted and held (for O_DIRECT and held reads)."""

    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, nbytes)
        self.view = memoryview(self.map)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.tensor.fill_(1)

    def close(self) -> None:
        del self.tensor
        self.view.release()
        self.map.close()


class PairedMemcpy:
    """The stall's floor of the moment: a held memcpy of ``nbytes`` (section 1's method: one
    ``dst.copy_(src)``, torch's threads), timed right before a rep. This machine's copy speed swings
    by 1.5-2x within a run, so a floor measured minutes away judges the stall against another machine."""

    def __init__(self, nbytes: int) -> None:
        self.src = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
        self.dst = torch.zeros_like(self.src)
        self()

    def __call__(self) -> float:
        t0 = now()
        self.dst.copy_(self.src)
        return now() - t0


class PairedODirect:
    """The disk of the moment: a durable O_DIRECT write of ``nbytes`` from held memory (section 1's
    method, 32 MiB requests on ``threads`` threads) into ``directory``, timed right before a rep of
    ours. The disk's speed drifts within a run, and a limit measured minutes earlier or later judges
    the save against another disk."""

    def __init__(self, nbytes: int, directory: str, threads: int = 2) -> None:
        self.buffer = AlignedBuffer(-(-nbytes // 4096) * 4096)
        self.buffer.tensor.view(torch.float32).uniform_()  # the bytes section 1 writes
        self.path, self.threads = os.path.join(directory, f"paired_odirect_{os.getpid()}.bin"), threads

    def __call__(self) -> float:
        seconds = write_file(self.path, self.buffer.view, direct=True, threads=self.threads)["s"]
        os.unlink(self.path)
        return seconds

    def close(self) -> None:
        self.buffer.close()


def read_file_into(path: str, buf: memoryview) -> dict:
    fd = os.open(path, os.O_RDONLY)
    try:
        t0 = now()
        off = 0
        while off < len(buf):
            n = os.preadv(fd, [buf[off:off + CHUNK]], off)
            if n == 0:
                break
            off += n
        t1 = now()
    finally:
        os.close(fd)
    return {"s": t1 - t0, "gbps": gbps(off, t1 - t0)}


def bench_limits(args, nbytes: int, tag: str = "start") -> dict:
    log(f"limits ({tag}): {nbytes / GiB:.3f} GiB")
    res: dict[str, Any] = {"bytes": nbytes, "torch_threads": torch.get_num_threads()}
    path = os.path.join(args.dir, f"limits_{tag}.bin")
    src = torch.empty(nbytes // 4).uniform_()
    dst = torch.empty_like(src)
    dst.fill_(0)  # pre-fault: a held buffer
    buf = AlignedBuffer(nbytes)
    buf.tensor.copy_(src.view(torch.uint8))

    def memcpy(_tag):
        t0 = now()
        dst.copy_(src)
        dt = now() - t0
        return {"s": dt, "gbps": gbps(nbytes, dt)}

    guarded(res, "memcpy_held", run_peer, memcpy, reps=args.reps, settle_s=args.settle_s, first=True,
            settle=tag == "start")

    def odirect(threads):
        def fn(_tag):
            remove(path)
            sync_quiet()
            return write_file(path, buf.view, direct=True, threads=threads)
        return fn

    guarded(res, "odirect_write_1t", run_peer, odirect(1), reps=args.reps, settle_s=args.settle_s, first=False,
            settle=tag == "start")
    guarded(res, "odirect_write_2t", run_peer, odirect(2), reps=args.reps, settle_s=args.settle_s, first=False,
            settle=tag == "start")

    def buffered(_tag):
        remove(path)
        sync_quiet()
        return write_file(path, buf.view, direct=False, threads=1)

    guarded(res, "buffered_write_fsync", run_peer, buffered, reps=args.reps, settle_s=args.settle_s, first=False,
            settle=tag == "start")

    def cold(_tag):
        why = drop_caches()
        if why is not None:
            raise PermissionError(f"drop_caches not permitted: {why}")
        return read_file_into(path, buf.view)

    guarded(res, "cold_read", run_peer, cold, reps=args.reps, settle_s=0, first=False, settle=False)
    read_file_into(path, buf.view)  # make sure it is cached

    def cached(_tag):
        return read_file_into(path, buf.view)

    guarded(res, "cached_read", run_peer, cached, reps=args.reps, settle_s=0, first=False, settle=False)
    ok = bool(torch.equal(buf.tensor, src.view(torch.uint8)))
    res["read_back_equal"] = ok
    remove(path)
    buf.close()
    del src, dst
    gc.collect()
    for k, v in res.items():
        if isinstance(v, dict) and "median" in v:
            log(f"  {k}: median {v['median'].get('gbps', 0):.2f} GB/s"
                + (f", after idle {v['settle']['gbps']:.2f}" if v.get("settle") else ""))
    return res


def limit_values(limits_start: dict, limits_end: Optional[dict]) -> dict:
    """The limits used for ratios: the better of the start/end medians (conservative for us)."""

    def best(key):
        vals = []
        for lim in (limits_start, limits_end or {}):
            v = lim.get(key)
            if isinstance(v, dict) and "median" in v and v["median"].get("gbps"):
                vals.append(v["median"]["gbps"])
        return max(vals) if vals else None

    odirect = [x for x in (best("odirect_write_1t"), best("odirect_write_2t")) if x]
    return {
        "memcpy_gbps": best("memcpy_held"),
        "odirect_write_gbps": max(odirect) if odirect else None,
        "buffered_write_fsync_gbps": best("buffered_write_fsync"),
        "cold_read_gbps": best("cold_read"),
        "cached_read_gbps": best("cached_read"),
    }


# ---------------------------------------------------------------------------------------- 2. workloads
def bench_workload(args, name: str, sd: dict, limits: dict) -> dict:
    from safetensors.torch import load_file, save_file
    import torch.distributed.checkpoint as dcp
    from asyncckpt import core

    nbytes = state_bytes(sd)
    res: dict[str, Any] = {"bytes": nbytes, "tensors": n_tensors(sd), "save": {}, "load": {}}
    log(f"workload {name}: {nbytes / GiB:.3f} GiB in {res['tensors']} tensors")
    wdir = os.path.join(args.dir, f"w_{name}")
    os.makedirs(wdir, exist_ok=True)
    flat = flat_tensors(sd)
    last: dict[str, str] = {}

    def saver(peer: str, call: Callable[[str], None], extra_sync: bool, paired: Optional[Callable[[], float]] = None):
        def prepare():
            remove_glob(wdir, peer + "_")
            sync_quiet()

        def fn(tag):
            raw_s = paired() if paired is not None else None
            path = os.path.join(wdir, f"{peer}_{tag}")
            t0 = now()
            call(path)
            t1 = now()
            os.sync()
            t2 = now()
            last[peer] = path
            out = {"s": t1 - t0, "durable_s": t2 - t0, "gbps": gbps(nbytes, t1 - t0),
                   "durable_gbps": gbps(nbytes, t2 - t0), "disk_bytes": tree_bytes(path)}
            if raw_s is not None:  # this rep against a raw write of the same bytes made just before it
                out.update(paired_odirect_s=raw_s, x_paired_odirect=raw_s / (t1 - t0))
            return out
        return fn, prepare

    def run_save(peer, call, first=True, paired=None):
        fn, prepare = saver(peer, call, True, paired)
        log(f"  save {peer}")
        r = guarded(res["save"], peer, run_peer, fn, reps=args.reps, settle_s=args.settle_s, first=first, prepare=prepare)
        if "median" in r:
            m = r["median"]
            log(f"    median {m['s']:.3f} s ({m['gbps']:.2f} GB/s), first {r.get('first', {}).get('s', float('nan')):.3f} s,"
                f" after idle {r.get('settle', {}).get('s', float('nan')):.3f} s")

    def torch_save(path):
        with open(path, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())

    def st_save(path):
        save_file(flat, path)
        fsync_path(path)

    def dcp_save(path):
        dcp.save(sd, checkpoint_id=path, no_dist=True)

    def ours_save(path):
        core.save(sd, path)

    writer_box: dict[str, Any] = {}

    def ours_writer(path):
        if "w" not in writer_box:
            writer_box["w"] = core.AsyncCkptStorageWriter(path)
        dcp.save(sd, checkpoint_id=path, storage_writer=writer_box["w"], no_dist=True)

    run_save("torch_save", torch_save)
    run_save("safetensors", st_save)
    run_save("dcp_save", dcp_save)
    with contextlib.suppress(Exception):
        core.default_checkpointer().close()  # the next core.save is a genuine first call
    paired_odirect = PairedODirect(nbytes, wdir)
    run_save("ours_core_save", ours_save, paired=paired_odirect)
    paired_odirect.close()

    def ours_async(tag):
        path = os.path.join(wdir, f"ours_core_async_save_{tag}")
        memcpy_s = paired_memcpy()
        t0 = now()
        handle = core.async_save(sd, path)
        t1 = now()
        handle.result()
        t2 = now()
        last["ours_core_async_save"] = path
        return {"stall_s": t1 - t0, "s": t2 - t0, "gbps": gbps(nbytes, t2 - t0),
                "paired_memcpy_s": memcpy_s, "x_paired_memcpy": (t1 - t0) / memcpy_s}

    paired_memcpy = PairedMemcpy(nbytes)
    log("  save ours_core_async_save (warm; stall = until async_save returned)")
    r = guarded(res["save"], "ours_core_async_save", run_peer, ours_async, reps=max(args.reps, STALL_REPS), settle_s=args.settle_s,
                first=False, prepare=lambda: (remove_glob(wdir, "ours_core_async_save_"), sync_quiet()))
    if "median" in r:
        log(f"    stall median {r['median']['stall_s']:.3f} s, total {r['median']['s']:.3f} s, "
            f"{r['median']['x_paired_memcpy']:.2f}x a held memcpy made right before each rep")
    del paired_memcpy
    remove_glob(wdir, "ours_core_async_save_")
    run_save("ours_writer_dcp_save", ours_writer)
    writer_box.clear()
    gc.collect()

    # ---- loads, into a preallocated (held) state dict, page cache warm; one cold rep.
    target = zeros_like_state(sd)
    tflat = flat_tensors(target)

    def loader(peer: str, call: Callable[[], None]):
        def fn(tag):
            if tag == "cold":
                why = drop_caches()
                if why is not None:
                    return {"skipped": why}
            fill_zero(target)
            t0 = now()
            call()
            dt = now() - t0
            return {"s": dt, "gbps": gbps(nbytes, dt)}
        return fn

    def run_load(peer, call, source_peer):
        if source_peer not in last:
            res["load"][peer] = {"error": f"no checkpoint from {source_peer}"}
            return
        log(f"  load {peer}")

        def body():
            fn = loader(peer, call)
            out = run_peer(fn, reps=args.reps, settle_s=0, first=True, settle=False)
            out["verified"] = same_state(target, sd) and non_tensors_equal(target, sd)
            out["cold"] = fn("cold")
            if not out["verified"]:
                raise AssertionError(f"{peer}: loaded values differ from the saved state")
            return out

        r = guarded(res["load"], peer, body)
        if "median" in r:
            log(f"    median {r['median']['s']:.3f} s ({r['median']['gbps']:.2f} GB/s), cold {r['cold'].get('s', float('nan')):.3f} s")

    def torch_load():
        loaded = torch.load(last["torch_save"], weights_only=True)
        copy_into_state(target, flat_tensors(loaded))
        if "optim" in target:
            target["optim"]["param_groups"] = loaded["optim"]["param_groups"]

    def st_load():
        loaded = load_file(last["safetensors"])
        copy_into_state(target, loaded)
        if "optim" in target:
            target["optim"]["param_groups"] = sd["optim"]["param_groups"]  # not in safetensors (tensors only)

    def dcp_load():
        dcp.load(target, checkpoint_id=last["dcp_save"], no_dist=True)

    def ours_load(verify):
        def call():
            core.load(target, last["ours_core_save"], verify=verify)
        return call

    def dcp_load_ours():
        dcp.load(target, checkpoint_id=last["ours_core_save"], no_dist=True)

    def restore_groups():
        if "optim" in target:
            target["optim"]["param_groups"] = zeros_like_state(sd["optim"]["param_groups"])

    for peer, call, src in [
        ("torch_load", torch_load, "torch_save"),
        ("safetensors_load_file", st_load, "safetensors"),
        ("dcp_load", dcp_load, "dcp_save"),
        ("ours_core_load_verify", ours_load(True), "ours_core_save"),
        ("ours_core_load_noverify", ours_load(False), "ours_core_save"),
        ("dcp_load_FileSystemReader_of_ours", dcp_load_ours, "ours_core_save"),
    ]:
        restore_groups()
        run_load(peer, call, src)
    del target, tflat
    with contextlib.suppress(Exception):
        core.default_checkpointer().close()
    remove(wdir)
    sync_quiet()
    gc.collect()
    return res


# ---------------------------------------------------------------------------------------- 3. two ranks
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, world: int, port: int, cfg: dict, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # as torchrun does with 2 ranks on 2 cores
    import torch.distributed as dist
    from asyncckpt import core

    out: dict[str, Any] = {}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
        for name in cfg["workloads"]:
            try:
                sd = make_large(cfg["bytes"]) if name == "large" else make_adam(cfg["bytes"], cfg["n_small"])
                nbytes = state_bytes(sd)
                wdir = os.path.join(cfg["dir"], f"r2_{name}")
                if rank == 0:
                    os.makedirs(wdir, exist_ok=True)
                dist.barrier()
                ck = core.default_checkpointer()
                reps: list[dict] = []
                w: dict[str, Any] = {"bytes": nbytes, "tensors": n_tensors(sd)}
                pair: dict[str, PairedODirect] = {}

                def one(tag):
                    dist.barrier()
                    if rank == 0:
                        remove_glob(wdir, "ck_")
                        os.sync()
                    dist.barrier()
                    raw_s = None
                    if pair:  # both ranks write their share raw at once: the disk of the moment for this rep
                        raw_s = pair["write"]()
                        dist.barrier()
                    path = os.path.join(wdir, f"ck_{tag}")
                    t0 = now()
                    core.save(sd, path)
                    dt = now() - t0
                    sizes = {}
                    for r in range(world):
                        for suffix in ("0", "1"):
                            fp = os.path.join(path, f"__{r}_{suffix}.distcp")
                            if os.path.exists(fp):
                                sizes[f"__{r}_{suffix}.distcp"] = os.path.getsize(fp)
                    return {"s": dt, "files": sizes, "path": path, "raw_s": raw_s}

                w["first"] = one("first")
                share = sum(size for file, size in w["first"]["files"].items() if file.startswith(f"__{rank}_"))
                pair["write"] = PairedODirect(share, wdir, threads=1)
                for i in range(cfg["reps"]):
                    reps.append(one(f"r{i}"))
                pair.pop("write").close()
                w["reps"] = reps
                dist.barrier()
                time.sleep(cfg["settle_s"])
                w["settle"] = one("settle")
                # load (each rank reads the whole replicated state: both ranks' files)
                target = zeros_like_state(sd)
                loads = []
                for i in range(cfg["reps"] + 1):
                    fill_zero(target)
                    dist.barrier()
                    t0 = now()
                    core.load(target, w["settle"]["path"])
                    loads.append(now() - t0)
                w["load_first_s"] = loads[0]
                w["load_reps_s"] = loads[1:]
                w["load_verified"] = same_state(target, sd)
                del target
                ck.close()
                dist.barrier()
                if rank == 0:
                    remove(wdir)
                out[name] = w
                del sd
                gc.collect()
            except Exception as e:
                out[name] = {"error": err_str(e), "traceback": traceback.format_exc()[-2000:]}
        queue.put((rank, out))
    except BaseException as e:
        queue.put((rank, {"error": err_str(e), "traceback": traceback.format_exc()[-2000:]}))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def bench_two_ranks(args, nbytes: int, limits: dict) -> dict:
    import multiprocessing as mp

    log("two ranks (gloo, spawned processes)")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    cfg = {"bytes": nbytes, "n_small": args.n_small, "dir": args.dir, "reps": args.reps,
           "settle_s": args.settle_s, "workloads": ["large"] if args.quick else ["large", "adam"]}
    procs = [ctx.Process(target=_rank_entry, args=(r, 2, port, cfg, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    deadline = time.monotonic() + args.rank_timeout
    while len(got) < 2 and time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            rank, out = queue.get(timeout=5)
            got[rank] = out
        if len(got) < 2 and not any(p.is_alive() for p in procs) and queue.empty():
            break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if len(got) < 2:
        return {"error": f"ranks did not finish (got {sorted(got)}; exit codes {[p.exitcode for p in procs]})",
                "partial": got}
    res: dict[str, Any] = {"world_size": 2, "per_rank_threads": 1, "raw": got}
    for name in cfg["workloads"]:
        r0, r1 = got[0].get(name, {}), got[1].get(name, {})
        if "error" in r0 or "error" in r1 or not r0:
            res[name] = {"error": r0.get("error") or r1.get("error") or "missing"}
            continue
        nb = r0["bytes"]
        reps = [max(a["s"], b["s"]) for a, b in zip(r0["reps"], r1["reps"])]
        first = max(r0["first"]["s"], r1["first"]["s"])
        settle = max(r0["settle"]["s"], r1["settle"]["s"])
        files = r0["settle"]["files"]
        loads = [max(a, b) for a, b in zip(r0["load_reps_s"], r1["load_reps_s"])]
        raw = [max(a["raw_s"], b["raw_s"]) for a, b in zip(r0["reps"], r1["reps"])]
        x_paired = [w / s for w, s in zip(raw, reps)]
        res[name] = {
            "paired_odirect_reps_s": raw, "x_paired_odirect_reps": x_paired, "save_x_paired_odirect": med(x_paired),
            "bytes": nb, "tensors": r0["tensors"],
            "save_first_s": first, "save_reps_s": reps, "save_median_s": med(reps), "save_settle_s": settle,
            "save_gbps": gbps(nb, med(reps)), "save_settle_gbps": gbps(nb, settle),
            "bytes_per_rank": {f"rank{r}": files.get(f"__{r}_0.distcp", 0) + files.get(f"__{r}_1.distcp", 0)
                               for r in range(2)},
            "files": files,
            "load_first_s": max(r0["load_first_s"], r1["load_first_s"]),
            "load_reps_s": loads, "load_median_s": med(loads), "load_gbps_per_rank": gbps(nb, med(loads)),
            "load_verified": bool(r0["load_verified"] and r1["load_verified"]),
        }
        log(f"  {name}: save median {med(reps):.3f} s ({gbps(nb, med(reps)):.2f} GB/s), after idle {settle:.3f} s, "
            f"bytes per rank {res[name]['bytes_per_rank']}")
    return res


# ---------------------------------------------------------------------------------------- 4. planning
def _planning_entry(cfg: dict, queue) -> None:
    try:
        queue.put(_planning_body(cfg))
    except BaseException as e:
        queue.put({"error": err_str(e), "traceback": traceback.format_exc()[-2000:]})


def _planning_body(cfg: dict) -> dict:
    """Time each ``async_save`` and split it with timers wrapped around the Checkpointer's steps.

    Only stable names are wrapped (``Checkpointer._plan`` / ``_free_slot`` / ``_submit`` and
    ``_stage_and_submit``: the copy's wait and the hand-off to the writer, which includes
    ``_submit``), so this survives changes inside them. What is
    left of the call is the per-save bookkeeping every save repeats (flatten, structure
    description + digest, agreement, plan-cache lookup, source lookup, request): "warm planning".
    "Cold planning" = that + ``_plan`` on the first save of a structure.
    """
    from collections import defaultdict

    from asyncckpt.core import Checkpointer

    timers: dict[str, float] = defaultdict(float)

    def wrap(owner, name, key):
        original = getattr(owner, name, None)
        if original is None:
            return False

        def timed(*a, **k):
            t0 = now()
            try:
                return original(*a, **k)
            finally:
                timers[key] += now() - t0

        setattr(owner, name, timed)
        return True

    wrapped = {"plan": wrap(Checkpointer, "_plan", "plan"), "slot": wrap(Checkpointer, "_free_slot", "slot"),
               "submit": wrap(Checkpointer, "_submit", "submit") or wrap(Checkpointer, "_ensure_worker", "submit"),
               "copy": wrap(Checkpointer, "_stage_and_submit", "copy")}

    def clear_templates():
        with contextlib.suppress(Exception):
            from asyncckpt.core.container import container_template
            container_template.cache_clear()

    n, reps = cfg["n"], cfg["reps"]
    gen = torch.Generator().manual_seed(7)
    lo, hi = math.log(256), math.log(4096)  # 1-16 KiB fp32, random shapes
    sizes = [int(math.exp(lo + (hi - lo) * u)) for u in torch.rand(n, generator=gen).tolist()]
    sd = {"model": {f"layers.{i // 10}.p{i % 10}": torch.randn(s, generator=gen) for i, s in enumerate(sizes)}}
    out: dict[str, Any] = {"tensors": n, "bytes": state_bytes(sd), "unique_shapes": len(set(sizes)), "wrapped": wrapped}
    d = cfg["dir"]
    os.makedirs(d, exist_ok=True)
    counter = [0]

    def timed_async(ck) -> dict:
        counter[0] += 1
        timers.clear()
        t0 = now()
        h = ck.async_save(sd, os.path.join(d, f"ck{counter[0]}"))
        ret = now() - t0
        parts = dict(timers)
        h.result()
        total = now() - t0
        shutil.rmtree(os.path.join(d, f"ck{counter[0]}"), ignore_errors=True)
        r = {"return_s": ret, "total_s": total, **{f"{k}_s": parts.get(k, 0.0) for k in ("plan", "slot", "submit", "copy")}}
        r["bookkeeping_s"] = ret - r["plan_s"] - r["slot_s"] - r["copy_s"]  # the hand-off (submit) is part of copy
        return r

    # 1. a fresh Checkpointer: writer start + plan + buffer + templates, all cold
    ck = Checkpointer()
    out["first"] = timed_async(ck)
    out["warm"] = [timed_async(ck) for _ in range(reps)]
    ck.close()
    # 2. a new structure for a Checkpointer whose writer already runs: cold plan, cold templates
    ck = Checkpointer()
    ck.save({"tiny": torch.zeros(4)}, os.path.join(d, "tiny"))
    clear_templates()
    out["cold_plan"] = timed_async(ck)
    out["warm2"] = [timed_async(ck) for _ in range(reps)]
    ck.close()
    # 3. the same, templates already rendered (a structure seen before by this process)
    ck = Checkpointer()
    ck.save({"tiny": torch.zeros(4)}, os.path.join(d, "tiny"))
    out["cold_plan_warm_templates"] = timed_async(ck)
    ck.close()

    warm = out["warm"] + out["warm2"]
    out["warm_median"] = {k: med([w[k] for w in warm]) for k in warm[0]}
    out["warm_planning_s"] = out["warm_median"]["bookkeeping_s"]
    out["cold_planning_s"] = out["cold_plan"]["bookkeeping_s"] + out["cold_plan"]["plan_s"]
    out["warm_cold_planning_ratio"] = out["warm_planning_s"] / out["cold_planning_s"]
    out["e2e_warm_over_first_return"] = out["warm_median"]["return_s"] / out["first"]["return_s"]
    out["e2e_warm_over_cold_plan_return"] = out["warm_median"]["return_s"] / out["cold_plan"]["return_s"]
    shutil.rmtree(d, ignore_errors=True)
    return out


def bench_planning(args) -> dict:
    import multiprocessing as mp

    log(f"planning: {args.plan_tensors} small tensors (fresh process: cold caches)")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    cfg = {"n": args.plan_tensors, "reps": max(args.reps, 3), "dir": os.path.join(args.dir, "planning")}
    p = ctx.Process(target=_planning_entry, args=(cfg, queue))
    p.start()
    try:
        out = queue.get(timeout=args.rank_timeout)
    except Exception as e:
        out = {"error": f"planning process gave no result: {err_str(e)}"}
    p.join(timeout=30)
    if p.is_alive():
        p.kill()
    if "error" not in out:
        log(f"  cold planning {out['cold_planning_s']:.3f} s, warm {out['warm_planning_s']:.4f} s "
            f"(ratio {out['warm_cold_planning_ratio']:.2%}); async_save return first {out['first']['return_s']:.3f} s, "
            f"warm {out['warm_median']['return_s']:.4f} s")
    return out


# ---------------------------------------------------------------------------------------- 5/6. stall, memory, slowdown
class MMLoop:
    """torch.mm 512x512 steps (the 'training' the save must not slow down)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.a = torch.randn(512, 512, generator=g)
        self.b = torch.randn(512, 512, generator=g)
        self.c = torch.empty(512, 512)

    def step(self) -> None:
        torch.mm(self.a, self.b, out=self.c)

    def rate_alone(self, seconds: float) -> float:
        for _ in range(20):
            self.step()
        t0, n = now(), 0
        while now() - t0 < seconds:
            self.step()
            n += 1
        return n / (now() - t0)

    def run_until(self, done: Callable[[], bool]) -> tuple[int, float]:
        t0, n = now(), 0
        while not done():
            self.step()
            n += 1
        return n, now() - t0


def bench_stall(args, sd: dict, limits: dict) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from asyncckpt.core import Checkpointer

    nbytes = state_bytes(sd)
    res: dict[str, Any] = {"bytes": nbytes, "tensors": n_tensors(sd), "peers": {}, "slowdown": {}}
    log(f"stall: {nbytes / GiB:.3f} GiB in {res['tensors']} tensors")
    sdir = os.path.join(args.dir, "stall")
    os.makedirs(sdir, exist_ok=True)

    # floors: one held memcpy of the same bytes (from the limits) and a per-tensor copy into held clones
    res["memcpy_same_bytes_s"] = nbytes / (limits["memcpy_gbps"] * 1e9) if limits.get("memcpy_gbps") else None
    held = {k: torch.zeros_like(t) for k, t in iter_tensors(sd)}
    srcs = flat_tensors(sd)

    def per_tensor_copy():
        t0 = now()
        for k, t in srcs.items():
            held[k].copy_(t)
        return now() - t0

    per_tensor_copy()
    res["per_tensor_held_copy_s"] = med([per_tensor_copy() for _ in range(args.reps)])
    del held
    gc.collect()
    log(f"  held memcpy of {nbytes / GiB:.3f} GiB: {res['memcpy_same_bytes_s']:.3f} s (1 GiB copy), "
        f"per-tensor copy into held tensors {res['per_tensor_held_copy_s']:.3f} s")

    # a 1-rank gloo group: DCP's PROCESS mode needs one (THREAD peers use no_dist=True, the faster DCP path)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)

    def prepare_for(prefix):
        def prepare():
            remove_glob(sdir, prefix + "_")
            sync_quiet()
        return prepare

    def async_peer(name: str, start: Callable[[str], Any], *, staged: Optional[Callable[[Any], None]] = None,
                   finish: Callable[[Any], None], first=True, settle=True, reps=None, sampler=True,
                   paired: Optional[Callable[[], float]] = None, paired_write: Optional[PairedODirect] = None):
        """start(path) -> token (returns after the blocking part); staged(token) waits for the snapshot;
        finish(token) waits for the write; then os.sync() for durable. ``paired``: the stall's floor
        of the moment, taken right before each rep; ``paired_write``: the disk's (before that)."""
        mem: dict[str, Any] = {}

        def fn(tag):
            path = os.path.join(sdir, f"{name}_{tag}")
            raw_s = paired_write() if paired_write is not None else None
            memcpy_s = paired() if paired is not None else None
            s = MemSampler() if sampler else contextlib.nullcontext()
            with s:
                t0 = now()
                token = start(path)
                t1 = now()
                if staged is not None:
                    staged(token)
                t2 = now()
                finish(token)
                t3 = now()
                os.sync()
                t4 = now()
            r = {"stall_s": t1 - t0, "staged_s": t2 - t0, "total_s": t3 - t0, "durable_s": t4 - t0,
                 "durable_gbps": gbps(nbytes, t4 - t0)}
            if memcpy_s is not None:  # this rep's stall against a held memcpy made just before it
                r.update(paired_memcpy_s=memcpy_s, x_paired_memcpy=(t1 - t0) / memcpy_s)
            if raw_s is not None:  # this rep's save-to-durable against a raw write of the same bytes just before it
                r.update(paired_odirect_s=raw_s, durable_x_paired_odirect=(t4 - t0) / raw_s)
            if sampler:
                r["mem"] = s.result()
                mem[tag] = r["mem"]
            return r

        log(f"  {name}")
        out = guarded(res["peers"], name, run_peer, fn, reps=args.reps if reps is None else reps,
                      settle_s=args.settle_s, first=first, settle=settle, prepare=prepare_for(name))
        if "median" in out:
            out["peak_extra_used_gib"] = max(m["extra_used_gib"] for m in mem.values()) if mem else None
            out["peak_extra_tree_rss_gib"] = max(m["extra_tree_rss_gib"] for m in mem.values()) if mem else None
            m = out["median"]
            log(f"    stall {m['stall_s']:.3f} s, staged {m['staged_s']:.3f} s, total {m['total_s']:.3f} s, "
                f"durable {m['durable_s']:.3f} s; first stall {out.get('first', {}).get('stall_s', float('nan')):.3f} s; "
                f"after idle stall {out.get('settle', {}).get('stall_s', float('nan')):.3f} s; "
                f"peak extra used {out['peak_extra_used_gib']:.2f} GiB")
        remove_glob(sdir, name + "_")
        return out

    # ---- ours
    ck = Checkpointer()
    paired_memcpy, paired_write = PairedMemcpy(nbytes), PairedODirect(nbytes, sdir)
    gc.collect()
    async_peer("ours_async_save", lambda p: ck.async_save(sd, p), staged=lambda h: h.wait_staged(),
               finish=lambda h: h.result(), paired=paired_memcpy, paired_write=paired_write,
               reps=max(args.reps, STALL_REPS))
    del paired_memcpy
    paired_write.close()
    async_peer("ours_async_save_overlap", lambda p: ck.async_save(sd, p, overlap_staging=True),
               staged=lambda h: h.wait_staged(), finish=lambda h: h.result(), first=True)
    # compute slowdown while our write is in flight
    loop = MMLoop()
    slow = res["slowdown"]

    def slowdown(name: str, start: Callable[[str], Any], done: Callable[[Any], bool], finish: Callable[[Any], None],
                 reps: int):
        def body():
            alone_before = loop.rate_alone(args.mm_seconds)
            steps = secs = stall = 0.0
            per = []
            for i in range(reps):
                prepare_for("slow_" + name)()
                path = os.path.join(sdir, f"slow_{name}_{i}")
                t0 = now()
                token = start(path)
                t1 = now()
                n, dt = loop.run_until(lambda: done(token))
                finish(token)
                steps += n
                secs += dt
                stall += t1 - t0
                per.append({"stall_s": t1 - t0, "in_flight_s": dt, "steps": n})
            alone_after = loop.rate_alone(args.mm_seconds)
            alone = (alone_before + alone_after) / 2
            rate = steps / secs if secs else None
            lost = (stall + secs - steps / alone) / reps  # seconds of compute lost per save (stall included)
            remove_glob(sdir, "slow_" + name + "_")
            return {"alone_steps_per_s": alone, "alone_before": alone_before, "alone_after": alone_after,
                    "in_flight_steps_per_s": rate, "slowdown_x": alone / rate if rate else None,
                    "in_flight_s_per_save": secs / reps, "stall_s_per_save": stall / reps,
                    "compute_lost_s_per_save": lost, "reps": per}

        log(f"  slowdown while {name} in flight")
        r = guarded(slow, name, body)
        if "slowdown_x" in r:
            log(f"    alone {r['alone_steps_per_s']:.0f} steps/s, in flight {r['in_flight_steps_per_s']:.0f} steps/s "
                f"({r['slowdown_x']:.2f}x) for {r['in_flight_s_per_save']:.2f} s; lost {r['compute_lost_s_per_save']:.2f} s/save")

    slowdown("ours_async_save", lambda p: ck.async_save(sd, p), lambda h: h.done(), lambda h: h.result(), args.reps)
    slowdown("ours_async_save_overlap", lambda p: ck.async_save(sd, p, overlap_staging=True), lambda h: h.done(),
             lambda h: h.result(), args.reps)
    # the floor: the same bytes written durably by another process from memory it holds, nothing else
    raw = RawWriter(nbytes, sdir)
    slowdown("raw_write_floor", lambda p: raw.start(), lambda _: raw.done(), lambda _: raw.wait(), args.reps)
    raw.close()
    with contextlib.suppress(Exception):
        ck.close()
    del ck
    gc.collect()

    # ---- dcp.async_save THREAD, default stager (deep copy in the caller), no_dist
    async_peer("dcp_async_thread_default", lambda p: dcp.async_save(sd, checkpoint_id=p, no_dist=True),
               finish=lambda f: f.result(timeout=args.peer_timeout))
    slowdown("dcp_async_thread_default", lambda p: dcp.async_save(sd, checkpoint_id=p, no_dist=True),
             lambda f: f.done(), lambda f: f.result(timeout=args.peer_timeout), 1)

    # ---- dcp.async_save THREAD with a reused DefaultStager(shared memory, async staging), no_dist
    def stager_peer():
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(False, True, True, False))
        try:
            async_peer("dcp_async_thread_DefaultStager_shm_async",
                       lambda p: dcp.async_save(sd, checkpoint_id=p, async_stager=stager, no_dist=True),
                       staged=lambda r: r.staging_completion.result(timeout=args.peer_timeout),
                       finish=lambda r: r.upload_completion.result(timeout=args.peer_timeout), settle=False)
        finally:
            stager.close()

    guarded_into(res["peers"], "dcp_async_thread_DefaultStager_shm_async", stager_peer)
    gc.collect()

    # ---- Lightning AsyncCheckpointIO(TorchCheckpointIO()): clone in the caller, torch.save in a thread, no fsync
    def lightning_peer():
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        io_ = AsyncCheckpointIO(TorchCheckpointIO())
        async_peer("lightning_AsyncCheckpointIO", lambda p: io_.save_checkpoint(sd, p), finish=lambda _t: io_.teardown())

        class Flag(TorchCheckpointIO):
            def save_checkpoint(self, checkpoint, path, storage_options=None):
                super().save_checkpoint(checkpoint, path, storage_options)
                self.done_event.set()

        inner = Flag()
        io2 = AsyncCheckpointIO(inner)

        def start(p):
            inner.done_event = threading.Event()
            io2.save_checkpoint(sd, p)
            return inner.done_event

        slowdown("lightning_AsyncCheckpointIO", start, lambda e: e.is_set(), lambda _e: io2.teardown(), 1)

    guarded_into(res["peers"], "lightning_AsyncCheckpointIO", lightning_peer)
    gc.collect()

    # ---- dcp.async_save PROCESS (default stager), needs the process group; slow: fewer reps, no idle rep
    if not args.skip_process:
        async_peer("dcp_async_process_default",
                   lambda p: dcp.async_save(sd, checkpoint_id=p, async_checkpointer_type=AsyncCheckpointerType.PROCESS),
                   finish=lambda f: f.result(timeout=args.peer_timeout), settle=False, reps=min(args.reps, 2))
    gc.collect()
    remove(sdir)
    return res


# ---------------------------------------------------------------------------------------- report
def fmt(x, spec=".2f", none="–"):
    if x is None:
        return none
    try:
        return format(x, spec)
    except (TypeError, ValueError):
        return str(x)


def ratio(a, b):
    return a / b if a and b else None


def render_md(R: dict, command: str) -> str:
    L = R.get("limits", {})
    lim = R.get("limit_values", {})
    md: list[str] = []
    w = md.append
    w("# asyncckpt core benchmarks")
    w("")
    meta = R["meta"]
    if meta.get("core_snapshot_commit"):
        src = f"asyncckpt.core as committed at `{meta['core_snapshot_commit'][:10]}` (`git archive` snapshot)"
    else:
        src = f"asyncckpt.core from the working tree at `{meta['git_commit'][:10]}`" + (
            f" (uncommitted changes: {meta['core_dirty']})" if meta.get("core_dirty") else "")
    w(f"Generated by `benchmarks/core_bench.py` on {meta['date']} ({meta['machine']}); Python {meta['python']}, "
      f"torch {meta['torch']}, lightning {meta.get('lightning', '?')}, safetensors {meta.get('safetensors', '?')}; "
      f"{src}; whole run {meta.get('wall_s', 0) / 60:.1f} min.")
    w("")
    w("Command:")
    w("")
    w("```")
    w(command)
    w("```")
    w("")
    if meta.get("command_as_run") and meta["command_as_run"] != command:
        w(f"(This run was started as `{meta['command_as_run']}` and its two output files copied to docs/.)")
        w("")
    w("## How to read this")
    w("")
    w("Every figure comes from one run on this machine, and each is compared to this machine's limits measured in the same run "
      "(section 1): a **save** is compared with a durable sequential O_DIRECT write + fsync of the same bytes "
      "(`x O_DIRECT` = our GB/s / O_DIRECT GB/s: 1.00 means the save ran at the disk's speed); a **load** with a sequential "
      "read from the page cache into held memory (`x cached read`); an **async stall** with a memcpy of the same bytes "
      "into a held buffer. The `vs ours` columns give the peer's time divided by ours (2.0 = ours is twice as fast). "
      "Times are medians of back-to-back reps (min–max in brackets); `first` is the first call of a fresh process/object "
      "(worker start, planning, buffer allocation); `after idle` is one rep after "
      f"{R['meta']['settle_s']:.0f} s of idle time. This VM hands freed memory back to its host and touching it again "
      "costs ~3 s/GiB, so `after idle` is what a checkpoint every few minutes sees, and back-to-back reps are the "
      "optimistic case. GB/s = 1e9 bytes/s of tensor data (the same logical bytes for every peer). `durable` = "
      "after a following `os.sync()` (matters for peers that do not fsync). The disk is a shared virtio device; its speed "
      "changes from run to run, so compare figures within this run only.")
    w("")
    # summary of goals
    G = R.get("goals")
    if G:
        w("## Goals (summary; details in the sections below)")
        w("")
        w("Where a rep is paired with the machine's limit of that moment, the pair decides: a 1-rank save against a raw "
          "O_DIRECT write of the same bytes made right before it, an async stall against a held memcpy of the same bytes "
          "made right before it (median of the per-rep ratios). This machine's copy and disk speeds move by up to 2x "
          "within one run (section 1: start vs end), so a rate measured minutes away judges the rep against another "
          "machine. The ratio to section 1's best rate is shown beside it.")
        w("")
        w("| goal | measured | met |")
        w("|---|---|---|")
        for g in G:
            w(f"| {g['goal']} | {g['measured']} | {g['met']} |")
        w("")
    # limits
    w("## 1. Machine limits")
    w("")
    w("| what | median GB/s (min–max) | after idle GB/s | end-of-run median GB/s |")
    w("|---|---|---|---|")
    size_txt = f"{L.get('bytes', 0) / GiB:.3g} GiB"
    names = [("memcpy_held", f"memcpy {size_txt} into a held buffer (`dst.copy_(src)`, {R['meta']['torch_threads']} threads)"),
             ("odirect_write_1t", f"O_DIRECT write {size_txt} + fsync, 1 thread, 32 MiB requests"),
             ("odirect_write_2t", f"O_DIRECT write {size_txt} + fsync, 2 threads, 32 MiB requests"),
             ("buffered_write_fsync", f"buffered write {size_txt} + fsync"),
             ("cold_read", "sequential read after drop_caches (into a held buffer)"),
             ("cached_read", "sequential read from page cache (into a held buffer)")]
    LE = R.get("limits_end", {}) or {}
    for key, label in names:
        v = L.get(key)
        if not isinstance(v, dict):
            continue
        if "error" in v:
            w(f"| {label} | error: {v['error']} | | |")
            continue
        e = LE.get(key) if isinstance(LE.get(key), dict) else {}
        w(f"| {label} | {fmt(v['median'].get('gbps'))} ({fmt(v['min'].get('gbps'))}–{fmt(v['max'].get('gbps'))}) | "
          f"{fmt((v.get('settle') or {}).get('gbps'))} | {fmt((e.get('median') or {}).get('gbps'))} |")
    w("")
    w(f"Limits used for the ratios below (better of start/end medians): memcpy {fmt(lim.get('memcpy_gbps'))} GB/s, "
      f"O_DIRECT durable write {fmt(lim.get('odirect_write_gbps'))} GB/s, cached read {fmt(lim.get('cached_read_gbps'))} GB/s, "
      f"cold read {fmt(lim.get('cold_read_gbps'))} GB/s.")
    w("")

    # workloads
    for wname, title in [("large", "(a) 1 GiB in 16 large tensors"), ("adam", "(b) 1 GiB state dict, ~8,000 tensors (params + Adam state)")]:
        W = R.get("workloads", {}).get(wname)
        if not isinstance(W, dict):
            continue
        w(f"## 2{'a' if wname == 'large' else 'b'}. Workload {title}")
        w("")
        if "error" in W:
            w(f"error: {W['error']}")
            w("")
            continue
        w(f"{W['bytes'] / GiB:.3f} GiB of fp32 in {W['tensors']} tensors, 1 process (torch {R['meta']['torch_threads']} threads).")
        w("")
        w("**Save** (returns when durable for every row but where noted)")
        w("")
        w("| saver | first s | median s (min–max) | GB/s | x O_DIRECT | durable s | after idle s | after idle GB/s | x O_DIRECT | vs ours (median) | vs ours (after idle) |")
        w("|---|---|---|---|---|---|---|---|---|---|---|")
        S = W["save"]
        ours = S.get("ours_core_save", {})
        ours_m = (ours.get("median") or {}).get("s")
        ours_i = (ours.get("settle") or {}).get("s")
        labels = {"torch_save": "`torch.save` + fsync", "safetensors": "`safetensors.torch.save_file` + fsync",
                  "dcp_save": "`dcp.save` (no_dist=True, FileSystemWriter)", "ours_core_save": "**ours `core.save`**",
                  "ours_writer_dcp_save": "ours `AsyncCkptStorageWriter` via `dcp.save` (no_dist)"}
        for k, label in labels.items():
            v = S.get(k)
            if not isinstance(v, dict):
                continue
            if "error" in v:
                w(f"| {label} | error: {v['error']} | | | | | | | | | |")
                continue
            m, st = v["median"], v.get("settle") or {}
            w(f"| {label} | {fmt((v.get('first') or {}).get('s'), '.3f')} | {fmt(m['s'], '.3f')} ({fmt(v['min']['s'], '.3f')}–{fmt(v['max']['s'], '.3f')}) | "
              f"{fmt(m['gbps'])} | {fmt(ratio(m['gbps'], lim.get('odirect_write_gbps')))} | {fmt(m['durable_s'], '.3f')} | "
              f"{fmt(st.get('s'), '.3f')} | {fmt(st.get('gbps'))} | {fmt(ratio(st.get('gbps'), lim.get('odirect_write_gbps')))} | "
              f"{fmt(ratio(m['s'], ours_m))} | {fmt(ratio(st.get('s'), ours_i))} |")
        w("")
        paired = [r.get("x_paired_odirect") for r in ours.get("reps", []) if r.get("x_paired_odirect")]
        if paired:
            w(f"Paired with the disk of the moment: right before each back-to-back rep of ours, a raw O_DIRECT write + "
              f"fsync of the same bytes from held memory (section 1's method) took {fmt((ours.get('median') or {}).get('paired_odirect_s'), '.3f')} s "
              f"(median); ours / that write = **{fmt(statistics.median(paired))}x** (per rep {', '.join(fmt(x) for x in paired)}).")
            w("")
        w("**Load** into a preallocated state dict (page cache warm; `cold` = one rep after drop_caches). "
          "torch.load and safetensors rows include copying into the preallocated tensors (what `load_state_dict` does).")
        w("")
        w("| loader | median s (min–max) | GB/s | x cached read | cold s | cold GB/s | x cold read | vs ours (verify on) | verified |")
        w("|---|---|---|---|---|---|---|---|---|")
        Ld = W["load"]
        ours_l = (Ld.get("ours_core_load_verify", {}).get("median") or {}).get("s")
        labels = {"torch_load": "`torch.load(weights_only=True)` + copy", "safetensors_load_file": "`safetensors load_file` + copy",
                  "dcp_load": "`dcp.load` (no_dist) of the dcp.save checkpoint", "ours_core_load_verify": "**ours `core.load`, verify on**",
                  "ours_core_load_noverify": "ours `core.load`, verify off",
                  "dcp_load_FileSystemReader_of_ours": "stock `dcp.load` (FileSystemReader) of our checkpoint"}
        for k, label in labels.items():
            v = Ld.get(k)
            if not isinstance(v, dict):
                continue
            if "error" in v:
                w(f"| {label} | error: {v['error']} | | | | | | | |")
                continue
            m, c = v["median"], v.get("cold") or {}
            w(f"| {label} | {fmt(m['s'], '.3f')} ({fmt(v['min']['s'], '.3f')}–{fmt(v['max']['s'], '.3f')}) | {fmt(m['gbps'])} | "
              f"{fmt(ratio(m['gbps'], lim.get('cached_read_gbps')))} | {fmt(c.get('s'), '.3f')} | {fmt(c.get('gbps'))} | "
              f"{fmt(ratio(c.get('gbps'), lim.get('cold_read_gbps')))} | {fmt(ratio(m['s'], ours_l))} | {v.get('verified')} |")
        w("")

    # two ranks
    T = R.get("ranks2")
    if isinstance(T, dict):
        w("## 3. Two ranks (gloo, CPU, spawned processes, 1 intra-op thread each), replicated state, `core.save`")
        w("")
        if "error" in T:
            w(f"error: {T['error']}")
        else:
            w("Both ranks hold the same full state; the planner deduplicates replicated tensors so each rank writes about half. "
              "Time = the slower rank, from a barrier to `core.save` returning (committed). The 1-rank column is the same workload "
              "from section 2 (one process, 2 threads). `x paired`: right before each rep, both ranks write their share "
              "of the bytes raw (O_DIRECT + fsync from held memory, at once, 32 MiB requests), and that write's time "
              "(the slower rank's) is divided by the rep's (median over reps): the disk of that moment.")
            w("")
            w("| workload | 1 rank median s | 2 ranks first s | 2 ranks median s (reps) | GB/s | x O_DIRECT | x paired raw write (reps) | after idle s | after idle GB/s | bytes written rank 0 / rank 1 | 2-rank load median s | load verified |")
            w("|---|---|---|---|---|---|---|---|---|---|---|---|")
            for wname in ("large", "adam"):
                v = T.get(wname)
                if not isinstance(v, dict):
                    continue
                if "error" in v:
                    w(f"| {wname} | error: {v['error']} | | | | | | | | | | |")
                    continue
                one = ((R.get("workloads", {}).get(wname, {}).get("save", {}).get("ours_core_save", {}) or {}).get("median") or {}).get("s")
                b = v["bytes_per_rank"]
                w(f"| {wname} | {fmt(one, '.3f')} | {fmt(v['save_first_s'], '.3f')} | {fmt(v['save_median_s'], '.3f')} "
                  f"({', '.join(fmt(x, '.2f') for x in v['save_reps_s'])}) | {fmt(v['save_gbps'])} | "
                  f"{fmt(ratio(v['save_gbps'], lim.get('odirect_write_gbps')))} | {fmt(v.get('save_x_paired_odirect'))} "
                  f"({', '.join(fmt(x, '.2f') for x in v.get('x_paired_odirect_reps', []))}) | {fmt(v['save_settle_s'], '.3f')} | "
                  f"{fmt(v['save_settle_gbps'])} | {b['rank0'] / 1e6:.1f} MB / {b['rank1'] / 1e6:.1f} MB | "
                  f"{fmt(v['load_median_s'], '.3f')} | {v['load_verified']} |")
        w("")

    # planning
    P = R.get("planning")
    if isinstance(P, dict):
        w(f"## 4. Planning: cold vs warm ({P.get('tensors', '?')} small tensors)")
        w("")
        if "error" in P:
            w(f"error: {P['error']}")
        else:
            w(f"{P['tensors']} fp32 tensors of 1–16 KiB ({P['unique_shapes']} distinct shapes, {P['bytes'] / 1e6:.0f} MB), "
              "in a fresh process. Each `Checkpointer.async_save` is split by timers around `_plan` (DCP local/global plan, "
              "dedup, layout, container templates), `_free_slot` (staging buffer), `_submit` (hand-off; starts the writer "
              "the first time) and the snapshot copy; `bookkeeping` = the rest of the call, what every save repeats (flatten, "
              "structure description and digest, agreement, plan-cache lookup, source lookup). Warm planning = bookkeeping "
              "of a later save; cold planning = bookkeeping + `_plan` of the first save of the structure (writer already running).")
            w("")
            w("| save | returned after s | _plan s | bookkeeping s | buffer s | hand-off s | copy s | total (committed) s |")
            w("|---|---|---|---|---|---|---|---|")
            for label, r_ in (("first save, fresh Checkpointer", P["first"]),
                              ("first save of the structure, writer running, templates cold", P["cold_plan"]),
                              ("same, templates already rendered", P.get("cold_plan_warm_templates")),
                              ("later saves (median)", P["warm_median"])):
                if not r_:
                    continue
                w(f"| {label} | {fmt(r_['return_s'], '.4f')} | {fmt(r_['plan_s'], '.4f')} | {fmt(r_['bookkeeping_s'], '.4f')} | "
                  f"{fmt(r_['slot_s'], '.4f')} | {fmt(r_['submit_s'], '.4f')} | {fmt(r_['copy_s'], '.4f')} | {fmt(r_['total_s'], '.3f')} |")
            w("")
            w(f"**Warm planning {fmt(P['warm_planning_s'], '.4f')} s / cold planning {fmt(P['cold_planning_s'], '.4f')} s = "
              f"{fmt(100 * P['warm_cold_planning_ratio'], '.1f')} %** (goal <= 5 %). Whole `async_save` call, later / first: "
              f"{fmt(100 * P['e2e_warm_over_first_return'], '.1f')} % (fresh Checkpointer), "
              f"{fmt(100 * P['e2e_warm_over_cold_plan_return'], '.1f')} % (new structure, writer running).")
        w("")

    # stall
    ST = R.get("stall")
    if isinstance(ST, dict):
        w("## 5. Async save: stall, total, memory (workload b)")
        w("")
        if "error" in ST:
            w(f"error: {ST['error']}")
        else:
            mc = ST.get("memcpy_same_bytes_s")
            w(f"{ST['bytes'] / GiB:.3f} GiB in {ST['tensors']} tensors. Floor: a held memcpy of the same bytes = "
              f"{fmt(mc, '.3f')} s (section 1's held memcpy rate); copying tensor by tensor into held tensors = "
              f"{fmt(ST.get('per_tensor_held_copy_s'), '.3f')} s. `stall` = time the call blocked; `staged` = until the "
              "snapshot was complete (the caller may mutate the state after it); `total` = until the write finished "
              "(`result()` / `teardown()`); `durable` = after a following `os.sync()`. Memory = peak over all reps of "
              "(sampled - value just before the call): system used (total - available) and the process tree's RSS "
              "(our writer maps the shared staging buffer too, so tree RSS counts it twice). THREAD peers use `no_dist=True`; "
              "PROCESS needs a (1-rank gloo) process group.")
            w("")
            rows = []
            for wname in ("large", "adam"):
                v = ((R.get("workloads", {}).get(wname) or {}).get("save") or {}).get("ours_core_async_save")
                if isinstance(v, dict) and "median" in v:
                    wb = R["workloads"][wname]["bytes"]
                    mcw = wb / (lim["memcpy_gbps"] * 1e9) if lim.get("memcpy_gbps") else None
                    rows.append(f"| {wname} ({R['workloads'][wname]['tensors']} tensors) | {fmt(v['median']['stall_s'], '.3f')} "
                                f"({fmt(v['min']['stall_s'], '.3f')}–{fmt(v['max']['stall_s'], '.3f')}) | {fmt(mcw, '.3f')} | "
                                f"{fmt(ratio(v['median']['stall_s'], mcw))} | {_paired_cell(v)} | "
                                f"{fmt((v.get('settle') or {}).get('stall_s'), '.3f')} | "
                                f"{fmt(v['median']['s'], '.3f')} |")
            if rows:
                w("Ours by workload (`core.async_save` on the warm default Checkpointer, section 2's states):")
                w("")
                w("| workload | stall s (min–max) | held memcpy s | x memcpy | x paired memcpy (per rep) | after idle stall s | total s |")
                w("|---|---|---|---|---|---|---|")
                for r_ in rows:
                    w(r_)
                w("")
                w("All async paths, workload b:")
                w("")
            w("| path | first stall s | stall s (min–max) | x memcpy | staged s | total s | durable s | durable GB/s | x O_DIRECT | after idle stall s | after idle durable s | peak extra used GiB | peak extra tree RSS GiB | stall vs ours | durable vs ours |")
            w("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
            pe = ST["peers"]
            o = (pe.get("ours_async_save") or {}).get("median") or {}
            labels = {"ours_async_save": "**ours `Checkpointer.async_save`**",
                      "ours_async_save_overlap": "ours, `overlap_staging=True`",
                      "dcp_async_thread_default": "`dcp.async_save` THREAD, default stager",
                      "dcp_async_thread_DefaultStager_shm_async": "`dcp.async_save` THREAD, reused `DefaultStager(StagingOptions(False, True, True, False))`",
                      "dcp_async_process_default": "`dcp.async_save` PROCESS, default stager",
                      "lightning_AsyncCheckpointIO": "Lightning `AsyncCheckpointIO(TorchCheckpointIO())` (no fsync)",
                      "raw_write_floor": "floor: a raw O_DIRECT write + fsync of the same bytes by another process "
                                         "(no snapshot, no checksums; `benchmarks/raw_writer.py`)"}
            for k, label in labels.items():
                v = pe.get(k)
                if not isinstance(v, dict):
                    continue
                if "error" in v:
                    w(f"| {label} | error: {v['error']} |" + " |" * 13)
                    continue
                m, st, f = v["median"], v.get("settle") or {}, v.get("first") or {}
                w(f"| {label} | {fmt(f.get('stall_s'), '.3f')} | {fmt(m['stall_s'], '.3f')} ({fmt(v['min']['stall_s'], '.3f')}–{fmt(v['max']['stall_s'], '.3f')}) | "
                  f"{fmt(ratio(m['stall_s'], mc))} | {fmt(m['staged_s'], '.3f')} | {fmt(m['total_s'], '.3f')} | {fmt(m['durable_s'], '.3f')} | "
                  f"{fmt(m['durable_gbps'])} | {fmt(ratio(m['durable_gbps'], lim.get('odirect_write_gbps')))} | "
                  f"{fmt(st.get('stall_s'), '.3f')} | {fmt(st.get('durable_s'), '.3f')} | {fmt(v.get('peak_extra_used_gib'))} | "
                  f"{fmt(v.get('peak_extra_tree_rss_gib'))} | {fmt(ratio(m['stall_s'], o.get('stall_s')))} | "
                  f"{fmt(ratio(m['durable_s'], o.get('durable_s')))} |")
            w("")
            if (pe.get("ours_async_save") or {}).get("reps"):
                w(f"`x memcpy` uses section 1's best held memcpy rate. `x paired memcpy`: each rep's stall against a held "
                  f"memcpy of the same bytes made right before it (this machine's copy speed swings within a run); ours, "
                  f"workload b: {_paired_cell(pe['ours_async_save'])}. Its `durable` against a raw O_DIRECT write + "
                  f"fsync of the same bytes from held memory made right before each rep (before that memcpy): "
                  f"{_paired_cell(pe['ours_async_save'], 'durable_x_paired_odirect')}.")
                w("")
            SL = ST.get("slowdown", {})
            if SL:
                w("## 6. Compute slowdown while a save is in flight")
                w("")
                w("A `torch.mm` 512x512 loop (2 intra-op threads) runs in the caller from the moment the save call returns "
                  "until the save is done. `lost` = seconds of loop progress lost per save, stall included "
                  "(stall + in-flight time - steps / alone rate).")
                w("")
                w("| path | alone steps/s | in-flight steps/s | slowdown | in flight s/save | stall s/save | compute lost s/save | lost vs ours |")
                w("|---|---|---|---|---|---|---|---|")
                ol = (SL.get("ours_async_save") or {}).get("compute_lost_s_per_save")
                for k, label in labels.items():
                    v = SL.get(k)
                    if not isinstance(v, dict):
                        continue
                    if "error" in v:
                        w(f"| {label} | error: {v['error']} | | | | | | |")
                        continue
                    w(f"| {label} | {fmt(v['alone_steps_per_s'], '.0f')} | {fmt(v['in_flight_steps_per_s'], '.0f')} | "
                      f"{fmt(v['slowdown_x'])}x | {fmt(v['in_flight_s_per_save'], '.2f')} | {fmt(v['stall_s_per_save'], '.3f')} | "
                      f"{fmt(v['compute_lost_s_per_save'], '.2f')} | {fmt(ratio(v['compute_lost_s_per_save'], ol))} |")
                w("")
    w("## Framework adapters and the training loop")
    w("")
    w("Measured by their own scripts, each against the framework's own saving in the same run: "
      "[Lightning](benchmarks_lightning.md) (`benchmarks/lightning_bench.py`), "
      "[Accelerate](benchmarks_accelerate.md) (`benchmarks/accelerate_bench.py`), "
      "[Transformers Trainer](benchmarks_hf_trainer.md) (`benchmarks/hf_trainer_bench.py`), and the training-loop "
      "slowdown of the core against torch.save, dcp.async_save and Lightning's AsyncCheckpointIO "
      "([training loop](benchmarks_training.md), `benchmarks/train_bench.py`).")
    w("")
    I = R.get("interference") or {}
    if I:
        w("## Other load on the machine during each section")
        w("")
        w("CPU time of the whole machine not used by this benchmark's processes (other jobs share this 2-core VM; "
          "kernel threads doing our I/O count here too, so a few tenths of a core is normal). Well above that, other "
          "jobs were running and the section's timings are pessimistic, above all the multi-threaded copies and the mm loop.")
        w("")
        w("| section | wall s | rest of the machine, mean cores | max cores | ours, mean cores |")
        w("|---|---|---|---|---|")
        for k, v in I.items():
            w(f"| {k} | {fmt(v.get('wall_s'), '.0f')} | {fmt(v.get('foreign_cpu_cores_mean'))} | "
              f"{fmt(v.get('foreign_cpu_cores_max'))} | {fmt(v.get('our_cpu_cores_mean'))} |")
        w("")
    errors = R.get("errors_summary") or []
    if errors:
        w("## Errors recorded")
        w("")
        for e in errors:
            w(f"- `{e[0]}`: {e[1]}")
        w("")
    return "\n".join(md) + "\n"


def collect_errors(obj, path="") -> list:
    found = []
    if isinstance(obj, dict):
        if "error" in obj and isinstance(obj["error"], str):
            found.append((path, obj["error"]))
        for k, v in obj.items():
            if k in ("traceback", "raw", "partial"):
                continue
            found.extend(collect_errors(v, f"{path}.{k}" if path else str(k)))
    return found


def _paired_cell(result: dict, key: str = "x_paired_memcpy") -> str:
    """The median over a peer's reps of a ratio to the paired floor (``key``), and each rep's."""
    ratios = [r[key] for r in result.get("reps", []) if r.get(key)]
    if not ratios:
        return "–"
    return f"{fmt(statistics.median(ratios))}x ({', '.join(fmt(x) for x in ratios)})"


def goals(R: dict) -> list:
    lim = R.get("limit_values", {})
    out = []

    def add(goal, value, ok):
        out.append({"goal": goal, "measured": value, "met": "yes" if ok else ("no" if ok is not None else "n/a")})

    for wname in ("large", "adam"):
        W = R.get("workloads", {}).get(wname, {})
        s = ((W.get("save") or {}).get("ours_core_save") or {})
        g = (s.get("median") or {}).get("gbps")
        r = ratio(g, lim.get("odirect_write_gbps"))
        gi = (s.get("settle") or {}).get("gbps")
        ri = ratio(gi, lim.get("odirect_write_gbps"))
        wl = "(a) large tensors" if wname == "large" else "(b) ~8k tensors"
        paired = (s.get("median") or {}).get("x_paired_odirect")
        decider = paired if paired is not None else r
        add(f"{wl}: save >= 80% of O_DIRECT durable write (1 rank)",
            f"{fmt(paired)}x a raw O_DIRECT write of the same bytes made right before each rep (median); "
            f"{fmt(g)} GB/s = {fmt(r)}x section 1's best O_DIRECT rate back-to-back, {fmt(gi)} GB/s = {fmt(ri)}x after idle",
            None if decider is None else decider >= 0.8)
        T = (R.get("ranks2") or {}).get(wname) or {}
        r2 = ratio(T.get("save_gbps"), lim.get("odirect_write_gbps"))
        paired2 = T.get("save_x_paired_odirect")
        decider2 = paired2 if paired2 is not None else r2
        add(f"{wl}: save >= 80% of O_DIRECT durable write (2 ranks)",
            f"{fmt(paired2)}x the two ranks' shares written raw (O_DIRECT, at once) right before each rep (median); "
            f"{fmt(T.get('save_gbps'))} GB/s = {fmt(r2)}x section 1's best O_DIRECT rate",
            None if decider2 is None else decider2 >= 0.8)
        ld = (W.get("load") or {})
        ol = ((ld.get("ours_core_load_verify") or {}).get("median") or {})
        dl = ((ld.get("dcp_load") or {}).get("median") or {})
        rl = ratio(ol.get("gbps"), lim.get("cached_read_gbps"))
        add(f"{wl}: load >= 80% of cached read, and faster than dcp.load",
            f"{fmt(ol.get('gbps'))} GB/s = {fmt(rl)}x cached read; dcp.load / ours = {fmt(ratio(dl.get('s'), ol.get('s')))}",
            None if rl is None else (rl >= 0.8 and (dl.get("s") or 0) > (ol.get("s") or 1e9)))
    P = R.get("planning") or {}
    if "warm_cold_planning_ratio" in P:
        add("warm planning <= 5% of cold", f"{100 * P['warm_cold_planning_ratio']:.1f} %", P["warm_cold_planning_ratio"] <= 0.05)
    ST = R.get("stall") or {}
    peers = ST.get("peers") or {}
    o = (peers.get("ours_async_save") or {}).get("median") or {}
    if o.get("stall_s") and ST.get("memcpy_same_bytes_s"):
        x = o["stall_s"] / ST["memcpy_same_bytes_s"]
        paired = o.get("x_paired_memcpy")
        add("(b) async stall <= 1.2x held memcpy of the same bytes",
            f"{fmt(paired)}x a held memcpy made right before each rep (median); {o['stall_s']:.3f} s = {x:.2f}x "
            "section 1's best memcpy rate", (paired if paired is not None else x) <= 1.2)
    for wname in ("large",):
        v = (((R.get("workloads", {}).get(wname) or {}).get("save") or {}).get("ours_core_async_save") or {})
        if "median" in v and lim.get("memcpy_gbps"):
            x = v["median"]["stall_s"] / (R["workloads"][wname]["bytes"] / (lim["memcpy_gbps"] * 1e9))
            paired = v["median"].get("x_paired_memcpy")
            add("(a) async stall <= 1.2x held memcpy of the same bytes",
                f"{fmt(paired)}x a held memcpy made right before each rep (median); {v['median']['stall_s']:.3f} s = "
                f"{x:.2f}x section 1's best memcpy rate", (paired if paired is not None else x) <= 1.2)
    ov = (peers.get("ours_async_save_overlap") or {}).get("median") or {}
    if "stall_s" in ov and ST.get("memcpy_same_bytes_s"):
        x = ov["stall_s"] / ST["memcpy_same_bytes_s"]
        add("(b) overlapped stall <= 0.1x held memcpy", f"{ov['stall_s']:.4f} s = {x:.3f}x", x <= 0.1)
    if o.get("durable_s") and lim.get("odirect_write_gbps"):
        disk_s = ST["bytes"] / (lim["odirect_write_gbps"] * 1e9)
        x = o["durable_s"] / disk_s
        paired = o.get("durable_x_paired_odirect")
        add("(b) async save to durable <= 1.25x the disk's durable write time for the same bytes",
            f"{fmt(paired)}x a raw O_DIRECT write of the same bytes made right before each rep (median); "
            f"{o['durable_s']:.3f} s = {x:.2f}x section 1's best O_DIRECT rate ({disk_s:.3f} s)",
            (paired if paired is not None else x) <= 1.25)
    SL = ST.get("slowdown") or {}
    mine, floor = SL.get("ours_async_save") or {}, SL.get("raw_write_floor") or {}
    if mine.get("slowdown_x"):
        def lost_in_flight(r: dict):
            return r["compute_lost_s_per_save"] - r["stall_s_per_save"] if r.get("compute_lost_s_per_save") is not None else None

        add("(b) compute slowdown while a save is in flight <= 1.2x",
            f"{mine['slowdown_x']:.2f}x for {mine['in_flight_s_per_save']:.2f} s (compute lost while in flight: "
            f"{fmt(lost_in_flight(mine), '.3f')} s/save); the floor, a raw O_DIRECT write of the same bytes by another "
            f"process: {fmt(floor.get('slowdown_x'))}x for {fmt(floor.get('in_flight_s_per_save'))} s "
            f"({fmt(lost_in_flight(floor), '.3f')} s/save)", mine["slowdown_x"] <= 1.2)
    peak = (peers.get("ours_async_save") or {}).get("peak_extra_used_gib")
    if peak is not None:
        x = peak / (ST["bytes"] / GiB)
        add("(b) peak extra memory <= 1.1x the state per save in flight",
            f"{peak:.2f} GiB = {x:.2f}x, at the first save (staging buffer allocated, writer started); later saves reuse "
            "the buffer", x <= 1.1)
    return out


def git_meta() -> dict:
    def run(*cmd):
        try:
            return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:
            return ""
    return {"git_commit": run("git", "rev-parse", "HEAD"),
            "core_dirty": run("git", "status", "--short", "--", "core").replace("\n", "; ")}


# ---------------------------------------------------------------------------------------- main
def run_on_snapshot(rev: str, argv: list) -> int:
    """Re-run this script with asyncckpt.core taken from ``git archive rev`` (a consistent snapshot)."""
    import tempfile

    sha = subprocess.run(["git", "rev-parse", rev], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    tmp = tempfile.mkdtemp(prefix="asyncckpt-bench-")
    try:
        pkg = os.path.join(tmp, "asyncckpt")
        os.makedirs(pkg)
        open(os.path.join(pkg, "__init__.py"), "w").close()
        archive = subprocess.run(["git", "archive", sha, "core"], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", pkg], input=archive, check=True)
        env = dict(os.environ, ASYNCCKPT_BENCH_SNAPSHOT=sha,
                   PYTHONPATH=os.pathsep.join([tmp] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        log(f"benchmarking asyncckpt.core at {sha[:10]} (snapshot in {tmp})")
        return subprocess.call([sys.executable, os.path.abspath(__file__)] + list(argv), env=env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON results file")
    ap.add_argument("--md", default=None, help="markdown report")
    ap.add_argument("--dir", default="/work/bench-tmp", help="scratch directory on the disk under test (emptied afterwards)")
    ap.add_argument("--settle-s", type=float, default=None, help="idle seconds before the after-idle rep (default 20; 2 with --quick)")
    ap.add_argument("--reps", type=int, default=None, help="back-to-back reps per figure (default 3; 2 with --quick)")
    ap.add_argument("--size-mib", type=int, default=None, help="state size (default 1024; 128 with --quick)")
    ap.add_argument("--n-small", type=int, default=None, help="small params in workload b (default 2000; 250 with --quick)")
    ap.add_argument("--plan-tensors", type=int, default=None, help="tensors for the planning test (default 10000; 2000 with --quick)")
    ap.add_argument("--mm-seconds", type=float, default=None, help="seconds of the alone mm loop (default 3; 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="small smoke version (128 MiB), < 2 minutes")
    ap.add_argument("--sections", default="limits,workloads,ranks2,planning,stall",
                    help="comma list of: limits,workloads,ranks2,planning,stall")
    ap.add_argument("--skip-process", action="store_true", help="skip dcp.async_save PROCESS mode (slow; skipped with --quick)")
    ap.add_argument("--peer-timeout", type=float, default=300.0)
    ap.add_argument("--rank-timeout", type=float, default=900.0)
    ap.add_argument("--core-rev", default=None,
                    help="benchmark asyncckpt.core as committed at this git revision (e.g. HEAD: a `git archive` "
                         "snapshot put first on PYTHONPATH) instead of the working tree, which others may be editing")
    ap.add_argument("--wait-quiet", type=float, default=0.0,
                    help="before starting, wait up to this many seconds until the machine is idle (other jobs distort timings)")
    ap.add_argument("--from-json", default=None, help="only re-render --md from an existing results JSON")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            R = json.load(f)
        R["goals"] = goals(R)
        with open(args.md, "w") as f:
            f.write(render_md(R, R["meta"]["command"]))
        return 0
    if args.core_rev and not os.environ.get("ASYNCCKPT_BENCH_SNAPSHOT"):
        return run_on_snapshot(args.core_rev, sys.argv[1:] if argv is None else argv)
    q = args.quick
    args.settle_s = args.settle_s if args.settle_s is not None else (1.0 if q else 20.0)
    if q:
        args.skip_process = True
    args.size_mib = args.size_mib or (128 if q else 1024)
    args.reps = args.reps or (2 if q else 3)
    args.n_small = args.n_small or (250 if q else 2000)
    args.plan_tensors = args.plan_tensors or (2000 if q else 10000)
    args.mm_seconds = args.mm_seconds or (1.0 if q else 3.0)
    sections = set(args.sections.split(","))
    nbytes = args.size_mib * MiB
    os.makedirs(args.dir, exist_ok=True)
    t_start = now()
    command = " ".join([".venv/bin/python", "benchmarks/core_bench.py"] + (argv if argv is not None else sys.argv[1:]))
    R: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": command,
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
                       f"{psutil.virtual_memory().total / GiB:.1f} GiB RAM, kernel {platform.release()}",
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "quick": q, "settle_s": args.settle_s, "reps": args.reps,
            "size_mib": args.size_mib, "dir": args.dir, "loadavg_start": os.getloadavg(),
            **git_meta(),
        },
    }
    import asyncckpt.core as _core_mod
    R["meta"]["core_source"] = os.path.dirname(_core_mod.__file__)
    R["meta"]["core_snapshot_commit"] = os.environ.get("ASYNCCKPT_BENCH_SNAPSHOT")
    if args.wait_quiet > 0:
        log(f"waiting up to {args.wait_quiet:.0f} s for the machine to be idle")
        R["meta"]["wait_quiet"] = wait_quiet(args.wait_quiet)
        log(f"  {R['meta']['wait_quiet']}")
    cpu = CpuMonitor().start()
    R["interference"] = {}

    def section(name, fn, *a):
        t0 = now()
        try:
            return fn(*a)
        finally:
            R["interference"][name] = {"wall_s": now() - t0, **cpu.window(t0, now())}
            i = R["interference"][name]
            log(f"  [{name}: {i['wall_s']:.0f} s, other processes used {i.get('foreign_cpu_cores_mean', 0):.2f} cores on average]")
    with contextlib.suppress(Exception):
        import lightning, safetensors
        R["meta"]["lightning"] = lightning.__version__
        R["meta"]["safetensors"] = safetensors.__version__

    def save_partial():
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(rnd(R, 5), f, indent=1, default=str)

    try:
        if "limits" in sections:
            section("limits", guarded, R, "limits", bench_limits, args, nbytes, "start")
        R["limit_values"] = limit_values(R.get("limits", {}), None)
        save_partial()
        if "workloads" in sections:
            R["workloads"] = {}
            sd = make_large(nbytes)
            section("workload_large", guarded, R["workloads"], "large", bench_workload, args, "large", sd, R["limit_values"])
            del sd
            gc.collect()
            save_partial()
            sd = make_adam(nbytes, args.n_small)
            section("workload_adam", guarded, R["workloads"], "adam", bench_workload, args, "adam", sd, R["limit_values"])
            del sd
            gc.collect()
            save_partial()
        if "ranks2" in sections:
            section("ranks2", guarded, R, "ranks2", bench_two_ranks, args, nbytes, R["limit_values"])
            save_partial()
        if "planning" in sections:
            section("planning", guarded, R, "planning", bench_planning, args)
            save_partial()
        if "stall" in sections:
            sd = make_adam(nbytes, args.n_small)
            section("stall", guarded, R, "stall", bench_stall, args, sd, R["limit_values"])
            del sd
            gc.collect()
            save_partial()
        if "limits" in sections:
            section("limits_end", guarded, R, "limits_end", bench_limits, args, nbytes, "end")
            R["limit_values"] = limit_values(R.get("limits", {}), R.get("limits_end"))
    finally:
        cpu.stop()
        R["meta"]["wall_s"] = now() - t_start
        R["meta"]["loadavg_end"] = os.getloadavg()
        R["goals"] = goals(R)
        R["errors_summary"] = collect_errors({k: v for k, v in R.items() if k != "meta"})
        save_partial()
        if args.md:
            os.makedirs(os.path.dirname(os.path.abspath(args.md)), exist_ok=True)
            with open(args.md, "w") as f:
                f.write(render_md(R, command))
        with contextlib.suppress(Exception):
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        for name in os.listdir(args.dir) if os.path.isdir(args.dir) else []:
            remove(os.path.join(args.dir, name))
        log(f"done in {(now() - t_start) / 60:.1f} min")
        for g in R["goals"]:
            log(f"goal: {g['goal']}: {g['measured']} -> {g['met']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
