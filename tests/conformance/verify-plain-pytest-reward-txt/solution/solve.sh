#!/bin/bash
awk -F'\t' '$2 < 100 {print $1}' /app/inventory.tsv | sort > /app/low_stock.txt
