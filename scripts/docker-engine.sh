# Sourced by the scripts that need a Docker engine (test-compose.sh, test-k8s.sh):
#   engine_start NAME LOGDIR   installs Debian's docker.io when missing (as root) and starts dockerd
#                              when none answers, logging to LOGDIR/dockerd.log
#   engine_stop NAME           stops only the dockerd engine_start started
# NAME prefixes what they print.
engine_pid=

engine_start() {
  local name=$1 logs=$2
  if ! command -v dockerd >/dev/null; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
      echo "$name: docker.io missing: install it (Debian: sudo apt-get install docker.io)" >&2
      return 1
    fi
    echo "$name: installing docker.io (Debian)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io >/dev/null
  fi
  docker info >/dev/null 2>&1 && return 0
  [ "$(id -u)" = 0 ] || { echo "$name: no Docker engine answers, and starting one needs root" >&2; return 1; }
  mkdir -p "$logs"
  dockerd > "$logs/dockerd.log" 2>&1 &
  engine_pid=$!
  for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { tail -20 "$logs/dockerd.log" >&2; return 1; }
  echo "$name: started dockerd (pid $engine_pid, log $logs/dockerd.log)"
}

engine_stop() {
  if [ -n "$engine_pid" ]; then
    kill -TERM "$engine_pid" 2>/dev/null && wait "$engine_pid" 2>/dev/null || true
    echo "$1: stopped the dockerd it started"
  fi
}
