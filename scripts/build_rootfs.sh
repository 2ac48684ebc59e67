#!/usr/bin/env bash
# scripts/build_rootfs.sh [DIR]
# Builds the Debian root file system the sandboxes run on (bwrap binds it read-only as /;
# scripts/build_base_image.sh imports the same tree as the Docker base image).
# Idempotent: does nothing when DIR already holds a finished root. Needs root and Debian's mirror.
set -euo pipefail
DIR=${1:-${TBEXP_CACHE:-$HOME/.cache/tbexp}/rootfs}
PACKAGES=python3,python3-pytest,tmux,ca-certificates,git,sqlite3,jq,procps,less,file
if [ -f "$DIR/.tbexp-complete" ]; then
  exit 0
fi
command -v debootstrap >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }
TMP="$DIR.partial"
rm -rf "$TMP"
mkdir -p "$(dirname "$DIR")"
echo "building the sandbox root file system in $DIR (debootstrap, about a minute)..." >&2
debootstrap --variant=minbase --include=$PACKAGES bookworm "$TMP" >"$TMP.log" 2>&1 || { tail -20 "$TMP.log" >&2; exit 1; }
# Mount points bwrap binds over; a read-only root cannot grow them later.
mkdir -p "$TMP/app" "$TMP/logs" "$TMP/tests" "$TMP/solution"
rm -rf "$TMP/var/cache/apt/archives"/*.deb "$TMP/var/lib/apt/lists"/*
touch "$TMP/.tbexp-complete"
rm -rf "$DIR"
mv "$TMP" "$DIR"
rm -f "$TMP.log"
echo "root file system ready: $DIR ($(du -sh "$DIR" | cut -f1))" >&2
