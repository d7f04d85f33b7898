"""A training process that dies: saves, says so, and waits to be killed (test_survival.py; the benchmark's kill trials).

Usage: survival_child.py ROOT SEED MODE [RANK WORLD PORT]
  MODE "returned": a committed checkpoint ``base``, then ``async_save`` of ``next``; prints
                   ``returned`` once the call returned, then trains on (sleeps) until killed.
  MODE "snapshot": the same, but the snapshot copy of ``next`` stops halfway and prints ``copying``:
                   the process is killed in the middle of its snapshot.
  MODE "rounds":   ``async_save`` of ``next0``, ``next1``, ... (``SURVIVAL_ROUNDS`` of them, each holding
                   ``values(SEED + round, i)``), one after the other: prints ``returned <round>`` once its call
                   returned and ``committed <round>`` once it committed, then trains on (sleeps) until killed.
  MODE "closed":   ``async_save`` of ``next`` and the removal of ``base`` after it, then closes its end of
                   the writer's socket and prints ``closed``, as a dying process does before its exit is
                   known (the writer's replies then fail).
Every tensor of ``next`` is ``values(SEED, i)``; ``base`` holds zeros. ``SURVIVAL_ELEMENTS`` in the
environment sets each tensor's length. With RANK/WORLD/PORT the
ranks meet in a gloo process group (a TCPStore served by rank 0's process) and each saves its shard.

``SURVIVAL_GO`` in the environment: a file whose existence the process waits for (printing ``ready``) before the
save of ``next``, so that several programs started at once save one after the other.
``SURVIVAL_WRITER`` in the environment says what the save of ``next`` finds:
  "running" (the default) the writer that saved ``base``;
  "none"                  no writer: ``next`` is the process's first save (no ``base``), and starts it;
  "idle-stopped"          no writer: the one that saved ``base`` stopped when idle (``writer_idle_timeout``)
                          before ``next``, which starts another. Prints ``idle`` once it stopped.
"""
import os
import signal
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from asyncckpt import core
from asyncckpt.core.snapshot import shared_buffer
from writers import writers_of

# A training process started from a shell in the foreground: SIGHUP's default action and SIGINT's KeyboardInterrupt,
# also where the tests run under nohup (SIGHUP ignored) or in the background of a script (SIGINT ignored), which
# leave them so in every process they start.
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)

TENSORS = 8
# 256 MiB: the write outlasts the moment the call returns (the benchmark's kill trials grow it where it does not)
ELEMENTS = int(os.environ.get("SURVIVAL_ELEMENTS", 8 << 20))


def values(seed: int, index: int, rank: int = 0, elements: int = ELEMENTS) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1000 + index * 10 + rank)
    return torch.rand(elements, generator=generator)


def main() -> None:
    root, seed, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rank, world = 0, 1
    if len(sys.argv) > 4:
        rank, world, port = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
        store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    timeout = float(os.environ.get("SURVIVAL_TIMEOUT", "60"))
    writer = os.environ.get("SURVIVAL_WRITER", "running")
    checkpointer = core.Checkpointer(timeout=timeout, writer_idle_timeout=1.0 if writer == "idle-stopped" else 30.0)
    state = {f"t{i}": torch.zeros(ELEMENTS) for i in range(TENSORS)}  # each rank its own share
    state = {f"r{rank}.{k}": v for k, v in state.items()}
    if writer != "none":
        checkpointer.save(state, os.path.join(root, "base"))
    if writer == "idle-stopped":
        deadline = time.monotonic() + 60
        while writers_of(os.getpid()):
            assert time.monotonic() < deadline, "the writer did not stop when idle"
            time.sleep(0.05)
        print("idle", flush=True)
    if mode == "rounds":
        for round in range(int(os.environ["SURVIVAL_ROUNDS"])):
            for i, key in enumerate(state):
                state[key].copy_(values(seed + round, i, rank))
            handle = checkpointer.async_save(state, os.path.join(root, f"next{round}"))
            print(f"returned {round}", flush=True)
            handle.result()
            print(f"committed {round}", flush=True)
        time.sleep(3600)
    for i, key in enumerate(state):
        state[key].copy_(values(seed, i, rank))
    if mode == "snapshot":
        real_copy = shared_buffer._copy_group
        copied = []
        announced = threading.Lock()

        def stopping_copy(views, sources):
            if copied:
                if announced.acquire(blocking=False):  # once: two copy lanes printing at once interleave their lines
                    print("copying", flush=True)
                time.sleep(3600)
            copied.append(len(views))
            real_copy(views, sources)

        shared_buffer._copy_group = stopping_copy
    if os.environ.get("SURVIVAL_GO"):
        print("ready", flush=True)
        while not os.path.exists(os.environ["SURVIVAL_GO"]):
            time.sleep(0.01)
    handle = checkpointer.async_save(state, os.path.join(root, "next"))
    if mode == "closed":
        checkpointer.remove([os.path.join(root, "base")], after=handle)
        socket.socket(fileno=os.dup(checkpointer._ledger.queue._writer.conn.fileno())).shutdown(socket.SHUT_RDWR)
        print("closed", flush=True)
        time.sleep(3600)
    print("returned", flush=True)
    try:
        handle.result()
        print("committed", flush=True)
    except Exception as e:  # a surviving rank of a save another rank died in: the error names it
        print(f"failed: {e}", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
