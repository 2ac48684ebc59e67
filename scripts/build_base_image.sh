#!/usr/bin/env bash
# scripts/build_base_image.sh [TAG]
# Builds the Docker base image the task Dockerfiles start FROM (sandbox.base_image, default
# tbexp-base:bookworm) from the same Debian root bwrap uses (scripts/build_rootfs.sh), by
# `docker import`: no registry is needed, nothing is pulled. Needs a running engine
# (scripts/start_dockerd.sh). Idempotent: does nothing when TAG exists.
set -euo pipefail
TAG=${1:-tbexp-base:bookworm}
ROOTFS=${TBEXP_CACHE:-$HOME/.cache/tbexp}/rootfs
HERE=$(cd "$(dirname "$0")" && pwd)
if docker image inspect "$TAG" >/dev/null 2>&1; then
  exit 0
fi
bash "$HERE/build_rootfs.sh" "$ROOTFS"
echo "importing $ROOTFS as $TAG..." >&2
tar -C "$ROOTFS" --exclude=./.tbexp-complete -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'WORKDIR /' \
  --change 'CMD ["bash"]' \
  --message "tbexp base image from $ROOTFS" - "$TAG" >/dev/null
echo "image ready: $TAG ($(docker image inspect "$TAG" --format '{{.Size}}' | numfmt --to=iec))" >&2
