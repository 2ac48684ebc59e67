#!/usr/bin/env bash
# scripts/test.sh [pytest arguments...]
# Sets everything up (scripts/setup.sh), then runs the test suite. Tests that need a service
# (the Docker engine) start it themselves, or are skipped with the reason in the summary.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
