"""Small helpers every scenario uses: the clock, the log, statistics of reps, files and ports."""
from __future__ import annotations

import datetime
import os
import shutil
import socket
import statistics
import time
from typing import Iterable, Optional

GiB = 1 << 30
MiB = 1 << 20


def now() -> float:
    return time.perf_counter()


def log(message: str) -> None:
    print(f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {message}", flush=True)


def error_text(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) < 600 else text[:600] + "..."


def median(values: Iterable) -> Optional[float]:
    """The median of the values that are not None (None if there are none)."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def spread(values: Iterable) -> dict:
    """Median, min and max of a rep's values (the figures a page shows as "median (min-max)")."""
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def gbps(nbytes: int, seconds: Optional[float]) -> Optional[float]:
    return nbytes / seconds / 1e9 if seconds and seconds > 0 else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def free_port() -> int:
    """A free TCP port on localhost, for a gloo process group's rendezvous or a local S3 server."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, threads: Optional[int] = None, backend: str = "gloo") -> None:
    """Join a CPU process group of ``world`` ranks on localhost (``threads``: torch's intra-op threads,
    as torchrun sets them for ranks sharing the machine's cores; ``backend="cuda:gloo"``: a group that
    refuses CPU tensors, as NCCL's)."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if threads:
        torch.set_num_threads(threads)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=900))


PF_EXITING = 0x4  # /proc/PID/stat flags: the process is exiting


def dying(pid: int) -> bool:
    """Whether the process runs no more code of its own: exiting (the kernel's PF_EXITING flag: its
    memory may still be being freed), a zombie, or gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return True
    return fields[0] in "ZX" or bool(int(fields[6]) & PF_EXITING)
