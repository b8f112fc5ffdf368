"""Faults and costs on a cluster's links (trillium/stack/hosts.py), as tests inject them.

Every fault acts where a real network's would, between hosts and not inside them: nftables
rules in a `bridge` table on the bridge (a dropped frame vanishes; neither end is told, as in a
partition), and tc qdiscs on both ends of a host's link. A partition drops a host's frames to
and from every other host and the operator's (the bridge's own address); a one-way partition
drops only frames from one host to another. Loss drops each frame between hosts at random
(`numgen random`). A bandwidth cap is a token bucket (tbf) each way.

This kernel has no netem: added latency is not a qdisc here (see docs/operations.md).
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import subprocess
import sys
import time
from typing import Any

from trillium.stack.hosts import Host, join_bridge


def sh(*argv: str, check: bool = True, timeout: float = 60) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


class Network:
    """The fault and cost controls of one cluster, from its stack state's `hosts` section."""

    def __init__(self, hosts: dict[str, Any]) -> None:
        self.bridge: str = hosts["bridge"]
        self.gateway: str = hosts["gateway"]
        self.subnet = ipaddress.ip_network(hosts["subnet"])
        self.hosts = {name: Host(**h) for name, h in hosts["hosts"].items()}
        self.table = f"{self.bridge}_faults"
        self.capped: set[str] = set()

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def add_host(self, name: str) -> Host:
        """A host brought in (a machine in place of a lost one): a namespace on the bridge with the
        next free address. The cluster's `down` removes it with the others."""
        taken = {self.gateway, *(h.address for h in self.hosts.values())}
        address = next(str(a) for a in list(self.subnet.hosts())[9:] if str(a) not in taken)
        tag = self.bridge.removesuffix("br")
        host = Host(name, f"{tag}-{name}", address, f"{tag}v{len(self.hosts)}")
        join_bridge(host, self.bridge, self.subnet.prefixlen)
        self.hosts[name] = host
        return host

    # ---- faults ----
    def _rules(self, chain_rules: dict[str, list[str]]) -> None:
        """Add rules to the fault table (created on first use: forward between hosts, input and
        output to and from the operator)."""
        lines = [f"table bridge {self.table} {{"]
        for hook in ("forward", "input", "output"):
            lines.append(f"  chain {hook} {{ type filter hook {hook} priority 0; policy accept; }}")
        lines.append("}")
        for hook, rules in chain_rules.items():
            lines += [f"add rule bridge {self.table} {hook} {rule}" for rule in rules]
        subprocess.run(["nft", "-f", "-"], input="\n".join(lines) + "\n", text=True, check=True)

    def partition(self, name: str) -> float:
        """Cut `name` off from every host and the operator, both ways; returns when it began."""
        veth = self.hosts[name].veth
        self._rules(
            {
                "forward": [f'iifname "{veth}" drop', f'oifname "{veth}" drop'],
                "input": [f'iifname "{veth}" drop'],
                "output": [f'oifname "{veth}" drop'],
            }
        )
        return time.monotonic()

    def one_way(self, src: str, dst: str) -> float:
        """Drop what `src` sends to `dst`; what `dst` sends to `src` still arrives."""
        self._rules({"forward": [f'iifname "{self.hosts[src].veth}" oifname "{self.hosts[dst].veth}" drop']})
        return time.monotonic()

    def loss(self, per_mille: int) -> None:
        """Drop `per_mille`/1000 of the frames between any two hosts, at random."""
        self._rules({"forward": [f"numgen random mod 1000 < {per_mille} drop"]})

    def cap(self, name: str, mbit: float) -> None:
        """A token bucket of `mbit` Mbit/s each way on `name`'s link."""
        host = self.hosts[name]
        burst = max(int(mbit * 1e6 / 8 / 100), 16 * 1024)  # 10 ms at the rate, at least 16 KiB
        for ns, dev in ((None, host.veth), (host.netns, "eth0")):
            prefix = ["ip", "netns", "exec", ns] if ns else []
            qdisc = ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "200ms"]
            sh(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", *qdisc)
        self.capped.add(name)

    def heal(self) -> float:
        """Every fault and cap removed; returns when."""
        sh("nft", "delete", "table", "bridge", self.table, check=False)
        for name in self.capped:
            host = self.hosts[name]
            sh("tc", "qdisc", "del", "dev", host.veth, "root", check=False)
            sh("ip", "netns", "exec", host.netns, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        self.capped.clear()
        return time.monotonic()

    # ---- what a link does, measured ----
    def rtt_ms(self, name: str, count: int = 5) -> float:
        """The mean round trip from the operator to `name`, by ping."""
        out = sh("ping", "-c", str(count), "-i", "0.2", "-q", "-W", "2", self.hosts[name].address)
        match = re.search(r"= [\d.]+/([\d.]+)/", out)
        assert match, out
        return float(match.group(1))

    def mbit_per_s(self, name: str, seconds: float = 1.0) -> float:
        """Bulk TCP throughput from the operator to `name`: a sink in `name`'s namespace counts what
        arrives between its first byte and the sender's close."""
        host = self.hosts[name]
        sink = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, sys.executable, "-c", _SINK, host.address],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            port = int(sink.stdout.readline())
            chunk = bytes(1 << 16)
            with socket.create_connection((host.address, port), timeout=10) as conn:
                deadline = time.monotonic() + seconds
                while time.monotonic() < deadline:
                    conn.sendall(chunk)
            received = json.loads(sink.communicate(timeout=30)[0])
            return received["bytes"] * 8 / received["seconds"] / 1e6
        finally:
            sink.kill()
            sink.wait()


# A TCP sink: prints its port, then the bytes one connection brought and the seconds they took.
_SINK = """
import json, socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
received, first = 0, None
while data := conn.recv(1 << 20):
    first = first or time.monotonic()
    received += len(data)
print(json.dumps({"bytes": received, "seconds": time.monotonic() - first}))
"""
