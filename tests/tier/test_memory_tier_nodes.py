"""The memory tier across nodes: several "nodes" on this machine, each a ``torchrun --nnodes N --node-rank i`` of its
own (static rendezvous on node 0) in a network namespace of its own (``netns.Network``; loopback where namespaces
are refused) with its own ``ASYNCCKPT_NODE`` and ``ASYNCCKPT_MEMORY_ROOT``, replicas between them, real kills (kill -9 of every process of a node, trainers and writers), a node's
memory deleted as when a node is replaced, a byte flipped in a replica, a peer's writer stopped (SIGSTOP) while the
others replicate to it.

Each program prints to files (``processes.Program``), never to pipes.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Optional

import pytest
import torch

from dist_helper import free_port
from netns import Network
from programs import tier as tier_programs
from program_end import DESTROY_PROCESS_GROUP
from processes import Program
from writers import wait_until_gone, writers_of

PEER_WARNING = "does not take memory-tier replicas"


class Job:
    """``nodes`` torchrun agents, one per node, node ``i`` in a network namespace of its own with ``ASYNCCKPT_NODE=
    n{i}`` and its memory root ``memory/n{i}``: a multi-node job as a launcher starts it, every node's output in
    files."""

    def __init__(self, program: Path, args: list[str], *, nodes: int, memory: Path, logs: Path) -> None:
        port = free_port()
        self.network = Network(nodes)
        self.nodes = []
        for node in range(nodes):
            env = {**os.environ, "ASYNCCKPT_NODE": f"n{node}", "ASYNCCKPT_MEMORY_ROOT": str(memory / f"n{node}"),
                   "GLOO_SOCKET_IFNAME": self.network.interface, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
            if not self.network.isolated:
                env["ASYNCCKPT_REPLICATION_ADDRESS"] = "127.0.0.1"
            self.nodes.append(Program([*self.network.prefix(node), sys.executable, "-m", "torch.distributed.run",
                                       "--nnodes", str(nodes), "--node-rank", str(node), "--nproc-per-node", "1",
                                       "--master-addr", self.network.address(0), "--master-port", str(port),
                                       str(program), *args], logs, env=env, cwd=program.parent))

    def wait_for_line(self, wanted: str, timeout: float = 240) -> None:
        for node in self.nodes:
            node.wait_for_line(wanted, timeout)

    def trainer(self, node: int) -> Optional[int]:
        """The pid of ``node``'s training process (None before it printed it)."""
        return next((int(line.split()[1]) for line in self.nodes[node].lines() if line.startswith("PID ")), None)

    def kill_node(self, node: int) -> None:
        """kill -9 every process of ``node``: its launcher, its training process and that one's writer."""
        trainer = self.trainer(node)
        for pid in [self.nodes[node].pid, *([trainer, *writers_of(trainer)] if trainer is not None else [])]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.nodes[node].wait(30)

    def kill(self) -> None:
        """kill -9 every node's processes (a job whose node died, restarted by its launcher)."""
        trainers = [pid for pid in map(self.trainer, range(len(self.nodes))) if pid is not None]
        for node in range(len(self.nodes)):
            self.kill_node(node)
        wait_until_gone(*trainers)

    def finish(self, timeout: float = 300) -> list[str]:
        """Wait for every node to exit 0; the lines they printed."""
        lines = []
        for node in self.nodes:
            assert node.wait(timeout) == 0, f"{node.lines()[-20:]}\n{node.error_output()[-5000:]}"
            lines += node.lines()
        return lines

    def stop(self) -> None:
        """Every process still running killed (a failed test's: a launcher killed alone leaves its workers), its
        network gone."""
        for node in range(len(self.nodes)):
            self.kill_node(node)
        self.network.close()


@pytest.fixture
def jobs():
    """``jobs(program, args, nodes=..., memory=..., logs=...)``: a ``Job``; every one still running is killed at
    the end of the test."""
    started: list[Job] = []

    def start(*args, **kwargs) -> Job:
        job = Job(*args, **kwargs)
        started.append(job)
        return job
    yield start
    for job in started:
        job.stop()


