"""Across hosts, with TLS (the cluster runs `trillium up --tls`), no secret crosses the network in
clear: a capture of every frame on the bridge while a job trains, while a host logs in to Redis and
to Kafka anew and the operator calls the API, holds the token, Redis's password and Kafka's in no
TCP stream and nowhere else, while every connection opened to a service's HTTP or gRPC port, to
Redis or to Kafka began with a TLS handshake; a marker sent in clear between two hosts is in it
(the capture does see payloads: were it not found, the test fails waiting for it)."""

from __future__ import annotations

import secrets
import socket
import struct
import subprocess
import sys

import pytest
from timeline import cluster_job
from waiting import wait_until

from trillium import stack
from trillium.config import ENV_KAFKA_BOOTSTRAP
from trillium.scopes import SCOPES
from trillium.stack import tls
from trillium.stack.client import CoordinatorClient
from trillium.stack.hosts import GRPC_PORT, HTTP_PORT, KAFKA_PORT, REDIS_PORT
from trillium.stack.links import Network

pytestmark = pytest.mark.cluster

# A host's fresh logins, as a restarted process makes them: Redis (AUTH) and Kafka (SASL/SCRAM).
LOGINS = """
import asyncio, os
from trillium.config import KafkaConnection
from trillium.wire.kafka import wait_for_kafka
from trillium.wire.state import wait_for_redis

async def main():
    await wait_for_redis(os.environ["TRILLIUM_REDIS_URL"], timeout_s=30)
    await wait_for_kafka(KafkaConnection.from_env(), timeout_s=30)

asyncio.run(main())
"""

TLS_HANDSHAKE = b"\x16\x03"  # a TLS record of the handshake type (a ClientHello, first on a connection)


def tcp_streams(pcap: bytes) -> tuple[dict[tuple[str, int, str, int], bytes], set[tuple[str, int, str, int]]]:
    """Each TCP direction's payload in capture order, keyed (source, port, destination, port), and
    the directions whose connection opened in the capture (a SYN seen). A segment sent twice
    appears twice: a repeat hides no byte."""
    endian = "<" if pcap[:4] in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1") else ">"
    assert struct.unpack(endian + "I", pcap[20:24])[0] == 1, "not an Ethernet capture"
    streams: dict[tuple[str, int, str, int], bytearray] = {}
    opened: set[tuple[str, int, str, int]] = set()
    offset = 24
    while offset + 16 <= len(pcap):
        captured = struct.unpack(endian + "I", pcap[offset + 8 : offset + 12])[0]
        frame = pcap[offset + 16 : offset + 16 + captured]
        offset += 16 + captured
        if len(frame) < 14 + 20 or frame[12:14] != b"\x08\x00" or frame[14 + 9] != 6:
            continue  # IPv4 and TCP only
        ip = frame[14:]
        total = struct.unpack("!H", ip[2:4])[0]
        segment = ip[(ip[0] & 0x0F) * 4 : total]
        source_port, destination_port = struct.unpack("!HH", segment[:4])
        key = (socket.inet_ntoa(ip[12:16]), source_port, socket.inet_ntoa(ip[16:20]), destination_port)
        flags = segment[13]
        if flags & 0x02 and not flags & 0x10:  # SYN without ACK: the client opened it
            opened.add(key)
        if payload := segment[(segment[12] >> 4) * 4 :]:
            streams.setdefault(key, bytearray()).extend(payload)
    return {key: bytes(data) for key, data in streams.items()}, opened


def test_no_secret_crosses_the_network_in_clear(cluster, network: Network, tmp_path) -> None:
    state = stack.read_state(cluster)
    stack_tls = tls.load(state)
    assert stack_tls is not None, "the cluster runs with TLS"
    hidden = {
        **{f"the {scope} token": stack.read_token(cluster, scope) for scope in SCOPES},
        "Redis's password": stack_tls.redis_password,
        "Kafka's password": stack_tls.kafka_password,
    }
    marker = secrets.token_hex(16).encode()
    serving = network.host("serving-0")
    logins = tls.process_env(state, serving.name, serving.address) | {ENV_KAFKA_BOOTSTRAP: state["kafka"]["bootstrap"]}
    pcap = tmp_path / "bridge.pcap"
    with network.capture(pcap):
        client = CoordinatorClient.for_stack(cluster)
        try:
            view = client.follow(client.submit(cluster_job(1))["id"], timeout_s=300)
        finally:
            client.close()
        subprocess.run(
            ["ip", "netns", "exec", serving.netns, sys.executable, "-c", LOGINS],
            env=logins | {"PATH": "/usr/bin:/bin"},
            check=True,
            timeout=120,
        )
        network.send_in_clear("serving-0", "redis", marker)
        # The capture is stopped only once the marker is in its file: tcpdump writes each frame
        # as it reads it (-U), and what the kernel still held when it stopped would be lost.
        wait_until(lambda: marker in pcap.read_bytes(), "the marker in the capture", 30)
    assert view["job"]["state"] == "finished", view["job"]["error"]

    raw = pcap.read_bytes()
    streams, opened = tcp_streams(raw)
    for what, secret in hidden.items():
        assert secret.encode() not in raw, f"{what} crossed the bridge in clear"
        leaks = [key for key, data in streams.items() if secret.encode() in data]
        assert not leaks, f"{what} crossed the bridge in clear, in {leaks}"
    ports = {HTTP_PORT: "HTTP", GRPC_PORT: "gRPC", REDIS_PORT: "Redis", KAFKA_PORT: "Kafka"}
    began = {port: [streams.get(key, b"")[:2] for key in opened if key[3] == port] for port in ports}
    for port, name in ports.items():
        plain = [first for first in began[port] if first and first != TLS_HANDSHAKE]
        assert not plain, f"connections to {name} (port {port}) began without TLS: {plain[:3]}"
    # The job, the logins and the operator's calls opened connections to each of these anew.
    for port in (HTTP_PORT, REDIS_PORT, KAFKA_PORT):
        assert TLS_HANDSHAKE in began[port], f"no new {ports[port]} connection in the capture"
