"""Starting and stopping the cluster: its processes in order, each waited for until it serves, and
on `down` everything they left on the machine (containers, mounts, the bridge, netfilter rules,
sysctls) taken away again."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from .. import object_store
from ..procs import LauncherError, pid_alive, write_json
from . import configs, oci, pki
from .configs import (
    API_PORT,
    API_SERVICE_IP,
    BRIDGE,
    ETCD_CLIENT_PORT,
    ETCD_PEER_PORT,
    NODE,
    NODE_IP,
    POD_SUBNET,
    RUN,
    SERVICE_RANGE,
    Layout,
)

STATE_FILE = "cluster.json"
IMAGES_FILE = "trillium-images.json"  # in containerd's store: the engine's image ID of each image imported
START_TIMEOUT_S = 180.0  # each process, until it serves (the first kubelet start on a loaded machine)
STOP_TIMEOUT_S = 30.0
SYSCTLS = {"net/ipv4/ip_forward": "1", "net/bridge/bridge-nf-call-iptables": "1"}
DEBIAN_TOOLS = {"etcd": "etcd-server", "containerd": "containerd", "runc": "runc", "ipset": "ipset", "nft": "nftables"}
BUILT_TOOLS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy", "kubectl")
BUILT_TOOLS += ("coredns", "kube-router", "pause", "probe")


def home() -> Path:
    return Path(os.environ.get("TRILLIUM_K8S_HOME", Path(__file__).resolve().parents[3] / ".cache" / "k8s"))


def _require(layout: Layout) -> None:
    if os.geteuid() != 0:
        raise LauncherError("the Kubernetes cluster runs as root (containers, the bridge, netfilter)")
    missing = [package for tool, package in DEBIAN_TOOLS.items() if not _which(tool)]
    if missing or not Path("/usr/lib/cni/bridge").exists():
        raise LauncherError(f"Debian's {' '.join(missing or ['containernetworking-plugins'])} needed: make k8s-tools")
    unbuilt = [tool for tool in BUILT_TOOLS if not os.access(layout.bin / tool, os.X_OK)]
    if unbuilt:
        raise LauncherError(f"not built in {layout.bin}: {', '.join(unbuilt)} (make k8s-tools)")
    object_store.binary()  # the local overlay's object store


def _which(tool: str) -> bool:
    return any(os.access(Path(d) / tool, os.X_OK) for d in os.environ.get("PATH", "").split(":") + ["/usr/sbin"])


def kubectl(layout: Layout, *args: str, check: bool = True, timeout: float = 60.0, stdin: str | None = None) -> str:
    """kubectl as the cluster's administrator (`stdin` its input: a manifest for `apply -f -`); its output."""
    command = [str(layout.bin / "kubectl"), "--kubeconfig", str(layout.admin_kubeconfig), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, input=stdin)
    if check and done.returncode != 0:
        raise LauncherError(f"kubectl {' '.join(args)}: {done.stderr.strip()[-800:]}")
    return done.stdout


