"""json-sum: sum one numeric field over a JSON array of records (one jq).

Every record also carries other numeric fields drawn from the same pool, so
the field name in the instruction decides the answer.
"""

from __future__ import annotations

import json
import random

from tbexp.tasks.builtin.family import SINGLE_INTEGER_CHECKS, Combo, Family, TaskSpec

FILES = ("orders.json", "payments.json", "invoices.json", "sales.json", "refunds.json", "transfers.json")
FIELDS = ("amount", "price", "qty", "weight", "score", "points", "cost", "hours")
OUTPUTS = ("total.txt", "sum.txt", "result.txt", "answer.txt", "out.txt", "value.txt")
ITEM_NAMES = ("apple", "bolt", "cable", "desk", "lamp", "nail", "pen", "rope", "tape", "wire")


def build(combo: Combo, rng: random.Random) -> TaskSpec:
    file, field, out = combo["file"], combo["field"], combo["out"]
    others = rng.sample([f for f in FIELDS if f != field], 2)
    records = []
    for record_id in range(1, rng.randint(6, 14) + 1):
        record = {"id": record_id, "name": rng.choice(ITEM_NAMES)}
        for name in sorted([field, *others]):  # the asked field is not always in the same place
            record[name] = rng.randint(1, 500)
        records.append(record)
    return TaskSpec(
        instruction=(
            f"/app/data/{file} holds a JSON array of records. "
            f"Write the sum of the `{field}` field over all records to /app/{out}."
        ),
        app_files={f"data/{file}": json.dumps(records, indent=1) + "\n"},
        solution=[f"jq '[.[].{field}] | add' /app/data/{file} > /app/{out}"],
        expected={"out": f"/app/{out}", "total": sum(r[field] for r in records)},
    )


CHECKS = SINGLE_INTEGER_CHECKS

FAMILY = Family(
    name="json-sum",
    description="Sum one field over the records of a JSON file.",
    category="data-processing",
    difficulty="easy",
    discovery=False,
    pools={"file": FILES, "field": FIELDS, "out": OUTPUTS},
    build=build,
    checks=CHECKS,
)
