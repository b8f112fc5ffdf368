"""What the security tests' real services run with (test_grpc_auth.py, test_rest_tls.py): the
stack's token, and TLS files made with openssl: a CA and a server certificate it signed."""

from __future__ import annotations

import subprocess
from pathlib import Path

from trillium.config import GrpcTls

TOKEN = "the-stack-token-0123456789"  # the stack token the services under test are started with


def tls_files(directory: Path) -> GrpcTls:
    """A CA, and a server certificate it signed for 127.0.0.1 (the address the test dials)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=directory)

    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=trillium-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    )
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=embedding-ps",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    )
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        "-out",
        "server.pem",
    )
    return GrpcTls(cert_file=directory / "server.pem", key_file=directory / "server.key", ca_file=directory / "ca.pem")
