"""The machine a sitting ran on: its facts, its load while the sitting ran, and its limits.

The project's machine is a 2-vCPU VM shared with other jobs, whose copy and disk speeds drift within
minutes; a figure means something only beside the load it was measured under and the machine's own
limits measured in the same sitting. Every page states both.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import os
import platform
import threading
from typing import Optional

import psutil
import torch

from .floors import AlignedBuffer, per_tensor_copy, read_files, write_file
from .util import GiB, error_text, gbps, log, now, spread
from .workloads import make_adam


def facts() -> dict:
    """Cores, memory, CPU model, kernel, Python, torch and (if any) the GPU."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    out = {"host": platform.node(), "cpu": model, "cores": os.cpu_count(),
           "memory_gib": round(psutil.virtual_memory().total / GiB, 1), "kernel": platform.release(),
           "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    return out


class LoadMonitor:
    """CPU time used by processes outside this sitting's process tree (other jobs on the machine),
    sampled once a second, and the load average; a ``phase`` reports its own window of them."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._last: dict[int, float] = {}
        self.samples: list[tuple[float, float, float]] = []  # (time, busy cores, our cores)
        self.phases: dict[str, dict] = {}
        self.loadavg_before = os.getloadavg()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _ours(self) -> float:
        delta, seen = 0.0, {}
        with contextlib.suppress(psutil.Error):
            for p in [self.proc] + self.proc.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    seen[p.pid] = t.user + t.system + t.children_user + t.children_system
                    delta += seen[p.pid] - self._last.get(p.pid, 0.0)
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
            if t > last_t:
                with self._lock:
                    self.samples.append((t, (busy - last_busy) / (t - last_t), max(0.0, ours / (t - last_t))))
            last_t, last_busy = t, busy

    def window(self, t0: float, t1: float) -> dict:
        with self._lock:
            rows = [r for r in self.samples if t0 <= r[0] <= t1 + 1.0]
        if not rows:
            return {"wall_s": t1 - t0}
        foreign = [max(0.0, busy - ours) for _, busy, ours in rows]
        return {"wall_s": t1 - t0, "foreign_cores_mean": sum(foreign) / len(foreign), "foreign_cores_max": max(foreign),
                "our_cores_mean": sum(o for *_, o in rows) / len(rows)}

    @contextlib.contextmanager
    def phase(self, name: str):
        """Record the wall time and the rest of the machine's CPU use while the block runs."""
        t0, load = now(), os.getloadavg()[0]
        try:
            yield
        finally:
            self.phases[name] = {**self.window(t0, now()), "loadavg": [load, os.getloadavg()[0]]}
            p = self.phases[name]
            log(f"  [{name}: {p['wall_s']:.0f} s, other processes {p.get('foreign_cores_mean', 0):.2f} cores]")

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        whole = self.window(self.samples[0][0] - 1.0, self.samples[-1][0]) if self.samples else {}
        return {"loadavg_before": list(self.loadavg_before), "loadavg_after": list(os.getloadavg()),
                **{k: v for k, v in whole.items() if k != "wall_s"}, "phases": self.phases}


def wait_quiet(max_wait_s: float, threshold_pct: float = 15.0, quiet_for_s: float = 20.0) -> dict:
    """Wait (at most ``max_wait_s``) until the whole machine has been nearly idle for ``quiet_for_s``."""
    t0, quiet_since = now(), None
    while now() - t0 < max_wait_s:
        if psutil.cpu_percent(interval=2.0) < threshold_pct:
            quiet_since = quiet_since or now()
            if now() - quiet_since >= quiet_for_s:
                return {"waited_s": now() - t0, "quiet": True}
        else:
            quiet_since = None
    return {"waited_s": now() - t0, "quiet": False}


def settle(max_wait_s: float = 10.0, threshold_pct: float = 10.0, samples: int = 3) -> float:
    """Wait (at most ``max_wait_s``) until the machine has been nearly idle for ``samples`` samples of 0.1 s: the
    work a step left behind (another process's start-up) done before the next is timed. Seconds waited."""
    t0, quiet = now(), 0
    while quiet < samples and now() - t0 < max_wait_s:
        quiet = quiet + 1 if psutil.cpu_percent(interval=0.1) < threshold_pct else 0
    return now() - t0


# ------------------------------------------------------------------------------------------ limits
LIMITS = {
    "memcpy": "memcpy into a held buffer (`dst.copy_(src)`, torch's threads)",
    "odirect_write": "O_DIRECT write + fsync from held memory, 2 threads of 32 MiB requests",
    "buffered_write": "buffered write + fsync",
    "cold_read": "sequential read after drop_caches, into a held buffer",
    "cached_read": "sequential read from the page cache, into a held buffer",
    "per_tensor_copy": "copying a model's and Adam's ~8,000 tensors (per GiB) one by one into held clones",
}


