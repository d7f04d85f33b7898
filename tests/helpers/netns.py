"""Simulated nodes, each in a network namespace of its own: ``Network(n)`` makes ``n`` namespaces, each with one
interface (``eth0``, address ``10.<x>.<y>.<i+1>``) on a bridge in a namespace of its own (the switch), so that the
nodes reach each other only through their links, and a test can cut a node's link (``cut``), bring it back
(``restore``) or slow it (``slow``), as a network other jobs share does. Nothing of it touches the machine's own
network: deleting the namespaces (``close``) removes it all.

We are root here. Where the machine refuses namespaces (no root, no ``ip``), ``Network`` falls back to loopback:
every node on ``127.0.0.1`` in the machine's namespace, said once (``reason``), and what needs a link of its own
(``cut``, ``slow``) is not there (``isolated`` is False: a test skips, saying why).
"""
from __future__ import annotations

import os
import random
import subprocess
from typing import Optional


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


class Network:
    """``nodes`` simulated nodes; ``prefix(i)`` is the command that runs a program on node ``i``, ``address(i)`` its
    address, ``interface`` the name of its network interface (for gloo's ``GLOO_SOCKET_IFNAME``)."""

    def __init__(self, nodes: int) -> None:
        self.nodes = nodes
        self.name = f"ack{os.getpid() % 10000}{random.randrange(1000):03d}"
        self.reason: Optional[str] = None
        self._made: list[str] = []
        subnet = f"10.{random.randrange(1, 250)}.{random.randrange(1, 250)}"
        self._addresses = [f"{subnet}.{i + 1}" for i in range(nodes)]
        try:
            self._make()
        except (OSError, subprocess.CalledProcessError) as e:
            self.close()
            self.reason = getattr(e, "stderr", None) or str(e)
            print(f"network namespaces refused ({self.reason.strip()}): the nodes share the loopback address 127.0.0.1")

    @property
    def isolated(self) -> bool:
        """Each node has a link of its own (namespaces), which ``cut`` and ``slow`` act on."""
        return self.reason is None

    @property
    def interface(self) -> str:
        return "eth0" if self.isolated else "lo"

    def _namespace(self, node: Optional[int]) -> str:
        return f"{self.name}{'sw' if node is None else node}"

    def _make(self) -> None:
        switch = self._namespace(None)
        _ip("netns", "add", switch)
        self._made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for node in range(self.nodes):
            namespace = self._namespace(node)
            _ip("netns", "add", namespace)
            self._made.append(namespace)
            _ip("link", "add", f"v{node}", "netns", switch, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _ip("-n", switch, "link", "set", f"v{node}", "master", "br0")
            _ip("-n", switch, "link", "set", f"v{node}", "up")
            _ip("-n", namespace, "addr", "add", f"{self._addresses[node]}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")

    def prefix(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self._namespace(node)] if self.isolated else []

    def address(self, node: int) -> str:
        return self._addresses[node] if self.isolated else "127.0.0.1"

    def cut(self, node: int) -> None:
        """Node ``node``'s link goes down: what it sends and what is sent to it is lost (a peer waits, then
        times out), as when a cable or a switch port fails."""
        _ip("-n", self._namespace(None), "link", "set", f"v{node}", "down")

    def restore(self, node: int) -> None:
        _ip("-n", self._namespace(None), "link", "set", f"v{node}", "up")

    def slow(self, node: int, rate: str) -> None:
        """What node ``node`` sends and what is sent to it goes at ``rate`` (``tc``'s units: ``200mbit``): a
        transfer to or from it lasts."""
        for namespace, device in ((self._namespace(None), f"v{node}"), (self._namespace(node), "eth0")):
            subprocess.run(["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf", "rate", rate,
                            "burst", "256kb", "latency", "5s"], check=True, stdout=subprocess.DEVNULL)

    def close(self) -> None:
        for namespace in reversed(self._made):
            subprocess.run(["ip", "netns", "del", namespace], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._made = []

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
