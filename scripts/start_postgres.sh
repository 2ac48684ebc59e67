#!/usr/bin/env bash
# scripts/start_postgres.sh [DATA_DIR] [PORT]
# A throwaway PostgreSQL server for an Optuna study (the sweep tests start one this way): Debian's
# postgresql, a fresh cluster in DATA_DIR (default: a new /tmp/tbexp-postgres.XXXX), listening on
# 127.0.0.1:PORT only (default 5433), trust authentication, a database `tbexp`. The last line printed
# is the storage URL for hydra.sweeper.storage; stop it with the command printed before it.
# Installs postgresql from Debian when missing (needs root). As root the server runs as the
# `postgres` user (PostgreSQL refuses to run as root), so DATA_DIR must not sit under a directory
# only root can enter (pytest's tmp_path does): the default is fine.
set -euo pipefail
PORT=${2:-5433}

if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ]; then
    echo "start_postgres.sh: PostgreSQL is not installed and installing it needs root (apt-get install postgresql)" >&2
    exit 1
  fi
  echo "installing postgresql ..." >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null
fi
BIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)

DATA=${1:-$(mktemp -d /tmp/tbexp-postgres.XXXX)}
mkdir -p "$DATA"
as_server_user=()
if [ "$(id -u)" = 0 ]; then
  chown postgres:postgres "$DATA"
  chmod 700 "$DATA"
  as_server_user=(runuser -u postgres --)
fi

if [ ! -f "$DATA/PG_VERSION" ]; then
  "${as_server_user[@]}" "$BIN/initdb" -D "$DATA" -A trust -U postgres --no-sync >"$DATA.initdb.log" 2>&1 \
    || { cat "$DATA.initdb.log" >&2; echo "start_postgres.sh: initdb failed" >&2; exit 1; }
fi
# The socket goes into the data directory: /var/run/postgresql may not exist or be writable.
"${as_server_user[@]}" "$BIN/pg_ctl" -D "$DATA" -l "$DATA/server.log" -w -t 60 \
  -o "-c listen_addresses=127.0.0.1 -p $PORT -k $DATA -c fsync=off" start >/dev/null \
  || { tail -20 "$DATA/server.log" >&2; echo "start_postgres.sh: the server did not start" >&2; exit 1; }
if ! "$BIN/psql" -h 127.0.0.1 -p "$PORT" -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname='tbexp'" | grep -q 1; then
  "$BIN/createdb" -h 127.0.0.1 -p "$PORT" -U postgres tbexp
fi
echo "stop: ${as_server_user[*]} $BIN/pg_ctl -D $DATA -m fast stop"
echo "postgresql://postgres@127.0.0.1:$PORT/tbexp"
