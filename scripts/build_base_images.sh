#!/usr/bin/env bash
# scripts/build_base_images.sh [IMAGE...]
# Builds LOCAL STAND-INS of the base images published task Dockerfiles start FROM (or COPY --from), under their
# published names, because no image registry can be reached here (nothing is pulled, ever). They are NOT the
# images the registries serve: each is a Debian root made by debootstrap (the suite nearest the image, as the
# table in tbexp/sandboxes/debian_roots.py says) plus, for python images, pip and venv from Debian (linked into
# /usr/local/bin, where the python images keep them), for Terminal-Bench's base images their public Dockerfiles'
# additions (tmux, asciinema, curl, WORKDIR /app), with tmux, python3 and bash in every one; uv's image
# (ghcr.io/astral-sh/uv:VERSION) is /uv and /uvx from PyPI's uv wheel. Then `docker import`ed, with the root's own
# WORKDIR and ENV. The same roots serve bwrap without Docker (cached under $TBEXP_CACHE/environments/).
# docs/environments.md lists what differs.
# Default set: debian:bookworm-slim debian:trixie-slim python:3.11-slim-bookworm python:3.13-slim-bookworm
#              (a trixie root: bookworm has no python3.13) ubuntu:24.04 ubuntu:26.04 (trixie) ubuntu:22.04
#              (bookworm), python:3.11-slim, python:3.12-slim (trixie's 3.13), python:3.13-slim as tags of the
#              same roots, Terminal-Bench's python-3-13 and ubuntu-24-04 images, and uv's image at the version
#              Terminal-Bench's test scripts install.
# Needs root, Debian's mirror and a running engine (scripts/start_dockerd.sh). Idempotent: an image built from
# the current stand-in root is left alone; one built from an older definition (another root, or an import
# without the tbexp.stand_in label) is imported again under the same name (the old image is left untagged,
# never removed: other containers may use it).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
PYTHON=${PYTHON:-$(command -v python3)}
IMAGES=("$@")
if [ ${#IMAGES[@]} -eq 0 ]; then
  IMAGES=(debian:bookworm-slim debian:trixie-slim python:3.11-slim-bookworm python:3.13-slim-bookworm
          ubuntu:24.04 ubuntu:26.04 ubuntu:22.04 python:3.11-slim python:3.12-slim python:3.13-slim
          ghcr.io/laude-institute/t-bench/python-3-13:20250620 ghcr.io/laude-institute/t-bench/ubuntu-24-04:20250624
          ghcr.io/laude-institute/t-bench/ubuntu-24-04:latest ghcr.io/astral-sh/uv:0.9.5)
fi
declare -A IMPORTED  # stand-in root name -> an image of it already here: a second name is a tag
stand_in() { (cd "$REPO" && PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m tbexp.sandboxes.environments "$@" | tail -1); }
for IMAGE in "${IMAGES[@]}"; do
  NAME=$(stand_in --name "$IMAGE")
  if [ "$(docker image inspect "$IMAGE" --format '{{index .Config.Labels "tbexp.stand_in"}}' 2>/dev/null)" = "$NAME" ]; then
    IMPORTED[$NAME]=$IMAGE
    continue  # imported from the current definition's root already
  fi
  if [ -n "${IMPORTED[$NAME]:-}" ]; then
    docker tag "${IMPORTED[$NAME]}" "$IMAGE"
    echo "image ready: $IMAGE (a tag of ${IMPORTED[$NAME]})" >&2
    continue
  fi
  ROOT=$(stand_in "$IMAGE")
  # The root's own config (.tbexp-env.json: WORKDIR, ENV), as `docker import --change` lines.
  mapfile -t CHANGES < <("$PYTHON" - "$ROOT" <<'EOF'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
saved = root / ".tbexp-env.json"
config = json.loads(saved.read_text()) if saved.is_file() else {"workdir": "/", "env": {}}
env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", **config["env"]}
changes = [f"ENV {key}={json.dumps(value)}" for key, value in env.items()]
changes += [f"WORKDIR {config['workdir'] or '/'}", f"LABEL tbexp.stand_in={root.name}"]
changes += ['CMD ["bash"]'] if (root / "bin/bash").exists() else []
for change in changes:
    print("--change"); print(change)
EOF
)
  echo "importing $ROOT as $IMAGE (a local stand-in, not the published image)..." >&2
  tar -C "$ROOT" --exclude=./.tbexp-complete --exclude=./.tbexp-env.json --exclude=./.tbexp-tool-image -c . | docker import \
    "${CHANGES[@]}" --message "tbexp local stand-in for $IMAGE, from $ROOT" - "$IMAGE" >/dev/null
  IMPORTED[$NAME]=$IMAGE
  echo "image ready: $IMAGE ($(docker image inspect "$IMAGE" --format '{{.Size}}' | numfmt --to=iec))" >&2
done
