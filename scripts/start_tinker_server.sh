#!/usr/bin/env bash
# scripts/start_tinker_server.sh [MODEL_DIR] [PORT] [STATE_DIR]
# A local Tinker-API server for backend=tinker: SkyRL's (scripts/setup_tinker_server.sh installs it, here at once if
# missing), JAX on CPU, serving MODEL_DIR (default: the shipped tiny model, tbexp/models/tiny) on 127.0.0.1:PORT
# (default: a free port), its database, checkpoints and log in STATE_DIR (default: a new /tmp/tbexp-tinker.XXXX).
# Waits until the engine answers (about 20 s on 2 cores), then prints the stop command and, last, the base URL:
#   python -m tbexp backend=tinker backend.base_url=<URL> model.path=<MODEL_DIR>   (any TINKER_API_KEY will do)
# SkyRL's JAX backend: LoRA up to rank 32, cross_entropy / importance_sampling / ppo / cispo (no gspo).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=$(realpath "${1:-tbexp/models/tiny}")
PORT=${2:-$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
STATE=${3:-$(mktemp -d /tmp/tbexp-tinker.XXXX)}
WAIT_S=${TINKER_SERVER_WAIT_S:-180}
[ -f "$MODEL/config.json" ] || { echo "start_tinker_server.sh: $MODEL holds no model (config.json)" >&2; exit 1; }
PY=$(scripts/setup_tinker_server.sh | tail -1)
mkdir -p "$STATE/checkpoints"

# JAX on CPU; no network: the model is a local directory and Hugging Face must not be asked about it.
JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 setsid "$PY" scripts/skyrl_tinker_api.py \
  --host 127.0.0.1 --port "$PORT" --base-model "$MODEL" --backend jax \
  --database-url "sqlite:///$STATE/tinker.db" --checkpoints-base "$STATE/checkpoints" \
  --backend-config "${TINKER_SERVER_BACKEND_CONFIG:-{\"max_lora_adapters\": 16, \"max_lora_rank\": 32}}" \
  >"$STATE/server.log" 2>&1 </dev/null &
PID=$!
echo "$PID" >"$STATE/server.pid"
URL="http://127.0.0.1:$PORT"
STOP="kill -TERM -- -$PID"  # setsid: the API process leads a group that holds its engine too
# Ready when the API answers and the engine has started its loop (the API answers seconds before the engine does).
for _ in $(seq "$WAIT_S"); do
  if ! kill -0 "$PID" 2>/dev/null; then
    tail -30 "$STATE/server.log" >&2; echo "start_tinker_server.sh: the server exited (log: $STATE/server.log)" >&2; exit 1
  fi
  if curl -sf "$URL/api/v1/healthz" >/dev/null 2>&1 && grep -q "Starting background engine" "$STATE/server.log"; then
    echo "stop: $STOP"
    echo "$URL"
    exit 0
  fi
  sleep 1
done
$STOP 2>/dev/null || true
tail -30 "$STATE/server.log" >&2
echo "start_tinker_server.sh: not ready after $WAIT_S s (log: $STATE/server.log)" >&2
exit 1
