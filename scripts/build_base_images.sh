#!/usr/bin/env bash
# scripts/build_base_images.sh [IMAGE...]
# Builds LOCAL STAND-INS of the base images published task Dockerfiles start FROM, under their published
# names, because no image registry can be reached here (nothing is pulled, ever). They are NOT the
# images Docker Hub serves: each is a Debian root made by debootstrap (the suite nearest the image, as
# the table in tbexp/sandboxes/debian_roots.py says) plus, for python images, pip and venv from Debian,
# with tmux, python3 and bash in every one; then `docker import`ed. The same roots serve bwrap without
# Docker (cached under $TBEXP_CACHE/environments/). docs/environments.md lists what differs.
# Default set: debian:bookworm-slim debian:trixie-slim python:3.11-slim-bookworm python:3.13-slim-bookworm
#              (a trixie root: bookworm has no python3.13) ubuntu:24.04 (trixie) ubuntu:22.04 (bookworm),
#              and python:3.11-slim, python:3.12-slim (trixie's 3.13), python:3.13-slim as tags of the same roots.
# Needs root, Debian's mirror and a running engine (scripts/start_dockerd.sh). Idempotent: an image that
# exists is left alone (remove it with `docker rmi NAME` to rebuild it).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
PYTHON=${PYTHON:-$(command -v python3)}
IMAGES=("$@")
if [ ${#IMAGES[@]} -eq 0 ]; then
  IMAGES=(debian:bookworm-slim debian:trixie-slim python:3.11-slim-bookworm python:3.13-slim-bookworm ubuntu:24.04 ubuntu:22.04
          python:3.11-slim python:3.12-slim python:3.13-slim)
fi
declare -A IMPORTED  # root -> the image already imported from it in this run: a second name is a tag
for IMAGE in "${IMAGES[@]}"; do
  if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    continue
  fi
  ROOT=$(cd "$REPO" && PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m tbexp.sandboxes.environments "$IMAGE" | tail -1)
  if [ -n "${IMPORTED[$ROOT]:-}" ]; then
    docker tag "${IMPORTED[$ROOT]}" "$IMAGE"
    echo "image ready: $IMAGE (a tag of ${IMPORTED[$ROOT]})" >&2
    continue
  fi
  echo "importing $ROOT as $IMAGE (a local stand-in, not the published image)..." >&2
  tar -C "$ROOT" --exclude=./.tbexp-complete --exclude=./.tbexp-env.json -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'WORKDIR /' \
    --change 'CMD ["bash"]' \
    --message "tbexp local stand-in for $IMAGE, from $ROOT" - "$IMAGE" >/dev/null
  IMPORTED[$ROOT]=$IMAGE
  echo "image ready: $IMAGE ($(docker image inspect "$IMAGE" --format '{{.Size}}' | numfmt --to=iec))" >&2
done
