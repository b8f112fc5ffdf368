"""The configuration files of the cluster's processes: containerd's, the CNI network's, the
kubelet's and kube-proxy's, written under the cluster's state directory on every `up`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .pki import Pki

NODE = "trillium-k8s"
BRIDGE = "trk8s0"
POD_SUBNET = "10.244.0.0/24"
NODE_IP = "10.244.0.1"  # the bridge's gateway address: the node's only address
SERVICE_RANGE = "10.96.0.0/24"
API_SERVICE_IP = "10.96.0.1"  # the `kubernetes` Service: the range's first address
DNS_SERVICE_IP = "10.96.0.10"
API_PORT = 6443
ETCD_CLIENT_PORT = 23790
ETCD_PEER_PORT = 23800
CLUSTER_DOMAIN = "cluster.local"
PAUSE_IMAGE = "trillium.local/pause:3.10"
COREDNS_IMAGE = "trillium.local/coredns:1.15.0"
PROBE_IMAGE = "trillium.local/probe:dev"
OBJECT_STORE_IMAGE = "trillium.local/versitygw:1.8.0"  # the version the Makefile builds
RUN = Path("/run/trillium-k8s")  # sockets and containerd's state: gone with the machine


@dataclass(frozen=True)
class Layout:
    """Where the cluster keeps what: `state` is made anew by every `up`, `containerd` keeps the
    imported images from one cluster to the next."""

    home: Path  # .cache/k8s

    @property
    def bin(self) -> Path:
        return self.home / "bin"

    @property
    def state(self) -> Path:
        return self.home / "state"

    @property
    def containerd_root(self) -> Path:
        return self.home / "containerd"

    @property
    def kubelet_root(self) -> Path:
        return self.state / "kubelet"

    @property
    def logs(self) -> Path:
        return self.state / "logs"

    @property
    def cni_conf(self) -> Path:
        return self.state / "cni" / "net.d"

    @property
    def cni_ipam(self) -> Path:
        return self.state / "cni" / "ipam"

    @property
    def containerd_socket(self) -> Path:
        return RUN / "containerd.sock"

    @property
    def pki(self) -> Pki:
        return Pki(self.state / "pki")

    @property
    def admin_kubeconfig(self) -> Path:
        return self.pki.kubeconfig("admin")


def containerd_config(layout: Layout) -> str:
    """containerd 1.6's config (version 2): its own root, state and socket, so the Docker engine's
    containerd beside it is untouched; CRI with runc and cgroupfs (this machine's cgroups are v1
    beside a cgroup2 holding hugetlb: a hybrid that crun 1.8 refuses) and the pause image written here."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return f"""version = 2
root = "{layout.containerd_root}"
state = "{RUN / "containerd"}"

[grpc]
  address = "{layout.containerd_socket}"

[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  enable_selinux = false
  # This machine's root lacks CAP_SYS_RESOURCE, so no process may lower its OOM score below 0:
  # containerd raises a pod's asked-for score (the sandbox's -998, a Guaranteed pod's -997) to its own.
  restrict_oom_score_adj = true

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  BinaryName = "/usr/bin/runc"
  SystemdCgroup = false

[{cri}.cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "{layout.cni_conf}"
"""


def cni_config(layout: Layout) -> dict:
    """One bridge network: pods on `BRIDGE` in POD_SUBNET, routed through the node's address. No
    masquerade: nothing outside this machine is reached."""
    return {
        "cniVersion": "1.0.0",
        "name": "trillium",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "hairpinMode": True,
                "ipMasq": False,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(layout.cni_ipam),
                    "ranges": [[{"subnet": POD_SUBNET, "rangeStart": "10.244.0.10", "gateway": NODE_IP}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            }
        ],
    }


def kubelet_config(layout: Layout) -> dict:
    pki = layout.pki
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki.ca_cert)},
        },
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(pki.cert("kubelet-serving")),
        "tlsPrivateKeyFile": str(pki.key("kubelet-serving")),
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,
        "failSwapOn": False,
        "clusterDNS": [DNS_SERVICE_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": str(layout.state / "resolv.conf"),
        # The machine's disk is shared with CI's images and caches: evict only when nearly full.
        "evictionHard": {"memory.available": "200Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 99,
        "imageGCLowThresholdPercent": 98,
        "serializeImagePulls": False,
    }


def kube_proxy_config(layout: Layout) -> dict:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "nftables",
        "clientConnection": {"kubeconfig": str(layout.pki.kubeconfig("kube-proxy"))},
        "hostnameOverride": NODE,
        "bindAddress": NODE_IP,
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "clusterCIDR": POD_SUBNET,
        "nodePortAddresses": [f"{NODE_IP}/32"],
        "conntrack": {"maxPerCore": 0},  # leaves the machine's conntrack table size alone
    }


def write(layout: Layout) -> None:
    """Every process's configuration file under `layout.state`."""
    layout.cni_conf.mkdir(parents=True, exist_ok=True)
    (layout.cni_conf / "10-trillium.conflist").write_text(json.dumps(cni_config(layout), indent=2))
    (layout.state / "containerd.toml").write_text(containerd_config(layout))
    (layout.state / "kubelet.json").write_text(json.dumps(kubelet_config(layout), indent=2))
    (layout.state / "kube-proxy.json").write_text(json.dumps(kube_proxy_config(layout), indent=2))
    # Pods of dnsPolicy Default, and CoreDNS, read this: nothing upstream answers here.
    (layout.state / "resolv.conf").write_text(f"nameserver {DNS_SERVICE_IP}\n")
