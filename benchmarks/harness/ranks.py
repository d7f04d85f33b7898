"""Several ranks on this machine: spawned processes in a gloo group, each running one function."""
from __future__ import annotations

import contextlib
import multiprocessing
import traceback
from typing import Any, Callable

from .util import error_text, free_port, init_gloo


def _entry(fn: Callable, rank: int, world: int, port: int, threads: int, backend: str, args: tuple, queue) -> None:
    try:
        init_gloo(rank, world, port, threads, backend)
        queue.put((rank, fn(rank, world, *args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        queue.put((rank, {"error": error_text(e), "traceback": traceback.format_exc()[-3000:]}))
    finally:
        import torch.distributed as dist

        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def on_ranks(fn: Callable[..., Any], world: int, *args: Any, threads: int = 1, timeout: float = 1800,
             backend: str = "gloo") -> list:
    """``fn(rank, world, *args)`` on ``world`` spawned ranks (``threads`` intra-op threads each, as torchrun
    gives ranks sharing the cores) in a group of ``backend``; their results by rank. ``fn`` must be importable
    (a module's function)."""
    context = multiprocessing.get_context("spawn")
    queue, port = context.Queue(), free_port()
    procs = [context.Process(target=_entry, args=(fn, rank, world, port, threads, backend, args, queue)) for rank in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world:
            rank, result = queue.get(timeout=timeout)
            if isinstance(result, dict) and "error" in result and "traceback" in result:
                raise RuntimeError(f"rank {rank}: {result['error']}\n{result['traceback']}")
            results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return [results[rank] for rank in range(world)]
