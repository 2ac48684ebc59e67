#!/bin/bash
cd /app
python3 - <<'PY'
import csv
from collections import Counter
totals = Counter()
with open("sales.csv") as f:
    for row in csv.DictReader(f):
        totals[row["region"]] += int(row["amount"])
with open("totals.csv", "w") as f:
    f.write("region,total\n")
    for region in sorted(totals):
        f.write(f"{region},{totals[region]}\n")
PY
