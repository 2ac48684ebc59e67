#!/bin/bash
echo "scratch work" > /app/scratch.txt
wc -l < /app/words.txt > /app/count.txt
echo done > /logs/artifacts/report.txt
