"""Faults and costs on a cluster's links (`hosts.py`), as tests and benchmarks inject them.

Every fault acts where a real network's would, between hosts and not inside them: nftables
rules in a `bridge` table on the bridge (a dropped frame vanishes; neither end is told, as in a
partition), and tc qdiscs on both ends of a host's link. A partition drops a host's frames to
and from every other host and the operator's (the bridge's own address); a one-way partition
drops only frames from one host to another. Loss drops each frame between hosts at random
(`numgen random`). A bandwidth cap is a token bucket (tbf) each way.

This kernel has no netem, so latency is added by scripts/linkdelay on the receiving host, to
every TCP connection into it (a cluster started with `link_delay`): a connection's round trip
grows by twice the one-way delay of the host it connects to. ICMP is not delayed, so a link's
round trip is measured by a TCP echo, through the same path the stack's connections take.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .hosts import LINKDELAY_CONTROL_PORT, Host, join_bridge


def sh(*argv: str, check: bool = True, timeout: float = 60) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


class Network:
    """The fault and cost controls of one cluster, from its stack state's `hosts` section."""

    def __init__(self, hosts: dict[str, Any]) -> None:
        self.bridge: str = hosts["bridge"]
        self.switch: str = hosts["switch"]
        self.gateway: str = hosts["gateway"]
        self.subnet = ipaddress.ip_network(hosts["subnet"])
        self.hosts = {name: Host(**h) for name, h in hosts["hosts"].items()}
        self.table = f"{self.bridge}_faults"
        self.counts = f"{self.bridge}_counts"
        self.capped: set[str] = set()
        self.delayable: bool = hosts.get("link_delay", False)
        self.delayed: set[str] = set()

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def add_host(self, name: str) -> Host:
        """A host brought in (a machine in place of a lost one): a namespace on the bridge with the
        next free address. The cluster's `down` removes it with the others."""
        taken = {self.gateway, *(h.address for h in self.hosts.values())}
        address = next(str(a) for a in list(self.subnet.hosts())[9:] if str(a) not in taken)
        tag = self.bridge.removesuffix("br")
        host = Host(name, f"{tag}-{name}", address, f"{tag}v{len(self.hosts)}")
        join_bridge(host, self.switch, self.bridge, self.subnet.prefixlen)
        self.hosts[name] = host
        return host

    # ---- faults ----
    def _in_switch(self, *argv: str, **kwargs: Any) -> str:
        return sh("ip", "netns", "exec", self.switch, *argv, **kwargs)

    def _rules(self, rules: list[str], tag: str | None = None) -> None:
        """Add rules to the fault table's chain of frames crossing the bridge (the table made on
        first use), each marked `tag` when given, for `lift`. The operator is on a port of the
        bridge too, so its frames pass there."""
        mark = f' comment "{tag}"' if tag else ""
        lines = [
            f"table bridge {self.table} {{",
            "  chain forward { type filter hook forward priority 0; policy accept; }",
            "}",
            *(f"add rule bridge {self.table} forward {rule}{mark}" for rule in rules),
        ]
        subprocess.run(
            ["ip", "netns", "exec", self.switch, "nft", "-f", "-"], input="\n".join(lines) + "\n", text=True, check=True
        )

    def partition(self, name: str, tag: str | None = None) -> float:
        """Cut `name` off from every host and the operator, both ways; returns when it began."""
        veth = self.hosts[name].veth
        self._rules([f'iifname "{veth}" drop', f'oifname "{veth}" drop'], tag)
        return time.monotonic()

    def cut(self, a: str, b: str, tag: str | None = None) -> float:
        """Cut `a` off from `b`, both ways; each still reaches every other host."""
        va, vb = self.hosts[a].veth, self.hosts[b].veth
        self._rules([f'iifname "{va}" oifname "{vb}" drop', f'iifname "{vb}" oifname "{va}" drop'], tag)
        return time.monotonic()

    def one_way(self, src: str, dst: str, tag: str | None = None) -> float:
        """Drop what `src` sends to `dst`; what `dst` sends to `src` still arrives."""
        self._rules([f'iifname "{self.hosts[src].veth}" oifname "{self.hosts[dst].veth}" drop'], tag)
        return time.monotonic()

    def loss(self, per_mille: int, tag: str | None = None) -> None:
        """Drop `per_mille`/1000 of the frames between any two hosts, at random."""
        self._rules([f"numgen random mod 1000 < {per_mille} drop"], tag)

    def lift(self, tag: str) -> float:
        """Remove the rules added with `tag`, the others kept (faults that overlap end one by
        one); returns when."""
        listed = self._in_switch("nft", "-a", "list", "chain", "bridge", self.table, "forward", check=False)
        for line in listed.splitlines():
            if f'comment "{tag}"' in line and "# handle " in line:
                handle = line.rsplit("# handle ", 1)[1].strip()
                self._in_switch("nft", "delete", "rule", "bridge", self.table, "forward", "handle", handle)
        return time.monotonic()

    def cap(self, name: str, mbit: float) -> None:
        """A token bucket of `mbit` Mbit/s each way on `name`'s link."""
        host = self.hosts[name]
        burst = max(int(mbit * 1e6 / 8 / 100), 16 * 1024)  # 10 ms at the rate, at least 16 KiB
        for ns, dev in ((self.switch, host.veth), (host.netns, "eth0")):
            prefix = ["ip", "netns", "exec", ns]
            qdisc = ["tbf", "rate", f"{mbit}mbit", "burst", str(burst), "latency", "200ms"]
            sh(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", *qdisc)
        self.capped.add(name)

    def uncap(self, name: str) -> None:
        """`name`'s link at its full rate again."""
        host = self.hosts[name]
        self._in_switch("tc", "qdisc", "del", "dev", host.veth, "root", check=False)
        sh("ip", "netns", "exec", host.netns, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        self.capped.discard(name)

    def delay(self, name: str, one_way_ms: float) -> None:
        """Hold every byte into and out of `name`'s TCP connections `one_way_ms` longer: a round
        trip to it grows by twice that. Needs a cluster started with `link_delay`."""
        if not self.delayable:
            raise RuntimeError("added latency needs a cluster started with link_delay (hosts.py)")
        url = f"http://{self.hosts[name].address}:{LINKDELAY_CONTROL_PORT}/delay?ms={one_way_ms}"
        with urllib.request.urlopen(urllib.request.Request(url, method="PUT"), timeout=10) as reply:
            reply.read()
        if one_way_ms:
            self.delayed.add(name)
        else:
            self.delayed.discard(name)

    def round_trip(self, rtt_ms: float) -> None:
        """Every link's round trip raised by `rtt_ms` (half of it each way into every host)."""
        for name in self.hosts:
            self.delay(name, rtt_ms / 2)

    def heal(self) -> float:
        """Every fault, cap and delay removed; returns when."""
        for name in list(self.delayed):
            self.delay(name, 0)
        self._in_switch("nft", "delete", "table", "bridge", self.table, check=False)
        for name in list(self.capped):
            self.uncap(name)
        return time.monotonic()

    # ---- what crosses the links ----
    def count(self, pairs: list[tuple[str, str]]) -> None:
        """Count the bytes of every frame from one host to another, for each (from, to) of
        `pairs`: nftables counters on the bridge, read by `counted`."""
        lines = [
            f"table bridge {self.counts} {{",
            "  chain forward { type filter hook forward priority -10; policy accept; }",
            "}",
            *(
                f'add rule bridge {self.counts} forward iifname "{self.hosts[a].veth}" '
                f'oifname "{self.hosts[b].veth}" counter comment "{a}>{b}"'
                for a, b in pairs
            ),
        ]
        self._in_switch("nft", "delete", "table", "bridge", self.counts, check=False)
        subprocess.run(
            ["ip", "netns", "exec", self.switch, "nft", "-f", "-"], input="\n".join(lines) + "\n", text=True, check=True
        )

    def counted(self) -> dict[tuple[str, str], int]:
        """The bytes (Ethernet frames, headers included) each counted pair has carried so far."""
        listing = json.loads(self._in_switch("nft", "-j", "list", "table", "bridge", self.counts))
        out = {}
        for item in listing["nftables"]:
            rule = item.get("rule")
            if rule and "comment" in rule:
                counter = next(e["counter"] for e in rule["expr"] if "counter" in e)
                src, dst = rule["comment"].split(">")
                out[(src, dst)] = counter["bytes"]
        return out

    # ---- what a link does, measured ----
    def rtt_ms(self, name: str, count: int = 9) -> float:
        """The median round trip of one byte over TCP from the operator to `name` and back (an
        echo in `name`'s namespace), on a connection set up beforehand."""
        with self._peer(name, _ECHO) as (conn, _):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for _ in range(count):
                began = time.perf_counter()
                conn.sendall(b"x")
                conn.recv(1)
                times.append((time.perf_counter() - began) * 1000)
        return sorted(times)[count // 2]

    def mbit_per_s(self, name: str, seconds: float = 1.0) -> float:
        """Bulk TCP throughput from the operator to `name`: a sink in `name`'s namespace counts what
        arrives between its first byte and the sender's close."""
        with self._peer(name, _SINK) as (conn, sink):
            chunk = bytes(1 << 16)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                conn.sendall(chunk)
            conn.shutdown(socket.SHUT_WR)
            received = json.loads(sink.stdout.readline())
        return received["bytes"] * 8 / received["seconds"] / 1e6

    @contextlib.contextmanager
    def capture(self, path: Path) -> Iterator[Path]:
        """Every frame crossing the bridge, as tcpdump writes them (pcap) to `path`, from when it
        listens to the end of the block. (A promiscuous bridge passes each frame it forwards up
        to its own interface too, where tcpdump sees it.)"""
        argv = ["ip", "netns", "exec", self.switch, "tcpdump", "-i", self.bridge, "-n", "-U", "-s", "0"]
        dump = subprocess.Popen([*argv, "-w", str(path)], stderr=subprocess.PIPE, text=True)
        try:
            said = dump.stderr.readline()  # "listening on <bridge>, ..." once frames are taken
            if "listening on" not in said:
                raise RuntimeError(f"tcpdump on {self.bridge} did not start: {said.strip()}{dump.stderr.read()}")
            yield path
        finally:
            dump.terminate()  # tcpdump writes what it holds and exits
            dump.wait(10)

    def send_in_clear(self, src: str, dst: str, payload: bytes) -> None:
        """One UDP datagram of `payload` from `src` to `dst` (nothing need listen): bytes known to
        cross the bridge in clear."""
        argv = [sys.executable, "-c", _DATAGRAM, payload.hex(), self.hosts[dst].address]
        sh("ip", "netns", "exec", self.hosts[src].netns, *argv)

    @contextlib.contextmanager
    def _peer(self, name: str, program: str):
        """A connection from the operator to `program` run in `name`'s namespace (it prints the
        port it listens on first)."""
        host = self.hosts[name]
        peer = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, sys.executable, "-c", program, host.address],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            port = int(peer.stdout.readline())
            with socket.create_connection((host.address, port), timeout=10) as conn:
                conn.settimeout(30)
                yield conn, peer
        finally:
            peer.kill()
            peer.wait()


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
print(json.dumps({"bytes": received, "seconds": time.monotonic() - first}), flush=True)
"""

# One UDP datagram: the payload (hex) to the address, port 9 (discard).
_DATAGRAM = """
import socket, sys
socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(bytes.fromhex(sys.argv[1]), (sys.argv[2], 9))
"""

# A TCP echo of one connection: prints its port, then sends back what arrives.
_ECHO = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while data := conn.recv(1 << 16):
    conn.sendall(data)
"""
