#!/usr/bin/env bash
# Fails with one clear line per missing tool: `scripts/require.sh java mvn cargo`.
set -u
declare -A how=(
  [java]="install a JDK 17+ (Debian: apt-get install openjdk-17-jre-headless)"
  [mvn]="install Apache Maven (Debian: apt-get install maven)"
  [cargo]="install Rust with rustup (https://rustup.rs)"
  [go]="install Go 1.22+ (https://go.dev/dl)"
  [python3]="install Python 3.11+ (Debian: apt-get install python3 python3-venv)"
)
missing=0
for tool in "$@"; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "trillium setup: '$tool' not found: ${how[$tool]:-install it}" >&2
    missing=1
  fi
done
exit $missing
