#!/bin/sh
# Starts the key-value daemon, then runs the container's command (an image's usual entrypoint script).
python3 /usr/local/lib/kv_server.py > /tmp/kv_server.log 2>&1 &
exec "$@"
