#!/usr/bin/env bash
# Wheels for a GPU machine that reaches no package registry (docs/gpu-sampling.md#on-an-h100-80-gb-issue-43-2026-12-08):
#   scripts/gpu_wheels.sh            # here, from any directory of the checkout: fills .whl/ (git-ignored locally)
# then, there, before the benchmark:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:.
# The versions are requirements.lock's; the packages are those tbexp's local backend imports (tinker, transformers,
# peft) and their needs that the machine's image lacks or holds too old. torch, triton, numpy and the CUDA libraries
# stay the image's. About 30 MB.
set -euo pipefail
cd "$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
PACKAGES="tinker transformers peft huggingface-hub hf-xet httpx2 httpcore2 truststore idna click tokenizers kernels
tomlkit pydantic pydantic-core annotated-types typing-inspection typing-extensions distro sniffio orjson pyqwest
opentelemetry-api zstandard h2 hpack hyperframe"
pins=()
for p in $PACKAGES; do
  pin=$(grep -i -m1 "^$p==" requirements.lock | cut -d' ' -f1)
  [ -n "$pin" ] || { echo "requirements.lock has no $p" >&2; exit 1; }
  pins+=("$pin")
done
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}"
