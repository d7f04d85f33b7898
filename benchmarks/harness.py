"""The measurement machinery that core_bench.py's sections share, and that floors.py, load_bench.py and
profile_core.py reuse so that every script measures the same way: timing and logging helpers, file
helpers, error capture for a failing peer, memory and CPU samplers, the back-to-back rep runner, the
state dicts of the workloads, the machine's limits (section 1) and the floors paired with each rep.

Kept apart from the sections so that a script can import a workload or a floor without the sections'
peers (torch.distributed.checkpoint, safetensors, Lightning) or asyncckpt.core: nothing here imports them.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import json
import math
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import threading
import time
import traceback
from typing import Any, Callable, Optional

import psutil
import torch

from raw_writer import CHUNK, write_file

GiB = 1 << 30
MiB = 1 << 20
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


def free_port() -> int:
    """A free TCP port on localhost, for a gloo process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def copy_into_state(target, flat: dict) -> None:
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
    src = dst = None  # frees the 2 x nbytes now (not del: the memcpy closure reads them)
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


# ---------------------------------------------------------------------------------------- 6. slowdown
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


# ---------------------------------------------------------------------------------------- run metadata
def write_report(result: dict, json_path: str, markdown_path: str, markdown: str) -> None:
    """A benchmark's figures as JSON and its page as markdown (printed too)."""
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    with open(markdown_path, "w") as f:
        f.write(markdown)
    print(markdown)


def git_meta() -> dict:
    """The commit a run measured and any uncommitted changes under core/, recorded with its figures."""
    def run(*cmd):
        try:
            return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:
            return ""
    return {"git_commit": run("git", "rev-parse", "HEAD"),
            "core_dirty": run("git", "status", "--short", "--", "core").replace("\n", "; ")}

