"""One simulated node's replication receiver, as tests/test_replication.py runs it: a process of its own
serving the memory root of ``ASYNCCKPT_MEMORY_ROOT`` (``tier.memory_root``), as the writer of a
node's lowest local rank will.

Prints its address (``host port``) once it listens, then serves until SIGTERM, which closes the receiver
(ending every connection) before it exits. ``python replication_node.py [BIND]`` (default: the job's address,
``ASYNCCKPT_REPLICATION_ADDRESS``); the job's secret comes from the launcher's environment
(``ASYNCCKPT_REPLICATION_SECRET``), its refusals go to stderr.
"""
import signal
import sys

from asyncckpt.core.tier import memory_root
from asyncckpt.core.tier.transport import Receiver, job_secret

if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # before the receiver's threads: they inherit it
    with Receiver(memory_root(), secret=job_secret(None), bind=sys.argv[1] if len(sys.argv) > 1 else None,
                  idle_timeout=5.0) as receiver:
        print(*receiver.address, flush=True)
        signal.sigwait({signal.SIGTERM})
    print("closed", flush=True)
