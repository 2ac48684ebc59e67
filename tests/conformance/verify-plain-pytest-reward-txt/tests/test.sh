#!/bin/bash
# The shape of most Harbor-format collections and of every Terminal-Bench 1 task Harbor's mapper converts:
# plain pytest, the reward from its exit status.
cd /app
pytest /tests/test_outputs.py -rA
if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