def _wait(what: str, ready, proc: subprocess.Popen | None, log: Path | None, timeout: float = START_TIMEOUT_S) -> None:
    """Until `ready()` is true; a process that exits meanwhile fails the start with its log's end."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-1500:] if log and log.exists() else ""
            raise LauncherError(f"{what} exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(Exception):
            if ready():
                return
        if time.monotonic() > deadline:
            raise LauncherError(f"{what} not ready after {timeout:.0f} s (logs in {log or 'its log'})")
        time.sleep(0.5)


class Cluster:
    def __init__(self, layout: Layout | None = None) -> None:
        self.layout = layout or Layout(home())

    # ---- the state file: pids, and what `down` restores

    def _state_path(self) -> Path:
        return self.layout.state / STATE_FILE

    def read_state(self) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(self._state_path().read_text())
        return {}

    def _save(self, state: dict[str, Any]) -> None:
        write_json(self._state_path(), state)

    # ---- up

    def up(self) -> None:
        layout = self.layout
        _require(layout)
        if any(pid_alive(p) for p in self.read_state().get("pids", {}).values()):
            raise LauncherError("a cluster is already running (make k8s-down first)")
        self.down(quiet=True, keep_images=True)  # what an earlier cluster left, if it was not taken down
        layout.logs.mkdir(parents=True, exist_ok=True)
        RUN.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {"pids": {}, "sysctls": {}}
        for key, value in SYSCTLS.items():
            path = Path("/proc/sys") / key
            state["sysctls"][key] = path.read_text().strip()
            path.write_text(value)
        self._save(state)
        _bridge_up()
        server = f"https://{NODE_IP}:{API_PORT}"
        keys = pki.ensure(layout.pki.directory, NODE, NODE_IP, API_SERVICE_IP, server)
        configs.write(layout)
        try:
            self._start_control_plane(state, keys)
            self._start_node(state, keys)
        except BaseException:
            self.down(quiet=True, keep_images=True)
            raise

    def _start(self, state: dict[str, Any], name: str, command: list[str]) -> tuple[subprocess.Popen, Path]:
        log = self.layout.logs / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        state["pids"][name] = proc.pid
        self._save(state)
        return proc, log

    def _start_control_plane(self, state: dict[str, Any], keys: pki.Pki) -> None:
        layout = self.layout
        etcd_url = f"http://127.0.0.1:{ETCD_CLIENT_PORT}"
        peer_url = f"http://127.0.0.1:{ETCD_PEER_PORT}"
        proc, log = self._start(
            state,
            "etcd",
            [
                "etcd",
                "--name=trillium",
                f"--data-dir={layout.state / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=trillium={peer_url}",
            ],
        )
        _wait("etcd", lambda: _get(f"{etcd_url}/health").get("health") == "true", proc, log)
        bin_ = layout.bin
        proc, log = self._start(
            state,
            "kube-apiserver",
            [
                str(bin_ / "kube-apiserver"),
                f"--etcd-servers={etcd_url}",
                f"--bind-address={NODE_IP}",
                f"--advertise-address={NODE_IP}",
                f"--secure-port={API_PORT}",
                f"--service-cluster-ip-range={SERVICE_RANGE}",
                f"--tls-cert-file={keys.cert('apiserver')}",
                f"--tls-private-key-file={keys.key('apiserver')}",
                f"--client-ca-file={keys.ca_cert}",
                f"--kubelet-client-certificate={keys.cert('apiserver-kubelet-client')}",
                f"--kubelet-client-key={keys.key('apiserver-kubelet-client')}",
                f"--kubelet-certificate-authority={keys.ca_cert}",
                "--kubelet-preferred-address-types=InternalIP",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={keys.service_account_pub}",
                f"--service-account-signing-key-file={keys.service_account_key}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--anonymous-auth=false",
                "--profiling=false",
            ],
        )
        _wait("kube-apiserver", lambda: kubectl(layout, "get", "--raw", "/readyz", timeout=10) == "ok", proc, log)
        for name, identity, port in (
            ("kube-controller-manager", "controller-manager", 10257),
            ("kube-scheduler", "scheduler", 10259),
        ):
            kubeconfig = str(keys.kubeconfig(identity))
            extra = []
            if name == "kube-controller-manager":
                extra = [
                    f"--service-account-private-key-file={keys.service_account_key}",
                    f"--root-ca-file={keys.ca_cert}",
                    f"--cluster-signing-cert-file={keys.ca_cert}",
                    f"--cluster-signing-key-file={keys.ca_key}",
                    "--use-service-account-credentials=true",
                    f"--service-cluster-ip-range={SERVICE_RANGE}",
                ]
            proc, log = self._start(
                state,
                name,
                [
                    str(bin_ / name),
                    f"--kubeconfig={kubeconfig}",
                    f"--authentication-kubeconfig={kubeconfig}",
                    f"--authorization-kubeconfig={kubeconfig}",
                    "--bind-address=127.0.0.1",
                    "--leader-elect=false",
                    "--profiling=false",
                    *extra,
                ],
            )
            _wait(name, lambda port=port: _healthy(f"https://127.0.0.1:{port}/healthz"), proc, log)

    def _start_node(self, state: dict[str, Any], keys: pki.Pki) -> None:
        layout = self.layout
        proc, log = self._start(state, "containerd", ["containerd", "--config", str(layout.state / "containerd.toml")])
        _wait("containerd", lambda: _ctr(layout, "version", timeout=5) is not None, proc, log)
        self._import_system_images()
        proc, log = self._start(
            state,
            "kubelet",
            [
                str(layout.bin / "kubelet"),
                f"--config={layout.state / 'kubelet.json'}",
                f"--kubeconfig={keys.kubeconfig('kubelet')}",
                f"--root-dir={layout.kubelet_root}",
                f"--hostname-override={NODE}",
                f"--node-ip={NODE_IP}",
            ],
        )
        _wait("the kubelet's node", lambda: "True" in _node_ready(layout), proc, log)
        # CoreDNS, and the grants kube-router starts with: before it, which lists what they allow at start.
        kubectl(layout, "apply", "-f", str(Path(__file__).with_name("system.yaml")))
        proc, log = self._start(
            state, "kube-proxy", [str(layout.bin / "kube-proxy"), f"--config={layout.state / 'kube-proxy.json'}"]
        )
        _wait("kube-proxy", lambda: _healthy("http://127.0.0.1:10256/healthz"), proc, log)
        proc, log = self._start(
            state,
            "kube-router",
            [
                str(layout.bin / "kube-router"),
                f"--kubeconfig={keys.kubeconfig('network-policy')}",
                "--run-firewall=true",
                "--run-router=false",
                "--run-service-proxy=false",
                "--run-loadbalancer=false",
                f"--hostname-override={NODE}",
                f"--service-cluster-ip-range={SERVICE_RANGE}",
                "--enable-cni=false",
                "--metrics-port=0",
                "--health-port=0",  # it would listen on every address
            ],
        )
        # Its health port would listen on every address: ready once its filter chain is in place.
        _wait("kube-router", lambda: _iptables_chain("KUBE-ROUTER-FORWARD"), proc, log)
        kubectl(layout, "-n", "kube-system", "rollout", "status", "deployment/coredns", "--timeout=180s", timeout=200)

    def _import_system_images(self) -> None:
        """pause, CoreDNS, the local overlay's object store and the tests' probe, written from their
        binaries into containerd's k8s.io namespace."""
        bin_ = self.layout.bin
        specs = [
            oci.ImageSpec(configs.PAUSE_IMAGE, {"/pause": bin_ / "pause"}, ["/pause"]),
            oci.ImageSpec(configs.COREDNS_IMAGE, {"/coredns": bin_ / "coredns"}, ["/coredns"]),
            oci.ImageSpec(
                configs.OBJECT_STORE_IMAGE, {"/versitygw": object_store.binary()}, ["/versitygw"], user="10001"
            ),
            # The cluster tests' pods (tests/k8s): a server, a client and a resolver in 2 MB.
            oci.ImageSpec(configs.PROBE_IMAGE, {"/probe": bin_ / "probe"}, ["/probe"], user="65532"),
        ]
        for spec in specs:
            archive = oci.write_archive(spec, self.layout.state / f"{spec.name.rpartition('/')[2]}.tar")
            if _ctr(self.layout, "images", "import", str(archive), timeout=120) is None:
                raise LauncherError(f"containerd refused the image {spec.name} ({archive})")
            archive.unlink()

    def import_images(self, names: list[str]) -> list[str]:
        """Images of the Docker engine (`make images-offline`) into the node's containerd, streamed
        from `docker save`: the kubelet then finds them under the same names (docker.io/...). Only
        those the node lacks, or holds another build of (by the engine's image ID, recorded in the
        store beside them): a rebuilt image is imported again. Returns those imported."""
        ctr = ["ctr", "--address", str(self.layout.containerd_socket), "--namespace", "k8s.io"]
        record = self.layout.containerd_root / IMAGES_FILE
        imported: dict[str, str] = json.loads(record.read_text()) if record.exists() else {}
        done_names = []
        for name in names:
            inspect = subprocess.run(
                ["docker", "image", "inspect", "-f", "{{.Id}}", name], capture_output=True, text=True
            )
            if inspect.returncode != 0:
                raise LauncherError(f"no image {name} in the Docker engine: {inspect.stderr.strip()[-300:]}")
            image_id = inspect.stdout.strip()
            if imported.get(name) == image_id:
                continue
            save = subprocess.Popen(["docker", "save", name], stdout=subprocess.PIPE)
            done = subprocess.run([*ctr, "images", "import", "-"], stdin=save.stdout, capture_output=True, text=True)
            save.stdout.close()
            if save.wait() != 0 or done.returncode != 0:
                raise LauncherError(f"importing {name}: {done.stderr.strip()[-500:] or 'docker save failed'}")
            imported[name] = image_id
            write_json(record, imported)
            done_names.append(name)
        return done_names

    # ---- down

    def down(self, quiet: bool = False, keep_images: bool = False) -> None:
        """Stop every process, then take away what they left: pods' containers and mounts, the
        bridge, kube-proxy's and kube-router's rules, the sysctls as they were and, unless
        `keep_images`, containerd's store (the images imported: gigabytes, which a later cluster
        imports again from the Docker engine)."""
        layout = self.layout
        state = self.read_state()
        pids: dict[str, int] = state.get("pids", {})
        for name in ("kube-router", "kube-proxy", "kubelet"):
            _stop(pids.get(name))
        _kill_containers(layout)
        for name in ("containerd", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            _stop(pids.get(name))
        _kill_shims(layout)
        _unmount_under([layout.kubelet_root, RUN, layout.containerd_root])
        _remove_pod_netns()
        if (layout.bin / "kube-proxy").exists():
            subprocess.run([str(layout.bin / "kube-proxy"), "--cleanup"], capture_output=True, timeout=60)
        if (layout.bin / "kube-router").exists():
            subprocess.run([str(layout.bin / "kube-router"), "--cleanup-config"], capture_output=True, timeout=60)
        _remove_kube_chains()
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True)
        for key, value in state.get("sysctls", {}).items():
            with contextlib.suppress(OSError):
                (Path("/proc/sys") / key).write_text(value)
        for leftover in ("etcd", "kubelet", "cni", "volumes", STATE_FILE):
            path = layout.state / leftover
            if path.is_dir():
                subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)
            else:
                path.unlink(missing_ok=True)
        if not keep_images:
            subprocess.run(["rm", "-rf", "--one-file-system", str(layout.containerd_root)], check=False)
        if not quiet:
            print("k8s: the cluster is down")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


