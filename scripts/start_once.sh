# scripts/start_once.sh — sourced by the scripts that start a service (start_dockerd.sh, start_slurm.sh).
# start_once NAME WHAT CHECK...: exit 0 at once when CHECK succeeds (the service answers); else demand
# root, take /run/tbexp-NAME.lock (one starter at a time: parallel test sessions start services too),
# and exit 0 if the starter that held it has started the service meanwhile. The lock stays held (fd 9)
# until the calling script ends; daemons it starts should get `9>&-` so they do not keep it.
start_once() {
  local name=$1 what=$2
  shift 2
  if "$@"; then
    exit 0
  fi
  if [ "$(id -u)" != 0 ]; then
    echo "start_$name.sh: $what is not answering and starting it needs root" >&2
    exit 1
  fi
  exec 9>"/run/tbexp-$name.lock"
  flock -w 120 9 || echo "start_$name.sh: another start has held the lock for 120 s; going on" >&2
  if "$@"; then
    exit 0
  fi
}
