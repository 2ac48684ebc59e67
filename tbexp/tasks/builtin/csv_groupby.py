"""csv-groupby: per-group totals of a CSV column (one awk | sort).

The CSV has three columns: an `id`, a grouping column and a numeric column,
in one of a few orders (the `layout` pool). The instruction quotes the header,
so the column numbers for awk can be read off it.
"""

from __future__ import annotations

import random

from tbexp.tasks.builtin.family import Combo, Family, TaskSpec

FILES = ("sales.csv", "inventory.csv", "expenses.csv", "shipments.csv", "budget.csv", "visits.csv")
KEYS = {  # grouping column -> the values it takes
    "region": ("north", "south", "east", "west"),
    "team": ("red", "blue", "green", "gold"),
    "store": ("downtown", "airport", "mall", "harbor"),
    "city": ("oslo", "lima", "pune", "kyiv"),
    "dept": ("hr", "ops", "sales", "legal"),
    "country": ("fr", "de", "jp", "br"),
}
VALUES = ("amount", "units", "hours", "count", "revenue", "cost")
LAYOUTS = ("id,key,value", "key,id,value", "key,value,id")
OUTPUTS = ("totals.csv", "summary.csv", "grouped.csv", "report.csv", "sums.csv", "result.csv")


def build(combo: Combo, rng: random.Random) -> TaskSpec:
    file, key, value, out = combo["file"], combo["key"], combo["value"], combo["out"]
    roles = combo["layout"].split(",")
    names = {"id": "id", "key": key, "value": value}
    header = ",".join(names[role] for role in roles)
    totals: dict[str, int] = {}
    rows = []
    for row_id in range(101, 101 + rng.randint(8, 16)):
        group, number = rng.choice(KEYS[key]), rng.randint(1, 300)
        totals[group] = totals.get(group, 0) + number
        cells = {"id": str(row_id), "key": group, "value": str(number)}
        rows.append(",".join(cells[role] for role in roles))
    key_col, value_col = roles.index("key") + 1, roles.index("value") + 1
    awk = f"awk -F, 'NR>1 {{t[${key_col}]+=${value_col}}} END {{for (k in t) print k \",\" t[k]}}'"
    return TaskSpec(
        instruction=(
            f"/app/{file} is a CSV file with the header `{header}`. For each {key}, total the {value} column; "
            f"write one line `{key},total` per {key}, sorted by {key}, with no header, to /app/{out}."
        ),
        app_files={file: "\n".join([header, *rows]) + "\n"},
        solution=[f"{awk} /app/{file} | sort > /app/{out}"],
        expected={"out": f"/app/{out}", "totals": dict(sorted(totals.items()))},
    )


CHECKS = """
from pathlib import Path

EXPECTED = __EXPECTED__
OUT = Path(EXPECTED["out"])


def _rows():
    return [line.split(",") for line in OUT.read_text().splitlines() if line.strip()]


def test_output_file_exists():
    assert OUT.is_file(), f"{OUT} was not written"


def test_one_line_per_group():
    assert sorted(row[0].strip() for row in _rows()) == sorted(EXPECTED["totals"])


def test_totals_are_correct():
    assert {row[0].strip(): int(row[1]) for row in _rows()} == EXPECTED["totals"]


def test_lines_are_sorted():
    keys = [row[0].strip() for row in _rows()]
    assert keys and keys == sorted(keys)
"""

FAMILY = Family(
    name="csv-groupby",
    description="Total a CSV column per group.",
    category="data-processing",
    difficulty="medium",
    discovery=False,
    pools={"file": FILES, "key": tuple(KEYS), "value": VALUES, "layout": LAYOUTS, "out": OUTPUTS},
    build=build,
    checks=CHECKS,
)
