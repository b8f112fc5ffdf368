"""The cluster as a deployment: every process on its own host, addressed as compose and
deploy/k8s address them, no path between hosts over loopback, and each link's cost measured."""

from __future__ import annotations

import ipaddress
import json

import pytest
from timeline import assert_exactly_once, cluster_job

from trillium import stack
from trillium.stack.client import CoordinatorClient
from trillium.stack.links import Network, sh

pytestmark = pytest.mark.cluster


def _address(endpoint: str) -> str:
    """The IP address of an `ss` endpoint: `10.0.0.1:80`, or a JVM's `[::ffff:10.0.0.1]:80`."""
    ip = ipaddress.ip_address(endpoint.rsplit(":", 1)[0].strip("[]"))
    return str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip)


def _sockets(netns: str, *query: str) -> list[tuple[str, str]]:
    """The (local, peer) addresses of the TCP sockets `ss` lists in a namespace."""
    out = sh("ip", "netns", "exec", netns, "ss", "-Htn", *query)
    return [(_address(line.split()[-2]), line.split()[-1]) for line in out.splitlines()]


def _connections(netns: str) -> list[tuple[str, str]]:
    """The (local, peer) addresses of every established TCP connection in a namespace."""
    return [(local, _address(peer)) for local, peer in _sockets(netns, "state", "established")]


def test_every_process_runs_on_a_host_of_its_own_and_nothing_crosses_loopback(cluster, network: Network) -> None:
    st = stack.read_state(cluster)
    subnet = ipaddress.ip_network(st["hosts"]["subnet"])
    names = {p["name"] for p in st["processes"]}
    assert set(network.hosts) == names and "kafka" in names and "redis" in names
    assert len({h.address for h in network.hosts.values()}) == len(names), "two processes share a host"
    for host in network.hosts.values():
        # Each listens on its host's address alone: a path that fell back to 127.0.0.1 (or
        # reached a peer through an all-interfaces socket) would find nothing there.
        listeners = _sockets(host.netns, "state", "listening")
        assert listeners and all(local == host.address for local, _ in listeners), (host, listeners)
    assert st["kafka"]["bootstrap"] == f"{network.host('kafka').address}:9092"
    redis_url = f"{'rediss' if st['tls'] else 'redis'}://{network.host('redis').address}:6379/0"
    assert st["redis"]["url"].partition("?")[0] == redis_url
    scheme = "https" if st["tls"] else "http"
    client = CoordinatorClient.for_stack(cluster)
    try:
        for worker in client.workers():
            host = network.host(worker["name"])
            assert worker["http_url"] == f"{scheme}://{host.address}:8080", worker
            if worker["grpc_address"]:
                assert worker["grpc_address"] == f"{host.address}:50051", worker
        job = cluster_job(epochs=4)
        job_id = client.submit(job)["id"]
        # While it trains, every connection of every host is between two hosts' addresses.
        seen: set[tuple[str, str]] = set()
        served: set[tuple[str, str]] = set()  # (a gRPC server's host, the address its callers come from)
        while client.job(job_id)["job"]["state"] not in ("finished", "failed", "stopped"):
            for host in network.hosts.values():
                seen.update((host.name, peer) for local, peer in _connections(host.netns) if local == host.address)
                grpc_served = _sockets(host.netns, "state", "established", "sport", "=", ":50051")
                served.update((host.name, _address(peer)) for _, peer in grpc_served)
                for local, peer in _connections(host.netns):
                    assert ipaddress.ip_address(local) in subnet and ipaddress.ip_address(peer) in subnet, (
                        host.name,
                        local,
                        peer,
                    )
        view = client.follow(job_id, timeout_s=300)
    finally:
        client.close()
    assert view["job"]["state"] == "finished", view["job"]["error"]
    assert_exactly_once(view, job)
    by_address = {h.address: h.name for h in network.hosts.values()}
    peers = {(a, by_address.get(p, "operator")) for a, p in seen}
    # The data plane crossed the bridge: lookups (worker -> PS), gradients (Kafka), the feed.
    assert ("embedding_worker-0", "embedding_ps-1") in peers or ("embedding_ps-1", "embedding_worker-0") in peers
    assert ("nn_worker-1", "kafka") in peers and ("data_loader-0", "kafka") in peers
    # A server sees its callers' own addresses, linkdelay between them or not (as across a wire,
    # and as the coordinator's check of a registration's host needs).
    worker = network.host("embedding_worker-0").address
    assert ("embedding_ps-1", worker) in served, served


def test_each_link_reports_the_rtt_and_bandwidth_measured_on_it(network: Network) -> None:
    links = {
        name: {"rtt_ms": round(network.rtt_ms(name), 3), "mbit_per_s": round(network.mbit_per_s(name, 0.5))}
        for name in ("embedding_ps-0", "kafka")
    }
    network.cap("embedding_ps-0", 10)
    try:
        capped = network.mbit_per_s("embedding_ps-0", 2.0)
    finally:
        network.heal()
    print("\nlinks (operator -> host):", json.dumps(links), f"capped at 10 Mbit/s: {capped:.1f} Mbit/s")
    for link in links.values():
        assert 0 < link["rtt_ms"] < 5 and link["mbit_per_s"] > 100
    assert 7 < capped <= 10.5  # the token bucket holds what it asked for, within TCP's slack


def test_added_latency_lengthens_every_round_trip_and_the_job_still_trains_exactly(cluster, network: Network) -> None:
    """linkdelay on every host (no netem here): the round trip measured through it is what was
    asked, on the path the stack's own connections take, and a job trains across it."""
    base = network.rtt_ms("embedding_ps-0")
    network.round_trip(10.0)
    try:
        delayed = {name: round(network.rtt_ms(name), 2) for name in ("embedding_ps-0", "kafka", "coordinator-0")}
        print(f"\nround trips with 10 ms added (operator -> host): {json.dumps(delayed)}; without: {base:.3f} ms")
        # A round trip holds each way's 5 ms, plus the bridge's and the relay's (under 2 ms here).
        assert all(10.0 <= rtt < 12.0 for rtt in delayed.values()), delayed
        client = CoordinatorClient.for_stack(cluster)
        try:
            job = cluster_job(epochs=2)
            view = client.follow(client.submit(job)["id"], timeout_s=300)
        finally:
            client.close()
        assert view["job"]["state"] == "finished", view["job"]["error"]
        assert view["job"]["recoveries"] == [], view["job"]["recoveries"]
        assert_exactly_once(view, job)
    finally:
        network.heal()
    assert network.rtt_ms("embedding_ps-0") < 2.0, "the delay outlived the heal"
