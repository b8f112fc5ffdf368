"""With TLS configured, a service's HTTP port speaks only TLS, with the certificate its peers
check against the stack's CA, and the token crosses loopback in no readable byte: a capture of
every frame on `lo` during an authenticated call finds it nowhere (and finds it in a plaintext
call, so the capture does see payloads)."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from tls_files import TOKEN, tls_files
from unconnected import unconnected_settings

from trillium.config import (
    ENV_COORDINATOR_URL,
    ENV_GRPC_TLS_CA,
    ENV_GRPC_TLS_CERT,
    ENV_GRPC_TLS_KEY,
    ENV_KAFKA_BOOTSTRAP,
    ENV_OPERATE_DIGEST,
    ENV_REDIS_URL,
    ENV_RUN_DIR,
    ENV_TOKEN,
)
from trillium.scopes import token_digest
from trillium.services.embedding_ps.server import EmbeddingPS
from trillium.stack.procs import free_port

ETH_P_ALL = 0x0003


OPERATOR = "an-operators-token-0123456789"  # /status takes a reader's token: an operator's


@pytest.fixture(scope="module")
def tls_ps(infra, tmp_path_factory):
    """A real embedding_ps with TLS on: its HTTP port, and the CA that signed its certificate."""
    run_dir = tmp_path_factory.mktemp("rest-tls")
    tls = tls_files(run_dir)
    http_port, grpc_port = free_port(), free_port()
    env = os.environ | {
        ENV_KAFKA_BOOTSTRAP: infra.kafka_bootstrap,
        ENV_REDIS_URL: infra.redis_database(5),
        ENV_COORDINATOR_URL: f"https://127.0.0.1:{free_port()}",
        ENV_TOKEN: TOKEN,
        ENV_OPERATE_DIGEST: token_digest(OPERATOR),
        ENV_RUN_DIR: str(run_dir),
        ENV_GRPC_TLS_CERT: str(tls.cert_file),
        ENV_GRPC_TLS_KEY: str(tls.key_file),
        ENV_GRPC_TLS_CA: str(tls.ca_file),
    }
    argv = [sys.executable, "-m", "trillium.services.embedding_ps", "--index", "4"]
    argv += ["--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ca = ssl.create_default_context(cafile=str(tls.ca_file))
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, f"embedding_ps exited with {proc.returncode}"
        try:
            if httpx.get(f"https://127.0.0.1:{http_port}/readyz", verify=ca).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "embedding_ps not ready in 60 s"
        time.sleep(0.2)
    yield http_port, ca
    proc.terminate()
    proc.wait(30)


def test_the_http_port_speaks_only_tls_with_a_certificate_the_ca_signed(tls_ps) -> None:
    port, ca = tls_ps
    status = httpx.get(f"https://127.0.0.1:{port}/status", verify=ca, headers={"Authorization": f"Bearer {OPERATOR}"})
    assert status.status_code == 200 and status.json()["role"] == "embedding_ps"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/readyz")  # plaintext: no answer a client could read
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://127.0.0.1:{port}/readyz")  # the system's CAs did not sign it


class Capture:
    """Every frame on loopback while it runs (root: AF_PACKET)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.2)
        self.frames: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                self.frames.append(self.sock.recv(1 << 16))
            except TimeoutError:
                continue

    def stop(self) -> bytes:
        """Every frame sent while it ran: a frame on loopback is queued to this socket within the
        sender's call, so the ones the reader had not taken when told to stop are read here (it
        stops after the frame it is reading: on a busy machine the request's frame was still
        queued, and the control below failed)."""
        self._stop.set()
        self._thread.join(5)
        assert not self._thread.is_alive(), "the capture's reader did not stop"
        self.sock.setblocking(False)
        while True:
            try:
                self.frames.append(self.sock.recv(1 << 16))
            except BlockingIOError:
                break
        self.sock.close()
        return b"".join(self.frames)


def _plaintext_call(token: str) -> None:
    """A REST call with the token to a plain listener on loopback (the capture's control)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        threading.Thread(target=lambda: server.accept()[0].recv(4096), daemon=True).start()
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/status", headers={"Authorization": f"Bearer {token}"}, timeout=1)


@pytest.mark.skipif(os.geteuid() != 0, reason="capturing loopback frames needs root (AF_PACKET)")
def test_the_token_crosses_the_link_in_no_readable_byte(tls_ps) -> None:
    port, ca = tls_ps
    capture = Capture()
    for _ in range(3):
        r = httpx.get(f"https://127.0.0.1:{port}/status", verify=ca, headers={"Authorization": f"Bearer {OPERATOR}"})
        assert r.status_code == 200
    over_tls = capture.stop()
    assert len(over_tls) > 3000, "the capture saw no traffic"
    assert OPERATOR.encode() not in over_tls

    control = Capture()
    _plaintext_call(OPERATOR)
    assert OPERATOR.encode() in control.stop(), "the capture does not see payloads: it proves nothing"


async def test_a_service_registers_an_https_url_when_tls_is_on(tmp_path: Path) -> None:
    settings = unconnected_settings("embedding_ps").model_copy(update={"grpc_tls": tls_files(tmp_path)})
    ps = EmbeddingPS(settings)
    try:
        assert ps.registration()["http_url"].startswith("https://")
    finally:
        await ps.coordinator.aclose()