def _held(memory: Path) -> list[str]:
    """What the nodes' memory roots under ``memory`` hold (hidden entries aside)."""
    return sorted(str(entry) for entry in memory.glob("*/*") if not entry.name.startswith("."))


# ------------------------------------------------------------------------------------------ the core
CORE = textwrap.dedent('''
    import json, os, sys, time, torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from asyncckpt import core
    from asyncckpt.core.storage import commit
    from asyncckpt.core import tier

    mode, root, replicas = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    print(f"PID {os.getpid()}", flush=True)

    def state(step):  # a DTensor sharded over the ranks (each rank writes its shard), a replicated tensor, a value
        g = torch.Generator().manual_seed(step)
        return {"w": distribute_tensor(torch.randn(3 * 4096, 64, generator=g), mesh, [Shard(0)]),
                "b": torch.arange(1000) * step, "step": step}

    def wait_for(path):  # the test's signal; a test that failed before giving it leaves nothing waiting for ever
        deadline = time.monotonic() + 300
        while not os.path.exists(path):
            assert time.monotonic() < deadline, f"no {path}"
            time.sleep(0.05)

    checkpointer = core.Checkpointer(memory_tier=core.MemoryTier(persist_every=2, keep=2, replicas=replicas,
                                                                 peer_timeout=2))
    if mode == "save":  # steps 1-3: 2 is durable too, 3 in memory only; a directory with a DCP part, in memory only
        for step in (1, 2, 3):
            checkpointer.async_save(state(step), f"{root}/step_{step:03d}", step=step)
        directory = checkpointer.begin_directory(f"{root}-directories/checkpoint_3", step=3)
        directory.save_sharded(state(3), "model")
        directory.write_bytes(f"rank_{dist.get_rank()}.json", json.dumps({"step": 3}).encode())
        directory.commit()
        checkpointer.wait()
        dist.barrier()
        print("SAVED", flush=True)
        time.sleep(600)  # killed here
    elif mode == "load":
        path = checkpointer.latest_checkpoint(root)
        print(f"BEFORE THE LOAD {checkpointer!r}", flush=True)  # its writer: started yet or not
        loaded = {"w": distribute_tensor(torch.zeros(3 * 4096, 64), mesh, [Shard(0)]), "b": torch.zeros(1000, dtype=torch.int64),
                  "step": None}
        checkpointer.load(loaded, path)
        print(f"AFTER THE LOAD {checkpointer!r}", flush=True)
        expected = state(loaded["step"])
        same = torch.equal(loaded["w"].to_local(), expected["w"].to_local()) and torch.equal(loaded["b"], expected["b"])
        print(f"RESUMED {path} {loaded['step']} {same}", flush=True)
        directory = checkpointer.latest_checkpoint(f"{root}-directories")
        if directory is not None:
            part = {"w": distribute_tensor(torch.zeros(3 * 4096, 64), mesh, [Shard(0)]), "b": torch.zeros(1000, dtype=torch.int64)}
            dcp.load(part, checkpoint_id=os.path.join(directory, "model"))
            expected = state(3)
            same = torch.equal(part["w"].to_local(), expected["w"].to_local()) and torch.equal(part["b"], expected["b"])
            with open(os.path.join(directory, f"rank_{dist.get_rank()}.json")) as f:
                same = same and json.load(f) == {"step": 3}
        print(f"DIRECTORY {directory} {directory is not None and same}", flush=True)
        checkpointer.close()
    else:  # "stall": step 1 everywhere, then steps 2 and 3 while the test holds node 1's writer stopped
        go = sys.argv[4]
        checkpointer.async_save(state(1), f"{root}/step_001", step=1)
        checkpointer.wait()
        dist.barrier()
        print("READY", flush=True)
        wait_for(go + ".stopped")
        calls, steps = [], 0
        for step in (2, 3):
            started = time.perf_counter()
            checkpointer.async_save(state(step), f"{root}/step_{step:03d}", step=step)
            calls.append(time.perf_counter() - started)
            for _ in range(5):  # training goes on: a collective per step
                dist.all_reduce(torch.ones(16))
                steps += 1
                time.sleep(0.1)
        print("CALLS", steps, *(f"{call:.3f}" for call in calls), flush=True)
        print("TRAINED", flush=True)
        wait_for(go + ".continued")
        checkpointer.wait()
        dist.barrier()
        for step in (2, 3):
            record = commit.read_commit_record(tier.memory_path(f"{root}/step_{step:03d}"))
            print(f"HOLDERS {step} {json.dumps(tier.holders(record), sort_keys=True)}", flush=True)
        checkpointer.close()
        print("DONE", flush=True)
''') + DESTROY_PROCESS_GROUP


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    """A job of three nodes (one rank each, replicas=2: every node's shares on both others) that saved steps 1-3
    (2 durable too, 3 in memory only) and a directory checkpoint with a DCP part (memory only), and was then killed
    whole (kill -9): its memory roots and durable root, and a copy of them as the kill left them, for each test to
    start from."""
    base = tmp_path_factory.mktemp("three_nodes")
    program = base / "core_nodes.py"
    program.write_text(CORE)
    memory, durable = base / "memory", base / "run"
    job = Job(program, ["save", str(durable), "2"], nodes=3, memory=memory, logs=base / "logs")
    try:
        job.wait_for_line("SAVED")
        job.kill()
    finally:
        job.stop()
    assert sorted(os.listdir(durable)) == ["step_002"]  # step 3: in memory only
    assert not os.path.exists(f"{durable}-directories/checkpoint_3")
    shutil.copytree(memory, base / "pristine-memory", symlinks=True)
    return base, program, memory, durable


