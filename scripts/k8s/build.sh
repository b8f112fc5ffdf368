#!/usr/bin/env bash
# Builds the single-node cluster's binaries into .cache/k8s/bin (trillium/stack/k8s), and installs
# Debian's parts of it when missing (as root):
#   Go module proxy: kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy
#                    and kubectl (k8s.io/kubernetes, pinned in scripts/k8s/go.mod), CoreDNS, kube-router
#   Go:              probe (scripts/k8s/probe), the cluster tests' pods' one program
#   gcc:             pause, the pod sandbox's process (its C source comes with k8s.io/kubernetes)
#   Debian:          etcd-server, containerd, runc, containernetworking-plugins, ipset, nftables,
#                    iptables (kube-router's rules), conntrack
# The Go module and build caches stay in .cache/k8s/go, so a rebuild after a version change is warm.
set -euo pipefail
cd "$(dirname "$0")/../.."
scripts/require.sh go
out=.cache/k8s/bin
mkdir -p "$out"
export GOMODCACHE="$PWD/.cache/k8s/go/mod" GOCACHE="$PWD/.cache/k8s/go/build" GOFLAGS=-modcacherw CGO_ENABLED=0

packages=(etcd-server containerd runc containernetworking-plugins ipset nftables iptables conntrack)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "k8s: Debian's ${missing[*]} needed (as root)" >&2; exit 1; }
  echo "k8s: installing Debian's ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
fi

flags=(-trimpath -ldflags "-s -w")
kubernetes=$(sed -n 's/^\tk8s.io\/kubernetes \(v[0-9.]*\)$/\1/p' scripts/k8s/go.mod)
# The version each binary reports (kubectl version, a node's kubeletVersion), as upstream's build stamps it.
minor=$(echo "$kubernetes" | cut -d. -f2)
stamp="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  stamp+=" -X $pkg.gitVersion=$kubernetes -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
done
for cmd in kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl; do
  if [ ! -x "$out/$cmd" ] || [ "$(cat "$out/.$cmd.version" 2>/dev/null)" != "$kubernetes" ]; then
    (cd scripts/k8s && go build -trimpath -ldflags "$stamp" -o "../../$out/$cmd" "k8s.io/kubernetes/cmd/$cmd")
    echo "$kubernetes" > "$out/.$cmd.version"
  fi
done
# kube-router runs only its NetworkPolicy controller (iptables and ipsets: this kernel has no nft
# queue, which kube-network-policies needs). v2.1.0 is the one version the proxy serves here; the
# releases that fix the flaws reported against it are refused (403), so it runs on this machine's
# test cluster only, never in deploy/.
declare -A modules=(
  [coredns]=github.com/coredns/coredns@v1.15.0
  [kube-router]=github.com/cloudnativelabs/kube-router/v2/cmd/kube-router@v2.1.0
)
for cmd in "${!modules[@]}"; do
  if [ ! -x "$out/$cmd" ] || [ "$(cat "$out/.$cmd.version" 2>/dev/null)" != "${modules[$cmd]}" ]; then
    GOBIN="$PWD/$out" go install "${flags[@]}" "${modules[$cmd]}"
    echo "${modules[$cmd]}" > "$out/.$cmd.version"
  fi
done
if [ ! -x "$out/probe" ] || [ scripts/k8s/probe/main.go -nt "$out/probe" ]; then
  (cd scripts/k8s/probe && go build "${flags[@]}" -o "../../../$out/probe" .)
fi
if [ ! -x "$out/pause" ]; then
  source_dir=$(cd scripts/k8s && go list -m -f '{{.Dir}}' k8s.io/kubernetes)
  gcc -static -Os -Wall -DVERSION=3.10 -o "$out/pause" "$source_dir/build/pause/linux/pause.c"
fi
