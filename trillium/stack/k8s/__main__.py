"""`python -m trillium.stack.k8s up|down [--keep-images]|status|images NAME...|kubectl ARGS`: the
single-node cluster (make k8s-up, make k8s-down); `images` imports images of the Docker engine into
the node; `kubectl` runs the built kubectl as the cluster's administrator."""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..procs import LauncherError, pid_alive
from .cluster import Cluster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trillium.stack.k8s", description=__doc__)
    parser.add_argument("command", choices=["up", "down", "status", "images", "kubectl"])
    parser.add_argument(
        "--keep-images", action="store_true", help="down: keep the node's imported images for the next cluster"
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help="kubectl's arguments; the images to import")
    options = parser.parse_args(argv)
    cluster = Cluster()
    try:
        if options.command == "up":
            started = time.monotonic()
            cluster.up()
            print(
                f"k8s: the cluster is up in {time.monotonic() - started:.0f} s; kubeconfig {cluster.layout.admin_kubeconfig}"
            )
        elif options.command == "down":
            cluster.down(keep_images=options.keep_images)
        elif options.command == "images":
            started = time.monotonic()
            imported = cluster.import_images(options.args)
            print(f"k8s: {len(imported)} images imported in {time.monotonic() - started:.0f} s ({', '.join(imported)})")
        elif options.command == "status":
            pids = cluster.read_state().get("pids", {})
            if not pids:
                print("k8s: no cluster")
                return 1
            for name, pid in pids.items():
                print(f"{name:24} {pid:>8} {'running' if pid_alive(pid) else 'exited'}")
            return 0 if all(pid_alive(pid) for pid in pids.values()) else 1
        else:
            kubectl = str(cluster.layout.bin / "kubectl")
            os.execv(kubectl, [kubectl, "--kubeconfig", str(cluster.layout.admin_kubeconfig), *options.args])
    except LauncherError as err:
        print(f"k8s: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
