#!/usr/bin/env bash
# scripts/setup_tinker_server.sh
# SkyRL's Tinker-API server (an open engine that speaks the Tinker REST protocol) in its own Python 3.12
# environment, $TBEXP_CACHE/skyrl-venv (default cache: ~/.cache/tbexp), idempotent with a stamp: JAX on CPU,
# about 6.6 GB and three minutes the first time, seconds after. It is kept apart from .venv because SkyRL pins
# its own tinker SDK (0.25) and JAX, which must not meet tbexp's locked versions (tinker 0.38, torch).
# The last line printed is the environment's python. scripts/start_tinker_server.sh starts the server with it.
set -euo pipefail
SKYRL_SPEC=${SKYRL_SPEC:-"skyrl[tinker,jax]==0.4.0"}
CACHE=${TBEXP_CACHE:-$HOME/.cache/tbexp}
VENV=$CACHE/skyrl-venv
stamp=$VENV/.tbexp-skyrl-installed
want="$SKYRL_SPEC aiohttp"

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  mkdir -p "$CACHE"
  free_gib=$(df -Pk "$CACHE" | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$free_gib" -lt 9 ]; then
    echo "setup_tinker_server.sh: SkyRL with JAX needs about 9 GiB free under $CACHE; $free_gib GiB are free" >&2
    exit 1
  fi
  cd "$(dirname "$0")/.."
  UV=$(command -v uv || echo .venv/bin/uv)
  if [ ! -x "$VENV/bin/python" ]; then
    PY=""
    for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
      if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
        PY=$(command -v "$c"); break
      fi
    done
    [ -n "$PY" ] || { echo "setup_tinker_server.sh: Python 3.12 not found" >&2; exit 1; }
    "$PY" -m venv "$VENV"
  fi
  echo "installing $SKYRL_SPEC into $VENV (about 6.6 GB, a few minutes the first time) ..." >&2
  if [ -x "$UV" ]; then
    # uv's download cache beside the environment, not in ~/.cache: the wheels are about 2 GB.
    export UV_CACHE_DIR=${UV_CACHE_DIR:-$CACHE/uv-cache}
    install=("$UV" pip install -q --python "$VENV/bin/python")
  else
    install=("$VENV/bin/python" -m pip install -q)
  fi
  "${install[@]}" "$SKYRL_SPEC" aiohttp >"$VENV/install.log" 2>&1 \
    || { tail -30 "$VENV/install.log" >&2; echo "setup_tinker_server.sh: the install failed (log: $VENV/install.log)" >&2; exit 1; }
  echo "$want" >"$stamp"
fi
echo "$VENV/bin/python"
