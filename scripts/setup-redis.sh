#!/usr/bin/env bash
# Makes Debian's redis-server available: installs it when missing and we are root.
set -eu
command -v redis-server >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "trillium setup: installing Debian's redis-server" >&2
  # Install only: the launcher starts its own redis-server, never the system service.
  (apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1 ||
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null; })
  command -v redis-server >/dev/null 2>&1 && exit 0
fi
echo "trillium setup: 'redis-server' not found: install it (Debian: sudo apt-get install redis-server)," \
     "or point TRILLIUM_REDIS_URL at an external Redis" >&2
exit 1