def drop_caches() -> Optional[str]:
    """Empty the page cache (root only). None on success, else why not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return error_text(e)


def measure_limits(kinds: tuple[str, ...], nbytes: int, directory: str, reps: int) -> dict:
    """The machine's own rate for ``nbytes`` of each kind in ``LIMITS``: ``reps`` reps each, GB/s."""
    log(f"limits: {', '.join(kinds)} for {nbytes / GiB:.3f} GiB")
    out: dict = {"bytes": nbytes}
    path = os.path.join(directory, f"limits_{os.getpid()}.bin")
    buf = AlignedBuffer(nbytes)
    buf.tensor.view(torch.uint8)[: nbytes - nbytes % 4].view(torch.float32).uniform_()

    def rates(one) -> dict:
        try:
            one()  # warm
            return spread([gbps(nbytes, one()) for _ in range(reps)])
        except Exception as e:  # noqa: BLE001 - a limit this machine does not allow is reported, not fatal
            return {"error": error_text(e)}

    if "memcpy" in kinds:
        src = buf.tensor[:nbytes]
        dst = torch.zeros_like(src)

        def memcpy() -> float:
            t0 = now()
            dst.copy_(src)
            return now() - t0

        out["memcpy"] = rates(memcpy)
        del dst

    def write(direct: bool) -> float:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.sync()
        return write_file(path, buf.view, direct=direct, threads=2 if direct else 1)["s"]

    for kind, direct in (("odirect_write", True), ("buffered_write", False)):
        if kind in kinds:
            out[kind] = rates(lambda direct=direct: write(direct))
    if {"cold_read", "cached_read"} & set(kinds):
        write(True)  # the file the reads read
    if "cold_read" in kinds:
        def cold() -> float:
            why = drop_caches()
            if why is not None:
                raise PermissionError(f"drop_caches not permitted: {why}")
            return read_files([path], buf.view)["s"]

        out["cold_read"] = rates(cold)
    if "cached_read" in kinds:
        out["cached_read"] = rates(lambda: read_files([path], buf.view)["s"])
    if "per_tensor_copy" in kinds:
        out["per_tensor_copy"] = spread([gbps(nbytes, s) for s in per_tensor_copy(make_adam(nbytes), reps)])
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    buf.close()
    gc.collect()
    for kind in kinds:
        if "median" in out.get(kind, {}):
            log(f"  {kind}: {out[kind]['median']:.2f} GB/s")
    return out


# ------------------------------------------------------------------------------------------ memory and the page cache
class MemSampler:
    """Peak system used memory (total - available) and process-tree RSS over a block, sampled in a thread."""

    def __init__(self, interval: float = 0.05) -> None:
        self.interval, self.proc = interval, psutil.Process()
        self._procs: list = [self.proc]
        self._n = 0
        self._stop = threading.Event()
        self.base_used = self.base_rss = self.peak_used = self.peak_rss = 0

    def _sample(self) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        if self._n % 10 == 0:  # listing the children is the costly part: every 0.5 s
            with contextlib.suppress(psutil.Error):
                self._procs = [self.proc] + self.proc.children(recursive=True)
        self._n += 1
        rss = 0
        for p in self._procs:
            with contextlib.suppress(psutil.Error):
                rss += p.memory_info().rss
        return vm.total - vm.available, rss

    def _run(self) -> None:
        while not self._stop.is_set():
            used, rss = self._sample()
            self.peak_used, self.peak_rss = max(self.peak_used, used), max(self.peak_rss, rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> "MemSampler":
        self.base_used, self.base_rss = self.peak_used, self.peak_rss = self._sample()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def result(self) -> dict:
        return {"extra_used_gib": (self.peak_used - self.base_used) / GiB,
                "extra_tree_rss_gib": (self.peak_rss - self.base_rss) / GiB}


def evict(paths: list[str]) -> None:
    """Drop the files' pages from the page cache (``posix_fadvise(DONTNEED)`` after a sync)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


def resident_fraction(paths: list[str]) -> float:
    """The fraction of the files' pages in the page cache (``mincore`` of a mapping; reads nothing)."""
    resident = total = 0
    for path in paths:
        size = os.path.getsize(path)
        if not size:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            pages = -(-size // mmap.PAGESIZE)
            vector = ctypes.create_string_buffer(pages)
            if _libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            resident += sum(byte & 1 for byte in vector.raw)
            total += pages
            _libc.munmap(address, size)
        finally:
            os.close(fd)
    return resident / total if total else 0.0


def touch_memory(nbytes: int) -> None:
    """Touch ``nbytes`` of fresh memory and free it: this VM hands memory freed seconds ago back to its
    host and touching it again costs ~3 s/GiB, which would hit the next rep's allocations at random."""
    if nbytes:
        block = bytearray(nbytes)
        view = memoryview(block)
        for start in range(0, nbytes, 1 << 26):
            view[start:start + (1 << 26)] = bytes(min(1 << 26, nbytes - start))
        del view, block
