"""Where the stack's processes run: all on loopback (`Loopback`), or each on a host of its own
(`Cluster`), a Linux network namespace with its own address on a bridge, as a real deployment
places them on machines.

A cluster is a switch (a namespace of its own holding a bridge), one namespace per process,
Kafka and Redis included, each joined to the bridge by a veth pair whose inner end is `eth0`,
and a link from the machine's own namespace (the operator's host: the supervisor, the CLI and
tests reach the stack from its address, `.1`). The bridge is kept out of the machine's own
namespace because there its frames would pass the machine's firewall (br_netfilter): Docker's
FORWARD policy of drop, for one, cuts every host off from every other. Every
process binds and advertises its host's address on the ports docker compose and deploy/k8s
use (HTTP 8080, gRPC 50051, Kafka 9092, Redis 6379, the object store's S3 7070), and nothing listens on a host's loopback
(up only because Linux routes a host's traffic to its own address through it): a path that
would fall back to 127.0.0.1 is refused at once instead of working by accident.

The subnet is `TRILLIUM_CLUSTER_SUBNET` (default 10.250.0.0/24): it must be free on this
machine, since its route is the bridge's. Namespaces and links are named from a digest of the
run directory, so a cluster's leftovers (a supervisor killed with -9) are found and removed by
the next start. Creating one needs root (CAP_NET_ADMIN).

Faults and link costs (`links.py`: partitions, loss, bandwidth caps) act in the switch, on each
host's bridge-side interface (`Host.veth`). Added latency needs more, since this kernel has no netem:
with `link_delay`, every host runs scripts/linkdelay, and an nftables rule in its namespace
sends every TCP connection that arrives on its interface through it (the delay is 0 until set).
With `clock_jumps`, each service's wall clock can be moved (`clocks.py`). All of it is test and
benchmark support (tests/cluster/, bench/cluster.py, bench/nemesis.py), never used by a service.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import clocks
from .procs import LauncherError, free_port, port_free

ENV_CLUSTER_SUBNET = "TRILLIUM_CLUSTER_SUBNET"
DEFAULT_SUBNET = "10.250.0.0/24"
# The ports every host uses, as docker-compose.yml and deploy/k8s do.
HTTP_PORT = 8080
GRPC_PORT = 50051
KAFKA_PORT = 9092
KAFKA_CONTROLLER_PORT = 9093
REDIS_PORT = 6379
STORE_PORT = 7070  # the object store's S3 endpoint (object_store.py), versitygw's default
# The name of a host's interface on the bridge, inside its namespace (GLOO_SOCKET_IFNAME).
HOST_IFNAME = "eth0"
# scripts/linkdelay on each host (`link_delay`): where redirected connections arrive, its control.
LINKDELAY_PORT = 15000
LINKDELAY_CONTROL_PORT = 15001
# The mark (and routing table) of linkdelay's upstream connections, whose source ports lie above
# Linux's ephemeral range: every client's must end below them (EPHEMERAL_PORTS_BELOW).
LINKDELAY_MARK = 1
EPHEMERAL_PORTS_BELOW = 61000
ENV_LINKDELAY = "TRILLIUM_LINKDELAY"
DEFAULT_LINKDELAY = Path(__file__).resolve().parents[2] / ".cache" / "bin" / "linkdelay"


@dataclass(frozen=True)
class Host:
    """One host of a cluster: the process it runs, its namespace, its address, and the bridge
    side of its link (where tc and nftables act on its traffic)."""

    name: str
    netns: str
    address: str
    veth: str


class Loopback:
    """Every process on 127.0.0.1, each on a free port remembered per run directory."""

    def __init__(self, ports: dict[str, int], save: Callable[[dict[str, int]], None]) -> None:
        self.ports = {k: v for k, v in ports.items() if port_free(v)}
        self._save = save

    def address(self, name: str) -> str:
        return "127.0.0.1"

    def exec_prefix(self, name: str) -> list[str]:
        return []

    def env(self, name: str) -> dict[str, str]:
        return {}

    def port(self, name: str, kind: str) -> int:
        key = f"{name}.{kind}" if kind not in ("kafka", "kafka_controller", "redis") else kind
        if key not in self.ports:
            taken = set(self.ports.values())
            port = free_port()
            while port in taken:
                port = free_port()
            self.ports[key] = port
            self._save(self.ports)
        return self.ports[key]

    def public(self) -> dict[str, Any] | None:
        return None

    def create(self) -> None:
        pass

    def destroy(self) -> None:
        pass


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise LauncherError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done


def _check_ephemeral_ports() -> None:
    """This machine's clients (the supervisor, the CLI, tests) reach the hosts through linkdelay
    too: their source ports must stay below the ones its upstream connections take. A namespace
    the cluster creates starts with Linux's default range, which does."""
    path = Path("/proc/sys/net/ipv4/ip_local_port_range")
    high = int(path.read_text().split()[1])
    if high >= EPHEMERAL_PORTS_BELOW:
        raise LauncherError(
            f"link_delay needs this machine's ephemeral ports below {EPHEMERAL_PORTS_BELOW} "
            f"(net.ipv4.ip_local_port_range ends at {high}), where linkdelay's own connections start"
        )


