#!/usr/bin/env bash
# scripts/lock.sh [--upgrade | --upgrade-package NAME ...]
# Writes requirements.lock: every package tbexp and its tests install, pinned with hashes, resolved from
# pyproject.toml's ranges for Python 3.12 on x86-64 Linux (CUDA torch). scripts/setup.sh installs exactly
# this file, so a fresh clone gets the versions CI tested. With no argument it keeps every pin that still
# satisfies pyproject.toml; --upgrade moves all of them to the newest releases within the ranges. Run the
# suite after (scripts/test.sh) and commit the lock with the change that needed it.
# scripts/test_newest.sh tries the newest releases past the ranges without touching this file.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${LOCK_OUT:-requirements.lock}
[ -x .venv/bin/uv ] || scripts/setup.sh  # uv comes with the dev tools
# A pip constraints file this machine sets (pip's config or PIP_CONSTRAINT) binds the install, so the
# resolution honours it too; otherwise pip would refuse the lock it is given.
constraints=()
for c in ${PIP_CONSTRAINT:-} $(python3 -m pip config list 2>/dev/null | sed -n "s/^global.constraint='\(.*\)'$/\1/p"); do
  [ -f "$c" ] && constraints+=(--constraint "$c")
done
.venv/bin/uv pip compile pyproject.toml --extra dev \
  --python-version 3.12 --python-platform x86_64-manylinux_2_28 \
  --generate-hashes --no-header --quiet "${constraints[@]}" "$@" -o "$out"
# The constraint file is this machine's, not the project's: keep its path out of the committed lock.
sed -i '/^    #   -c /d; s/^    # via -c .*$/    # via (a pip constraint)/' "$out"
echo "$out: $(grep -c '^[A-Za-z0-9]' "$out") packages" >&2