def _restored(three_nodes) -> tuple[Path, Path, Path, Path]:
    base, program, memory, durable = three_nodes
    shutil.rmtree(memory)
    shutil.copytree(base / "pristine-memory", memory, symlinks=True)
    return base, program, memory, durable


def _resumed(lines: list[str]) -> list[tuple[str, int, bool]]:
    return [(path, int(step), same == "True") for _, path, step, same in
            (line.split() for line in lines if line.startswith("RESUMED "))]


def _writers(lines: list[str], when: str) -> list[str]:
    """Each node's writer ``BEFORE`` or ``AFTER`` its load: ``running`` or ``stopped``."""
    return [line.rpartition("writer=")[2].split()[0].rstrip(")") for line in lines if line.startswith(f"{when} THE LOAD ")]


def test_a_process_restart_loads_each_nodes_own_memory_before_its_writer_starts(three_nodes, jobs):
    """Every process killed, every node's memory intact: the relaunched job resumes from step 3 (in memory only),
    each node from its own copy, bit for bit; no node needs another's, so each node's writer (which serves its
    memory to the others) starts after the load, not during it."""
    base, program, memory, durable = _restored(three_nodes)
    job = jobs(program, ["load", str(durable), "2"], nodes=3, memory=memory, logs=base / "logs-restart")
    lines = job.finish()
    assert sorted(_resumed(lines)) == sorted((str(path), 3, True) for path in memory.glob("n*/*/step_003"))
    assert _writers(lines, "BEFORE") == ["stopped"] * 3 and _writers(lines, "AFTER") == ["running"] * 3, lines


