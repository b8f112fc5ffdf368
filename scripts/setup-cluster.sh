#!/usr/bin/env bash
# The tools of the cluster of hosts on this machine (tests/cluster, `trillium up --cluster`):
# iproute2 (ip, tc), nftables (partitions, loss, linkdelay's redirect), tcpdump (captures
# on the bridge). Installs Debian's packages when missing and we are root.
set -eu
declare -A package=([ip]=iproute2 [tc]=iproute2 [nft]=nftables [tcpdump]=tcpdump)
missing=()
for tool in "${!package[@]}"; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("${package[$tool]}")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "trillium setup: installing Debian's ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
  exit 0
fi
echo "trillium setup: the cluster of hosts needs ${missing[*]} (Debian packages) and root" >&2
exit 1
