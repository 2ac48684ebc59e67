#!/bin/bash
# The uv bootstrap of Terminal-Bench 2 test.sh files: offline, apt-get and curl fail,
# and tbexp's provisioned uv (read-only in $HOME/.local/bin) is what env finds.
apt-get update
apt-get install -y curl

curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh

source $HOME/.local/bin/env

# Run pytest tests
uvx -p 3.11 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --ctrf /logs/verifier/ctrf.json /tests/test_outputs.py -rA

if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
