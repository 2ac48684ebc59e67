#!/bin/bash
# Not one command a line (a loop): the oracle runs this file as a script, as Harbor does.
cd /app/logs
for f in *.log; do
  echo "$f $(grep -c ERROR "$f")"
done > /app/errors.txt