class Cluster:
    """Each process on a host of its own (see the module's docstring)."""

    def __init__(
        self,
        run_dir: Path,
        names: list[str],
        subnet: str | None = None,
        link_delay: bool = False,
        clock_jumps: bool = False,
    ) -> None:
        self.run_dir = run_dir
        self.logs = run_dir / "logs"
        self.link_delay = link_delay
        self.clock_jumps = clock_jumps
        if clock_jumps:
            clocks.library()  # built, or a LauncherError saying how
        self.linkdelay = Path(os.environ.get(ENV_LINKDELAY, DEFAULT_LINKDELAY))
        if link_delay and not os.access(self.linkdelay, os.X_OK):
            raise LauncherError(
                f"link_delay needs scripts/linkdelay built at {self.linkdelay} "
                f"(`make .cache/bin/linkdelay`, or set {ENV_LINKDELAY})"
            )
        if link_delay:
            _check_ephemeral_ports()
        subnet = subnet or os.environ.get(ENV_CLUSTER_SUBNET, DEFAULT_SUBNET)
        try:
            self.subnet = ipaddress.ip_network(subnet)
        except ValueError as err:
            raise LauncherError(f"{ENV_CLUSTER_SUBNET}={subnet!r}: {err}") from None
        if self.subnet.version != 4 or self.subnet.num_addresses < len(names) + 4:
            raise LauncherError(f"{ENV_CLUSTER_SUBNET}={subnet!r}: an IPv4 subnet with room for {len(names)} hosts")
        # Interface names hold 15 bytes: "trl" + 5 hex digits + a suffix of up to 7.
        self.tag = "trl" + hashlib.sha1(str(run_dir.absolute()).encode()).hexdigest()[:5]
        self.bridge = f"{self.tag}br"
        self.switch = f"{self.tag}-switch"
        self.uplink = f"{self.tag}up"  # the operator's end of its link to the switch
        addresses = list(self.subnet.hosts())
        self.gateway = str(addresses[0])  # the bridge's own: the operator's host
        self.hosts = {
            name: Host(name, f"{self.tag}-{name}", str(addresses[i + 9]), f"{self.tag}v{i}")
            for i, name in enumerate(names)
        }

    # ---- placement (what the supervisor asks) ----
    def address(self, name: str) -> str:
        return self.hosts[name].address

    def exec_prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[name].netns]

    def env(self, name: str) -> dict[str, str]:
        # torch.distributed's gloo binds its pairs to this interface (else: the host name's address).
        out = {"GLOO_SOCKET_IFNAME": HOST_IFNAME}
        return out | clocks.env(self.run_dir, name) if self.clock_jumps else out

    def port(self, name: str, kind: str) -> int:
        return {
            "http": HTTP_PORT,
            "grpc": GRPC_PORT,
            "kafka": KAFKA_PORT,
            "kafka_controller": KAFKA_CONTROLLER_PORT,
            "redis": REDIS_PORT,
            "s3": STORE_PORT,
        }[kind]

    def public(self) -> dict[str, Any]:
        return {
            "subnet": str(self.subnet),
            "bridge": self.bridge,
            "switch": self.switch,
            "gateway": self.gateway,
            "link_delay": self.link_delay,
            "clock_jumps": self.clock_jumps,
            "hosts": {name: asdict(h) for name, h in self.hosts.items()},
        }

    # ---- the network ----
    def create(self) -> None:
        """The bridge, then each host's namespace and link; leftovers of this run directory's
        last cluster are removed first. Raises LauncherError naming the command that failed."""
        if os.geteuid() != 0:
            raise LauncherError("a cluster of hosts needs root (network namespaces, veth, a bridge)")
        self.destroy()
        for line in _ip("-4", "-o", "addr", "show").stdout.splitlines():
            address = ipaddress.ip_interface(line.split()[3])
            if address.network.overlaps(self.subnet):
                raise LauncherError(
                    f"the cluster's subnet {self.subnet} overlaps {address} on {line.split()[1]}: "
                    f"set {ENV_CLUSTER_SUBNET} to a free one"
                )
        _ip("netns", "add", self.switch)
        _ip("link", "add", self.bridge, "type", "bridge", netns=self.switch)
        _ip("link", "set", self.bridge, "up", netns=self.switch)
        peer = f"{self.uplink}p"
        _ip("link", "add", self.uplink, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", self.switch)
        _ip("link", "set", peer, "master", self.bridge, netns=self.switch)
        _ip("link", "set", peer, "up", netns=self.switch)
        _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.uplink)
        _ip("link", "set", self.uplink, "up")
        for host in self.hosts.values():
            join_bridge(host, self.switch, self.bridge, self.subnet.prefixlen)
            if self.link_delay:
                self._delay_ingress(host)

    def _delay_ingress(self, host: Host) -> None:
        """Start linkdelay on `host` and send every TCP connection arriving on its interface
        through it (but those to linkdelay itself)."""
        rules = (
            "table ip trillium_linkdelay {\n"
            "  chain prerouting {\n"
            "    type nat hook prerouting priority dstnat; policy accept;\n"
            f'    iifname "{HOST_IFNAME}" ip daddr {host.address} '
            f"tcp dport != {{ {LINKDELAY_PORT}, {LINKDELAY_CONTROL_PORT} }} redirect to :{LINKDELAY_PORT}\n"
            "  }\n"
            "}\n"
        )
        done = subprocess.run(
            ["ip", "netns", "exec", host.netns, "nft", "-f", "-"], input=rules, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise LauncherError(f"nftables in {host.netns}: {done.stderr.strip()}")
        # linkdelay dials from the client's address (a server sees its callers' addresses, as
        # across a wire) and marks its connections: the server's sockets take the mark of the
        # SYN they accept, and marked packets route to this host's loopback, where linkdelay's
        # socket holds the client's address, instead of out to the client's host.
        sysctl = ["ip", "netns", "exec", host.netns, "sysctl", "-q", "-w", "net.ipv4.tcp_fwmark_accept=1"]
        subprocess.run(sysctl, check=True, capture_output=True)
        mark = str(LINKDELAY_MARK)
        _ip("rule", "add", "fwmark", mark, "lookup", mark, "priority", "100", netns=host.netns)
        _ip("route", "add", "local", "0.0.0.0/0", "dev", "lo", "table", mark, netns=host.netns)
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"linkdelay-{host.name}.log", "ab") as logfile:
            subprocess.Popen(
                [
                    *self.exec_prefix(host.name),
                    str(self.linkdelay),
                    "-listen",
                    f"{host.address}:{LINKDELAY_PORT}",
                    "-control",
                    f"{host.address}:{LINKDELAY_CONTROL_PORT}",
                ],
                stdout=logfile,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def destroy(self) -> None:
        """Remove every namespace and link of this run directory's cluster (idempotent), with any
        process still in a namespace (linkdelay, or a killed supervisor's children)."""
        for ns in _ip("netns", "list", check=False).stdout.splitlines():
            name = ns.split()[0] if ns.strip() else ""
            if name.startswith(f"{self.tag}-"):
                for pid in _ip("netns", "pids", name, check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                _ip("netns", "delete", name, check=False)  # takes its ends of the veth pairs along
        if _ip("link", "show", self.uplink, check=False).returncode == 0:
            _ip("link", "delete", self.uplink, check=False)


def join_bridge(host: Host, switch: str, bridge: str, prefixlen: int) -> None:
    """Make `host`: its namespace, and a veth pair from it (`eth0`, with its address) to the
    bridge in the switch's namespace."""
    peer = f"{host.veth}p"
    _ip("netns", "add", host.netns)
    _ip("link", "add", host.veth, "type", "veth", "peer", "name", peer)
    _ip("link", "set", peer, "netns", host.netns)
    _ip("link", "set", peer, "name", HOST_IFNAME, netns=host.netns)
    _ip("addr", "add", f"{host.address}/{prefixlen}", "dev", HOST_IFNAME, netns=host.netns)
    _ip("link", "set", HOST_IFNAME, "up", netns=host.netns)
    _ip("link", "set", "lo", "up", netns=host.netns)
    _ip("link", "set", host.veth, "netns", switch)
    _ip("link", "set", host.veth, "master", bridge, netns=switch)
    _ip("link", "set", host.veth, "up", netns=switch)