def _healthy(url: str) -> bool:
    """Whether a component's health endpoint on loopback answers 200 (its serving certificate is
    its own self-signed one: the address is this machine's)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(url, timeout=5, context=context) as response:
        return response.status == 200


def _iptables_chain(chain: str) -> bool:
    return subprocess.run(["iptables", "-S", chain], capture_output=True).returncode == 0


def _ctr(layout: Layout, *args: str, timeout: float) -> str | None:
    done = subprocess.run(
        ["ctr", "--address", str(layout.containerd_socket), "--namespace", "k8s.io", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.stdout if done.returncode == 0 else None


def _node_ready(layout: Layout) -> str:
    jsonpath = '{.status.conditions[?(@.type=="Ready")].status}'
    return kubectl(layout, "get", "node", NODE, "-o", f"jsonpath={jsonpath}", check=False, timeout=10)


def _bridge_up() -> None:
    """The pod bridge, made before the API server, which listens on its gateway address."""
    subprocess.run(["ip", "link", "add", BRIDGE, "type", "bridge"], capture_output=True)
    prefix = POD_SUBNET.split("/")[1]
    subprocess.run(["ip", "addr", "replace", f"{NODE_IP}/{prefix}", "dev", BRIDGE], check=True)
    subprocess.run(["ip", "link", "set", BRIDGE, "up"], check=True)


def _stop(pid: int | None) -> None:
    if not pid_alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _kill_containers(layout: Layout) -> None:
    """Every pod's processes, through containerd while it still runs."""
    if not layout.containerd_socket.exists():
        return
    tasks = _ctr(layout, "tasks", "ls", "-q", timeout=30) or ""
    for task in tasks.split():
        _ctr(layout, "tasks", "kill", "-s", "SIGKILL", task, timeout=30)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while (_ctr(layout, "tasks", "ls", "-q", timeout=30) or "").split() and time.monotonic() < deadline:
        for task in (_ctr(layout, "tasks", "ls", "-q", timeout=30) or "").split():
            _ctr(layout, "tasks", "delete", "-f", task, timeout=30)
        time.sleep(0.5)
    for container in (_ctr(layout, "containers", "ls", "-q", timeout=30) or "").split():
        _ctr(layout, "containers", "delete", container, timeout=30)


