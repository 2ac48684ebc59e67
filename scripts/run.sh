#!/usr/bin/env bash
# scripts/run.sh [hydra overrides...]
# Sets everything up (scripts/setup.sh), then runs `python -m tbexp` in .venv with the given overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m tbexp "$@"
