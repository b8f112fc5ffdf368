"""The cluster's certificates and kubeconfigs, made on the first `up` in `<state>/pki/` (keys mode
0600): one CA that signs every serving and client certificate, as kubeadm lays them out, and the
service accounts' signing key. Each component authenticates to the API server by its certificate's
name (CN the user, O the group), which the cluster's RBAC then grants.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..procs import write_private
from ..tls import openssl

CERT_DAYS = 365
CURVE = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Identity:
    """A client certificate's subject: the user the API server sees, and its groups."""

    user: str
    groups: tuple[str, ...] = ()

    @property
    def subject(self) -> str:
        return f"/CN={self.user}" + "".join(f"/O={group}" for group in self.groups)


# Who each client is to the API server; the node's name goes into the kubelet's.
ADMIN = Identity("trillium-admin", ("system:masters",))
CONTROLLER_MANAGER = Identity("system:kube-controller-manager")
SCHEDULER = Identity("system:kube-scheduler")
KUBE_PROXY = Identity("system:kube-proxy")
NETWORK_POLICY = Identity("trillium:kube-router")  # granted by system.yaml's ClusterRole
APISERVER_KUBELET = Identity("kube-apiserver-kubelet-client", ("system:masters",))


def kubelet_identity(node: str) -> Identity:
    return Identity(f"system:node:{node}", ("system:nodes",))


@dataclass(frozen=True)
class Pki:
    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def service_account_key(self) -> Path:
        return self.directory / "sa.key"

    @property
    def service_account_pub(self) -> Path:
        return self.directory / "sa.pub"

    def cert(self, name: str) -> Path:
        return self.directory / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.directory / f"{name}.key"

    def kubeconfig(self, name: str) -> Path:
        return self.directory / f"{name}.kubeconfig"


def ensure(directory: Path, node: str, node_ip: str, service_ip: str, server: str) -> Pki:
    """Every certificate and kubeconfig the cluster's processes need, made where missing: the API
    server's names its every address (the node's, the `kubernetes` Service's, loopback's)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    pki = Pki(directory)
    if not pki.ca_cert.exists():
        _self_signed(pki, "trillium-k8s-ca")
    if not pki.service_account_pub.exists():
        openssl(
            "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(pki.service_account_key)
        )
        pki.service_account_key.chmod(0o600)
        openssl("pkey", "-in", str(pki.service_account_key), "-pubout", "-out", str(pki.service_account_pub))
    names = ["kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"]
    servers = {
        "apiserver": (
            Identity("kube-apiserver"),
            [f"IP:{node_ip}", f"IP:{service_ip}", "IP:127.0.0.1", "DNS:localhost"],
        ),
        "kubelet-serving": (Identity(node), [f"IP:{node_ip}", f"DNS:{node}"]),
    }
    servers["apiserver"][1].extend(f"DNS:{name}" for name in names)
    for name, (identity, alt_names) in servers.items():
        _signed(pki, name, identity, "serverAuth", alt_names)
    clients = {
        "admin": ADMIN,
        "controller-manager": CONTROLLER_MANAGER,
        "scheduler": SCHEDULER,
        "kube-proxy": KUBE_PROXY,
        "network-policy": NETWORK_POLICY,
        "kubelet": kubelet_identity(node),
        "apiserver-kubelet-client": APISERVER_KUBELET,
    }
    for name, identity in clients.items():
        _signed(pki, name, identity, "clientAuth", [])
        if name != "apiserver-kubelet-client":
            _write_kubeconfig(pki, name, server)
    return pki


def _request(subject: str) -> list[str]:
    """`openssl req` making a key and its certificate for `subject` (self-signed unless -CA follows)."""
    return ["req", "-x509", *CURVE, "-days", str(CERT_DAYS), "-subj", subject]


def _self_signed(pki: Pki, name: str) -> None:
    extensions = ["basicConstraints=critical,CA:TRUE", "keyUsage=critical,keyCertSign,cRLSign"]
    added = [arg for extension in extensions for arg in ("-addext", extension)]
    openssl(*_request(f"/CN={name}"), *added, "-keyout", str(pki.ca_key), "-out", str(pki.ca_cert))
    pki.ca_key.chmod(0o600)


def _signed(pki: Pki, name: str, identity: Identity, usage: str, alt_names: list[str]) -> None:
    """`name`.crt and .key, signed by the CA for `usage` (serverAuth or clientAuth), unless made."""
    if pki.cert(name).exists():
        return
    extensions = ["basicConstraints=critical,CA:FALSE", f"extendedKeyUsage={usage}"]
    if alt_names:
        extensions.append("subjectAltName=" + ",".join(alt_names))
    added = [arg for extension in extensions for arg in ("-addext", extension)]
    signer = ["-CA", str(pki.ca_cert), "-CAkey", str(pki.ca_key)]
    with tempfile.TemporaryDirectory(dir=pki.directory) as scratch:
        key, cert = Path(scratch) / "key.pem", Path(scratch) / "cert.pem"
        openssl(*_request(identity.subject), *signer, *added, "-keyout", str(key), "-out", str(cert))
        write_private(pki.key(name), key.read_text())
        pki.cert(name).write_text(cert.read_text())  # last: it marks the pair made


def _write_kubeconfig(pki: Pki, name: str, server: str) -> None:
    """A kubeconfig (JSON, which kubectl and every component read as YAML) for client `name`."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "trillium", "cluster": {"server": server, "certificate-authority": str(pki.ca_cert)}}],
        "users": [
            {"name": name, "user": {"client-certificate": str(pki.cert(name)), "client-key": str(pki.key(name))}}
        ],
        "contexts": [{"name": "trillium", "context": {"cluster": "trillium", "user": name}}],
        "current-context": "trillium",
    }
    write_private(pki.kubeconfig(name), json.dumps(config, indent=2))
