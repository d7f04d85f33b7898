"""Run a function on N ranks with real torch.distributed (gloo, CPU), with a timeout.

``run_on_ranks(fn, world_size, *args)`` spawns one process per rank, initialises a gloo process
group (unless ``init_process_group=False``: then only RANK/WORLD_SIZE are set, to prove a code
path needs no communication; ``backend="cuda:gloo"``: a group that refuses CPU tensors, as NCCL
does), calls ``fn(rank, world_size, *args)`` and returns every rank's result (``die=True``: once
every rank returned, each kills itself with SIGKILL, as a job killed there: no exit drain, its
writers orphaned). Any rank's exception, or a rank that does not finish within ``timeout``, fails
the call with each rank's traceback.

Ranks start from a fork server (``multiprocessing``'s ``forkserver``) that imported torch, its
distributed checkpointing and ``asyncckpt.core`` once per test session: a rank is a fork of that
clean, single-threaded process, so it does not pay those imports again, as a spawned rank would
(seconds per rank on a busy machine). It gets the caller's environment as it is at the call.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What every rank needs: imported by the fork server before it forks any rank.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor", "asyncckpt.core"]


def _entry(fn, rank, world_size, port, args, results, init_process_group, environ, backend, die):
    os.environ.clear()
    os.environ.update(environ)  # the fork server's environment is the one it started with
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    succeeded = False
    try:
        if init_process_group:
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
        result = fn(rank, world_size, *args)
        if die:
            _store_barrier(world_size, "dying")  # no rank dies while another still talks to it
            _store_barrier(world_size, "left", wait=rank == 0)  # rank 0, which serves the Store, dies last
            results.put((rank, "ok", result))
            results.close()
            results.join_thread()
            os.kill(os.getpid(), signal.SIGKILL)
        results.put((rank, "ok", result))
        succeeded = True
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if init_process_group and dist.is_initialized():
            try:
                if succeeded:  # a rank done early must not close its connections while a peer still makes them
                    _store_barrier(world_size, "done")
                dist.destroy_process_group()
            except Exception:
                pass


def _store_barrier(world_size: int, key: str, wait: bool = True) -> None:
    """Every rank got here (through the Store: a group that carries no CPU tensors has no CPU barrier); without
    ``wait``, this rank only says it did."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.add(f"dist_helper/{key}", 1)
    deadline = time.monotonic() + 60
    while wait and store.add(f"dist_helper/{key}", 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.01)


def run_on_ranks(fn, world_size: int, *args, timeout: float = 180.0, init_process_group: bool = True,
                 backend: str = "gloo", die: bool = False) -> list:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # used when the server starts (the first call of the session)
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, daemon=False,
                    args=(fn, rank, world_size, port, args, results, init_process_group, dict(os.environ), backend, die))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    while len(outcome) < world_size and time.monotonic() < deadline:
        try:
            rank, status, value = results.get(timeout=0.5)
            outcome[rank] = (status, value)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()) if len(outcome) == world_size else 1.0)
        if p.is_alive():
            p.kill()
            p.join()
    problems = []
    for rank in range(world_size):
        if rank not in outcome:
            problems.append(f"rank {rank}: no result (timed out after {timeout:.0f}s or died, exit code {procs[rank].exitcode})")
        elif outcome[rank][0] == "error":
            problems.append(f"rank {rank} failed:\n{outcome[rank][1]}")
    if problems:
        raise AssertionError("\n\n".join(problems))
    return [outcome[rank][1] for rank in range(world_size)]
