#!/usr/bin/env bash
# scripts/start_dockerd.sh
# Starts the Docker engine that sandbox=docker uses, unless one already answers:
#   dockerd --bridge=none --iptables=false   (no container networking at all; log: $TBEXP_DOCKERD_LOG)
# Its data root is an XFS file system in a sparse loop file, so Docker's storage as a whole cannot
# fill the host's disk. It is mounted with project quotas where the kernel has XFS quotas: overlay2
# can then cap each container's writable layer too (--storage-opt size=, which it supports only on
# XFS with pquota); without them (as on this project's VMs) only the total is bounded. Where no loop
# file system can be made, or with TBEXP_DOCKER_DATA_GB=0, Docker's default data root is used and
# nothing is bounded (see tbexp/sandboxes/docker_containers.py).
# Installs docker.io (and xfsprogs) from Debian when missing. Idempotent; needs root.
set -euo pipefail
LOG=${TBEXP_DOCKERD_LOG:-/var/log/tbexp-dockerd.log}
DATA_IMG=${TBEXP_DOCKER_DATA_IMG:-/var/lib/tbexp-docker.xfs}
DATA_DIR=${TBEXP_DOCKER_DATA_DIR:-/var/lib/tbexp-docker}

answering() { timeout 10 docker info >/dev/null 2>&1; }
engine_answers() { command -v docker >/dev/null && answering; }

source "$(dirname "${BASH_SOURCE[0]}")/start_once.sh"
start_once dockerd "the Docker engine" engine_answers

apt_install() {
  [ -n "${APT_UPDATED:-}" ] || { apt-get update -qq >/dev/null; APT_UPDATED=1; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}
if ! command -v dockerd >/dev/null; then
  echo "installing docker.io..." >&2
  apt_install docker.io
fi

# A data root of bounded size with project quotas; an empty result means Docker's default.
data_root() {
  local gb=${TBEXP_DOCKER_DATA_GB:-}
  if [ "$gb" = 0 ]; then return 0; fi
  if mountpoint -q "$DATA_DIR"; then echo "$DATA_DIR"; return 0; fi
  command -v mkfs.xfs >/dev/null || apt_install xfsprogs || return 0
  if [ ! -f "$DATA_IMG" ]; then
    if [ -z "$gb" ]; then  # half the free space, 8-64 GB; sparse, so it takes only what is used
      local free_gb
      free_gb=$(df --output=avail -BG "$(dirname "$DATA_IMG")" | tail -1 | tr -dc 0-9)
      gb=$(( free_gb / 2 )); (( gb > 64 )) && gb=64; (( gb < 8 )) && gb=8
    fi
    truncate -s "${gb}G" "$DATA_IMG.partial" && mkfs.xfs -q "$DATA_IMG.partial" && mv "$DATA_IMG.partial" "$DATA_IMG" || { rm -f "$DATA_IMG.partial"; return 0; }
  fi
  mkdir -p "$DATA_DIR"
  if mount -o loop,pquota "$DATA_IMG" "$DATA_DIR" 2>/dev/null || mount -o loop "$DATA_IMG" "$DATA_DIR"; then
    echo "$DATA_DIR"
  fi
  return 0
}

ARGS=(--bridge=none --iptables=false)
ROOT=$(data_root || true)
if [ -n "$ROOT" ]; then
  ARGS+=(--data-root="$ROOT")
else
  echo "start_dockerd.sh: no loop-mounted data root (loop device or XFS missing); Docker's disk use is unbounded" >&2
fi

# A dockerd that is still starting up is waited for; a pid file left by one that was killed
# (or is a zombie) would stop a new one from starting.
running_dockerd() {  # pid file -> true if it names a live, non-zombie process
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ -d "/proc/$pid" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null
}
DOCKERD_PID=
if running_dockerd /var/run/docker.pid; then
  DOCKERD_PID=$(cat /var/run/docker.pid)
  echo "dockerd $DOCKERD_PID is running but not answering yet; waiting for it" >&2
else
  for pidfile in /var/run/docker.pid /var/run/docker/containerd/containerd.pid; do
    running_dockerd "$pidfile" || rm -f "$pidfile"
  done
  echo "starting dockerd ${ARGS[*]} (log: $LOG)" >&2
  setsid nohup dockerd "${ARGS[@]}" >>"$LOG" 2>&1 </dev/null 9>&- &  # 9>&-: the lock is not dockerd's to keep
  DOCKERD_PID=$!
fi
for _ in $(seq 60); do
  if answering; then
    exit 0
  fi
  [ -d "/proc/$DOCKERD_PID" ] || break  # it died: no point waiting
  sleep 0.5
done
echo "start_dockerd.sh: dockerd did not answer; last lines of $LOG:" >&2
tail -20 "$LOG" >&2
exit 1
