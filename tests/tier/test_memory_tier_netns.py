"""The memory tier on four nodes, each in a network namespace of its own (``netns.Network``: a link per node on a
bridge, which a test cuts, restores or slows), each node one training process started with torchrun's environment
(its own ``ASYNCCKPT_NODE`` and memory root): what a job of several nodes meets on a network it shares.

One job saves (``SAVE``): step 1 in memory only; step 2 durable too, each rank's writer writing its own share from its
own node's memory (the bytes each writer wrote are its share's); step 3 saved, and every training process killed
(kill -9) the moment the save returned on it: the writers, on their own, commit it in every node's memory and durably.
Then the job restarts (``RESUME``) with node 1 replaced (its memory gone), node 2's link cut while node 1 fetches its
share from it: node 1 takes it from node 3, and every rank resumes from step 3 in memory, bit for bit; it saves steps 4
and 5 with node 3's link cut while the replicas of step 4 go to it: the save commits with the replicas the nodes took,
or fails naming what failed, within the save's timeout, and step 5 commits; the run's end leaves nothing in memory.

Where namespaces are refused, the nodes share the loopback address, and the link cuts are skipped (said once).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dist_helper import free_port
from netns import Network
from processes import Program
from writers import wait_until_gone, writers_of

NODES = 4

PROGRAM = textwrap.dedent('''
    import json, os, signal, sys, time, torch, torch.distributed as dist
    from datetime import timedelta
    from asyncckpt import core
    from asyncckpt.core.storage import commit
    from asyncckpt.core import tier

    mode, root, control = sys.argv[1], sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    print(f"PID {os.getpid()}", flush=True)

    def state(step):  # each rank's own share of 8 MiB
        return {f"rank{rank}": torch.randn(2 << 20, generator=torch.Generator().manual_seed(100 * step + rank)),
                "step": step}

    def wait_for(name):  # the test's signal
        deadline = time.monotonic() + 300
        while not os.path.exists(os.path.join(control, name)):
            assert time.monotonic() < deadline, f"no {name}"
            time.sleep(0.05)

    def written(checkpointer):  # what this rank's writer wrote to storage so far
        with open(f"/proc/{checkpointer.writer_pid()}/io") as f:
            return int(next(line.split()[1] for line in f if line.startswith("write_bytes")))

    checkpointer = core.Checkpointer(memory_tier=core.MemoryTier(persist_every=2, keep=2, replicas=2, peer_timeout=8),
                                     timeout=60)
    if mode == "save":
        checkpointer.save(state(1), f"{root}/step_1", step=1)  # in memory only
        before = written(checkpointer)
        checkpointer.async_save(state(2), f"{root}/step_2", step=2)  # durable too
        checkpointer.wait_for(f"{root}/step_2")
        copy = tier.memory_path(f"{root}/step_2")  # this node's: its share, and the replicas it received (here
        record = commit.read_commit_record(copy)    # on the disk, they count as written too; in tmpfs they would not)
        received = sum(os.path.getsize(os.path.join(copy, name)) for name in record["files"]
                       if tier.writer_of(record, name) != rank and os.path.exists(os.path.join(copy, name)))
        print(f"WROTE {written(checkpointer) - before - received}", flush=True)
        dist.barrier()
        checkpointer.async_save(state(3), f"{root}/step_3", step=3, durable=True)
        os.kill(os.getpid(), signal.SIGKILL)  # every training process, the moment the save returned on it
    else:  # "resume"
        path = checkpointer.latest_checkpoint(root)
        loaded = {f"rank{rank}": torch.zeros(2 << 20), "step": None}
        checkpointer.load(loaded, path)
        same = torch.equal(loaded[f"rank{rank}"], state(loaded["step"])[f"rank{rank}"])
        print(f"RESUMED {path} {loaded['step']} {same}", flush=True)
        dist.barrier()
        print("REPLICATING", flush=True)
        wait_for("slowed")
        checkpointer.async_save(state(4), f"{root}/step_4", step=4)  # the test cuts node 3's link meanwhile
        started = time.monotonic()
        try:
            checkpointer.wait()
            print("STEP 4 COMMITTED", json.dumps(tier.holders(commit.read_commit_record(
                tier.memory_path(f"{root}/step_4")))), flush=True)
        except core.CheckpointError as e:
            print("STEP 4 FAILED", str(e).replace(chr(10), " "), flush=True)
        print(f"STEP 4 ENDED IN {time.monotonic() - started:.1f}", flush=True)
        dist.barrier()
        checkpointer.save(state(5), f"{root}/step_5", step=5)
        print("STEP 5 COMMITTED", flush=True)
        checkpointer.close()
        print("DONE", flush=True)
    dist.destroy_process_group()
''')


class Nodes:
    """``NODES`` training processes, process ``i`` on node ``i`` of ``network`` with torchrun's environment (rank
    ``i`` of ``NODES``, one a node) and its own node id and memory root; every output in files."""

    def __init__(self, network: Network, program: Path, args: list[str], memory: Path, logs: Path) -> None:
        port = free_port()
        self.processes = []
        for node in range(NODES):
            env = {**os.environ, "RANK": str(node), "WORLD_SIZE": str(NODES), "LOCAL_RANK": "0",
                   "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(node), "MASTER_ADDR": network.address(0),
                   "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": network.interface, "ASYNCCKPT_NODE": f"n{node}",
                   "ASYNCCKPT_MEMORY_ROOT": str(memory / f"n{node}"), "OMP_NUM_THREADS": "1",
                   "PYTHONWARNINGS": "ignore"}
            if not network.isolated:
                env["ASYNCCKPT_REPLICATION_ADDRESS"] = "127.0.0.1"
            self.processes.append(Program([*network.prefix(node), sys.executable, str(program), *args], logs, env=env,
                                          cwd=program.parent))

    def wait_for_line(self, wanted: str, timeout: float = 300) -> None:
        for process in self.processes:
            process.wait_for_line(wanted, timeout)

    def lines(self) -> list[str]:
        return [line for process in self.processes for line in process.lines()]

    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def finish(self, timeout: float = 300) -> list[str]:
        for process in self.processes:
            assert process.wait(timeout) == 0, f"{process.lines()[-20:]}\n{process.error_output()[-5000:]}"
        return self.lines()

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def _receiving(memory: Path, name: str) -> bool:
    """A file whose name has ``name`` in it is arriving under ``memory`` (a node's memory root): a replica or a
    fetched file, still under its hidden name."""
    return any(".asyncckpt-tmp-" in file and name in file
               for _directory, _subdirectories, files in os.walk(memory) for file in files)


def _wait(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def network():
    with Network(NODES) as made:
        yield made


def test_four_nodes_in_namespaces_survive_a_job_killed_whole_a_replaced_node_and_cut_links(tmp_path, network):
    program = tmp_path / "nodes.py"
    program.write_text(PROGRAM)
    memory, durable, control = tmp_path / "memory", tmp_path / "run", tmp_path / "control"
    control.mkdir()
    started: list[Nodes] = []
    try:
        job = Nodes(network, program, ["save", str(durable), str(control)], memory, tmp_path / "logs-save")
        started.append(job)
        for process in job.processes:
            assert process.wait(300) is not None
        trainers = [int(line.split()[1]) for line in job.lines() if line.startswith("PID ")]
        wait_until_gone(*trainers, timeout=120)  # the writers finished step 3 on their own, and ended

        # each rank's writer wrote its own share of step 2 durably, not another's (8 MiB each, and the replicas its
        # node received in memory)
        wrote = [int(line.split()[1]) for line in job.lines() if line.startswith("WROTE ")]
        assert len(wrote) == NODES and all(8 << 20 <= nbytes < 9 << 20 for nbytes in wrote), wrote
        # step 3, whose save returned on every rank right before every training process died: committed in every
        # node's memory (each node's copy, of one save) and durably
        records = [json.loads((memory / f"n{node}" / run / "step_3" / ".asyncckpt-commit.json").read_text())
                   for node in range(NODES) for run in os.listdir(memory / f"n{node}") if not run.startswith(".")]
        assert len(records) == NODES and len({record["save_id"] for record in records}) == 1, records
        durable_record = json.loads((durable / "step_3" / ".asyncckpt-commit.json").read_text())
        assert durable_record["save_id"] == records[0]["save_id"] and "tier" not in durable_record
        assert sorted(os.listdir(durable)) == ["step_2", "step_3"]

        # the job restarts with node 1 replaced: its share of step 3 is on nodes 2 and 3; node 2's link is cut as
        # node 1 fetches it from there, and node 1 takes it from node 3
        shutil.rmtree(memory / "n1")
        if network.isolated:
            network.slow(2, "100mbit")
        job = Nodes(network, program, ["resume", str(durable), str(control)], memory, tmp_path / "logs-resume")
        started.append(job)
        if network.isolated:
            _wait(lambda: _receiving(memory / "n1", "__1_0.distcp"), "node 1 never fetched its share")
            network.cut(2)
            _wait(lambda: "not using the copy" in job.processes[1].error_output(), "node 1 did not give up node 2")
            network.restore(2)
        job.wait_for_line("REPLICATING")
        resumed = sorted(line.split()[1:] for line in job.lines() if line.startswith("RESUMED "))
        assert [(Path(path).parent.parent.name, step, same) for path, step, same in resumed] == \
            [(f"n{node}", "3", "True") for node in range(NODES)], resumed  # from each node's memory, bit for bit
        if network.isolated:
            warnings = [line for line in job.processes[1].error_output().splitlines() if "not using the copy" in line]
            assert warnings and all("node n2" in line for line in warnings), warnings

        # step 4 replicates while node 3's link is cut (for longer than the peers wait for it), then restored
        if network.isolated:
            network.restore(2)
            network.slow(3, "100mbit")
        (control / "slowed").touch()
        if network.isolated:
            _wait(lambda: _receiving(memory / "n3", ".distcp"), "no replica went to node 3")
            network.cut(3)
            time.sleep(10)  # beyond peer_timeout
            network.restore(3)
        lines = job.finish()
        outcome = [line for line in lines if line.startswith("STEP 4 ")]
        committed = [line for line in outcome if line.startswith("STEP 4 COMMITTED")]
        failed = [line for line in outcome if line.startswith("STEP 4 FAILED")]
        # either every rank saw it commit (with the replicas the nodes took) or every rank saw it fail, naming why
        assert len(committed) == NODES or (len(failed) == NODES and all("rank" in line for line in failed)), outcome
        assert all(float(line.split()[-1]) < 60 for line in outcome if "ENDED IN" in line), outcome  # the timeout
        assert lines.count("STEP 5 COMMITTED") == NODES and lines.count("DONE") == NODES
        assert sorted(os.listdir(durable)) == ["step_2", "step_3", "step_5"]  # the run's last, written at its end
        assert [entry for node in range(NODES) for entry in os.listdir(memory / f"n{node}")
                if not entry.startswith(".")] == []
        assert writers_of(*job.pids()) == []
    finally:
        for job in started:
            job.stop()
