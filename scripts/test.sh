#!/usr/bin/env bash
# scripts/test.sh [pytest arguments...]
# Sets everything up (scripts/setup.sh), checks the style (ruff format, ruff check), then runs the test
# suite. Tests that need a service (the Docker engine) start it themselves, or are skipped with the reason
# in the summary.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# The house style, checked first (under a second): line length 120, imports sorted, no unused names.
if ! .venv/bin/ruff format --check --quiet . || ! .venv/bin/ruff check --quiet .; then
  echo "tbexp: the style check failed; .venv/bin/ruff format . && .venv/bin/ruff check --fix . mends most of it" >&2
  exit 1
fi
exec .venv/bin/python -m pytest "$@"
