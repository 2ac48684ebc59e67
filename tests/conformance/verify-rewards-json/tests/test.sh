#!/bin/bash
# No pytest: the script checks the output itself and writes named rewards.
mkdir -p /logs/verifier
exists=0; count=0; values=0
if [ -f /app/squares.txt ]; then exists=1; fi
if [ "$exists" = 1 ] && [ "$(wc -w < /app/squares.txt)" = 5 ]; then count=1; fi
if [ "$exists" = 1 ] && [ "$(tr -s ' \n' ' ' < /app/squares.txt | sed 's/ $//')" = "1 4 9 16 25" ]; then values=1; fi
reward=$(python3 -c "print(($exists + $count + $values) / 3)")
cat > /logs/verifier/reward.json <<JSON
{"reward": $reward, "exists": $exists, "count": $count, "values": $values}
JSON
