#!/usr/bin/env bash
# scripts/test_newest.sh [pytest arguments...]
# The suite against the newest releases of every dependency, pyproject.toml's upper bounds lifted: not what a
# user gets (scripts/setup.sh installs requirements.lock), but what they would get once the bounds move. It
# resolves them as scripts/lock.sh does into .venv-newest/requirements.newest, installs them and tbexp into
# .venv-newest (the project's .venv is left alone), prints the packages that moved past the lock, then runs the
# style checks and pytest there. When it passes, raise the bounds in pyproject.toml, `scripts/lock.sh --upgrade`,
# and commit both. Takes as long as scripts/test.sh plus an install (a few minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh  # the sandbox root, and uv (one of the dev tools) in .venv
venv=.venv-newest
[ -x $venv/bin/python ] || "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" -m venv $venv
# pyproject's requirements with every upper bound (`<X`, `<=X`, `~=X`, `==X`) dropped.
.venv/bin/python - >$venv/requirements.in <<'EOF'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in project["dependencies"] + project["optional-dependencies"]["dev"]:
    name, spec = re.match(r"([A-Za-z0-9_.\-\[\]]+)(.*)", req).groups()
    lower = [s.strip() for s in spec.split(",") if s.strip().startswith((">=", ">"))]
    print(name + ",".join(lower))
EOF
constraints=()
for c in ${PIP_CONSTRAINT:-} $(python3 -m pip config list 2>/dev/null | sed -n "s/^global.constraint='\(.*\)'$/\1/p"); do
  [ -f "$c" ] && constraints+=(--constraint "$c")  # what pip here would refuse anyway (see scripts/lock.sh)
done
.venv/bin/uv pip compile $venv/requirements.in --upgrade --python-version 3.12 \
  --python-platform x86_64-manylinux_2_28 --no-header --no-annotate --quiet "${constraints[@]}" \
  -o $venv/requirements.newest
echo "newest releases past requirements.lock:" >&2
.venv/bin/python - <<'EOF' >&2
import re
pins = lambda path: dict(re.findall(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)", open(path).read(), re.M))
lock, newest = pins("requirements.lock"), pins(".venv-newest/requirements.newest")
moved = [f"  {n} {lock[n]} -> {v}" for n, v in sorted(newest.items()) if n in lock and lock[n] != v]
print("\n".join(moved) or "  none")
EOF
$venv/bin/python -m pip install -q -r $venv/requirements.newest >$venv/pip.log 2>&1 || { tail -20 $venv/pip.log >&2; exit 1; }
$venv/bin/python -m pip install -q --no-deps -e . >>$venv/pip.log 2>&1
$venv/bin/ruff format --check --quiet . && $venv/bin/ruff check --quiet .
exec $venv/bin/python -m pytest "$@"
