"""The files the single-node cluster is made of, checked by tools of their own: its certificates
by openssl (chain, names, usages), its image archives by their digests and contents."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

from trillium.stack.k8s import oci, pki


def _text(cert: Path) -> str:
    return subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-text"], capture_output=True, text=True, check=True
    ).stdout


def test_every_certificate_chains_to_the_ca_with_its_names_and_usage(tmp_path) -> None:
    keys = pki.ensure(tmp_path / "pki", "node-a", "10.244.0.1", "10.96.0.1", "https://10.244.0.1:6443")
    for name in ("apiserver", "kubelet-serving", "admin", "kubelet", "kube-proxy", "apiserver-kubelet-client"):
        verified = subprocess.run(
            ["openssl", "verify", "-CAfile", str(keys.ca_cert), str(keys.cert(name))], capture_output=True, text=True
        )
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert keys.key(name).stat().st_mode & 0o077 == 0, f"{name}'s key is readable by others"
    apiserver = _text(keys.cert("apiserver"))
    for name in ("IP Address:10.244.0.1", "IP Address:10.96.0.1", "DNS:kubernetes.default.svc.cluster.local"):
        assert name in apiserver
    assert "TLS Web Server Authentication" in apiserver and "TLS Web Client Authentication" not in apiserver
    kubelet = _text(keys.cert("kubelet"))
    assert "CN = system:node:node-a" in kubelet and "O = system:nodes" in kubelet
    assert "TLS Web Client Authentication" in kubelet
    admin = json.loads(keys.kubeconfig("admin").read_text())
    assert admin["clusters"][0]["cluster"]["server"] == "https://10.244.0.1:6443"
    assert Path(admin["users"][0]["user"]["client-certificate"]) == keys.cert("admin")
    before = keys.cert("admin").read_bytes()
    pki.ensure(tmp_path / "pki", "node-a", "10.244.0.1", "10.96.0.1", "https://10.244.0.1:6443")
    assert keys.cert("admin").read_bytes() == before, "a second start made the certificates anew"


def test_an_image_archive_holds_its_files_under_the_digests_its_manifest_names(tmp_path) -> None:
    binary = tmp_path / "tool"
    binary.write_bytes(b"\x7fELF pretend binary")
    spec = oci.ImageSpec("trillium.local/tool:1.0", {"/usr/bin/tool": binary}, ["/usr/bin/tool"], ["--flag"])
    archive = oci.write_archive(spec, tmp_path / "tool.tar")
    with tarfile.open(archive) as tar:
        blobs = {
            m.name.rpartition("/")[2]: tar.extractfile(m).read()
            for m in tar.getmembers()
            if m.name.startswith("blobs/")
        }
        index = json.loads(tar.extractfile("index.json").read())
        docker = json.loads(tar.extractfile("manifest.json").read())
    assert all(hashlib.sha256(data).hexdigest() == digest for digest, data in blobs.items())
    entry = index["manifests"][0]
    assert entry["annotations"]["io.containerd.image.name"] == "trillium.local/tool:1.0"
    manifest = json.loads(blobs[entry["digest"].removeprefix("sha256:")])
    config = json.loads(blobs[manifest["config"]["digest"].removeprefix("sha256:")])
    layer = blobs[manifest["layers"][0]["digest"].removeprefix("sha256:")]
    assert config["config"]["Entrypoint"] == ["/usr/bin/tool"] and config["config"]["Cmd"] == ["--flag"]
    assert config["rootfs"]["diff_ids"] == [f"sha256:{hashlib.sha256(layer).hexdigest()}"]
    with tarfile.open(fileobj=io.BytesIO(layer)) as files:
        assert files.getnames() == ["usr", "usr/bin", "usr/bin/tool"]
        member = files.getmember("usr/bin/tool")
        assert member.mode == 0o755 and files.extractfile(member).read() == binary.read_bytes()
    assert docker[0]["RepoTags"] == ["trillium.local/tool:1.0"]
    again = oci.write_archive(spec, tmp_path / "again.tar")
    assert again.read_bytes() == archive.read_bytes(), "the same files made another image"
