"""A stack whose traffic may cross a network (`trillium up --tls`): every byte between its hosts
encrypted and every peer checked, as a deployment across machines must be.

On the first start the launcher makes, in `<run-dir>/tls/` (keys and secrets mode 0600):
- a CA, and for each host a certificate it signed naming the host's address and name (a peer is
  dialled at the address it registers), which every service serves on its HTTP and gRPC ports and
  checks its peers' against (`TRILLIUM_GRPC_TLS_*`);
- Redis's password, and Redis served over TLS only (`rediss://`, its plain port closed);
- Kafka's user and password: the broker takes SASL/SCRAM-SHA-512 over TLS (SASL_SSL) only, its
  controller only the broker itself, by its certificate (mutual TLS).
The token, the passwords and the data cross the bridge as TLS records only
(tests/cluster/test_tls_capture.py captures the bridge to check it). The object store, when there is
one, stays plain HTTP: S3's signatures keep its keys off the wire, not its objects.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trillium.config import (
    ENV_GRPC_TLS_CA,
    ENV_GRPC_TLS_CERT,
    ENV_GRPC_TLS_KEY,
    ENV_KAFKA_CA_FILE,
    ENV_KAFKA_PASSWORD,
    ENV_KAFKA_SASL_MECHANISM,
    ENV_KAFKA_SECURITY_PROTOCOL,
    ENV_KAFKA_USERNAME,
    ENV_REDIS_URL,
    KafkaConnection,
)

from .procs import LauncherError, write_private

KAFKA_USER = "trillium"
KAFKA_MECHANISM = "SCRAM-SHA-512"
CERT_DAYS = 365


def openssl(*args: str) -> None:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise LauncherError(f"openssl {args[0]} failed making the stack's certificates: {done.stderr.strip()[-500:]}")


def _request(key: list[str], name: str) -> list[str]:
    """`openssl req` making a key and its certificate for `name` (self-signed unless -CA follows)."""
    return ["req", "-x509", *key, "-days", str(CERT_DAYS), "-subj", f"/CN={name}"]


@dataclass(frozen=True)
class StackTls:
    """The files of `<run-dir>/tls/` and the passwords they hold."""

    directory: Path
    redis_password: str
    kafka_password: str

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    def cert_file(self, host: str) -> Path:
        return self.directory / f"{host}.pem"

    def key_file(self, host: str) -> Path:
        return self.directory / f"{host}.key"

    def keystore(self, host: str) -> Path:
        """The host's key and certificate in one PEM file, as Kafka's PEM keystore reads them."""
        return self.directory / f"{host}.keystore.pem"

    def service_env(self, host: str) -> dict[str, str]:
        """A service's TLS (every listener and every client of it) and its Kafka login."""
        return {
            ENV_GRPC_TLS_CERT: str(self.cert_file(host)),
            ENV_GRPC_TLS_KEY: str(self.key_file(host)),
            ENV_GRPC_TLS_CA: str(self.ca_file),
            ENV_KAFKA_SECURITY_PROTOCOL: "SASL_SSL",
            ENV_KAFKA_SASL_MECHANISM: KAFKA_MECHANISM,
            ENV_KAFKA_USERNAME: KAFKA_USER,
            ENV_KAFKA_PASSWORD: self.kafka_password,
            ENV_KAFKA_CA_FILE: str(self.ca_file),
        }

    def kafka_connection(self, bootstrap: str) -> KafkaConnection:
        return KafkaConnection(
            bootstrap=bootstrap,
            security_protocol="SASL_SSL",
            sasl_mechanism=KAFKA_MECHANISM,
            username=KAFKA_USER,
            password=self.kafka_password,
            ca_file=self.ca_file,
        )

    def redis_url(self, address: str, port: int) -> str:
        return f"rediss://:{self.redis_password}@{address}:{port}/0?ssl_ca_certs={self.ca_file}"

    def with_password(self, public_redis_url: str) -> str:
        """The stack state's Redis URL (which shows no password) with it."""
        return public_redis_url.replace("rediss://", f"rediss://:{self.redis_password}@", 1)

    def secrets(self) -> list[str]:
        """What must never appear in a log or on the wire."""
        return [self.redis_password, self.kafka_password]


def ensure(run_dir: Path, hosts: dict[str, str]) -> StackTls:
    """The stack's CA, passwords and a certificate per host (name -> address), made where missing:
    a restarted stack keeps them, a host new to it gets its certificate."""
    directory = run_dir / "tls"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    passwords = directory / "passwords.json"
    if not passwords.exists():
        write_private(passwords, json.dumps({"redis": secrets.token_urlsafe(24), "kafka": secrets.token_urlsafe(24)}))
    saved = json.loads(passwords.read_text())
    tls = StackTls(directory, redis_password=saved["redis"], kafka_password=saved["kafka"])
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    if not tls.ca_file.exists():
        ca_key = directory / "ca.key"
        openssl(*_request(curve, "trillium-stack-ca"), "-keyout", str(ca_key), "-out", str(tls.ca_file))
    for host, address in hosts.items():
        if tls.keystore(host).exists():
            continue
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            key, cert = Path(scratch) / "key.pem", Path(scratch) / "cert.pem"
            signed = ["-CA", str(tls.ca_file), "-CAkey", str(directory / "ca.key")]
            names = [f"subjectAltName=IP:{address},DNS:{host}", "basicConstraints=critical,CA:FALSE"]
            names.append("extendedKeyUsage=serverAuth,clientAuth")
            extensions = [arg for name in names for arg in ("-addext", name)]
            openssl(*_request(curve, host), *signed, *extensions, "-keyout", str(key), "-out", str(cert))
            write_private(tls.key_file(host), key.read_text())
            tls.cert_file(host).write_text(cert.read_text())
            write_private(tls.keystore(host), key.read_text() + cert.read_text())  # last: it marks the host done
    return tls


def load(state: dict) -> StackTls | None:
    """A running stack's TLS, from its state (for its clients: the CLI, tests); None when it runs without."""
    if not state.get("tls"):
        return None
    run_dir = Path(state["run_dir"])
    saved = json.loads((run_dir / "tls" / "passwords.json").read_text())
    return StackTls(run_dir / "tls", redis_password=saved["redis"], kafka_password=saved["kafka"])


def process_env(state: dict, host: str, address: str) -> dict[str, str]:
    """What a process started by hand on a new host (an operator's replacement) needs on top of
    the stack's endpoints to join a stack with TLS: its certificate, made now, Kafka's login and
    Redis's URL with the password. {} for a stack without TLS."""
    if not state.get("tls"):
        return {}
    stack_tls = ensure(Path(state["run_dir"]), {host: address})
    return stack_tls.service_env(host) | {ENV_REDIS_URL: stack_tls.with_password(state["redis"]["url"])}
