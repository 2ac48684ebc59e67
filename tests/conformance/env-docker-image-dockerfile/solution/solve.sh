#!/bin/bash
awk -F, 'NR > 1 {s += $2} END {print s}' /app/prices.csv > /app/total.txt