def test_a_replaced_node_fetches_its_shares_from_its_peers_and_a_damaged_replica_gives_way(three_nodes, jobs):
    """Node 2 replaced (its memory gone) and a byte flipped in node 0's replica of its share: the relaunched job
    resumes from step 3, in memory only, on every node; node 2 fetches its share from node 1 after refusing node
    0's damaged copy, which one warning names; each rank's state is bit for bit that of step 3."""
    base, program, memory, durable = _restored(three_nodes)
    shutil.rmtree(memory / "n2")
    (replica,) = memory.glob("n0/*/step_003/__2_0.distcp")
    with open(replica, "r+b") as f:
        f.seek(replica.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    job = jobs(program, ["load", str(durable), "2"], nodes=3, memory=memory, logs=base / "logs-replaced")
    lines = job.finish()
    resumed = _resumed(lines)
    assert sorted(resumed) == sorted((str(path), 3, True) for path in memory.glob("n*/*/step_003")), resumed
    assert _writers(lines, "BEFORE") == ["running"] * 3  # node 2 fetches: the others' writers serve it at once
    directories = sorted(line.split()[1:] for line in lines if line.startswith("DIRECTORY "))
    assert directories == sorted([str(path), "True"] for path in memory.glob("n*/*/checkpoint_3")), directories
    warnings = [line for line in job.nodes[2].error_output().splitlines() if "not using the copy" in line]
    assert len(warnings) == 1 and "__2_0.distcp" in warnings[0] and "node n0" in warnings[0], warnings


def test_with_every_node_memory_lost_the_job_resumes_from_storage(three_nodes, jobs):
    base, program, memory, durable = _restored(three_nodes)
    shutil.rmtree(memory)
    job = jobs(program, ["load", str(durable), "2"], nodes=3, memory=memory, logs=base / "logs-lost")
    lines = job.finish()
    assert _resumed(lines) == [(str(durable / "step_002"), 2, True)] * 3
    assert [line for line in lines if line.startswith("DIRECTORY ")] == ["DIRECTORY None False"] * 3  # memory only


def test_a_peer_that_stops_answering_leaves_training_and_saves_going(tmp_path, jobs):
    """Node 1's writer stopped (SIGSTOP) between two saves: the save calls still return at once and training goes
    on; node 0's writer gives up on node 1 after ``peer_timeout``, says so once, and leaves it out of the next save
    too; once node 1 answers again the saves commit, node 0's shares held by node 0 alone, node 1's by both; the
    run's end persists the last and leaves nothing in memory, nor any process."""
    program = tmp_path / "core_nodes.py"
    program.write_text(CORE)
    memory, durable, go = tmp_path / "memory", tmp_path / "run", tmp_path / "go"
    job = jobs(program, ["stall", str(durable), "1", str(go)], nodes=2, memory=memory, logs=tmp_path / "logs")
    job.wait_for_line("READY")
    trainers = [job.trainer(0), job.trainer(1)]
    (writer,) = writers_of(trainers[1])
    os.kill(writer, signal.SIGSTOP)
    try:
        Path(f"{go}.stopped").touch()
        job.wait_for_line("TRAINED")
        deadline = time.monotonic() + 60
        while PEER_WARNING not in job.nodes[0].error_output():
            assert time.monotonic() < deadline, job.nodes[0].error_output()[-3000:]
            time.sleep(0.1)
    finally:
        os.kill(writer, signal.SIGCONT)
    Path(f"{go}.continued").touch()
    lines = job.finish()
    trained = [line.split() for line in lines if line.startswith("CALLS")]
    assert all(int(words[1]) == 10 and all(float(call) < 5.0 for call in words[2:]) for words in trained), trained
    said = [line for line in job.nodes[0].error_output().splitlines() if PEER_WARNING in line]
    assert len(said) == 1 and "n1" in said[0], said
    holders = {(line.split()[1], line.split(maxsplit=2)[2]) for line in lines if line.startswith("HOLDERS")}
    assert len(holders) == 2, holders  # each node's copy of a step has the same record
    for _step, text in holders:
        held = json.loads(text)
        assert held["__0_0.distcp"] == ["n0"] and held["__1_0.distcp"] == ["n1", "n0"], held
    assert sorted(os.listdir(durable)) == ["step_002", "step_003"]  # every second, and the last of the run
    assert _held(memory) == []
    assert writers_of(*trainers) == []


# ------------------------------------------------------------------------------------------ an adapter
def test_accelerate_resumes_on_a_replaced_node_from_its_peers_memory(tmp_path, jobs):
    """Accelerate on two nodes (DDP, one rank each): every process of node 1 killed (kill -9) and its memory deleted
    right after a memory-only checkpoint committed; the relaunched job (a new node 1) resumes from that checkpoint,
    node 1 fetching it from node 0, and ends bit for bit as an uninterrupted run without asyncckpt."""
    program = tmp_path / "accelerate_nodes.py"
    program.write_text(tier_programs.ACCELERATE)
    memory = tmp_path / "memory"

    def run(**run):  # one training per process (programs/tier.py)
        return [tier_programs.config([run], replicas=1)]

    jobs(program, run(root=str(tmp_path / "native"), asyncckpt=False), nodes=2, memory=memory,
         logs=tmp_path / "logs").finish()
    first = jobs(program, run(root=str(tmp_path / "async"), stop_at=2), nodes=2, memory=memory, logs=tmp_path / "logs")
    first.wait_for_line("SAVED")
    first.kill()
    assert sorted(os.listdir(tmp_path / "async" / "checkpoints")) == ["checkpoint_1"]  # 0 and 2: in memory only
    shutil.rmtree(memory / "n1")
    second = jobs(program, run(root=str(tmp_path / "async"), resume=True), nodes=2, memory=memory,
                  logs=tmp_path / "logs")
    lines = second.finish()
    assert "RANK 0 BEGINS AT 3" in lines and "RANK 1 BEGINS AT 3" in lines, lines  # from checkpoint_2, in memory
    a, b = (torch.load(tmp_path / name / "final.pt", weights_only=True) for name in ("async", "native"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _held(memory) == []
    assert writers_of(*(second.trainer(node) for node in (0, 1))) == []



def test_lightning_on_two_nodes_resumes_from_the_other_nodes_replica(tmp_path, jobs):
    """Lightning with ``Trainer(num_nodes=2, devices=1, strategy="ddp")``, a node per torchrun, the memory tier on:
    steps 5 and 15 in memory only, 10 durable too; rank 0's files go to node 1's memory as they commit. Every
    process of both nodes killed after step 15's checkpoint and node 0's memory deleted (a replaced node):
    ``ckpt_path="last"`` brings the process group up before Lightning picks, the nodes agree on step 15's
    ``last.ckpt`` (newer than the durable step 10), node 0 fetches it from node 1, both ranks resume at 15 and end
    bit for bit as Lightning's own kill and resume from step 15; nothing left in memory, no process."""
    program = tmp_path / "lightning_nodes.py"
    program.write_text(tier_programs.LIGHTNING)
    memory = tmp_path / "memory"

    def run(**run):  # a node per torchrun, one rank each
        return [tier_programs.config([{"asyncckpt": run["root"].endswith("async"), **run}], replicas=1, num_nodes=2,
                                     devices=1, max_steps=24)]

    for arm in ("native", "async"):  # stopped once the checkpoint of step 15 is committed
        job = jobs(program, run(root=str(tmp_path / arm), stop_at=15), nodes=2, memory=memory, logs=tmp_path / "logs")
        job.wait_for_line("SAVED")
        job.kill()
    assert sorted(os.listdir(tmp_path / "async" / "ckpts")) == ["epoch=0-step=10.ckpt", "last.ckpt"]
    held = {node: sorted(entry.name for entry in (memory / node).glob("*/*") if not entry.name.startswith("."))
            for node in ("n0", "n1")}
    assert held["n0"] == held["n1"] == ["epoch=0-step=15.ckpt", "last.ckpt"], held  # the newest two, replicated
    shutil.rmtree(memory / "n0")
    lines = []
    for arm in ("native", "async"):
        job = jobs(program, run(root=str(tmp_path / arm), resume=True), nodes=2, memory=memory, logs=tmp_path / "logs")
        lines += job.finish()
    assert lines.count("RANK 0 BEGINS AT 15") == 2 and lines.count("RANK 1 BEGINS AT 15") == 2, lines
    a, b = (torch.load(tmp_path / name / "final.pt", weights_only=True) for name in ("async", "native"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _held(memory) == []
    assert writers_of(*(job.trainer(node) for node in (0, 1))) == []


UNEVEN = textwrap.dedent('''
    import os, sys, torch, torch.distributed as dist
    from asyncckpt import core

    root = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"PID {os.getpid()}", flush=True)
    state = {f"rank{rank}": torch.arange(64 * 1024, dtype=torch.float32) * (rank + 1)}  # 256 KiB, each its own
    with core.Checkpointer(memory_tier=core.MemoryTier(replicas=1, keep=1, max_bytes=2 << 20)) as checkpointer:
        for step in (1, 2):
            checkpointer.save(state, f"{root}/step_{step}", step=step)
        loaded = {f"rank{rank}": torch.zeros(64 * 1024)}
        checkpointer.load(loaded, f"{root}/step_2")
        print("LOADED", torch.equal(loaded[f"rank{rank}"], state[f"rank{rank}"]), flush=True)
''')


def test_nodes_that_differ_in_free_memory_place_each_save_alike(tmp_path, jobs):
    """Node 1's memory root holds another job's 1.5 MiB, so that its tier (2 MiB: a checkpoint of 512 KiB there,
    its share and node 0's replica, twice) does not fit while node 0's does: every rank saves to storage, node 1
    says so once, and the saves load (a save whose ranks split between memory and storage would fail)."""
    program = tmp_path / "uneven.py"
    program.write_text(UNEVEN)
    memory, durable = tmp_path / "memory", tmp_path / "run"
    (memory / "n1" / "another-job").mkdir(parents=True)
    (memory / "n1" / "another-job" / "blob").write_bytes(bytes(3 << 19))
    job = jobs(program, [str(durable)], nodes=2, memory=memory, logs=tmp_path / "logs")
    lines = job.finish()
    assert lines.count("LOADED True") == 2, lines
    assert sorted(os.listdir(durable)) == ["step_1", "step_2"]
    assert "does not fit" not in job.nodes[0].error_output()
    assert job.nodes[1].error_output().count("does not fit") == 1, job.nodes[1].error_output()[-3000:]


def test_the_trainer_resumes_on_a_replaced_node_from_its_peers_memory(tmp_path, jobs):
    """The Transformers Trainer on two nodes (DDP, one rank each), the memory tier on (``replicas=1``): checkpoints
    5 and 15 in memory only, 10 durable too; every rank killed (kill -9) in the step after step 15's save, and node
    1's memory deleted (a replaced node); the relaunched job resumes from checkpoint-15, node 1 fetching it from
    node 0, and ends bit for bit as an uninterrupted run without asyncckpt; nothing left in memory, no process."""
    program = tmp_path / "trainer_nodes.py"
    program.write_text(tier_programs.TRAINER)
    memory = tmp_path / "memory"
    first = jobs(program, [str(tmp_path), "first", "15", "1"], nodes=2, memory=memory, logs=tmp_path / "logs")
    for node in first.nodes:
        node.wait(300)
    wait_until_gone(*(first.trainer(node) for node in (0, 1)), timeout=120)
    assert sorted(name for name in os.listdir(tmp_path / "async") if name.startswith("checkpoint-")) == \
        ["checkpoint-10"]  # 15: in memory only
    shutil.rmtree(memory / "n1")
    second = jobs(program, [str(tmp_path), "second", "15", "1"], nodes=2, memory=memory, logs=tmp_path / "logs")
    lines = second.finish()
    assert "RANK 0 BEGINS AT 15" in lines and "RANK 1 BEGINS AT 15" in lines, lines  # from memory
    a, b = (torch.load(tmp_path / name / "final.pt", weights_only=True) for name in ("async", "native"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _held(memory) == []
    assert writers_of(*(second.trainer(node) for node in (0, 1))) == []
