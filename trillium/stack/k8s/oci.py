"""Images of one static binary, written as an image archive that containerd imports (`ctr images
import`): the pod sandbox's `pause` and CoreDNS, which no registry serves here. The archive holds
both indexes that `docker save` writes, OCI's (index.json) and Docker's (manifest.json), so its
name survives either importer. Layers are deterministic (mtime 0, root-owned), so an unchanged
binary makes the same image digest.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"


@dataclass(frozen=True)
class ImageSpec:
    name: str  # the full reference: trillium.local/pause:3.10
    files: dict[str, Path]  # the path in the image -> the file on this host (copied mode 0755)
    entrypoint: list[str]
    args: list[str] = field(default_factory=list)
    user: str = "0"


def _layer(files: dict[str, Path]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        made: set[str] = set()
        for inside, source in sorted(files.items()):
            parts = inside.strip("/").split("/")
            for depth in range(1, len(parts)):
                directory = "/".join(parts[:depth])
                if directory not in made:
                    made.add(directory)
                    info = tarfile.TarInfo(directory)
                    info.type = tarfile.DIRTYPE
                    info.mode = 0o755
                    tar.addfile(info)
            data = source.read_bytes()
            info = tarfile.TarInfo("/".join(parts))
            info.size = len(data)
            info.mode = 0o755
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _blob(tar: tarfile.TarFile, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return digest


def write_archive(spec: ImageSpec, path: Path) -> Path:
    """The image archive of `spec` at `path`."""
    layer = _layer(spec.files)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": spec.entrypoint, "Cmd": spec.args, "User": spec.user},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]},
    }
    with tarfile.open(path, "w") as tar:
        layer_digest = _blob(tar, layer)
        config_bytes = json.dumps(config, sort_keys=True).encode()
        config_digest = _blob(tar, config_bytes)
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": f"sha256:{config_digest}", "size": len(config_bytes)},
            "layers": [{"mediaType": OCI_LAYER, "digest": f"sha256:{layer_digest}", "size": len(layer)}],
        }
        manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
        manifest_digest = _blob(tar, manifest_bytes)
        tag = spec.name.rpartition(":")[2]
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": OCI_MANIFEST,
                    "digest": f"sha256:{manifest_digest}",
                    "size": len(manifest_bytes),
                    "annotations": {"io.containerd.image.name": spec.name, "org.opencontainers.image.ref.name": tag},
                }
            ],
        }
        docker = [
            {
                "Config": f"blobs/sha256/{config_digest}",
                "RepoTags": [spec.name],
                "Layers": [f"blobs/sha256/{layer_digest}"],
            }
        ]
        for name, content in (
            ("oci-layout", {"imageLayoutVersion": "1.0.0"}),
            ("index.json", index),
            ("manifest.json", docker),
        ):
            data = json.dumps(content).encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
