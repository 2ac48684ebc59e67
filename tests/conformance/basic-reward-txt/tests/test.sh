#!/bin/bash
# No pytest: the checks are shell tests, and the only result is the reward in reward.txt.
mkdir -p /logs/verifier
reward=0
if [ "$(cat /app/release/VERSION 2>/dev/null)" = "2.4.1" ] && [ -x /app/release/run.sh ] \
    && [ "$(/app/release/run.sh 2>/dev/null)" = "ok" ]; then
    reward=1
fi
echo "reward: $reward"
echo "$reward" > /logs/verifier/reward.txt
