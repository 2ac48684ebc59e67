#!/usr/bin/env bash
# scripts/setup.sh
# Everything tbexp needs on a fresh Debian machine, idempotent: system packages (bubblewrap,
# debootstrap), a Python 3.12 environment in .venv with the locked versions (requirements.lock) and
# tbexp installed, and the sandbox root
# file system. scripts/run.sh and scripts/test.sh call it first; a second call takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v bwrap >/dev/null || need_apt+=(bubblewrap)
command -v debootstrap >/dev/null || need_apt+=(debootstrap)
command -v prlimit >/dev/null || need_apt+=(util-linux)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "tbexp setup: please install ${need_apt[*]} (apt-get install ${need_apt[*]}) or run as root" >&2
    exit 1
  fi
  echo "installing ${need_apt[*]} ..." >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

find_python() {
  for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      command -v "$candidate"; return 0
    fi
  done
  return 1
}

if [ ! -x .venv/bin/python ]; then
  PY=$(find_python) || { echo "tbexp setup: Python 3.12 not found (tried python3.12 and pyenv's 3.12.x); install it first" >&2; exit 1; }
  echo "creating .venv with $PY ..." >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.tbexp-installed
want=$(cat pyproject.toml requirements.lock | sha256sum | cut -c1-16)
if [ "$(cat $stamp 2>/dev/null)" != "$want" ]; then
  # torch with its CUDA libraries makes .venv about 6.5 GB, and pip unpacks each wheel beside it first: say so
  # before minutes of downloading rather than after pip runs out of space half-way.
  free_gib=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$free_gib" -lt 9 ]; then
    echo "tbexp setup: installing into .venv needs about 9 GiB free on $(df -P . | awk 'NR==2 {print $6}'); $free_gib GiB are free" >&2
    exit 1
  fi
  echo "installing tbexp and its dependencies into .venv (torch is large: a few minutes the first time) ..." >&2
  # Exactly the versions in requirements.lock (hashes checked), then tbexp itself with no resolution of its own:
  # a fresh clone gets what CI tested. `pip check` then holds the lock against pyproject.toml's ranges.
  if ! { .venv/bin/python -m pip install -q --require-hashes -r requirements.lock \
         && .venv/bin/python -m pip install -q --no-deps -e . ; } >.venv/pip.log 2>&1 \
     || ! .venv/bin/python -c 'import tbexp, hydra, torch, harbor'; then
    grep -v "^WARNING: Location" .venv/pip.log | tail -30 >&2
    if grep -q "No space left on device" .venv/pip.log; then
      echo "tbexp setup: the disk filled up during the install ($(df -Ph . | awk 'NR==2 {print $4}') free now); free space and run again" >&2
    fi
    echo "tbexp setup: installing into .venv failed (full log: .venv/pip.log)" >&2
    exit 1
  fi
  if ! .venv/bin/python -m pip check >.venv/pip-check.log 2>&1; then
    cat .venv/pip-check.log >&2
    echo "tbexp setup: requirements.lock does not satisfy pyproject.toml; scripts/lock.sh refreshes it" >&2
    exit 1
  fi
  echo "$want" > $stamp
fi

scripts/build_rootfs.sh