def _kill_shims(layout: Layout) -> None:
    """containerd's shims outlive it: those of this cluster's containerd (by its socket)."""
    socket = str(layout.containerd_socket)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and socket.encode() in argv:
                os.kill(int(entry.name), signal.SIGKILL)


def _unmount_under(roots: list[Path]) -> None:
    """Every mount below `roots` (overlay snapshots, pods' volumes, sandboxes' /dev/shm), deepest first."""
    prefixes = [str(root.resolve()) for root in roots]
    with open("/proc/self/mounts") as mounts:
        points = [line.split()[1] for line in mounts]
    inside = [p for p in points if any(p == prefix or p.startswith(prefix + "/") for prefix in prefixes)]
    for point in sorted(inside, key=len, reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def _remove_kube_chains() -> None:
    """The kubelet's iptables chains (KUBE-FIREWALL and its canaries), which no cleanup flag of its
    own removes, with whatever else named KUBE- is left: the jumps to them first, then the chains."""
    for tool in ("iptables", "ip6tables"):
        for table in ("filter", "nat", "mangle"):
            saved = subprocess.run([f"{tool}-save", "-t", table], capture_output=True, text=True)
            lines = saved.stdout.splitlines()
            for line in lines:
                parts = shlex.split(line)
                if parts[:1] == ["-A"] and ("KUBE-" in parts[1] or any(p.startswith("KUBE-") for p in parts[2:])):
                    subprocess.run([tool, "-t", table, "-D", *parts[1:]], capture_output=True)
            chains = [line[1:].split()[0] for line in lines if line.startswith(":KUBE-")]
            for chain in chains:
                subprocess.run([tool, "-t", table, "-F", chain], capture_output=True)
            for chain in chains:
                subprocess.run([tool, "-t", table, "-X", chain], capture_output=True)


def _remove_pod_netns() -> None:
    """The network namespaces containerd made for pods (`cni-<uuid>`): the cluster harness's own
    namespaces have other names."""
    netns = Path("/var/run/netns")
    if not netns.is_dir():
        return
    for entry in netns.glob("cni-*"):
        subprocess.run(["umount", "-l", str(entry)], capture_output=True)
        entry.unlink(missing_ok=True)
