"""buried-json: find the one JSON file somewhere under a directory, then sum a field of it.

Discovery: the instruction names only the top directory. The JSON file sits
two levels down (`<year>/<part>/<name>.json`, random per instance) among
decoy CSV, text and log files. The oracle lists JSON files with `find`, then
runs jq on `"$(find ...)"` so its last command stands on its own.
"""

from __future__ import annotations

import json
import random

from tbexp.tasks.builtin.family import SINGLE_INTEGER_CHECKS, Combo, Family, TaskSpec

ROOTS = ("incoming", "inbox", "drop", "uploads", "exports", "feeds")
FIELDS = ("amount", "price", "qty", "score", "points", "cost")
OUTPUTS = ("total.txt", "sum.txt", "result.txt", "answer.txt", "out.txt", "value.txt")
YEARS = ("2022", "2023", "2024")
PARTS = ("q1", "q2", "q3", "q4", "jan", "feb", "mar")
STEMS = ("raw", "batch", "records", "export", "part", "chunk")
DECOYS = ("notes.txt", "index.csv", "run.log", "readme.txt", "old.csv", "errors.log")


def build(combo: Combo, rng: random.Random) -> TaskSpec:
    root, field, out = combo["root"], combo["field"], combo["out"]
    folders = [f"{year}/{part}" for year in YEARS for part in PARTS]
    json_folder, *decoy_folders = rng.sample(folders, 4)
    json_path = f"{root}/{json_folder}/{rng.choice(STEMS)}.json"
    other = rng.choice([f for f in FIELDS if f != field])
    records = [{"id": i, field: rng.randint(1, 400), other: rng.randint(1, 400)} for i in range(rng.randint(5, 12))]
    files = {json_path: json.dumps(records, indent=1) + "\n"}
    for folder in decoy_folders:
        for decoy in rng.sample(DECOYS, 2):
            files[f"{root}/{folder}/{decoy}"] = f"{field},{other}\n{rng.randint(1, 400)},{rng.randint(1, 400)}\n"
    return TaskSpec(
        instruction=(
            f"Somewhere under /app/{root} there is exactly one JSON file, an array of records. "
            f"Write the sum of its `{field}` field to /app/{out}."
        ),
        app_files=files,
        solution=[
            f"find /app/{root} -name '*.json'",
            f"jq '[.[].{field}] | add' \"$(find /app/{root} -name '*.json')\" > /app/{out}",
        ],
        expected={"out": f"/app/{out}", "total": sum(r[field] for r in records)},
    )


CHECKS = SINGLE_INTEGER_CHECKS

FAMILY = Family(
    name="buried-json",
    description="Find the one JSON file under a directory and sum a field of it.",
    category="file-search",
    difficulty="medium",
    discovery=True,
    pools={"root": ROOTS, "field": FIELDS, "out": OUTPUTS},
    build=build,
    checks=CHECKS,
)
